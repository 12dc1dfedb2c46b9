"""The experts' blockwise FP8 arithmetic, one class per implementation (`fp8_backend` picks one per device).

Every implementation computes the same function, rounding at the same points: e4m3 tokens with one
float32 scale per row per 128 channels (1x128), e4m3 weights with one per 128x128 block, FP32
accumulation, BF16 results.

* `ReferenceFP8`: `moe_ep.ops.fp8` and GEMMs on the dequantized values in FP32, on any device.
* `CublasFP8`: the reference, but the forward GEMMs are cuBLAS blockwise FP8 GEMMs (`F.scaled_mm`), one
  per expert with host-side bounds (sm_90 without Triton).
* `TritonFP8`: fused Triton casts (the SwiGLU and its gradient computed in float32 in the pass that casts
  their output), the weight cast also writing each weight transposed, and the grouped FP8 GEMM with
  device offsets (`fp8_grouped_gemm`: the `moe_ep._fp8` kernel where it takes the operands, else
  Triton) for the forward and the input gradients, whose output gradients are then cast to e4m3 too.
  With `depth_gemm` (the `moe_ep._fp8` kernels run on the device) the FP8 weight gradients are the
  depth-grouped GEMM of `moe_ep._fp8`; otherwise they take the reference.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..ops.fp8 import (padded_segment_ends, per_block_cast_back, per_block_cast_to_fp8,
                       per_column_segments_cast_to_fp8, per_token_cast_back, per_token_cast_to_fp8)
from .grouped import ExpertSegments, grouped_linear, swiglu

FP8Tokens = tuple[torch.Tensor, torch.Tensor]
"""`(q float8_e4m3fn [..., H], scales)`: `per_token_cast_to_fp8` output (float32 or UE8M0 scales)."""
# cuBLAS blockwise FP8 GEMMs want the rows of A in multiples of this.
_SCALED_MM_ROW_MULTIPLE = 4


class FP8Weight(NamedTuple):
    """Expert weights `[E, M, K]` cast to e4m3 with float32 128x128 block `scales [E, M/128, K/128]`.

    `q_t` is `q` transposed (`[E, K, M]`, contiguous) where the weights were cast for the Triton
    GEMMs, whose input-gradient GEMM reads it; None elsewhere.
    """

    q: torch.Tensor
    scales: torch.Tensor
    q_t: Optional[torch.Tensor] = None


class ReferenceFP8:
    """The FP8 expert arithmetic in PyTorch (see the module docstring)."""

    name = "reference"

    def cast_rows(self, x: torch.Tensor) -> FP8Tokens:
        """`per_token_cast_to_fp8(x)`: 1x128, float32 scales."""
        return per_token_cast_to_fp8(x)

    def swiglu_to_fp8(self, z: torch.Tensor) -> FP8Tokens:
        """`per_token_cast_to_fp8(swiglu(gate, up))` of BF16 `z = [gate, up]` (the SwiGLU in BF16 here)."""
        return per_token_cast_to_fp8(swiglu(*z.chunk(2, dim=-1)))

    def swiglu_backward(self, z: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, Optional[FP8Tokens]]:
        """The gradient of `swiglu(gate, up)` with respect to BF16 `z = [gate, up]` given `grad`, and
        its 1x128 e4m3 cast where the same pass makes it (else None)."""
        with torch.enable_grad():
            z_leaf = z.detach().requires_grad_()
            (grad_z,) = torch.autograd.grad(swiglu(*z_leaf.chunk(2, dim=-1)), z_leaf, grad)
        return grad_z, None

    def rows_from_fp8(self, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """`per_token_cast_back(q, scales)` in BF16 (float32 scales)."""
        return per_token_cast_back(q, scales, torch.bfloat16)

    def cast_weight(self, weight: torch.Tensor) -> FP8Weight:
        """`per_block_cast_to_fp8(weight)` (128x128)."""
        return FP8Weight(*per_block_cast_to_fp8(weight))

    def grouped_linear(self, x: FP8Tokens, weight: FP8Weight, seg: ExpertSegments) -> torch.Tensor:
        """Blockwise-scaled `x[rows of e] @ weight[e].T` in FP32, rounded to BF16: `(q [N, K], scales
        [N, K/128] float32)` and `[E, M, K]` blockwise e4m3 to `[N, M]`. Rows past the last segment are
        zeros."""
        dense_x = per_token_cast_back(*x, dtype=torch.float32)
        dense_w = per_block_cast_back(weight.q, weight.scales, dtype=torch.float32)
        return seg.mask(grouped_linear(dense_x, dense_w, seg)).to(torch.bfloat16)

    def input_grad(self, grad: torch.Tensor, weight: FP8Weight, seg: ExpertSegments,
                   grad_8: Optional[FP8Tokens] = None) -> torch.Tensor:
        """`grad[rows of e] @ dequant(weight[e])`: the input gradient of `grouped_linear`, `[N, M] ->
        [N, K]`, here in BF16 on the dequantized weight (`grad_8`, the e4m3 cast of `grad` where one
        was made, is for the FP8 implementations). Rows past the last segment are zeros."""
        dense_weight = per_block_cast_back(weight.q, weight.scales, grad.dtype).transpose(-2, -1)
        return seg.mask(grouped_linear(grad, dense_weight, seg))

    def weight_grad(self, grad: torch.Tensor, x: FP8Tokens, seg: ExpertSegments) -> torch.Tensor:
        """`grad[rows of e].T @ dequant(x)[rows of e]` in FP8: `[N, M], [N, K] -> [E, M, K]` BF16.

        Both operands are cast along the tokens, every expert's tokens padded with zeros to a multiple
        of 128 (`per_column_segments_cast_to_fp8`): `grad` with one scale per channel per 128 tokens,
        `x` (dequantized from its 1x128 cast) with one per 128x128 block, so that the GEMM applies one
        scale per output row per K block, as the forward does. Here the products of the dequantized
        casts, accumulated in FP32.
        """
        starts, counts = seg.starts_and_counts()
        padded_ends = padded_segment_ends(counts)
        grad_t = per_token_cast_back(*per_column_segments_cast_to_fp8(grad, starts, counts, block_scales=False),
                                     dtype=torch.float32)
        x_t = per_block_cast_back(*per_column_segments_cast_to_fp8(per_token_cast_back(*x, dtype=torch.float32),
                                                                   starts, counts, block_scales=True),
                                  dtype=torch.float32)
        ends = [0] + padded_ends.tolist()
        return torch.stack([grad_t[:, b:e] @ x_t[:, b:e].t() for b, e in zip(ends[:-1], ends[1:])]).to(torch.bfloat16)


class CublasFP8(ReferenceFP8):
    """The reference with cuBLAS blockwise FP8 forward GEMMs (see the module docstring)."""

    name = "cublas"

    def grouped_linear(self, x: FP8Tokens, weight: FP8Weight, seg: ExpertSegments) -> torch.Tensor:
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


class TritonFP8(ReferenceFP8):
    """The fused Triton casts and the grouped FP8 GEMMs (see the module docstring)."""

    name = "triton"

    def __init__(self, casts: ModuleType, gemm: ModuleType, depth_gemm: bool) -> None:
        """`casts`, `gemm`: the modules `fp8_casts` and `fp8_grouped_gemm`; `depth_gemm`: whether the
        weight gradients run on the depth-grouped GEMM of `moe_ep._fp8`."""
        self.casts, self.gemm, self.depth_gemm = casts, gemm, depth_gemm

    def cast_rows(self, x: torch.Tensor) -> FP8Tokens:
        return self.casts.per_token_cast_to_fp8(x)

    def swiglu_to_fp8(self, z: torch.Tensor) -> FP8Tokens:
        return self.casts.swiglu_to_fp8(z)

    def swiglu_backward(self, z: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, Optional[FP8Tokens]]:
        return self.casts.swiglu_backward_to_fp8(z, grad)

    def rows_from_fp8(self, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return self.casts.per_token_cast_back(q, scales)

    def cast_weight(self, weight: torch.Tensor) -> FP8Weight:
        return FP8Weight(*self.casts.per_block_cast_to_fp8_with_transpose(weight))

    def grouped_linear(self, x: FP8Tokens, weight: FP8Weight, seg: ExpertSegments) -> torch.Tensor:
        return self.gemm.fp8_grouped_mm(*x, weight.q, weight.scales, seg.offsets)

    def input_grad(self, grad: torch.Tensor, weight: FP8Weight, seg: ExpertSegments,
                   grad_8: Optional[FP8Tokens] = None) -> torch.Tensor:
        # With the transposed weight, the forward's FP8 GEMM against W[e]^T, whose 128x128 block scales
        # are W[e]'s transposed; `grad` cast to e4m3 (1x128 along M) unless that cast was already made.
        if weight.q_t is None:
            return super().input_grad(grad, weight, seg)
        rows = grad_8 if grad_8 is not None else self.cast_rows(grad)
        return self.gemm.fp8_grouped_mm(*rows, weight.q_t, weight.scales.transpose(-2, -1), seg.offsets)

    def weight_grad(self, grad: torch.Tensor, x: FP8Tokens, seg: ExpertSegments) -> torch.Tensor:
        if not self.depth_gemm:
            return super().weight_grad(grad, x, seg)
        starts, counts = seg.starts_and_counts()
        padded_ends = padded_segment_ends(counts)
        grad_t = self.casts.per_column_segments_cast_to_fp8(grad, None, starts, counts, padded_ends,
                                                            block_scales=False)
        x_t = self.casts.per_column_segments_cast_to_fp8(*x, starts, counts, padded_ends, block_scales=True)
        return self.gemm.fp8_depth_grouped_mm(*grad_t, *x_t, padded_ends)
