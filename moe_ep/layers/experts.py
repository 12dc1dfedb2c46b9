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
and input gradients the dequantized weights. It runs in BF16, except on CUDA with Triton (sm_90+),
where both FP8 GEMMs and the input-gradient GEMMs run as blockwise-scaled FP8 grouped GEMMs
(`fp8_grouped_gemm`: the TMA + wgmma kernel of `moe_ep._fp8` where it is built, else Triton): the output gradients are then cast to e4m3 (1x128) for the input-gradient
GEMMs, one more rounding of the same straight-through gradient. Weight gradients stay BF16. There
the casts are fused Triton kernels (`fp8_casts`, bit for bit those of `moe_ep.ops.fp8`), the weight
cast also writes each weight transposed, which the input-gradient GEMM reads, and the SwiGLU and its
gradient are computed in float32 in the passes that cast their outputs to FP8.

With `fp8_weight_grads`, the weight gradients are FP8 GEMMs too (`fp8_grouped_weight_grad`): both
operands are cast along the tokens, each expert's tokens padded to 128, the output gradient with one
scale per channel per 128 tokens and the activation with one per 128x128 block. Off by default: on an
H200 at DeepSeek-V3 shapes it is slower than the BF16 weight gradients (session 18,
`docs/perf-notes-fp8-gemm.md`).
"""

from __future__ import annotations

import math
from functools import cache, cached_property
from types import ModuleType
from typing import NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.fp8 import (BLOCK, FP8_DTYPE, padded_segment_ends, per_block_cast_back, per_block_cast_to_fp8,
                       per_column_segments_cast_to_fp8, per_token_cast_back, per_token_cast_to_fp8, unpack_ue8m0)
from ..ops.validation import check_tensor

FP8Tokens = tuple[torch.Tensor, torch.Tensor]
"""`(q float8_e4m3fn [..., H], scales)`: `per_token_cast_to_fp8` output (float32 or UE8M0 scales)."""


class FP8Weight(NamedTuple):
    """Expert weights `[E, M, K]` cast to e4m3 with float32 128x128 block `scales [E, M/128, K/128]`.

    `q_t` is `q` transposed (`[E, K, M]`, contiguous) where the weights were cast for the Triton
    GEMMs, whose input-gradient GEMM reads it; None elsewhere.
    """

    q: torch.Tensor
    scales: torch.Tensor
    q_t: Optional[torch.Tensor] = None


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# cuBLAS blockwise FP8 GEMMs want the rows of A in multiples of this.
_SCALED_MM_ROW_MULTIPLE = 4
GROUPED_MM_ROW_ALIGNMENT = 8
"""Rows per expert segment (a multiple of) that the BF16 grouped GEMMs need on CUDA."""


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class ExpertSegments:
    """Which rows of a flattened expert-major `[N, ...]` tensor belong to which local expert."""

    def __init__(self, tokens_per_expert: torch.Tensor, num_rows: int, rows_per_expert: Optional[int] = None,
                 tokens_per_expert_list: Optional[Sequence[int]] = None, alignment: int = 1) -> None:
        """Contiguous segments of `tokens_per_expert` rows (each a multiple of `alignment`), or
        (`rows_per_expert` given) fixed segments of that many rows whose first `tokens_per_expert[e]`
        rows are valid."""
        device = tokens_per_expert.device
        self.packed = rows_per_expert is not None
        self.alignment = alignment if rows_per_expert is None else rows_per_expert
        if rows_per_expert is None:
            self.offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        else:
            num_experts = tokens_per_expert.numel()
            self.offsets = ((torch.arange(num_experts, device=device) + 1) * rows_per_expert).to(torch.int32)
            tokens_per_expert_list = [rows_per_expert] * num_experts
        self.num_rows = num_rows
        self._rows_per_expert = rows_per_expert
        self._tokens_per_expert = tokens_per_expert
        self._host_counts = tokens_per_expert_list

    @cached_property
    def valid(self) -> torch.Tensor:
        """`[N]` bool device mask of the rows that belong to an expert (built on first use only)."""
        rows = torch.arange(self.num_rows, device=self.offsets.device)
        if self._rows_per_expert is None:
            return rows < self.offsets[-1]
        return rows % self._rows_per_expert < self._tokens_per_expert.repeat_interleave(self._rows_per_expert)

    @cached_property
    def bounds(self) -> list[int]:
        """Host row bounds `[0, end_0, ..., end_{E-1}]` (a device sync unless counts were given)."""
        counts = self._host_counts if self._host_counts is not None else self._tokens_per_expert.tolist()
        bounds = [0]
        for count in counts:
            bounds.append(bounds[-1] + int(count))
        if bounds[-1] > self.num_rows:
            raise ValueError(f"tokens_per_expert: the experts hold {bounds[-1]} rows but x has {self.num_rows}")
        return bounds

    def starts_and_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Device `[E]` int32 first rows and row counts of the experts' (valid) rows."""
        counts = self._tokens_per_expert.to(torch.int32)
        segment_rows = self._rows_per_expert if self.packed else counts
        return self.offsets - segment_rows, counts

    def ranges(self) -> list[tuple[int, int, int]]:
        """`(expert, begin, end)` of every expert's rows."""
        return [(e, b, end) for e, (b, end) in enumerate(zip(self.bounds[:-1], self.bounds[1:]))]

    @cached_property
    def all_rows_valid(self) -> bool:
        """Whether no row is ignored: contiguous segments covering every row, known from host counts."""
        return not self.packed and self._host_counts is not None and self.bounds[-1] == self.num_rows

    def mask(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` with the ignored rows set to 0 (a select, so NaN garbage there cannot leak)."""
        if self.all_rows_valid:
            return rows
        return torch.where(self.valid[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))

    def mask_packed(self, rows: torch.Tensor) -> torch.Tensor:
        """`mask(rows)` in the packed layout, whose ignored rows lie inside the segments; `rows` as
        they are in the contiguous layout, for FP8 GEMM outputs (zeros past the last segment) and
        for operands that are only contracted over the segments."""
        return self.mask(rows) if self.packed else rows


def _uses_grouped_mm(x: torch.Tensor, seg: ExpertSegments) -> bool:
    # The weight-gradient GEMM contracts over each segment: CUDA needs 16-byte aligned groups there
    # (8 BF16 rows) and asserts on the device otherwise, so unaligned segments take the loop.
    return (_GROUPED_MM is not None and x.is_cuda and x.dtype == torch.bfloat16
            and seg.alignment % GROUPED_MM_ROW_ALIGNMENT == 0)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, seg: ExpertSegments) -> torch.Tensor:
    """`x[rows of e] @ weight[e].T` for every expert: `[N, K] x [E, M, K] -> [N, M]`.

    Rows outside every segment are unspecified (callers mask them). One device-offset grouped
    GEMM on CUDA BF16; elsewhere an exact loop over experts. Every expert's weight joins the
    autograd graph, even without rows, so its gradient is 0 rather than missing.
    """
    if _uses_grouped_mm(x, seg):
        return _GROUPED_MM(x, weight.transpose(-2, -1), offs=seg.offsets)
    parts = [x[begin:end] @ weight[e].t() for e, begin, end in seg.ranges()]
    return torch.cat(parts + [x.new_zeros(x.size(0) - seg.bounds[-1], weight.size(-2))])


def grouped_weight_grad(grad: torch.Tensor, x: torch.Tensor, seg: ExpertSegments) -> torch.Tensor:
    """`grad[rows of e].T @ x[rows of e]` for every expert: `[N, M], [N, K] -> [E, M, K]`."""
    if _uses_grouped_mm(x, seg):
        return _GROUPED_MM(grad.t(), x, offs=seg.offsets)
    out = x.new_zeros(seg.offsets.numel(), grad.size(1), x.size(1))
    for e, begin, end in seg.ranges():
        out[e] = grad[begin:end].t() @ x[begin:end]
    return out


def fp8_grouped_weight_grad(grad: torch.Tensor, x: FP8Tokens, seg: ExpertSegments) -> torch.Tensor:
    """`grad[rows of e].T @ dequant(x)[rows of e]` in FP8: `[N, M], [N, K] -> [E, M, K]` BF16.

    Both operands are cast along the tokens, every expert's tokens padded with zeros to a multiple of
    128 (`per_column_segments_cast_to_fp8`): `grad` with one scale per channel per 128 tokens, `x`
    (dequantized from its 1x128 cast) with one per 128x128 block, so that the GEMM applies one scale
    per output row per K block, as the forward does. The product is the depth-grouped FP8 GEMM of
    `moe_ep._fp8` where it runs, with the casts in Triton; elsewhere the reference: the same
    products of the dequantized casts, accumulated in FP32.
    """
    starts, counts = seg.starts_and_counts()
    padded_ends = padded_segment_ends(counts)
    if _triton_fp8_available(grad.device) and _triton_fp8().gemm.fp8_cuda.runs_on(grad):
        casts, gemm = _triton_fp8()
        grad_t = casts.per_column_segments_cast_to_fp8(grad, None, starts, counts, padded_ends, block_scales=False)
        x_t = casts.per_column_segments_cast_to_fp8(*x, starts, counts, padded_ends, block_scales=True)
        return gemm.fp8_depth_grouped_mm(*grad_t, *x_t, padded_ends)
    grad_t = per_token_cast_back(*per_column_segments_cast_to_fp8(grad, starts, counts, block_scales=False),
                                 dtype=torch.float32)
    x_t = per_block_cast_back(*per_column_segments_cast_to_fp8(per_token_cast_back(*x, dtype=torch.float32), starts,
                                                               counts, block_scales=True), dtype=torch.float32)
    ends = [0] + padded_ends.tolist()
    return torch.stack([grad_t[:, b:e] @ x_t[:, b:e].t() for b, e in zip(ends[:-1], ends[1:])]).to(torch.bfloat16)


class _TritonFP8(NamedTuple):
    casts: ModuleType
    gemm: ModuleType


@cache
def _triton_fp8() -> Optional[_TritonFP8]:
    """The Triton FP8 casts and grouped GEMM, imported on first use (Triton is optional and slow to
    import), or None."""
    try:
        from . import fp8_casts, fp8_grouped_gemm
    except ImportError:
        return None
    return _TritonFP8(fp8_casts, fp8_grouped_gemm)


def _triton_fp8_available(device: torch.device) -> bool:
    """The Triton blockwise FP8 kernels need FP8 tensor cores (sm_90+) and Triton."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            and _triton_fp8() is not None)


def cast_rows_to_fp8(x: torch.Tensor) -> FP8Tokens:
    """`per_token_cast_to_fp8(x)` (1x128, float32 scales): one fused Triton pass where the Triton
    FP8 kernels run, else the reference."""
    if _triton_fp8_available(x.device):
        return _triton_fp8().casts.per_token_cast_to_fp8(x)
    return per_token_cast_to_fp8(x)


def swiglu_to_fp8(z: torch.Tensor) -> FP8Tokens:
    """`per_token_cast_to_fp8(swiglu(gate, up))` of BF16 `z = [gate, up]`: one fused Triton pass (the
    SwiGLU in float32) where the Triton FP8 kernels run, else the reference in BF16."""
    if _triton_fp8_available(z.device):
        return _triton_fp8().casts.swiglu_to_fp8(z)
    return per_token_cast_to_fp8(swiglu(*z.chunk(2, dim=-1)))


def swiglu_backward(z: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, Optional[FP8Tokens]]:
    """The gradient of `swiglu(gate, up)` with respect to BF16 `z = [gate, up]` given `grad`, and
    where the Triton FP8 kernels run its 1x128 e4m3 cast from the same fused pass (else None)."""
    if _triton_fp8_available(z.device):
        return _triton_fp8().casts.swiglu_backward_to_fp8(z, grad)
    with torch.enable_grad():
        z_leaf = z.detach().requires_grad_()
        (grad_z,) = torch.autograd.grad(swiglu(*z_leaf.chunk(2, dim=-1)), z_leaf, grad)
    return grad_z, None


def rows_from_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`per_token_cast_back(q, scales)` in BF16 (float32 scales): one Triton pass where the Triton
    FP8 kernels run, else the reference."""
    if _triton_fp8_available(q.device):
        return _triton_fp8().casts.per_token_cast_back(q, scales)
    return per_token_cast_back(q, scales, torch.bfloat16)


def cast_weight_to_fp8(weight: torch.Tensor) -> FP8Weight:
    """`per_block_cast_to_fp8(weight)` (128x128), with the transposed copy where the Triton FP8
    kernels run (one fused pass)."""
    if _triton_fp8_available(weight.device):
        return FP8Weight(*_triton_fp8().casts.per_block_cast_to_fp8_with_transpose(weight))
    return FP8Weight(*per_block_cast_to_fp8(weight))


def _blockwise_fp8_gemm_available(device: torch.device) -> bool:
    """Blockwise (1x128 / 128x128) `F.scaled_mm` exists on sm_90 only (see `shared/ANCHORS.md`)."""
    return device.type == "cuda" and hasattr(F, "scaled_mm") and torch.cuda.get_device_capability(device) == (9, 0)


def fp8_grouped_linear(x: FP8Tokens, weight: FP8Weight, seg: ExpertSegments) -> torch.Tensor:
    """Blockwise-scaled `x[rows of e] @ weight[e].T` in FP32, rounded to BF16.

    `x` is `(q [N, K], scales [N, K/128] float32)`, `weight` `[E, M, K]` blockwise e4m3.
    Rows past the last segment are zeros. On CUDA sm_90+ this is one grouped FP8 GEMM with device
    offsets (`fp8_grouped_gemm`: the `moe_ep._fp8` kernel, or Triton); on sm_90 without Triton, one
    cuBLAS FP8 GEMM per expert (host-side bounds); elsewhere the reference: the same products of
    dequantized values, accumulated in FP32.
    """
    if _triton_fp8_available(x[0].device):
        return _triton_fp8().gemm.fp8_grouped_mm(*x, weight.q, weight.scales, seg.offsets)
    if _blockwise_fp8_gemm_available(x[0].device):
        return _scaled_mm_per_expert(x, weight, seg)
    dense_x = per_token_cast_back(*x, dtype=torch.float32)
    dense_w = per_block_cast_back(weight.q, weight.scales, dtype=torch.float32)
    return seg.mask(grouped_linear(dense_x, dense_w, seg)).to(torch.bfloat16)


def _scaled_mm_per_expert(x: FP8Tokens, weight: FP8Weight, seg: ExpertSegments) -> torch.Tensor:
    (q, scales), (w_q, w_scales) = x, weight[:2]
    # cuBLAS also wants the weight scales' K-block count padded to a multiple of 4.
    w_scales = F.pad(w_scales, (0, -w_scales.size(-1) % 4))
    out = q.new_zeros(q.size(0), w_q.size(-2), dtype=torch.bfloat16)
    for e, begin, end in seg.ranges():
        if end == begin:
            continue
        if (end - begin) % _SCALED_MM_ROW_MULTIPLE:
            raise ValueError(f"tokens_per_expert: FP8 GEMMs on GPU need every expert's rows in multiples of "
                             f"{_SCALED_MM_ROW_MULTIPLE} (set expert_alignment); expert {e} has {end - begin}")
        out[begin:end] = F.scaled_mm(
            q[begin:end], w_q[e].t(),
            scales[begin:end].t().contiguous().t(), F.ScalingType.BlockWise1x128,
            w_scales[e].t(), F.ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )
    return out


def fp8_grouped_input_grad(grad: torch.Tensor, weight: FP8Weight, seg: ExpertSegments,
                           grad_8: Optional[FP8Tokens] = None) -> torch.Tensor:
    """`grad[rows of e] @ dequant(weight[e])`: the input gradient of `fp8_grouped_linear`, `[N, M] -> [N, K]`.

    With the transposed weight (`weight.q_t`, cast for the Triton kernels), `grad` is cast to e4m3
    (1x128 along M; `grad_8` if that cast was already made) and the product runs as the forward's
    FP8 grouped GEMM against `W[e]^T`, whose 128x128 block scales are `W[e]`'s transposed; elsewhere
    in BF16 on the dequantized weight. Rows past the last segment are zeros.
    """
    if weight.q_t is not None:
        rows = grad_8 if grad_8 is not None else cast_rows_to_fp8(grad)
        return _triton_fp8().gemm.fp8_grouped_mm(*rows, weight.q_t, weight.scales.transpose(-2, -1), seg.offsets)
    dense_weight = per_block_cast_back(weight.q, weight.scales, grad.dtype).transpose(-2, -1)
    return seg.mask(grouped_linear(grad, dense_weight, seg))


class _FP8SwiGLU(torch.autograd.Function):
    """SwiGLU experts on FP8 tokens; the BF16 input gradient leaves through `carrier`."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, scales: torch.Tensor, carrier: Optional[torch.Tensor],
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, weights_8: tuple[FP8Weight, FP8Weight],
                seg: ExpertSegments, fp8_weight_grads: bool) -> torch.Tensor:
        """`weights_8` are the FP8 casts of the two weights, which only receive the gradients."""
        gate_up_8, down_8 = weights_8
        # Contiguous segments need no masks here: the GEMMs write zeros past the last segment and
        # contract over the segments only.
        z = seg.mask_packed(fp8_grouped_linear((q, scales), gate_up_8, seg))
        h_8 = swiglu_to_fp8(z)
        y = seg.mask_packed(fp8_grouped_linear(h_8, down_8, seg))
        ctx.save_for_backward(q, scales, z, *h_8, *gate_up_8, *down_8)
        ctx.seg = seg
        ctx.fp8_weight_grads = fp8_weight_grads
        ctx.carrier_dtype = None if carrier is None else carrier.dtype
        ctx.weight_dtypes = (gate_up_proj.dtype, down_proj.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        q, scales, z, h_q, h_scales, *weights = ctx.saved_tensors
        gate_up_8, down_8 = FP8Weight(*weights[:3]), FP8Weight(*weights[3:])
        seg: ExpertSegments = ctx.seg
        grad_y = seg.mask_packed(grad_y.to(torch.bfloat16).contiguous())
        grad_down = _weight_grad(grad_y, (h_q, h_scales), seg, ctx.fp8_weight_grads)
        grad_h = fp8_grouped_input_grad(grad_y, down_8, seg)
        grad_z, grad_z_8 = swiglu_backward(z, seg.mask_packed(grad_h))
        grad_gate_up = _weight_grad(grad_z, (q, scales), seg, ctx.fp8_weight_grads)
        grad_x = None
        if ctx.carrier_dtype is not None:
            grad_x = seg.mask_packed(fp8_grouped_input_grad(grad_z, gate_up_8, seg, grad_z_8)).to(ctx.carrier_dtype)
        gate_up_dtype, down_dtype = ctx.weight_dtypes
        return None, None, grad_x, grad_gate_up.to(gate_up_dtype), grad_down.to(down_dtype), None, None, None


def _weight_grad(grad: torch.Tensor, x: FP8Tokens, seg: ExpertSegments, in_fp8: bool) -> torch.Tensor:
    """The experts' weight gradient against the FP8 activation `x`: in FP8, or in BF16 on its dequantized values."""
    if in_fp8:
        return fp8_grouped_weight_grad(grad, x, seg)
    return grouped_weight_grad(grad, seg.mask_packed(rows_from_fp8(*x)), seg)


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
    the weight gradients in FP8 as well (`fp8_grouped_weight_grad`). `cache_fp8_weights` keeps the
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
            out = self._fp8(*cast_rows_to_fp8(flat(x).detach()), flat(x), seg)
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
        weights_8 = (cast_weight_to_fp8(self.gate_up_proj), cast_weight_to_fp8(self.down_proj))
        self._fp8_weight_cache = (key, weights_8) if self.cache_fp8_weights else None
        return weights_8
