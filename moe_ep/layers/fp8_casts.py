"""Fused FP8 casts in Triton: one memory pass each, bit for bit the casts of `moe_ep.ops.fp8`.

* `per_token_cast_to_fp8`: `[..., K]` rows to e4m3 with one float32 scale per row per 128 columns.
  The scales come back as a `[..., K/128]` view of `[K/128, rows]` storage (rows adjacent), so the
  grouped GEMM's per-row scale loads coalesce; their values are those of the reference.
* `per_block_cast_to_fp8_with_transpose`: `[..., N, K]` weights to e4m3 with one scale per 128x128
  block, and in the same pass the transposed copy `[..., K, N]`, whose block scales are the
  transposed scale matrix: the input-gradient GEMM then reads a contracted-dimension-contiguous weight.

The arithmetic is the reference's, in float32: `amax = max(max|x|, 1e-4)`, `scale = amax / 448` and
`1 / scale` as IEEE divisions (`div_rn`: Triton's `/` may be approximate), `q = e4m3(clamp(x * (1 /
scale), ±448))` rounded to nearest even. Only the default scales (no power-of-two rounding, no UE8M0).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..ops.fp8 import AMAX_FLOOR, BLOCK, FP8_DTYPE, FP8_MAX

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_FP8_MAX = tl.constexpr(FP8_MAX)
_ROWS_PER_PROGRAM = 32
_CASTABLE = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _snap_to_e4m3_grid(v):
    """Float32 `v` (|v| <= 448) rounded to nearest even onto the e4m3 values, exactly.

    Only for the interpreter, whose float8 conversion mis-rounds (a mantissa rounding up past its
    binade loses the carry; ties go away from zero). An e4m3 value with exponent `p` (at least -6,
    the subnormals') has spacing `2**(p - 3)`, so `|v| / spacing` is below 16, where adding and
    subtracting 1.5 * 2**23 rounds a float32 to an even integer. The sign is put back afterwards,
    so that values rounding to zero give -0.0 as the hardware's conversion does.
    """
    bits = v.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    spacing_exponent = tl.maximum(exponent, 127 - 6) - 3
    spacing = (spacing_exponent << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - spacing_exponent) << 23).to(tl.float32, bitcast=True)
    magnitude = ((tl.abs(v) * inverse + 12582912.0) - 12582912.0) * spacing
    return tl.where(bits < 0, -magnitude, magnitude)


@triton.jit
def _quantize(x, amax, SNAP: tl.constexpr):
    """`(q e4m3, scale)` of float32 `x` whose block maxima `amax` broadcast against it."""
    scale = tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), tl.full(amax.shape, _FP8_MAX, tl.float32))
    inverse = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    v = tl.minimum(tl.maximum(x * inverse, -_FP8_MAX), _FP8_MAX)
    if SNAP:
        v = _snap_to_e4m3_grid(v)
    return v.to(tl.float8e4nv, fp_downcast_rounding="rtne"), scale


@triton.jit
def _per_token_kernel(
    x_ptr, q_ptr, scale_ptr, num_rows,
    stride_xm, stride_xk, stride_qm, stride_sm, stride_sk,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SNAP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_block = tl.program_id(1)
    cols = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = rows < num_rows
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask[:, None], other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    q, scale = _quantize(x, amax[:, None], SNAP)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask[:, None])
    tl.store(scale_ptr + rows * stride_sm + k_block * stride_sk, tl.reshape(scale, (BLOCK_R,)), mask=mask)


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast `[..., K]` (K a multiple of 128) to e4m3 with one float32 scale per row per 128 columns.

    Returns `(q [..., K] float8_e4m3fn, scales [..., K/128] float32)`, the values of
    `moe_ep.ops.fp8.per_token_cast_to_fp8(x)`; the scales are a view of row-adjacent storage.
    """
    if x.dtype not in _CASTABLE:
        raise TypeError(f"x: expected one of {_CASTABLE}, got {x.dtype}")
    depth = x.size(-1)
    if x.dim() < 1 or depth % BLOCK:
        raise ValueError(f"x: the last dimension must be a multiple of {BLOCK} for FP8, got {tuple(x.shape)}")
    rows = x.reshape(-1, depth)
    num_rows = rows.size(0)
    q = torch.empty(rows.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(depth // BLOCK, num_rows, dtype=torch.float32, device=x.device).t()
    if num_rows:
        grid = (triton.cdiv(num_rows, _ROWS_PER_PROGRAM), depth // BLOCK)
        _per_token_kernel[grid](
            rows, q, scales, num_rows, *rows.stride(), q.stride(0), *scales.stride(),
            BLOCK_R=_ROWS_PER_PROGRAM, BLOCK_K=BLOCK, SNAP=_INTERPRETED, num_warps=4,
        )
    return q.view(x.shape), scales.unflatten(0, x.shape[:-1])


@triton.jit
def _per_block_kernel(
    w_ptr, q_ptr, q_t_ptr, scale_ptr, N, K, blocks_n, blocks_k,
    stride_we, stride_wn, stride_wk,
    BLOCK_C: tl.constexpr, SNAP: tl.constexpr,
):
    pid = tl.program_id(0)
    block_k = pid % blocks_k
    block_n = (pid // blocks_k) % blocks_n
    matrix = (pid // (blocks_k * blocks_n)).to(tl.int64)
    rows = block_n * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = block_k * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    rows = rows.to(tl.int64)
    cols = cols.to(tl.int64)
    w = tl.load(w_ptr + matrix * stride_we + rows[:, None] * stride_wn + cols[None, :] * stride_wk,
                mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize(w, tl.max(tl.abs(w)), SNAP)
    tl.store(q_ptr + matrix * N * K + rows[:, None] * K + cols[None, :], q, mask=mask)
    tl.store(q_t_ptr + matrix * N * K + cols[:, None] * N + rows[None, :], tl.trans(q), mask=tl.trans(mask))
    tl.store(scale_ptr + pid, scale)


def per_block_cast_to_fp8_with_transpose(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast `[..., N, K]` weights to e4m3 with one float32 scale per 128x128 block, and transpose them.

    Returns `(q [..., N, K], scales [..., ceil(N/128), ceil(K/128)], q_t [..., K, N])`: `q` and
    `scales` are `moe_ep.ops.fp8.per_block_cast_to_fp8(w)`, `q_t` is `q` transposed (contiguous),
    and `scales.transpose(-2, -1)` are its block scales.
    """
    if w.dtype not in _CASTABLE:
        raise TypeError(f"w: expected one of {_CASTABLE}, got {w.dtype}")
    if w.dim() < 2:
        raise ValueError(f"w: expected [..., N, K], got {tuple(w.shape)}")
    *lead, n, k = w.shape
    matrices = w.reshape(-1, n, k)
    blocks_n, blocks_k = triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)
    q = torch.empty(matrices.shape, dtype=FP8_DTYPE, device=w.device)
    q_t = torch.empty(matrices.size(0), k, n, dtype=FP8_DTYPE, device=w.device)
    scales = torch.empty(matrices.size(0), blocks_n, blocks_k, dtype=torch.float32, device=w.device)
    if scales.numel():
        _per_block_kernel[(scales.numel(),)](
            matrices, q, q_t, scales, n, k, blocks_n, blocks_k, *matrices.stride(),
            BLOCK_C=BLOCK, SNAP=_INTERPRETED, num_warps=8,
        )
    return q.view(w.shape), scales.view(*lead, blocks_n, blocks_k), q_t.view(*lead, k, n)
