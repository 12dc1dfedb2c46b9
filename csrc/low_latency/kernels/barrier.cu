// The low-latency barrier of all ranks (launch_barrier), with a timeout: what cleans and the collective
// destroy of a buffer wait on.
#include "low_latency/kernels/signals.cuh"

namespace moe_ep::kernels::ll {

namespace {

constexpr uint64_t kExactBarrierBit = 1ull << 63;

// One warp: lane r signals rank r, then lane r waits for rank r's signal (see launch_barrier). It runs
// even when an earlier wait gave up (a Buffer that failed is still destroyed collectively), with its
// own abort word; a timeout here also sets the state's. In elastic mode a barrier that is not `exact`
// (a clean) waits for no rank left out and masks a rank that does not arrive in time, instead of failing.
__global__ void barrier_kernel(const Context ctx, uint64_t epoch, bool exact) {
    const int64_t offset = barrier_offset(ctx.comm.num_ranks);
    const int lane = threadIdx.x;
    // An exact barrier (destroy) signals its epoch with a bit no other barrier sets: a rank that made one
    // barrier call fewer than its peers expects the epoch of their previous barrier, and must not take
    // the signals still left from that one for theirs.
    const uint64_t signal_value = exact ? epoch | kExactBarrierBit : epoch;
    // Writes of earlier kernels and memsets on the stream reach the peers before the signal.
    __threadfence_system();
    if (lane < ctx.comm.num_ranks) {
        const int64_t mine = offset + static_cast<int64_t>(ctx.comm.rank) * 8;
        if (ctx.peers[lane] != nullptr)
            st_release_sys_u64(reinterpret_cast<uint64_t*>(ctx.peers[lane] + mine), signal_value);
        else
            put_signal(reinterpret_cast<uint64_t*>(ctx.local + mine), signal_value, lane);
    }
    volatile int gave_up = 0;
    for (int r = lane; r < ctx.comm.num_ranks; r += 32) {
        const uint64_t* signal = reinterpret_cast<const uint64_t*>(ctx.local + offset) + r;
        const auto arrived = [&] {
            const uint64_t seen = ld_acquire_sys_u64(signal);
            return exact ? seen == signal_value : (seen & ~kExactBarrierBit) >= epoch;
        };
        const bool ok = ctx.mask != nullptr && !exact
                            ? wait_peer(arrived, ctx, r, kErrBarrierTimeout) != Arrival::kFailed
                            : wait_until(arrived, ctx.comm, &gave_up, kErrBarrierTimeout);
        if (!ok) {
            ctx.state->abort = 1;
            ctx.state->barrier_failed = 1;
            break;
        }
    }
}

}  // namespace

cudaError_t launch_barrier(const Context& ctx, uint64_t epoch, bool exact, cudaStream_t stream) {
    barrier_kernel<<<1, 32, 0, stream>>>(ctx, epoch, exact);
    return cudaGetLastError();
}

}  // namespace moe_ep::kernels::ll
