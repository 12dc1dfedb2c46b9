"""The CUDA kernels of `moe_ep._fp8`.

The blockwise FP8 grouped GEMM (wgmma) at expert-sized shapes: against float64 references of the
dequantized math and against the Triton kernel, on skewed segments with empty experts, garbage past
the last segment, depths that wrap the shared-memory ring many times, more tiles than SMs (every
persistent block walks several, its shared-memory ring running on from one tile into the next), and
strided operands. The weight cast with its transposed copy: bit for bit the reference and the Triton kernel."""

from __future__ import annotations

import pytest
import torch

import test_fp8_grouped_gemm as cpu
from moe_ep.kernels.loaders import fp8_extension
from moe_ep.ops import fp8

gemm = cpu.gemm
casts = cpu.casts
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
    or fp8_extension() is None,
    reason="needs an sm_90 GPU and moe_ep._fp8 built for sm_90a")


def skewed_counts(num_experts: int, rows: int, seed: int) -> list[int]:
    """Uneven rows per expert (some experts get none), each padded to 16 as the dispatcher does."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.rand(num_experts, generator=g) ** 3
    popularity[torch.randperm(num_experts, generator=g)[: num_experts // 4]] = 0
    counts = torch.multinomial(popularity, rows, replacement=True, generator=g).bincount(minlength=num_experts)
    return [int(c + (-c) % 16) for c in counts]


def operands(seed: int, counts: list[int], depth: int, width: int, tail: int):
    (qa, sa), (qw, sw) = cpu.fp8_operands(seed, sum(counts) + tail, depth, width, experts=len(counts))
    qa, sa, qw, sw = (t.cuda() for t in (qa, sa, qw, sw))
    # Rows past the last segment hold NaN codes and NaN scales: none may leak into the outputs.
    qa[sum(counts):] = torch.tensor(0x7F, dtype=torch.uint8).view(fp8.FP8_DTYPE)
    sa[sum(counts):] = float("nan")
    return qa, sa, qw, sw, cpu.ends(counts).cuda()


@pytest.mark.parametrize("num_experts, rows, depth, width", [
    (8, 1000, 2048, 512),    # 16 K blocks: the stage ring wraps 3 times; 256-column tiles
    (16, 3000, 7168, 256),   # the gate/up projection's depth: 56 K blocks
    (5, 700, 512, 1024),     # fewer K blocks than stages, many column tiles
    (7, 900, 1536, 640),     # 128-column tiles (640 is no multiple of 256), 12 K blocks
    (1, 130, 128, 128),      # one expert, one K block, a segment one row past a tile
    # More tiles than SMs (132 on an H100): 336 and 297 tiles with rows, several per block,
    # K blocks no multiple of the stage count (5 against 4 stages, 7 against 6), empty experts and
    # the zero tail among them.
    (12, 10000, 640, 1024),
    (9, 12000, 896, 384),    # 128-column tiles
])
def test_matches_float64_reference_and_triton(num_experts: int, rows: int, depth: int, width: int) -> None:
    counts = skewed_counts(num_experts, rows, seed=depth + width)
    qa, sa, qw, sw, ends = operands(num_experts, counts, depth, width, tail=37)
    got = gemm.fp8_grouped_mm(qa, sa, qw, sw, ends, backend="cuda")
    a, w = cpu.dequantized((qa.cpu(), sa.cpu()), (qw.cpu(), sw.cpu()))
    cpu.assert_bf16_close(got, a.nan_to_num(), w.transpose(-2, -1), counts)
    triton_out = gemm.fp8_grouped_mm(qa, sa, qw, sw, ends, backend="triton")
    valid = slice(0, sum(counts))
    # Both sum each 128-deep block on the tensor cores and scale it in FP32: at most one BF16 ulp apart.
    ulp = 2.0 ** -7 * triton_out[valid].float().abs()
    assert ((got[valid].float() - triton_out[valid].float()).abs() <= ulp).all()
    assert torch.equal(got, gemm.fp8_grouped_mm(qa, sa, qw, sw, ends, backend="cuda")), "not deterministic"


def test_every_expert_empty_gives_zeros() -> None:
    qa, sa, qw, sw, ends = operands(0, [0, 0, 0], 256, 256, tail=200)
    assert (gemm.fp8_grouped_mm(qa, sa, qw, sw, ends, backend="cuda") == 0).all()


def test_dgrad_layout_and_strided_scales() -> None:
    """The input-gradient call as the experts make it: the transposed weight copy and transposed
    (non-contiguous) weight scales, row-adjacent activation scales in a column-major buffer."""
    counts = skewed_counts(6, 900, seed=3)
    (qg, sg), _ = cpu.fp8_operands(7, sum(counts), 768, 128, experts=1)  # gradients [N, M]
    _, (qw, sw) = cpu.fp8_operands(8, 16, 1024, 768, experts=6)          # weights [E, M, K]
    weight = fp8.per_block_cast_back(qw, sw, torch.float32).cuda()
    qw, sw, qw_t = cpu.casts.per_block_cast_to_fp8_with_transpose(weight)
    sg = sg.cuda().t().contiguous().t()
    ends = cpu.ends(counts).cuda()
    got = gemm.fp8_grouped_mm(qg.cuda(), sg, qw_t, sw.transpose(-2, -1), ends, backend="cuda")
    g, w = cpu.dequantized((qg, sg.cpu()), (qw.cpu(), sw.cpu()))
    cpu.assert_bf16_close(got, g, w, counts)


def test_operands_tma_cannot_read_fall_back_to_triton() -> None:
    """A weight whose K is not contiguous: "auto" takes the Triton kernel, "cuda" refuses."""
    counts = [64, 32]
    qa, sa, qw, sw, ends = operands(1, counts, 256, 128, tail=0)
    strided = qw.transpose(-2, -1).contiguous().transpose(-2, -1)
    assert not gemm.cuda_kernel_runs(qa, strided)
    with pytest.raises(RuntimeError, match="backend='cuda'"):
        gemm.fp8_grouped_mm(qa, sa, strided, sw, ends, backend="cuda")
    assert torch.equal(gemm.fp8_grouped_mm(qa, sa, strided, sw, ends),
                       gemm.fp8_grouped_mm(qa, sa, qw, sw, ends, backend="triton"))


def weight(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """BF16 weights with an all-zero block (the amax floor) and a huge value in the last block."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w[..., :fp8.BLOCK, :fp8.BLOCK] = 0.0
    w[..., -1, -1] = 3e4
    return w.to(torch.bfloat16).cuda()


@pytest.mark.parametrize("shape", [(4, 512, 1024), (2, 3, 256, 384), (128, 128), (1, 4096, 7168)])
def test_cuda_weight_cast_is_bitwise_the_reference(shape: tuple[int, ...]) -> None:
    w = weight(shape, seed=len(shape))
    assert casts.cuda_weight_cast_runs(w)
    q, scales, q_t = casts.per_block_cast_to_fp8_with_transpose(w, backend="cuda")
    want_q, want_scales = fp8.per_block_cast_to_fp8(w)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    assert q_t.is_contiguous() and q_t.shape == (*shape[:-2], shape[-1], shape[-2])
    assert torch.equal(q_t.view(torch.uint8), want_q.transpose(-2, -1).view(torch.uint8))
    for got, triton_out in zip((q, scales, q_t), casts.per_block_cast_to_fp8_with_transpose(w, backend="triton")):
        assert torch.equal(got.view(torch.uint8), triton_out.view(torch.uint8))


def test_cuda_weight_cast_reads_strided_matrices() -> None:
    """Rows 128..383 of every matrix: the matrix stride is not rows x cols."""
    big = weight((3, 512, 256), seed=5)
    w = big[:, 128:384]
    q, scales, q_t = casts.per_block_cast_to_fp8_with_transpose(w, backend="cuda")
    want_q, want_scales = fp8.per_block_cast_to_fp8(w.contiguous())
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    assert torch.equal(q_t.view(torch.uint8), want_q.transpose(-2, -1).contiguous().view(torch.uint8))


def test_cuda_weight_cast_falls_back_or_refuses() -> None:
    """Shapes or layouts the kernel cannot take go to Triton under "auto" and raise under "cuda"."""
    for w in (weight((200, 256), seed=6), weight((256, 256), seed=7).t(), weight((256, 256), seed=8).float()):
        assert not casts.cuda_weight_cast_runs(w)
        with pytest.raises(RuntimeError, match="backend='cuda'"):
            casts.per_block_cast_to_fp8_with_transpose(w, backend="cuda")
        q, scales, _ = casts.per_block_cast_to_fp8_with_transpose(w)
        want_q, want_scales = fp8.per_block_cast_to_fp8(w)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_scales)


def column_operands(seed: int, counts: list[int], width_a: int, width_b: int):
    """The weight-gradient GEMM's operands as the experts make them: random BF16 output gradients and
    e4m3 activations, cast along the tokens of each expert's segment on the GPU."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    grad = (torch.randn(rows, width_a, generator=g) * torch.logspace(-2, 2, rows)[:, None]).bfloat16().cuda()
    x = fp8.per_token_cast_to_fp8(torch.randn(rows, width_b, generator=g) * 3)
    x = (x[0].cuda(), x[1].cuda())
    lengths = torch.tensor(counts, dtype=torch.int32).cuda()
    starts = lengths.cumsum(0, dtype=torch.int32) - lengths
    padded_ends = fp8.padded_segment_ends(lengths)
    a = casts.per_column_segments_cast_to_fp8(grad, None, starts, lengths, padded_ends, block_scales=False)
    b = casts.per_column_segments_cast_to_fp8(*x, starts, lengths, padded_ends, block_scales=True)
    return a, b, padded_ends


@pytest.mark.parametrize("counts, width_a, width_b", [
    ([300, 0, 128, 1, 900, 64], 512, 768),  # empty, one-row, exact-tile and 8-block segments
    ([2000, 16, 48], 256, 1024),            # 16 K blocks: the stage ring wraps
    ([0, 0], 128, 256),                     # no tokens at all: zero gradients
    ([130] * 12, 384, 640),                 # 128-column tiles (640 is no multiple of 256)
    # 336 tiles (more than SMs), experts without columns between the others, and 6, 3, 10 and 1 K
    # blocks against 4 stages.
    ([700, 0, 300, 0, 0, 1200, 5], 1024, 1536),
])
def test_depth_grouped_gemm_matches_float64_reference(counts: list[int], width_a: int, width_b: int) -> None:
    (qa, sa), (qb, sb), padded_ends = column_operands(len(counts) + width_a, counts, width_a, width_b)
    got = gemm.fp8_depth_grouped_mm(qa, sa, qb, sb, padded_ends)
    assert got.shape == (len(counts), width_a, width_b) and got.dtype == torch.bfloat16
    a = fp8.per_token_cast_back(qa.cpu(), sa.cpu(), torch.float64)
    b = fp8.per_block_cast_back(qb.cpu(), sb.cpu(), torch.float64)
    bounds = [0] + padded_ends.tolist()
    for e in range(len(counts)):
        columns = slice(bounds[e], bounds[e + 1])
        want = a[:, columns] @ b[:, columns].t()
        if counts[e] == 0:
            assert (got[e] == 0).all()
            continue
        # One BF16 ulp, plus the tensor cores' ~14-bit sums inside each 128-deep block (as the
        # forward GEMM's test bounds them).
        bound = 2 ** -7 * want.abs() + 2 ** -12 * (a[:, columns].abs() @ b[:, columns].abs().t())
        assert ((got[e].double().cpu() - want).abs() <= bound).all(), e
    assert torch.equal(got, gemm.fp8_depth_grouped_mm(qa, sa, qb, sb, padded_ends)), "not deterministic"


def test_weight_grad_on_the_gpu_matches_the_reference_path(monkeypatch) -> None:
    """The FP8 weight gradient on the CUDA kernels against its CPU reference on the same inputs."""
    from moe_ep.kernels.fp8_backend import fp8_backend_for
    from moe_ep.kernels.grouped import ExpertSegments
    counts = [272, 0, 48, 1040, 16]
    g = torch.Generator().manual_seed(11)
    grad = torch.randn(sum(counts) + 32, 256, generator=g).bfloat16()
    x = fp8.per_token_cast_to_fp8(torch.randn(sum(counts) + 32, 512, generator=g))
    seg_args = (torch.tensor(counts, dtype=torch.int32), sum(counts) + 32)
    got = fp8_backend_for(torch.device("cuda")).weight_grad(grad.cuda(), (x[0].cuda(), x[1].cuda()),
                                                            ExpertSegments(seg_args[0].cuda(), seg_args[1]))
    want = fp8_backend_for(torch.device("cpu")).weight_grad(grad, x, ExpertSegments(*seg_args))
    assert got.shape == want.shape == (len(counts), 256, 512)
    # The same casts (Triton against the reference, bit for bit elsewhere); FP32 products summed in
    # another order and both rounded to BF16.
    assert float((got.cpu().double() - want.double()).norm() / want.double().norm()) < 4e-3
    assert (got[1] == 0).all()
