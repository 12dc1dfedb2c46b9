// The `moe_ep._low_latency` and `moe_ep._low_latency_p2p` extension modules: torch binding of the
// low-latency mode (argument checks and kernel launches on the current stream).
// moe_ep/ops/backends/cuda_low_latency.py drives the protocol. Built only with
// NVSHMEM. `_low_latency` is relocatable device code (NVSHMEM's device library needs it) and reaches
// peers without P2P through NVSHMEM puts; `_low_latency_p2p` is the same source compiled with
// MOE_EP_LL_P2P_ONLY as whole-program code, for groups whose peers are all mapped (one host with P2P):
// the kernels then use no NVSHMEM device API.
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <optional>

#include "common/binding_outputs.hpp"
#include "low_latency/api.cuh"
#include "low_latency/nvshmem_runtime.hpp"

namespace moe_ep {

namespace ll = kernels::ll;

namespace {

using at::Tensor;
using std::optional;

void launch_check(cudaError_t err, const char* what) {
    TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

void check_tensor(const Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape, int device) {
    TORCH_CHECK_VALUE(t.is_cuda() && t.get_device() == device, name, ": expected a tensor on cuda:", device);
    TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, ": expected ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.sizes() == shape, name, ": expected shape ", shape, ", got ", t.sizes());
}

void check_dense(const Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape, int device) {
    check_tensor(t, name, dtype, shape, device);
    TORCH_CHECK_VALUE(t.is_contiguous(), name, ": expected a contiguous tensor");
}

template <typename T>
T* opt_ptr(const optional<Tensor>& t) {
    return t.has_value() ? static_cast<T*>(t->data_ptr()) : nullptr;
}

cudaStream_t current_stream(const NvshmemRuntime& rt) { return at::cuda::getCurrentCUDAStream(rt.device()).stream(); }

// Checks shared by dispatch and combine; returns the number of local experts.
int64_t check_sizes(const NvshmemRuntime& rt, const Tensor& topk_idx, int64_t max_tokens, int64_t hidden,
                    int64_t num_experts) {
    const int64_t num_ranks = rt.num_ranks();
    TORCH_CHECK_VALUE(num_experts > 0 && num_experts % num_ranks == 0 && num_experts <= ll::kMaxExperts,
                      "num_experts: expected a multiple of ", num_ranks, " up to ", ll::kMaxExperts, ", got ",
                      num_experts);
    TORCH_CHECK_VALUE(topk_idx.dim() == 2 && topk_idx.size(1) >= 1 && topk_idx.size(1) <= kNumMaxTopk,
                      "topk_idx: expected [num_tokens, k] with 1 <= k <= ", kNumMaxTopk);
    check_dense(topk_idx, "topk_idx", at::kLong, {topk_idx.size(0), topk_idx.size(1)}, rt.device());
    TORCH_CHECK_VALUE(topk_idx.size(0) <= max_tokens, "topk_idx: ", topk_idx.size(0),
                      " tokens exceed num_max_dispatch_tokens_per_rank=", max_tokens);
    TORCH_CHECK_VALUE(hidden > 0 && hidden % 8 == 0, "hidden: expected a positive multiple of 8, got ", hidden);
    return num_experts / num_ranks;
}

// The buffer layout of a call running `phases`; a call with the send phase also prepares the buffer.
ll::Layout layout_for_phases(NvshmemRuntime& rt, int64_t phases, int64_t max_tokens, int64_t hidden,
                             int64_t num_experts, cudaStream_t stream) {
    TORCH_CHECK_VALUE(phases >= 1 && phases <= 3, "phases: expected 1 (send), 2 (receive) or 3 (both)");
    return (phases & ll::kSendPhase) ? rt.prepare(max_tokens, hidden, num_experts, stream)
                                     : rt.layout(max_tokens, hidden, num_experts);
}

// The outputs a dispatch fills, made in one binding call and two allocations (each allocation costs the
// host about as much as a kernel launch): recv_x with recv_scales (FP8 only; token-dimension contiguous),
// then the handle's src_info and layout_range with recv_count.
py::tuple dispatch_outputs(const NvshmemRuntime& rt, const Tensor& x, int64_t max_tokens, int64_t num_experts,
                           int64_t mode) {
    TORCH_CHECK_VALUE(x.dim() == 2, "x: expected [num_tokens, hidden]");
    TORCH_CHECK_VALUE(mode >= 0 && mode <= 2, "mode: expected 0 (bf16), 1 (fp8) or 2 (fp8 ue8m0)");
    const int64_t num_ranks = rt.num_ranks(), num_local = num_experts / num_ranks, hidden = x.size(1);
    const int64_t slots = num_ranks * max_tokens;
    const auto dispatch_mode = static_cast<ll::Mode>(mode);
    py::object recv_scales = py::none();
    Tensor recv_x;
    if (dispatch_mode == ll::Mode::kBF16) {
        recv_x = at::empty({num_local, slots, hidden}, x.options());
    } else {
        const bool packed = dispatch_mode == ll::Mode::kFP8UE8M0;
        const int64_t groups = packed ? (hidden / kFp8Block + 3) / 4 : hidden / kFp8Block;
        const at::ScalarType scale_type = packed ? at::kInt : at::kFloat;
        const std::vector<Tensor> tokens = carve(
            x.options(), {{{num_local, slots, hidden}, at::kFloat8_e4m3fn}, {{num_local, groups, slots}, scale_type}});
        recv_x = tokens[0];
        recv_scales = py::cast(tokens[1].transpose(1, 2));
    }
    const std::vector<Tensor> meta = carve(
        x.options(), {{{num_local, slots}, at::kInt}, {{num_local, num_ranks}, at::kLong}, {{num_local}, at::kInt}});
    return py::make_tuple(recv_x, recv_scales, meta[0], meta[1], meta[2]);
}

void dispatch(NvshmemRuntime& rt, const Tensor& x, const Tensor& topk_idx, const Tensor& recv_x,
              const optional<Tensor>& recv_scales, const Tensor& recv_src_info, const Tensor& layout_range,
              const Tensor& recv_count, const optional<Tensor>& cumulative_stats, const optional<Tensor>& wait_stats,
              int64_t max_tokens, int64_t num_experts, int64_t mode, bool round_scale, int64_t phases) {
    rt.check_usable();
    const int device = rt.device();
    TORCH_CHECK_VALUE(x.dim() == 2, "x: expected [num_tokens, hidden]");
    const int64_t num_tokens = x.size(0), hidden = x.size(1), num_ranks = rt.num_ranks();
    const int64_t num_local = check_sizes(rt, topk_idx, max_tokens, hidden, num_experts);
    check_dense(x, "x", at::kBFloat16, {topk_idx.size(0), hidden}, device);
    TORCH_CHECK_VALUE(num_tokens * topk_idx.size(1) <= ll::kMaxTopkEntries, "topk_idx: num_tokens x k = ",
                      num_tokens * topk_idx.size(1), " exceeds ", ll::kMaxTopkEntries);
    TORCH_CHECK_VALUE(mode >= 0 && mode <= 2, "mode: expected 0 (bf16), 1 (fp8) or 2 (fp8 ue8m0)");
    const auto dispatch_mode = static_cast<ll::Mode>(mode);
    const bool fp8 = dispatch_mode != ll::Mode::kBF16;
    TORCH_CHECK_VALUE(!fp8 || hidden % kFp8Block == 0, "x: FP8 needs a hidden size that is a multiple of ", kFp8Block,
                      ", got ", hidden);
    const int64_t slots = num_ranks * max_tokens;
    check_dense(recv_x, "recv_x", fp8 ? at::kFloat8_e4m3fn : at::kBFloat16, {num_local, slots, hidden}, device);
    TORCH_CHECK_VALUE(recv_scales.has_value() == fp8, "recv_scales: expected exactly with FP8");
    if (fp8) {
        const int64_t groups = dispatch_mode == ll::Mode::kFP8 ? hidden / kFp8Block : (hidden / kFp8Block + 3) / 4;
        check_tensor(*recv_scales, "recv_scales", dispatch_mode == ll::Mode::kFP8 ? at::kFloat : at::kInt,
                     {num_local, slots, groups}, device);
        TORCH_CHECK_VALUE(recv_scales->strides() == at::IntArrayRef({groups * slots, 1, slots}),
                          "recv_scales: expected the token-dimension-contiguous layout (transposed [E, G, R*M])");
    }
    check_dense(recv_src_info, "recv_src_info", at::kInt, {num_local, slots}, device);
    check_dense(layout_range, "layout_range", at::kLong, {num_local, num_ranks}, device);
    check_dense(recv_count, "recv_count", at::kInt, {num_local}, device);
    if (cumulative_stats.has_value())
        check_dense(*cumulative_stats, "cumulative_local_expert_recv_stats", at::kInt, {num_local}, device);
    if (wait_stats.has_value())
        check_dense(*wait_stats, "dispatch_wait_recv_cost_stats", at::kLong, {num_ranks}, device);
    const cudaStream_t stream = current_stream(rt);
    const ll::Layout layout = layout_for_phases(rt, phases, max_tokens, hidden, num_experts, stream);
    ll::DispatchArgs a{};
    a.x = x.data_ptr();
    a.topk_idx = topk_idx.data_ptr<int64_t>();
    a.recv_x = recv_x.data_ptr();
    a.recv_scales = fp8 ? recv_scales->data_ptr() : nullptr;
    a.recv_src_info = recv_src_info.data_ptr<int>();
    a.layout_range = layout_range.data_ptr<int64_t>();
    a.recv_count = recv_count.data_ptr<int>();
    a.cumulative_stats = opt_ptr<int>(cumulative_stats);
    a.wait_stats = opt_ptr<int64_t>(wait_stats);
    a.num_tokens = static_cast<int>(num_tokens);
    a.num_topk = static_cast<int>(topk_idx.size(1));
    a.hidden = static_cast<int>(hidden);
    a.max_tokens = static_cast<int>(max_tokens);
    a.num_experts = static_cast<int>(num_experts);
    a.mode = dispatch_mode;
    a.round_scale = round_scale || dispatch_mode == ll::Mode::kFP8UE8M0;
    launch_check(ll::launch_dispatch(a, rt.context(), layout, static_cast<int>(phases), stream), "low-latency dispatch");
}

void check_logfmt_hidden(int64_t hidden) {
    TORCH_CHECK_VALUE(hidden % ll::kLogfmtBlock == 0 && hidden <= ll::kLogfmtMaxHidden,
                      "use_logfmt: LogFMT needs a hidden size that is a multiple of ", ll::kLogfmtBlock,
                      " up to ", ll::kLogfmtMaxHidden, ", got ", hidden);
}

void combine(NvshmemRuntime& rt, const Tensor& x, bool zero_copy, const Tensor& src_info, const Tensor& layout_range,
             const Tensor& topk_idx, const Tensor& topk_weights, const Tensor& out, const optional<Tensor>& wait_stats,
             int64_t max_tokens, int64_t hidden, int64_t num_experts, bool logfmt, int64_t phases) {
    rt.check_usable();
    const int device = rt.device();
    const int64_t num_ranks = rt.num_ranks(), slots = num_ranks * max_tokens;
    const int64_t num_local = check_sizes(rt, topk_idx, max_tokens, hidden, num_experts);
    const int64_t num_tokens = topk_idx.size(0);
    if (logfmt) {
        // A LogFMT combine stages its partial rows in the send region, which a zero-copy combine reads.
        TORCH_CHECK_VALUE(!zero_copy, "use_logfmt: cannot be combined with zero_copy");
        check_logfmt_hidden(hidden);
    }
    if (!zero_copy) check_dense(x, "x", at::kBFloat16, {num_local, slots, hidden}, device);
    check_dense(src_info, "handle.src_info", at::kInt, {num_local, slots}, device);
    check_dense(layout_range, "handle.layout_range", at::kLong, {num_local, num_ranks}, device);
    check_dense(topk_weights, "topk_weights", at::kFloat, {num_tokens, topk_idx.size(1)}, device);
    check_dense(out, "out", at::kBFloat16, {num_tokens, hidden}, device);
    if (wait_stats.has_value())
        check_dense(*wait_stats, "combine_wait_recv_cost_stats", at::kLong, {num_ranks}, device);
    const cudaStream_t stream = current_stream(rt);
    const ll::Layout layout = layout_for_phases(rt, phases, max_tokens, hidden, num_experts, stream);
    ll::CombineArgs a{};
    a.x = zero_copy ? rt.send_region(layout) : x.data_ptr();
    a.src_info = src_info.data_ptr<int>();
    a.layout_range = layout_range.data_ptr<int64_t>();
    a.topk_idx = topk_idx.data_ptr<int64_t>();
    a.topk_weights = topk_weights.data_ptr<float>();
    a.out = out.data_ptr();
    a.wait_stats = opt_ptr<int64_t>(wait_stats);
    a.num_tokens = static_cast<int>(num_tokens);
    a.num_topk = static_cast<int>(topk_idx.size(1));
    a.hidden = static_cast<int>(hidden);
    a.max_tokens = static_cast<int>(max_tokens);
    a.num_experts = static_cast<int>(num_experts);
    a.logfmt = logfmt;
    launch_check(ll::launch_combine(a, rt.context(), layout, static_cast<int>(phases), stream), "low-latency combine");
}

// The zero-copy combine buffer `[E_local, R*M, H]` bf16: a view of the send region (valid while the
// runtime lives).
Tensor send_buffer(const NvshmemRuntime& rt, int64_t max_tokens, int64_t hidden, int64_t num_experts) {
    const ll::Layout layout = rt.layout(max_tokens, hidden, num_experts);
    const int64_t num_ranks = rt.num_ranks();
    return torch::from_blob(rt.send_region(layout), {num_experts / num_ranks, num_ranks * max_tokens, hidden},
                            torch::dtype(torch::kBFloat16).device(torch::kCUDA, rt.device()));
}

// LogFMT-10 on its own (tests): `rows` [N, H] bf16 -> (wire [N, 2H] uint8, zero past each row's bytes;
// compact [N] int32, 1 for the LogFMT layout; nbytes [N] int32).
py::tuple logfmt_encode(const Tensor& rows) {
    TORCH_CHECK_VALUE(rows.is_cuda() && rows.dim() == 2 && rows.is_contiguous(),
                      "rows: expected a contiguous [N, H] CUDA tensor");
    TORCH_CHECK_TYPE(rows.scalar_type() == at::kBFloat16, "rows: expected bfloat16, got ", rows.scalar_type());
    const int64_t num_rows = rows.size(0), hidden = rows.size(1);
    check_logfmt_hidden(hidden);
    const auto options = rows.options();
    Tensor wire = torch::zeros({num_rows, 2 * hidden}, options.dtype(at::kByte));
    Tensor compact = torch::empty({num_rows}, options.dtype(at::kInt));
    Tensor nbytes = torch::empty({num_rows}, options.dtype(at::kInt));
    launch_check(ll::launch_logfmt_encode(rows.data_ptr(), wire.data_ptr(), compact.data_ptr<int>(),
                                          nbytes.data_ptr<int>(), static_cast<int>(num_rows), static_cast<int>(hidden),
                                          at::cuda::getCurrentCUDAStream(rows.get_device()).stream()),
                 "LogFMT encode");
    return py::make_tuple(wire, compact, nbytes);
}

// LogFMT-10 on its own (tests): wire rows [N, >= 2H] uint8 and their formats [N] int32 -> [N, H] bf16.
Tensor logfmt_decode(const Tensor& wire, const Tensor& compact, int64_t hidden) {
    check_logfmt_hidden(hidden);
    TORCH_CHECK_VALUE(wire.is_cuda() && wire.dim() == 2 && wire.size(1) == 2 * hidden && wire.is_contiguous(),
                      "wire: expected a contiguous [N, 2 * hidden] CUDA tensor");
    TORCH_CHECK_TYPE(wire.scalar_type() == at::kByte, "wire: expected uint8, got ", wire.scalar_type());
    check_dense(compact, "compact", at::kInt, {wire.size(0)}, wire.get_device());
    Tensor rows = torch::empty({wire.size(0), hidden}, wire.options().dtype(at::kBFloat16));
    launch_check(ll::launch_logfmt_decode(wire.data_ptr(), compact.data_ptr<int>(), rows.data_ptr(),
                                          static_cast<int>(wire.size(0)), static_cast<int>(hidden),
                                          at::cuda::getCurrentCUDAStream(wire.get_device()).stream()),
                 "LogFMT decode");
    return rows;
}

// Elastic mode: the rank mask [R] int32 that the kernels read and set (valid while the runtime lives).
Tensor rank_mask(const NvshmemRuntime& rt) {
    TORCH_CHECK_VALUE(rt.mask() != nullptr, "the low-latency runtime was created without elastic mode (shrink)");
    return torch::from_blob(rt.mask(), {rt.num_ranks()}, torch::dtype(torch::kInt32).device(torch::kCUDA, rt.device()));
}

// Buffer.get_local_buffer_tensor(use_rdma_buffer=True): the whole symmetric buffer as uint8 (valid while
// the runtime lives).
Tensor local_buffer(const NvshmemRuntime& rt) {
    return torch::from_blob(rt.base(), {rt.num_bytes()}, torch::dtype(torch::kUInt8).device(torch::kCUDA, rt.device()));
}

}  // namespace

}  // namespace moe_ep

#ifndef MOE_EP_LL_P2P_ONLY
namespace moe_ep {
// Internode normal mode (csrc/internode/binding.cpp) shares this module's NVSHMEM device state.
void register_internode(pybind11::module_& m);
}  // namespace moe_ep
#endif

// TORCH_EXTENSION_NAME: _low_latency, or _low_latency_p2p for the P2P-only build (MOE_EP_LL_P2P_ONLY).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    namespace ll = moe_ep::kernels::ll;
    using moe_ep::NvshmemRuntime;
    m.doc() = "moe_ep low-latency kernels and NVSHMEM runtime";
    m.def("ll_buffer_bytes", [](int64_t max_tokens, int64_t hidden, int64_t num_ranks, int64_t num_experts) {
        return ll::make_layout(max_tokens, hidden, num_ranks, num_experts).total;
    });
    // Module-local: both low-latency modules bind this C++ type, and one process may import both.
    py::class_<NvshmemRuntime>(m, "NvshmemRuntime", py::module_local())
        .def(py::init<int, int, int64_t, double, bool, bool, int>(), py::arg("rank"), py::arg("num_ranks"),
             py::arg("num_bytes"), py::arg("timeout_s"), py::arg("puts_only") = false, py::arg("shrink") = false,
             py::arg("ranks_per_node") = 0,
             py::call_guard<py::gil_scoped_release>())
        .def_static("unique_id_bytes", &NvshmemRuntime::unique_id_bytes)
        .def_static("create_unique_id", [] { return py::bytes(NvshmemRuntime::create_unique_id()); })
        .def_static(
            "init",
            [](const py::bytes& unique_id, int rank, int num_ranks) {
                std::string id = unique_id;
                py::gil_scoped_release release;
                NvshmemRuntime::init(id, rank, num_ranks);
            },
            py::arg("unique_id"), py::arg("rank"), py::arg("num_ranks"))
        .def("destroy", &NvshmemRuntime::destroy, py::call_guard<py::gil_scoped_release>())
        .def("check_usable", &NvshmemRuntime::check_usable)
        .def("clean", [](NvshmemRuntime& rt) { rt.clean(moe_ep::current_stream(rt)); })
        .def_property_readonly("all_peers_mapped", &NvshmemRuntime::all_peers_mapped)
        .def_property_readonly("num_bytes", &NvshmemRuntime::num_bytes);
    m.def("ll_dispatch_outputs", &moe_ep::dispatch_outputs);
    m.def("ll_dispatch", &moe_ep::dispatch);
    m.def("ll_combine", &moe_ep::combine);
    m.def("ll_send_buffer", &moe_ep::send_buffer);
    m.def("ll_local_buffer", &moe_ep::local_buffer);
    m.def("ll_rank_mask", &moe_ep::rank_mask);
    m.def("ll_logfmt_encode", &moe_ep::logfmt_encode);
    m.def("ll_logfmt_decode", &moe_ep::logfmt_decode);
#ifndef MOE_EP_LL_P2P_ONLY
    moe_ep::register_internode(m);
#endif
}
