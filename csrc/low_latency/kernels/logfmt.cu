// LogFMT-10 on its own (launch_logfmt_encode / launch_logfmt_decode): the combine's wire format applied
// to rows in device memory, one warp per row, so that tests compare its bytes with moe_ep/ops/logfmt.py.
#include "low_latency/api.cuh"
#include "low_latency/kernels/logfmt.cuh"

namespace moe_ep::kernels::ll {

namespace {

constexpr int kLogfmtThreads = 256;

__global__ void logfmt_encode_kernel(const int4* rows, uint8_t* wire, int* compact, int* nbytes, int num_rows,
                                     int hidden) {
    const int row = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32), lane = threadIdx.x % 32;
    if (row >= num_rows) return;  // the whole warp
    const int4* src = rows + static_cast<int64_t>(row) * (hidden / 8);
    uint8_t* dst = wire + static_cast<int64_t>(row) * 2 * hidden;
    const int bytes = logfmt_encode_row(src, dst, hidden, lane);
    if (bytes == 0)
        for (int i = lane; i < hidden / 8; i += 32) reinterpret_cast<int4*>(dst)[i] = src[i];
    if (lane == 0) {
        compact[row] = bytes > 0 ? 1 : 0;
        nbytes[row] = bytes > 0 ? bytes : 2 * hidden;
    }
}

__global__ void logfmt_decode_kernel(const uint8_t* wire, const int* compact, int4* rows, int num_rows, int hidden) {
    const int row = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32), lane = threadIdx.x % 32;
    if (row >= num_rows) return;  // the whole warp
    const uint8_t* src = wire + static_cast<int64_t>(row) * 2 * hidden;
    int4* dst = rows + static_cast<int64_t>(row) * (hidden / 8);
    const int vectors = hidden / 8;
    if (compact[row] == 0) {
        for (int i = lane; i < vectors; i += 32) dst[i] = reinterpret_cast<const int4*>(src)[i];
        return;
    }
    const LogfmtBlocks blocks = logfmt_row_layout(src, hidden / kLogfmtBlock, lane);
    for (int base = 0; base < vectors; base += 32) {
        // The 32 vectors of a step cover blocks base / 16 and base / 16 + 1, held in the same slot.
        const int vec = base + lane, block = vec / 16, slot = base / 16 < 32 ? 0 : 1;
        const uint32_t header = __shfl_sync(kFullMask, blocks.header[slot], block % 32);
        const int offset = __shfl_sync(kFullMask, blocks.offset[slot], block % 32);
        if (vec < vectors) dst[vec] = logfmt_load_vector(src, header, offset, vec);
    }
}

}  // namespace

cudaError_t launch_logfmt_encode(const void* rows, void* wire, int* compact, int* nbytes, int num_rows, int hidden,
                                 cudaStream_t stream) {
    const int blocks = (num_rows * 32 + kLogfmtThreads - 1) / kLogfmtThreads;
    if (blocks > 0)
        logfmt_encode_kernel<<<blocks, kLogfmtThreads, 0, stream>>>(static_cast<const int4*>(rows),
                                                                   static_cast<uint8_t*>(wire), compact, nbytes,
                                                                   num_rows, hidden);
    return cudaGetLastError();
}

cudaError_t launch_logfmt_decode(const void* wire, const int* compact, void* rows, int num_rows, int hidden,
                                 cudaStream_t stream) {
    const int blocks = (num_rows * 32 + kLogfmtThreads - 1) / kLogfmtThreads;
    if (blocks > 0)
        logfmt_decode_kernel<<<blocks, kLogfmtThreads, 0, stream>>>(static_cast<const uint8_t*>(wire), compact,
                                                                   static_cast<int4*>(rows), num_rows, hidden);
    return cudaGetLastError();
}

}  // namespace moe_ep::kernels::ll
