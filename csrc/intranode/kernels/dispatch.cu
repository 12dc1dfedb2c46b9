// Intranode dispatch. Block c serves channel c (a contiguous token range) twice over: its send pipeline
// sends the channel to every destination with bulk copies, its receiver warps copy what every source
// sent into the outputs with loads and stores (so that the SM's bulk-copy unit serves the sends
// alone), and every SM pushes to peers. A ring slot (whole 128-byte lines) holds one token: the hidden
// row, then the extras [scales (G x 4 B) | source index | top-k ids (k x int32) | top-k weights
// (k x f32)]. Tokens for this rank itself skip the rings: the sender writes them straight into the
// outputs.
#include <algorithm>

#include "common/launch_cache.cuh"
#include "common/phase_clock.cuh"
#include "common/pipeline.cuh"
#include "intranode/api.cuh"

namespace moe_ep::kernels {

namespace {

// Sender: warps [0, kLoaderWarps) load, the next one stores, the next one writes send_head; then the
// receiver's kRecvWarps copy warps.
constexpr int kLoaderWarps = 4;
static_assert(kLoaderWarps == prof::kDispatchLoaders, "profile roles follow the warp layout");
constexpr int kSendWarps = kLoaderWarps + 2;
constexpr int kSendThreads = 32 * kSendWarps;
constexpr int kRecvWarps = 8;
constexpr int kDispatchThreads = kSendThreads + 32 * kRecvWarps;
// The storer publishes every destination's tail at once for slots up to this size: at hidden 7168
// that took the FP8 dispatch (7,552-byte slots) from 374-386 us to 325 us, and cost the BF16 one
// (14,464-byte slots) 25 us.
constexpr int kPublishTogetherMaxSlotBytes = 8192;

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
// `word(i)` reads the i-th 4-byte word of the slot.
template <typename Word>
MOE_EP_DEVICE void write_recv_extras(const DispatchArgs& a, const SlotLayout& layout, const Word& word, int row,
                                     int rank, int lane) {
    if (a.recv_x_scales != nullptr)
        for (int g = lane; g < a.num_scales; g += 32)
            a.recv_x_scales[static_cast<size_t>(row) * a.num_scales + g] = word(layout.scales() + g);
    if (a.recv_src_idx != nullptr && lane == 0) a.recv_src_idx[row] = static_cast<int>(word(layout.src()));
    if (a.recv_topk_idx != nullptr && lane < a.num_topk) {
        const int expert = static_cast<int>(word(layout.topk() + lane));
        const int first = rank * a.num_local_experts;
        const bool local = expert >= first && expert < first + a.num_local_experts;
        a.recv_topk_idx[static_cast<size_t>(row) * a.num_topk + lane] = local ? expert - first : -1;
        if (a.recv_topk_weights != nullptr) {
            const float w = __uint_as_float(word(layout.weights() + lane));
            a.recv_topk_weights[static_cast<size_t>(row) * a.num_topk + lane] = local ? w : 0.0f;
        }
    }
}

// Reads the words of a slot staged in shared memory.
struct StagedWords {
    const uint32_t* words;
    MOE_EP_DEVICE uint32_t operator()(int i) const { return words[i]; }
};

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
        write_recv_extras(*a, layout, StagedWords{reinterpret_cast<const uint32_t*>(stage)}, base_row + pos, rank, lane);
    }
};

// Loader warp `loader` of kLoaderWarps fills the stages of every kLoaderWarps-th token sent anywhere,
// so that several tokens' metadata loads are in flight at once.
MOE_EP_DEVICE void load_tokens(const DispatchArgs& a, const SlotLayout& layout, const StageRing& ring, int channel,
                               int begin, int end, int loader, const CommContext& comm, volatile int* abort) {
    const int lane = threadIdx.x & 31;
    int seq = 0;
    PhaseClock clock(comm, prof::record(prof::kDispatch, channel, loader));
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
            clock.lap(prof::kMeta);
            if (!acquire_stage(ring, seq - 1, comm, abort)) return;
            clock.lap(prof::kWaitStage);
            clock.item();
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
            clock.lap(prof::kCopy);
        }
    }
    if (seq % kLoaderWarps == loader && acquire_stage(ring, seq, comm, abort)) fill_stage(ring, seq, -1, 0, nullptr, 0);
}

// send_head[t, d]: position of token t inside the block destination d receives from this rank.
MOE_EP_DEVICE void write_send_head(const DispatchArgs& a, int channel, int begin, int end, int num_ranks,
                                   const CommContext& comm) {
    const int lane = threadIdx.x & 31;
    PhaseClock clock(comm, prof::record(prof::kDispatch, channel, prof::kDispatchSendHead));
    clock.count(prof::kItems, end > begin ? end - begin : 0);
    int running[kNumMaxNvlPeers];
#pragma unroll
    for (int d = 0; d < kNumMaxNvlPeers; ++d)
        running[d] = d < num_ranks && channel > 0 ? a.channel_prefix_matrix[d * a.num_channels + channel - 1] : 0;
    for (int base = begin; base < end; base += 32) {
        const int t = base + lane;
        const uint32_t mask = t < end ? token_rank_mask(a.is_token_in_rank, t, num_ranks) : 0;
#pragma unroll
        for (int d = 0; d < kNumMaxNvlPeers; ++d) {
            if (d >= num_ranks) break;
            const bool hit = (mask >> d) & 1;
            const uint32_t ballot = __ballot_sync(kFullMask, hit);
            if (t < end)
                a.send_head[static_cast<size_t>(t) * num_ranks + d] =
                    hit ? running[d] + __popc(ballot & ((1u << lane) - 1)) : -1;
            running[d] += __popc(ballot);
        }
    }
    clock.lap(prof::kCopy);
}

constexpr int kCopyUnroll = 16;  // 16-byte units in flight per lane of a receiver warp

// Reads the words of a ring slot a peer wrote (through L2: an earlier lap may sit in L1).
struct RingWords {
    const uint32_t* words;
    MOE_EP_DEVICE uint32_t operator()(int i) const { return __ldcg(words + i); }
};

MOE_EP_DEVICE void copy_row(const uint8_t* src, uint8_t* dst, int row_bytes, int lane) {
    const int units = row_bytes / 16;
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    for (int base = 0; base < units; base += 32 * kCopyUnroll) {
        int4 v[kCopyUnroll];
#pragma unroll
        for (int i = 0; i < kCopyUnroll; ++i)
            if (base + 32 * i + lane < units) v[i] = __ldcg(s + base + 32 * i + lane);
#pragma unroll
        for (int i = 0; i < kCopyUnroll; ++i)
            if (base + 32 * i + lane < units) d[base + 32 * i + lane] = v[i];
    }
}

// Copy warp `warp` of kRecvWarps takes rows warp, warp + kRecvWarps, ... of every source's ring for
// this channel, whichever source has one announced. A ring slot is free once every warp has moved
// past it: lane s publishes head s as the minimum over the warps' next rows of source s.
MOE_EP_DEVICE void run_receiver(const DispatchArgs& a, const SlotLayout& layout, int channel, int slot_bytes, int warp,
                                const CommContext& comm, volatile int* abort) {
    __shared__ int s_next[kRecvWarps][kNumMaxNvlPeers];  // per warp and source: the next row it has not copied
    __shared__ int s_published[kNumMaxNvlPeers];
    const int lane = threadIdx.x & 31;
    const int R = comm.num_ranks, C = a.num_channels, me = comm.rank;
    const bool source_lane = lane < R && lane != me;
    int start = 0, count = 0;
    if (source_lane) {
        start = a.recv_channel_prefix_matrix[lane * C + channel];
        const int end = channel + 1 < C ? a.recv_channel_prefix_matrix[lane * C + channel + 1]
                                        : a.rank_prefix_matrix[lane * R + me];
        count = end - start;
    }
    const int* tail_ptr = comm.peers.ctrl[me] + ctrl::kTail + channel * kNumMaxNvlPeers + lane;
    int* head_ptr = source_lane ? comm.peers.ctrl[lane] + ctrl::kHead + channel * kNumMaxNvlPeers + me : nullptr;
    const uint8_t* my_ring = comm.peers.data[me] + ring_offset(channel, lane < R ? lane : 0, R, a.ring_slots, slot_bytes);
    volatile int* next_of = &s_next[0][0];
    volatile int* published = s_published;
    int next = warp, tail_seen = 0;
    if (lane < kNumMaxNvlPeers) {
        next_of[warp * kNumMaxNvlPeers + lane] = next;
        if (warp == 0) published[lane] = 0;
    }
    asm volatile("bar.sync 2, %0;" ::"r"(32 * kRecvWarps));
    PhaseClock clock(comm, prof::record(prof::kDispatch, channel, prof::kDispatchRecvCopy),
                     warp == 0 ? ClockWriter::kSharedWithTimestamps : ClockWriter::kShared);
    uint64_t deadline = global_timer_ns() + comm.timeout_ns;
    for (;;) {
        const bool pending = source_lane && next < count;
        if (__ballot_sync(kFullMask, pending) == 0) break;
        if (pending && next >= tail_seen) tail_seen = ld_acquire_sys(tail_ptr);
        const uint32_t ready = __ballot_sync(kFullMask, pending && next < tail_seen);
        if (ready == 0) {
            clock.lap(prof::kCopy);
            clock.idle();
            if (*abort) return;
            if (global_timer_ns() > deadline) {
                report_error(comm.flags, kErrRecvTimeout);
                *abort = 1;
                return;
            }
        } else {
            clock.busy();
            deadline = global_timer_ns() + comm.timeout_ns;
            __syncwarp();  // lane s's acquire of tail s covers every lane's reads of ring s
            for (uint32_t todo = ready; todo != 0; todo &= todo - 1) {
                const int s = __ffs(todo) - 1;
                const int i = __shfl_sync(kFullMask, next, s);
                const int row = __shfl_sync(kFullMask, start, s) + i;
                const uint8_t* slot = reinterpret_cast<const uint8_t*>(__shfl_sync(
                                          kFullMask, reinterpret_cast<unsigned long long>(my_ring), s)) +
                                      static_cast<size_t>(i % a.ring_slots) * slot_bytes;
                copy_row(slot, static_cast<uint8_t*>(a.recv_x) + static_cast<size_t>(row) * a.row_bytes, a.row_bytes,
                         lane);
                write_recv_extras(a, layout, RingWords{reinterpret_cast<const uint32_t*>(slot)}, row, me, lane);
                clock.item();
            }
            if ((ready >> lane) & 1) next += kRecvWarps;
            __syncwarp();  // every lane's loads of the rows returned before their slots are released
            if (lane < kNumMaxNvlPeers) next_of[warp * kNumMaxNvlPeers + lane] = next;
            clock.lap(prof::kCopy);
        }
        // Head of source s: rows below every warp's next row are copied. An idle warp publishes what it
        // sees too, so that the last copy of a source is announced even if its warp missed another's.
        if (source_lane) {
            int head = count;
            for (int w = 0; w < kRecvWarps; ++w) head = min(head, next_of[w * kNumMaxNvlPeers + lane]);
            const int last = published[lane];
            if (head > last && (ready == 0 || head == count || head - last >= a.publish_every)) {
                if (atomicMax(const_cast<int*>(published) + lane, head) < head) red_max_relaxed_sys(head_ptr, head);
            }
        }
        clock.lap(prof::kPublish);
    }
}

__global__ void __launch_bounds__(kDispatchThreads, 1) dispatch_kernel(DispatchArgs a, CommContext comm,
                                                                       int num_stages, int slot_bytes) {
    extern __shared__ __align__(1024) uint8_t smem[];
    __shared__ volatile int s_abort;  // shared by the block's pipelines: one failure stops both
    const int channel = blockIdx.x;
    const bool is_sender = threadIdx.x < kSendThreads;
    const int warp = threadIdx.x / 32;
    // A cancelled dispatch still writes send_head (this rank's routing alone), so that a combine issued
    // with its handle before the error surfaces pairs up across ranks instead of waiting on garbage.
    const bool cancelled = dispatch_cancelled(comm, recv_total(a.rank_prefix_matrix, comm), a.num_recv_rows);
    const SlotLayout layout{a.row_bytes, a.num_scales, a.num_topk};
    const StageRing ring = make_stage_ring(smem, num_stages, slot_bytes, threadIdx.x == 0);
    if (threadIdx.x == 0) s_abort = 0;
    __syncthreads();

    if (!is_sender) {
        if (!cancelled) run_receiver(a, layout, channel, slot_bytes, warp - kSendWarps, comm, &s_abort);
        return;
    }
    int begin, end;
    channel_range(a.num_tokens, a.num_channels, channel, begin, end);
    if (warp == kLoaderWarps + 1) {
        if (a.send_head != nullptr) write_send_head(a, channel, begin, end, comm.num_ranks, comm);
    } else if (cancelled) {
        return;
    } else if (warp < kLoaderWarps) {
        load_tokens(a, layout, ring, channel, begin, end, warp, comm, &s_abort);
    } else {
        const SelfSink sink{&a, layout, a.recv_channel_prefix_matrix[comm.rank * a.num_channels + channel], comm.rank};
        const StorerParams params{channel, a.ring_slots, slot_bytes, a.publish_every,
                                  slot_bytes <= kPublishTogetherMaxSlotBytes};
        PhaseClock clock(comm, prof::record(prof::kDispatch, channel, prof::kDispatchSendStorer));
        run_storer(ring, params, comm, sink, &s_abort, clock);
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

int max_pipeline_stages(int slot_bytes) {
    const int optin = shared_memory_optin();
    if (optin == 0) return 0;
    const int static_bytes = 2048;  // static shared memory of the kernels
    const int ring_bytes = optin - static_bytes - kStageRingHeaderBytes;
    const int stages = std::min(kMaxStages, ring_bytes / stage_stride(slot_bytes));
    return stages >= 2 ? stages : 0;
}

cudaError_t launch_dispatch(const DispatchArgs& args, const CommContext& comm, cudaStream_t stream) {
    if (const cudaError_t err = clear_profile(comm, prof::kDispatch, stream); err != cudaSuccess) return err;
    const int slot_bytes = dispatch_slot_bytes(args.row_bytes, args.num_scales, args.num_topk);
    const int stages = max_pipeline_stages(slot_bytes);
    if (stages == 0) return cudaErrorInvalidValue;
    const size_t smem = stage_ring_smem_bytes(stages, slot_bytes);
    if (const cudaError_t err = allow_dynamic_shared_memory(dispatch_kernel, smem); err != cudaSuccess) return err;
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
