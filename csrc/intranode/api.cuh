// Host entry points of the normal-mode (intranode NVLink) kernels, module moe_ep._C. Plain C++ and
// CUDA runtime types only: the runtime and binding.cpp include this header, kernels/*.cu implement it.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "common/comm.cuh"

namespace moe_ep::kernels {

// is_token_in_rank [T, R] and counts [R + E] (num_tokens_per_rank, then num_tokens_per_expert: one
// zeroing) from topk_idx [T, k].
cudaError_t launch_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                                   int num_ranks, bool* is_token_in_rank, int* counts, cudaStream_t stream);

struct NotifyArgs {
    const bool* is_token_in_rank;       // [T, R]
    const int* num_tokens_per_rank;     // [R]
    const int* num_tokens_per_expert;   // [E]
    int num_tokens;
    int num_channels;
    int num_local_experts;
    int expert_alignment;
    int num_worst_tokens;  // this rank's limit, 0 = none (then the host waits for the counts)
    int* channel_prefix_matrix;       // out [R, C]
    int* rank_prefix_matrix;          // out [R, R]
    int* recv_channel_prefix_matrix;  // out [R, C]
};

// Exchanges counts and num_worst_tokens limits with every peer; writes the three prefix matrices and,
// when the host waits (num_worst_tokens == 0), the received row count and per-expert counts into the
// host flags. When some rank would receive more rows than its limit, it cancels the data kernels up to
// the next notify (ctrl::kDispatchCancelled) and reports the overflow (HostFlags::overflow). Also
// resets the ring counters for the next data kernel.
cudaError_t launch_notify_dispatch(const NotifyArgs& args, const CommContext& comm, cudaStream_t stream);

// Barrier, reset of this rank's ring counters, barrier: what a data kernel needs when no notify runs.
cudaError_t launch_prepare_rings(const CommContext& comm, cudaStream_t stream);

struct DispatchArgs {
    const void* x;                  // [T, row_bytes]
    const uint32_t* x_scales;       // [T, G] 4-byte scales with row stride scale_stride, or null
    int64_t scale_stride;
    const int64_t* topk_idx;        // [T, k] or null
    const float* topk_weights;      // [T, k] or null
    const bool* is_token_in_rank;   // [T, R]
    const int* channel_prefix_matrix;       // [R, C] sender side
    const int* recv_channel_prefix_matrix;  // [R, C] receiver side
    const int* rank_prefix_matrix;          // [R, R]
    void* recv_x;                   // [N, row_bytes]
    int num_recv_rows;              // N: rows of every recv_* output
    uint32_t* recv_x_scales;        // [N, G] or null
    int64_t* recv_topk_idx;         // [N, k] or null
    float* recv_topk_weights;       // [N, k] or null
    int* recv_src_idx;              // [N] or null (cached dispatch keeps the handle's)
    int* send_head;                 // [T, R] or null (cached dispatch keeps the handle's)
    int num_tokens;
    int row_bytes;
    int num_scales;
    int num_topk;
    int num_local_experts;
    int num_channels;
    int ring_slots;       // Q: slots of each (channel, source) ring
    int publish_every;    // ring counters are published at least every this many tokens
};

// Ring slot size in bytes for one dispatched token.
int dispatch_slot_bytes(int row_bytes, int num_scales, int num_topk);
int combine_slot_bytes(int row_bytes, int num_topk);
// Stages of a block's stage ring that fit into its shared memory for a slot size (0 if not even two fit).
int max_pipeline_stages(int slot_bytes);

// Moves nothing (it still writes send_head) when the dispatch is cancelled (ctrl::kDispatchCancelled)
// or this rank's rows (from rank_prefix_matrix) exceed num_recv_rows.
cudaError_t launch_dispatch(const DispatchArgs& args, const CommContext& comm, cudaStream_t stream);

// Rows [*num_recv, num_rows) of the dispatch outputs become padding (0 / -1); every row when the
// dispatch was cancelled (as launch_dispatch decides it).
cudaError_t launch_fill_padding(const int* num_recv, int num_rows, int row_bytes, void* recv_x, int num_scales,
                                uint32_t* recv_x_scales, int num_topk, int64_t* recv_topk_idx,
                                float* recv_topk_weights, int* recv_src_idx, const CommContext& comm,
                                cudaStream_t stream);

enum class DType : int { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2, kFloat64 = 3 };

struct CombineArgs {
    const void* x;                  // [N, H] rows in this rank's dispatch receive layout
    const float* topk_weights;      // [N, k] or null
    const void* bias_0;             // [T, H] or null
    const void* bias_1;             // [T, H] or null
    const int* rank_prefix_matrix;          // [R, R]
    const int* channel_prefix_matrix;       // [R, C] (this rank as dispatch sender)
    const int* recv_channel_prefix_matrix;  // [R, C] (this rank as dispatch receiver)
    const bool* is_token_in_rank;   // [T, R]
    const int* send_head;           // [T, R]
    void* combined_x;               // [T, H]
    float* combined_topk_weights;   // [T, k] or null
    DType dtype;
    int num_tokens;
    int row_bytes;
    int num_topk;
    int num_channels;
    int ring_slots;
    int publish_every;  // rings: tails published at least every this many rows; staged: rows per chunk
    // Staged path when every rank's staging area fits into this many bytes (its NVLink buffer's data
    // region); 0: always the rings. The kernel decides from rank_prefix_matrix, the same way on every rank.
    int64_t staging_bytes;
};

enum CombinePath : int { kCombineNone = 0, kCombineStaged = 1, kCombineRings = 2 };

// Two ways to return the rows, chosen inside the kernel and reported in HostFlags::combine_path:
// - staged (combine_staged.cuh), when every owner's staging area fits: each rank bulk-copies the rows
//   it received from owner d into d's staging area (slot = row + k weights), with no flow control;
//   senders claim chunks of rows and reducers claim tokens from per-rank counters;
// - rings, otherwise: per (channel, rank pair) rings with head/tail flow control, one block per channel.
// Both reduce in the torch backend's order (bias, then ranks 0..R-1 in float32), reading this rank's
// own contribution in place.
cudaError_t launch_combine(const CombineArgs& args, const CommContext& comm, cudaStream_t stream);

// Whether the kernels in this binary were compiled for sm_90.
bool is_sm90_compiled();

}  // namespace moe_ep::kernels
