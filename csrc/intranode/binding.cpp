// The `moe_ep._C` extension module: torch binding of the normal-mode (intranode NVLink) operations,
// with their argument checks, output allocation on the current stream, kernel launches and, without
// num_worst_tokens, the host wait for receive counts.
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <limits>
#include <optional>
#ifdef MOE_EP_PROFILE
#include <chrono>
#include <cstring>
#endif

#include "common/binding_outputs.hpp"
#include "intranode/runtime.hpp"

namespace moe_ep {

namespace {

using at::Tensor;
using std::optional;

void launch_check(cudaError_t err, const char* what) {
    TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

// Channels of a launch on `num_sms` SMs (kChannelsPerSmPair per SM pair, a block each); every block of
// the grid must be resident at once.
int channels_for(const NvlRuntime& rt, int64_t num_sms) {
    constexpr int max_sms = 2 * kNumMaxChannels / kChannelsPerSmPair;
    TORCH_CHECK_VALUE(num_sms >= 2 && num_sms <= max_sms && num_sms % 2 == 0,
                      "config.num_sms: expected an even number from 2 to ", max_sms, ", got ", num_sms);
    TORCH_CHECK_VALUE(num_sms <= rt.device_sms(), "config.num_sms: ", num_sms, " exceeds the ", rt.device_sms(),
                      " SMs of the device");
    return static_cast<int>(num_sms / 2 * kChannelsPerSmPair);
}

// The channel count of a handle's prefix matrices must be one that `channels_for` gives.
void check_channels(const NvlRuntime& rt, int num_channels) {
    TORCH_CHECK_VALUE(num_channels % kChannelsPerSmPair == 0, "handle: the prefix matrices have ",
                      num_channels, " channels, expected a multiple of ", kChannelsPerSmPair,
                      " (use the handle of a dispatch with the same Config)");
    channels_for(rt, 2 * num_channels / kChannelsPerSmPair);
}

// The rings of one kernel must fit into the NVLink buffer.
void check_ring_space(const NvlRuntime& rt, int num_channels, int ring_slots, int slot_bytes) {
    const int64_t needed = static_cast<int64_t>(num_channels) * rt.num_ranks() * ring_slots * slot_bytes;
    TORCH_CHECK_VALUE(needed <= rt.data_bytes(), "num_nvl_bytes: the CUDA backend needs ", needed,
                      " bytes of NVLink buffer for ", num_channels, " channels x ", rt.num_ranks(), " ranks x ",
                      ring_slots, " slots x ", slot_bytes, " bytes, the Buffer has ", rt.data_bytes(),
                      " (size it with Config.get_nvl_buffer_size_hint)");
    TORCH_CHECK_VALUE(kernels::max_pipeline_stages(slot_bytes) > 0, "x: a row of ", slot_bytes,
                      " bytes (with metadata) is too large for the CUDA backend's shared-memory stages");
}

const int* int_ptr(const Tensor& t) { return t.data_ptr<int>(); }

// Config.pipeline_lag, checked: bulk stores left in flight per storer thread, 0 for the default.
int checked_pipeline_lag(int64_t pipeline_lag) {
    TORCH_CHECK_VALUE(pipeline_lag >= 0 && pipeline_lag <= std::numeric_limits<int>::max(),
                      "config.pipeline_lag: expected 0 (half the stages) or a positive count, got ", pipeline_lag);
    return static_cast<int>(pipeline_lag);
}

#ifdef MOE_EP_PROFILE
// Host side of the profile: channels of the last launch of each kernel, and how long the last
// dispatch spent from the notify launch to the host knowing the output size (with num_worst_tokens
// the host does not wait: the launch alone).
struct HostProfile {
    int channels[kernels::prof::kNumKernels] = {};
    double notify_wait_us = 0;
};
HostProfile g_host_profile;

py::dict last_profile(const NvlRuntime& rt) {
    namespace prof = kernels::prof;
    const std::vector<int64_t> values = rt.read_profile();
    py::list fields;
    for (const char* name : {"start", "first", "end", "wait_stage", "wait_remote", "copy", "copy_wait", "publish",
                             "items", "wait_events", "writers", "meta", "sm"})
        fields.append(name);
    py::list dispatch_roles, combine_roles;
    for (int w = 0; w < prof::kDispatchLoaders; ++w) dispatch_roles.append("send_loader" + std::to_string(w));
    for (const char* name : {"send_storer", "send_head", "recv_copy"}) dispatch_roles.append(name);
    for (int d = 0; d < kNumMaxNvlPeers; ++d) combine_roles.append("sender" + std::to_string(d));
    combine_roles.append("reducer");
    py::dict out;
    out["fields"] = fields;
    out["host_notify_wait_us"] = g_host_profile.notify_wait_us;
    out["rank"] = rt.rank();
    const char* names[] = {"dispatch", "combine"};
    for (int k = 0; k < prof::kNumKernels; ++k) {
        const int C = g_host_profile.channels[k];
        py::dict kernel;
        kernel["num_channels"] = C;
        kernel["roles"] = k == prof::kDispatch ? dispatch_roles : combine_roles;
        Tensor records = at::empty({C, prof::kRoles, prof::kFields}, at::TensorOptions().dtype(at::kLong));
        if (C > 0)
            std::memcpy(records.data_ptr<int64_t>(), values.data() + prof::record(k, 0, 0),
                        sizeof(int64_t) * C * prof::kRecordInt64s);
        kernel["records"] = records;
        out[names[k]] = kernel;
    }
    return out;
}
#endif

template <typename T>
T* opt_ptr(const optional<Tensor>& t) {
    return t.has_value() ? static_cast<T*>(t->data_ptr()) : nullptr;
}

kernels::DType combine_dtype(const Tensor& x) {
    switch (x.scalar_type()) {
        case at::kBFloat16: return kernels::DType::kBFloat16;
        case at::kHalf: return kernels::DType::kFloat16;
        case at::kFloat: return kernels::DType::kFloat32;
        case at::kDouble: return kernels::DType::kFloat64;
        default: TORCH_CHECK_TYPE(false, "x: the CUDA backend combines bfloat16, float16, float32 or float64, got ",
                                  x.scalar_type());
    }
}

int row_bytes_of(const Tensor& x) {
    const int64_t bytes = x.size(1) * x.element_size();
    TORCH_CHECK_VALUE(bytes % 16 == 0, "x: rows must be a multiple of 16 bytes, got ", bytes);
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "x: data must be 16-byte aligned");
    return static_cast<int>(bytes);
}

std::tuple<Tensor, Tensor, Tensor> get_dispatch_layout(const Tensor& topk_idx, int64_t num_experts,
                                                       int64_t num_ranks) {
    TORCH_CHECK(topk_idx.is_cuda() && topk_idx.scalar_type() == at::kLong && topk_idx.is_contiguous());
    const int64_t num_tokens = topk_idx.size(0);
    // One allocation for all three outputs: the counts per rank, then per expert (zeroed at once), then
    // the token-to-rank mask.
    const std::vector<Tensor> parts =
        carve(topk_idx.options(), {{{num_ranks + num_experts}, at::kInt}, {{num_tokens, num_ranks}, at::kBool}});
    const Tensor &counts = parts[0], &in_rank = parts[1];
    launch_check(kernels::launch_dispatch_layout(topk_idx.data_ptr<int64_t>(), num_tokens, topk_idx.size(1),
                                                 num_experts, num_ranks, in_rank.data_ptr<bool>(),
                                                 counts.data_ptr<int>(), c10::cuda::getCurrentCUDAStream()),
                 "get_dispatch_layout");
    return {counts.narrow(0, 0, num_ranks), counts.narrow(0, num_ranks, num_experts), in_rank};
}

// Outputs of one dispatch: [W, ...] rows, padding filled on the device from the handle's counts. Two
// allocations: the tokens with their FP8 scales (used and freed together), and the per-row metadata
// (top-k ids and weights, source index: small, and the source index lives on in the handle).
struct RecvOutputs {
    Tensor x;
    optional<Tensor> scales, topk_idx, topk_weights, src_idx;
};

RecvOutputs alloc_recv(const Tensor& x, const optional<Tensor>& scales, int64_t num_rows, int64_t num_topk,
                       bool with_topk, bool with_weights, bool with_src) {
    RecvOutputs out;
    std::vector<Part> tokens{{{num_rows, x.size(1)}, x.scalar_type()}};
    if (scales.has_value()) tokens.push_back({{num_rows, scales->size(1)}, scales->scalar_type()});
    std::vector<Tensor> carved = carve(x.options(), tokens);
    out.x = carved[0];
    if (scales.has_value()) out.scales = carved[1];
    std::vector<Part> meta;
    if (with_topk) meta.push_back({{num_rows, num_topk}, at::kLong});
    if (with_weights) meta.push_back({{num_rows, num_topk}, at::kFloat});
    if (with_src) meta.push_back({{num_rows}, at::kInt});
    if (meta.empty()) return out;
    carved = carve(x.options(), meta);
    size_t next = 0;
    if (with_topk) out.topk_idx = carved[next++];
    if (with_weights) out.topk_weights = carved[next++];
    if (with_src) out.src_idx = carved[next++];
    return out;
}

kernels::DispatchArgs dispatch_args(const Tensor& x, const optional<Tensor>& scales, const Tensor& in_rank,
                                    const Tensor& channel_prefix, const Tensor& recv_channel_prefix,
                                    const Tensor& rank_prefix, const RecvOutputs& out, int ring_slots,
                                    int publish_every) {
    kernels::DispatchArgs a{};
    a.x = x.data_ptr();
    if (scales.has_value()) {
        TORCH_CHECK_VALUE(scales->element_size() == 4 && (scales->size(1) <= 1 || scales->stride(1) == 1),
                          "x[1]: scales must be 4-byte values with contiguous rows");
        a.x_scales = static_cast<const uint32_t*>(scales->data_ptr());
        a.scale_stride = scales->stride(0);
        a.num_scales = static_cast<int>(scales->size(1));
    }
    a.is_token_in_rank = in_rank.data_ptr<bool>();
    a.channel_prefix_matrix = int_ptr(channel_prefix);
    a.recv_channel_prefix_matrix = int_ptr(recv_channel_prefix);
    a.rank_prefix_matrix = int_ptr(rank_prefix);
    a.recv_x = out.x.data_ptr();
    a.num_recv_rows = static_cast<int>(out.x.size(0));
    a.recv_x_scales = opt_ptr<uint32_t>(out.scales);
    a.recv_topk_idx = opt_ptr<int64_t>(out.topk_idx);
    a.recv_topk_weights = opt_ptr<float>(out.topk_weights);
    a.recv_src_idx = opt_ptr<int>(out.src_idx);
    a.num_tokens = static_cast<int>(x.size(0));
    a.row_bytes = row_bytes_of(x);
    a.num_channels = static_cast<int>(channel_prefix.size(1));
    a.ring_slots = ring_slots;
    a.publish_every = publish_every;
    return a;
}

// Padding rows past those received (all rows when the dispatch was cancelled).
void fill_padding(const NvlRuntime& rt, const Tensor& rank_prefix, const RecvOutputs& out, int row_bytes,
                  cudaStream_t stream) {
    const int* num_recv = int_ptr(rank_prefix) + (rt.num_ranks() - 1) * rt.num_ranks() + rt.rank();
    const int num_scales = out.scales.has_value() ? static_cast<int>(out.scales->size(1)) : 0;
    const int num_topk = out.topk_idx.has_value() ? static_cast<int>(out.topk_idx->size(1)) : 0;
    launch_check(kernels::launch_fill_padding(num_recv, static_cast<int>(out.x.size(0)), row_bytes, out.x.data_ptr(),
                                              num_scales, opt_ptr<uint32_t>(out.scales), num_topk,
                                              opt_ptr<int64_t>(out.topk_idx), opt_ptr<float>(out.topk_weights),
                                              opt_ptr<int>(out.src_idx), rt.comm(), stream),
                 "fill_padding");
}

// Rows of the outputs and the per-expert list of a dispatch whose notify kernel was just launched.
struct RecvSizes {
    int64_t num_rows;
    std::vector<int> per_expert;
};

// With num_worst_tokens the sizes are fixed and the host goes on at once; an overflow cancels the
// kernels on the device and is raised by a later call (NvlRuntime::check_usable). Without, the host
// waits for the counts.
RecvSizes recv_sizes(NvlRuntime& rt, int64_t num_worst_tokens, int num_local_experts) {
    if (num_worst_tokens > 0) return {num_worst_tokens, {}};
    const int num_recv = rt.wait_recv_count();
    return {num_recv, rt.expert_counts(num_local_experts)};
}

py::tuple dispatch(NvlRuntime& rt, const Tensor& x, const optional<Tensor>& x_scales,
                   const optional<Tensor>& topk_idx, const optional<Tensor>& topk_weights,
                   const Tensor& num_tokens_per_rank, const Tensor& is_token_in_rank,
                   const Tensor& num_tokens_per_expert, int64_t expert_alignment, int64_t num_worst_tokens,
                   int64_t num_sms, int64_t send_chunk, int64_t ring_slots, int64_t pipeline_lag) {
    rt.check_usable();
    const int lag = checked_pipeline_lag(pipeline_lag);
    const int R = rt.num_ranks(), C = channels_for(rt, num_sms);
    const int E = static_cast<int>(num_tokens_per_expert.numel());
    const int El = E / R;
    TORCH_CHECK_VALUE(El <= kNumMaxLocalExperts, "num_experts: at most ", kNumMaxLocalExperts,
                      " experts per rank, got ", El);
    const int num_topk = topk_idx.has_value() ? static_cast<int>(topk_idx->size(1)) : 0;
    const int num_scales = x_scales.has_value() ? static_cast<int>(x_scales->size(1)) : 0;
    const int row_bytes = row_bytes_of(x);
    const int slot_bytes = kernels::dispatch_slot_bytes(row_bytes, num_scales, num_topk);
    check_ring_space(rt, C, static_cast<int>(ring_slots), slot_bytes);

    const auto stream = c10::cuda::getCurrentCUDAStream();
    // The handle's prefix matrices and send_head in one allocation, made before the host waits for the
    // counts (what is allocated after the wait delays the dispatch kernel's launch).
    const std::vector<Tensor> handle_parts = carve(
        x.options(), {{{R, C}, at::kInt}, {{R, R}, at::kInt}, {{R, C}, at::kInt}, {{x.size(0), R}, at::kInt}});
    const Tensor &channel_prefix = handle_parts[0], &rank_prefix = handle_parts[1];
    const Tensor &recv_channel_prefix = handle_parts[2], &send_head = handle_parts[3];
    kernels::NotifyArgs n{};
    n.is_token_in_rank = is_token_in_rank.data_ptr<bool>();
    n.num_tokens_per_rank = int_ptr(num_tokens_per_rank);
    n.num_tokens_per_expert = int_ptr(num_tokens_per_expert);
    n.num_tokens = static_cast<int>(x.size(0));
    n.num_channels = C;
    n.num_local_experts = El;
    n.expert_alignment = static_cast<int>(expert_alignment);
    n.num_worst_tokens = static_cast<int>(num_worst_tokens);
    n.channel_prefix_matrix = channel_prefix.data_ptr<int>();
    n.rank_prefix_matrix = rank_prefix.data_ptr<int>();
    n.recv_channel_prefix_matrix = recv_channel_prefix.data_ptr<int>();
    rt.arm_recv_count(num_worst_tokens > 0);
#ifdef MOE_EP_PROFILE
    const auto notify_started = std::chrono::steady_clock::now();
#endif
    launch_check(kernels::launch_notify_dispatch(n, rt.comm(), stream), "notify_dispatch");
    const RecvSizes sizes = recv_sizes(rt, num_worst_tokens, El);
#ifdef MOE_EP_PROFILE
    g_host_profile.notify_wait_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - notify_started).count();
    g_host_profile.channels[kernels::prof::kDispatch] = C;
#endif

    RecvOutputs out = alloc_recv(x, x_scales, sizes.num_rows, num_topk, topk_idx.has_value(), topk_weights.has_value(),
                                 true);
    kernels::DispatchArgs a = dispatch_args(x, x_scales, is_token_in_rank, channel_prefix, recv_channel_prefix,
                                            rank_prefix, out, static_cast<int>(ring_slots),
                                            static_cast<int>(send_chunk));
    a.topk_idx = topk_idx.has_value() ? topk_idx->data_ptr<int64_t>() : nullptr;
    a.topk_weights = topk_weights.has_value() ? topk_weights->data_ptr<float>() : nullptr;
    a.num_topk = num_topk;
    a.num_local_experts = El;
    a.send_head = send_head.data_ptr<int>();
    launch_check(kernels::launch_dispatch(a, rt.comm(lag), stream), "dispatch");
    if (num_worst_tokens > 0) fill_padding(rt, rank_prefix, out, row_bytes, stream);
    return py::make_tuple(out.x, out.scales, out.topk_idx, out.topk_weights, sizes.per_expert, rank_prefix,
                          channel_prefix, recv_channel_prefix, *out.src_idx, send_head);
}

py::tuple cached_dispatch(NvlRuntime& rt, const Tensor& x, const optional<Tensor>& x_scales,
                          const Tensor& rank_prefix, const Tensor& channel_prefix, const Tensor& recv_channel_prefix,
                          const Tensor& is_token_in_rank, int64_t num_rows, bool exact_rows, int64_t send_chunk,
                          int64_t ring_slots, int64_t pipeline_lag) {
    rt.check_usable();
    const int lag = checked_pipeline_lag(pipeline_lag);
    const int C = static_cast<int>(channel_prefix.size(1));
    check_channels(rt, C);
    const int num_scales = x_scales.has_value() ? static_cast<int>(x_scales->size(1)) : 0;
    const int row_bytes = row_bytes_of(x);
    check_ring_space(rt, C, static_cast<int>(ring_slots), kernels::dispatch_slot_bytes(row_bytes, num_scales, 0));
    const auto stream = c10::cuda::getCurrentCUDAStream();
    RecvOutputs out = alloc_recv(x, x_scales, num_rows, 0, false, false, false);
    const kernels::DispatchArgs a = dispatch_args(x, x_scales, is_token_in_rank, channel_prefix, recv_channel_prefix,
                                                  rank_prefix, out, static_cast<int>(ring_slots),
                                                  static_cast<int>(send_chunk));
    launch_check(kernels::launch_prepare_rings(rt.comm(), stream), "prepare_rings");
    launch_check(kernels::launch_dispatch(a, rt.comm(lag), stream), "cached_dispatch");
#ifdef MOE_EP_PROFILE
    g_host_profile.channels[kernels::prof::kDispatch] = C;
#endif
    // No padding rows when the handle's dispatch received exactly its rows, unless a num_worst_tokens
    // dispatch since may have cancelled the data kernels (then every row is padding).
    if (!exact_rows || rt.dispatch_may_be_cancelled()) fill_padding(rt, rank_prefix, out, row_bytes, stream);
    return py::make_tuple(out.x, out.scales);
}

py::tuple combine(NvlRuntime& rt, const Tensor& x, const optional<Tensor>& topk_weights,
                  const optional<Tensor>& bias_0, const optional<Tensor>& bias_1, const Tensor& rank_prefix,
                  const Tensor& channel_prefix, const Tensor& recv_channel_prefix, const Tensor& is_token_in_rank,
                  const Tensor& send_head, int64_t send_chunk, int64_t ring_slots, bool staged,
                  int64_t pipeline_lag) {
    rt.check_usable();
    const int lag = checked_pipeline_lag(pipeline_lag);
    const int C = static_cast<int>(channel_prefix.size(1));
    check_channels(rt, C);
    const int num_topk = topk_weights.has_value() ? static_cast<int>(topk_weights->size(1)) : 0;
    TORCH_CHECK_VALUE(num_topk <= kNumMaxTopk, "topk_weights: at most ", kNumMaxTopk, " columns");
    const int row_bytes = row_bytes_of(x);
    check_ring_space(rt, C, static_cast<int>(ring_slots), kernels::combine_slot_bytes(row_bytes, num_topk));
    const int64_t num_tokens = is_token_in_rank.size(0);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    // The sums and their weights in one allocation.
    std::vector<Part> parts{{{num_tokens, x.size(1)}, x.scalar_type()}};
    if (topk_weights.has_value()) parts.push_back({{num_tokens, num_topk}, at::kFloat});
    const std::vector<Tensor> outputs = carve(x.options(), parts);
    const Tensor& combined = outputs[0];
    optional<Tensor> combined_weights;
    if (topk_weights.has_value()) combined_weights = outputs[1];
    kernels::CombineArgs a{};
    a.x = x.data_ptr();
    a.topk_weights = opt_ptr<const float>(topk_weights);
    a.bias_0 = bias_0.has_value() ? bias_0->data_ptr() : nullptr;
    a.bias_1 = bias_1.has_value() ? bias_1->data_ptr() : nullptr;
    a.rank_prefix_matrix = int_ptr(rank_prefix);
    a.channel_prefix_matrix = int_ptr(channel_prefix);
    a.recv_channel_prefix_matrix = int_ptr(recv_channel_prefix);
    a.is_token_in_rank = is_token_in_rank.data_ptr<bool>();
    a.send_head = int_ptr(send_head);
    a.combined_x = combined.data_ptr();
    a.combined_topk_weights = opt_ptr<float>(combined_weights);
    a.dtype = combine_dtype(x);
    a.num_tokens = static_cast<int>(num_tokens);
    a.row_bytes = row_bytes;
    a.num_topk = num_topk;
    a.num_channels = C;
    a.ring_slots = static_cast<int>(ring_slots);
    a.publish_every = static_cast<int>(send_chunk);
    a.staging_bytes = staged ? rt.data_bytes() : 0;
    launch_check(kernels::launch_prepare_rings(rt.comm(), stream), "prepare_rings");
    launch_check(kernels::launch_combine(a, rt.comm(lag), stream), "combine");
#ifdef MOE_EP_PROFILE
    g_host_profile.channels[kernels::prof::kCombine] = C;
#endif
    return py::make_tuple(combined, combined_weights);
}

}  // namespace

}  // namespace moe_ep

PYBIND11_MODULE(_C, m) {
    using moe_ep::NvlRuntime;
    namespace kernels = moe_ep::kernels;
    m.doc() = "moe_ep normal-mode (intranode NVLink) kernels and runtime";
    py::class_<NvlRuntime>(m, "NvlRuntime")
        .def(py::init<int, int, int64_t, double>(), py::arg("rank"), py::arg("num_ranks"), py::arg("num_nvl_bytes"),
             py::arg("timeout_s"))
        .def("local_handle", [](const NvlRuntime& rt) { return py::bytes(rt.local_handle()); })
        .def("open_peers",
             [](NvlRuntime& rt, const std::vector<py::bytes>& handles) {
                 std::vector<std::string> records(handles.begin(), handles.end());
                 rt.open_peers(records);
             })
        .def("check_usable", &NvlRuntime::check_usable)
        .def("last_combine_path", &NvlRuntime::last_combine_path)
        .def("destroy", &NvlRuntime::destroy)
        .def_property_readonly("data_bytes", &NvlRuntime::data_bytes)
        // Buffer.get_local_buffer_tensor: the data region as uint8, a view valid while the runtime lives.
        .def("local_buffer", [](const NvlRuntime& rt) {
            return torch::from_blob(rt.data(), {rt.data_bytes()},
                                    torch::dtype(torch::kUInt8).device(torch::kCUDA, rt.device()));
        });
    m.def("get_dispatch_layout", &moe_ep::get_dispatch_layout);
    m.def("dispatch", &moe_ep::dispatch);
    m.def("cached_dispatch", &moe_ep::cached_dispatch);
    m.def("combine", &moe_ep::combine);
    m.def("handle_bytes", [] { return NvlRuntime::kHandleBytes; });
    m.def("is_sm90_compiled", &kernels::is_sm90_compiled);
#ifdef MOE_EP_PROFILE
    // Built with MOE_EP_PROFILE=1 only: per-phase timing of the last dispatch and combine kernels.
    m.def("last_profile", &moe_ep::last_profile, py::arg("runtime"));
#endif
}
