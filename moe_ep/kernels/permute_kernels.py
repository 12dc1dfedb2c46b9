"""Fused Triton kernels for the dispatcher's un-permute: expert-major layout rows back to received rows.

* `weighted_selection_sum(y, dest_row, weights)`: `out[r] = sum_j w[r, j] * y[dest_row[r, j]]` over
  the valid slots (`dest_row >= 0`) in slot order, accumulated in float32 and stored in y's dtype:
  the un-permute's forward, and with `weights=None` (factor 1) the permute's backward. A program
  owns a tile of output rows and columns, reads each selected row's columns once and writes the
  tile once: no atomics, so the sum is deterministic.
* `unpermute_backward(grad, y, src_row, row_weight, with_dots)`: for each layout row `i` of the
  token `s = src_row[i]` (-1: padding), in one pass, `grad_y[i] = grad[s] * row_weight[i]` (in
  float32, stored in y's dtype) and `dots[i] = <grad[s], y[i]>` (float32); padding rows give zeros.

The arithmetic is that of the torch code in `dispatcher.py` (float32 products and sums, in slot
order); results may differ from it in float32 rounding (fused multiply-adds; the dots' summation
order) and, in Triton's interpreter, whose float32 to bfloat16 conversion truncates, by one
bfloat16 unit in the last place.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# A program's tile: 4096 elements are 32 float32 accumulators per thread at 4 warps. Columns come
# in blocks of up to 1024 (2 KiB of a bfloat16 row), rows fill the rest of the tile.
_TILE = 4096
_MAX_BLOCK_H = 1024
_NUM_WARPS = 4


def _blocks(width: int) -> tuple[int, int]:
    """`(BLOCK_R, BLOCK_H)` for rows of `width` elements."""
    block_h = min(triton.next_power_of_2(max(width, 1)), _MAX_BLOCK_H)
    return _TILE // block_h, block_h


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name}: expected one of {_DTYPES}, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected [rows, H], got {tuple(x.shape)}")


@triton.jit
def _selection_sum_kernel(
    y_ptr, dest_ptr, weight_ptr, out_ptr, num_rows, width,
    stride_ym, stride_yh, stride_om,
    NUM_TOPK: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_in = rows < num_rows
    col_in = cols < width
    rows = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for slot in tl.static_range(NUM_TOPK):
        src = tl.load(dest_ptr + rows * NUM_TOPK + slot, mask=row_in, other=-1)
        selected = src >= 0
        picked = tl.load(y_ptr + src[:, None] * stride_ym + cols[None, :] * stride_yh,
                         mask=selected[:, None] & col_in[None, :], other=0.0).to(tl.float32)
        if WEIGHTED:
            weight = tl.load(weight_ptr + rows * NUM_TOPK + slot, mask=selected, other=0.0).to(tl.float32)
            picked = picked * weight[:, None]
        acc += picked
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_in[:, None] & col_in[None, :])


def weighted_selection_sum(y: torch.Tensor, dest_row: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """`out [N, H]` in y's dtype with `out[r] = sum_j weights[r, j] * y[dest_row[r, j]]` over the slots
    with `dest_row[r, j] >= 0`, in slot order, accumulated in float32 (`weights=None`: factor 1).

    `y [N_layout, H]` bfloat16, float16 or float32 (any strides); `dest_row [N, k]` int64;
    `weights [N, k]` any float dtype, read as float32. Rows without a valid slot are zero.
    """
    _check_rows("y", y)
    if dest_row.dim() != 2 or dest_row.dtype != torch.int64:
        raise TypeError(f"dest_row: expected int64 [N, k], got {dest_row.dtype} {tuple(dest_row.shape)}")
    if weights is not None and weights.shape != dest_row.shape:
        raise ValueError(f"weights: expected {tuple(dest_row.shape)}, got {tuple(weights.shape)}")
    (num_rows, num_topk), width = dest_row.shape, y.size(1)
    out = torch.empty(num_rows, width, dtype=y.dtype, device=y.device)
    if out.numel():
        block_r, block_h = _blocks(width)
        _selection_sum_kernel[(triton.cdiv(num_rows, block_r), triton.cdiv(width, block_h))](
            y, dest_row.contiguous(), None if weights is None else weights.contiguous(), out, num_rows, width,
            *y.stride(), out.stride(0),
            NUM_TOPK=num_topk, WEIGHTED=weights is not None, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=_NUM_WARPS,
        )
    return out


@triton.jit
def _unpermute_backward_kernel(
    grad_ptr, y_ptr, src_ptr, weight_ptr, grad_y_ptr, dot_ptr, num_rows, width,
    stride_gm, stride_gh, stride_ym, stride_yh, stride_dm,
    GRAD_Y: tl.constexpr, DOTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_in = rows < num_rows
    rows = rows.to(tl.int64)
    src = tl.load(src_ptr + rows, mask=row_in, other=-1)
    is_token = src >= 0
    if GRAD_Y:
        weight = tl.load(weight_ptr + rows, mask=is_token, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for start in range(0, width, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_in = cols < width
        token_cols = is_token[:, None] & col_in[None, :]
        grad = tl.load(grad_ptr + src[:, None] * stride_gm + cols[None, :] * stride_gh,
                       mask=token_cols, other=0.0).to(tl.float32)
        if GRAD_Y:
            tl.store(grad_y_ptr + rows[:, None] * stride_dm + cols[None, :],
                     (grad * weight[:, None]).to(grad_y_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])
        if DOTS:
            # Padding rows' y is not read: their dot is 0 whatever the experts left there.
            y = tl.load(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yh,
                        mask=token_cols, other=0.0).to(tl.float32)
            dot += grad * y
    if DOTS:
        tl.store(dot_ptr + rows, tl.sum(dot, axis=1), mask=row_in)


def unpermute_backward(
    grad: torch.Tensor, y: torch.Tensor, src_row: torch.Tensor, row_weight: Optional[torch.Tensor], with_dots: bool
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """`(grad_y, dots)` of the un-permute for each layout row `i` of the token `s = src_row[i]`.

    `grad_y [N_layout, H]` in y's dtype, `grad[s] * row_weight[i]` in float32, only with
    `row_weight [N_layout]` (else None); `dots [N_layout]` float32, `sum_h grad[s, h] * y[i, h]`
    in float32, only `with_dots` (else None). Padding rows (`s = -1`) give zeros.
    `grad [N, H]` and `y [N_layout, H]`: bfloat16, float16 or float32, any strides.
    """
    _check_rows("grad", grad)
    _check_rows("y", y)
    if grad.size(1) != y.size(1) or src_row.shape != (y.size(0),):
        raise ValueError(f"grad, y, src_row: expected [N, H], [N_layout, H], [N_layout], "
                         f"got {tuple(grad.shape)}, {tuple(y.shape)}, {tuple(src_row.shape)}")
    if row_weight is not None and row_weight.shape != src_row.shape:
        raise ValueError(f"row_weight: expected {tuple(src_row.shape)}, got {tuple(row_weight.shape)}")
    num_rows, width = y.shape
    grad_y = None if row_weight is None else torch.empty(num_rows, width, dtype=y.dtype, device=y.device)
    dots = torch.empty(num_rows, dtype=torch.float32, device=y.device) if with_dots else None
    if (grad_y is not None or dots is not None) and num_rows:
        block_r, block_h = _blocks(width)
        _unpermute_backward_kernel[(triton.cdiv(num_rows, block_r),)](
            grad, y, src_row.contiguous(), None if row_weight is None else row_weight.contiguous(), grad_y, dots,
            num_rows, width, *grad.stride(), *y.stride(), width,
            GRAD_Y=grad_y is not None, DOTS=with_dots, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=_NUM_WARPS,
        )
    return grad_y, dots
