"""Loading Triton kernel modules for tests: compiled with CUDA, else run in Triton's interpreter.

Triton decides between compiling and interpreting when a function is decorated, its own library
functions (`tl.max`, ...) included, so without CUDA both Triton and the kernel module are imported
with `TRITON_INTERPRET=1`; `interpret_without_cuda` keeps the variable set while a test runs, as
Triton's runtime reads it too. Test modules using them are skipped without Triton.
"""

from __future__ import annotations

import importlib
import os
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Iterator

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@contextmanager
def _interpreting() -> Iterator[None]:
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def import_kernels(name: str) -> ModuleType:
    """Module `name`, compiled for the GPU, or interpreted on a machine without CUDA."""
    if DEVICE == "cuda":
        pytest.importorskip("triton")
        return importlib.import_module(name)
    with _interpreting():
        triton = pytest.importorskip("triton")
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(triton.language.max, InterpretedFunction):
            pytest.skip("triton was imported before its interpreter was enabled: run with TRITON_INTERPRET=1",
                        allow_module_level=True)
        return importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)


def interpret_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
