// The `moe_ep._fp8_gemm` extension module: the grouped blockwise FP8 GEMM (csrc/kernels/fp8_gemm.cu)
// with its argument checks, the output allocation and the launch on the current stream.
// A module apart from `moe_ep._C`: NVSHMEM makes `_C` relocatable device code (-rdc), and under -rdc
// ptxas ignores the kernel's setmaxnreg register budget and spills its accumulators (2.4x slower).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "kernels/api.cuh"

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

Tensor fp8_grouped_mm(const Tensor& a, const Tensor& a_scales, const Tensor& b, const Tensor& b_scales,
                      const Tensor& ends) {
    TORCH_CHECK(kernels::fp8_grouped_gemm_supported(),
                "fp8_grouped_mm: moe_ep._fp8_gemm was not built for sm_90a or the driver cannot encode TMA maps");
    check_operand(a, "a", 2);
    check_operand(b, "b", 3);
    const int64_t num_rows = a.size(0), depth = a.size(1), num_experts = b.size(0), n_out = b.size(1);
    const int64_t tile = kernels::fp8_grouped_gemm_tile();
    TORCH_CHECK_VALUE(b.size(2) == depth && depth % tile == 0 && n_out % tile == 0, "a ", a.sizes(), ", b ",
                      b.sizes(), ": K must match and K and N_OUT be multiples of ", tile);
    TORCH_CHECK_VALUE(num_experts >= 1 && num_rows < (int64_t{1} << 31), "a, b: expected at least one expert and "
                      "fewer than 2^31 rows, got ", num_experts, " experts and ", num_rows, " rows");
    TORCH_CHECK_TYPE(a_scales.scalar_type() == at::kFloat && b_scales.scalar_type() == at::kFloat,
                     "a_scales, b_scales: expected float32");
    TORCH_CHECK_VALUE(a_scales.sizes() == at::IntArrayRef({num_rows, depth / tile}), "a_scales: expected shape [",
                      num_rows, ", ", depth / tile, "], got ", a_scales.sizes());
    TORCH_CHECK_VALUE(b_scales.sizes() == at::IntArrayRef({num_experts, n_out / tile, depth / tile}),
                      "b_scales: expected shape [", num_experts, ", ", n_out / tile, ", ", depth / tile, "], got ",
                      b_scales.sizes());
    TORCH_CHECK_VALUE(ends.scalar_type() == at::kInt && ends.sizes() == at::IntArrayRef({num_experts}),
                      "ends: expected int32 [", num_experts, "], got ", ends.scalar_type(), " ", ends.sizes());
    for (const Tensor* t : {&a_scales, &b, &b_scales, &ends}) {
        TORCH_CHECK_VALUE(t->device() == a.device(), "a_scales, b, b_scales, ends: expected every tensor on ",
                          a.device(), ", got ", t->device());
    }
    TORCH_CHECK_VALUE(a.is_cuda(), "a: expected a CUDA tensor");
    const Tensor ends_dense = ends.contiguous();
    const c10::cuda::CUDAGuard guard(a.device());
    Tensor out = at::empty({num_rows, n_out}, a.options().dtype(at::kBFloat16));
    if (num_rows == 0) return out;
    kernels::Fp8GroupedGemmArgs args{};
    args.a = a.data_ptr();
    args.a_row_stride = a.stride(0);
    args.a_scales = a_scales.data_ptr<float>();
    args.a_scale_row_stride = a_scales.stride(0);
    args.a_scale_k_stride = a_scales.stride(1);
    args.b = b.data_ptr();
    args.b_row_stride = b.stride(1);
    args.b_expert_stride = b.stride(0);
    args.b_scales = b_scales.data_ptr<float>();
    args.b_scale_expert_stride = b_scales.stride(0);
    args.b_scale_row_stride = b_scales.stride(1);
    args.b_scale_k_stride = b_scales.stride(2);
    args.ends = ends_dense.data_ptr<int>();
    args.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
    args.out_row_stride = out.stride(0);
    args.num_rows = static_cast<int>(num_rows);
    args.depth = static_cast<int>(depth);
    args.n_out = static_cast<int>(n_out);
    args.num_experts = static_cast<int>(num_experts);
    const cudaError_t err = kernels::launch_fp8_grouped_gemm(args, c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, "fp8_grouped_mm: launch failed: ", cudaGetErrorString(err));
    return out;
}

}  // namespace

}  // namespace moe_ep

PYBIND11_MODULE(_fp8_gemm, m) {
    using moe_ep::fp8_grouped_mm;
    namespace kernels = moe_ep::kernels;
    m.doc() = "moe_ep grouped blockwise FP8 GEMM (sm_90a)";
    m.def("fp8_grouped_mm", &fp8_grouped_mm, py::arg("a"), py::arg("a_scales"), py::arg("b"), py::arg("b_scales"),
          py::arg("ends"),
          "Grouped e4m3 GEMM with 1x128 / 128x128 block scales: [N, K] x [E, N_OUT, K] -> [N, N_OUT] BF16; rows "
          "from ends[-1] on are zeros.");
    m.def("fp8_grouped_mm_supported", &kernels::fp8_grouped_gemm_supported,
          "Whether the grouped FP8 GEMM can run here (sm_90a build, TMA map encoder found).");
}
