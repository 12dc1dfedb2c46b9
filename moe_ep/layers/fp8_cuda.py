"""The compiled FP8 expert kernels (`moe_ep._fp8`: the grouped blockwise GEMM and the weight cast),
and whether they can run here. Built for sm_90a only; the Triton kernels stand in elsewhere."""

from __future__ import annotations

import importlib
import os
from functools import cache
from types import ModuleType
from typing import Optional

import torch

TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether Triton runs in its interpreter (`TRITON_INTERPRET=1`, CPU): no compiled kernel is used then."""


@cache
def fp8_extension() -> Optional[ModuleType]:
    """`moe_ep._fp8` when it is built and runnable here (sm_90a build, TMA map encoder), else None."""
    try:
        ext = importlib.import_module("moe_ep._fp8")
    except ImportError:
        return None
    return ext if ext.fp8_grouped_mm_supported() else None


def runs_on(t: torch.Tensor) -> bool:
    """Whether the kernels can take `t`'s device (an sm_90 GPU, outside Triton's interpreter)."""
    return (t.is_cuda and not TRITON_INTERPRETED and torch.cuda.get_device_capability(t.device) == (9, 0)
            and fp8_extension() is not None)


def aligned_rows(t: torch.Tensor, granule_bytes: int = 16) -> bool:
    """Innermost dimension contiguous; start and every other stride in `granule_bytes` multiples."""
    return (t.stride(-1) == 1 and t.data_ptr() % granule_bytes == 0
            and all(s * t.element_size() % granule_bytes == 0 for s in t.stride()[:-1]))
