// Device helpers shared by the kernel files: memory-model primitives, bulk (TMA) copies, mbarriers,
// timeouts and the cross-rank barrier.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "common/comm.cuh"

#define MOE_EP_DEVICE __device__ __forceinline__

namespace moe_ep::kernels {

constexpr unsigned kFullMask = 0xffffffffu;
// kFp8Max as the float the FP8 casts compute with.
constexpr float kFp8MaxFloat = kFp8Max;

// Host code may call it too: nvcc compiles a device-only function called from a host template without a
// diagnostic, and the process then exits at that call.
__host__ __device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Token range [begin, end) of channel `channel` when `num_tokens` are cut into `num_channels` chunks.
MOE_EP_DEVICE void channel_range(int num_tokens, int num_channels, int channel, int& begin, int& end) {
    const int per_channel = ceil_div(num_tokens, num_channels);
    begin = min(channel * per_channel, num_tokens);
    end = min(begin + per_channel, num_tokens);
}

// ------------------------------------------------------------------ memory model

MOE_EP_DEVICE uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

MOE_EP_DEVICE int ld_acquire_sys(const int* ptr) {
    int v;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

MOE_EP_DEVICE int ld_volatile(const int* ptr) {
    int v;
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

MOE_EP_DEVICE void st_release_sys(int* ptr, int v) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// A counter that only tells a peer how far data was consumed (no data of ours to make visible with it).
MOE_EP_DEVICE void st_relaxed_sys(int* ptr, int v) {
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// Raises a peer's counter to at least v: writers that race cannot move it backwards.
MOE_EP_DEVICE void red_max_relaxed_sys(int* ptr, int v) {
    asm volatile("red.relaxed.sys.global.max.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

MOE_EP_DEVICE void red_add_release_sys(int* ptr, int v) {
    asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// 64-bit signal words of the low-latency buffer (tag << 32 | value).
MOE_EP_DEVICE uint64_t ld_acquire_sys_u64(const uint64_t* ptr) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
    return v;
}

MOE_EP_DEVICE uint64_t ld_acquire_gpu_u64(const uint64_t* ptr) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
    return v;
}

MOE_EP_DEVICE void st_release_sys_u64(uint64_t* ptr, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

MOE_EP_DEVICE void st_relaxed_sys_u64(uint64_t* ptr, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

MOE_EP_DEVICE void st_relaxed_gpu_u64(uint64_t* ptr, uint64_t v) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

MOE_EP_DEVICE void st_release_gpu_u64(uint64_t* ptr, uint64_t v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

// Orders generic-proxy global accesses against later bulk-copy (async proxy) accesses and back.
MOE_EP_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
// Makes generic writes to shared memory visible to a later bulk copy reading them.
MOE_EP_DEVICE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ------------------------------------------------------------------ mbarriers and bulk copies

MOE_EP_DEVICE uint32_t smem_addr(const void* ptr) { return static_cast<uint32_t>(__cvta_generic_to_shared(ptr)); }

MOE_EP_DEVICE void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

MOE_EP_DEVICE void mbar_arrive(uint64_t* bar) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(smem_addr(bar)) : "memory");
}

MOE_EP_DEVICE void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}

MOE_EP_DEVICE bool mbar_test(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    return done != 0;
}

// Global -> shared bulk copy completing on `bar` (which must expect the bytes).
MOE_EP_DEVICE void bulk_load(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(smem_dst)),
                 "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

// Shared -> global bulk copy (local or peer memory), tracked by this thread's bulk groups.
MOE_EP_DEVICE void bulk_store(void* gmem_dst, const void* smem_src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst),
                 "r"(smem_addr(smem_src)), "r"(bytes)
                 : "memory");
}

// Starts moving `bytes` (a multiple of 16) at `gmem_src` into L2, without waiting or using registers.
MOE_EP_DEVICE void prefetch_l2(const void* gmem_src, uint32_t bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(gmem_src), "r"(bytes) : "memory");
}

MOE_EP_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Wait until at most N of this thread's bulk groups are incomplete (writes done).
template <int N>
MOE_EP_DEVICE void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// Wait until at most N of this thread's bulk groups still read their shared-memory source.
template <int N>
MOE_EP_DEVICE void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

constexpr int kMaxBulkLag = 16;

// bulk_wait / bulk_wait_read with a run-time count (the instruction takes an immediate), clamped to
// [0, kMaxBulkLag].
template <bool kRead>
MOE_EP_DEVICE void bulk_wait_dyn(int n) {
    switch (n <= 0 ? 0 : n >= kMaxBulkLag ? kMaxBulkLag : n) {
#define MOE_EP_BULK_CASE(N)                       \
    case N:                                       \
        if constexpr (kRead) bulk_wait_read<N>(); \
        else bulk_wait<N>();                      \
        break;
        MOE_EP_BULK_CASE(0) MOE_EP_BULK_CASE(1) MOE_EP_BULK_CASE(2) MOE_EP_BULK_CASE(3) MOE_EP_BULK_CASE(4)
        MOE_EP_BULK_CASE(5) MOE_EP_BULK_CASE(6) MOE_EP_BULK_CASE(7) MOE_EP_BULK_CASE(8) MOE_EP_BULK_CASE(9)
        MOE_EP_BULK_CASE(10) MOE_EP_BULK_CASE(11) MOE_EP_BULK_CASE(12) MOE_EP_BULK_CASE(13)
        MOE_EP_BULK_CASE(14) MOE_EP_BULK_CASE(15) MOE_EP_BULK_CASE(16)
#undef MOE_EP_BULK_CASE
    }
}

// Stores whose shared-memory source may still be unread when the storer moves on: half the stages,
// so that the loader keeps the other half to run ahead.
MOE_EP_DEVICE int read_lag(int num_stages, int requested) {
    return min(requested > 0 ? requested : (num_stages - 1) / 2, min(num_stages - 1, kMaxBulkLag - 4));
}

// ------------------------------------------------------------------ errors and timeouts

MOE_EP_DEVICE void report_error(HostFlags* flags, int code, int detail = 0) {
    volatile HostFlags* f = flags;
    if (f->error == kOk) {
        f->error_detail = detail;
        f->error = code;
    }
    __threadfence_system();
}

struct NoStallHook {
    MOE_EP_DEVICE void operator()() const {}
};

// Spins until `ready()` holds. Gives up when `*abort` is raised by another warp of the block, or
// after `timeout_ns` without success: then reports `code`, raises `*abort` and returns false.
// `stalled()` runs once when the first poll fails (the profiling build's clock counts the stall).
template <typename Ready, typename StallHook = NoStallHook>
MOE_EP_DEVICE bool wait_until(Ready&& ready, const CommContext& comm, volatile int* abort, int code,
                              StallHook stalled = {}) {
    if (ready()) return true;
    stalled();
    const uint64_t deadline = global_timer_ns() + comm.timeout_ns;
    for (uint32_t spins = 1;; ++spins) {
        if (ready()) return true;
        if ((spins & 63) == 0) {
            if (*abort) return false;
            if (global_timer_ns() > deadline) {
                report_error(comm.flags, code);
                *abort = 1;
                return false;
            }
        }
    }
}

MOE_EP_DEVICE bool mbar_wait(uint64_t* bar, uint32_t parity, const CommContext& comm, volatile int* abort) {
    return wait_until([&] { return mbar_test(bar, parity); }, comm, abort, kErrInternalTimeout);
}

// ------------------------------------------------------------------ cross-rank barrier

// All threads of one block call this; threads [0, R) signal and wait. Writes made by the block before
// the call are visible to every peer after it. Returns false on timeout (error reported).
MOE_EP_DEVICE bool rank_barrier(const CommContext& comm, volatile int* abort) {
    __shared__ int s_epoch;
    int* own = comm.peers.ctrl[comm.rank];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) s_epoch = ++own[ctrl::kBarrierEpoch];
    __syncthreads();
    const int epoch = s_epoch;
    if (threadIdx.x < comm.num_ranks) {
        red_add_release_sys(comm.peers.ctrl[threadIdx.x] + ctrl::kBarrierSignal + comm.rank, 1);
        const int* signal = own + ctrl::kBarrierSignal + threadIdx.x;
        wait_until([&] { return ld_acquire_sys(signal) >= epoch; }, comm, abort, kErrBarrierTimeout);
    }
    __syncthreads();
    return *abort == 0;
}

// Clears this rank's ring tails and heads, staging ready counts and combine claim counters (peers write
// the first three during data kernels).
MOE_EP_DEVICE void clear_ring_counters(const CommContext& comm) {
    int* own = comm.peers.ctrl[comm.rank];
    for (int i = threadIdx.x; i < 2 * kNumMaxChannels * kNumMaxNvlPeers; i += blockDim.x) own[ctrl::kTail + i] = 0;
    for (int i = threadIdx.x; i < kNumMaxNvlPeers * ctrl::kStagingChunks + 2; i += blockDim.x)
        own[ctrl::kStagingReady + i] = 0;
}

// Ring slots are whole 128-byte lines: NVLink stores that cover only part of a line cost about 30 %
// of the throughput (4 ranks pushing 14,416-byte rows took 630-638 us, 14,464-byte rows 484-491 us; the
// 4-rank BF16 dispatch went from 665-711 us to 523-540 us).
constexpr int kSlotAlign = 128;

__host__ __device__ inline int align_slot(int bytes) { return (bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign; }

// Byte offset of the ring (channel, source) inside a receiver's data region.
MOE_EP_DEVICE size_t ring_offset(int channel, int source, int num_ranks, int ring_slots, int slot_bytes) {
    return (static_cast<size_t>(channel) * num_ranks + source) * ring_slots * static_cast<size_t>(slot_bytes);
}

MOE_EP_DEVICE int warp_sum(int v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
    return v;
}

MOE_EP_DEVICE int warp_max(int v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
}

// Bit r set when is_token_in_rank[token, r].
MOE_EP_DEVICE uint32_t token_rank_mask(const bool* is_token_in_rank, int token, int num_ranks) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(is_token_in_rank) + static_cast<size_t>(token) * num_ranks;
    uint32_t mask = 0;
    for (int r = 0; r < num_ranks; ++r) mask |= (row[r] ? 1u : 0u) << r;
    return mask;
}

}  // namespace moe_ep::kernels
