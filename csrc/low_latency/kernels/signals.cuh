// Signals of the low-latency protocol (low_latency/api.cuh): 64-bit words carrying an operation's tag
// and a value, stored with release semantics into mapped peers, or put through NVSHMEM to the others.
#pragma once

#include "common/common.cuh"
#include "low_latency/api.cuh"

#ifndef MOE_EP_LL_P2P_ONLY
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace moe_ep::kernels::ll {

namespace {  // local to each translation unit (csrc/README.md)

MOE_EP_DEVICE uint64_t make_signal(uint32_t tag, uint32_t value) {
    return (static_cast<uint64_t>(tag) << 32) | value;
}

// ------------------------------------------------------------------ waiting for peers (elastic mode too)

// Whether this rank's operations leave `peer` out (elastic mode, api.cuh): it is masked, or this rank
// is. Never without elastic mode.
MOE_EP_DEVICE bool left_out(const Context& c, int peer) {
    return c.mask != nullptr && (ld_volatile(c.mask + peer) != 0 || ld_volatile(c.mask + c.comm.rank) != 0);
}

// The ranks this rank leaves out, read once by a block into shared memory (bit r of word r / 32), so that
// all of its warps decide alike while a timeout elsewhere changes the mask (warps of a team meet at a
// barrier). Fills and synchronizes the block; all zero without elastic mode.
struct LeftOutSnapshot {
    uint32_t words[kMaxElasticRanks / 32];
    MOE_EP_DEVICE void fill(const Context& c) {
        for (int w = threadIdx.x; w < (c.comm.num_ranks + 31) / 32; w += blockDim.x) {
            uint32_t word = 0;
            for (int b = 0; b < 32 && 32 * w + b < c.comm.num_ranks; ++b)
                word |= (left_out(c, 32 * w + b) ? 1u : 0u) << b;
            words[w] = word;
        }
        __syncthreads();
    }
    MOE_EP_DEVICE bool operator()(int rank) const { return (words[rank / 32] >> (rank % 32)) & 1u; }
};

enum class Arrival { kReady, kLeftOut, kFailed };

// Spins until `ready()` holds for something `peer` sends. Without elastic mode this is `wait_until`: a
// timeout reports `code` and raises the abort word (kFailed, as is any earlier abort). In elastic mode a
// peer left out before or during the wait is not waited for (kLeftOut), and a wait that times out masks
// the peer and gives kLeftOut instead of failing.
template <typename Ready>
MOE_EP_DEVICE Arrival wait_peer(Ready&& ready, const Context& c, int peer, int code) {
    if (c.mask == nullptr) return wait_until(ready, c.comm, &c.state->abort, code) ? Arrival::kReady : Arrival::kFailed;
    if (left_out(c, peer)) return Arrival::kLeftOut;
    if (ready()) return Arrival::kReady;
    const uint64_t deadline = global_timer_ns() + c.comm.timeout_ns;
    for (uint32_t spins = 1;; ++spins) {
        if (ready()) return Arrival::kReady;
        if ((spins & 63) == 0) {
            if (ld_volatile(&c.state->abort) != 0) return Arrival::kFailed;
            if (left_out(c, peer)) return Arrival::kLeftOut;
            if (global_timer_ns() > deadline) {
                atomicExch(c.mask + peer, 1);
                return Arrival::kLeftOut;
            }
        }
    }
}

// Waits until `*signal` (sent by `peer`) carries `tag`, then yields its value (see wait_peer). The time
// spent spinning is added to `waited_ns`.
MOE_EP_DEVICE Arrival wait_signal(const uint64_t* signal, uint32_t tag, const Context& c, int peer, uint32_t& value,
                                  uint64_t& waited_ns) {
    uint64_t v = ld_acquire_sys_u64(signal);
    if ((v >> 32) != tag || c.mask != nullptr) {
        const uint64_t start = global_timer_ns();
        const Arrival arrival = wait_peer(
            [&] {
                v = ld_acquire_sys_u64(signal);
                return (v >> 32) == tag;
            },
            c, peer, kErrRecvTimeout);
        waited_ns += global_timer_ns() - start;
        if (arrival != Arrival::kReady) return arrival;
    }
    value = static_cast<uint32_t>(v);
    return Arrival::kReady;
}

MOE_EP_DEVICE void add_wait(int64_t* stats, int rank, uint64_t waited_ns) {
    if (stats != nullptr && waited_ns != 0)
        atomicAdd(reinterpret_cast<unsigned long long*>(stats + rank), static_cast<unsigned long long>(waited_ns));
}

// ------------------------------------------------------------------ transport to peers without P2P

#ifndef MOE_EP_LL_P2P_ONLY
// NVSHMEM delivers the row, then its signal. `staged` must be symmetric memory written by this warp. Out of
// line: peers without P2P are the cold path, and inlined into the dispatch loop it made the kernel spill.
__device__ __noinline__ void put_row_with_signal(uint8_t* sym_dst, const uint8_t* staged, size_t bytes,
                                                 uint64_t* sym_signal, uint64_t signal, int pe) {
    __threadfence_system();  // the staged row must be visible to the transport (a NIC) before it reads it
    __syncwarp();
    nvshmemx_putmem_signal_nbi_warp(sym_dst, staged, bytes, sym_signal, signal, NVSHMEM_SIGNAL_SET, pe);
}

MOE_EP_DEVICE void put_signal(uint64_t* sym_signal, uint64_t signal, int pe) {
    nvshmemx_signal_op(sym_signal, signal, NVSHMEM_SIGNAL_SET, pe);
}

MOE_EP_DEVICE void complete_puts() { nvshmem_quiet(); }
#else
// MOE_EP_LL_P2P_ONLY: without NVSHMEM's device library (the P2P-only module, whose runtime requires every
// peer mapped, and the compile check) peers are only ever written with direct stores.
MOE_EP_DEVICE void put_row_with_signal(uint8_t*, const uint8_t*, size_t, uint64_t*, uint64_t, int) { __trap(); }
MOE_EP_DEVICE void put_signal(uint64_t*, uint64_t, int) { __trap(); }
MOE_EP_DEVICE void complete_puts() {}
#endif

}  // namespace

}  // namespace moe_ep::kernels::ll
