"""`MoETokenDispatcher`: routed tokens to an expert-major layout on the owning ranks, and back.

Normal mode: `ops.dispatch` sends each token once to every rank holding one of its experts; the
received rows are then permuted expert-major (`routing.expert_major_layout`): expert `e`'s rows are
contiguous, padded with zero rows to `expert_alignment`, with counts on the device. `combine`
un-permutes, weights and sums each token's selections on the receiving rank and `ops.combine`
returns the sums. Low-latency mode: `ops.low_latency_dispatch` already delivers the packed
`[E_local, R*max, H]` layout that `GroupedMLP` consumes as is.

Routing weights are applied exactly once, at combine (the un-permute here, inside the low-latency
combine in that mode), in float32: experts run unweighted (`GroupedMLP(routing_weights=None)`).
On CUDA with Triton, the un-permute and the backward passes of both permutations are fused Triton
kernels (`moe_ep.kernels.permute_kernels`), with the torch code's arithmetic; elsewhere that torch code runs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple, Optional, Union

import torch

from .. import ops
from ..ops import Buffer, DispatchHandle, LowLatencyHandle
from ..kernels.loaders import triton_kernels
from ..ops.routing import ExpertLayout, expert_major_layout, static_layout_rows
from .config import MoEConfig

Tokens = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class ExpertInput(NamedTuple):
    """What the experts run on: pass it to `GroupedMLP(tokens, tokens_per_expert, carrier=...,
    tokens_per_expert_list=...)`."""

    tokens: Tokens  # [N_layout, H] or packed [E_local, R*max, H]; FP8 `(q, scales)` with FP8 dispatch
    tokens_per_expert: torch.Tensor  # [E_local] int32 on the device (aligned in normal mode)
    tokens_per_expert_list: Optional[list[int]]  # host copy when known without a sync
    carrier: Optional[torch.Tensor]  # zero-storage bf16 gradient carrier with FP8 dispatch


def _gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`x[rows]` with zero rows where `rows` is -1."""
    is_fp8 = x.dtype == torch.float8_e4m3fn
    source = x.view(torch.uint8) if is_fp8 else x  # e4m3 zero is the all-zero byte
    out = source.index_select(0, rows.clamp(min=0)).masked_fill_((rows < 0)[:, None], 0)
    return out.view(x.dtype) if is_fp8 else out


def _sum_selections_torch(y: torch.Tensor, dest_row: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """`out[r] = sum_j w[r, j] * y[dest_row[r, j]]` over valid slots in slot order, at least float32."""
    acc = torch.zeros(dest_row.size(0), y.size(1), dtype=torch.promote_types(y.dtype, torch.float32),
                      device=y.device)
    # One gather per top-k slot (k <= 32) keeps the sum deterministic, unlike an atomic scatter-add.
    for slot in range(dest_row.size(1)):
        rows = dest_row[:, slot]
        factor = (rows >= 0).to(acc.dtype) if weights is None else torch.where(rows >= 0, weights[:, slot], 0)
        acc.addcmul_(y.index_select(0, rows.clamp(min=0)), factor.to(acc.dtype)[:, None])
    return acc


def _unpermute_backward_torch(grad: torch.Tensor, y: torch.Tensor, src_row: torch.Tensor,
                              row_weight: Optional[torch.Tensor],
                              with_dots: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Per layout row `i` of the token `src_row[i]` (-1: padding, zeros): `grad[src] * row_weight[i]`
    in y's dtype when `row_weight` is given, and `<grad[src], y[i]>` (at least float32) `with_dots`."""
    acc = torch.promote_types(y.dtype, torch.float32)
    row_grad = _gather_rows(grad, src_row).to(acc)  # the output gradient of each layout row's token
    grad_y = None if row_weight is None else (row_grad * row_weight.to(acc)[:, None]).to(y.dtype)
    dots = (row_grad * y.to(acc)).sum(-1) if with_dots else None
    return grad_y, dots


def _triton_kernels(*tensors: torch.Tensor) -> Optional[ModuleType]:
    """The Triton un-permute kernels where they run on `tensors` (CUDA sm_80+; bfloat16, float16 or
    float32), else None: the torch code then runs (CPU, float64, no Triton)."""
    device = tensors[0].device
    if device.type != "cuda" or any(t.dtype not in _TRITON_DTYPES for t in tensors):
        return None
    return triton_kernels("permute_kernels") if torch.cuda.get_device_capability(device) >= (8, 0) else None


def _sum_selections(y: torch.Tensor, dest_row: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """`out[r] = sum_j w[r, j] * y[dest_row[r, j]]` over valid slots in slot order, accumulated in at
    least float32, in y's dtype (`weights=None`: factor 1); one fused pass where Triton runs."""
    kernels = _triton_kernels(y)
    if kernels is not None:
        return kernels.weighted_selection_sum(y, dest_row, weights)
    return _sum_selections_torch(y, dest_row, weights).to(y.dtype)


class _Permute(torch.autograd.Function):
    """Received rows to the expert-major layout; backward sums each row's selections.

    With `zero_storage`, `x` is an FP8 dispatch's gradient carrier: the output is a zero-storage
    carrier of the layout's shape, so no dense zero tensor is ever materialised.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src_row: torch.Tensor, dest_row: torch.Tensor,
                zero_storage: bool) -> torch.Tensor:
        ctx.save_for_backward(dest_row)
        if zero_storage:
            return torch.zeros((), dtype=x.dtype, device=x.device).expand(src_row.numel(), x.size(1))
        return _gather_rows(x, src_row)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        (dest_row,) = ctx.saved_tensors
        return _sum_selections(grad, dest_row, None), None, None, None


class _Unpermute(torch.autograd.Function):
    """Expert outputs back to received rows, each weighted by its routing weight and summed."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, weights: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        ctx.save_for_backward(y, weights, layout.dest_row, layout.src_row, layout.src_slot)
        return _sum_selections(y, layout.dest_row, weights)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        y, weights, dest_row, src_row, src_slot = ctx.saved_tensors
        need_grad_y, need_grad_w = ctx.needs_input_grad[:2]
        num_topk = dest_row.size(1)
        pair = torch.where(src_row >= 0, src_row * num_topk + src_slot, weights.numel())  # extra slot: padding
        row_weight = torch.cat([weights.reshape(-1), weights.new_zeros(1)])[pair] if need_grad_y else None
        kernels = _triton_kernels(y, grad)
        backward = _unpermute_backward_torch if kernels is None else kernels.unpermute_backward
        grad_y, dots = backward(grad, y, src_row, row_weight, need_grad_w)
        grad_w = None
        if dots is not None:
            # d loss / d w[r, j] = <grad[r], y[dest_row[r, j]]>; every selection owns one layout row.
            grad_w = weights.new_zeros(weights.numel() + 1).scatter_(0, pair, dots.to(weights.dtype))
            grad_w = grad_w[:-1].view_as(weights)
        return grad_y, grad_w, None


class _NormalStep(NamedTuple):
    handle: DispatchHandle
    layout: ExpertLayout
    recv_weights: torch.Tensor


class _LowLatencyStep(NamedTuple):
    handle: LowLatencyHandle
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


class MoETokenDispatcher:
    """Dispatches routed tokens to their experts' ranks in an expert-major layout and combines them back.

    Mode (`config.dispatch_mode`): "normal" (`buffer` in any mode; `config.num_worst_tokens > 0`
    gives static shapes and no host sync) or "low_latency" (`buffer` in low-latency mode, at most
    `config.low_latency_max_tokens` tokens per rank). FP8 dispatch with `config.use_fp8_dispatch`.
    Each `dispatch` must be followed by its `combine` before the next `dispatch`; the step's
    handle is dropped at `combine` (backward keeps what it needs inside the autograd graph).
    """

    def __init__(self, config: MoEConfig, buffer: Buffer) -> None:
        if config.dispatch_mode == "low_latency" and not buffer.low_latency_mode:
            raise ValueError("buffer: dispatch_mode='low_latency' needs a Buffer with low_latency_mode=True")
        self.config = config
        self.buffer = buffer
        self.num_local_experts = config.num_experts // buffer.group_size
        self._step: Optional[Union[_NormalStep, _LowLatencyStep]] = None

    def dispatch(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> ExpertInput:
        """Send `hidden [T, H]` to the experts `topk_idx [T, k]` picked with `topk_weights [T, k]` (float32)."""
        if self._step is not None:
            raise RuntimeError("dispatch: the previous dispatch has not been combined yet")
        if self.config.dispatch_mode == "low_latency":
            return self._dispatch_low_latency(hidden, topk_idx, topk_weights)
        return self._dispatch_normal(hidden, topk_idx, topk_weights)

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """Weighted sum of every token's expert outputs, `[T, H]`; `expert_out` is shaped like the tokens."""
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("combine: no dispatch to combine")
        if isinstance(step, _LowLatencyStep):
            return ops.low_latency_combine(self.buffer, expert_out, step.topk_idx, step.topk_weights, step.handle)
        per_row = _Unpermute.apply(expert_out, step.recv_weights, step.layout)
        return ops.combine(self.buffer, per_row, step.handle)

    def _dispatch_normal(self, hidden: torch.Tensor, topk_idx: torch.Tensor,
                         topk_weights: torch.Tensor) -> ExpertInput:
        cfg = self.config
        out = ops.dispatch(self.buffer, hidden, topk_idx, topk_weights, cfg.num_experts,
                           expert_alignment=cfg.expert_alignment, num_worst_tokens=cfg.num_worst_tokens,
                           use_fp8=cfg.use_fp8_dispatch)
        counts_list: Optional[list[int]] = None
        if cfg.num_worst_tokens > 0:
            num_rows = static_layout_rows(cfg.num_worst_tokens, topk_idx.size(1), self.num_local_experts,
                                          cfg.expert_alignment)
        else:
            counts_list = list(out.num_recv_tokens_per_expert_list)
            num_rows = sum(counts_list)
        layout = expert_major_layout(out.recv_topk_idx, self.num_local_experts, cfg.expert_alignment, num_rows)
        carrier = None
        if cfg.use_fp8_dispatch:
            tokens: Tokens = (_gather_rows(out.recv_x, layout.src_row), _gather_rows(out.recv_x_scales, layout.src_row))
            carrier = _Permute.apply(out.grad_carrier, layout.src_row, layout.dest_row, True)
        else:
            tokens = _Permute.apply(out.recv_x, layout.src_row, layout.dest_row, False)
        self._step = _NormalStep(out.handle, layout, out.recv_topk_weights)
        return ExpertInput(tokens, layout.tokens_per_expert, counts_list, carrier)

    def _dispatch_low_latency(self, hidden: torch.Tensor, topk_idx: torch.Tensor,
                              topk_weights: torch.Tensor) -> ExpertInput:
        cfg = self.config
        out = ops.low_latency_dispatch(self.buffer, hidden, topk_idx, cfg.low_latency_max_tokens, cfg.num_experts,
                                       use_fp8=cfg.use_fp8_dispatch)
        tokens = (out.recv_x, out.recv_x_scales) if cfg.use_fp8_dispatch else out.recv_x
        self._step = _LowLatencyStep(out.handle, topk_idx, topk_weights)
        return ExpertInput(tokens, out.recv_count, None, out.grad_carrier)
