"""FP8 helpers: cast error bounds, power-of-two scales, UE8M0 packing, block casts."""

from __future__ import annotations

import pytest
import torch

from moe_ep.ops import fp8

E4M3_REL_STEP = 2.0 ** -3  # e4m3 keeps 3 mantissa bits: relative rounding error <= half a step


def _random(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, so per-token scaling matters.
    return torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[0])[:, None]


@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("hidden", [128, 384, 2944])
def test_per_token_cast_error_bound(hidden: int, round_scale: bool) -> None:
    x = _random((16, hidden), hidden)
    q, scales = fp8.per_token_cast_to_fp8(x, round_scale=round_scale)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (16, hidden // 128)
    back = fp8.per_token_cast_back(q, scales, torch.float32)
    blocks = x.view(16, -1, 128)
    amax = blocks.abs().amax(-1, keepdim=True)
    err = (back.view_as(blocks) - blocks).abs()
    # Normal range: half a step of the value; below it, half the smallest normal step times the scale.
    bound = torch.maximum(blocks.abs() * E4M3_REL_STEP / 2, scales[..., None] * 2.0 ** -9)
    assert (err <= bound * (1 + 1e-6)).all()
    assert (q.float().abs() <= 448).all()
    # The largest element of every block uses the top of the e4m3 range (unless the scale was rounded up).
    top = q.float().view_as(blocks).abs().amax(-1)
    assert (amax > 1e-4).all() and (top >= (224 if round_scale else 448)).all()
    if round_scale:
        assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))


def test_scale_formula_and_floor() -> None:
    x = torch.zeros(2, 256)
    x[0, 5] = -896.0  # amax 896 -> scale 2, q = -448
    x[1, 130] = 1e-9  # below the amax floor
    q, scales = fp8.per_token_cast_to_fp8(x)
    assert scales[0, 0] == 2.0 and q[0, 5].float() == -448.0
    assert scales[1, 1] == pytest.approx(1e-4 / 448, rel=1e-6)


def test_ue8m0_packing_round_trip() -> None:
    x = _random((8, 2944), 3)  # 23 groups: the last packed word is partly empty
    q, packed = fp8.per_token_cast_to_fp8(x, use_ue8m0=True)
    q_pow2, scales = fp8.per_token_cast_to_fp8(x, round_scale=True)
    assert packed.dtype == torch.int32 and packed.shape == (8, 6)
    assert torch.equal(q.view(torch.uint8), q_pow2.view(torch.uint8))
    assert torch.equal(fp8.unpack_ue8m0(packed)[:, :23], scales)
    assert (fp8.unpack_ue8m0(packed)[:, 23:] == 0).all()
    # Byte j of word i holds group 4i + j: check one by hand.
    exponent = int(scales[2, 9].view(torch.int32)) >> 23
    assert (int(packed[2, 2]) >> 8) & 0xFF == exponent
    assert torch.equal(fp8.per_token_cast_back(q, packed), fp8.per_token_cast_back(q_pow2, scales))


def test_per_token_cast_rejects_bad_hidden() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.per_token_cast_to_fp8(torch.randn(2, 200))


@pytest.mark.parametrize("shape", [(256, 384), (3, 200, 130)])
def test_block_cast_error_bound(shape: tuple[int, ...]) -> None:
    w = _random((shape[-2], shape[-1]), 7).expand(shape).contiguous()
    q, scales = fp8.per_block_cast_to_fp8(w)
    assert q.shape == w.shape
    assert scales.shape == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    back = fp8.per_block_cast_back(q, scales, torch.float32)
    expanded = scales.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :shape[-2], :shape[-1]]
    bound = torch.maximum(w.abs() * E4M3_REL_STEP / 2, expanded * 2.0 ** -9)
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()


def test_padded_segment_ends() -> None:
    counts = torch.tensor([5, 0, 128, 129, 256], dtype=torch.int32)
    assert fp8.padded_segment_ends(counts).tolist() == [128, 128, 256, 512, 768]
    assert fp8.padded_columns_bound(5 + 128 + 129 + 256, 5) >= 768


@pytest.mark.parametrize("block_scales", [False, True])
def test_per_column_segments_cast_layout(block_scales: bool) -> None:
    """Each segment transposed into its own 128-padded columns, zeros around it, cast along the tokens."""
    x = _random((300, 256), 7)
    starts, counts = torch.tensor([0, 140, 140, 150]), torch.tensor([140, 0, 10, 137])  # rows 287.. are junk
    x[287:] = float("nan")
    q, scales = fp8.per_column_segments_cast_to_fp8(x, starts, counts, block_scales=block_scales)
    assert q.shape == (256, fp8.padded_columns_bound(300, 4))
    assert scales.shape == ((2 if block_scales else 256), q.size(1) // 128)
    back = (fp8.per_block_cast_back if block_scales else fp8.per_token_cast_back)(q, scales, torch.float32)
    placed = [(0, 0, 140), (256, 140, 10), (384, 150, 137)]  # (first column, first row, rows)
    covered = torch.zeros(q.size(1), dtype=torch.bool)
    for column, row, rows in placed:
        want = x[row:row + rows].t()
        got = back[:, column:column + rows]
        assert ((got - want).abs() <= want.abs() * E4M3_REL_STEP / 2 + scales.max() * 2.0 ** -9).all()
        covered[column:column + rows] = True
    assert (q[:, ~covered].float() == 0).all()
    if not block_scales:  # one scale per feature per 128 tokens: the second block of segment 0 is 12 tokens
        assert torch.equal(scales[:, 1], fp8.per_token_cast_to_fp8(
            torch.nn.functional.pad(x[128:140].t(), (0, 116)))[1][:, 0])
