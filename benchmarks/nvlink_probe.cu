// NVLink probe: how fast can SMs move rows between GPUs when all of them do it at once, by pushing
// (stores into the peer) or pulling (loads from the peer)? It measures the NVLink floor that the
// intranode kernels are judged against (docs/design/intranode.md). Standalone: no torch, one process driving
// GPUs 0 .. gpus-1 with peer access. Every mode moves `rows` rows of `row_bytes` (default 11,000 x
// 14,336 B = 158 MB, the remote bytes one rank moves in the 4-rank benchmark) out of every GPU at the
// same time, warp w of a GPU moving its rows to or from its peer number w % (gpus - 1) (with 4 GPUs: an
// all-to-all, like the dispatch and combine); the printed GB/s is per GPU and direction (bytes / time
// of the slowest GPU).
//   nvcc -O3 -std=c++17 -I csrc -gencode arch=compute_90a,code=sm_90a -o /tmp/nvlink_probe \
//       benchmarks/nvlink_probe.cu
//   /tmp/nvlink_probe [rows] [row_bytes] [gpus]   (gpus default 2; prints one JSON object per line)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#include "common/common.cuh"  // bulk copies and mbarriers of the kernels

#define CHECK(call)                                                                            \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            std::exit(1);                                                                      \
        }                                                                                      \
    } while (0)

namespace {

using namespace moe_ep::kernels;

// The fan-out modes copy the dispatch's send pattern: a row is loaded once and stored to every peer
// (one lane per peer); the publishing ones announce progress like the dispatch's tails: every
// kPublishEvery rows a lane waits for its stores kLag rows back to complete, then writes a counter into
// its peer, after a release fence (`_pub`) or without one (`_pub_relaxed`, not a valid protocol: it
// measures what the fence costs).
enum Mode : int {
    kPushBulk = 0, kPullBulk = 1, kPullLoad = 2, kPushStore = 3, kLocalBulk = 4,
    kFanout = 5, kFanoutPublish = 6, kFanoutPublishRelaxed = 7, kPushBulkPublish = 8, kNumModes = 9
};
const char* kModeNames[] = {"push_bulk", "pull_bulk", "pull_ld", "push_st", "local_bulk",
                            "push_bulk_fanout", "push_bulk_fanout_pub", "push_bulk_fanout_pub_relaxed",
                            "push_bulk_pub"};
constexpr int kPublishEvery = 8;
constexpr int kFlagsPerGpu = 2048;  // one progress counter per (source GPU, warp) at every GPU

// Spins on a stage barrier (common.cuh's mbar_wait adds the kernels' timeout and abort machinery).
__device__ __forceinline__ void wait_stage(uint64_t* bar, uint32_t parity) {
    while (!mbar_test(bar, parity)) {
    }
}

constexpr int kLag = 3;  // stores left in flight before a stage is reused

constexpr int kMaxGpus = 8;

// Where warp w of a GPU reads and writes: its peer number w % count (local mode: count 1); fan-out:
// every peer. flag[i]: this GPU's progress counters at peer i.
struct Targets {
    const uint8_t* src[kMaxGpus];
    uint8_t* dst[kMaxGpus];
    int* flag[kMaxGpus];
    int count;
};

// How a bulk-mode warp sends: to one peer or to all (fan-out), and how it announces progress.
struct SendPattern {
    bool fanout;
    int publish_every;  // 0: never
    bool release;
};

// Bulk modes: every warp runs one pipeline of `stages` shared-memory stages: lane 0 bulk loads a row,
// the sending lanes (lane 0, or lane i for peer i in fan-out) bulk store it, loads issued stages - kLag
// rows ahead. Fan-out warps take rows / count rows, so every mode moves the same bytes.
__global__ void __launch_bounds__(128, 1) bulk_kernel(const Targets t, int rows, int row_bytes, int stages,
                                                      SendPattern pattern) {
    extern __shared__ __align__(128) uint8_t smem[];
    const int warp = threadIdx.x / 32, warps = blockDim.x / 32, lane = threadIdx.x & 31;
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * 32;
    uint8_t* buf = smem + 4096 + static_cast<size_t>(warp) * stages * row_bytes;
    const int senders = pattern.fanout ? t.count : 1;
    if (lane >= senders) return;
    const unsigned sender_mask = (1u << senders) - 1;
    if (lane == 0) {
        for (int s = 0; s < stages; ++s) mbar_init(bars + s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp(sender_mask);
    int begin, end;
    const int global_warp = blockIdx.x * warps + warp;
    channel_range(pattern.fanout ? rows / t.count : rows, gridDim.x * warps, global_warp, begin, end);  // this warp's rows
    const int n = end - begin;
    const int peer = pattern.fanout ? lane : global_warp % t.count;
    const uint8_t* src = t.src[pattern.fanout ? 0 : peer];
    uint8_t* dst = t.dst[peer];
    int* flag = t.flag[peer] == nullptr ? nullptr : t.flag[peer] + global_warp;
    auto load = [&](int i) {
        if (lane != 0 || i >= n) return;
        const int s = i % stages;
        mbar_arrive_expect_tx(bars + s, row_bytes);
        bulk_load(buf + static_cast<size_t>(s) * row_bytes, src + static_cast<size_t>(begin + i) * row_bytes, row_bytes,
                  bars + s);
    };
    for (int i = 0; i < stages - kLag; ++i) load(i);
    for (int i = 0; i < n; ++i) {
        const int s = i % stages;
        wait_stage(bars + s, (i / stages) & 1);
        bulk_store(dst + static_cast<size_t>(begin + i) * row_bytes, buf + static_cast<size_t>(s) * row_bytes, row_bytes);
        bulk_commit();
        bulk_wait_read<kLag>();
        if (pattern.publish_every > 0 && i >= kLag && (i - kLag) % pattern.publish_every == 0) {
            bulk_wait<kLag>();
            fence_proxy_async_global();
            if (pattern.release) st_release_sys(flag, i + 1 - kLag);
            else st_relaxed_sys(flag, i + 1 - kLag);
        }
        __syncwarp(sender_mask);
        load(i + stages - kLag);
    }
    bulk_wait<0>();
}

// Load/store modes: a warp moves a row with 16-byte accesses, the whole row's loads in flight at once.
constexpr int kUnitsPerLane = 28;  // 14,336-byte rows: 28 x 16 B per lane
__global__ void __launch_bounds__(256, 1) ldst_kernel(const Targets t, int rows, int row_units) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
    int begin, end;
    const int global_warp = blockIdx.x * warps + warp;
    channel_range(rows, gridDim.x * warps, global_warp, begin, end);  // this warp's rows
    const int4* src = reinterpret_cast<const int4*>(t.src[global_warp % t.count]);
    int4* dst = reinterpret_cast<int4*>(t.dst[global_warp % t.count]);
    for (int r = begin; r < end; ++r) {
        int4 v[kUnitsPerLane];
#pragma unroll
        for (int u = 0; u < kUnitsPerLane; ++u)
            if (lane + 32 * u < row_units) v[u] = __ldcg(src + static_cast<size_t>(r) * row_units + lane + 32 * u);
#pragma unroll
        for (int u = 0; u < kUnitsPerLane; ++u)
            if (lane + 32 * u < row_units) __stcg(dst + static_cast<size_t>(r) * row_units + lane + 32 * u, v[u]);
    }
}

struct Gpu {
    uint8_t* src;
    uint8_t* dst;  // [gpus][rows x row_bytes]: the rows from GPU s land in block s
    int* flags;    // [gpus][kFlagsPerGpu]: progress counters written by GPU s
    cudaStream_t stream;
    cudaEvent_t start, stop;
};

}  // namespace

int main(int argc, char** argv) {
    const int rows = argc > 1 ? std::atoi(argv[1]) : 11000;
    const int row_bytes = argc > 2 ? std::atoi(argv[2]) : 14336;
    const int gpus = argc > 3 ? std::atoi(argv[3]) : 2;
    const size_t bytes = static_cast<size_t>(rows) * row_bytes;
    int count = 0;
    CHECK(cudaGetDeviceCount(&count));
    if (gpus < 2 || gpus > kMaxGpus || count < gpus) {
        std::fprintf(stderr, "gpus: expected 2 to %d and at most the %d GPUs present, got %d\n", kMaxGpus, count, gpus);
        return 1;
    }
    Gpu g[kMaxGpus];
    for (int d = 0; d < gpus; ++d) {
        CHECK(cudaSetDevice(d));
        for (int p = 0; p < gpus; ++p)
            if (p != d) CHECK(cudaDeviceEnablePeerAccess(p, 0));
        CHECK(cudaMalloc(&g[d].src, bytes));
        CHECK(cudaMalloc(&g[d].dst, bytes * gpus));
        CHECK(cudaMemset(g[d].src, d + 1, bytes));
        CHECK(cudaMemset(g[d].dst, 0, bytes * gpus));
        CHECK(cudaMalloc(&g[d].flags, sizeof(int) * kFlagsPerGpu * gpus));
        CHECK(cudaMemset(g[d].flags, 0, sizeof(int) * kFlagsPerGpu * gpus));
        CHECK(cudaStreamCreateWithFlags(&g[d].stream, cudaStreamNonBlocking));
        CHECK(cudaEventCreate(&g[d].start));
        CHECK(cudaEventCreate(&g[d].stop));
        CHECK(cudaFuncSetAttribute(bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
    }
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int sm_counts[] = {12, 24, 48, sms};
    for (int mode = 0; mode < kNumModes; ++mode) {
        for (int blocks : sm_counts) {
            const bool fanout = mode == kFanout || mode == kFanoutPublish || mode == kFanoutPublishRelaxed;
            const SendPattern pattern{fanout,
                                      mode == kFanoutPublish || mode == kFanoutPublishRelaxed || mode == kPushBulkPublish
                                          ? kPublishEvery
                                          : 0,
                                      mode != kFanoutPublishRelaxed};
            const bool bulk = mode == kPushBulk || mode == kPullBulk || mode == kLocalBulk || mode >= kFanout;
            const bool pull = mode == kPullBulk || mode == kPullLoad;
            const bool push = mode == kPushBulk || mode == kPushStore || mode >= kFanout;
            const int warps = bulk ? 2 : 8;
            const int stages = bulk ? (220 * 1024 - 4096) / (warps * row_bytes) : 0;
            // Pull: this GPU reads a peer's source into its own destination block for that peer; push:
            // it writes its source into its block of the peer's destination; local: its own buffers.
            auto targets = [&](int d) {
                Targets t{};
                if (mode == kLocalBulk) {
                    t.src[0] = g[d].src;
                    t.dst[0] = g[d].dst + d * bytes;
                    t.count = 1;
                    return t;
                }
                for (int p = 0; p < gpus; ++p) {
                    if (p == d) continue;
                    t.src[t.count] = pull ? g[p].src : g[d].src;
                    t.dst[t.count] = push ? g[p].dst + d * bytes : g[d].dst + p * bytes;
                    t.flag[t.count] = g[p].flags + d * kFlagsPerGpu;
                    ++t.count;
                }
                return t;
            };
            auto launch = [&](int d) {
                if (bulk) {
                    const size_t smem = 4096 + static_cast<size_t>(warps) * stages * row_bytes;
                    bulk_kernel<<<blocks, 32 * warps, smem, g[d].stream>>>(targets(d), rows, row_bytes, stages,
                                                                           pattern);
                } else {
                    ldst_kernel<<<blocks, 32 * warps, 0, g[d].stream>>>(targets(d), rows, row_bytes / 16);
                }
            };
            const int warmup = 2, iters = 10;
            float worst_ms = 0.0f;
            for (int it = 0; it < warmup + iters; ++it) {
                for (int d = 0; d < gpus; ++d) {
                    CHECK(cudaSetDevice(d));
                    CHECK(cudaStreamSynchronize(g[d].stream));
                }
                for (int d = 0; d < gpus; ++d) {
                    CHECK(cudaSetDevice(d));
                    CHECK(cudaEventRecord(g[d].start, g[d].stream));
                    launch(d);
                    CHECK(cudaGetLastError());
                    CHECK(cudaEventRecord(g[d].stop, g[d].stream));
                }
                float slowest = 0.0f;
                for (int d = 0; d < gpus; ++d) {
                    CHECK(cudaSetDevice(d));
                    CHECK(cudaEventSynchronize(g[d].stop));
                    float ms = 0.0f;
                    CHECK(cudaEventElapsedTime(&ms, g[d].start, g[d].stop));
                    slowest = ms > slowest ? ms : slowest;
                }
                if (it >= warmup) worst_ms += slowest / iters;
            }
            // The last row GPU 1 moves (its last warp's, with peer number W - 1 of its peers 0, 2, 3, ...;
            // fan-out: row rows / peers - 1, sent to every peer) must hold GPU 1's bytes where it went;
            // local mode: GPU 0's own copy.
            const int peer_number = fanout ? 0 : (blocks * warps - 1) % (gpus - 1);
            const int peer = peer_number == 0 ? 0 : peer_number + 1;
            const size_t last_byte = fanout ? static_cast<size_t>(rows / (gpus - 1)) * row_bytes - 1 : bytes - 1;
            const uint8_t* where = mode == kLocalBulk ? g[0].dst + bytes - 1
                                   : push         ? g[peer].dst + bytes + last_byte
                                                  : g[1].dst + static_cast<size_t>(peer) * bytes + bytes - 1;
            uint8_t probe = 0;
            CHECK(cudaSetDevice(mode == kLocalBulk ? 0 : push ? peer : 1));
            CHECK(cudaMemcpy(&probe, where, 1, cudaMemcpyDeviceToHost));
            const int expected = mode == kLocalBulk ? 1 : pull ? peer + 1 : 2;
            std::printf(
                "{\"mode\": \"%s\", \"gpus\": %d, \"sms\": %d, \"warps_per_block\": %d, \"stages_per_warp\": %d, "
                "\"bytes\": %zu, \"time_us\": %.1f, \"gb_per_s\": %.1f, \"check\": %s}\n",
                kModeNames[mode], gpus, blocks, warps, stages, bytes, worst_ms * 1e3, bytes / (worst_ms * 1e-3) / 1e9,
                probe == expected ? "true" : "false");
            std::fflush(stdout);
        }
    }
    return 0;
}
