// Intranode combine. Two paths in one kernel (intranode/api.cuh, launch_combine): the staged one
// (combine_staged.cuh) when every owner's staging area fits, else the rings below.
//
// Rings: one block per dispatch channel, the channel's token range of every rank. The
// block's first R - 1 warps send back the rows this rank received from the channel of every other rank
// (ring slot: the row, then the k top-k weights), one warp per destination; its other warps reduce the
// channel's range of this rank's own tokens: bias first, then the contributions of ranks 0..R-1 in
// order, all in float32 (float64 for double), exactly like the torch backend. This rank's own
// contribution is read in place. Senders and reducers of all channels run at once, so every rank's
// senders make progress while its reducers wait for theirs.
#include <algorithm>

#include "common/launch_cache.cuh"
#include "common/phase_clock.cuh"
#include "common/pipeline.cuh"
#include "intranode/api.cuh"
#include "intranode/kernels/combine_reduce.cuh"
#include "intranode/kernels/combine_staged.cuh"

namespace moe_ep::kernels {

namespace {

constexpr int kCombineThreads = 512;
constexpr int kCombineWarps = kCombineThreads / 32;
// A sender publishes its tail for the rows whose stores completed, up to this many stores back, so
// that publishing never drains its pipeline.
constexpr int kPublishLag = 2;

// Rows [start, start + count) of x that this rank sends back to `dest` for `channel`.
MOE_EP_DEVICE void returned_rows(const CombineArgs& a, int channel, int rank, int num_ranks, int dest, int& start,
                                 int& count) {
    const int C = a.num_channels;
    start = a.recv_channel_prefix_matrix[dest * C + channel];
    const int end = channel + 1 < C ? a.recv_channel_prefix_matrix[dest * C + channel + 1]
                                    : a.rank_prefix_matrix[dest * num_ranks + rank];
    count = end - start;
}

// Sender warp for one destination (owner) rank: its own stages, its own ring, its own progress. One
// in-order pipeline shared by all destinations could deadlock: owners need every source of a token, so
// a sender stuck on a full ring of owner A while owner A waits for another sender stuck on owner B ...
// closes a cycle. Lane 0 issues the bulk copies; lanes < k carry the weights, prefetched one row ahead.
MOE_EP_DEVICE void send_rows(const CombineArgs& a, const StageRing& ring, int first_stage, int num_stages, int dest,
                             int channel, int slot_bytes, const CommContext& comm, volatile int* abort) {
    const int lane = threadIdx.x & 31;
    const int me = comm.rank;
    int start, count;
    returned_rows(a, channel, me, comm.num_ranks, dest, start, count);
    uint8_t* ring_base = comm.peers.data[dest] + ring_offset(channel, me, comm.num_ranks, a.ring_slots, slot_bytes);
    int* tail_ptr = comm.peers.ctrl[dest] + ctrl::kTail + channel * kNumMaxNvlPeers + me;
    const int* head_ptr = comm.peers.ctrl[me] + ctrl::kHead + channel * kNumMaxNvlPeers + dest;
    const bool has_weights = a.topk_weights != nullptr && lane < a.num_topk;
    auto weight_of = [&](int i) {
        return has_weights && i < count ? a.topk_weights[static_cast<size_t>(start + i) * a.num_topk + lane] : 0.0f;
    };
    auto load = [&](int i) {  // bulk-load row i into its stage
        if (lane == 0 && i < count) {
            const int st = first_stage + i % num_stages;
            mbar_arrive_expect_tx(ring.full + st, a.row_bytes);
            bulk_load(ring.stage(st), static_cast<const uint8_t*>(a.x) + static_cast<size_t>(start + i) * a.row_bytes,
                      a.row_bytes, ring.full + st);
        }
    };
    int head = 0, published = 0;
    bool ok = true;
    PhaseClock clock(comm, prof::record(prof::kCombine, channel, dest));
    float weight = weight_of(0);
    load(0);
    clock.lap(prof::kCopy);
    for (int i = 0; i < count && ok; ++i) {
        // Row i + 1 reuses the stage of row i + 1 - S, whose store is the (S - 2)-th newest one.
        bulk_wait_dyn<true>(num_stages - 2);
        __syncwarp();
        clock.lap(prof::kCopyWait);
        if (num_stages > 1) load(i + 1);
        const float next_weight = weight_of(i + 1);
        const int st = first_stage + i % num_stages;
        uint8_t* stage = ring.stage(st);
        if (has_weights) reinterpret_cast<float*>(stage + a.row_bytes)[lane] = weight;
        fence_proxy_async_shared();
        __syncwarp();  // the weights written by lanes < k are read by lane 0's bulk store
        clock.lap(prof::kCopy);
        ok = __all_sync(kFullMask, mbar_wait(ring.full + st, (i / num_stages) & 1, comm, abort));
        clock.lap(prof::kWaitStage);
        clock.item();
        if (ok && lane == 0) {
            if (i - head >= a.ring_slots)
                ok = wait_for_ring_slot(i, a.ring_slots, tail_ptr, head_ptr, head, published, comm, abort, clock);
            if (ok) {
                bulk_store(ring_base + static_cast<size_t>(i % a.ring_slots) * slot_bytes, stage, slot_bytes);
                bulk_commit();
                clock.lap(prof::kCopy);
                const int done = i + 1 - kPublishLag;  // rows complete once at most kPublishLag stores are pending
                // The first row is published at once: the owner's reducers wait for it before any work.
                if (done - published >= (published == 0 ? 1 : a.publish_every)) {
                    bulk_wait<kPublishLag>();
                    clock.lap(prof::kCopyWait);
                    publish_tail(tail_ptr, done);
                    published = done;
                    clock.lap(prof::kPublish);
                }
            }
        }
        ok = __all_sync(kFullMask, ok);
        if (num_stages == 1 && i + 1 < count) {  // its wait counts with the next row's (kCopyWait)
            bulk_wait<0>();
            __syncwarp();
            load(i + 1);
        }
        weight = next_weight;
    }
    bulk_wait<0>();
    clock.lap(prof::kCopyWait);
    if (lane == 0 && ok && *abort == 0 && count > published) publish_tail(tail_ptr, count);
    clock.lap(prof::kPublish);
}

// Reducer warps [first_warp, kCombineWarps) of the block: tokens of the channel round robin, heads
// published after every chunk of 8 tokens per warp.
template <typename T, int kRanks>
MOE_EP_DEVICE void reduce_channel(const CombineArgs& a, int channel, int first_warp, int slot_bytes,
                                  const CommContext& comm, volatile int* abort) {
    __shared__ int s_head[2][kNumMaxNvlPeers];  // consumed ring positions, per chunk parity
    const int num_warps = kCombineWarps - first_warp, num_threads = 32 * num_warps;
    const int warp = threadIdx.x / 32 - first_warp, lane = threadIdx.x & 31, thread = threadIdx.x - 32 * first_warp;
    const int R = comm.num_ranks, C = a.num_channels, me = comm.rank;
    PhaseClock clock(comm, prof::record(prof::kCombine, channel, prof::kCombineReducer),
                     warp == 0 ? ClockWriter::kSharedWithTimestamps : ClockWriter::kShared);
    if (thread < 2 * kNumMaxNvlPeers) s_head[thread / kNumMaxNvlPeers][thread % kNumMaxNvlPeers] = 0;
    asm volatile("bar.sync 1, %0;" ::"r"(num_threads));
    clock.lap(prof::kWaitStage);

    int begin, end;
    channel_range(a.num_tokens, C, channel, begin, end);
    // Lane r: where ring (channel, r) starts in r's block, how far its tail is known, its slots.
    const int chan_start = lane < R && channel > 0 ? a.channel_prefix_matrix[lane * C + channel - 1] : 0;
    const int self_base = me > 0 ? a.rank_prefix_matrix[(me - 1) * R + me] : 0;
    const int* tail_ptr = comm.peers.ctrl[me] + ctrl::kTail + channel * kNumMaxNvlPeers + lane;
    const uint8_t* my_ring =
        comm.peers.data[me] + ring_offset(channel, lane < R ? lane : 0, R, a.ring_slots, slot_bytes);
    int tail_seen = 0, published = 0;

    // A chunk never needs more ring positions than a ring holds: its heads are only published after it.
    // Eight tokens per warp between the reducers' barriers: a barrier waits for the warp whose token
    // arrived last, so fewer barriers leave less waiting.
    const int chunk_tokens = min(8 * num_warps, a.ring_slots);
    for (int chunk = begin, index = 0; chunk < end; chunk += chunk_tokens, ++index) {
        const int parity = index & 1;
        for (int t = chunk + warp; t < min(chunk + chunk_tokens, end); t += num_warps) {
            if (*abort) break;
            const uint32_t mask =
                __ballot_sync(kFullMask, lane < R && reinterpret_cast<const uint8_t*>(a.is_token_in_rank)[
                                                         static_cast<size_t>(t) * R + lane] != 0);
            const uint8_t* row = nullptr;
            bool ok = true;
            int pos = 0;
            if ((mask >> lane) & 1) {
                const int head = a.send_head[static_cast<size_t>(t) * R + lane];
                if (lane == me) {
                    row = static_cast<const uint8_t*>(a.x) + static_cast<size_t>(self_base + head) * a.row_bytes;
                } else {
                    pos = head - chan_start;
                    if (pos >= tail_seen)
                        ok = clock.wait([&] { return (tail_seen = ld_acquire_sys(tail_ptr)) > pos; }, comm, abort,
                                        kErrRecvTimeout);
                    row = my_ring + static_cast<size_t>(pos % a.ring_slots) * slot_bytes;
                }
            }
            __syncwarp();  // lane r's acquire of tail r covers every lane's reads of that ring
            if (!__all_sync(kFullMask, ok)) break;
            clock.item_after_lane_waits();
            reduce_token<T, kRanks>(a, t, mask, row, me, lane);
            if (((mask >> lane) & 1) && lane != me) atomicMax(&s_head[parity][lane], pos + 1);
            clock.lap(prof::kCopy);
        }
        clock.lap(prof::kMeta);  // the last loop test and abort checks
        asm volatile("bar.sync 1, %0;" ::"r"(num_threads));
        clock.lap(prof::kWaitStage);
        if (thread < R && thread != me && *abort == 0) {
            const int head = s_head[parity][thread];
            if (head > published) {
                st_release_sys(comm.peers.ctrl[thread] + ctrl::kHead + channel * kNumMaxNvlPeers + me, head);
                published = head;
            }
        }
        clock.lap(prof::kPublish);
    }
}

// Both paths use the same threads: the first warps send (R - 1 for the rings, staged_sender_warps for
// the staged path), the others reduce. `num_stages` stages of one slot for the rings, `staged_stages`
// of staged_slots_per_stage slots for the staged path.
template <typename T, int kRanks>
__global__ void __launch_bounds__(kCombineThreads, 1) combine_kernel(CombineArgs a, CommContext comm, int num_stages,
                                                                      int staged_stages, int slot_bytes) {
    extern __shared__ __align__(1024) uint8_t smem[];
    __shared__ volatile int s_abort;
    __shared__ ChunkDone s_done[kNumMaxNvlPeers - 1][kMaxStagedSignalLag + 1];
    // The handle of a dispatch cancelled by an overflow (its error surfaces at the next call) has
    // prefix matrices that do not match the expert outputs: read nothing.
    if (ld_volatile(comm.peers.ctrl[comm.rank] + ctrl::kDispatchCancelled) != 0) return;
    const int channel = blockIdx.x, warp = threadIdx.x / 32, senders = comm.num_ranks - 1;
    const int staged_senders = staged_sender_warps(comm.num_ranks, staged_stages);
    const StagingPlan plan = plan_staging(a, comm.num_ranks, slot_bytes, staged_stages / staged_senders);
    if (channel == 0 && threadIdx.x == 0) comm.flags->combine_path = plan.staged ? kCombineStaged : kCombineRings;
    if (threadIdx.x == 0) s_abort = 0;
    if (plan.staged) {
        const int slots = staged_slots_per_stage(slot_bytes), per_sender = staged_stages / staged_senders;
        const StageRing ring = make_stage_ring(smem, staged_stages, slots * slot_bytes, threadIdx.x == 0);
        __syncthreads();
        // Senders that run out of rows to claim reduce too: at two ranks the link is done well before
        // the reducers are (senders ended at 160-175 us, reducers at 240 us).
        if (warp < staged_senders)
            send_staged(a, ring, warp * per_sender, per_sender, slots, plan, slot_bytes, s_done[warp], comm, &s_abort);
        reduce_staged<T, kRanks>(a, plan, slot_bytes, staged_senders, comm, &s_abort);
        return;
    }
    const StageRing ring = make_stage_ring(smem, num_stages, slot_bytes, threadIdx.x == 0);
    __syncthreads();
    if (warp >= senders) {
        reduce_channel<T, kRanks>(a, channel, senders, slot_bytes, comm, &s_abort);
        return;
    }
    // Sender warp w serves the w-th other rank with its own share of the stages.
    const int per_dest = num_stages / senders;
    const int dest = warp < comm.rank ? warp : warp + 1;
    send_rows(a, ring, warp * per_dest, per_dest, dest, channel, slot_bytes, comm, &s_abort);
}

template <typename T, int kRanks>
cudaError_t launch_for_ranks(const CombineArgs& args, const CommContext& comm, cudaStream_t stream) {
    const int slot_bytes = combine_slot_bytes(args.row_bytes, args.num_topk);
    const int stages = max_pipeline_stages(slot_bytes);
    // At least one stage per destination; the reducers need at least one warp.
    if (stages < comm.num_ranks - 1 || comm.num_ranks > kRanks || comm.num_ranks >= kCombineWarps)
        return cudaErrorInvalidValue;
    const int staged_slot_bytes = staged_slots_per_stage(slot_bytes) * slot_bytes;
    const int staged_stages = max_pipeline_stages(staged_slot_bytes);
    const size_t smem = std::max(stage_ring_smem_bytes(stages, slot_bytes),
                                 staged_stages > 0 ? stage_ring_smem_bytes(staged_stages, staged_slot_bytes) : 0);
    if (const cudaError_t err = allow_dynamic_shared_memory(combine_kernel<T, kRanks>, smem); err != cudaSuccess)
        return err;
    combine_kernel<T, kRanks>
        <<<args.num_channels, kCombineThreads, smem, stream>>>(args, comm, stages, staged_stages, slot_bytes);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const CombineArgs& args, const CommContext& comm, cudaStream_t stream) {
    if (comm.num_ranks <= 2) return launch_for_ranks<T, 2>(args, comm, stream);
    return comm.num_ranks <= 4 ? launch_for_ranks<T, 4>(args, comm, stream)
                               : launch_for_ranks<T, kNumMaxNvlPeers>(args, comm, stream);
}

}  // namespace

int combine_slot_bytes(int row_bytes, int num_topk) { return align_slot(row_bytes + 4 * num_topk); }

cudaError_t launch_combine(const CombineArgs& args, const CommContext& comm, cudaStream_t stream) {
    if (const cudaError_t err = clear_profile(comm, prof::kCombine, stream); err != cudaSuccess) return err;
    switch (args.dtype) {
        case DType::kBFloat16: return launch_typed<__nv_bfloat16>(args, comm, stream);
        case DType::kFloat16: return launch_typed<__half>(args, comm, stream);
        case DType::kFloat32: return launch_typed<float>(args, comm, stream);
        case DType::kFloat64: return launch_typed<double>(args, comm, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace moe_ep::kernels
