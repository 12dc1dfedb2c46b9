"""The blockwise FP8 grouped GEMM against float64 references of the dequantized math.

The Triton kernel compiled on a GPU, in Triton's interpreter elsewhere (see `triton_kernels`), and
the CUDA kernel of `moe_ep._fp8` where it runs. Skipped without Triton.
"""

from __future__ import annotations

import pytest
import torch

import moe_ep.layers.experts as experts_module
from moe_ep.kernels.fp8_experts import ReferenceFP8, TritonFP8
from moe_ep.kernels.loaders import fp8_extension
from moe_ep.layers import GroupedMLP
from moe_ep.ops import fp8
from triton_kernels import DEVICE, import_kernels, interpret_without_cuda

gemm = import_kernels("moe_ep.kernels.fp8_grouped_gemm")
casts = import_kernels("moe_ep.kernels.fp8_casts")
triton = pytest.importorskip("triton")

E, K, M = 4, 256, 256
# Segment starts aligned to 16 rows as the dispatcher pads them; expert 1 receives nothing, and
# segments both shorter and longer than one row tile; 5 trailing rows belong to no expert.
COUNTS = [48, 0, 80, 16]
NUM_ROWS = sum(COUNTS) + 5
BF16_REL = 1e-2  # outputs round to BF16 (2**-8 relative at most); FP32 accumulation adds next to nothing


@pytest.fixture(autouse=True)
def _interpret(monkeypatch) -> None:
    interpret_without_cuda(monkeypatch)


@pytest.fixture(params=["triton", "cuda"])
def backend(request) -> str:
    """Each implementation of `fp8_grouped_mm`; the CUDA one needs an sm_90a build on an sm_90 GPU."""
    if request.param == "cuda" and (DEVICE != "cuda" or fp8_extension() is None
                                    or torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("the moe_ep._fp8 FP8 GEMM runs on sm_90 GPUs with an sm_90a build only")
    return request.param


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


def assert_bf16_close(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, counts: list[int] = COUNTS) -> None:
    """`got` (BF16) against the float64 `a[rows of e] @ b[e]` on the valid rows, zeros past them."""
    assert got.dtype == torch.bfloat16
    assert (got[sum(counts):] == 0).all(), "rows past the last segment must be zeros"
    if sum(counts) == 0:
        return
    got = got[:sum(counts)].double().cpu()
    want = per_expert(a, b, counts)
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < BF16_REL
    # One BF16 ulp (the interpreter truncates where the GPU rounds to nearest), plus Hopper's FP8
    # tensor cores summing each 128-deep block with ~14 mantissa bits: error relative to sum |products|.
    bound = 2 ** -7 * want.abs() + 2 ** -12 * per_expert(a.abs(), b.abs(), counts)
    excess = (got - want).abs() - bound
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} elements off, worst by {float(excess.max()):.3g}"


def fp8_operands(seed: int, num_rows: int, depth: int, width: int, experts: int = E):
    """Quantized random activations `[num_rows, depth]` and weights `[experts, width, depth]`."""
    g = generator(seed)
    x = torch.randn(num_rows, depth, generator=g)
    w = torch.randn(experts, width, depth, generator=g) / depth ** 0.5
    # Scale magnitudes that differ per block, so a misplaced scale cannot go unnoticed.
    x = x * torch.rand(num_rows, depth // fp8.BLOCK, generator=g).repeat_interleave(fp8.BLOCK, -1) * 4
    w = w * torch.rand(experts, width // fp8.BLOCK, depth // fp8.BLOCK, generator=g).repeat_interleave(
        fp8.BLOCK, -2).repeat_interleave(fp8.BLOCK, -1) * 4
    return fp8.per_token_cast_to_fp8(x), fp8.per_block_cast_to_fp8(w)


def dequantized(rows: tuple[torch.Tensor, torch.Tensor], weights: tuple[torch.Tensor, torch.Tensor]):
    return (fp8.per_token_cast_back(*rows, torch.float64),
            fp8.per_block_cast_back(*weights, torch.float64))


def test_forward_matches_dequantized_float64(backend: str) -> None:
    (qa, sa), (qw, sw) = fp8_operands(0, NUM_ROWS, K, M)
    out = gemm.fp8_grouped_mm(qa.to(DEVICE), sa.to(DEVICE), qw.to(DEVICE), sw.to(DEVICE), ends(), backend=backend)
    assert out.shape == (NUM_ROWS, M)
    a, w = dequantized((qa, sa), (qw, sw))
    assert_bf16_close(out, a, w.transpose(-2, -1))


def test_dgrad_is_the_forward_against_the_transposed_weight(backend: str) -> None:
    """The input gradient `grad @ W[e]` as experts run it: the fused cast's transposed weight and
    row-adjacent gradient scales, through the forward kernel."""
    (qg, sg), (qw, sw) = fp8_operands(1, NUM_ROWS, M, K)  # gradients [N, M], weights [E, M, K]
    weight = fp8.per_block_cast_back(qw, sw, torch.float32)
    qw, sw, qw_t = casts.per_block_cast_to_fp8_with_transpose(weight.to(DEVICE))
    qg, sg = casts.per_token_cast_to_fp8(fp8.per_token_cast_back(qg, sg, torch.float32).to(DEVICE))
    dx = gemm.fp8_grouped_mm(qg, sg, qw_t, sw.transpose(-2, -1), ends(), backend=backend)
    assert dx.shape == (NUM_ROWS, K)
    g, w = dequantized((qg.cpu(), sg.cpu()), (qw.cpu(), sw.cpu()))
    assert_bf16_close(dx, g, w)


# The GPU's tile shapes (BLOCK_M, BLOCK_N, SPLIT_N), also two column blocks in one scale block, and
# one smaller than a segment.
TILES = [(128, 128, 1), (64, 128, 1), (16, 64, 1), (64, 128, 2), (16, 64, 2)]


@pytest.mark.parametrize("block_m, block_n, split_n", TILES)
def test_forward_with_each_tile_shape(block_m: int, block_n: int, split_n: int) -> None:
    """Every tile indexes rows, experts and scales alike (expert 2 spans two 128-row tiles)."""
    counts = [48, 0, 160, 16]
    (qa, sa), (qw, sw) = fp8_operands(2, sum(counts), K, M)
    config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_N": split_n},
                           num_warps=4 if block_m < 128 else 8, num_stages=3)
    out = gemm.fp8_grouped_mm(qa.to(DEVICE), sa.to(DEVICE), qw.to(DEVICE), sw.to(DEVICE), ends(counts),
                              config=config)
    a, w = dequantized((qa, sa), (qw, sw))
    assert_bf16_close(out, a, w.transpose(-2, -1), counts)


@pytest.mark.parametrize("counts", [[0, 64, 0], [32], [0, 0, 0, 0, 16], [0, 0]])
def test_forward_segment_edge_cases(counts: list[int], backend: str) -> None:
    """Leading, trailing and all-empty experts, one expert, expert counts that are not powers of two."""
    num_rows = sum(counts) + 3
    (qa, sa), (qw, sw) = fp8_operands(5, num_rows, K, 128, experts=len(counts))
    out = gemm.fp8_grouped_mm(qa.to(DEVICE), sa.to(DEVICE), qw.to(DEVICE), sw.to(DEVICE), ends(counts),
                              backend=backend)
    assert out.shape == (num_rows, 128)
    a, w = dequantized((qa, sa), (qw, sw))
    assert_bf16_close(out, a, w.transpose(-2, -1), counts)


def test_rejects_misshapen_operands() -> None:
    (qa, sa), (qw, sw) = fp8_operands(3, 16, K, M)
    with pytest.raises(ValueError, match="scales"):
        gemm.fp8_grouped_mm(qa, sa[:, :1], qw, sw, ends([16, 0, 0, 0]))
    with pytest.raises(ValueError, match="ends"):
        gemm.fp8_grouped_mm(qa, sa, qw, sw, ends([16, 0, 0, 0]).long())
    with pytest.raises(TypeError):
        gemm.fp8_grouped_mm(qa.float(), sa, qw, sw, ends([16, 0, 0, 0]))
    with pytest.raises(ValueError, match="config"):
        gemm.fp8_grouped_mm(qa, sa, qw[:, :128], sw[:, :1], ends([16, 0, 0, 0]),
                            config=triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "SPLIT_N": 2}))
    with pytest.raises(ValueError, match="backend"):
        gemm.fp8_grouped_mm(qa, sa, qw, sw, ends([16, 0, 0, 0]), backend="cutlass")
    if not gemm.cuda_kernel_runs(qa, qw):
        with pytest.raises(RuntimeError, match="backend='cuda'"):
            gemm.fp8_grouped_mm(qa, sa, qw, sw, ends([16, 0, 0, 0]), backend="cuda")


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
        fp8 = TritonFP8(casts, gemm, depth_gemm=False) if triton_on else ReferenceFP8()
        monkeypatch.setattr(experts_module, "fp8_backend_for", lambda device: fp8)
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


def test_grouped_mlp_recasts_once_weight_caching_is_off(monkeypatch) -> None:
    """Turning `cache_fp8_weights` off (as benchmarks do between runs) stops reusing earlier casts."""
    casts_made = []
    original = ReferenceFP8.cast_weight
    monkeypatch.setattr(ReferenceFP8, "cast_weight", lambda self, w: casts_made.append(w) or original(self, w))
    module = GroupedMLP(E, 256, 128, use_fp8=True, cache_fp8_weights=True, dtype=torch.bfloat16)
    module._fp8_weights()
    module._fp8_weights()
    assert len(casts_made) == 2
    module.cache_fp8_weights = False
    module._fp8_weights()
    assert len(casts_made) == 4 and module._fp8_weight_cache is None
