// Host entry points of the FP8 expert kernels (module moe_ep._fp8): the grouped blockwise GEMM
// (kernels/grouped_gemm.cu, sm_90a) and the blockwise weight cast (kernels/weight_cast.cu). Plain C++
// and CUDA runtime types only: binding.cpp includes this header, the kernel files implement it.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace moe_ep::kernels {

// Grouped by rows (the experts' forward and input gradients): out[rows of e] = (a * a_scales) @
// (b[e] * b_scales[e])^T for every expert e owning the rows [ends[e-1], ends[e]) of `a`; rows from
// ends[E-1] on become zeros.
// Grouped by depth (the experts' weight gradients, `group_depth`): out[e] = (a[:, K_e] * a_scales) @
// (b[0][:, K_e] * b_scales[0])^T for every expert e, K_e = [ends[e-1], ends[e]) (multiples of 128) of
// the one `a [num_rows, depth]` and `b [1, n_out, depth]`; `out [E, num_rows, n_out]`, num_rows a
// multiple of 128; an expert without columns gets zeros.
// Strides in elements unless named bytes; K (innermost) contiguous in `a` and `b`, and a, b and their
// byte strides 16-byte aligned.
struct Fp8GroupedGemmArgs {
    const void* a;               // [num_rows, depth] e4m3
    int64_t a_row_stride;        // bytes
    const float* a_scales;       // [num_rows, depth / 128]
    int64_t a_scale_row_stride;
    int64_t a_scale_k_stride;
    const void* b;               // [num_experts, n_out, depth] e4m3
    int64_t b_row_stride;        // bytes
    int64_t b_expert_stride;     // bytes
    const float* b_scales;       // [num_experts, n_out / 128, depth / 128]
    int64_t b_scale_expert_stride;
    int64_t b_scale_row_stride;
    int64_t b_scale_k_stride;
    const int* ends;             // [num_experts] cumulative segment ends
    __nv_bfloat16* out;          // [num_rows, n_out], or [num_experts, num_rows, n_out] grouped by depth
    int64_t out_row_stride;
    int64_t out_expert_stride;   // grouped by depth only
    bool group_depth;
    int num_rows;
    int depth;                   // K, a multiple of the tile
    int n_out;                   // a multiple of the tile
    int num_experts;
};

// Rows, columns and K depth of the GEMM's tiles: depth and n_out must be multiples of it.
int fp8_grouped_gemm_tile();
// Whether this binary holds the GEMM for sm_90a and the driver can encode TMA maps (queried once).
bool fp8_grouped_gemm_supported();
cudaError_t launch_fp8_grouped_gemm(const Fp8GroupedGemmArgs& args, cudaStream_t stream);

// 128x128 blockwise e4m3 cast of BF16 weights `w [num_matrices, rows, cols]` (cols contiguous), with
// the transposed copy the input-gradient GEMM reads: q [m, rows, cols], q_t [m, cols, rows] (both
// contiguous), scales [m, rows / 128, cols / 128] = max(amax, amax_floor) / 448 per block. Rows and
// cols multiples of 128; the arithmetic is that of moe_ep.ops.fp8.per_block_cast_to_fp8, bit for bit.
struct Fp8WeightCastArgs {
    const __nv_bfloat16* w;
    int64_t w_matrix_stride;  // elements
    int64_t w_row_stride;     // elements
    uint8_t* q;
    uint8_t* q_t;
    float* scales;
    int num_matrices;
    int rows;
    int cols;
    float amax_floor;
};
cudaError_t launch_fp8_weight_cast(const Fp8WeightCastArgs& args, cudaStream_t stream);

}  // namespace moe_ep::kernels
