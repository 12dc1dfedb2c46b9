// The staged combine (CombineArgs::staging_bytes): used when every owner's staging area fits into its
// NVLink buffer. Owner d's staging area starts at its data region: one block per source rank r != d in
// rank order, holding the rows r received from d in r's receive order, which is d's token order
// (position = send_head[t, r]); a slot is the row followed by its k top-k weights.
//
// Work is claimed, not assigned. Sender warps take chunks of rows from one counter per rank and
// reducer warps take tokens from another, so a warp on an SM that is slow under load simply takes
// less; with fixed channels (the rings) the channel of the slowest SM sets the end. Nothing flows back to the senders: the staging area holds every row, and each chunk
// has a ready count at its owner that its sender raises once the chunk's stores have landed.
#pragma once

#include "common/phase_clock.cuh"
#include "common/pipeline.cuh"
#include "intranode/api.cuh"
#include "intranode/kernels/combine_reduce.cuh"

namespace moe_ep::kernels {

constexpr int kStagedStageBytes = 16384;  // a sender stage holds as many slots as fit, at least one
// Sender warps of a staged block: they are not tied to destinations, and one per block (two ranks)
// cannot keep the link busy with its chain of per-row waits (about 1.3 us of work per row: 320 us for
// 170 rows, while the reducers waited for data 220 of their 342 us).
constexpr int kStagedMinSenders = 3;
constexpr int kStagedStoreLag = 3;        // bulk stores whose stage may still be unread when the warp moves on
// Bulk stores a sender warp leaves in flight before it waits for the oldest to land and raises its chunk's
// ready count (Config.pipeline_lag overrides it, up to kMaxStagedSignalLag): about 40 KB per warp
// at hidden 7168, megabytes per GPU. At two ranks 1-3 stores took 342-347 us, 6 and 12 took 384-401 us.
constexpr int kStagedSignalLag = 3;
constexpr int kMaxStagedSignalLag = 12;

// Slots in one sender stage of the staged path.
__host__ __device__ inline int staged_slots_per_stage(int slot_bytes) {
    const int fit = kStagedStageBytes / slot_bytes;
    return fit < 1 ? 1 : fit > 32 ? 32 : fit;
}

// Sender warps of a staged block: one per other rank, at least kStagedMinSenders, but no more than can
// have two of the `staged_stages` stages each (rows of 16 KB leave 13 stages, too few for 7 senders).
MOE_EP_DEVICE int staged_sender_warps(int R, int staged_stages) {
    return max(1, min(max(R - 1, kStagedMinSenders), staged_stages / 2));
}

// Rows rank `from` dispatched to rank `to`, which `to` returns to `from` in combine.
MOE_EP_DEVICE int rows_between(const int* rank_prefix_matrix, int R, int from, int to) {
    return rank_prefix_matrix[from * R + to] - (from > 0 ? rank_prefix_matrix[(from - 1) * R + to] : 0);
}

// First slot of source `source`'s block in the staging area of `owner`.
MOE_EP_DEVICE int staging_block_start(const int* rank_prefix_matrix, int R, int owner, int source) {
    int start = 0;
    for (int r = 0; r < source; ++r)
        if (r != owner) start += rows_between(rank_prefix_matrix, R, owner, r);
    return start;
}

struct StagingPlan {
    bool staged;     // every rank's staging area fits
    int chunk_rows;  // rows per claimed chunk and ready count
};

// The same on every rank, since rank_prefix_matrix is. `stages_per_sender` < 2 rules the path out.
MOE_EP_DEVICE StagingPlan plan_staging(const CombineArgs& a, int R, int slot_bytes, int stages_per_sender) {
    StagingPlan plan{false, a.publish_every};
    if (a.staging_bytes <= 0 || stages_per_sender < 2) return plan;
    int64_t most_bytes = 0;
    int most_rows = 0;
    for (int d = 0; d < R; ++d) {
        int64_t rows = 0;
        for (int r = 0; r < R; ++r) {
            if (r == d) continue;
            const int n = rows_between(a.rank_prefix_matrix, R, d, r);
            rows += n;
            most_rows = max(most_rows, n);
        }
        most_bytes = max(most_bytes, rows * slot_bytes);
    }
    plan.staged = most_bytes <= a.staging_bytes;
    plan.chunk_rows = max(a.publish_every, ceil_div(most_rows, ctrl::kStagingChunks));
    return plan;
}

// What this rank returns to every owner, held by lane d for owner d and read with shuffles (all lanes
// call), so that a sender's per-row chain has no global loads in it.
struct OwedRows {
    int rows;     // rows this rank received from the lane's rank
    int x_first;  // where they start in this rank's x
    int staging;  // where this rank's block starts in the lane's staging area, in slots

    MOE_EP_DEVICE OwedRows(const int* rpm, int R, int me) {
        const int d = threadIdx.x & 31;
        const bool owner = d < R && d != me;
        rows = owner ? rows_between(rpm, R, d, me) : 0;
        x_first = owner && d > 0 ? rpm[(d - 1) * R + me] : 0;
        staging = owner ? staging_block_start(rpm, R, d, me) : 0;
    }
    MOE_EP_DEVICE int rows_of(int owner) const { return __shfl_sync(kFullMask, rows, owner); }
    MOE_EP_DEVICE int x_first_of(int owner) const { return __shfl_sync(kFullMask, x_first, owner); }
    MOE_EP_DEVICE int staging_of(int owner) const { return __shfl_sync(kFullMask, staging, owner); }
};

// A sender warp's source of work: chunk c of the rows owed to owner d is entry c * (R - 1) + i, d the
// i-th rank after this one (so that the ranks start on different links). Entries are claimed in order
// from this rank's counter, so all warps of all ranks move one front through the staging blocks, which
// the owners' reducers follow. All lanes call next(); lane 0 claims.
struct ChunkClaims {
    const OwedRows& owed;
    int* counter;
    int R, me, chunk_rows, num_entries;
    int dest = 0, pos = 0, end = 0;
    int claimed;  // lane 0: the entry claimed for after the current one, in flight while it is sent
    bool done = false;

    MOE_EP_DEVICE ChunkClaims(const OwedRows& owed_, int* counter_, int R_, int me_, int chunk_rows_)
        : owed(owed_), counter(counter_), R(R_), me(me_), chunk_rows(chunk_rows_) {
        num_entries = warp_max(ceil_div(owed.rows, chunk_rows)) * (R - 1);
        claimed = (threadIdx.x & 31) == 0 ? atomicAdd(counter, 1) : 0;
    }

    // The next stage: `rows` (at most max_rows) rows from position `first` of the rows owed to `owner`.
    MOE_EP_DEVICE bool next(int max_rows, int& owner, int& first, int& rows) {
        while (pos >= end) {
            if (done) return false;
            const int entry = __shfl_sync(kFullMask, claimed, 0);
            if ((threadIdx.x & 31) == 0 && entry < num_entries) claimed = atomicAdd(counter, 1);
            if (entry >= num_entries) {
                done = true;
                return false;
            }
            dest = (me + 1 + entry % (R - 1)) % R;
            pos = entry / (R - 1) * chunk_rows;
            end = min(owed.rows_of(dest), pos + chunk_rows);
        }
        owner = dest;
        first = pos;
        rows = min(max_rows, end - pos);
        pos += rows;
        return true;
    }
};

// A stage whose store completes a chunk: the owner and the chunk's index and rows, for its ready count.
struct ChunkDone {
    int owner_chunk;  // owner + 16 * chunk, or -1 when the stage does not end a chunk
    int rows;
};

// Sender warp with stages [first_stage, first_stage + num_stages) of `ring`: bulk-loads claimed rows
// into its stages, lanes add the weights (fetched a stage ahead), lane 0 bulk-stores each stage into the
// owner's staging area. A stage is reused once its store has read it; a chunk's ready count is raised
// once its last store has landed, `signal_lag` stores later; the warp's first chunk at once, so that
// the owners' reducers start early. `done` is the warp's history of its last kMaxStagedSignalLag + 1 stores.
MOE_EP_DEVICE void send_staged(const CombineArgs& a, const StageRing& ring, int first_stage, int num_stages,
                               int slots_per_stage, const StagingPlan& plan, int slot_bytes, ChunkDone* done,
                               const CommContext& comm, volatile int* abort) {
    const int lane = threadIdx.x & 31, me = comm.rank, R = comm.num_ranks, S = num_stages;
    const bool has_weights = a.topk_weights != nullptr && a.num_topk > 0;
    const OwedRows owed(a.rank_prefix_matrix, R, me);
    ChunkClaims claims(owed, comm.peers.ctrl[me] + ctrl::kCombineClaims, R, me, plan.chunk_rows);
    auto first_row = [&](int owner, int first) { return owed.x_first_of(owner) + first; };  // in this rank's x
    auto stage_of = [&](int seq) { return first_stage + seq % S; };

    auto load = [&](int seq) {
        int owner, first, rows;
        if (!claims.next(slots_per_stage, owner, first, rows)) return false;
        const int s = stage_of(seq);
        uint8_t* stage = ring.stage(s);
        const uint8_t* src = static_cast<const uint8_t*>(a.x) + static_cast<size_t>(first_row(owner, first)) * a.row_bytes;
        if (lane == 0) {
            ring.token[s] = first;
            ring.mask[s] = static_cast<uint32_t>(owner) | static_cast<uint32_t>(rows) << 8;
            mbar_arrive_expect_tx(ring.full + s, static_cast<uint32_t>(rows) * a.row_bytes);
        }
        __syncwarp();
        if (slot_bytes == a.row_bytes) {  // the slots are the rows: one copy
            if (lane == 0) bulk_load(stage, src, static_cast<uint32_t>(rows) * a.row_bytes, ring.full + s);
        } else if (lane < rows) {
            bulk_load(stage + static_cast<size_t>(lane) * slot_bytes, src + static_cast<size_t>(lane) * a.row_bytes,
                      a.row_bytes, ring.full + s);
        }
        return true;
    };

    // Weights of a stage: the first kPrefetched per lane are loaded a stage ahead, the rest when stored.
    constexpr int kPrefetched = 4;
    struct Weights {
        float v[kPrefetched];
    };
    auto fetch_weights = [&](int s) {
        Weights w{};
        const int rows = static_cast<int>(ring.mask[s] >> 8), owner = static_cast<int>(ring.mask[s] & 0xff);
        const int n = rows * a.num_topk, row = first_row(owner, ring.token[s]);
#pragma unroll
        for (int j = 0; j < kPrefetched; ++j) {
            const int e = lane + 32 * j;
            if (e < n) w.v[j] = a.topk_weights[static_cast<size_t>(row) * a.num_topk + e];
        }
        return w;
    };
    auto put_weights = [&](int s, const Weights& w) {
        const int rows = static_cast<int>(ring.mask[s] >> 8), owner = static_cast<int>(ring.mask[s] & 0xff);
        const int n = rows * a.num_topk, row = first_row(owner, ring.token[s]);
        uint8_t* stage = ring.stage(s);
        for (int e = lane, j = 0; e < n; e += 32, ++j) {
            const int i = e / a.num_topk, k = e % a.num_topk;
            reinterpret_cast<float*>(stage + static_cast<size_t>(i) * slot_bytes + a.row_bytes)[k] =
                j < kPrefetched ? w.v[j] : a.topk_weights[static_cast<size_t>(row) * a.num_topk + e];
        }
        fence_proxy_async_shared();
    };

    auto signal = [&](const ChunkDone& d) {  // lane 0, once the chunk's stores have landed
        if (d.owner_chunk < 0) return;
        fence_proxy_async_global();
        red_add_release_sys(comm.peers.ctrl[d.owner_chunk % 16] + ctrl::kStagingReady + me * ctrl::kStagingChunks +
                                d.owner_chunk / 16,
                            d.rows);
    };

    const int lag_read = min(kStagedStoreLag, S - 1);
    const int signal_lag = comm.pipeline_lag > 0 ? min(comm.pipeline_lag, kMaxStagedSignalLag) : kStagedSignalLag;
    constexpr int kHistory = kMaxStagedSignalLag + 1;
    PhaseClock clock(comm, prof::record(prof::kCombine, blockIdx.x, threadIdx.x / 32));
    int loaded = 0;
    while (loaded < S - lag_read && load(loaded)) ++loaded;
    Weights weights{};
    if (has_weights && loaded > 0) weights = fetch_weights(stage_of(0));
    clock.lap(prof::kMeta);
    int seq = 0, next_signal = 0;  // lane 0: the oldest store not signaled yet
    bool first_chunk = true;       // lane 0: no chunk of this warp ended yet
    for (; seq < loaded; ++seq) {
        const int s = stage_of(seq);
        if (!__all_sync(kFullMask, mbar_wait(ring.full + s, (seq / S) & 1, comm, abort))) break;
        clock.lap(prof::kWaitStage);
        clock.item();
        if (has_weights) {
            put_weights(s, weights);
            if (seq + 1 < loaded) weights = fetch_weights(stage_of(seq + 1));
        }
        const int owner = static_cast<int>(ring.mask[s] & 0xff), rows = static_cast<int>(ring.mask[s] >> 8);
        const int first = ring.token[s], owed_rows = owed.rows_of(owner), staging_first = owed.staging_of(owner);
        __syncwarp();
        if (lane == 0) {
            uint8_t* staging = comm.peers.data[owner] + static_cast<size_t>(staging_first + first) * slot_bytes;
            bulk_store(staging, ring.stage(s), static_cast<uint32_t>(rows) * slot_bytes);
            bulk_commit();
            clock.lap(prof::kCopy);
            const int chunk = first / plan.chunk_rows, chunk_end = min(owed_rows, (chunk + 1) * plan.chunk_rows);
            done[seq % kHistory] =
                first + rows == chunk_end ? ChunkDone{owner + 16 * chunk, chunk_end - chunk * plan.chunk_rows}
                                          : ChunkDone{-1, 0};
            bulk_wait_dyn<true>(lag_read);  // the store of stage seq - lag_read has read its stage
            int landed = -1;  // signal the stores up to this one
            if (first_chunk && done[seq % kHistory].owner_chunk >= 0) {
                bulk_wait<0>();
                landed = seq;
                first_chunk = false;
            } else if (seq - next_signal >= signal_lag) {
                bulk_wait_dyn<false>(signal_lag);
                landed = seq - signal_lag;
            }
            clock.lap(prof::kCopyWait);
            for (; next_signal <= landed; ++next_signal) signal(done[next_signal % kHistory]);
            clock.lap(prof::kPublish);
        }
        __syncwarp();
        clock.lap(prof::kCopy);
        if (load(loaded)) {  // into the stage of seq - lag_read
            ++loaded;
            if (has_weights && seq + 1 == loaded - 1) weights = fetch_weights(stage_of(seq + 1));
        }
        clock.lap(prof::kMeta);
    }
    if (lane == 0) {
        bulk_wait<0>();
        clock.lap(prof::kCopyWait);
        if (*abort == 0)
            for (; next_signal < seq; ++next_signal) signal(done[next_signal % kHistory]);
        clock.lap(prof::kPublish);
    }
    __syncwarp();
    clock.combine_lanes();
}

// Reducer warp: claims this rank's tokens one at a time (the next claim is in flight while it reduces).
// Lane r waits for the ready count of the chunk holding the token's row from rank r. Every contribution
// is prefetched into L2 first, so that the reduction's rounds of loads, each bounded by registers, wait
// on L2 rather than on HBM.
template <typename T, int kRanks>
MOE_EP_DEVICE void reduce_staged(const CombineArgs& a, const StagingPlan& plan, int slot_bytes, int senders,
                                 const CommContext& comm, volatile int* abort) {
    const int lane = threadIdx.x & 31, R = comm.num_ranks, me = comm.rank;
    const int* rpm = a.rank_prefix_matrix;
    const bool peer_lane = lane < R && lane != me;
    const int rows_from_lane = peer_lane ? rows_between(rpm, R, me, lane) : 0;
    const uint8_t* block = comm.peers.data[me] +
                           static_cast<size_t>(peer_lane ? staging_block_start(rpm, R, me, lane) : 0) * slot_bytes;
    const int* ready = comm.peers.ctrl[me] + ctrl::kStagingReady + lane * ctrl::kStagingChunks;
    const int self_base = me > 0 ? rpm[(me - 1) * R + me] : 0;
    int* token_counter = comm.peers.ctrl[me] + ctrl::kCombineClaims + 1;
    auto claim = [&] { return lane == 0 ? atomicAdd(token_counter, 1) : 0; };
    int known_chunk = -1;

    PhaseClock clock(comm, prof::record(prof::kCombine, blockIdx.x, prof::kCombineReducer),
                     threadIdx.x / 32 == senders ? ClockWriter::kSharedWithTimestamps : ClockWriter::kShared);
    for (int t = __shfl_sync(kFullMask, claim(), 0); t < a.num_tokens;) {
        const int next = claim();
        if (*abort) break;
        const uint32_t mask = __ballot_sync(
            kFullMask, lane < R && reinterpret_cast<const uint8_t*>(a.is_token_in_rank)[static_cast<size_t>(t) * R + lane] != 0);
        const uint8_t* row = nullptr;
        bool ok = true;
        if ((mask >> lane) & 1) {
            const int pos = a.send_head[static_cast<size_t>(t) * R + lane];
            if (lane == me) {
                row = static_cast<const uint8_t*>(a.x) + static_cast<size_t>(self_base + pos) * a.row_bytes;
                prefetch_l2(row, a.row_bytes);
            } else {
                const int chunk = pos / plan.chunk_rows;
                if (chunk > known_chunk) {
                    const int expected = min(plan.chunk_rows, rows_from_lane - chunk * plan.chunk_rows);
                    // Polls are plain loads, spaced out: hundreds of lanes spinning with system-scope
                    // acquires on the few lines of the front slow the whole GPU down.
                    ok = clock.wait(
                        [&] {
                            if (ld_volatile(ready + chunk) >= expected) return true;
                            __nanosleep(128);
                            return false;
                        },
                        comm, abort, kErrRecvTimeout);
                    ld_acquire_sys(ready + chunk);  // orders the slot reads after the count
                    known_chunk = chunk;
                }
                row = block + static_cast<size_t>(pos) * slot_bytes;
                prefetch_l2(row, a.row_bytes);
            }
        }
        __syncwarp();  // lane r's acquire of r's ready count covers every lane's reads of r's slots
        if (!__all_sync(kFullMask, ok)) break;
        clock.item_after_lane_waits();
        reduce_token<T, kRanks>(a, t, mask, row, me, lane);
        t = __shfl_sync(kFullMask, next, 0);
        clock.lap(prof::kCopy);
    }
}

}  // namespace moe_ep::kernels
