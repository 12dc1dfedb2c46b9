"""Differentiable dispatch and combine over a `Buffer` (torch.autograd.Function wrappers).

Backward of a dispatch is a combine of the gradients (the `topk_weights` gradient included); backward
of a combine is a cached dispatch. Low-latency mode likewise. Every rank must run backward through
the same ops in the same order, as with any collective. Handles live in the autograd context only
until backward has used them.

FP8 dispatch (`use_fp8=True`) returns e4m3 data and scales, which cannot carry gradients, plus a
zero-storage BF16 `grad_carrier` of the same shape: a consumer adds it to (or threads it through)
its use of the dequantized tokens, and the BF16 gradient it receives goes back straight through
the cast.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from . import fp8
from .buffer import Buffer
from .config import Config
from .handles import DispatchHandle, LowLatencyHandle
from .routing import unpack_layout_range


class DispatchOutput(NamedTuple):
    recv_x: torch.Tensor  # [N, H]; float8_e4m3fn data with use_fp8
    recv_x_scales: Optional[torch.Tensor]  # [N, H/128] float32 with use_fp8
    recv_topk_idx: torch.Tensor  # [N, k] int64 local expert ids or -1
    recv_topk_weights: torch.Tensor  # [N, k] float32
    num_recv_tokens_per_expert_list: list[int]
    handle: DispatchHandle
    grad_carrier: Optional[torch.Tensor]  # [N, H] zero-storage bf16 with use_fp8


class LowLatencyDispatchOutput(NamedTuple):
    recv_x: torch.Tensor  # [E_local, R*max, H]
    recv_x_scales: Optional[torch.Tensor]
    recv_count: torch.Tensor  # [E_local] int32
    handle: LowLatencyHandle
    grad_carrier: Optional[torch.Tensor]


def _carrier(shape: torch.Size, device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.bfloat16, device=device).expand(shape)


def _grad_or_zeros(grad: Optional[torch.Tensor], shape: torch.Size, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """The incoming gradient as a contiguous `dtype` tensor, zeros of `shape` when absent."""
    if grad is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return grad.to(dtype).contiguous()


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: torch.Tensor, buffer: Buffer, topk_idx: torch.Tensor,
                num_experts: int, options: dict, box: list) -> tuple[torch.Tensor, ...]:
        layout = buffer.get_dispatch_layout(topk_idx, num_experts)
        tokens = fp8.per_token_cast_to_fp8(x, options["round_scale"]) if options["use_fp8"] else x
        recv, recv_idx, recv_w, per_expert, handle, _ = buffer.dispatch(
            tokens, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
            topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=options["expert_alignment"],
            num_worst_tokens=options["num_worst_tokens"], config=options["config"])
        ctx.buffer, ctx.handle, ctx.config, ctx.x_dtype = buffer, handle, options["combine_config"], x.dtype
        ctx.use_fp8 = options["use_fp8"]
        ctx.recv_shape = (recv[0] if ctx.use_fp8 else recv).shape
        ctx.save_for_backward(recv_idx)
        box.extend([per_expert, handle])
        if ctx.use_fp8:
            data, scales = recv
            ctx.mark_non_differentiable(data, scales, recv_idx)
            return data, scales, recv_idx, recv_w, _carrier(data.shape, data.device)
        ctx.mark_non_differentiable(recv_idx)
        return recv, recv_idx, recv_w

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        (recv_idx,) = ctx.saved_tensors
        grad_x, grad_w = (grads[4], grads[3]) if ctx.use_fp8 else (grads[0], grads[2])
        grad_dtype = torch.bfloat16 if ctx.use_fp8 else ctx.x_dtype
        grad_x = _grad_or_zeros(grad_x, ctx.recv_shape, grad_dtype, recv_idx.device)
        # Only the slots owned by this rank came from the forward pass; others were constant zeros.
        grad_w = torch.where(recv_idx >= 0, _grad_or_zeros(grad_w, recv_idx.shape, torch.float32, recv_idx.device), 0.0)
        combined, combined_w, _ = ctx.buffer.combine(grad_x, ctx.handle, topk_weights=grad_w, config=ctx.config)
        ctx.handle = None
        return combined.to(ctx.x_dtype), combined_w, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias_0: Optional[torch.Tensor], bias_1: Optional[torch.Tensor],
                buffer: Buffer, handle: DispatchHandle, config: Optional[Config],
                dispatch_config: Optional[Config]) -> torch.Tensor:
        bias = (bias_0, bias_1) if bias_1 is not None else bias_0
        combined, _, _ = buffer.combine(x, handle, bias=bias, config=config)
        ctx.buffer, ctx.handle, ctx.config = buffer, handle, dispatch_config
        ctx.has_bias = (bias_0 is not None, bias_1 is not None)
        return combined

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        grad = grad.contiguous()
        grad_x, *_ = ctx.buffer.dispatch(grad, handle=ctx.handle, config=ctx.config)
        ctx.handle = None
        grad_b0 = grad if ctx.has_bias[0] else None
        grad_b1 = grad if ctx.has_bias[1] else None
        return grad_x, grad_b0, grad_b1, None, None, None, None


def dispatch(
    buffer: Buffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    *,
    expert_alignment: int = 1,
    num_worst_tokens: int = 0,
    use_fp8: bool = False,
    round_scale: bool = False,
    config: Optional[Config] = None,
    combine_config: Optional[Config] = None,
) -> DispatchOutput:
    """Differentiable normal-mode dispatch of `x [T, H]` with its routing (layout computed inside).

    Gradients flow to `x` and `topk_weights`. With `use_fp8`, tokens travel as e4m3 with 1x128
    scales and `grad_carrier` routes the BF16 gradient back (see the module docstring).
    """
    box: list = []
    options = dict(expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens, use_fp8=use_fp8,
                   round_scale=round_scale, config=config, combine_config=combine_config)
    outputs = _Dispatch.apply(x, topk_weights, buffer, topk_idx, num_experts, options, box)
    per_expert, handle = box
    if use_fp8:
        data, scales, recv_idx, recv_w, carrier = outputs
        return DispatchOutput(data, scales, recv_idx, recv_w, per_expert, handle, carrier)
    recv, recv_idx, recv_w = outputs
    return DispatchOutput(recv, None, recv_idx, recv_w, per_expert, handle, None)


def combine(
    buffer: Buffer,
    x: torch.Tensor,
    handle: DispatchHandle,
    bias: Optional[torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = None,
    *,
    config: Optional[Config] = None,
    dispatch_config: Optional[Config] = None,
) -> torch.Tensor:
    """Differentiable normal-mode combine: sums each row back to its source token, plus `bias`."""
    bias_0, bias_1 = (bias if isinstance(bias, tuple) else (bias, None))
    return _Combine.apply(x, bias_0, bias_1, buffer, handle, config, dispatch_config)


class _LowLatencyDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, buffer: Buffer, topk_idx: torch.Tensor, max_tokens: int,
                num_experts: int, options: dict, box: list) -> tuple[torch.Tensor, ...]:
        recv, recv_count, handle, _, _ = buffer.low_latency_dispatch(
            x, topk_idx, max_tokens, num_experts, use_fp8=options["use_fp8"], round_scale=options["round_scale"],
            use_ue8m0=options["use_ue8m0"])
        ctx.buffer, ctx.handle, ctx.use_fp8 = buffer, handle, options["use_fp8"]
        ctx.recv_shape = (recv[0] if ctx.use_fp8 else recv).shape
        ctx.save_for_backward(topk_idx)
        box.append(handle)
        if ctx.use_fp8:
            data, scales = recv
            ctx.mark_non_differentiable(data, scales, recv_count)
            return data, scales, recv_count, _carrier(data.shape, data.device)
        ctx.mark_non_differentiable(recv_count)
        return recv, recv_count

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        (topk_idx,) = ctx.saved_tensors
        handle: LowLatencyHandle = ctx.handle
        grad = _grad_or_zeros(grads[3] if ctx.use_fp8 else grads[0], ctx.recv_shape, torch.bfloat16, topk_idx.device)
        ones = torch.ones(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
        grad_x, _, _ = ctx.buffer.low_latency_combine(grad, topk_idx, ones, handle)
        ctx.handle = None
        return grad_x, None, None, None, None, None, None


def low_latency_dispatch(
    buffer: Buffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    *,
    use_fp8: bool = False,
    round_scale: bool = False,
    use_ue8m0: bool = False,
) -> LowLatencyDispatchOutput:
    """Differentiable low-latency dispatch; the gradient of `x` is a low-latency combine with unit weights."""
    box: list = []
    options = dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
    outputs = _LowLatencyDispatch.apply(x, buffer, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, options,
                                        box)
    if use_fp8:
        data, scales, recv_count, carrier = outputs
        return LowLatencyDispatchOutput(data, scales, recv_count, box[0], carrier)
    recv, recv_count = outputs
    return LowLatencyDispatchOutput(recv, None, recv_count, box[0], None)


def _bytes_as_bf16(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.bfloat16)


class _LowLatencyCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: torch.Tensor, buffer: Buffer, topk_idx: torch.Tensor,
                handle: LowLatencyHandle) -> torch.Tensor:
        combined, _, _ = buffer.low_latency_combine(x, topk_idx, topk_weights, handle)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.save_for_backward(x, topk_weights, topk_idx)
        return combined

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, topk_weights, topk_idx = ctx.saved_tensors
        buffer: Buffer = ctx.buffer
        handle: LowLatencyHandle = ctx.handle
        num_topk = topk_idx.size(1)
        num_local = handle.num_experts // buffer.group_size
        dispatch_args = (topk_idx, handle.num_max_dispatch_tokens_per_rank, handle.num_experts)

        # Each expert row needs the output gradient of its token and the weight of its slot: send both.
        grad_rows, _, _, _, _ = buffer.low_latency_dispatch(grad.to(torch.bfloat16).contiguous(), *dispatch_args,
                                                            use_fp8=False)
        meta = torch.cat([_bytes_as_bf16(topk_idx), _bytes_as_bf16(topk_weights)], dim=1)
        meta = torch.nn.functional.pad(meta, (0, (-meta.size(1)) % 8))
        meta_rows, _, _, _, _ = buffer.low_latency_dispatch(meta, *dispatch_args, use_fp8=False)
        row_topk = meta_rows[..., :4 * num_topk].contiguous().view(torch.int64)
        row_weights = meta_rows[..., 4 * num_topk:6 * num_topk].contiguous().view(torch.float32)
        expert_ids = buffer.rank * num_local + torch.arange(num_local, device=x.device)
        valid_rows = torch.arange(x.size(1), device=x.device) < unpack_layout_range(handle.layout_range)[0].sum(1, keepdim=True)
        # [E_local, R*max, k]: one hit per valid row, none on padding rows (whose contents are unspecified).
        slot_match = (row_topk == expert_ids[:, None, None]) & valid_rows[..., None]
        row_weight = (row_weights * slot_match).sum(-1, keepdim=True)
        grad_x = (grad_rows.float() * row_weight).to(x.dtype)

        # d loss / d weight = <grad, expert output>; return it in the column of its slot (one per row).
        dots = (grad_rows.float() * x.float()).sum(-1, keepdim=True)
        per_slot = torch.zeros(x.shape, dtype=torch.bfloat16, device=x.device)
        per_slot[..., :num_topk] = (slot_match * dots).to(torch.bfloat16)
        ones = torch.ones_like(topk_weights)
        grad_w, _, _ = buffer.low_latency_combine(per_slot, topk_idx, ones, handle)
        ctx.handle = None
        grad_w = torch.where(topk_idx >= 0, grad_w[:, :num_topk].float(), 0.0)
        return grad_x, grad_w, None, None, None


def low_latency_combine(
    buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle
) -> torch.Tensor:
    """Differentiable low-latency combine (weighted); gradients flow to `x` and `topk_weights`.

    Backward needs `hidden >= num_topk` and moves the output gradient plus the routing metadata with
    two low-latency dispatches and one combine.
    """
    return _LowLatencyCombine.apply(x, topk_weights, buffer, topk_idx, handle)
