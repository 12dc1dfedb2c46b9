// Low-latency combine (the protocol: low_latency/api.cuh).
//
// Semantics (docs/semantics.md): the rank r holding experts of token t of source s reduces them first,
// P[r, t] = bf16(sum over t's slots j on r, in slot order, of w[t, j] * y[e_j][row of t]) in float32 with
// separate multiply and add, and sends the one row P[r, t] to s; s sums the partial rows of t's ranks in
// ascending rank order in float32 and rounds to BF16 (out[t] = 0 when t has no valid slot).
//
// The weights are combine arguments, known only on s: the send phase first sends each token's top-k ids
// and weights to every rank hosting one of its experts (metadata), then reduces the tokens it received
// in the dispatch as their metadata arrives. Send phase, in two loops so that every warp has made all of
// its stores before it waits for anything:
//  1. stores only: items t < T send token t's metadata (entries, then one release flag per destination,
//     lanes in parallel); items T + (local expert, source) record where each of the pair's packed rows
//     lies: rowmap[source][token][local expert] = row, tagged with the operation;
//  2. one warp per received row (workers per (local expert, source) pair, as the dispatch receive): wait
//     for its token's metadata; the row of the token's first slot on this rank reduces all of the token's
//     local rows (their positions from the rowmap) and stores P to data[this rank][token] of the source,
//     then releases flags[this rank][token] there; the other rows are done.
// Receive phase: a block per token waits for the flags of the ranks its valid slots name and sums their
// partial rows in ascending rank order.
//
// LogFMT (CombineArgs::logfmt): the warp reducing a token writes P to this rank's send region (free: a
// LogFMT combine is never zero-copy), encodes it into the stage row of the pair (logfmt.cuh) and copies
// (or puts) the encoded bytes; the flag's value says whether the row is in the LogFMT layout (1) or plain
// BF16 (0). The receive phase reads the headers of a token's LogFMT rows into shared memory and decodes
// each vector as it sums.
#include <climits>

#include <cuda_bf16.h>

#include "low_latency/kernels/logfmt.cuh"
#include "low_latency/kernels/operation.cuh"
#include "low_latency/kernels/rows.cuh"
#include "low_latency/kernels/schedule.cuh"
#include "low_latency/kernels/signals.cuh"

namespace moe_ep::kernels::ll {

namespace {

constexpr int kPartialUnroll = 4;  // vectors per lane reduced together into a partial row
constexpr int kPartialRows = 2;    // local expert rows loaded together into a partial row
constexpr int kReduceBatch = 8;    // partial rows loaded together by the receive phase's sum

// The rank hosting a top-k slot's expert; -1 for a masked (or out-of-range) slot.
MOE_EP_DEVICE int rank_of_slot(int64_t expert, int num_experts, int num_local) {
    return expert >= 0 && expert < num_experts ? static_cast<int>(expert) / num_local : -1;
}

// Lane j holds slot j's rank (-1 for none): true on the lane of the first slot of each rank.
MOE_EP_DEVICE bool first_slot_of_rank(int rank, int lane) {
    const uint32_t same = __match_any_sync(kFullMask, rank);
    return rank >= 0 && __ffs(same) - 1 == lane;
}

// Loop 1: token `t`'s ids and weights into entries meta[this rank][t][j] of every rank hosting one of its
// experts, then one flag per destination (each released by the lane of its first slot). True when
// NVSHMEM puts were issued (peers without P2P, staged once in stage_meta[t]).
MOE_EP_DEVICE bool send_metadata(const CombineArgs& a, const Context& c, const Layout& L, const Phase& op, int t,
                                 int lane) {
    const int num_local = a.num_experts / c.comm.num_ranks;
    const int64_t at = static_cast<int64_t>(t) * a.num_topk + lane;
    const int64_t e = lane < a.num_topk ? __ldg(a.topk_idx + at) : -1;
    const float weight = lane < a.num_topk ? __ldg(a.topk_weights + at) : 0.0f;
    const int dst = rank_of_slot(e, a.num_experts, num_local);
    const bool first = first_slot_of_rank(dst, lane) && !left_out(c, dst);
    const uint32_t firsts = __ballot_sync(kFullMask, first);
    const int64_t pair = static_cast<int64_t>(c.comm.rank) * a.max_tokens + t;  // (source, token) on the destination
    const int64_t entry_offset = op.meta + pair * kMetaBytes + lane * kMetaEntryBytes;
    const uint2 entry = make_uint2(static_cast<uint32_t>(dst >= 0 ? static_cast<int>(e) : -1), __float_as_uint(weight));
    const uint64_t signal = make_signal(op.tag, 0);
    bool puts = false;
    for (uint32_t rest = firsts; rest != 0; rest &= rest - 1) {
        uint8_t* peer = c.peers[__shfl_sync(kFullMask, dst, __ffs(rest) - 1)];
        if (peer == nullptr)
            puts = true;
        else if (lane < a.num_topk)
            *reinterpret_cast<uint2*>(peer + entry_offset) = entry;
    }
    if (puts) {
        uint8_t* staged = c.local + L.stage_meta + static_cast<int64_t>(t) * kMetaBytes;
        if (lane < a.num_topk) reinterpret_cast<uint2*>(staged)[lane] = entry;
        for (uint32_t rest = firsts; rest != 0; rest &= rest - 1) {
            const int r = __shfl_sync(kFullMask, dst, __ffs(rest) - 1);
            if (c.peers[r] == nullptr)
                put_row_with_signal(c.local + op.meta + pair * kMetaBytes, staged, a.num_topk * kMetaEntryBytes,
                                    reinterpret_cast<uint64_t*>(c.local + op.meta_flags + pair * 8), signal, r);
        }
    }
    // __syncwarp orders every lane's entry stores before the releases (release is cumulative).
    __syncwarp();
    if (first && c.peers[dst] != nullptr)
        st_release_sys_u64(reinterpret_cast<uint64_t*>(c.peers[dst] + op.meta_flags + pair * 8), signal);
    return puts;
}

// Loop 1: rowmap[source][token][local expert] = packed row, for every row of the pair (lanes over rows).
MOE_EP_DEVICE void record_rows(const CombineArgs& a, const Context& c, const Layout& L, const Phase& op, int pair,
                               int lane) {
    const int num_ranks = c.comm.num_ranks;
    const int num_local = a.num_experts / num_ranks;
    const int local_expert = pair / num_ranks, src = pair % num_ranks;
    const int64_t range = __ldg(a.layout_range + local_expert * num_ranks + src);
    const int count = static_cast<int>(range & 0xffffffff), begin = static_cast<int>(range >> 32);
    const int64_t slots = static_cast<int64_t>(num_ranks) * a.max_tokens;
    uint64_t* rowmap = reinterpret_cast<uint64_t*>(c.local + L.rowmap);
    for (int i = lane; i < count; i += 32) {
        const int row = begin + i;
        const int token = __ldg(a.src_info + local_expert * slots + row);
        if (token >= 0 && token < a.max_tokens)
            st_relaxed_gpu_u64(rowmap + (static_cast<int64_t>(src) * a.max_tokens + token) * num_local + local_expert,
                               make_signal(op.tag, static_cast<uint32_t>(row)));
    }
}

MOE_EP_DEVICE void add_weighted(float* acc, const int4& row, float w) {
    const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&row);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(y[i]);
        acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(w, f.x));
        acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(w, f.y));
    }
}

MOE_EP_DEVICE int4 to_bf16x8(const float* acc) {
    int4 result;
    __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    return result;
}

// dst = bf16(sum over the slots of `slots` in slot order of weight_j * row_j) with the whole warp; lane j
// holds slot j's `row` and `weight`.
MOE_EP_DEVICE void reduce_partial_row(int4* dst, const int4* row, float weight, uint32_t slots, int vectors, int lane) {
    for (int base = 0; base < vectors; base += 32 * kPartialUnroll) {
        float acc[kPartialUnroll][8];
#pragma unroll
        for (int u = 0; u < kPartialUnroll; ++u)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
        for (uint32_t rest = slots; rest != 0;) {
            // Up to kPartialRows slots at a time: their loads are all in flight before the first is added.
            int4 v[kPartialRows][kPartialUnroll];
            float w[kPartialRows];
            int taken = 0;
#pragma unroll
            for (int s = 0; s < kPartialRows; ++s) {
                const int j = __ffs(rest) - 1;  // -1 once `rest` is empty: nothing loaded for it
                const int4* src = reinterpret_cast<const int4*>(
                    __shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(row), max(j, 0)));
                w[s] = __shfl_sync(kFullMask, weight, max(j, 0));
                if (j >= 0) {
                    rest &= rest - 1;
                    taken = s + 1;
#pragma unroll
                    for (int u = 0; u < kPartialUnroll; ++u) {
                        const int i = base + u * 32 + lane;
                        if (i < vectors) v[s][u] = __ldg(src + i);
                    }
                }
            }
#pragma unroll
            for (int s = 0; s < kPartialRows; ++s)
                if (s < taken)
#pragma unroll
                    for (int u = 0; u < kPartialUnroll; ++u) add_weighted(acc[u], v[s][u], w[s]);
        }
#pragma unroll
        for (int u = 0; u < kPartialUnroll; ++u) {
            const int i = base + u * 32 + lane;
            if (i < vectors) dst[i] = to_bf16x8(acc[u]);
        }
    }
}

// The partial row of a token in LogFMT: reduced into `partial` (this rank's send region), encoded into
// `staged` (the pair's stage row), then its bytes (the encoded row, or the BF16 one when that is
// smaller) stored to the source's `peer_row` and released by `peer_flag`, or, without a mapping
// (`peer_row` null), put to `sym_row` with signal `sym_flag`; the signal's value gives the format.
// Returns whether it put.
MOE_EP_DEVICE bool send_logfmt_row(const int4* row, float weight, uint32_t slots, int hidden, uint8_t* partial,
                                             uint8_t* staged, uint8_t* peer_row, uint64_t* peer_flag, uint8_t* sym_row,
                                             uint64_t* sym_flag, uint32_t tag, int src, int lane) {
    reduce_partial_row(reinterpret_cast<int4*>(partial), row, weight, slots, hidden / 8, lane);
    __syncwarp();  // every lane reads what the others wrote
    const int encoded = logfmt_encode_row(reinterpret_cast<const int4*>(partial), staged, hidden, lane);
    __syncwarp();
    const uint8_t* wire = encoded > 0 ? staged : partial;
    const int bytes = encoded > 0 ? encoded : 2 * hidden;
    const uint64_t signal = make_signal(tag, encoded > 0 ? 1u : 0u);
    if (peer_row == nullptr) {
        put_row_with_signal(sym_row, wire, bytes, sym_flag, signal, src);
        return true;
    }
    copy_row(reinterpret_cast<int4*>(peer_row), reinterpret_cast<const int4*>(wire), bytes / 16, lane);
    __syncwarp();  // orders every lane's stores before lane 0's release
    if (lane == 0) st_release_sys_u64(peer_flag, signal);
    return false;
}

// Loop 2, for one received row (local expert, source `src`, `token`): waits for the token's metadata;
// if the row belongs to the token's first slot on this rank, reduces all of the token's local rows into
// its partial row and delivers it to `src` (rows of the token's other slots are done). False when a
// wait gave up; in elastic mode a source left out is skipped.
template <bool kLogfmt>
MOE_EP_DEVICE bool reduce_token(const CombineArgs& a, const Context& c, const Layout& L, const Phase& op,
                                int local_expert, int src, int token, int lane, uint64_t& waited, bool& used_puts) {
    const int num_ranks = c.comm.num_ranks, rank = c.comm.rank;
    const int num_local = a.num_experts / num_ranks;
    const int64_t pair = static_cast<int64_t>(src) * a.max_tokens + token;
    Arrival arrival = Arrival::kReady;
    if (lane == 0) {
        uint32_t unused;
        arrival = wait_signal(reinterpret_cast<const uint64_t*>(c.local + op.meta_flags) + pair, op.tag, c, src, unused,
                              waited);
    }
    // __syncwarp orders lane 0's acquire before the other lanes' reads of the entries.
    __syncwarp();
    arrival = static_cast<Arrival>(__shfl_sync(kFullMask, static_cast<int>(arrival), 0));
    if (arrival != Arrival::kReady) return arrival == Arrival::kLeftOut;
    bool ok = true;
    int expert = -1;
    float weight = 0.0f;
    if (lane < a.num_topk) {
        const uint2 entry = reinterpret_cast<const uint2*>(c.local + op.meta + pair * kMetaBytes)[lane];
        expert = static_cast<int>(entry.x);
        weight = __uint_as_float(entry.y);
    }
    const int first_expert = rank * num_local;
    const bool here = expert >= first_expert && expert < first_expert + num_local;
    const uint32_t slots = __ballot_sync(kFullMask, here);
    if (slots == 0 || __shfl_sync(kFullMask, expert, __ffs(slots) - 1) != first_expert + local_expert) return true;

    // Rows of the token's other local experts: recorded in loop 1 of this phase, maybe by another warp.
    const int4* row = nullptr;
    if (here) {
        const uint64_t* entry = reinterpret_cast<const uint64_t*>(c.local + L.rowmap) + pair * num_local +
                                (expert - first_expert);
        uint64_t v = 0;
        ok = wait_until(
            [&] {
                v = ld_acquire_gpu_u64(entry);
                return (v >> 32) == op.tag;
            },
            c.comm, &c.state->abort, kErrInternalTimeout);
        const int64_t packed = static_cast<int64_t>(expert - first_expert) * num_ranks * a.max_tokens +
                               static_cast<uint32_t>(v);
        row = static_cast<const int4*>(a.x) + packed * (a.hidden / 8);
    }
    if (__any_sync(kFullMask, !ok)) return false;

    uint8_t* peer = c.peers[src];
    const int64_t slot = static_cast<int64_t>(rank) * a.max_tokens + token;  // [this rank][token] on the source
    const int64_t data_offset = op.data + slot * L.row_bytes;
    const int64_t flag_offset = op.flags + slot * 8;
    if constexpr (kLogfmt) {
        uint8_t* peer_row = peer != nullptr ? peer + data_offset : nullptr;
        uint64_t* peer_flag = peer != nullptr ? reinterpret_cast<uint64_t*>(peer + flag_offset) : nullptr;
        used_puts |= send_logfmt_row(row, weight, slots, a.hidden, c.local + L.send + pair * L.row_bytes,
                                     c.local + L.stage + pair * L.row_bytes, peer_row, peer_flag,
                                     c.local + data_offset, reinterpret_cast<uint64_t*>(c.local + flag_offset),
                                     op.tag, src, lane);
        return true;
    }
    uint8_t* out = peer != nullptr ? peer + data_offset : c.local + L.stage + pair * L.row_bytes;
    reduce_partial_row(reinterpret_cast<int4*>(out), row, weight, slots, a.hidden / 8, lane);
    const uint64_t signal = make_signal(op.tag, 0);
    if (peer != nullptr) {
        __syncwarp();  // orders every lane's stores before lane 0's release
        if (lane == 0) st_release_sys_u64(reinterpret_cast<uint64_t*>(peer + flag_offset), signal);
    } else {
        put_row_with_signal(c.local + data_offset, out, L.row_bytes, reinterpret_cast<uint64_t*>(c.local + flag_offset),
                            signal, src);
        used_puts = true;
    }
    return true;
}

template <bool kLogfmt>
MOE_EP_DEVICE void combine_send(const CombineArgs& a, const Context& c, const Layout& L, const Phase& op) {
    const int num_ranks = c.comm.num_ranks;
    const int64_t slots = static_cast<int64_t>(num_ranks) * a.max_tokens;
    const int num_pairs = a.num_experts;  // (local expert, source)
    const WarpSchedule ws = WarpSchedule::make();
    const int lane = ws.lane;
    bool used_puts = false;
    // Loop 1: stores only.
    for (int item = ws.warp; item < a.num_tokens + num_pairs; item += ws.num_warps) {
        if (item < a.num_tokens)
            used_puts |= send_metadata(a, c, L, op, item, lane);
        else
            record_rows(a, c, L, op, item - a.num_tokens, lane);
    }
    // Loop 2: every received row, `workers` warps per (local expert, source) pair.
    const int workers = ws.workers_per_item(num_pairs);
    for (int v = ws.warp; v < num_pairs * workers; v += ws.num_warps) {
        const int pair = v % num_pairs, sub = v / num_pairs;
        const int local_expert = pair / num_ranks, src = pair % num_ranks;
        const int64_t range = __ldg(a.layout_range + local_expert * num_ranks + src);
        const int count = static_cast<int>(range & 0xffffffff), begin = static_cast<int>(range >> 32);
        uint64_t waited = 0;
        bool ok = true;
        for (int i = sub; i < count && ok; i += workers) {
            const int token = __ldg(a.src_info + local_expert * slots + begin + i);
            if (token < 0 || token >= a.max_tokens) continue;
            ok = reduce_token<kLogfmt>(a, c, L, op, local_expert, src, token, lane, waited, used_puts);
        }
        if (lane == 0) add_wait(a.wait_stats, src, waited);  // metadata waits count for the source
        if (!ok) break;
    }
    if (used_puts) complete_puts();
}

// The combined row of a token with the block's threads: `out[vec] = bf16(sum over positions p < count in
// order of float(load(p, vec)))` in float32, `load(p, vec)` the vector (8 BF16 values) `vec` of the
// partial row at position p.
template <class Load>
MOE_EP_DEVICE void sum_partials(int4* out, int vectors, int count, const Load& load) {
    for (int vec = threadIdx.x; vec < vectors; vec += blockDim.x) {
        float acc[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
        for (int p0 = 0; p0 < count; p0 += kReduceBatch) {
            int4 rows[kReduceBatch];
#pragma unroll
            for (int u = 0; u < kReduceBatch; ++u)
                if (p0 + u < count) rows[u] = load(p0 + u, vec);
#pragma unroll
            for (int u = 0; u < kReduceBatch; ++u) {
                if (p0 + u >= count) continue;
                const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&rows[u]);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 f = __bfloat1622float2(y[i]);
                    acc[2 * i] = __fadd_rn(acc[2 * i], f.x);
                    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], f.y);
                }
            }
        }
        out[vec] = to_bf16x8(acc);
    }
}

// LogFMT: what the block knows of each of a token's partial rows (by position).
struct LogfmtRows {
    uint32_t format[kNumMaxTopk];                      // the flag's value: 1 = LogFMT layout, 0 = BF16
    uint32_t header[kNumMaxTopk][kLogfmtMaxGroups];    // per block, of LogFMT rows
    uint16_t offset[kNumMaxTopk][kLogfmtMaxGroups];    // byte offset of each block in its row
};

// sum_partials over partial rows in LogFMT or BF16 (`rows.format`): a warp per LogFMT row first reads its
// headers and finds where each block starts.
MOE_EP_DEVICE void sum_logfmt_partials(int4* out, int hidden, int count, const uint8_t* const* partial_rows,
                                       LogfmtRows& rows) {
    const int groups = hidden / kLogfmtBlock, lane = threadIdx.x % 32;
    for (int p = threadIdx.x / 32; p < count; p += blockDim.x / 32) {
        if (rows.format[p] == 0) continue;
        const LogfmtBlocks blocks = logfmt_row_layout(partial_rows[p], groups, lane);
        if (lane < groups) {
            rows.header[p][lane] = blocks.header[0];
            rows.offset[p][lane] = static_cast<uint16_t>(blocks.offset[0]);
        }
        if (lane + 32 < groups) {
            rows.header[p][lane + 32] = blocks.header[1];
            rows.offset[p][lane + 32] = static_cast<uint16_t>(blocks.offset[1]);
        }
    }
    __syncthreads();
    sum_partials(out, hidden / 8, count, [&](int p, int vec) {
        if (rows.format[p] == 0) return reinterpret_cast<const int4*>(partial_rows[p])[vec];
        return logfmt_load_vector(partial_rows[p], rows.header[p][vec / 16], rows.offset[p][vec / 16], vec);
    });
}

// out[t] = bf16(sum over the ranks hosting t's valid slots, ascending, of float(P[r, t])) in float32.
template <bool kLogfmt>
MOE_EP_DEVICE void combine_recv(const CombineArgs& a, const Context& c, const Layout& L, const Phase& op) {
    __shared__ const uint8_t* s_rows[kNumMaxTopk];  // the partial rows to sum, in ascending rank order
    __shared__ int s_count;
    __shared__ int s_failed;
    __shared__ LogfmtRows s_logfmt;
    const int num_ranks = c.comm.num_ranks;
    const int num_local = a.num_experts / num_ranks;
    const int vectors = a.hidden / 8;
    const uint64_t* flags = reinterpret_cast<const uint64_t*>(c.local + op.flags);
    const uint8_t* data = c.local + op.data;
    for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            const int64_t e = lane < a.num_topk ? __ldg(a.topk_idx + static_cast<int64_t>(t) * a.num_topk + lane) : -1;
            const int r = rank_of_slot(e, a.num_experts, num_local);
            bool present = first_slot_of_rank(r, lane);
            bool ok = true;
            uint32_t format = 0;
            if (present) {
                uint64_t waited = 0;
                const Arrival arrival =
                    wait_signal(flags + static_cast<int64_t>(r) * a.max_tokens + t, op.tag, c, r, format, waited);
                add_wait(a.wait_stats, r, waited);
                ok = arrival != Arrival::kFailed;
                present = arrival == Arrival::kReady;  // elastic mode: ranks left out add nothing
            }
            // The position of r among the token's ranks that take part, in ascending order.
            int position = 0;
            if (num_ranks <= 32) {
                const uint32_t ranks = __reduce_or_sync(kFullMask, present ? 1u << r : 0u);
                position = present ? __popc(ranks & ((1u << r) - 1u)) : 0;
            } else {
                const int key = present ? r : INT_MAX;
                for (int i = 0; i < 32; ++i) position += __shfl_sync(kFullMask, key, i) < key;
            }
            const int count = __popc(__ballot_sync(kFullMask, present));
            if (present) {
                s_rows[position] = data + (static_cast<int64_t>(r) * a.max_tokens + t) * L.row_bytes;
                s_logfmt.format[position] = format;
            }
            const bool failed = __any_sync(kFullMask, !ok);
            if (lane == 0) {
                s_failed = failed;
                s_count = count;
            }
        }
        // The barrier orders the acquires of warp 0 before every thread's reads of the rows.
        __syncthreads();
        if (s_failed) return;
        const int count = s_count;
        int4* out = static_cast<int4*>(a.out) + static_cast<int64_t>(t) * vectors;
        if constexpr (kLogfmt)
            sum_logfmt_partials(out, a.hidden, count, s_rows, s_logfmt);
        else
            sum_partials(out, vectors, count,
                         [&](int p, int vec) { return reinterpret_cast<const int4*>(s_rows[p])[vec]; });
        __syncthreads();  // s_rows / s_count are rewritten for the next token
    }
}

template <bool kLogfmt>
__global__ void __launch_bounds__(kBlockThreads, 1)
    combine_kernel(const CombineArgs args, const Context ctx, const Layout layout, int phases) {
    const Operation op = begin_operation(ctx, layout);
    if (op.abort) return;
    if (phases & kSendPhase) {
        if (wait_for_receivers(ctx, layout, op.send)) combine_send<kLogfmt>(args, ctx, layout, op.send);
        finish_phase(&ctx.state->send_done, &ctx.state->send_seq);
    }
    if (phases & kRecvPhase) {
        combine_recv<kLogfmt>(args, ctx, layout, op.recv);
        if (finish_phase(&ctx.state->recv_done, &ctx.state->recv_seq)) acknowledge(ctx, layout, op.recv.seq + 1);
    }
}

}  // namespace

cudaError_t launch_combine(const CombineArgs& args, const Context& ctx, const Layout& layout, int phases,
                           cudaStream_t stream) {
    // LogFMT is a kernel of its own: the BF16 combine keeps its registers.
    if (args.logfmt) return launch_cooperative(combine_kernel<true>, ctx.num_blocks, 0, stream, args, ctx, layout, phases);
    return launch_cooperative(combine_kernel<false>, ctx.num_blocks, 0, stream, args, ctx, layout, phases);
}

}  // namespace moe_ep::kernels::ll
