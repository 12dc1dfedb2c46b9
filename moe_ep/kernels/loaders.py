"""Loading optional compiled code on first use: the `moe_ep._fp8` extension and the Triton kernel modules."""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType
from typing import Optional


@cache
def fp8_extension() -> Optional[ModuleType]:
    """`moe_ep._fp8` (the CUDA FP8 grouped GEMMs and weight cast) when it is built and runnable here
    (an sm_90a build, a TMA map encoder), else None."""
    try:
        ext = importlib.import_module("moe_ep._fp8")
    except ImportError:
        return None
    return ext if ext.fp8_grouped_mm_supported() else None


@cache
def triton_kernels(name: str) -> Optional[ModuleType]:
    """The Triton kernel module `moe_ep.kernels.<name>`, imported on first use (Triton is optional
    and slow to import), or None without Triton."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None


def interpreted(kernel: object) -> bool:
    """Whether the Triton function `kernel` runs in Triton's interpreter (CPU), which Triton decides
    when the function is decorated (`TRITON_INTERPRET=1` at that time)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)
