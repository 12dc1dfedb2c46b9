"""Which FP8 implementation runs on a device, decided once per device.

Tiers, best first:
  "cuda"      an sm_90 GPU with `moe_ep._fp8` built for sm_90a, and Triton: `TritonFP8` whose GEMMs and
              weight cast run the `moe_ep._fp8` kernels wherever they take the operands (`aligned_rows`),
              Triton elsewhere, and whose FP8 weight gradients run its depth-grouped GEMM;
  "triton"    another sm_90+ GPU with Triton: `TritonFP8` on the Triton kernels alone;
  "cublas"    an sm_90 GPU without Triton, where torch has blockwise `F.scaled_mm`: `CublasFP8`;
  "reference" anything else (CPU, older GPUs): `ReferenceFP8`.
Triton's interpreter (`TRITON_INTERPRET=1`) runs the Triton kernels on the CPU, never the CUDA ones.
"""

from __future__ import annotations

from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F

from .fp8_experts import CublasFP8, ReferenceFP8, TritonFP8
from .loaders import fp8_extension, triton_kernels

Tier = Literal["cuda", "triton", "cublas", "reference"]


def _device_key(device: torch.device) -> torch.device:
    """`device` with its index, so that `cuda` and `cuda:<current>` share one cache entry."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@cache
def _tier(device: torch.device) -> Tier:
    if device.type != "cuda":
        return "reference"
    capability = torch.cuda.get_device_capability(device)
    casts, gemm = triton_kernels("fp8_casts"), triton_kernels("fp8_grouped_gemm")
    if casts is not None and gemm is not None and capability >= (9, 0):
        compiled = capability == (9, 0) and not gemm.INTERPRETED and fp8_extension() is not None
        return "cuda" if compiled else "triton"
    # Blockwise (1x128 / 128x128) scaling in cuBLAS exists for sm_90 only.
    if capability == (9, 0) and hasattr(F, "scaled_mm"):
        return "cublas"
    return "reference"


def fp8_tier(device: torch.device) -> Tier:
    """The FP8 tier of `device` (see the module docstring)."""
    return _tier(_device_key(torch.device(device)))


@cache
def _backend(device: torch.device) -> ReferenceFP8:
    tier = _tier(device)
    if tier in ("cuda", "triton"):
        return TritonFP8(triton_kernels("fp8_casts"), triton_kernels("fp8_grouped_gemm"), depth_gemm=tier == "cuda")
    return CublasFP8() if tier == "cublas" else ReferenceFP8()


def fp8_backend_for(device: torch.device) -> ReferenceFP8:
    """The FP8 implementation for tensors on `device`, the same object for every call on it."""
    return _backend(_device_key(torch.device(device)))


def cuda_kernels_run(t: torch.Tensor) -> bool:
    """Whether the `moe_ep._fp8` kernels can take `t`'s device (the "cuda" tier)."""
    return t.is_cuda and fp8_tier(t.device) == "cuda"


def aligned_rows(t: torch.Tensor, granule_bytes: int = 16) -> bool:
    """Innermost dimension contiguous; start and every other stride in `granule_bytes` multiples: what
    the `moe_ep._fp8` kernels' TMA loads need."""
    return (t.stride(-1) == 1 and t.data_ptr() % granule_bytes == 0
            and all(s * t.element_size() % granule_bytes == 0 for s in t.stride()[:-1]))
