// Low-latency dispatch and combine over double-buffered symmetric memory with tagged signals (see
// low_latency.cuh for the protocol).
//
// Work is split among warps, numbered across blocks first (warp w of block b is global warp
// w * grid + b) so that consecutive work items land on different SMs.
//  * Dispatch send: warp item e < E counts the messages for expert e and signals the count to its
//    owner; then a team of warps per token t (per (t, rank) at small batches) casts t once, each warp a
//    share of the row, writes the row to [this rank][t] on every rank hosting one of t's experts, then
//    signals each of t's messages at the position of t among this rank's tokens for its expert (so
//    rows arrive in token order).
//  * Dispatch receive: (local expert, source) pairs, several warps per pair; each learns the counts of
//    every source of its expert, packs its messages' rows source-major and writes layout_range /
//    recv_count.
//  * Combine send: each token's top-k ids and weights go to the ranks hosting its experts; each rank
//    then reduces, per (source, token) it received, its local experts' rows into one BF16 partial row
//    and sends that row to slot [this rank][token] of the source (see the combine section).
//  * Combine receive: a block per token waits for the partial rows of its ranks and sums them in rank
//    order.
// A launch with both phases needs no grid barrier: receivers wait on signals, also for their own rows,
// and the cooperative launch keeps every block resident so that no waiting block starves a sender.
#include <climits>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/common.cuh"
#include "low_latency/api.cuh"

#ifndef MOE_EP_LL_P2P_ONLY
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace moe_ep::kernels::ll {

namespace {

constexpr int kWarps = kBlockThreads / 32;
constexpr int kCopyUnroll = 8;  // 16-byte loads in flight per lane when copying a row
constexpr int kCastUnroll = 4;  // 32-byte steps in flight per lane when casting a row to FP8
constexpr int kReduceBatch = 8;  // top-k rows loaded together by the combine reduction
constexpr float kAmaxFloor = 1e-4f;

// ------------------------------------------------------------------ signals

MOE_EP_DEVICE uint64_t make_signal(uint32_t tag, uint32_t value) {
    return (static_cast<uint64_t>(tag) << 32) | value;
}

// Waits until `*signal` carries `tag`, then yields its value. The time spent spinning is added to
// `waited_ns`. False when this rank gave up (timeout here or elsewhere: the error is reported).
MOE_EP_DEVICE bool wait_signal(const uint64_t* signal, uint32_t tag, const Context& c, uint32_t& value,
                               uint64_t& waited_ns) {
    uint64_t v = ld_acquire_sys_u64(signal);
    if ((v >> 32) != tag) {
        const uint64_t start = global_timer_ns();
        const bool ok = wait_until(
            [&] {
                v = ld_acquire_sys_u64(signal);
                return (v >> 32) == tag;
            },
            c.comm, &c.state->abort, kErrRecvTimeout);
        waited_ns += global_timer_ns() - start;
        if (!ok) return false;
    }
    value = static_cast<uint32_t>(v);
    return true;
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

// ------------------------------------------------------------------ rows

// Copies the 16-byte vectors [begin, end) of `src` with the whole warp, kCopyUnroll loads in flight per
// lane, handing each to `store(index, value, pred)` (every lane calls it; `pred`: this lane has a value).
// `kReadOnly`: the source is not written while the kernel runs (the non-coherent path is then allowed);
// rows written by peers use ordinary loads.
template <bool kReadOnly, class Store>
MOE_EP_DEVICE void copy_vectors(const int4* src, int begin, int end, int lane, const Store& store) {
    for (int base = begin; base < end; base += 32 * kCopyUnroll) {
        int4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
            const int i = base + u * 32 + lane;
            if (i < end) v[u] = kReadOnly ? __ldg(src + i) : src[i];
        }
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) store(base + u * 32 + lane, v[u], base + u * 32 + lane < end);
    }
}

// Copies a row of `n` 16-byte vectors written by a peer to `dst`.
MOE_EP_DEVICE void copy_row(int4* dst, const int4* src, int n, int lane) {
    copy_vectors<false>(src, 0, n, lane, [dst](int i, const int4& v, bool pred) {
        if (pred) dst[i] = v;
    });
}

// The rows a send writes a token's row to: one address per destination rank, held by the lanes of
// `lanes`, so that a row loaded (and cast) once is stored to each. Every lane calls `store` (it
// shuffles the addresses); `pred` says whether this lane has a value to store.
struct RowFanOut {
    uint8_t* row;  // this lane's destination when its bit is set in `lanes`
    uint32_t lanes;
    template <class T>
    MOE_EP_DEVICE void store(int64_t offset, T v, bool pred) const {
        for (uint32_t rest = lanes; rest != 0; rest &= rest - 1) {
            uint8_t* to = reinterpret_cast<uint8_t*>(
                __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), __ffs(rest) - 1));
            if (pred) *reinterpret_cast<T*>(to + offset) = v;
        }
    }
};

// Sends the 16-byte vectors [begin, end) of a token's (read-only) row to `to`.
MOE_EP_DEVICE void send_row(const RowFanOut& to, const int4* src, int begin, int end, int lane) {
    copy_vectors<true>(src, begin, end, lane, [&to](int i, const int4& v, bool pred) {
        to.store(static_cast<int64_t>(i) * 16, v, pred);
    });
}

// 2^ceil(log2(s)) for a positive normal float, exactly (fp8.py's round_scale for every BF16 input:
// amax / 448 of a BF16 amax is a power of two or at least 0.4 % away from one).
MOE_EP_DEVICE float pow2_ceil(float s) {
    const uint32_t bits = __float_as_uint(s);
    const uint32_t exponent = (bits >> 23) + ((bits & 0x7fffffu) != 0 ? 1u : 0u);
    return __uint_as_float(exponent << 23);
}

MOE_EP_DEVICE float clamp_fp8(float v) { return fminf(fmaxf(v, -kFp8MaxFloat), kFp8MaxFloat); }

// Casts one BF16 row to e4m3 followed by its scales, bit for bit like fp8.per_token_cast_to_fp8:
// amax floored at 1e-4, scale = amax / 448 (rounded to a power of two with round_scale), q =
// saturate(x * (1 / scale)) to nearest even. Every float operation is explicitly rounded so that the
// compiler cannot fuse it. A lane casts 16 channels per step; the 8 lanes of a 128-channel group
// share their amax through shuffles, and a warp step covers 4 groups, i.e. exactly one UE8M0 word.
// The warp casts the 16-channel chunks [first_chunk, end_chunk) of the row, whole warp steps (see
// warp_share), so that several warps can cast one row.
template <bool kUe8m0>
MOE_EP_DEVICE void cast_row_fp8(const int4* x_row, const RowFanOut& to, int hidden, int first_chunk, int end_chunk,
                                bool round_scale, int lane) {
    for (int base = first_chunk; base < end_chunk; base += 32 * kCastUnroll) {
        int4 raw[kCastUnroll][2];
#pragma unroll
        for (int u = 0; u < kCastUnroll; ++u) {
            const int c = base + u * 32 + lane;
            raw[u][0] = raw[u][1] = make_int4(0, 0, 0, 0);
            if (c < end_chunk) {
                raw[u][0] = __ldg(x_row + 2 * c);
                raw[u][1] = __ldg(x_row + 2 * c + 1);
            }
        }
#pragma unroll
        for (int u = 0; u < kCastUnroll; ++u) {
            const int step = base + u * 32;  // warp-uniform; groups never straddle the row end (H % 128 == 0)
            if (step >= end_chunk) break;
            const int c = step + lane;
            const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(raw[u]);
            float v[16];
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float2 f = __bfloat1622float2(pairs[i]);
                v[2 * i] = f.x;
                v[2 * i + 1] = f.y;
                amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
            }
#pragma unroll
            for (int offset = 4; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
            float scale = __fdiv_rn(fmaxf(amax, kAmaxFloor), kFp8MaxFloat);
            if (round_scale) scale = pow2_ceil(scale);
            const float inv = __frcp_rn(scale);
            uint32_t packed[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 lo = make_float2(clamp_fp8(__fmul_rn(v[4 * i], inv)), clamp_fp8(__fmul_rn(v[4 * i + 1], inv)));
                const float2 hi =
                    make_float2(clamp_fp8(__fmul_rn(v[4 * i + 2], inv)), clamp_fp8(__fmul_rn(v[4 * i + 3], inv)));
                packed[i] = static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(lo, __NV_SATFINITE, __NV_E4M3)) |
                            (static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(hi, __NV_SATFINITE, __NV_E4M3)) << 16);
            }
            to.store(static_cast<int64_t>(c) * 16,
                     make_int4(static_cast<int>(packed[0]), static_cast<int>(packed[1]), static_cast<int>(packed[2]),
                               static_cast<int>(packed[3])),
                     c < end_chunk);
            if constexpr (kUe8m0) {
                // Groups past the row end contribute 0 bytes, as pack_ue8m0 pads the last word.
                const uint32_t exponent = c < end_chunk ? (__float_as_uint(scale) >> 23) & 0xffu : 0u;
                uint32_t word = 0;
#pragma unroll
                for (int b = 0; b < 4; ++b) word |= __shfl_sync(kFullMask, exponent, 8 * b) << (8 * b);
                to.store(hidden + static_cast<int64_t>(step / 32) * 4, word, lane == 0);
            } else {
                to.store(hidden + static_cast<int64_t>(c / 8) * 4, __float_as_uint(scale), lane % 8 == 0 && c < end_chunk);
            }
        }
    }
}

// Bytes of one dispatch message: the row, then (FP8) its scales.
MOE_EP_DEVICE int message_bytes(Mode mode, int hidden) {
    const int groups = hidden / kFp8Block;
    switch (mode) {
        case Mode::kBF16: return hidden * 2;
        case Mode::kFP8: return hidden + groups * 4;
        default: return hidden + (groups + 3) / 4 * 4;
    }
}

// ------------------------------------------------------------------ operation bookkeeping

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
// the barrier orders every thread's later stores after those acquires.
MOE_EP_DEVICE bool wait_for_receivers(const Context& c, const Layout& L, const Phase& send) {
    __shared__ int s_failed;
    if (threadIdx.x < 32) {
        bool ok = true;
        const uint64_t* acks = reinterpret_cast<const uint64_t*>(c.local + L.acks);
        for (int r = threadIdx.x; r < c.comm.num_ranks && ok && send.seq >= 2; r += 32)
            ok = wait_until([&] { return ld_acquire_sys_u64(acks + r) + 1 >= send.seq; }, c.comm, &c.state->abort,
                            kErrSendTimeout);
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

// One warp: lane r signals rank r, then lane r waits for rank r's signal (see launch_barrier). It runs
// even when an earlier wait gave up (a Buffer that failed is still destroyed collectively), with its
// own abort word; a timeout here also sets the state's.
__global__ void barrier_kernel(const Context ctx, uint64_t epoch, bool exact) {
    const int64_t offset = barrier_offset(ctx.comm.num_ranks);
    const int lane = threadIdx.x;
    // Writes of earlier kernels and memsets on the stream reach the peers before the signal.
    __threadfence_system();
    if (lane < ctx.comm.num_ranks) {
        const int64_t mine = offset + static_cast<int64_t>(ctx.comm.rank) * 8;
        if (ctx.peers[lane] != nullptr)
            st_release_sys_u64(reinterpret_cast<uint64_t*>(ctx.peers[lane] + mine), epoch);
        else
            put_signal(reinterpret_cast<uint64_t*>(ctx.local + mine), epoch, lane);
    }
    volatile int gave_up = 0;
    for (int r = lane; r < ctx.comm.num_ranks; r += 32) {
        const uint64_t* signal = reinterpret_cast<const uint64_t*>(ctx.local + offset) + r;
        const bool ok = wait_until(
            [&] {
                const uint64_t seen = ld_acquire_sys_u64(signal);
                return exact ? seen == epoch : seen >= epoch;
            },
            ctx.comm, &gave_up, kErrBarrierTimeout);
        if (!ok) {
            ctx.state->abort = 1;
            ctx.state->barrier_failed = 1;
            break;
        }
    }
}

// Warps numbered across blocks first; `workers` warps per item when there are fewer items than warps.
struct WarpSchedule {
    int warp, num_warps, lane;
    MOE_EP_DEVICE static WarpSchedule make() {
        return {static_cast<int>(threadIdx.x / 32 * gridDim.x + blockIdx.x), static_cast<int>(kWarps * gridDim.x),
                static_cast<int>(threadIdx.x % 32)};
    }
    MOE_EP_DEVICE int workers_per_item(int num_items) const { return max(1, num_warps / max(num_items, 1)); }
};

// Teams of `size` consecutive warps of one block (1, 2, 4 or 8) among its warps [first_warp, kWarps),
// numbered across blocks first like the warps: at decode sizes one item per team, so that a row is
// cast by several warps at once instead of one warp's chain of loads. Named barrier 1 + index (0 is
// __syncthreads) joins a team's warps.
struct TeamSchedule {
    int team, num_teams, size, member, first_warp;
    static constexpr int kMaxSize = 8;
    // The largest team size that still gives every one of `num_items` items its own team. Warps outside
    // every team (before first_warp, or left over) get team INT_MAX: no item.
    MOE_EP_DEVICE static TeamSchedule make(int num_items, int first_warp) {
        const int grid = static_cast<int>(gridDim.x), avail = kWarps - first_warp;
        int size = kMaxSize;
        while (size > 1 && (size > avail || num_items > avail / size * grid)) size /= 2;
        const int rel = static_cast<int>(threadIdx.x / 32) - first_warp, per_block = avail / size;
        const bool in_team = rel >= 0 && rel / size < per_block;
        return {in_team ? rel / size * grid + static_cast<int>(blockIdx.x) : INT_MAX, per_block * grid, size,
                in_team ? rel % size : 0, first_warp};
    }
    // Teams of the largest size the grid holds when the teams start at warp `first_warp`.
    MOE_EP_DEVICE static int full_size_teams(int first_warp) {
        return (kWarps - first_warp) / kMaxSize * static_cast<int>(gridDim.x);
    }
    MOE_EP_DEVICE void sync() const {
        if (size > 1)
            asm volatile("bar.sync %0, %1;" ::"r"(1 + (static_cast<int>(threadIdx.x / 32) - first_warp) / size),
                         "r"(32 * size) : "memory");
    }
};

// The units [begin, end) of a row of `n` units that member `member` of `members` handles: whole
// 32-unit warp steps, so that lanes stay coalesced and FP8 scale words are never split.
MOE_EP_DEVICE void warp_share(int n, int member, int members, int& begin, int& end) {
    const int steps = (n + 31) / 32;
    begin = min(n, member * steps / members * 32);
    end = min(n, (member + 1) * steps / members * 32);
}

// ------------------------------------------------------------------ dispatch

// Entries of `ids[0, n)` equal to `expert`, counted by the whole warp (8 int16 per 16-byte load).
MOE_EP_DEVICE int count_expert(const int16_t* ids, int n, int expert, int lane) {
    const uint32_t pattern = static_cast<uint32_t>(static_cast<uint16_t>(expert)) * 0x10001u;
    const int4* vec = reinterpret_cast<const int4*>(ids);
    int count = 0;
    for (int i = lane; i < n / 8; i += 32) {
        const int4 v = vec[i];
        count += (__popc(__vcmpeq2(static_cast<uint32_t>(v.x), pattern)) + __popc(__vcmpeq2(static_cast<uint32_t>(v.y), pattern)) +
                  __popc(__vcmpeq2(static_cast<uint32_t>(v.z), pattern)) + __popc(__vcmpeq2(static_cast<uint32_t>(v.w), pattern))) /
                 16;
    }
    for (int i = n / 8 * 8 + lane; i < n; i += 32) count += ids[i] == expert;
    return warp_sum(count);
}

// Lane j of `slots` gets the position of slot j's message: the number of earlier entries for its expert.
MOE_EP_DEVICE int slot_positions(const int16_t* s_ids, int token_entry, uint32_t slots, int expert, int lane) {
    int position = 0;
    for (uint32_t rest = slots; rest != 0; rest &= rest - 1) {
        const int j = __ffs(rest) - 1;
        const int p = count_expert(s_ids, token_entry + j, __shfl_sync(kFullMask, expert, j), lane);
        if (lane == j) position = p;
    }
    return position;
}

// The rows of the dispatch send. An item is a token, or a (token, destination rank) pair at small batches,
// and a team of warps sends it: the team loads (and casts) the row once and stores it to every rank of
// the item that hosts one of the token's experts, into row [source rank][token] of that rank's data
// region; then every (token, slot) message gets its signal, the token, in the flag of its expert's
// position. The team's warps split the row, and each finds the positions of a share of the slots while
// the stores are in flight. An item with a rank reached through NVSHMEM puts is sent by the team's first
// warp alone: it stages the row for those ranks in the send region (row token * R + dst) and puts it once
// per message. Returns whether puts were issued.
template <Mode kMode>
MOE_EP_DEVICE bool send_rows(const DispatchArgs& a, const Context& c, const Layout& L, const Phase& op,
                             const int16_t* s_ids, int count_warps, int lane) {
    const int num_ranks = c.comm.num_ranks, rank = c.comm.rank;
    const int num_local = a.num_experts / num_ranks;
    // Items split by rank only while they fill at most half of the largest teams: a row cast once for
    // all its ranks sends less, while separate ranks go out from separate teams at once. Measured (s17-3,
    // hook send, 4 ranks): by rank 7.5 us against 8.5 at 1 token; by token 8.9 against 9.2 at 32.
    const int parts = a.num_tokens * num_ranks <= TeamSchedule::full_size_teams(count_warps) / 2 ? num_ranks : 1;
    const int num_items = a.num_tokens * parts;
    const TeamSchedule team = TeamSchedule::make(num_items, count_warps);
    const int bytes = message_bytes(kMode, a.hidden);
    bool used_puts = false;
    for (int item = team.team; item < num_items; item += team.num_teams) {
        const int token = item / parts, part = item % parts;
        const int expert = lane < a.num_topk ? s_ids[token * a.num_topk + lane] : -1;
        const int dst = expert >= 0 ? expert / num_local : -1;
        const bool in_item = expert >= 0 && (parts == 1 || dst == part);
        const uint32_t valid = __ballot_sync(kFullMask, in_item);
        if (valid == 0) continue;
        // One lane per destination rank: the first slot with an expert there. (Every lane must take part
        // in the match, so it is not behind the short-circuit.)
        const uint32_t same_dst = __match_any_sync(kFullMask, dst);
        const bool leads = in_item && __ffs(same_dst) - 1 == lane;
        uint8_t* peer = in_item ? c.peers[dst] : nullptr;
        const bool direct = __ballot_sync(kFullMask, leads && peer == nullptr) == 0;
        if (!direct && team.member != 0) continue;
        const int members = direct ? team.size : 1, member = direct ? team.member : 0;
        const int64_t data_offset = op.data + (static_cast<int64_t>(rank) * a.max_tokens + token) * L.row_bytes;
        uint8_t* staged = c.local + L.send + (static_cast<int64_t>(token) * num_ranks + max(dst, 0)) * L.row_bytes;
        const RowFanOut to{peer != nullptr ? peer + data_offset : staged, __ballot_sync(kFullMask, leads)};
        const int4* x_row = static_cast<const int4*>(a.x) + static_cast<int64_t>(token) * (a.hidden / 8);
        int begin, end;
        if constexpr (kMode == Mode::kBF16) {
            warp_share(a.hidden / 8, member, members, begin, end);
            send_row(to, x_row, begin, end, lane);
        } else {
            warp_share(a.hidden / 16, member, members, begin, end);
            cast_row_fp8<kMode == Mode::kFP8UE8M0>(x_row, to, a.hidden, begin, end, a.round_scale, lane);
        }
        const uint32_t mine =
            __ballot_sync(kFullMask, in_item && __popc(valid & ((1u << lane) - 1u)) % members == member);
        const int position = slot_positions(s_ids, token * a.num_topk, mine, expert, lane);
        // The team's barrier orders every share's stores before each warp's releases, which are
        // cumulative: no fence per warp. (A fence in every warp before the barrier cost 1-2 us at every
        // size: docs/perf-notes-low-latency.md, session 16.)
        if (members > 1) team.sync();
        const int64_t message = (static_cast<int64_t>(max(expert, 0) % num_local) * num_ranks + rank) * a.max_tokens + position;
        const int64_t flag_offset = op.flags + message * 8;
        const uint64_t signal = make_signal(op.tag, static_cast<uint32_t>(token));
        // __syncwarp orders every lane's row stores before the releases.
        __syncwarp();
        if (((mine >> lane) & 1u) && peer != nullptr) st_release_sys_u64(reinterpret_cast<uint64_t*>(peer + flag_offset), signal);
        // A put-with-signal orders one signal after its row: the row goes once per message.
        for (uint32_t rest = mine & __ballot_sync(kFullMask, peer == nullptr); rest != 0; rest &= rest - 1) {
            const int j = __ffs(rest) - 1;
            const int to_rank = __shfl_sync(kFullMask, dst, j);
            put_row_with_signal(c.local + data_offset,
                                c.local + L.send + (static_cast<int64_t>(token) * num_ranks + to_rank) * L.row_bytes, bytes,
                                reinterpret_cast<uint64_t*>(c.local + __shfl_sync(kFullMask, flag_offset, j)), signal, to_rank);
            used_puts = true;
        }
    }
    return used_puts;
}

// Items: one count per expert (a warp each), then the rows (send_rows).
template <Mode kMode>
MOE_EP_DEVICE void dispatch_send(const DispatchArgs& a, const Context& c, const Layout& L, const Phase& op,
                                 int16_t* s_ids) {
    const int num_ranks = c.comm.num_ranks, rank = c.comm.rank;
    const int num_local = a.num_experts / num_ranks;
    const int entries = a.num_tokens * a.num_topk;
    for (int i = threadIdx.x; i < entries; i += blockDim.x) {
        const int64_t e = a.topk_idx[i];
        s_ids[i] = static_cast<int16_t>(e >= 0 && e < a.num_experts ? e : -1);
    }
    __syncthreads();

    const WarpSchedule ws = WarpSchedule::make();
    const int lane = ws.lane;
    bool used_puts = false;
    for (int item = ws.warp; item < a.num_experts; item += ws.num_warps) {
        // Every (expert, source) pair gets a count, zero included: receivers wait for all of them. A
        // count guards no data (each message has its own flag), so it needs no release.
        const int count = count_expert(s_ids, entries, item, lane);
        if (lane == 0) {
            const int dst = item / num_local;
            const int64_t offset = op.counts + (static_cast<int64_t>(item % num_local) * num_ranks + rank) * 8;
            const uint64_t signal = make_signal(op.tag, static_cast<uint32_t>(count));
            if (c.peers[dst] != nullptr) {
                st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(c.peers[dst] + offset), signal);
            } else {
                put_signal(reinterpret_cast<uint64_t*>(c.local + offset), signal, dst);
                used_puts = true;
            }
        }
    }

    // The teams start after the warps that had a count item, so that no row waits for a count.
    const int count_warps = min(ceil_div(a.num_experts, static_cast<int>(gridDim.x)), kWarps - 1);
    if (send_rows<kMode>(a, c, L, op, s_ids, count_warps, lane)) used_puts = true;
    if (used_puts) complete_puts();
}

// Copies an FP8 message: the row to `out_row`, its `n` scale words to `out_scales[g * stride]` (the
// token-dimension-contiguous layout). The first 64 words are loaded before the row so that their loads
// overlap its copy instead of following it.
MOE_EP_DEVICE void copy_fp8_message(int4* out_row, uint32_t* out_scales, int64_t stride, const uint8_t* msg, int hidden,
                                    int n, int lane) {
    const uint32_t* scales = reinterpret_cast<const uint32_t*>(msg + hidden);
    const uint32_t first = lane < n ? scales[lane] : 0u;
    const uint32_t second = lane + 32 < n ? scales[lane + 32] : 0u;
    copy_row(out_row, reinterpret_cast<const int4*>(msg), hidden / 16, lane);
    if (lane < n) out_scales[lane * stride] = first;
    if (lane + 32 < n) out_scales[(lane + 32) * stride] = second;
    for (int g = lane + 64; g < n; g += 32) out_scales[g * stride] = scales[g];
}

template <Mode kMode>
MOE_EP_DEVICE void dispatch_recv(const DispatchArgs& a, const Context& c, const Layout& L, const Phase& op) {
    const int num_ranks = c.comm.num_ranks;
    const int64_t slots = static_cast<int64_t>(num_ranks) * a.max_tokens;  // rows per local expert
    const int groups = a.hidden / kFp8Block;
    const int words = (groups + 3) / 4;
    const int num_pairs = a.num_experts;  // (local expert, source)
    const WarpSchedule ws = WarpSchedule::make();
    const int lane = ws.lane;
    const int workers = ws.workers_per_item(num_pairs);
    const uint64_t* counts = reinterpret_cast<const uint64_t*>(c.local + op.counts);
    const uint64_t* flags = reinterpret_cast<const uint64_t*>(c.local + op.flags);
    const uint8_t* data = c.local + op.data;

    for (int v = ws.warp; v < num_pairs * workers; v += ws.num_warps) {
        const int pair = v % num_pairs, sub = v / num_pairs;
        const int local_expert = pair / num_ranks, src = pair % num_ranks;

        // Counts from every source of this expert give the begin of `src`'s rows (source-major packing).
        int before = 0, mine = 0, total = 0;
        uint64_t waited = 0;
        bool ok = true;
        for (int s = lane; s < num_ranks && ok; s += 32) {
            uint32_t n = 0;
            uint64_t count_wait = 0;
            ok = wait_signal(counts + local_expert * num_ranks + s, op.tag, c, n, count_wait);
            waited += s == src ? count_wait : 0;
            before += s < src ? static_cast<int>(n) : 0;
            mine += s == src ? static_cast<int>(n) : 0;
            total += static_cast<int>(n);
        }
        if (__any_sync(kFullMask, !ok)) return;
        before = warp_sum(before);
        mine = warp_sum(mine);
        total = warp_sum(total);
        if (sub == 0 && lane == 0) {
            a.layout_range[local_expert * num_ranks + src] =
                static_cast<int64_t>(mine) | (static_cast<int64_t>(before) << 32);
            if (a.cumulative_stats != nullptr) atomicAdd(a.cumulative_stats + local_expert, mine);
            if (src == 0) a.recv_count[local_expert] = total;
        }

        const int64_t first = (static_cast<int64_t>(local_expert) * num_ranks + src) * a.max_tokens;
        for (int i = sub; i < mine; i += workers) {
            uint32_t token = 0;
            if (lane == 0) ok = wait_signal(flags + first + i, op.tag, c, token, waited);
            // __syncwarp orders lane 0's acquire before the other lanes' reads of the message.
            __syncwarp();
            if (!__shfl_sync(kFullMask, ok, 0)) return;
            token = __shfl_sync(kFullMask, token, 0);
            const int64_t row = before + i;  // inside this expert
            const int64_t out_row = local_expert * slots + row;
            const uint8_t* msg = data + (static_cast<int64_t>(src) * a.max_tokens + token) * L.row_bytes;
            if (lane == 0) a.recv_src_info[out_row] = static_cast<int>(token);
            if constexpr (kMode == Mode::kBF16) {
                copy_row(static_cast<int4*>(a.recv_x) + out_row * (a.hidden / 8),
                                reinterpret_cast<const int4*>(msg), a.hidden / 8, lane);
            } else {
                const int n = kMode == Mode::kFP8 ? groups : words;
                copy_fp8_message(static_cast<int4*>(a.recv_x) + out_row * (a.hidden / 16),
                                 static_cast<uint32_t*>(a.recv_scales) + static_cast<int64_t>(local_expert) * n * slots + row,
                                 slots, msg, a.hidden, n, lane);
            }
        }
        add_wait(a.wait_stats, src, waited);  // lane 0 waited for the rows, lane src % 32 for the count
    }
}

template <Mode kMode>
__global__ void __launch_bounds__(kBlockThreads, 1)
    dispatch_kernel(const DispatchArgs args, const Context ctx, const Layout layout, int phases) {
    extern __shared__ __align__(16) int16_t s_ids[];
    const Operation op = begin_operation(ctx, layout);
    if (op.abort) return;
    if (phases & kSendPhase) {
        if (wait_for_receivers(ctx, layout, op.send)) dispatch_send<kMode>(args, ctx, layout, op.send, s_ids);
        finish_phase(&ctx.state->send_done, &ctx.state->send_seq);
    }
    if (phases & kRecvPhase) {
        dispatch_recv<kMode>(args, ctx, layout, op.recv);
        if (finish_phase(&ctx.state->recv_done, &ctx.state->recv_seq)) acknowledge(ctx, layout, op.recv.seq + 1);
    }
}

// ------------------------------------------------------------------ combine
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

constexpr int kPartialUnroll = 4;  // vectors per lane reduced together into a partial row
constexpr int kPartialRows = 2;    // local expert rows loaded together into a partial row

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
    const bool first = first_slot_of_rank(dst, lane);
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

// Loop 2, for one received row (local expert, source `src`, `token`): waits for the token's metadata;
// if the row belongs to the token's first slot on this rank, reduces all of the token's local rows into
// its partial row and delivers it to `src` (rows of the token's other slots are done). False when a
// wait gave up.
MOE_EP_DEVICE bool reduce_token(const CombineArgs& a, const Context& c, const Layout& L, const Phase& op,
                                int local_expert, int src, int token, int lane, uint64_t& waited, bool& used_puts) {
    const int num_ranks = c.comm.num_ranks, rank = c.comm.rank;
    const int num_local = a.num_experts / num_ranks;
    const int64_t pair = static_cast<int64_t>(src) * a.max_tokens + token;
    bool ok = true;
    if (lane == 0) {
        uint32_t unused;
        ok = wait_signal(reinterpret_cast<const uint64_t*>(c.local + op.meta_flags) + pair, op.tag, c, unused, waited);
    }
    // __syncwarp orders lane 0's acquire before the other lanes' reads of the entries.
    __syncwarp();
    if (!__shfl_sync(kFullMask, ok, 0)) return false;
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
    uint8_t* out = peer != nullptr ? peer + data_offset : c.local + L.stage + pair * L.row_bytes;
    reduce_partial_row(reinterpret_cast<int4*>(out), row, weight, slots, a.hidden / 8, lane);
    const uint64_t signal = make_signal(op.tag, 0);
    const int64_t flag_offset = op.flags + slot * 8;
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
            ok = reduce_token(a, c, L, op, local_expert, src, token, lane, waited, used_puts);
        }
        if (lane == 0) add_wait(a.wait_stats, src, waited);  // metadata waits count for the source
        if (!ok) break;
    }
    if (used_puts) complete_puts();
}

// out[t] = bf16(sum over the ranks hosting t's valid slots, ascending, of float(P[r, t])) in float32.
MOE_EP_DEVICE void combine_recv(const CombineArgs& a, const Context& c, const Layout& L, const Phase& op) {
    __shared__ int s_ranks[kNumMaxTopk];
    __shared__ int s_count;
    __shared__ int s_failed;
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
            const bool first = first_slot_of_rank(r, lane);
            // The position of r among the token's ranks in ascending order.
            int position = 0;
            if (num_ranks <= 32) {
                const uint32_t ranks = __reduce_or_sync(kFullMask, first ? 1u << r : 0u);
                position = first ? __popc(ranks & ((1u << r) - 1u)) : 0;
            } else {
                const int key = first ? r : INT_MAX;
                for (int i = 0; i < 32; ++i) position += __shfl_sync(kFullMask, key, i) < key;
            }
            const int count = __popc(__ballot_sync(kFullMask, first));
            bool ok = true;
            if (first) {
                uint64_t waited = 0;
                uint32_t unused;
                ok = wait_signal(flags + static_cast<int64_t>(r) * a.max_tokens + t, op.tag, c, unused, waited);
                add_wait(a.wait_stats, r, waited);
                s_ranks[position] = r;
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
        for (int vec = threadIdx.x; vec < vectors; vec += blockDim.x) {
            float acc[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
            for (int p0 = 0; p0 < count; p0 += kReduceBatch) {
                int4 rows[kReduceBatch];
#pragma unroll
                for (int u = 0; u < kReduceBatch; ++u)
                    if (p0 + u < count)
                        rows[u] = reinterpret_cast<const int4*>(
                            data + (static_cast<int64_t>(s_ranks[p0 + u]) * a.max_tokens + t) * L.row_bytes)[vec];
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
            static_cast<int4*>(a.out)[static_cast<int64_t>(t) * vectors + vec] = to_bf16x8(acc);
        }
        __syncthreads();  // s_ranks / s_count are rewritten for the next token
    }
}

__global__ void __launch_bounds__(kBlockThreads, 1)
    combine_kernel(const CombineArgs args, const Context ctx, const Layout layout, int phases) {
    const Operation op = begin_operation(ctx, layout);
    if (op.abort) return;
    if (phases & kSendPhase) {
        if (wait_for_receivers(ctx, layout, op.send)) combine_send(args, ctx, layout, op.send);
        finish_phase(&ctx.state->send_done, &ctx.state->send_seq);
    }
    if (phases & kRecvPhase) {
        combine_recv(args, ctx, layout, op.recv);
        if (finish_phase(&ctx.state->recv_done, &ctx.state->recv_seq)) acknowledge(ctx, layout, op.recv.seq + 1);
    }
}

// ------------------------------------------------------------------ launches

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

template <Mode kMode>
cudaError_t launch_dispatch_mode(const DispatchArgs& args, const Context& ctx, const Layout& layout, int phases,
                                 cudaStream_t stream) {
    static const cudaError_t attribute = cudaFuncSetAttribute(
        dispatch_kernel<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxTopkEntries * sizeof(int16_t));
    if (attribute != cudaSuccess) return attribute;
    const size_t shared = (phases & kSendPhase) ? (static_cast<size_t>(args.num_tokens) * args.num_topk * 2 + 15) / 16 * 16 : 0;
    return launch_cooperative(dispatch_kernel<kMode>, ctx.num_blocks, shared, stream, args, ctx, layout, phases);
}

}  // namespace

Layout make_layout(int64_t max_tokens, int64_t hidden, int64_t num_ranks, int64_t num_experts) {
    Layout layout{};
    layout.row_bytes = hidden * 2;
    const int64_t rows = num_experts * max_tokens;  // the local experts of all ranks are the global experts
    const int64_t tokens = num_ranks * max_tokens;  // (source rank, token) pairs
    layout.acks = 0;
    int64_t offset = persistent_bytes(num_ranks);
    for (int half = 0; half < 2; ++half) {
        layout.counts[half] = offset;
        offset += align_buffer_bytes(num_experts * 8);
        layout.flags[half] = offset;
        offset += align_buffer_bytes(rows * 8);
        layout.data[half] = offset;
        offset += align_buffer_bytes(rows * layout.row_bytes);
        layout.meta_flags[half] = offset;
        offset += align_buffer_bytes(tokens * 8);
        layout.meta[half] = offset;
        offset += align_buffer_bytes(tokens * kMetaBytes);
    }
    layout.send = offset;
    offset += align_buffer_bytes(rows * layout.row_bytes);
    layout.rowmap = offset;
    offset += align_buffer_bytes(rows * 8);
    layout.stage = offset;
    offset += align_buffer_bytes(tokens * layout.row_bytes);
    layout.stage_meta = offset;
    offset += align_buffer_bytes(max_tokens * kMetaBytes);
    layout.total = offset;
    return layout;
}

cudaError_t launch_dispatch(const DispatchArgs& args, const Context& ctx, const Layout& layout, int phases,
                            cudaStream_t stream) {
    switch (args.mode) {
        case Mode::kBF16: return launch_dispatch_mode<Mode::kBF16>(args, ctx, layout, phases, stream);
        case Mode::kFP8: return launch_dispatch_mode<Mode::kFP8>(args, ctx, layout, phases, stream);
        default: return launch_dispatch_mode<Mode::kFP8UE8M0>(args, ctx, layout, phases, stream);
    }
}

cudaError_t launch_barrier(const Context& ctx, uint64_t epoch, bool exact, cudaStream_t stream) {
    barrier_kernel<<<1, 32, 0, stream>>>(ctx, epoch, exact);
    return cudaGetLastError();
}

cudaError_t launch_combine(const CombineArgs& args, const Context& ctx, const Layout& layout, int phases,
                           cudaStream_t stream) {
    return launch_cooperative(combine_kernel, ctx.num_blocks, 0, stream, args, ctx, layout, phases);
}

int grid_blocks(int device) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
    return sms;
}

}  // namespace moe_ep::kernels::ll
