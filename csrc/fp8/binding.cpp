// The `moe_ep._fp8` extension module: the FP8 expert kernels (kernels/grouped_gemm.cu: the grouped
// blockwise FP8 GEMM; kernels/weight_cast.cu: the weight cast with its transposed copy), with their
// argument checks, output allocations and launches on the current stream.
// A module of its own, never relocatable device code: under -rdc ptxas ignores the GEMM's setmaxnreg
// register budget and spills its accumulators (2.4x slower).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "fp8/api.cuh"

namespace moe_ep {

namespace {

using at::Tensor;

// TMA reads the operands: K contiguous, base address and row strides in 16-byte multiples.
void check_operand(const Tensor& t, const char* name, int64_t dims) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat8_e4m3fn, name, ": expected float8_e4m3fn, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == dims, name, ": expected ", dims, " dimensions, got ", t.dim());
    TORCH_CHECK_VALUE(t.stride(-1) == 1, name, ": expected K (the last dimension) contiguous, got strides ",
                      t.strides());
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, ": expected a 16-byte aligned start");
    for (int64_t d = 0; d + 1 < dims; ++d) {
        TORCH_CHECK_VALUE(t.stride(d) % 16 == 0, name, ": expected strides in multiples of 16 bytes, got ",
                          t.strides());
    }
}

void check_scales(const Tensor& scales, const char* name, at::IntArrayRef expected) {
    TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat, name, ": expected float32, got ", scales.scalar_type());
    TORCH_CHECK_VALUE(scales.sizes() == expected, name, ": expected shape ", expected, ", got ", scales.sizes());
}

// The checks, output allocation and launch both groupings share: `b` is `[E, n_out, depth]` by rows,
// `[n_out, depth]` by depth; the output is `[num_rows, n_out]` by rows, `[E, num_rows, n_out]` by depth.
Tensor launch_gemm(const Tensor& a, const Tensor& a_scales, const Tensor& b, const Tensor& b_scales,
                   const Tensor& ends, int64_t num_experts, bool group_depth) {
    TORCH_CHECK(kernels::fp8_grouped_gemm_supported(),
                "moe_ep._fp8 was not built for sm_90a or the driver cannot encode TMA maps");
    TORCH_CHECK_VALUE(a.is_cuda(), "a: expected a CUDA tensor");
    for (const Tensor* t : {&a_scales, &b, &b_scales, &ends}) {
        TORCH_CHECK_VALUE(t->device() == a.device(), "a_scales, b, b_scales, ends: expected every tensor on ",
                          a.device(), ", got ", t->device());
    }
    const int64_t num_rows = a.size(0), depth = a.size(1), n_out = b.size(-2);
    const int64_t tile = kernels::fp8_grouped_gemm_tile();
    TORCH_CHECK_VALUE(b.size(-1) == depth && depth % tile == 0 && n_out % tile == 0, "a ", a.sizes(), ", b ",
                      b.sizes(), ": K must match and K and N_OUT be multiples of ", tile);
    TORCH_CHECK_VALUE(num_experts >= 1 && num_rows < (int64_t{1} << 31) && depth < (int64_t{1} << 31),
                      "a, b: expected at least one expert and fewer than 2^31 rows and columns, got ", num_experts,
                      " experts and a ", a.sizes());
    TORCH_CHECK_VALUE(ends.scalar_type() == at::kInt && ends.sizes() == at::IntArrayRef({num_experts}),
                      "ends: expected int32 [", num_experts, "], got ", ends.scalar_type(), " ", ends.sizes());
    check_scales(a_scales, "a_scales", {num_rows, depth / tile});
    const Tensor ends_dense = ends.contiguous();
    const c10::cuda::CUDAGuard guard(a.device());
    const auto bf16 = a.options().dtype(at::kBFloat16);
    Tensor out = group_depth ? at::empty({num_experts, num_rows, n_out}, bf16) : at::empty({num_rows, n_out}, bf16);
    if (out.numel() == 0) return out;
    kernels::Fp8GroupedGemmArgs args{};
    args.a = a.data_ptr();
    args.a_row_stride = a.stride(0);
    args.a_scales = a_scales.data_ptr<float>();
    args.a_scale_row_stride = a_scales.stride(0);
    args.a_scale_k_stride = a_scales.stride(1);
    args.b = b.data_ptr();
    args.b_row_stride = b.stride(-2);
    args.b_expert_stride = group_depth ? b.stride(-2) * n_out : b.stride(0);
    args.b_scales = b_scales.data_ptr<float>();
    args.b_scale_expert_stride = group_depth ? 0 : b_scales.stride(0);
    args.b_scale_row_stride = b_scales.stride(-2);
    args.b_scale_k_stride = b_scales.stride(-1);
    args.ends = ends_dense.data_ptr<int>();
    args.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
    args.out_row_stride = out.stride(-2);
    args.out_expert_stride = group_depth ? out.stride(0) : 0;
    args.group_depth = group_depth;
    args.num_rows = static_cast<int>(num_rows);
    args.depth = static_cast<int>(depth);
    args.n_out = static_cast<int>(n_out);
    args.num_experts = static_cast<int>(num_experts);
    const cudaError_t err = kernels::launch_fp8_grouped_gemm(args, c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, "FP8 grouped GEMM: launch failed: ", cudaGetErrorString(err));
    return out;
}

Tensor fp8_grouped_mm(const Tensor& a, const Tensor& a_scales, const Tensor& b, const Tensor& b_scales,
                      const Tensor& ends) {
    check_operand(a, "a", 2);
    check_operand(b, "b", 3);
    const int64_t tile = kernels::fp8_grouped_gemm_tile();
    check_scales(b_scales, "b_scales", {b.size(0), b.size(1) / tile, b.size(2) / tile});
    return launch_gemm(a, a_scales, b, b_scales, ends, b.size(0), false);
}

Tensor fp8_depth_grouped_mm(const Tensor& a, const Tensor& a_scales, const Tensor& b, const Tensor& b_scales,
                            const Tensor& ends) {
    check_operand(a, "a", 2);
    check_operand(b, "b", 2);
    const int64_t tile = kernels::fp8_grouped_gemm_tile();
    TORCH_CHECK_VALUE(a.size(0) % tile == 0, "a: expected rows in a multiple of ", tile, ", got ", a.sizes());
    check_scales(b_scales, "b_scales", {b.size(0) / tile, b.size(1) / tile});
    return launch_gemm(a, a_scales, b, b_scales, ends, ends.numel(), true);
}

std::tuple<Tensor, Tensor, Tensor> fp8_weight_cast(const Tensor& w, double amax_floor) {
    TORCH_CHECK_TYPE(w.scalar_type() == at::kBFloat16, "w: expected bfloat16, got ", w.scalar_type());
    TORCH_CHECK_VALUE(w.is_cuda(), "w: expected a CUDA tensor");
    TORCH_CHECK_VALUE(w.dim() >= 2, "w: expected [..., N, K], got ", w.sizes());
    const int64_t tile = kernels::fp8_grouped_gemm_tile();
    const int64_t n = w.size(-2), k = w.size(-1);
    TORCH_CHECK_VALUE(n % tile == 0 && k % tile == 0, "w: expected N and K multiples of ", tile, ", got ", w.sizes());
    TORCH_CHECK_VALUE(n * k < (int64_t{1} << 31), "w: expected fewer than 2^31 elements per matrix, got ", w.sizes());
    const Tensor matrices = w.reshape({-1, n, k});
    TORCH_CHECK_VALUE(matrices.stride(2) == 1 && matrices.stride(1) % 8 == 0 && matrices.stride(0) % 8 == 0 &&
                          reinterpret_cast<uintptr_t>(matrices.data_ptr()) % 16 == 0,
                      "w: expected K contiguous, 16-byte aligned rows and start; got strides ", w.strides());
    const c10::cuda::CUDAGuard guard(w.device());
    const auto fp8 = w.options().dtype(at::kFloat8_e4m3fn);
    Tensor q = at::empty({matrices.size(0), n, k}, fp8);
    Tensor q_t = at::empty({matrices.size(0), k, n}, fp8);
    Tensor scales = at::empty({matrices.size(0), n / tile, k / tile}, w.options().dtype(at::kFloat));
    kernels::Fp8WeightCastArgs args{};
    args.w = reinterpret_cast<const __nv_bfloat16*>(matrices.data_ptr());
    args.w_matrix_stride = matrices.stride(0);
    args.w_row_stride = matrices.stride(1);
    args.q = reinterpret_cast<uint8_t*>(q.data_ptr());
    args.q_t = reinterpret_cast<uint8_t*>(q_t.data_ptr());
    args.scales = scales.data_ptr<float>();
    args.num_matrices = static_cast<int>(matrices.size(0));
    args.rows = static_cast<int>(n);
    args.cols = static_cast<int>(k);
    args.amax_floor = static_cast<float>(amax_floor);
    const cudaError_t err = kernels::launch_fp8_weight_cast(args, c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, "fp8_weight_cast: launch failed: ", cudaGetErrorString(err));
    std::vector<int64_t> lead(w.sizes().begin(), w.sizes().end() - 2);
    auto shaped = [&lead](const Tensor& t, int64_t rows, int64_t cols) {
        std::vector<int64_t> shape = lead;
        shape.push_back(rows);
        shape.push_back(cols);
        return t.view(shape);
    };
    return {shaped(q, n, k), shaped(scales, n / tile, k / tile), shaped(q_t, k, n)};
}

}  // namespace

}  // namespace moe_ep

PYBIND11_MODULE(_fp8, m) {
    using moe_ep::fp8_depth_grouped_mm;
    using moe_ep::fp8_grouped_mm;
    using moe_ep::fp8_weight_cast;
    namespace kernels = moe_ep::kernels;
    m.doc() = "moe_ep FP8 expert kernels (sm_90a): grouped blockwise GEMMs (by rows, by depth), weight cast";
    m.def("fp8_weight_cast", &fp8_weight_cast, py::arg("w"), py::arg("amax_floor"),
          "128x128 blockwise e4m3 cast of BF16 [..., N, K] weights: (q, scales [..., N/128, K/128], q_t [..., K, N]).");
    m.def("fp8_grouped_mm", &fp8_grouped_mm, py::arg("a"), py::arg("a_scales"), py::arg("b"), py::arg("b_scales"),
          py::arg("ends"),
          "Grouped e4m3 GEMM with 1x128 / 128x128 block scales: [N, K] x [E, N_OUT, K] -> [N, N_OUT] BF16; rows "
          "from ends[-1] on are zeros.");
    m.def("fp8_depth_grouped_mm", &fp8_depth_grouped_mm, py::arg("a"), py::arg("a_scales"), py::arg("b"),
          py::arg("b_scales"), py::arg("ends"),
          "Depth-grouped e4m3 GEMM (weight gradients) with 1x128 / 128x128 block scales: out[e] = a[:, K_e] @ "
          "b[:, K_e]^T, K_e = [ends[e-1], ends[e]) (multiples of 128): [M, K] x [N_OUT, K] -> [E, M, N_OUT] BF16.");
    m.def("fp8_grouped_mm_supported", &kernels::fp8_grouped_gemm_supported,
          "Whether the grouped FP8 GEMM can run here (sm_90a build, TMA map encoder found).");
}
