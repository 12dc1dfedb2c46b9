// notify_dispatch: every rank learns what every other rank sends it, before any data moves; and the
// ring reset that cached dispatch and combine run instead.
#include "common/common.cuh"
#include "intranode/api.cuh"

namespace moe_ep::kernels {

namespace {

constexpr int kNotifyThreads = 512;

// The host waits for this value (also after an error, which it then reads from the flags), but only
// when this rank has no num_worst_tokens limit: with one it does not wait, and a count published then
// could be taken by a later, waiting dispatch for its own.
MOE_EP_DEVICE void publish_recv_count(const NotifyArgs& a, const CommContext& comm, int num_recv, bool cancelled) {
    if (threadIdx.x != 0 || a.num_worst_tokens > 0) return;
    volatile HostFlags* flags = comm.flags;
    flags->recv_cancelled = cancelled;
    __threadfence_system();
    flags->recv_count = num_recv;
    __threadfence_system();
}

// The first rank that receives more rows than its num_worst_tokens (the last value of its slot, 0: no
// limit), or rank -1. Every rank reads the same slots, so every rank finds the same one.
template <typename Sent>
MOE_EP_DEVICE WorstTokensOverflow find_overflow(const Sent& sent, int num_ranks, int limit_index) {
    for (int d = 0; d < num_ranks; ++d) {
        int rows = 0;
        for (int s = 0; s < num_ranks; ++s) rows += sent(s, d);
        const int limit = sent(d, limit_index);
        if (limit > 0 && rows > limit) return {0, d, rows, limit};
    }
    return {0, -1, 0, 0};
}

// Only thread 0 of this rank's notify kernels, which run one after another, writes the report.
MOE_EP_DEVICE void report_overflow(HostFlags* flags, const WorstTokensOverflow& found) {
    volatile WorstTokensOverflow* report = &flags->overflow;
    const int seq = report->seq;
    report->seq = seq + 1;
    __threadfence_system();
    report->rank = found.rank;
    report->rows = found.rows;
    report->limit = found.limit;
    __threadfence_system();
    report->seq = seq + 2;
    __threadfence_system();
}

__global__ void __launch_bounds__(kNotifyThreads, 1) notify_dispatch_kernel(NotifyArgs a, CommContext comm) {
    __shared__ int s_prefix[kNumMaxNvlPeers * kNumMaxChannels];  // [dest][channel], counts then inclusive prefix
    __shared__ volatile int s_abort;
    const int R = comm.num_ranks, C = a.num_channels, El = a.num_local_experts, me = comm.rank;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    int* own_ctrl = comm.peers.ctrl[me];
    if (threadIdx.x == 0) {
        s_abort = 0;
        // Until the counts are complete: a data kernel launched after a failed notify finds garbage there.
        own_ctrl[ctrl::kDispatchCancelled] = 1;
    }

    // Tokens this rank sends to each destination from each channel (sender-side channel prefix).
    for (int c = warp; c < C; c += num_warps) {
        int begin, end;
        channel_range(a.num_tokens, C, c, begin, end);
        int counts[kNumMaxNvlPeers] = {};
        for (int t = begin + lane; t < end; t += 32) {
            const uint32_t mask = token_rank_mask(a.is_token_in_rank, t, R);
#pragma unroll
            for (int d = 0; d < kNumMaxNvlPeers; ++d) counts[d] += (mask >> d) & 1;
        }
#pragma unroll
        for (int d = 0; d < kNumMaxNvlPeers; ++d) {
            const int total = warp_sum(counts[d]);
            if (lane == 0 && d < R) s_prefix[d * kNumMaxChannels + c] = total;
        }
    }
    __syncthreads();
    if (threadIdx.x < R) {
        int running = 0;
        for (int c = 0; c < C; ++c) {
            running += s_prefix[threadIdx.x * kNumMaxChannels + c];
            s_prefix[threadIdx.x * kNumMaxChannels + c] = running;
            a.channel_prefix_matrix[threadIdx.x * C + c] = running;
        }
    }

    if (!rank_barrier(comm, &s_abort)) return publish_recv_count(a, comm, 0, true);
    clear_ring_counters(comm);
    // Slot `me` of every destination: [tokens to each rank (R)] [channel prefix for it (C)] [expert counts (El)]
    // [num_worst_tokens].
    const int slot_ints = R + C + El + 1;
    for (int i = threadIdx.x; i < R * slot_ints; i += blockDim.x) {
        const int d = i / slot_ints, k = i % slot_ints;
        int v;
        if (k < R) v = a.num_tokens_per_rank[k];
        else if (k < R + C) v = s_prefix[d * kNumMaxChannels + (k - R)];
        else if (k < R + C + El) v = a.num_tokens_per_expert[d * El + (k - R - C)];
        else v = a.num_worst_tokens;
        comm.peers.ctrl[d][ctrl::kNotify + me * ctrl::kNotifySlot + k] = v;
    }
    if (!rank_barrier(comm, &s_abort)) return publish_recv_count(a, comm, 0, true);

    const int* slots = own_ctrl + ctrl::kNotify;
    auto sent = [&](int src, int k) { return ld_volatile(slots + src * ctrl::kNotifySlot + k); };
    for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
        const int s = i / R, d = i % R;
        int sum = 0;
        for (int q = 0; q <= s; ++q) sum += sent(q, d);
        a.rank_prefix_matrix[i] = sum;
    }
    for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
        const int s = i / C, c = i % C;
        int start = 0;
        for (int q = 0; q < s; ++q) start += sent(q, me);
        a.recv_channel_prefix_matrix[i] = start + (c > 0 ? sent(s, R + c - 1) : 0);
    }
    for (int e = threadIdx.x; a.num_worst_tokens == 0 && e < El; e += blockDim.x) {
        int sum = 0;
        for (int s = 0; s < R; ++s) sum += sent(s, R + C + e);
        const int align = max(a.expert_alignment, 1);
        reinterpret_cast<volatile int*>(comm.flags->expert_counts)[e] = (sum + align - 1) / align * align;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int num_recv = 0;
        for (int s = 0; s < R; ++s) num_recv += sent(s, me);
        const WorstTokensOverflow overflow = find_overflow(sent, R, slot_ints - 1);
        if (overflow.rank >= 0) report_overflow(comm.flags, overflow);
        own_ctrl[ctrl::kDispatchCancelled] = overflow.rank >= 0;
        publish_recv_count(a, comm, num_recv, overflow.rank >= 0);
    }
}

__global__ void __launch_bounds__(128, 1) prepare_rings_kernel(CommContext comm) {
    __shared__ volatile int s_abort;
    if (threadIdx.x == 0) s_abort = 0;
    if (!rank_barrier(comm, &s_abort)) return;
    clear_ring_counters(comm);
    rank_barrier(comm, &s_abort);
}

}  // namespace

cudaError_t launch_notify_dispatch(const NotifyArgs& args, const CommContext& comm, cudaStream_t stream) {
    notify_dispatch_kernel<<<1, kNotifyThreads, 0, stream>>>(args, comm);
    return cudaGetLastError();
}

cudaError_t launch_prepare_rings(const CommContext& comm, cudaStream_t stream) {
    prepare_rings_kernel<<<1, 128, 0, stream>>>(comm);
    return cudaGetLastError();
}

}  // namespace moe_ep::kernels
