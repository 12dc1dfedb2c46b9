"""Grouped SwiGLU experts over expert-major tokens, in BF16 or in blockwise-scaled FP8.

Tokens come either contiguous per expert (`[N, H]`, expert `e` owning the next
`tokens_per_expert[e]` rows, rows past the last expert ignored) or in the low-latency packed
layout (`[E, M, H]`, expert `e` owning rows `[0, tokens_per_expert[e])` of its slice). Ignored
rows produce zero outputs and receive zero gradients.

FP8 follows DeepSeek-V3: e4m3 activations with one scale per token per 128 channels, e4m3
weights with one scale per 128x128 block (quantized from the parameters on every forward),
FP32 accumulation, BF16 outputs; the SwiGLU output is re-quantized for the down projection.
Backward is the gradient of the computed function with the FP8 casts treated as identity
(straight-through), so weight gradients use the dequantized activations the forward actually saw,
and input gradients the dequantized weights. Weight gradients are BF16 GEMMs. The arithmetic is the
FP8 implementation of the tokens' device (`moe_ep.kernels.fp8_backend`): the reference in PyTorch,
or, on sm_90+ GPUs, fused casts and grouped FP8 GEMMs, where the input-gradient GEMMs are FP8 too
(the output gradients cast to e4m3, one more rounding of the same straight-through gradient).

With `fp8_weight_grads`, the weight gradients are FP8 GEMMs too (`ReferenceFP8.weight_grad`): both
operands are cast along the tokens, each expert's tokens padded to 128, the output gradient with one
scale per channel per 128 tokens and the activation with one per 128x128 block. Off by default: on an
H200 at DeepSeek-V3 shapes it is slower than the BF16 weight gradients.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import nn

from ..kernels.fp8_backend import fp8_backend_for
from ..kernels.fp8_experts import FP8Tokens, FP8Weight, ReferenceFP8
from ..kernels.grouped import ExpertSegments, grouped_linear, grouped_weight_grad, swiglu
from ..ops.fp8 import BLOCK, FP8_DTYPE, per_token_cast_back, unpack_ue8m0
from ..ops.validation import check_tensor


class _FP8SwiGLU(torch.autograd.Function):
    """SwiGLU experts on FP8 tokens; the BF16 input gradient leaves through `carrier`."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, scales: torch.Tensor, carrier: Optional[torch.Tensor],
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, weights_8: tuple[FP8Weight, FP8Weight],
                seg: ExpertSegments, fp8_weight_grads: bool) -> torch.Tensor:
        """`weights_8` are the FP8 casts of the two weights, which only receive the gradients."""
        gate_up_8, down_8 = weights_8
        fp8 = fp8_backend_for(q.device)
        # Contiguous segments need no masks here: the GEMMs write zeros past the last segment and
        # contract over the segments only.
        z = seg.mask_packed(fp8.grouped_linear((q, scales), gate_up_8, seg))
        h_8 = fp8.swiglu_to_fp8(z)
        y = seg.mask_packed(fp8.grouped_linear(h_8, down_8, seg))
        ctx.save_for_backward(q, scales, z, *h_8, *gate_up_8, *down_8)
        ctx.seg, ctx.fp8 = seg, fp8
        ctx.fp8_weight_grads = fp8_weight_grads
        ctx.carrier_dtype = None if carrier is None else carrier.dtype
        ctx.weight_dtypes = (gate_up_proj.dtype, down_proj.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        q, scales, z, h_q, h_scales, *weights = ctx.saved_tensors
        gate_up_8, down_8 = FP8Weight(*weights[:3]), FP8Weight(*weights[3:])
        seg: ExpertSegments = ctx.seg
        fp8: ReferenceFP8 = ctx.fp8
        grad_y = seg.mask_packed(grad_y.to(torch.bfloat16).contiguous())
        grad_down = _weight_grad(fp8, grad_y, (h_q, h_scales), seg, ctx.fp8_weight_grads)
        grad_h = fp8.input_grad(grad_y, down_8, seg)
        grad_z, grad_z_8 = fp8.swiglu_backward(z, seg.mask_packed(grad_h))
        grad_gate_up = _weight_grad(fp8, grad_z, (q, scales), seg, ctx.fp8_weight_grads)
        grad_x = None
        if ctx.carrier_dtype is not None:
            grad_x = seg.mask_packed(fp8.input_grad(grad_z, gate_up_8, seg, grad_z_8)).to(ctx.carrier_dtype)
        gate_up_dtype, down_dtype = ctx.weight_dtypes
        return None, None, grad_x, grad_gate_up.to(gate_up_dtype), grad_down.to(down_dtype), None, None, None


def _weight_grad(fp8: ReferenceFP8, grad: torch.Tensor, x: FP8Tokens, seg: ExpertSegments,
                 in_fp8: bool) -> torch.Tensor:
    """The experts' weight gradient against the FP8 activation `x`: in FP8, or in BF16 on its dequantized values."""
    if in_fp8:
        return fp8.weight_grad(grad, x, seg)
    return grouped_weight_grad(grad, seg.mask_packed(fp8.rows_from_fp8(*x)), seg)


def _float_scales(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Packed UE8M0 scales to float32; float32 scales unchanged."""
    if scales.dtype == torch.int32:
        return unpack_ue8m0(scales)[..., : q.size(-1) // BLOCK]
    return scales


class GroupedMLP(nn.Module):
    """SwiGLU experts `down(silu(gate(x)) * up(x))` for `num_local_experts` experts.

    Weights use the Hugging Face transformers v5 layout: `gate_up_proj [E, 2I, H]` (gate rows, then
    up rows) and `down_proj [E, H, I]`, so expert `e` computes
    `gate, up = (x @ gate_up_proj[e].T).chunk(2)` and `(silu(gate) * up) @ down_proj[e].T`.

    With `use_fp8`, the weights are cast to FP8 on every forward, and `fp8_weight_grads` computes
    the weight gradients in FP8 as well (see the module docstring). `cache_fp8_weights` keeps the
    casts until a parameter's version counter moves (in-place updates: optimizer steps,
    `load_state_dict`). Leave it off where a wrapper refills parameter storage behind autograd's
    back (FSDP-style unsharding), since that may not move the counter.
    """

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int, *, use_fp8: bool = False,
                 fp8_weight_grads: bool = False, cache_fp8_weights: bool = False, segment_alignment: int = 1,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        """`segment_alignment`: the multiple every contiguous expert segment is padded to (the
        dispatcher's `expert_alignment`); BF16 grouped GEMMs on CUDA need a multiple of 8."""
        super().__init__()
        self.segment_alignment = segment_alignment
        if use_fp8 and (hidden_size % BLOCK or intermediate_size % BLOCK):
            raise ValueError(f"use_fp8: hidden_size ({hidden_size}) and intermediate_size ({intermediate_size}) "
                             f"must be multiples of {BLOCK}")
        if fp8_weight_grads and not use_fp8:
            raise ValueError("fp8_weight_grads: expected only with use_fp8=True")
        self.fp8_weight_grads = fp8_weight_grads
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.use_fp8 = use_fp8
        self.cache_fp8_weights = cache_fp8_weights
        self._fp8_weight_cache: Optional[tuple[tuple, tuple[FP8Weight, FP8Weight]]] = None
        factory = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Parameter(torch.empty(num_local_experts, 2 * intermediate_size, hidden_size, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_local_experts, hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in `±1/sqrt(fan_in)` per projection, as `nn.Linear`'s default."""
        for weight in (self.gate_up_proj, self.down_proj):
            bound = 1 / math.sqrt(weight.size(-1))
            nn.init.uniform_(weight, -bound, bound)

    def forward(
        self,
        x: Union[torch.Tensor, FP8Tokens],
        tokens_per_expert: torch.Tensor,
        routing_weights: Optional[torch.Tensor] = None,
        *,
        carrier: Optional[torch.Tensor] = None,
        tokens_per_expert_list: Optional[Sequence[int]] = None,
    ) -> torch.Tensor:
        """Run every local expert on its rows of `x`.

        Args:
            x: `[N, H]` (contiguous per expert) or `[E, M, H]` (packed) tokens, or an FP8 dispatch's
                `(q, scales)` of the same shape, consumed as is on the FP8 path.
            tokens_per_expert: `[E]` integer device tensor of rows per expert (see the module doc).
            routing_weights: optional per-row weights (`[N]` or `[E, M]`), multiplied into the output
                in FP32.
            carrier: with FP8 `x`, a zero-storage tensor shaped like `x` that receives the BF16
                gradient with respect to the dequantized tokens.
            tokens_per_expert_list: host copy of `tokens_per_expert`, saving a device sync on the
                paths that loop over experts (CPU, FP8 on GPU without Triton).

        Returns the expert outputs shaped like `x`: BF16 on the FP8 path, else the dtype of `x`.
        """
        is_fp8 = isinstance(x, tuple)
        rows = x[0] if is_fp8 else x
        self._check_inputs(rows, is_fp8, tokens_per_expert, routing_weights, carrier, tokens_per_expert_list)
        packed_shape = rows.shape if rows.dim() == 3 else None
        num_rows = rows.shape[:-1].numel()
        seg = ExpertSegments(tokens_per_expert, num_rows, None if packed_shape is None else packed_shape[1],
                             tokens_per_expert_list, self.segment_alignment)
        flat = (lambda t: t.flatten(0, 1)) if packed_shape is not None else (lambda t: t)  # noqa: E731
        carrier = None if carrier is None else flat(carrier)
        if is_fp8:
            out = self._from_fp8_tokens(flat(x[0]), flat(_float_scales(*x)), carrier, seg)
        elif self.use_fp8:
            # Straight-through: `x` itself carries the gradient of the tokens' FP8 cast.
            out = self._fp8(*fp8_backend_for(x.device).cast_rows(flat(x).detach()), flat(x), seg)
        else:
            out = self._bf16(flat(x), seg)
        if routing_weights is not None:
            acc = torch.promote_types(out.dtype, torch.float32)
            out = (out.to(acc) * flat(routing_weights).to(acc)[:, None]).to(out.dtype)
        return out if packed_shape is None else out.view(packed_shape)

    def _check_inputs(self, rows: torch.Tensor, is_fp8: bool, tokens_per_expert: torch.Tensor,
                      routing_weights: Optional[torch.Tensor], carrier: Optional[torch.Tensor],
                      tokens_per_expert_list: Optional[Sequence[int]]) -> None:
        packed = (self.num_local_experts, None, self.hidden_size)
        check_tensor("x", rows, dtype=FP8_DTYPE if is_fp8 else None,
                     shape=(None, self.hidden_size) if rows.dim() == 2 else packed)
        check_tensor("tokens_per_expert", tokens_per_expert, shape=(self.num_local_experts,), device=rows.device)
        if tokens_per_expert.is_floating_point():
            raise TypeError(f"tokens_per_expert: expected an integer tensor, got {tokens_per_expert.dtype}")
        if carrier is not None:
            check_tensor("carrier", carrier, shape=tuple(rows.shape))
        if routing_weights is not None:
            check_tensor("routing_weights", routing_weights, shape=tuple(rows.shape[:-1]))
        if tokens_per_expert_list is not None and len(tokens_per_expert_list) != self.num_local_experts:
            raise ValueError(f"tokens_per_expert_list: expected {self.num_local_experts} counts, "
                             f"got {len(tokens_per_expert_list)}")

    def _from_fp8_tokens(self, q: torch.Tensor, scales: torch.Tensor, carrier: Optional[torch.Tensor],
                         seg: ExpertSegments) -> torch.Tensor:
        if self.use_fp8:
            return self._fp8(q, scales, carrier, seg)
        dense = per_token_cast_back(q, scales, self.gate_up_proj.dtype)
        # Adding the all-zero carrier changes no value but routes the tokens' gradient into it.
        return self._bf16(dense if carrier is None else dense + carrier, seg)

    def _bf16(self, x: torch.Tensor, seg: ExpertSegments) -> torch.Tensor:
        x = seg.mask(x)
        z = grouped_linear(x, self.gate_up_proj.to(x.dtype), seg)
        h = swiglu(*z.chunk(2, dim=-1))
        return seg.mask(grouped_linear(h, self.down_proj.to(x.dtype), seg))

    def _fp8(self, q: torch.Tensor, scales: torch.Tensor, carrier: Optional[torch.Tensor],
             seg: ExpertSegments) -> torch.Tensor:
        return _FP8SwiGLU.apply(q, scales, carrier, self.gate_up_proj, self.down_proj, self._fp8_weights(), seg,
                                self.fp8_weight_grads)

    @torch.no_grad()
    def _fp8_weights(self) -> tuple[FP8Weight, FP8Weight]:
        params = (self.gate_up_proj, self.down_proj)
        key = tuple((p._version, p.data_ptr(), p.device, p.dtype) for p in params)
        if self.cache_fp8_weights and self._fp8_weight_cache is not None and self._fp8_weight_cache[0] == key:
            return self._fp8_weight_cache[1]
        self._fp8_weight_cache = None  # freed before the new casts are made
        fp8 = fp8_backend_for(self.gate_up_proj.device)
        weights_8 = (fp8.cast_weight(self.gate_up_proj), fp8.cast_weight(self.down_proj))
        self._fp8_weight_cache = (key, weights_8) if self.cache_fp8_weights else None
        return weights_8
