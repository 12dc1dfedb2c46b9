// How the low-latency kernels split work among warps: numbered across blocks first (warp w of block b
// is global warp w * grid + b), so that consecutive work items land on different SMs; teams of warps
// for items that are rows to cast and send.
#pragma once

#include <climits>

#include "common/common.cuh"
#include "low_latency/api.cuh"

namespace moe_ep::kernels::ll {

namespace {  // local to each translation unit (csrc/README.md)

constexpr int kWarps = kBlockThreads / 32;

// Warps numbered across blocks first; `workers` warps per item when there are fewer items than warps.
struct WarpSchedule {
    int warp, num_warps, lane;
    MOE_EP_DEVICE static WarpSchedule make() {
        return {static_cast<int>(threadIdx.x / 32 * gridDim.x + blockIdx.x), static_cast<int>(kWarps * gridDim.x),
                static_cast<int>(threadIdx.x % 32)};
    }
    MOE_EP_DEVICE int workers_per_item(int num_items) const { return max(1, num_warps / max(num_items, 1)); }
};

// Teams of `size` consecutive warps of one block (1, 2, 4 or 8) among its warps [first_warp, kWarps),
// numbered across blocks first like the warps: at decode sizes one item per team, so that a row is
// cast by several warps at once instead of one warp's chain of loads. Named barrier 1 + index (0 is
// __syncthreads) joins a team's warps.
struct TeamSchedule {
    int team, num_teams, size, member, first_warp;
    static constexpr int kMaxSize = 8;
    // The largest team size that still gives every one of `num_items` items its own team. Warps outside
    // every team (before first_warp, or left over) get team INT_MAX: no item.
    MOE_EP_DEVICE static TeamSchedule make(int num_items, int first_warp) {
        const int grid = static_cast<int>(gridDim.x), avail = kWarps - first_warp;
        int size = kMaxSize;
        while (size > 1 && (size > avail || num_items > avail / size * grid)) size /= 2;
        const int rel = static_cast<int>(threadIdx.x / 32) - first_warp, per_block = avail / size;
        const bool in_team = rel >= 0 && rel / size < per_block;
        return {in_team ? rel / size * grid + static_cast<int>(blockIdx.x) : INT_MAX, per_block * grid, size,
                in_team ? rel % size : 0, first_warp};
    }
    // Teams of the largest size the grid holds when the teams start at warp `first_warp`.
    MOE_EP_DEVICE static int full_size_teams(int first_warp) {
        return (kWarps - first_warp) / kMaxSize * static_cast<int>(gridDim.x);
    }
    MOE_EP_DEVICE void sync() const {
        if (size > 1)
            asm volatile("bar.sync %0, %1;" ::"r"(1 + (static_cast<int>(threadIdx.x / 32) - first_warp) / size),
                         "r"(32 * size) : "memory");
    }
};

// The units [begin, end) of a row of `n` units that member `member` of `members` handles: whole
// 32-unit warp steps, so that lanes stay coalesced and FP8 scale words are never split.
MOE_EP_DEVICE void warp_share(int n, int member, int members, int& begin, int& end) {
    const int steps = (n + 31) / 32;
    begin = min(n, member * steps / members * 32);
    end = min(n, (member + 1) * steps / members * 32);
}

}  // namespace

}  // namespace moe_ep::kernels::ll
