// Operation bookkeeping of the low-latency kernels: which operation (and buffer half) a phase serves,
// counting blocks out of a phase, waiting until every receiver freed a half, acknowledging receipt, and
// the cooperative launch. A launch with both phases needs no grid barrier: receivers wait on signals,
// also for their own rows, and the cooperative launch keeps every block resident so that no waiting
// block starves a sender.
#pragma once

#include "common/common.cuh"
#include "low_latency/api.cuh"
#include "low_latency/kernels/signals.cuh"

namespace moe_ep::kernels::ll {

namespace {  // local to each translation unit (csrc/README.md)

// The tag of operation `seq` in signals: never 0, the value of cleaned memory.
MOE_EP_DEVICE uint32_t tag_of(uint64_t seq) { return static_cast<uint32_t>(seq % 0xffffffffull) + 1; }

struct Phase {
    uint64_t seq;    // operation number
    uint32_t tag;    // carried by every signal of the operation
    int64_t counts;  // offsets of the half it uses (see Layout)
    int64_t flags;
    int64_t data;
    int64_t meta_flags;
    int64_t meta;
};

MOE_EP_DEVICE Phase phase_of(uint64_t seq, const Layout& L) {
    // The half is selected without indexing the Layout arrays at run time (which would put the kernel
    // parameter into local memory).
    const bool odd = (seq & 1) != 0;
    return {seq,
            tag_of(seq),
            odd ? L.counts[1] : L.counts[0],
            odd ? L.flags[1] : L.flags[0],
            odd ? L.data[1] : L.data[0],
            odd ? L.meta_flags[1] : L.meta_flags[0],
            odd ? L.meta[1] : L.meta[0]};
}

struct Operation {
    Phase send, recv;
    bool abort;  // an earlier wait gave up: do nothing
};

// Read once per block so that every thread agrees. No counter moves before every block has read it:
// a phase's counter advances only when all blocks finished that phase.
MOE_EP_DEVICE Operation begin_operation(const Context& c, const Layout& L) {
    __shared__ uint64_t s_seq[2];
    __shared__ int s_abort;
    if (threadIdx.x == 0) {
        s_seq[0] = *reinterpret_cast<volatile uint64_t*>(&c.state->send_seq);
        s_seq[1] = *reinterpret_cast<volatile uint64_t*>(&c.state->recv_seq);
        s_abort = *reinterpret_cast<volatile int*>(&c.state->abort);
    }
    __syncthreads();
    return {phase_of(s_seq[0], L), phase_of(s_seq[1], L), s_abort != 0};
}

// Counts the block out of a phase; the last block advances `*seq` and returns true in all of its warp 0.
// The fences order every block's work of the phase before what the last block does next; __syncwarp
// extends that order from lane 0 to the other lanes of warp 0.
MOE_EP_DEVICE bool finish_phase(uint32_t* done, uint64_t* seq) {
    __syncthreads();
    if (threadIdx.x >= 32) return false;
    bool last = false;
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(done, 1u) == gridDim.x - 1;
        if (last) {
            __threadfence();
            *done = 0;
            *seq += 1;
        }
    }
    __syncwarp();
    return __shfl_sync(kFullMask, last, 0);
}

// Before writing a half, every rank must have received the operation that used it before (two
// operations earlier): their acknowledgement words count received operations. Warp 0 acquires them;
// the barrier orders every thread's later stores after those acquires. In elastic mode a rank left out
// is not waited for (nothing will be stored to it), and one that does not acknowledge in time is masked.
MOE_EP_DEVICE bool wait_for_receivers(const Context& c, const Layout& L, const Phase& send) {
    __shared__ int s_failed;
    if (threadIdx.x < 32) {
        bool ok = true;
        const uint64_t* acks = reinterpret_cast<const uint64_t*>(c.local + L.acks);
        for (int r = threadIdx.x; r < c.comm.num_ranks && ok && send.seq >= 2; r += 32)
            ok = wait_peer([&] { return ld_acquire_sys_u64(acks + r) + 1 >= send.seq; }, c, r, kErrSendTimeout) !=
                 Arrival::kFailed;
        const bool failed = __any_sync(kFullMask, !ok);
        if (threadIdx.x == 0) s_failed = failed;
    }
    __syncthreads();
    return !s_failed;
}

// Tells every rank (itself included) that this rank has received `received` operations. Called by warp 0
// of the last block of a receive phase after finish_phase, so all reads of the half happen before. One
// lane per rank: a system-scope release waits for the thread's earlier stores to reach their peer, so
// one thread storing to every rank in turn would pay an NVLink round trip per rank.
MOE_EP_DEVICE void acknowledge(const Context& c, const Layout& L, uint64_t received) {
    const int64_t offset = L.acks + static_cast<int64_t>(c.comm.rank) * 8;
    for (int r = threadIdx.x; r < c.comm.num_ranks; r += 32) {
        if (c.peers[r] != nullptr)
            st_release_sys_u64(reinterpret_cast<uint64_t*>(c.peers[r] + offset), received);
        else
            put_signal(reinterpret_cast<uint64_t*>(c.local + offset), received, r);
    }
}

template <typename... Params, typename... Args>
cudaError_t launch_cooperative(void (*kernel)(Params...), int blocks, size_t shared_bytes, cudaStream_t stream,
                               Args... args) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(kBlockThreads);
    config.dynamicSmemBytes = shared_bytes;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeCooperative;
    attribute[0].val.cooperative = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace

}  // namespace moe_ep::kernels::ll
