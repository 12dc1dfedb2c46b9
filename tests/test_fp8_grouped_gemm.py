"""The Triton blockwise FP8 grouped GEMMs against float64 references of the dequantized math.

On a machine without CUDA the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set while
the kernel module is imported, as Triton decides at decoration time, and while each test runs); with
CUDA they are compiled and run on the GPU. Skipped without Triton.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest
import torch

pytest.importorskip("triton")

import moe_ep.layers.experts as experts_module  # noqa: E402
from moe_ep.layers import GroupedMLP  # noqa: E402
from moe_ep.ops import fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, K, M = 4, 256, 256
# Segment starts aligned to 16 rows as the dispatcher pads them; expert 1 receives nothing, and
# segments both shorter and longer than one row tile; 5 trailing rows belong to no expert.
COUNTS = [48, 0, 80, 16]
NUM_ROWS = sum(COUNTS) + 5
BF16_REL = 1e-2  # outputs round to BF16 (2**-8 relative at most); FP32 accumulation adds next to nothing


def _import_gemm_module() -> ModuleType:
    name = "moe_ep.layers.fp8_grouped_gemm"
    if DEVICE == "cuda":
        return importlib.import_module(name)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


gemm = _import_gemm_module()


@pytest.fixture(autouse=True)
def _interpret(monkeypatch) -> None:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ends(counts: list[int] = COUNTS) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE)


def per_expert(a: torch.Tensor, b: torch.Tensor, counts: list[int] = COUNTS) -> torch.Tensor:
    """float64 `a[rows of e] @ b[e]` on the valid rows only."""
    parts, begin = [], 0
    for e, count in enumerate(counts):
        parts.append(a[begin:begin + count] @ b[e])
        begin += count
    return torch.cat(parts)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16
    got = got.double().cpu()
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < BF16_REL
    # Elementwise: one BF16 ulp (the interpreter truncates to BF16 where the GPU rounds to nearest)
    # plus a little FP32 accumulation error.
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-4 * float(want.abs().max()))


def fp8_operands(seed: int, num_rows: int, depth: int, width: int):
    """Quantized random activations `[num_rows, depth]` and weights `[E, width, depth]`."""
    g = generator(seed)
    x = torch.randn(num_rows, depth, generator=g)
    w = torch.randn(E, width, depth, generator=g) / depth ** 0.5
    # Scale magnitudes that differ per block, so a misplaced scale cannot go unnoticed.
    x = x * torch.rand(num_rows, depth // fp8.BLOCK, generator=g).repeat_interleave(fp8.BLOCK, -1) * 4
    w = w * torch.rand(E, width // fp8.BLOCK, depth // fp8.BLOCK, generator=g).repeat_interleave(
        fp8.BLOCK, -2).repeat_interleave(fp8.BLOCK, -1) * 4
    return fp8.per_token_cast_to_fp8(x), fp8.per_block_cast_to_fp8(w)


def test_forward_matches_dequantized_float64() -> None:
    (qa, sa), (qw, sw) = fp8_operands(0, NUM_ROWS, K, M)
    out = gemm.fp8_grouped_mm(qa.to(DEVICE), sa.to(DEVICE), qw.to(DEVICE), sw.to(DEVICE), ends())
    assert out.shape == (NUM_ROWS, M)
    a = fp8.per_token_cast_back(qa, sa, torch.float64)
    w = fp8.per_block_cast_back(qw, sw, torch.float64)
    assert_bf16_close(out[:sum(COUNTS)], per_expert(a, w.transpose(-2, -1)))


def test_dgrad_matches_dequantized_float64() -> None:
    # The forward maps K -> M; its input gradient maps M-wide gradients back to K.
    (qg, sg), (qw, sw) = fp8_operands(1, NUM_ROWS, M, K)
    qw, sw = qw.transpose(-2, -1).contiguous(), sw.transpose(-2, -1).contiguous()  # [E, M, K] weights
    dx = gemm.fp8_grouped_dgrad(qg.to(DEVICE), sg.to(DEVICE), qw.to(DEVICE), sw.to(DEVICE), ends())
    assert dx.shape == (NUM_ROWS, K)
    g = fp8.per_token_cast_back(qg, sg, torch.float64)
    w = fp8.per_block_cast_back(qw, sw, torch.float64)
    assert_bf16_close(dx[:sum(COUNTS)], per_expert(g, w))


@pytest.mark.skipif(DEVICE == "cuda", reason="pins interpreter tiles; the GPU autotunes its own")
@pytest.mark.parametrize("block_m, block_n", [(128, 128), (64, 128), (16, 64)])
def test_forward_with_each_tile_shape(monkeypatch, block_m: int, block_n: int) -> None:
    """The GPU's tiles (and one smaller than a segment) index rows, experts and scales alike."""
    kernel = gemm._grouped_mm_kernel.fn

    class Pinned:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: kernel[grid](*args, **kwargs, BLOCK_M=block_m, BLOCK_N=block_n)

    monkeypatch.setattr(gemm, "_grouped_mm_kernel", Pinned())
    counts = [48, 0, 160, 16]  # expert 2 spans two 128-row tiles
    (qa, sa), (qw, sw) = fp8_operands(2, sum(counts), K, M)
    out = gemm.fp8_grouped_mm(qa, sa, qw, sw, ends(counts))
    a = fp8.per_token_cast_back(qa, sa, torch.float64)
    w = fp8.per_block_cast_back(qw, sw, torch.float64)
    assert_bf16_close(out, per_expert(a, w.transpose(-2, -1), counts))


def test_rejects_misshapen_operands() -> None:
    (qa, sa), (qw, sw) = fp8_operands(3, 16, K, M)
    with pytest.raises(ValueError, match="scales"):
        gemm.fp8_grouped_mm(qa, sa[:, :1], qw, sw, ends([16, 0, 0, 0]))
    with pytest.raises(ValueError, match="ends"):
        gemm.fp8_grouped_mm(qa, sa, qw, sw, ends([16, 0, 0, 0]).long())
    with pytest.raises(TypeError):
        gemm.fp8_grouped_mm(qa.float(), sa, qw, sw, ends([16, 0, 0, 0]))


def test_grouped_mlp_fp8_path_through_the_triton_kernels(monkeypatch) -> None:
    """GroupedMLP's FP8 path with the Triton GEMMs (forced on CPU) against its reference path.

    Both round at the same points, but a BF16 ulp of difference in the gate/up output (here the
    interpreter's truncation) flips some e4m3 roundings of the SwiGLU output, each worth 6%: a few
    percent in every result. Input gradients also see the e4m3 cast of the output gradient."""
    hidden, inter = 256, 128
    torch.manual_seed(0)
    module = GroupedMLP(E, hidden, inter, use_fp8=True, dtype=torch.bfloat16, device=DEVICE)
    x = torch.randn(NUM_ROWS, hidden, generator=generator(4)).to(DEVICE, torch.bfloat16)
    upstream = torch.randn(NUM_ROWS, hidden, generator=generator(5)).to(DEVICE, torch.bfloat16)
    counts = torch.tensor(COUNTS, device=DEVICE)

    def run(triton_on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(experts_module, "_triton_fp8_available", lambda device: triton_on)
        monkeypatch.setattr(experts_module, "_triton_fp8_gemms", lambda: gemm)
        module.zero_grad()
        rows = x.clone().requires_grad_()
        out = module(rows, counts)
        out.backward(upstream)
        return [t.detach().double().cpu() for t in (out, rows.grad, module.gate_up_proj.grad, module.down_proj.grad)]

    got, want = run(True), run(False)
    valid = sum(COUNTS)
    for name, g, w, bound in zip(("out", "dx", "dgate_up", "ddown"), got, want, (0.05, 0.08, 0.08, 0.05)):
        assert torch.isfinite(g).all(), name
        assert float((g - w).norm() / w.norm()) <= bound, name
    assert got[0][valid:].abs().sum() == 0 and got[1][valid:].abs().sum() == 0
