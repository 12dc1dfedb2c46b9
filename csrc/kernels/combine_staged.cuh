// The staged combine path (launch_combine in api.cuh). Owner d's staging area starts at its NVLink
// data region: one block per source rank r != d in rank order, holding the rows r received from d in
// r's receive order (which is d's token order: position = send_head[t, r]); a slot is the row followed
// by its k top-k weights. Every rank's sender pipelines take equal slices of each block they owe, so
// all pipelines of all ranks finish together; nothing flows back but a ready count per chunk of rows,
// which is why a sender never waits for an owner.
#pragma once

#include "combine_reduce.cuh"
#include "pipeline.cuh"

namespace moe_ep::kernels {

constexpr int kStagedSenderWarps = 2;     // sender pipelines per block
constexpr int kStagedMaxStages = 16;      // stages per sender pipeline
constexpr int kStagedStoreLag = 3;        // bulk stores left in flight before a stage is reused
constexpr int kStagedStageBytes = 16384;  // slots per stage: as many as fit in this many bytes

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
    int chunk_rows;  // rows per ready count
};

// The same on every rank, since rank_prefix_matrix is.
MOE_EP_DEVICE StagingPlan plan_staging(const CombineArgs& a, int R, int slot_bytes) {
    StagingPlan plan{false, a.publish_every};
    if (a.staging_bytes <= 0) return plan;
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

// What a sender stage holds: `rows` slots of the block owed to `dest`, from position `pos` of that
// block, inside chunk `chunk` of `chunk_rows` rows (a chunk is one pipeline's, whole).
struct StagedStage {
    int dest, pos, rows, chunk, chunk_rows;
};

// Walks a sender pipeline's stages. The chunks this rank owes are listed chunk 0 of every owner (rotated,
// so that the ranks start on different links), then chunk 1 of every owner, ...; pipeline p sends
// entries p, p + P, p + 2P, ... So all pipelines of all ranks move one front through every block at
// once, which the owners' reducers follow, and no pipeline has more than one chunk more than another.
struct StagedCursor {
    const int* rpm;
    int R, me, pipe, num_pipes, slots_per_stage, chunk_rows;
    int most_chunks = 0, entry, pos = 0, end = 0;

    MOE_EP_DEVICE StagedCursor(const int* rpm_, int R_, int me_, int pipe_, int num_pipes_, int slots, int chunk)
        : rpm(rpm_), R(R_), me(me_), pipe(pipe_), num_pipes(num_pipes_), slots_per_stage(slots), chunk_rows(chunk),
          entry(pipe_ - num_pipes_) {
        for (int d = 0; d < R; ++d)
            if (d != me) most_chunks = max(most_chunks, ceil_div(rows_between(rpm, R, d, me), chunk_rows));
    }

    MOE_EP_DEVICE int dest() const { return (me + 1 + entry % (R - 1)) % R; }
    MOE_EP_DEVICE int chunk() const { return entry / (R - 1); }

    MOE_EP_DEVICE bool next(StagedStage& st) {
        while (pos >= end) {
            entry += num_pipes;
            if (entry >= most_chunks * (R - 1)) return false;
            pos = chunk() * chunk_rows;
            end = min(rows_between(rpm, R, dest(), me), pos + chunk_rows);
        }
        st = {dest(), pos, min(slots_per_stage, end - pos), chunk(), end - chunk() * chunk_rows};
        pos += st.rows;
        return true;
    }
};

// Sender warp: bulk-loads slots into its stages, lanes add the weights (fetched one stage ahead), lane 0
// bulk-stores each stage into the owner's staging area. A stage is reused once its store has read it;
// ready counts follow further behind: once the last store of a chunk has landed, the owner's count
// for that chunk becomes its row count.
MOE_EP_DEVICE void send_staged(const CombineArgs& a, const StageRing& ring, StagedStage* desc, StagedStage* sent,
                               int pipe, int num_pipes, int slot_bytes, int slots_per_stage, int chunk_rows,
                               const CommContext& comm, volatile int* abort) {
    const int lane = threadIdx.x & 31, me = comm.rank, R = comm.num_ranks, S = ring.num_stages;
    const int* rpm = a.rank_prefix_matrix;
    const bool has_weights = slot_bytes != a.row_bytes;
    if (R < 2) return;
    StagedCursor cursor(rpm, R, me, pipe, num_pipes, slots_per_stage, chunk_rows);
    auto first_row = [&](const StagedStage& st) {  // of the stage, in this rank's x
        return (st.dest > 0 ? rpm[(st.dest - 1) * R + me] : 0) + st.pos;
    };

    auto load = [&](int seq) {
        StagedStage st;
        if (!cursor.next(st)) return false;
        const int s = seq % S;
        uint8_t* stage = ring.stage(s);
        const uint8_t* src = static_cast<const uint8_t*>(a.x) + static_cast<size_t>(first_row(st)) * a.row_bytes;
        if (lane == 0) {
            desc[s] = st;
            mbar_arrive_expect_tx(ring.full + s, static_cast<uint32_t>(st.rows) * a.row_bytes);
        }
        __syncwarp();
        if (!has_weights) {  // the slots are the rows: one copy
            if (lane == 0) bulk_load(stage, src, static_cast<uint32_t>(st.rows) * a.row_bytes, ring.full + s);
        } else if (lane < st.rows) {
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
    auto fetch_weights = [&](const StagedStage& st) {
        Weights w{};
        const int n = st.rows * a.num_topk, row = first_row(st);
#pragma unroll
        for (int j = 0; j < kPrefetched; ++j) {
            const int e = lane + 32 * j;
            if (e < n) w.v[j] = a.topk_weights[static_cast<size_t>(row + e / a.num_topk) * a.num_topk + e % a.num_topk];
        }
        return w;
    };
    auto put_weights = [&](const StagedStage& st, uint8_t* stage, const Weights& w) {
        const int n = st.rows * a.num_topk, row = first_row(st);
        for (int e = lane, j = 0; e < n; e += 32, ++j) {
            const int i = e / a.num_topk, k = e % a.num_topk;
            reinterpret_cast<float*>(stage + static_cast<size_t>(i) * slot_bytes + a.row_bytes)[k] =
                j < kPrefetched ? w.v[j] : a.topk_weights[static_cast<size_t>(row + i) * a.num_topk + k];
        }
        fence_proxy_async_shared();
    };

    // Lane 0, for the stores in order: when `st` ends its chunk, `landed` makes sure the store has landed,
    // then the owner learns that the chunk is complete.
    auto signal = [&](const StagedStage& st, auto&& landed) {
        if (st.pos + st.rows != st.chunk * chunk_rows + st.chunk_rows) return;
        landed();
        fence_proxy_async_global();
        red_add_release_sys(comm.peers.ctrl[st.dest] + ctrl::kStagingReady + me * ctrl::kStagingChunks + st.chunk,
                            st.chunk_rows);
    };

    const int lag_read = min(kStagedStoreLag, S - 1);
    const int lag_done = kMaxBulkLag;  // stores in flight before the oldest must have landed to signal it
    MOE_EP_PROF(ProfRole timing; timing.begin(); uint64_t t_prof = timing.start;)
    int loaded = 0;
    while (loaded < S - lag_read && load(loaded)) ++loaded;
    Weights weights{};
    if (has_weights && loaded > 0) weights = fetch_weights(desc[0]);
    int seq = 0;
    for (; seq < loaded; ++seq) {
        const int s = seq % S;
        MOE_EP_PROF(t_prof = timing.add(prof::kCopy, t_prof);)
        if (!__all_sync(kFullMask, mbar_wait(ring.full + s, (seq / S) & 1, comm, abort))) break;
        MOE_EP_PROF(t_prof = timing.add(prof::kWaitStage, t_prof); timing.mark_first(); timing.count(prof::kItems);)
        const StagedStage st = desc[s];
        uint8_t* stage = ring.stage(s);
        if (has_weights) {
            put_weights(st, stage, weights);
            if (seq + 1 < loaded) weights = fetch_weights(desc[(seq + 1) % S]);
        }
        __syncwarp();
        if (lane == 0) {
            uint8_t* staging = comm.peers.data[st.dest] +
                               static_cast<size_t>(staging_block_start(rpm, R, st.dest, me) + st.pos) * slot_bytes;
            bulk_store(staging, stage, static_cast<uint32_t>(st.rows) * slot_bytes);
            bulk_commit();
            sent[seq % (kMaxBulkLag + 1)] = st;
            MOE_EP_PROF(t_prof = timing.add(prof::kCopy, t_prof);)
            bulk_wait_dyn<true>(lag_read);  // the store of stage seq - lag_read has read its stage
            MOE_EP_PROF(t_prof = timing.add(prof::kCopyWait, t_prof);)
            if (seq >= lag_done) signal(sent[(seq - lag_done) % (kMaxBulkLag + 1)], [] { bulk_wait<kMaxBulkLag>(); });
            MOE_EP_PROF(t_prof = timing.add(prof::kPublish, t_prof);)
        }
        __syncwarp();
        if (load(loaded)) {  // into the stage of seq - lag_read
            ++loaded;
            if (has_weights && seq + 1 == loaded - 1) weights = fetch_weights(desc[(seq + 1) % S]);
        }
    }
    MOE_EP_PROF(t_prof = timing.add(prof::kCopy, t_prof);)
    if (lane == 0) {
        bulk_wait<0>();
        MOE_EP_PROF(t_prof = timing.add(prof::kCopyWait, t_prof);)
        for (int i = max(0, seq - lag_done); i < seq; ++i) signal(sent[i % (kMaxBulkLag + 1)], [] {});
        MOE_EP_PROF(timing.add(prof::kPublish, t_prof);)
    }
    __syncwarp();
    MOE_EP_PROF(timing.store(comm, prof::kCombine, blockIdx.x, prof::kStagedSender + threadIdx.x / 32);)
}

// Reducer warps [first_warp, last warp of the block]: the reducer warps of all blocks take this rank's
// tokens round robin, so that together they follow the senders' front. Lane r waits for the ready count
// of the chunk holding the token's row from rank r.
template <typename T, int kRanks>
MOE_EP_DEVICE void reduce_staged(const CombineArgs& a, int first_warp, int slot_bytes, int chunk_rows,
                                 const CommContext& comm, volatile int* abort) {
    const int num_warps = blockDim.x / 32 - first_warp, warp = threadIdx.x / 32 - first_warp, lane = threadIdx.x & 31;
    const int R = comm.num_ranks, me = comm.rank;
    const int* rpm = a.rank_prefix_matrix;
    const bool peer_lane = lane < R && lane != me;
    const int rows_from_lane = peer_lane ? rows_between(rpm, R, me, lane) : 0;
    const uint8_t* block = comm.peers.data[me] +
                           static_cast<size_t>(peer_lane ? staging_block_start(rpm, R, me, lane) : 0) * slot_bytes;
    const int* ready = comm.peers.ctrl[me] + ctrl::kStagingReady + lane * ctrl::kStagingChunks;
    const int self_base = me > 0 ? rpm[(me - 1) * R + me] : 0;
    int known_chunk = -1;

    MOE_EP_PROF(ProfRole timing; timing.begin(); uint64_t t_prof = timing.start;)
    for (int t = blockIdx.x * num_warps + warp; t < a.num_tokens; t += gridDim.x * num_warps) {
        if (*abort) break;
        const uint32_t mask = __ballot_sync(
            kFullMask, lane < R && reinterpret_cast<const uint8_t*>(a.is_token_in_rank)[static_cast<size_t>(t) * R + lane] != 0);
        const uint8_t* row = nullptr;
        bool ok = true;
        MOE_EP_PROF(uint64_t lane_wait = 0;)
        if ((mask >> lane) & 1) {
            const int pos = a.send_head[static_cast<size_t>(t) * R + lane];
            if (lane == me) {
                row = static_cast<const uint8_t*>(a.x) + static_cast<size_t>(self_base + pos) * a.row_bytes;
            } else {
                const int chunk = pos / chunk_rows;
                if (chunk != known_chunk) {
                    const int expected = min(chunk_rows, rows_from_lane - chunk * chunk_rows);
                    MOE_EP_PROF(lane_wait = global_timer_ns();)
                    // Polls are plain loads, spaced out: hundreds of lanes spinning with system-scope
                    // acquires on the few lines of the front slow the whole GPU down.
                    ok = wait_until(
                        [&] {
                            if (ld_volatile(ready + chunk) >= expected) return true;
                            __nanosleep(128);
                            return false;
                        },
                        comm, abort, kErrRecvTimeout);
                    ld_acquire_sys(ready + chunk);  // orders the slot reads after the count
                    MOE_EP_PROF(lane_wait = global_timer_ns() - lane_wait;)
                    known_chunk = chunk;
                }
                row = block + static_cast<size_t>(pos) * slot_bytes;
            }
        }
        __syncwarp();  // lane r's acquire of r's ready count covers every lane's reads of r's slots
        if (!__all_sync(kFullMask, ok)) break;
        MOE_EP_PROF({
            const uint64_t now = global_timer_ns();
            const uint32_t waited = __reduce_max_sync(kFullMask, static_cast<uint32_t>(lane_wait));
            const uint32_t spent = static_cast<uint32_t>(now - t_prof);
            timing.acc[prof::kWaitRemote] += waited;
            timing.acc[prof::kMeta] += spent > waited ? spent - waited : 0;
            timing.count(prof::kItems);
            timing.mark_first();
            t_prof = now;
        })
        const uint8_t* rows[kRanks];
#pragma unroll
        for (int r = 0; r < kRanks; ++r)
            rows[r] = reinterpret_cast<const uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), r));
        reduce_token<T, kRanks>(a, t, mask, rows, me, lane);
        MOE_EP_PROF(t_prof = timing.add(prof::kCopy, t_prof);)
    }
    MOE_EP_PROF(timing.store(comm, prof::kCombine, blockIdx.x, prof::kCombineReducer, true, warp == 0);)
}

}  // namespace moe_ep::kernels
