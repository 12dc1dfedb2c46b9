// Sizes of the low-latency mode: the symmetric buffer's layout and the grid of every launch.
#include "low_latency/api.cuh"

namespace moe_ep::kernels::ll {

Layout make_layout(int64_t max_tokens, int64_t hidden, int64_t num_ranks, int64_t num_experts) {
    Layout layout{};
    layout.row_bytes = hidden * 2;
    const int64_t rows = num_experts * max_tokens;  // the local experts of all ranks are the global experts
    const int64_t tokens = num_ranks * max_tokens;  // (source rank, token) pairs
    layout.acks = 0;
    int64_t offset = persistent_bytes(num_ranks);
    for (int half = 0; half < 2; ++half) {
        layout.counts[half] = offset;
        offset += align_buffer_bytes(num_experts * 8);
        layout.flags[half] = offset;
        offset += align_buffer_bytes(rows * 8);
        layout.data[half] = offset;
        offset += align_buffer_bytes(rows * layout.row_bytes);
        layout.meta_flags[half] = offset;
        offset += align_buffer_bytes(tokens * 8);
        layout.meta[half] = offset;
        offset += align_buffer_bytes(tokens * kMetaBytes);
    }
    layout.send = offset;
    offset += align_buffer_bytes(rows * layout.row_bytes);
    layout.rowmap = offset;
    offset += align_buffer_bytes(rows * 8);
    layout.stage = offset;
    offset += align_buffer_bytes(tokens * layout.row_bytes);
    layout.stage_meta = offset;
    offset += align_buffer_bytes(max_tokens * kMetaBytes);
    layout.total = offset;
    return layout;
}

int grid_blocks(int device) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
    return sms;
}

}  // namespace moe_ep::kernels::ll
