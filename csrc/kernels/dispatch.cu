// Intranode dispatch. Block c serves channel c (a contiguous token range) with two independent
// pipelines: its send pipeline sends the channel to every destination, its receive pipeline receives
// it from every source, so that every SM pushes to peers. A ring slot (whole 128-byte lines) holds one
// token: the hidden row, then the extras [scales (G x 4 B) | source index | top-k ids (k x int32) |
// top-k weights (k x f32)].
// Tokens for this rank itself skip the rings: the sender writes them straight into the outputs.
#include <algorithm>

#include "pipeline.cuh"

namespace moe_ep::kernels {

namespace {

// Per pipeline. Sender: warps [0, kLoaderWarps) load, the next one stores, the next one writes
// send_head. Receiver: warp 0 loads, warp 1 stores.
constexpr int kLoaderWarps = 4;
constexpr int kPipelineThreads = 32 * (kLoaderWarps + 2);
constexpr int kDispatchThreads = kPipelineThreads * kDispatchPipelinesPerBlock;

struct SlotLayout {
    int row_bytes, num_scales, num_topk;
    MOE_EP_DEVICE int scales() const { return row_bytes / 4; }  // offsets in 4-byte words
    MOE_EP_DEVICE int src() const { return scales() + num_scales; }
    MOE_EP_DEVICE int topk() const { return src() + 1; }
    MOE_EP_DEVICE int weights() const { return topk() + num_topk; }
};

// Whether a dispatch must move nothing: the last notify kernel found some rank receiving more rows
// than its num_worst_tokens (or failed), a verdict that every rank shares, so that no block anywhere
// waits for another; or this rank's rows would not fit its outputs (a cached dispatch reusing the
// handle of such a dispatch: no other rank knows, their waits end in the timeout).
MOE_EP_DEVICE bool dispatch_cancelled(const CommContext& comm, const int* num_recv, int num_recv_rows) {
    return ld_volatile(comm.peers.ctrl[comm.rank] + ctrl::kDispatchCancelled) != 0 || *num_recv > num_recv_rows;
}

// Rows this rank receives, from the handle.
MOE_EP_DEVICE const int* recv_total(const int* rank_prefix_matrix, const CommContext& comm) {
    return rank_prefix_matrix + (comm.num_ranks - 1) * comm.num_ranks + comm.rank;
}

// Writes one received token's extras into the outputs (lane-parallel), mapping expert ids to local ids.
MOE_EP_DEVICE void write_recv_extras(const DispatchArgs& a, const SlotLayout& layout, const uint8_t* slot, int row,
                                     int rank, int lane) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(slot);
    if (a.recv_x_scales != nullptr)
        for (int g = lane; g < a.num_scales; g += 32)
            a.recv_x_scales[static_cast<size_t>(row) * a.num_scales + g] = words[layout.scales() + g];
    if (a.recv_src_idx != nullptr && lane == 0) a.recv_src_idx[row] = static_cast<int>(words[layout.src()]);
    if (a.recv_topk_idx != nullptr && lane < a.num_topk) {
        const int expert = static_cast<int>(words[layout.topk() + lane]);
        const int first = rank * a.num_local_experts;
        const bool local = expert >= first && expert < first + a.num_local_experts;
        a.recv_topk_idx[static_cast<size_t>(row) * a.num_topk + lane] = local ? expert - first : -1;
        if (a.recv_topk_weights != nullptr) {
            const float w = __uint_as_float(words[layout.weights() + lane]);
            a.recv_topk_weights[static_cast<size_t>(row) * a.num_topk + lane] = local ? w : 0.0f;
        }
    }
}

// Tokens this rank keeps: written straight into its own outputs by the storer warp.
struct SelfSink {
    const DispatchArgs* a;
    SlotLayout layout;
    int base_row;  // first output row of (this rank, this channel)
    int rank;
    MOE_EP_DEVICE void data(const uint8_t* stage, int, int pos) const {
        bulk_store(static_cast<uint8_t*>(a->recv_x) + static_cast<size_t>(base_row + pos) * a->row_bytes, stage,
                   a->row_bytes);
    }
    MOE_EP_DEVICE void extras(const uint8_t* stage, int, int pos, int lane) const {
        write_recv_extras(*a, layout, stage, base_row + pos, rank, lane);
    }
};

// Loader warp `loader` of kLoaderWarps fills the stages of every kLoaderWarps-th token sent anywhere,
// so that several tokens' metadata loads are in flight at once.
MOE_EP_DEVICE void load_tokens(const DispatchArgs& a, const SlotLayout& layout, const StageRing& ring, int channel,
                               int begin, int end, int loader, const CommContext& comm, volatile int* abort) {
    const int lane = threadIdx.x & 31;
    int seq = 0;
    MOE_EP_PROF(ProfRole timing; timing.begin(); uint64_t t_prof;
                struct Store {  // writes the record on every way out
                    ProfRole& p; const CommContext& c; int ch, role;
                    MOE_EP_DEVICE ~Store() { p.store(c, prof::kDispatch, ch, role); }
                } prof_store{timing, comm, channel, loader};)
    for (int base = begin; base < end; base += 32) {
        const int t = base + lane;
        const uint32_t my_mask = t < end ? token_rank_mask(a.is_token_in_rank, t, comm.num_ranks) : 0;
        uint32_t pending = __ballot_sync(kFullMask, my_mask != 0);
        while (pending) {
            const int src_lane = __ffs(pending) - 1;
            pending &= pending - 1;
            const int token = base + src_lane;
            const uint32_t mask = __shfl_sync(kFullMask, my_mask, src_lane);
            if (seq++ % kLoaderWarps != loader) continue;
            MOE_EP_PROF(t_prof = global_timer_ns();)
            if (!acquire_stage(ring, seq - 1, comm, abort)) return;
            MOE_EP_PROF(t_prof = timing.add(prof::kWaitStage, t_prof); timing.mark_first(); timing.count(prof::kItems);)
            uint32_t* words = reinterpret_cast<uint32_t*>(ring.stage((seq - 1) % ring.num_stages));
            if (a.x_scales != nullptr)
                for (int g = lane; g < a.num_scales; g += 32)
                    words[layout.scales() + g] = a.x_scales[static_cast<int64_t>(token) * a.scale_stride + g];
            if (lane == 0) words[layout.src()] = static_cast<uint32_t>(token);
            if (a.topk_idx != nullptr && lane < a.num_topk) {
                const size_t k = static_cast<size_t>(token) * a.num_topk + lane;
                words[layout.topk() + lane] = static_cast<uint32_t>(static_cast<int>(a.topk_idx[k]));
                words[layout.weights() + lane] = a.topk_weights != nullptr ? __float_as_uint(a.topk_weights[k]) : 0u;
            }
            fill_stage(ring, seq - 1, token, mask,
                       static_cast<const uint8_t*>(a.x) + static_cast<size_t>(token) * a.row_bytes, a.row_bytes);
            MOE_EP_PROF(timing.add(prof::kCopy, t_prof);)
        }
    }
    if (seq % kLoaderWarps == loader && acquire_stage(ring, seq, comm, abort)) fill_stage(ring, seq, -1, 0, nullptr, 0);
}

// send_head[t, d]: position of token t inside the block destination d receives from this rank.
MOE_EP_DEVICE void write_send_head(const DispatchArgs& a, int channel, int begin, int end, int num_ranks
                                   MOE_EP_PROF(, const CommContext& comm)) {
    const int lane = threadIdx.x & 31;
    MOE_EP_PROF(ProfRole timing; timing.begin(); timing.count(prof::kItems, end > begin ? end - begin : 0);)
    int running[kMaxRanks];
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d)
        running[d] = d < num_ranks && channel > 0 ? a.channel_prefix_matrix[d * a.num_channels + channel - 1] : 0;
    for (int base = begin; base < end; base += 32) {
        const int t = base + lane;
        const uint32_t mask = t < end ? token_rank_mask(a.is_token_in_rank, t, num_ranks) : 0;
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            if (d >= num_ranks) break;
            const bool hit = (mask >> d) & 1;
            const uint32_t ballot = __ballot_sync(kFullMask, hit);
            if (t < end)
                a.send_head[static_cast<size_t>(t) * num_ranks + d] =
                    hit ? running[d] + __popc(ballot & ((1u << lane) - 1)) : -1;
            running[d] += __popc(ballot);
        }
    }
    MOE_EP_PROF(timing.acc[prof::kCopy] = static_cast<uint32_t>(global_timer_ns() - timing.start);
                timing.store(comm, prof::kDispatch, channel, prof::kDispatchSendHead);)
}

MOE_EP_DEVICE void run_receiver(const DispatchArgs& a, const SlotLayout& layout, const StageRing& ring, int channel,
                                int slot_bytes, const CommContext& comm, volatile int* abort) {
    const int warp = (threadIdx.x % kPipelineThreads) / 32, lane = threadIdx.x & 31;
    const int R = comm.num_ranks, C = a.num_channels, me = comm.rank;
    // Lane s tracks source s: rows [start, start + count) of recv_x come from its ring.
    int start = 0, count = 0;
    if (lane < R && lane != me) {
        start = a.recv_channel_prefix_matrix[lane * C + channel];
        const int end = channel + 1 < C ? a.recv_channel_prefix_matrix[lane * C + channel + 1]
                                        : a.rank_prefix_matrix[lane * R + me];
        count = end - start;
    }
    const int total = warp_sum(count);
    int* stage_row = ring.token;  // the receiver keeps the output row in the token field
    if (warp == 0) {
        // Loader: poll the tails and bulk-load every announced slot into a stage.
        const int* tail_ptr = comm.peers.ctrl[me] + ctrl::kTail + channel * kMaxRanks + lane;
        const uint8_t* my_ring = comm.peers.data[me] + ring_offset(channel, lane < R ? lane : 0, R, a.ring_slots,
                                                                   slot_bytes);
        int loaded = 0;
        uint64_t deadline = global_timer_ns() + comm.timeout_ns;
        MOE_EP_PROF(ProfRole timing; timing.begin(); uint64_t t_prof = timing.start; int t_poll = 0;
                    struct Store {
                        ProfRole& p; const CommContext& c; int ch;
                        MOE_EP_DEVICE ~Store() { p.store(c, prof::kDispatch, ch, prof::kDispatchRecvLoader); }
                    } prof_store{timing, comm, channel};)
        for (int seq = 0; seq < total;) {
            MOE_EP_PROF(if (t_poll == 0) t_prof = timing.add(prof::kCopy, t_prof);)  // not inside a failed-poll streak
            int ready = 0;
            if (loaded < count) ready = min(ld_acquire_sys(tail_ptr), count) - loaded;
            __syncwarp();
            if (__ballot_sync(kFullMask, ready > 0) == 0) {
                MOE_EP_PROF(t_poll = 1;)
                if (*abort) return;
                if (global_timer_ns() > deadline) {
                    report_error(comm.flags, kErrRecvTimeout);
                    *abort = 1;
                    return;
                }
                continue;
            }
            MOE_EP_PROF(if (t_poll != 0) timing.count(prof::kWaitEvents);  // polling (failed or not) is remote wait
                        t_poll = 0; t_prof = timing.add(prof::kWaitRemote, t_prof); timing.mark_first();)
            deadline = global_timer_ns() + comm.timeout_ns;
            if (lane == 0) fence_proxy_async_global();  // the tails acquired above cover the bulk loads below
            for (int s = 0; s < R; ++s) {
                const int n = __shfl_sync(kFullMask, ready, s);
                const int first = __shfl_sync(kFullMask, loaded, s);
                const int row0 = __shfl_sync(kFullMask, start, s);
                const uint8_t* src_ring = reinterpret_cast<const uint8_t*>(
                    __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_ring), s));
                for (int i = 0; i < n; ++i, ++seq) {
                    MOE_EP_PROF(t_prof = timing.add(prof::kCopy, t_prof);)
                    if (!acquire_stage(ring, seq, comm, abort)) return;
                    MOE_EP_PROF(t_prof = timing.add(prof::kWaitStage, t_prof); timing.count(prof::kItems);)
                    if (lane == 0) {
                        const int st = seq % ring.num_stages;
                        stage_row[st] = row0 + first + i;
                        ring.mask[st] = s;
                        mbar_arrive_expect_tx(ring.full + st, slot_bytes);
                        bulk_load(ring.stage(st), src_ring + static_cast<size_t>((first + i) % a.ring_slots) * slot_bytes,
                                  slot_bytes, ring.full + st);
                    }
                    __syncwarp();
                }
            }
            loaded += ready;
        }
    } else if (warp == 1) {
        // Storer: stage -> recv_x row (bulk) and extras (lanes); frees ring slots by publishing heads.
        const int lag_read = read_lag(ring.num_stages, comm.pipeline_lag);
        int done = 0, published = 0;
        int* head_ptr = lane < R ? comm.peers.ctrl[lane] + ctrl::kHead + channel * kMaxRanks + me : nullptr;
        MOE_EP_PROF(ProfRole timing; timing.begin(); uint64_t t_prof;)
        for (int seq = 0; seq < total; ++seq) {
            const int st = seq % ring.num_stages;
            MOE_EP_PROF(t_prof = global_timer_ns();)
            if (!__all_sync(kFullMask, mbar_wait(ring.full + st, (seq / ring.num_stages) & 1, comm, abort))) break;
            MOE_EP_PROF(t_prof = timing.add(prof::kWaitStage, t_prof); timing.mark_first(); timing.count(prof::kItems);)
            const int row = stage_row[st];
            const int src = static_cast<int>(ring.mask[st]);
            const uint8_t* stage = ring.stage(st);
            if (lane == 0) {
                bulk_store(static_cast<uint8_t*>(a.recv_x) + static_cast<size_t>(row) * a.row_bytes, stage, a.row_bytes);
                bulk_commit();
            }
            write_recv_extras(a, layout, stage, row, me, lane);
            MOE_EP_PROF(t_prof = timing.add(prof::kCopy, t_prof);)
            if (lane == src) {
                ++done;
                if (done - published >= a.publish_every || done == count) {
                    // The slot's bulk load completed (its full barrier fired), so the slot is free: a
                    // relaxed store suffices, where a release would also wait for our output stores.
                    st_relaxed_sys(head_ptr, done);
                    published = done;
                }
            }
            MOE_EP_PROF(__syncwarp(); t_prof = timing.add(prof::kPublish, t_prof);)
            if (lane == 0) bulk_wait_dyn<true>(lag_read);
            __syncwarp();
            MOE_EP_PROF(timing.add(prof::kCopyWait, t_prof);)
            if (lane == 0 && seq >= lag_read) mbar_arrive(ring.empty + (seq - lag_read) % ring.num_stages);
        }
        MOE_EP_PROF(t_prof = global_timer_ns();)
        if (lane == 0) bulk_wait<0>();
        MOE_EP_PROF(__syncwarp(); timing.add(prof::kCopyWait, t_prof);
                    timing.store(comm, prof::kDispatch, channel, prof::kDispatchRecvStorer);)
    }
}

__global__ void __launch_bounds__(kDispatchThreads, 1) dispatch_kernel(DispatchArgs a, CommContext comm,
                                                                       int num_stages, int slot_bytes) {
    extern __shared__ __align__(1024) uint8_t smem[];
    __shared__ volatile int s_abort;  // shared by the block's pipelines: one failure stops both
    const int pipeline = threadIdx.x / kPipelineThreads;
    const int channel = blockIdx.x;
    const bool is_sender = pipeline == 0;
    const int warp = (threadIdx.x % kPipelineThreads) / 32;
    // A cancelled dispatch still writes send_head (this rank's routing alone), so that a combine issued
    // with its handle before the error surfaces pairs up across ranks instead of waiting on garbage.
    const bool cancelled = dispatch_cancelled(comm, recv_total(a.rank_prefix_matrix, comm), a.num_recv_rows);
    const SlotLayout layout{a.row_bytes, a.num_scales, a.num_topk};
    const StageRing ring = make_stage_ring(smem + pipeline * stage_ring_smem_bytes(num_stages, slot_bytes), num_stages,
                                           slot_bytes, threadIdx.x % kPipelineThreads == 0);
    if (threadIdx.x == 0) s_abort = 0;
    __syncthreads();
    MOE_EP_PROF(static_assert(kLoaderWarps == prof::kDispatchLoaders, "profile roles follow the warp layout");)

    if (!is_sender) {
        if (cancelled) return;
        run_receiver(a, layout, ring, channel, slot_bytes, comm, &s_abort);
        return;
    }
    int begin, end;
    channel_range(a.num_tokens, a.num_channels, channel, begin, end);
    if (warp == kLoaderWarps + 1) {
        if (a.send_head != nullptr) write_send_head(a, channel, begin, end, comm.num_ranks MOE_EP_PROF(, comm));
    } else if (cancelled) {
        return;
    } else if (warp < kLoaderWarps) {
        load_tokens(a, layout, ring, channel, begin, end, warp, comm, &s_abort);
    } else {
        const SelfSink sink{&a, layout, a.recv_channel_prefix_matrix[comm.rank * a.num_channels + channel], comm.rank};
        run_storer(ring, StorerParams{channel, a.ring_slots, slot_bytes, a.publish_every}, comm, sink, &s_abort);
    }
}

__global__ void fill_padding_kernel(const int* num_recv, int num_rows, int row_bytes, uint8_t* recv_x, int num_scales,
                                    uint32_t* recv_x_scales, int num_topk, int64_t* recv_topk_idx,
                                    float* recv_topk_weights, int* recv_src_idx, CommContext comm) {
    const int first = dispatch_cancelled(comm, num_recv, num_rows) ? 0 : *num_recv;
    const int units = row_bytes / 16;
    for (int row = first + blockIdx.x; row < num_rows; row += gridDim.x) {
        int4* out = reinterpret_cast<int4*>(recv_x + static_cast<size_t>(row) * row_bytes);
        for (int u = threadIdx.x; u < units; u += blockDim.x) out[u] = make_int4(0, 0, 0, 0);
        if (recv_x_scales != nullptr)
            for (int g = threadIdx.x; g < num_scales; g += blockDim.x)
                recv_x_scales[static_cast<size_t>(row) * num_scales + g] = 0;
        if (threadIdx.x < num_topk) {
            if (recv_topk_idx != nullptr) recv_topk_idx[static_cast<size_t>(row) * num_topk + threadIdx.x] = -1;
            if (recv_topk_weights != nullptr) recv_topk_weights[static_cast<size_t>(row) * num_topk + threadIdx.x] = 0.0f;
        }
        if (threadIdx.x == 0 && recv_src_idx != nullptr) recv_src_idx[row] = -1;
    }
}

}  // namespace

int dispatch_slot_bytes(int row_bytes, int num_scales, int num_topk) {
    return align_slot(row_bytes + 4 * (num_scales + 1 + 2 * num_topk));
}

int max_pipeline_stages(int slot_bytes, int pipelines) {
    int device = 0, optin = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
        return 0;
    const int static_bytes = 2048;  // static shared memory of the kernels
    const int per_pipeline = (optin - static_bytes) / pipelines - kStageRingHeaderBytes;
    const int stages = std::min(kMaxStages, per_pipeline / stage_stride(slot_bytes));
    return stages >= 2 ? stages : 0;
}

cudaError_t launch_dispatch(const DispatchArgs& args, const CommContext& comm, cudaStream_t stream) {
#ifdef MOE_EP_PROFILE
    if (const cudaError_t perr = clear_profile(comm, prof::kDispatch, stream); perr != cudaSuccess) return perr;
#endif
    const int slot_bytes = dispatch_slot_bytes(args.row_bytes, args.num_scales, args.num_topk);
    const int stages = max_pipeline_stages(slot_bytes, kDispatchPipelinesPerBlock);
    if (stages == 0) return cudaErrorInvalidValue;
    const size_t smem = kDispatchPipelinesPerBlock * stage_ring_smem_bytes(stages, slot_bytes);
    cudaError_t err = cudaFuncSetAttribute(dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    dispatch_kernel<<<args.num_channels, kDispatchThreads, smem, stream>>>(args, comm, stages, slot_bytes);
    return cudaGetLastError();
}

cudaError_t launch_fill_padding(const int* num_recv, int num_rows, int row_bytes, void* recv_x, int num_scales,
                                uint32_t* recv_x_scales, int num_topk, int64_t* recv_topk_idx,
                                float* recv_topk_weights, int* recv_src_idx, const CommContext& comm,
                                cudaStream_t stream) {
    if (num_rows == 0) return cudaSuccess;
    const int blocks = std::min(num_rows, 1024);
    fill_padding_kernel<<<blocks, 128, 0, stream>>>(num_recv, num_rows, row_bytes, static_cast<uint8_t*>(recv_x),
                                                    num_scales, recv_x_scales, num_topk, recv_topk_idx,
                                                    recv_topk_weights, recv_src_idx, comm);
    return cudaGetLastError();
}

}  // namespace moe_ep::kernels
