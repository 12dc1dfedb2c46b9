// Low-latency dispatch (the protocol: low_latency/api.cuh).
//  * Send: warp item e < E counts the messages for expert e and signals the count to its owner; then a
//    team of warps per token t (per (t, rank) at small batches) casts t once, each warp a share of the
//    row, writes the row to [this rank][t] on every rank hosting one of t's experts, then signals each
//    of t's messages at the position of t among this rank's tokens for its expert (so rows arrive in
//    token order).
//  * Receive: (local expert, source) pairs, several warps per pair; each learns the counts of every
//    source of its expert, packs its messages' rows source-major and writes layout_range / recv_count.
#include "low_latency/kernels/operation.cuh"
#include "low_latency/kernels/rows.cuh"
#include "low_latency/kernels/schedule.cuh"
#include "low_latency/kernels/signals.cuh"

namespace moe_ep::kernels::ll {

namespace {

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
                             const int16_t* s_ids, const LeftOutSnapshot& left_out_ranks, int count_warps, int lane) {
    const int num_ranks = c.comm.num_ranks, rank = c.comm.rank;
    const int num_local = a.num_experts / num_ranks;
    // Items split by rank only while they fill at most half of the largest teams: a row cast once for
    // all its ranks sends less, while separate ranks go out from separate teams at once. The send phase
    // alone at 4 ranks: by rank 7.5 us against 8.5 at 1 token; by token 8.9 us against 9.2 at 32.
    const int parts = a.num_tokens * num_ranks <= TeamSchedule::full_size_teams(count_warps) / 2 ? num_ranks : 1;
    const int num_items = a.num_tokens * parts;
    const TeamSchedule team = TeamSchedule::make(num_items, count_warps);
    const int bytes = message_bytes(kMode, a.hidden);
    bool used_puts = false;
    for (int item = team.team; item < num_items; item += team.num_teams) {
        const int token = item / parts, part = item % parts;
        const int expert = lane < a.num_topk ? s_ids[token * a.num_topk + lane] : -1;
        const int dst = expert >= 0 ? expert / num_local : -1;
        const bool in_item = expert >= 0 && (parts == 1 || dst == part) && !left_out_ranks(dst);
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
        // cumulative: no fence per warp (a fence in every warp before the barrier cost 1-2 us at every
        // size).
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
    __shared__ LeftOutSnapshot left_out_ranks;
    left_out_ranks.fill(c);  // synchronizes the block (s_ids too)

    const WarpSchedule ws = WarpSchedule::make();
    const int lane = ws.lane;
    bool used_puts = false;
    for (int item = ws.warp; item < a.num_experts; item += ws.num_warps) {
        // Every (expert, source) pair gets a count, zero included: receivers wait for all of them. A
        // count guards no data (each message has its own flag), so it needs no release.
        const int count = count_expert(s_ids, entries, item, lane);
        if (lane == 0 && !left_out_ranks(item / num_local)) {
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
    if (send_rows<kMode>(a, c, L, op, s_ids, left_out_ranks, count_warps, lane)) used_puts = true;
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

// Elastic mode: warp s decides whether source s takes part in this receive (every one of its counts
// arrived, lanes over the local experts) or is left out (masked before, or now by a timeout), and
// publishes the verdict, which every warp then packs by.
MOE_EP_DEVICE void decide_sources(const DispatchArgs& a, const Context& c, const Phase& op, const WarpSchedule& ws) {
    const int num_ranks = c.comm.num_ranks, num_local = a.num_experts / num_ranks;
    const uint64_t* counts = reinterpret_cast<const uint64_t*>(c.local + op.counts);
    for (int s = ws.warp; s < num_ranks; s += ws.num_warps) {
        bool present = true;
        uint64_t waited = 0;
        for (int e = ws.lane; e < num_local && present; e += 32) {
            uint32_t unused;
            present = wait_signal(counts + e * num_ranks + s, op.tag, c, s, unused, waited) == Arrival::kReady;
        }
        present = __all_sync(kFullMask, present);
        if (ws.lane == 0) {
            st_release_gpu_u64(c.verdicts + s, make_signal(op.tag, present ? 1u : 2u));
            add_wait(a.wait_stats, s, waited);
        }
    }
}

// The count of messages from source `s` for `local_expert`: false when this rank gave up. In elastic mode
// by the source's verdict (0 when it is left out); its wait guards only against a fault of this rank's
// own warps, so it may last twice the timeout (a verdict can take one timeout to come).
MOE_EP_DEVICE bool source_count(const DispatchArgs& a, const Context& c, const Phase& op, int local_expert, int s,
                                uint32_t& n, uint64_t& waited) {
    const uint64_t* count = reinterpret_cast<const uint64_t*>(c.local + op.counts) + local_expert * c.comm.num_ranks + s;
    if (c.mask == nullptr) return wait_signal(count, op.tag, c, s, n, waited) == Arrival::kReady;
    const uint64_t deadline = global_timer_ns() + 2 * c.comm.timeout_ns;
    uint64_t verdict = ld_acquire_gpu_u64(c.verdicts + s);
    for (uint32_t spins = 1; (verdict >> 32) != op.tag; ++spins) {
        if ((spins & 63) == 0 && (ld_volatile(&c.state->abort) != 0 || global_timer_ns() > deadline)) {
            if (ld_volatile(&c.state->abort) == 0) {
                report_error(c.comm.flags, kErrInternalTimeout);
                c.state->abort = 1;
            }
            return false;
        }
        verdict = ld_acquire_gpu_u64(c.verdicts + s);
    }
    n = static_cast<uint32_t>(verdict) == 1 ? static_cast<uint32_t>(ld_acquire_sys_u64(count)) : 0u;
    return true;
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
    const uint64_t* flags = reinterpret_cast<const uint64_t*>(c.local + op.flags);
    const uint8_t* data = c.local + op.data;
    if (c.mask != nullptr) decide_sources(a, c, op, ws);

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
            ok = source_count(a, c, op, local_expert, s, n, count_wait);
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
            Arrival arrival = Arrival::kReady;
            if (lane == 0) arrival = wait_signal(flags + first + i, op.tag, c, src, token, waited);
            // __syncwarp orders lane 0's acquire before the other lanes' reads of the message.
            __syncwarp();
            arrival = static_cast<Arrival>(__shfl_sync(kFullMask, static_cast<int>(arrival), 0));
            if (arrival == Arrival::kFailed) return;
            // Elastic mode: a source masked after its counts arrived leaves its remaining rows of this
            // receive unwritten (the layout still counts them).
            if (arrival == Arrival::kLeftOut) break;
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

cudaError_t launch_dispatch(const DispatchArgs& args, const Context& ctx, const Layout& layout, int phases,
                            cudaStream_t stream) {
    switch (args.mode) {
        case Mode::kBF16: return launch_dispatch_mode<Mode::kBF16>(args, ctx, layout, phases, stream);
        case Mode::kFP8: return launch_dispatch_mode<Mode::kFP8>(args, ctx, layout, phases, stream);
        default: return launch_dispatch_mode<Mode::kFP8UE8M0>(args, ctx, layout, phases, stream);
    }
}

}  // namespace moe_ep::kernels::ll
