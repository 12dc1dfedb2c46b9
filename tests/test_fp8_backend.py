"""One FP8 implementation per device: the tier follows the GPU, Triton and the `moe_ep._fp8` build."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import moe_ep.kernels.fp8_backend as resolver
from moe_ep.kernels.fp8_experts import CublasFP8, ReferenceFP8, TritonFP8


@pytest.fixture(autouse=True)
def _fresh_caches():
    resolver._tier.cache_clear()
    resolver._backend.cache_clear()
    yield
    resolver._tier.cache_clear()
    resolver._backend.cache_clear()


def test_cpu_takes_the_reference_once() -> None:
    cpu = torch.device("cpu")
    assert resolver.fp8_tier(cpu) == "reference"
    backend = resolver.fp8_backend_for(cpu)
    assert type(backend) is ReferenceFP8 and resolver.fp8_backend_for("cpu") is backend
    assert not resolver.cuda_kernels_run(torch.zeros(1))


@pytest.mark.parametrize("capability, has_triton, has_extension, interpreted, tier", [
    ((9, 0), True, True, False, "cuda"),
    ((9, 0), True, False, False, "triton"),
    ((9, 0), True, True, True, "triton"),  # the interpreter never hands work to the compiled kernels
    ((10, 0), True, True, False, "triton"),
    ((9, 0), False, True, False, "cublas"),
    ((10, 0), False, False, False, "reference"),
    ((8, 0), True, True, False, "reference"),
])
def test_gpu_tiers(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], has_triton: bool,
                   has_extension: bool, interpreted: bool, tier: str) -> None:
    probes: list[torch.device] = []
    module = SimpleNamespace(INTERPRETED=interpreted)
    monkeypatch.setattr(resolver.torch.cuda, "get_device_capability", lambda d: probes.append(d) or capability)
    monkeypatch.setattr(resolver, "triton_kernels", lambda name: module if has_triton else None)
    monkeypatch.setattr(resolver, "fp8_extension", lambda: object() if has_extension else None)
    gpu = torch.device("cuda", 3)
    assert resolver.fp8_tier(gpu) == tier
    backend = resolver.fp8_backend_for(gpu)
    want = {"cuda": TritonFP8, "triton": TritonFP8, "cublas": CublasFP8, "reference": ReferenceFP8}[tier]
    assert type(backend) is want and resolver.fp8_backend_for(gpu) is backend
    if isinstance(backend, TritonFP8):
        assert backend.depth_gemm == (tier == "cuda") and backend.casts is module
    assert probes == [gpu]  # decided once per device


def test_aligned_rows_follows_the_strides() -> None:
    rows = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert resolver.aligned_rows(rows)
    assert resolver.aligned_rows(rows[:, :60])  # fewer columns, the same 128-byte row stride
    assert not resolver.aligned_rows(rows[:, 3:])  # a start 6 bytes in
    assert not resolver.aligned_rows(rows.t())
    assert not resolver.aligned_rows(torch.zeros(4, 12, dtype=torch.bfloat16))  # 24-byte rows
