// get_dispatch_layout: per-rank and per-expert counts and the token-to-rank mask from top-k ids.
#include "common/common.cuh"
#include "intranode/api.cuh"

namespace moe_ep::kernels {

namespace {

constexpr int kLayoutThreads = 256;
constexpr int kLayoutMaxBlocks = 128;

// Each block counts its tokens (grid-stride) in shared memory and stores its counts in its own row of
// `partial` [blocks][R + E]; the last block to arrive (by a ticket in this rank's control area, which it
// resets for the next call) sums the rows into `counts`. So the outputs need no zeroing pass beforehand
// (one launch less per call) and the counts take no global atomics.
__global__ void __launch_bounds__(kLayoutThreads) dispatch_layout_kernel(const int64_t* topk_idx, int num_tokens,
                                                                         int num_topk, int num_experts, int num_ranks,
                                                                         bool* is_token_in_rank, int* counts,
                                                                         int* partial, int* ticket) {
    extern __shared__ int s_counts[];  // [num_ranks] then [num_experts], the order of `counts`
    __shared__ bool s_last;
    int* s_expert = s_counts + num_ranks;
    const int num_counts = num_ranks + num_experts;
    for (int i = threadIdx.x; i < num_counts; i += blockDim.x) s_counts[i] = 0;
    __syncthreads();

    const int experts_per_rank = num_experts / num_ranks;
    for (int token = blockIdx.x * blockDim.x + threadIdx.x; token < num_tokens; token += gridDim.x * blockDim.x) {
        uint32_t mask = 0;
        const int64_t* row = topk_idx + static_cast<size_t>(token) * num_topk;
        for (int j = 0; j < num_topk; ++j) {
            const int64_t expert = row[j];
            if (expert < 0) continue;
            atomicAdd(s_expert + expert, 1);
            mask |= 1u << (expert / experts_per_rank);
        }
        uint8_t* out = reinterpret_cast<uint8_t*>(is_token_in_rank) + static_cast<size_t>(token) * num_ranks;
        for (int r = 0; r < num_ranks; ++r) {
            const bool hit = (mask >> r) & 1;
            out[r] = hit;
            if (hit) atomicAdd(s_counts + r, 1);
        }
    }
    __syncthreads();
    int* mine = partial + static_cast<size_t>(blockIdx.x) * num_counts;
    for (int i = threadIdx.x; i < num_counts; i += blockDim.x) mine[i] = s_counts[i];
    __threadfence();  // this block's row is visible device-wide before its ticket is
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(ticket, 1) == static_cast<int>(gridDim.x) - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int i = threadIdx.x; i < num_counts; i += blockDim.x) {
        int sum = 0;
        for (int b = 0; b < static_cast<int>(gridDim.x); ++b)
            sum += __ldcg(partial + static_cast<size_t>(b) * num_counts + i);
        counts[i] = sum;
    }
    if (threadIdx.x == 0) *ticket = 0;
}

}  // namespace

int dispatch_layout_blocks(int num_tokens) {
    const int blocks = (num_tokens + kLayoutThreads - 1) / kLayoutThreads;
    return blocks < 1 ? 1 : (blocks > kLayoutMaxBlocks ? kLayoutMaxBlocks : blocks);
}

cudaError_t launch_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                                   int num_ranks, bool* is_token_in_rank, int* counts, int* partial, int* ticket,
                                   cudaStream_t stream) {
    const size_t smem = sizeof(int) * (num_experts + num_ranks);
    dispatch_layout_kernel<<<dispatch_layout_blocks(num_tokens), kLayoutThreads, smem, stream>>>(
        topk_idx, num_tokens, num_topk, num_experts, num_ranks, is_token_in_rank, counts, partial, ticket);
    return cudaGetLastError();
}

bool is_sm90_compiled() {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, dispatch_layout_kernel) != cudaSuccess) return false;
    return attr.binaryVersion >= 90;
}

}  // namespace moe_ep::kernels
