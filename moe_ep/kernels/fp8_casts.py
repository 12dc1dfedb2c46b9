"""Fused FP8 casts in Triton: one memory pass each, bit for bit the casts of `moe_ep.ops.fp8`.

* `per_token_cast_to_fp8`: `[..., K]` rows to e4m3 with one float32 scale per row per 128 columns.
  The scales come back as a `[..., K/128]` view of `[K/128, rows]` storage (rows adjacent), so the
  grouped GEMM's per-row scale loads coalesce; their values are those of the reference.
* `per_token_cast_back`: those rows back to bfloat16 (or float32).
* `swiglu_to_fp8`, `swiglu_backward_to_fp8`: the experts' SwiGLU on `[gate, up]` rows and its
  gradient, in float32, fused with the 1x128 cast of their output (the next GEMM's operand).
* `per_column_segments_cast_to_fp8`: the operands of the FP8 weight-gradient GEMM. Every expert's
  segment of `[N, F]` rows, transposed to `[F, tokens]` and padded with zero columns to a multiple
  of 128 tokens, cast along the tokens: one scale per feature per 128 tokens, or per 128x128 block.
* `per_block_cast_to_fp8_with_transpose`: `[..., N, K]` weights to e4m3 with one scale per 128x128
  block, and in the same pass the transposed copy `[..., K, N]`, whose block scales are the
  transposed scale matrix: the input-gradient GEMM then reads a contracted-dimension-contiguous weight.
  BF16 weights go through the CUDA kernel of `moe_ep._fp8` where it runs: the same bits, at about
  2.9 TB/s against this kernel's 2.4 TB/s on an H200.

The arithmetic is the reference's, in float32: `amax = max(max|x|, 1e-4)`, `scale = amax / 448` and
`1 / scale` as IEEE divisions (`div_rn`: Triton's `/` may be approximate), `q = e4m3(clamp(x * (1 /
scale), ±448))` rounded to nearest even; back, `x = q * scale` rounded to nearest even. Only the
default scales (no power-of-two rounding, no UE8M0).
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from ..ops.fp8 import AMAX_FLOOR, BLOCK, FP8_DTYPE, FP8_MAX, padded_columns_bound
from .fp8_backend import aligned_rows, cuda_kernels_run
from .loaders import fp8_extension, interpreted

_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_FP8_MAX = tl.constexpr(FP8_MAX)
_ROWS_PER_PROGRAM = 32
_CASTABLE = (torch.float32, torch.bfloat16, torch.float16)
FP8Rows = tuple[torch.Tensor, torch.Tensor]
"""`(q [N, K] e4m3, scales [N, K/128] float32)`, as `per_token_cast_to_fp8` returns them."""


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


INTERPRETED = interpreted(_snap_to_e4m3_grid)
"""Whether this module's kernels run in Triton's interpreter, whose float conversions are snapped
onto the right values first (`SNAP`)."""


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
def _row_tile(num_rows, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's rows (int64, `BLOCK_R` of them), its 128-column block and columns, and which rows exist."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_block = tl.program_id(1)
    cols = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    return rows.to(tl.int64), k_block, cols, rows < num_rows


@triton.jit
def _load_rows(ptr, rows, cols, mask, stride_m, stride_k):
    """The tile `ptr[rows, cols]` (rows past `mask` zero) in float32."""
    return tl.load(ptr + rows[:, None] * stride_m + cols[None, :] * stride_k, mask=mask[:, None], other=0.0).to(
        tl.float32)


@triton.jit
def _store_fp8_rows(x, q_ptr, scale_ptr, rows, k_block, cols, mask, stride_qm, stride_sm, stride_sk,
                    SNAP: tl.constexpr):
    """Quantize the float32 tile `x` (rows x one 128-column block) 1x128 and store it and its scales."""
    q, scale = _quantize(x, tl.max(tl.abs(x), axis=1)[:, None], SNAP)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask[:, None])
    tl.store(scale_ptr + rows * stride_sm + k_block * stride_sk, tl.reshape(scale, (x.shape[0],)), mask=mask)


@triton.jit
def _per_token_kernel(
    x_ptr, q_ptr, scale_ptr, num_rows,
    stride_xm, stride_xk, stride_qm, stride_sm, stride_sk,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SNAP: tl.constexpr,
):
    rows, k_block, cols, mask = _row_tile(num_rows, BLOCK_R, BLOCK_K)
    x = _load_rows(x_ptr, rows, cols, mask, stride_xm, stride_xk)
    _store_fp8_rows(x, q_ptr, scale_ptr, rows, k_block, cols, mask, stride_qm, stride_sm, stride_sk, SNAP)


def _check_depth(name: str, x: torch.Tensor) -> None:
    if x.dim() < 1 or x.size(-1) % BLOCK:
        raise ValueError(f"{name}: the last dimension must be a multiple of {BLOCK} for FP8, got {tuple(x.shape)}")


def _empty_fp8_rows(num_rows: int, depth: int, device: torch.device) -> FP8Rows:
    """`q [num_rows, depth]` e4m3 and its scales `[num_rows, depth/128]`, a view of `[depth/128, num_rows]`."""
    q = torch.empty(num_rows, depth, dtype=FP8_DTYPE, device=device)
    return q, torch.empty(depth // BLOCK, num_rows, dtype=torch.float32, device=device).t()


def _row_grid(num_rows: int, depth: int) -> tuple[int, int]:
    return triton.cdiv(num_rows, _ROWS_PER_PROGRAM), depth // BLOCK


def per_token_cast_to_fp8(x: torch.Tensor) -> FP8Rows:
    """Cast `[..., K]` (K a multiple of 128) to e4m3 with one float32 scale per row per 128 columns.

    Returns `(q [..., K] float8_e4m3fn, scales [..., K/128] float32)`, the values of
    `moe_ep.ops.fp8.per_token_cast_to_fp8(x)`; the scales are a view of row-adjacent storage.
    """
    if x.dtype not in _CASTABLE:
        raise TypeError(f"x: expected one of {_CASTABLE}, got {x.dtype}")
    _check_depth("x", x)
    rows = x.reshape(-1, x.size(-1))
    num_rows, depth = rows.shape
    q, scales = _empty_fp8_rows(num_rows, depth, x.device)
    if num_rows:
        _per_token_kernel[_row_grid(num_rows, depth)](
            rows, q, scales, num_rows, *rows.stride(), q.stride(0), *scales.stride(),
            BLOCK_R=_ROWS_PER_PROGRAM, BLOCK_K=BLOCK, SNAP=INTERPRETED, num_warps=4,
        )
    return q.view(x.shape), scales.unflatten(0, x.shape[:-1])


@triton.jit
def _snap_to_bf16_grid(v):
    """Float32 `v` rounded to nearest even onto the bfloat16 values (for the interpreter, whose
    conversion truncates): add just under half a bfloat16 step, plus the kept mantissa's last bit
    to break ties towards even, then clear the dropped bits."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _to_bf16(v, SNAP: tl.constexpr):
    """Float32 `v` rounded to nearest even to bfloat16 (snapped first in the interpreter)."""
    if SNAP:
        v = _snap_to_bf16_grid(v)
    return v.to(tl.bfloat16)


@triton.jit
def _per_token_back_kernel(
    q_ptr, scale_ptr, out_ptr, num_rows,
    stride_qm, stride_qk, stride_sm, stride_sk, stride_om,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SNAP: tl.constexpr,
):
    rows, k_block, cols, mask = _row_tile(num_rows, BLOCK_R, BLOCK_K)
    scale = tl.load(scale_ptr + rows * stride_sm + k_block * stride_sk, mask=mask, other=0.0)
    value = _load_rows(q_ptr, rows, cols, mask, stride_qm, stride_qk) * scale[:, None]
    if out_ptr.dtype.element_ty == tl.bfloat16:
        value = _to_bf16(value, SNAP)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], value, mask=mask[:, None])


def per_token_cast_back(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize 1x128 e4m3 rows `q [..., K]` with float32 `scales [..., K/128]` (any strides) to
    `dtype` (bfloat16 or float32): the values of `moe_ep.ops.fp8.per_token_cast_back`."""
    if q.dtype != FP8_DTYPE or scales.dtype != torch.float32:
        raise TypeError(f"q, scales: expected {FP8_DTYPE} and float32, got {q.dtype} and {scales.dtype}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"dtype: expected bfloat16 or float32, got {dtype}")
    _check_depth("q", q)
    if scales.shape != (*q.shape[:-1], q.size(-1) // BLOCK):
        raise ValueError(f"scales: expected {(*q.shape[:-1], q.size(-1) // BLOCK)}, got {tuple(scales.shape)}")
    rows, row_scales = q.reshape(-1, q.size(-1)), scales.reshape(-1, scales.size(-1))
    out = torch.empty(rows.shape, dtype=dtype, device=q.device)
    if rows.size(0):
        _per_token_back_kernel[_row_grid(*rows.shape)](
            rows, row_scales, out, rows.size(0), *rows.stride(), *row_scales.stride(), out.stride(0),
            BLOCK_R=_ROWS_PER_PROGRAM, BLOCK_K=BLOCK, SNAP=INTERPRETED, num_warps=4,
        )
    return out.view(q.shape)


@triton.jit
def _swiglu_kernel(
    z_ptr, q_ptr, scale_ptr, num_rows, width,
    stride_zm, stride_qm, stride_sm, stride_sk,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SNAP: tl.constexpr,
):
    rows, k_block, cols, mask = _row_tile(num_rows, BLOCK_R, BLOCK_K)
    gate = _load_rows(z_ptr, rows, cols, mask, stride_zm, 1)
    up = _load_rows(z_ptr + width, rows, cols, mask, stride_zm, 1)
    _store_fp8_rows(gate * tl.sigmoid(gate) * up, q_ptr, scale_ptr, rows, k_block, cols, mask,
                    stride_qm, stride_sm, stride_sk, SNAP)


def swiglu_to_fp8(z: torch.Tensor) -> FP8Rows:
    """`silu(gate) * up` of `z = [gate, up]` (`[N, 2I]`, BF16), computed in float32 and cast 1x128 to
    e4m3: `(q [N, I], scales [N, I/128])` as `per_token_cast_to_fp8` returns them."""
    _check_swiglu_input("z", z)
    num_rows, width = z.size(0), z.size(1) // 2
    q, scales = _empty_fp8_rows(num_rows, width, z.device)
    if num_rows:
        _swiglu_kernel[_row_grid(num_rows, width)](
            z, q, scales, num_rows, width, z.stride(0), q.stride(0), *scales.stride(),
            BLOCK_R=_ROWS_PER_PROGRAM, BLOCK_K=BLOCK, SNAP=INTERPRETED, num_warps=4,
        )
    return q, scales


@triton.jit
def _swiglu_backward_kernel(
    z_ptr, grad_ptr, grad_z_ptr, q_ptr, scale_ptr, num_rows, width,
    stride_zm, stride_gm, stride_dm, stride_qm, stride_sm, stride_sk,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SNAP: tl.constexpr,
):
    rows, k_block, cols, mask = _row_tile(num_rows, BLOCK_R, BLOCK_K)
    gate = _load_rows(z_ptr, rows, cols, mask, stride_zm, 1)
    up = _load_rows(z_ptr + width, rows, cols, mask, stride_zm, 1)
    grad = _load_rows(grad_ptr, rows, cols, mask, stride_gm, 1)
    sigmoid = tl.sigmoid(gate)
    # d silu(g) / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    grad_gate = _to_bf16(grad * up * sigmoid * (1.0 + gate * (1.0 - sigmoid)), SNAP)
    grad_up = _to_bf16(grad * gate * sigmoid, SNAP)
    grad_gate_ptrs = grad_z_ptr + rows[:, None] * stride_dm + cols[None, :]
    tl.store(grad_gate_ptrs, grad_gate, mask=mask[:, None])
    tl.store(grad_gate_ptrs + width, grad_up, mask=mask[:, None])
    # The FP8 copies are casts of the BF16 gradient just stored, as `per_token_cast_to_fp8` of it.
    _store_fp8_rows(grad_gate.to(tl.float32), q_ptr, scale_ptr, rows, k_block, cols, mask,
                    stride_qm, stride_sm, stride_sk, SNAP)
    _store_fp8_rows(grad_up.to(tl.float32), q_ptr + width, scale_ptr, rows, k_block + width // BLOCK_K, cols, mask,
                    stride_qm, stride_sm, stride_sk, SNAP)


def swiglu_backward_to_fp8(z: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, FP8Rows]:
    """Gradient of `silu(gate) * up` with respect to `z = [gate, up]` (`[N, 2I]`, BF16) given the
    output gradient `grad [N, I]`, computed in float32: `(grad_z [N, 2I] BF16, its 1x128 e4m3 cast
    (q, scales) as per_token_cast_to_fp8(grad_z) returns it)`."""
    _check_swiglu_input("z", z)
    num_rows, width = z.size(0), z.size(1) // 2
    check = (grad.dtype, tuple(grad.shape), grad.stride(-1))
    if check != (torch.bfloat16, (num_rows, width), 1):
        raise ValueError(f"grad: expected bfloat16 {(num_rows, width)} with contiguous rows, got {check}")
    grad_z = torch.empty_like(z, memory_format=torch.contiguous_format)
    q, scales = _empty_fp8_rows(num_rows, 2 * width, z.device)
    if num_rows:
        _swiglu_backward_kernel[_row_grid(num_rows, width)](
            z, grad, grad_z, q, scales, num_rows, width,
            z.stride(0), grad.stride(0), grad_z.stride(0), q.stride(0), *scales.stride(),
            BLOCK_R=_ROWS_PER_PROGRAM, BLOCK_K=BLOCK, SNAP=INTERPRETED, num_warps=4,
        )
    return grad_z, (q, scales)


def _check_swiglu_input(name: str, z: torch.Tensor) -> None:
    if z.dtype != torch.bfloat16 or z.dim() != 2 or z.size(1) % (2 * BLOCK) or z.stride(1) != 1:
        raise ValueError(f"{name}: expected bfloat16 [N, 2I] with contiguous rows and I a multiple of {BLOCK}, "
                         f"got {z.dtype} {tuple(z.shape)} strides {z.stride()}")


# Features per program and warps of `_column_segments_kernel`, by `block_scales` (a 128x128 block scale
# needs all 128 features of the block in one program). Smaller programs than a 128 x 128 tile on 8 warps
# keep more of them resident per SM, hiding the loads behind the transposes: at the DeepSeek-V3 expert
# shapes on an H100 the 1x128 cast ran 1.6x and the 128x128 one 1.3x faster than with (128, 8).
_COLUMN_SEGMENTS_TILING = {False: (64, 4), True: (BLOCK, 4)}


@triton.jit
def _column_segments_kernel(
    x_ptr, x_scale_ptr, q_ptr, scale_ptr, starts_ptr, counts_ptr, padded_ends_ptr, num_experts,
    stride_xm, stride_xk, stride_xsm, stride_xsk, stride_qm, stride_sm, stride_sk,
    FP8_INPUT: tl.constexpr, BLOCK_SCALES: tl.constexpr, E_POW2: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_F: tl.constexpr, SNAP: tl.constexpr,
):
    # A program casts BLOCK_C tokens x BLOCK_F features (BLOCK_F divides BLOCK_C; with block scales it is
    # BLOCK_C, the scale's block).
    column_block, feature_block = tl.program_id(0), tl.program_id(1)
    first_column = column_block * BLOCK_C
    # The expert whose padded columns hold this block: all experts at once, as in _locate_row_tile.
    e = tl.arange(0, E_POW2)
    padded_end = tl.load(padded_ends_ptr + e, mask=e < num_experts, other=0)
    expert = tl.sum(((padded_end <= first_column) & (e < num_experts)).to(tl.int32), 0)
    if expert < num_experts:
        padded_begin = tl.sum(tl.where(e == expert - 1, padded_end, 0), 0)
        tokens = first_column - padded_begin + tl.arange(0, BLOCK_C)
        valid = tokens < tl.load(counts_ptr + expert)
        rows = (tl.load(starts_ptr + expert) + tokens).to(tl.int64)
        features = (feature_block * BLOCK_F + tl.arange(0, BLOCK_F)).to(tl.int64)
        x = _load_rows(x_ptr, rows, features, valid, stride_xm, stride_xk)  # [tokens, features]
        if FP8_INPUT:
            scale_group = feature_block * BLOCK_F // BLOCK_C
            x = x * tl.load(x_scale_ptr + rows * stride_xsm + scale_group * stride_xsk, mask=valid, other=0.0)[:, None]
        if BLOCK_SCALES:
            q, scale = _quantize(x, tl.max(tl.abs(x)), SNAP)
            tl.store(scale_ptr + feature_block * stride_sm + column_block * stride_sk, scale)
        else:
            q, scale = _quantize(x, tl.max(tl.abs(x), axis=0)[None, :], SNAP)
            tl.store(scale_ptr + features * stride_sm + column_block * stride_sk, tl.reshape(scale, (BLOCK_F,)))
        columns = first_column + tl.arange(0, BLOCK_C)
        tl.store(q_ptr + features[:, None] * stride_qm + columns[None, :], tl.trans(q))


def per_column_segments_cast_to_fp8(x: torch.Tensor, x_scales: torch.Tensor | None, starts: torch.Tensor,
                                    counts: torch.Tensor, padded_ends: torch.Tensor, *, block_scales: bool,
                                    ) -> FP8Rows:
    """Expert `e`'s rows `[starts[e], starts[e] + counts[e])` of `x [N, F]`, transposed and cast to
    e4m3 along the tokens, at columns `[padded_ends[e-1], padded_ends[e])` of `q [F, C]`
    (`moe_ep.ops.fp8.padded_segment_ends` and `padded_columns_bound`); the padding columns are zeros,
    the columns from `padded_ends[-1]` on are never written.

    `x` is BF16/float32, or e4m3 with its 1x128 float32 `x_scales [N, F/128]` (dequantized first, in
    float32). Scales: `[F, C/128]` per feature per 128 tokens (rows adjacent in memory), or with
    `block_scales` `[F/128, C/128]` per 128x128 block. The values are those of
    `moe_ep.ops.fp8.per_column_segments_cast_to_fp8` on the columns written.
    """
    num_rows, features = x.shape
    num_experts = counts.numel()
    if (x.dtype == FP8_DTYPE) != (x_scales is not None):
        raise ValueError("x_scales: expected exactly with e4m3 x")
    _check_depth("x", x)
    columns = padded_columns_bound(num_rows, num_experts)
    q = torch.empty(features, columns, dtype=FP8_DTYPE, device=x.device)
    if block_scales:
        scales = torch.empty(features // BLOCK, columns // BLOCK, dtype=torch.float32, device=x.device)
    else:
        scales = torch.empty(columns // BLOCK, features, dtype=torch.float32, device=x.device).t()
    x_scale_strides = x_scales.stride() if x_scales is not None else (0, 0)
    block_features, num_warps = _COLUMN_SEGMENTS_TILING[block_scales]
    _column_segments_kernel[(columns // BLOCK, features // block_features)](
        x, x_scales, q, scales, starts, counts, padded_ends, num_experts,
        *x.stride(), *x_scale_strides, q.stride(0), *scales.stride(),
        FP8_INPUT=x_scales is not None, BLOCK_SCALES=block_scales, E_POW2=triton.next_power_of_2(num_experts),
        BLOCK_C=BLOCK, BLOCK_F=block_features, SNAP=INTERPRETED, num_warps=num_warps,
    )
    return q, scales


@triton.jit
def _per_block_kernel(
    w_ptr, q_ptr, q_t_ptr, scale_ptr, N, K, blocks_n, blocks_k,
    stride_we, stride_wn, stride_wk,
    BLOCK_C: tl.constexpr, SNAP: tl.constexpr, WRITE_T: tl.constexpr,
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
    if WRITE_T:
        tl.store(q_t_ptr + matrix * N * K + cols[:, None] * N + rows[None, :], tl.trans(q), mask=tl.trans(mask))
    tl.store(scale_ptr + pid, scale)


def cuda_weight_cast_runs(w: torch.Tensor) -> bool:
    """Whether `per_block_cast_to_fp8_with_transpose(w)` runs the CUDA kernel of `moe_ep._fp8`:
    BF16 `[..., N, K]` with N and K multiples of 128, K contiguous, 16-byte aligned rows."""
    return (w.dtype == torch.bfloat16 and w.dim() >= 2 and w.size(-2) % BLOCK == 0 and w.size(-1) % BLOCK == 0
            and cuda_kernels_run(w) and aligned_rows(w))


def per_block_cast_to_fp8_with_transpose(w: torch.Tensor, *, backend: Literal["auto", "cuda", "triton"] = "auto",
                                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast `[..., N, K]` weights to e4m3 with one float32 scale per 128x128 block, and transpose them.

    Returns `(q [..., N, K], scales [..., ceil(N/128), ceil(K/128)], q_t [..., K, N])`: `q` and
    `scales` are `moe_ep.ops.fp8.per_block_cast_to_fp8(w)`, `q_t` is `q` transposed (contiguous),
    and `scales.transpose(-2, -1)` are its block scales. `backend`: "cuda" (the `moe_ep._fp8`
    kernel, an error where it cannot run `w`), "triton", or "auto" (CUDA where it runs).
    """
    if w.dtype not in _CASTABLE:
        raise TypeError(f"w: expected one of {_CASTABLE}, got {w.dtype}")
    if w.dim() < 2:
        raise ValueError(f"w: expected [..., N, K], got {tuple(w.shape)}")
    if backend not in ("auto", "cuda", "triton"):
        raise ValueError(f"backend: expected 'auto', 'cuda' or 'triton', got {backend!r}")
    if backend == "cuda" and not cuda_weight_cast_runs(w):
        raise RuntimeError("backend='cuda': the moe_ep._fp8 weight cast cannot run here (it needs an sm_90a build "
                           "on an sm_90 GPU and BF16 weights with N, K multiples of 128 and 16-byte aligned rows)")
    if backend != "triton" and cuda_weight_cast_runs(w):
        return fp8_extension().fp8_weight_cast(w, AMAX_FLOOR)
    *lead, n, k = w.shape
    matrices = w.reshape(-1, n, k)
    blocks_n, blocks_k = triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)
    q = torch.empty(matrices.shape, dtype=FP8_DTYPE, device=w.device)
    q_t = torch.empty(matrices.size(0), k, n, dtype=FP8_DTYPE, device=w.device)
    scales = torch.empty(matrices.size(0), blocks_n, blocks_k, dtype=torch.float32, device=w.device)
    # The in-kernel transposed store was bitwise right on an H200 for bfloat16 weights but wrong for
    # float32 ones (Triton 3.6): other dtypes transpose with torch.
    fused_transpose = w.dtype == torch.bfloat16 or INTERPRETED
    if scales.numel():
        _per_block_kernel[(scales.numel(),)](
            matrices, q, q_t, scales, n, k, blocks_n, blocks_k, *matrices.stride(),
            BLOCK_C=BLOCK, SNAP=INTERPRETED, WRITE_T=fused_transpose, num_warps=8,
        )
        if not fused_transpose:
            q_t.copy_(q.transpose(-2, -1))
    return q.view(w.shape), scales.view(*lead, blocks_n, blocks_k), q_t.view(*lead, k, n)
