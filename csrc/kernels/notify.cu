// notify_dispatch: every rank learns what every other rank sends it, before any data moves; and the
// ring reset that cached dispatch and combine run instead.
#include "common.cuh"

namespace moe_ep::kernels {

namespace {

constexpr int kNotifyThreads = 512;

// The host waits for this value (also after an error, which it then reads from the flags).
MOE_EP_DEVICE void publish_recv_count(const CommContext& comm, int num_recv) {
    if (threadIdx.x != 0) return;
    __threadfence_system();
    reinterpret_cast<volatile HostFlags*>(comm.flags)->recv_count = num_recv;
    __threadfence_system();
}

__global__ void __launch_bounds__(kNotifyThreads, 1) notify_dispatch_kernel(NotifyArgs a, CommContext comm) {
    __shared__ int s_prefix[kMaxRanks * kMaxChannels];  // [dest][channel], counts then inclusive prefix
    __shared__ volatile int s_abort;
    const int R = comm.num_ranks, C = a.num_channels, El = a.num_local_experts, me = comm.rank;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    if (threadIdx.x == 0) s_abort = 0;

    // Tokens this rank sends to each destination from each channel (sender-side channel prefix).
    for (int c = warp; c < C; c += num_warps) {
        int begin, end;
        channel_range(a.num_tokens, C, c, begin, end);
        int counts[kMaxRanks] = {};
        for (int t = begin + lane; t < end; t += 32) {
            const uint32_t mask = token_rank_mask(a.is_token_in_rank, t, R);
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d) counts[d] += (mask >> d) & 1;
        }
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            const int total = warp_sum(counts[d]);
            if (lane == 0 && d < R) s_prefix[d * kMaxChannels + c] = total;
        }
    }
    __syncthreads();
    if (threadIdx.x < R) {
        int running = 0;
        for (int c = 0; c < C; ++c) {
            running += s_prefix[threadIdx.x * kMaxChannels + c];
            s_prefix[threadIdx.x * kMaxChannels + c] = running;
            a.channel_prefix_matrix[threadIdx.x * C + c] = running;
        }
    }

    if (!rank_barrier(comm, &s_abort)) return publish_recv_count(comm, 0);
    clear_ring_counters(comm);
    // Slot `me` of every destination: [tokens to each rank (R)] [channel prefix for it (C)] [expert counts (El)].
    const int slot_ints = R + C + El;
    for (int i = threadIdx.x; i < R * slot_ints; i += blockDim.x) {
        const int d = i / slot_ints, k = i % slot_ints;
        int v;
        if (k < R) v = a.num_tokens_per_rank[k];
        else if (k < R + C) v = s_prefix[d * kMaxChannels + (k - R)];
        else v = a.num_tokens_per_expert[d * El + (k - R - C)];
        comm.peers.ctrl[d][ctrl::kNotify + me * ctrl::kNotifySlot + k] = v;
    }
    if (!rank_barrier(comm, &s_abort)) return publish_recv_count(comm, 0);

    const int* slots = comm.peers.ctrl[me] + ctrl::kNotify;
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
    for (int e = threadIdx.x; e < El; e += blockDim.x) {
        int sum = 0;
        for (int s = 0; s < R; ++s) sum += sent(s, R + C + e);
        const int align = max(a.expert_alignment, 1);
        reinterpret_cast<volatile int*>(comm.flags->expert_counts)[e] = (sum + align - 1) / align * align;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int num_recv = 0;
        for (int s = 0; s < R; ++s) num_recv += sent(s, me);
        if (a.num_worst_tokens > 0) {
            // Every rank sees the same matrix, so every rank reports the same overflow.
            for (int d = 0; d < R; ++d) {
                int total = 0;
                for (int s = 0; s < R; ++s) total += sent(s, d);
                if (total > a.num_worst_tokens) {
                    report_error(comm.flags, kErrWorstTokens, d);
                    break;
                }
            }
        }
        publish_recv_count(comm, num_recv);
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
