"""FP8 (e4m3) casts with fine-grained scales: the reference the CUDA kernels are checked against.

Activations use one scale per token per 128 channels (1x128); weights use one scale per 128x128
block. A scale is stored as its inverse multiplier ("scale_inv"): `value ~= fp8 * scale`.

The arithmetic, in float32, is fixed so kernels can reproduce it bit for bit:

    amax  = max(max|x| over the block, 1e-4)
    scale = amax / 448                       (round_scale: 2 ** ceil(log2(amax / 448)))
    q     = saturate_e4m3(x * (1 / scale))    (round to nearest even)

UE8M0 keeps only the exponent byte of a power-of-two scale; four consecutive blocks' bytes are
packed little-endian into one int32 (block `4i + j` in byte `j` of word `i`; missing blocks of the
last word are 0).
"""

from __future__ import annotations

import torch
from einops import rearrange

from .constants import FP8_BLOCK as BLOCK

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
UE8M0_PER_INT32 = 4


def _scale_from_amax(amax: torch.Tensor, round_scale: bool) -> torch.Tensor:
    amax = amax.float().clamp(min=AMAX_FLOOR)
    # A tensor divisor: torch on CUDA turns division by a Python scalar into a multiplication by its
    # reciprocal, which rounds differently from the IEEE division the kernels do.
    scale = amax / torch.full_like(amax, FP8_MAX)
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def _quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def per_token_cast_to_fp8(
    x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast `[..., H]` (H a multiple of 128) to e4m3 with one scale per token per 128 channels.

    Returns `(q [..., H] float8_e4m3fn, scales)`: scales are float32 `[..., H/128]`, or with
    `use_ue8m0` (which implies power-of-two scales) int32 `[..., ceil(H/512)]` of packed exponent bytes.
    """
    if x.size(-1) % BLOCK != 0:
        raise ValueError(f"x: the hidden size must be a multiple of {BLOCK} for FP8, got {x.size(-1)}")
    blocks = rearrange(x, "... (g c) -> ... g c", c=BLOCK)
    scale = _scale_from_amax(blocks.abs().amax(-1), round_scale or use_ue8m0)
    q = rearrange(_quantize(blocks, scale[..., None]), "... g c -> ... (g c)")
    return q, (pack_ue8m0(scale) if use_ue8m0 else scale)


def per_token_cast_back(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize `per_token_cast_to_fp8` output (float32 or packed UE8M0 scales) to `dtype`."""
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)[..., : q.size(-1) // BLOCK]
    blocks = rearrange(q.float(), "... (g c) -> ... g c", c=BLOCK)
    return rearrange(blocks * scales.float()[..., None], "... g c -> ... (g c)").to(dtype)


def per_block_cast_to_fp8(w: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast `[..., N, K]` weights to e4m3 with one float32 scale per 128x128 block.

    N and K are zero-padded up to multiples of 128 for the block maxima only. Returns
    `(q [..., N, K], scales [..., ceil(N/128), ceil(K/128)])`.
    """
    *lead, n, k = w.shape
    pad_n, pad_k = (-n) % BLOCK, (-k) % BLOCK
    padded = torch.nn.functional.pad(w.float(), (0, pad_k, 0, pad_n))
    blocks = rearrange(padded, "... (gn bn) (gk bk) -> ... gn gk bn bk", bn=BLOCK, bk=BLOCK)
    scale = _scale_from_amax(blocks.abs().amax((-1, -2)), round_scale)
    q = _quantize(blocks, scale[..., None, None])
    q = rearrange(q, "... gn gk bn bk -> ... (gn bn) (gk bk)")[..., :n, :k]
    return q.contiguous(), scale


def per_block_cast_back(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize `per_block_cast_to_fp8` output."""
    n, k = q.shape[-2:]
    expanded = scales.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :n, :k]
    return (q.float() * expanded).to(dtype)


def padded_segment_ends(counts: torch.Tensor) -> torch.Tensor:
    """Cumulative ends `[E]` int32 of the segments' token counts, each padded up to a multiple of 128."""
    padded = (counts.to(torch.int64).clamp(min=0) + BLOCK - 1) // BLOCK * BLOCK
    return padded.cumsum(0).to(torch.int32)


def padded_columns_bound(num_rows: int, num_experts: int) -> int:
    """Columns that hold `num_experts` segments of `num_rows` rows in all, each padded to 128."""
    return BLOCK * (-(-num_rows // BLOCK) + num_experts)


def per_column_segments_cast_to_fp8(x: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, *,
                                    block_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment `e` of `x [N, F]` (rows `[starts[e], starts[e] + counts[e])`), transposed and cast to
    e4m3 along the tokens: the operands of the experts' FP8 weight-gradient GEMM.

    Segment `e` lands at columns `[padded_ends[e-1], padded_ends[e])` (`padded_segment_ends(counts)`)
    of the zero-padded `[F, padded_columns_bound(N, E)]` matrix, which is cast with one scale per row
    per 128 columns (`per_token_cast_to_fp8`, scales `[F, C/128]`) or per 128x128 block
    (`block_scales`: `per_block_cast_to_fp8`, scales `[F/128, C/128]`).
    """
    columns = torch.zeros(x.size(1), padded_columns_bound(x.size(0), counts.numel()), dtype=torch.float32,
                          device=x.device)
    begins = [0] + padded_segment_ends(counts).tolist()[:-1]
    for start, count, begin in zip(starts.tolist(), counts.tolist(), begins):
        columns[:, begin:begin + count] = x[start:start + count].float().t()
    return per_block_cast_to_fp8(columns) if block_scales else per_token_cast_to_fp8(columns)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Pack power-of-two float32 scales `[..., G]` into int32 `[..., ceil(G/4)]`; missing bytes are 0."""
    exponent = (scales.float().contiguous().view(torch.int32) >> 23) & 0xFF
    exponent = torch.nn.functional.pad(exponent, (0, (-scales.size(-1)) % UE8M0_PER_INT32))
    words = rearrange(exponent, "... (w b) -> ... w b", b=UE8M0_PER_INT32)
    shifts = torch.arange(UE8M0_PER_INT32, device=scales.device, dtype=torch.int32) * 8
    return (words << shifts).sum(-1, dtype=torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_ue8m0`: int32 `[..., W]` to float32 power-of-two scales `[..., 4W]`."""
    shifts = torch.arange(UE8M0_PER_INT32, device=packed.device, dtype=torch.int32) * 8
    exponent = (packed[..., None] >> shifts) & 0xFF
    return rearrange((exponent << 23).view(torch.float32), "... w b -> ... (w b)")
