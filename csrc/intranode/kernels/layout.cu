// get_dispatch_layout: per-rank and per-expert counts and the token-to-rank mask from top-k ids.
#include "common/common.cuh"
#include "intranode/api.cuh"

namespace moe_ep::kernels {

namespace {

constexpr int kLayoutThreads = 256;

__global__ void __launch_bounds__(kLayoutThreads) dispatch_layout_kernel(const int64_t* topk_idx, int num_tokens,
                                                                         int num_topk, int num_experts, int num_ranks,
                                                                         bool* is_token_in_rank, int* per_rank,
                                                                         int* per_expert) {
    extern __shared__ int s_counts[];  // [num_experts] then [num_ranks]
    int* s_rank = s_counts + num_experts;
    for (int i = threadIdx.x; i < num_experts + num_ranks; i += blockDim.x) s_counts[i] = 0;
    __syncthreads();

    const int experts_per_rank = num_experts / num_ranks;
    const int token = blockIdx.x * blockDim.x + threadIdx.x;
    if (token < num_tokens) {
        uint32_t mask = 0;
        const int64_t* row = topk_idx + static_cast<size_t>(token) * num_topk;
        for (int j = 0; j < num_topk; ++j) {
            const int64_t expert = row[j];
            if (expert < 0) continue;
            atomicAdd(s_counts + expert, 1);
            mask |= 1u << (expert / experts_per_rank);
        }
        uint8_t* out = reinterpret_cast<uint8_t*>(is_token_in_rank) + static_cast<size_t>(token) * num_ranks;
        for (int r = 0; r < num_ranks; ++r) {
            const bool hit = (mask >> r) & 1;
            out[r] = hit;
            if (hit) atomicAdd(s_rank + r, 1);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
        if (s_counts[i]) atomicAdd(per_expert + i, s_counts[i]);
    for (int i = threadIdx.x; i < num_ranks; i += blockDim.x)
        if (s_rank[i]) atomicAdd(per_rank + i, s_rank[i]);
}

}  // namespace

cudaError_t launch_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                                   int num_ranks, bool* is_token_in_rank, int* counts, cudaStream_t stream) {
    const cudaError_t err = cudaMemsetAsync(counts, 0, sizeof(int) * (num_ranks + num_experts), stream);
    if (err != cudaSuccess || num_tokens == 0) return err;
    const size_t smem = sizeof(int) * (num_experts + num_ranks);
    const int blocks = (num_tokens + kLayoutThreads - 1) / kLayoutThreads;
    dispatch_layout_kernel<<<blocks, kLayoutThreads, smem, stream>>>(topk_idx, num_tokens, num_topk, num_experts,
                                                                      num_ranks, is_token_in_rank, counts,
                                                                      counts + num_ranks);
    return cudaGetLastError();
}

bool is_sm90_compiled() {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, dispatch_layout_kernel) != cudaSuccess) return false;
    return attr.binaryVersion >= 90;
}

}  // namespace moe_ep::kernels
