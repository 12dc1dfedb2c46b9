// The sending half of a dispatch channel: loader warps fill shared-memory stages (one token each:
// bulk-loaded row + metadata written by lanes), a storer warp pushes every stage with bulk copies into
// the rings of its destination ranks (and into this rank's own outputs) and publishes the ring tails.
// The stage ring itself is shared with the combine kernel.
//
// Ring protocol for one (channel, sender -> receiver) ring of Q slots: the sender writes slot
// pos % Q, then (once the bulk write completed) publishes tail = pos + 1 into the receiver's control
// area; the receiver consumes slots below tail and publishes head into the sender's control area. A
// sender never writes slot pos unless pos - head < Q, and publishes its tail before waiting for head,
// so neither side can wait on work the other has done but not announced.
#pragma once

#include "common/common.cuh"
#include "common/phase_clock.cuh"

namespace moe_ep::kernels {

// Shared-memory stage ring: `num_stages` buffers of `stride` bytes with full/empty barriers and the
// token index / destination mask of what each stage holds.
struct StageRing {
    uint8_t* buffers;
    int stride;
    int num_stages;
    uint64_t* full;
    uint64_t* empty;
    int* token;
    uint32_t* mask;

    MOE_EP_DEVICE uint8_t* stage(int i) const { return buffers + static_cast<size_t>(i) * stride; }
};

// Stages per stage ring (the barrier arrays in its header have this many entries).
constexpr int kMaxStages = 32;
constexpr int kStageAlign = 128;
// Barriers (full, empty), token and mask arrays in front of a pipeline's stage buffers.
constexpr int kStageRingHeaderBytes = kStageAlign * ((16 * kMaxStages + 8 * kMaxStages + kStageAlign - 1) / kStageAlign);

__host__ __device__ inline int stage_stride(int slot_bytes) {
    return (slot_bytes + kStageAlign - 1) / kStageAlign * kStageAlign;
}

// Carves a pipeline's part of the dynamic shared memory into a stage ring; one thread per ring
// (`initializer`) initializes the barriers. Call from all threads, followed by a block-wide barrier.
MOE_EP_DEVICE StageRing make_stage_ring(uint8_t* smem, int num_stages, int slot_bytes, bool initializer) {
    StageRing ring;
    ring.full = reinterpret_cast<uint64_t*>(smem);
    ring.empty = ring.full + kMaxStages;
    ring.token = reinterpret_cast<int*>(ring.empty + kMaxStages);
    ring.mask = reinterpret_cast<uint32_t*>(ring.token + kMaxStages);
    ring.buffers = smem + kStageRingHeaderBytes;
    ring.stride = stage_stride(slot_bytes);
    ring.num_stages = num_stages;
    if (initializer) {
        for (int i = 0; i < num_stages; ++i) {
            mbar_init(ring.full + i, 1);
            mbar_init(ring.empty + i, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        fence_proxy_async_shared();
    }
    return ring;
}

// Shared-memory bytes of one pipeline's stage ring (a multiple of kStageAlign).
__host__ __device__ inline size_t stage_ring_smem_bytes(int num_stages, int slot_bytes) {
    return kStageRingHeaderBytes + static_cast<size_t>(num_stages) * stage_stride(slot_bytes);
}

// Loader side: wait until stage for sequence number `seq` is free. All lanes of the loader warp call it.
MOE_EP_DEVICE bool acquire_stage(const StageRing& ring, int seq, const CommContext& comm, volatile int* abort) {
    bool ok = true;
    if (seq >= ring.num_stages) {
        ok = mbar_wait(ring.empty + seq % ring.num_stages, ((seq / ring.num_stages) - 1) & 1, comm, abort);
    }
    return __all_sync(kFullMask, ok);
}

// Loader side, after the lanes wrote the stage's metadata: lane 0 publishes token/mask and starts the
// bulk load of `bytes` from `src` into the front of the stage. `bytes` may be 0 (sentinel).
MOE_EP_DEVICE void fill_stage(const StageRing& ring, int seq, int token, uint32_t mask, const void* src,
                              uint32_t bytes) {
    const int s = seq % ring.num_stages;
    fence_proxy_async_shared();
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
        ring.token[s] = token;
        ring.mask[s] = mask;
        if (bytes > 0) {
            mbar_arrive_expect_tx(ring.full + s, bytes);
            bulk_load(ring.stage(s), src, bytes, ring.full + s);
        } else {
            mbar_arrive(ring.full + s);
        }
    }
    __syncwarp();
}

// Announces ring position `pos` as the tail: the bulk stores before it (already completed) are made
// visible to the receiver first.
MOE_EP_DEVICE void publish_tail(int* tail_ptr, int pos) {
    fence_proxy_async_global();
    st_release_sys(tail_ptr, pos);
}

// A sender about to write ring position `pos` of a full ring (`pos - head >= ring_slots`): announce
// everything written so far, then wait until the receiver frees a slot (`head` follows it). False on
// timeout or abort.
MOE_EP_DEVICE bool wait_for_ring_slot(int pos, int ring_slots, int* tail_ptr, const int* head_ptr, int& head,
                                      int& published, const CommContext& comm, volatile int* abort,
                                      PhaseClock& clock) {
    bulk_wait<0>();
    clock.lap(prof::kCopyWait);
    publish_tail(tail_ptr, pos);
    published = pos;
    clock.lap(prof::kPublish);
    const bool ok = clock.wait([&] { return pos - (head = ld_acquire_sys(head_ptr)) < ring_slots; }, comm, abort,
                               kErrSendTimeout);
    fence_proxy_async_global();
    clock.lap(prof::kWaitRemote);
    return ok;
}

struct StorerParams {
    int channel;
    int ring_slots;
    int slot_bytes;
    int publish_every;
    // Every destination's tail in the same iteration (every publish_every stages, the first time two
    // stages in) instead of each destination's once it has publish_every new rows.
    bool publish_together;
};

// Storer warp: lane d < R serves destination d; `local` writes the stages meant for this rank itself.
// The sequence of stages ends with a token < 0. Every lane commits one bulk group per stage, so group
// counts line up with stage sequence numbers: a stage is released once the group `read_lag` stages
// back has read it, and a tail is published for the stores `done_lag` stages back once they completed
// (with `publish_together`, the first one for the stores kFirstPublishLag stages back). The lanes'
// phases differ, so `clock` ends with them combined.
constexpr int kFirstPublishLag = 2;
template <typename LocalSink>
MOE_EP_DEVICE void run_storer(const StageRing& ring, const StorerParams& p, const CommContext& comm,
                              const LocalSink& local, volatile int* abort, PhaseClock& clock) {
    // pos after stage seq, by seq % (lag + 1); one storer per block
    __shared__ int s_pos_after[kMaxBulkLag + 1][kNumMaxNvlPeers];
    const int lane = threadIdx.x & 31;
    const int me = comm.rank;
    const int lag_read = read_lag(ring.num_stages, comm.pipeline_lag);
    const int lag_done = lag_read + 4;
    const bool remote_lane = lane < comm.num_ranks && lane != me;
    uint8_t* ring_base = nullptr;
    int* tail_ptr = nullptr;
    const int* head_ptr = comm.peers.ctrl[me] + ctrl::kHead + p.channel * kNumMaxNvlPeers + lane;
    if (remote_lane) {
        ring_base = comm.peers.data[lane] + ring_offset(p.channel, me, comm.num_ranks, p.ring_slots, p.slot_bytes);
        tail_ptr = comm.peers.ctrl[lane] + ctrl::kTail + p.channel * kNumMaxNvlPeers + me;
    }
    int pos = 0, head = 0, published = 0;
    bool ok = true, started = false;
    int seq = 0;
    for (;; ++seq) {
        const int s = seq % ring.num_stages;
        ok = ok && mbar_wait(ring.full + s, (seq / ring.num_stages) & 1, comm, abort);
        if (!__all_sync(kFullMask, ok)) break;
        clock.lap(prof::kWaitStage);
        const int token = ring.token[s];
        if (token < 0) break;
        clock.item();
        const uint32_t mask = ring.mask[s];
        const uint8_t* stage = ring.stage(s);
        const int my_pos = pos;
        if (lane < comm.num_ranks && ((mask >> lane) & 1)) {
            if (lane == me) {
                local.data(stage, token, pos);
            } else {
                if (pos - head >= p.ring_slots) {
                    clock.lap(prof::kCopy);
                    ok = wait_for_ring_slot(pos, p.ring_slots, tail_ptr, head_ptr, head, published, comm, abort,
                                            clock);
                }
                if (ok) bulk_store(ring_base + static_cast<size_t>(pos % p.ring_slots) * p.slot_bytes, stage, p.slot_bytes);
            }
            ++pos;
        }
        bulk_commit();
        if (lane < kNumMaxNvlPeers) s_pos_after[seq % (kMaxBulkLag + 1)][lane] = pos;
        __syncwarp();
        if ((mask >> me) & 1) local.extras(stage, token, __shfl_sync(kFullMask, my_pos, me), lane);
        clock.lap(prof::kCopy);
        bulk_wait_dyn<true>(lag_read);
        __syncwarp();
        clock.lap(prof::kCopyWait);
        if (lane == 0 && seq >= lag_read) mbar_arrive(ring.empty + (seq - lag_read) % ring.num_stages);
        int lag = 0;  // publish the tails of the stores `lag` stages back, if due
        if (!p.publish_together) lag = seq >= lag_done ? lag_done : 0;
        else if (!started) lag = seq >= kFirstPublishLag ? kFirstPublishLag : 0;
        else lag = seq >= lag_done && (seq - lag_done) % p.publish_every == 0 ? lag_done : 0;
        if (lag > 0) {
            started = true;
            const int done = s_pos_after[(seq - lag) % (kMaxBulkLag + 1)][lane];
            if (remote_lane && ok && done > published && (p.publish_together || done - published >= p.publish_every)) {
                bulk_wait_dyn<false>(lag);
                clock.lap(prof::kCopyWait);
                publish_tail(tail_ptr, done);
                published = done;
                clock.lap(prof::kPublish);
            }
        }
    }
    bulk_wait<0>();
    clock.lap(prof::kCopyWait);
    if (remote_lane && ok && *abort == 0 && pos > published) publish_tail(tail_ptr, pos);
    clock.lap(prof::kPublish);
    clock.combine_lanes();
}

}  // namespace moe_ep::kernels
