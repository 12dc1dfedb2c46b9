// 128x128 blockwise e4m3 cast of BF16 weights with the transposed copy, in one pass at HBM speed.
//
// One block of 256 threads casts one 128x128 block. Thread t owns an 8x8 piece of it: rows
// 8 * (t / 16) .. +7, columns 8 * (t % 16) .. +7. Its 16-byte loads and 8-byte row stores are coalesced
// across the 16 threads of a row; the piece is transposed in registers, so the transposed copy is
// written as 8-byte column pieces without a trip through shared memory.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "fp8/api.cuh"
#include "common/common.cuh"

namespace moe_ep::kernels {

namespace {

constexpr int kPiece = 8;
constexpr int kCastThreads = (kFp8Block / kPiece) * (kFp8Block / kPiece);

// Byte k of row i of an 8x8 byte matrix, transposed: out[k] byte i = in[i] byte k.
MOE_EP_DEVICE void transpose_8x8(const uint64_t (&in)[kPiece], uint64_t (&out)[kPiece]) {
#pragma unroll
    for (int k = 0; k < kPiece; ++k) {
        uint64_t column = 0;
#pragma unroll
        for (int i = 0; i < kPiece; ++i) column |= ((in[i] >> (8 * k)) & 0xFF) << (8 * i);
        out[k] = column;
    }
}

// Four blocks per SM (at most 64 registers): the rows stay packed BF16 until they are cast, so that
// enough loads are in flight to keep HBM busy.
__global__ void __launch_bounds__(kCastThreads, 4) fp8_weight_cast_kernel(const Fp8WeightCastArgs args) {
    const int blocks_k = args.cols / kFp8Block, blocks_n = args.rows / kFp8Block;
    const int block_k = blockIdx.x % blocks_k;
    const int block_n = (blockIdx.x / blocks_k) % blocks_n;
    const int64_t matrix = blockIdx.x / (blocks_k * blocks_n);
    const int row = block_n * kFp8Block + kPiece * (threadIdx.x / 16);
    const int col = block_k * kFp8Block + kPiece * (threadIdx.x % 16);

    int4 packed[kPiece];
    const __nv_bfloat16* w = args.w + matrix * args.w_matrix_stride + col;
#pragma unroll
    for (int i = 0; i < kPiece; ++i) packed[i] = *reinterpret_cast<const int4*>(w + (row + i) * args.w_row_stride);
    // |x| and max are exact in BF16.
    __nv_bfloat162 amax2 = __float2bfloat162_rn(0.0f);
#pragma unroll
    for (int i = 0; i < kPiece; ++i) {
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed[i]);
#pragma unroll
        for (int j = 0; j < kPiece / 2; ++j) amax2 = __hmax2(amax2, __habs2(pairs[j]));
    }
    float amax = fmaxf(__low2float(amax2), __high2float(amax2));
    __shared__ float warp_amax[kCastThreads / 32];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kCastThreads / 32; ++i) amax = fmaxf(amax, warp_amax[i]);

    // The reference's arithmetic: correctly rounded divisions, a product, a clamp, round to nearest even.
    const float scale = __fdiv_rn(fmaxf(amax, args.amax_floor), kFp8MaxFloat);
    const float inverse = __fdiv_rn(1.0f, scale);
    uint64_t piece[kPiece];
#pragma unroll
    for (int i = 0; i < kPiece; ++i) {
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed[i]);
        piece[i] = 0;
#pragma unroll
        for (int j = 0; j < kPiece / 2; ++j) {
            const float2 x = __bfloat1622float2(pairs[j]);
            const float2 v = make_float2(fminf(fmaxf(x.x * inverse, -kFp8MaxFloat), kFp8MaxFloat),
                                         fminf(fmaxf(x.y * inverse, -kFp8MaxFloat), kFp8MaxFloat));
            const uint64_t pair = __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3);
            piece[i] |= pair << (16 * j);
        }
    }
    const int64_t matrix_offset = matrix * args.rows * args.cols;
#pragma unroll
    for (int i = 0; i < kPiece; ++i) {
        *reinterpret_cast<uint64_t*>(args.q + matrix_offset + int64_t(row + i) * args.cols + col) = piece[i];
    }
    uint64_t column[kPiece];
    transpose_8x8(piece, column);
#pragma unroll
    for (int k = 0; k < kPiece; ++k) {
        *reinterpret_cast<uint64_t*>(args.q_t + matrix_offset + int64_t(col + k) * args.rows + row) = column[k];
    }
    if (threadIdx.x == 0) args.scales[blockIdx.x] = scale;
}

}  // namespace

cudaError_t launch_fp8_weight_cast(const Fp8WeightCastArgs& args, cudaStream_t stream) {
    const int64_t blocks = int64_t(args.num_matrices) * (args.rows / kFp8Block) * (args.cols / kFp8Block);
    if (blocks == 0) return cudaSuccess;
    fp8_weight_cast_kernel<<<static_cast<unsigned>(blocks), kCastThreads, 0, stream>>>(args);
    return cudaGetLastError();
}

}  // namespace moe_ep::kernels
