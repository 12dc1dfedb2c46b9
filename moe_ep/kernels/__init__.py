"""Compute kernels, apart from the nn.Modules that use them.

* `grouped`: expert segments of an expert-major tensor, the BF16 grouped GEMMs over them, SwiGLU.
* `fp8_experts`: the experts' blockwise FP8 arithmetic, one class per implementation, and
  `fp8_backend`: the one that runs on a device, picked once per device.
* `fp8_casts`, `fp8_grouped_gemm` (FP8) and `permute_kernels` (the dispatcher's un-permute): Triton
  kernels, which also run in Triton's interpreter on the CPU; `fp8_grouped_gemm` and `fp8_casts` hand
  the operands they take to the CUDA kernels of `moe_ep._fp8`.
* `loaders`: imports of the optional compiled code on first use (Triton is optional and slow to import).
"""
