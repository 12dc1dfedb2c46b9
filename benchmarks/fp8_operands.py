"""The operands of the FP8 grouped GEMM benchmarks and the GEMMs run on them, shared by
`bench_fp8_grouped_gemm.py` (every kernel, timed with the clock sampled) and `fp8_kernel_once.py`
(one kernel, for Nsight Compute): the DeepSeek-V3 expert shapes, uneven expert segments, random BF16
inputs, output gradients and weights, their blockwise FP8 casts, and the forward / input-gradient /
weight-gradient GEMMs as BF16 `torch._grouped_mm` and the blockwise FP8 kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch

from moe_ep.kernels import fp8_grouped_gemm as gemm
from moe_ep.kernels.fp8_casts import (FP8Rows, per_block_cast_to_fp8_with_transpose, per_column_segments_cast_to_fp8,
                                      per_token_cast_to_fp8)
from moe_ep.ops import fp8

ALIGNMENT = 16
HIDDEN, INTERMEDIATE = 7168, 2048
PROJECTIONS = {"gate_up": (HIDDEN, 2 * INTERMEDIATE), "down": (INTERMEDIATE, HIDDEN)}  # (K, M) of the forward


def segment_counts(num_experts: int, rows: int, seed: int) -> list[int]:
    """Uneven rows per expert (a skewed multinomial), each padded up to 16 rows."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.rand(num_experts, generator=g) ** 2 + 0.05
    counts = torch.multinomial(popularity, rows, replacement=True, generator=g).bincount(minlength=num_experts)
    return [int(c + (-c) % ALIGNMENT) for c in counts]


@dataclass
class GroupedOperands:
    """A projection's BF16 operands on expert-major rows: `x [N, depth]` (the forward's input), `grad
    [N, width]` (the output gradient; None where not built), `w [E, width, depth]` (the weights),
    groups of `counts` rows ending at `ends` (int32, cumulative)."""
    counts: list[int]
    ends: torch.Tensor
    x: torch.Tensor
    grad: Optional[torch.Tensor]
    w: torch.Tensor


def grouped_operands(counts: list[int], depth: int, width: int, with_grad: bool = True,
                     device: str = "cuda") -> GroupedOperands:
    """Random BF16 operands of `counts` rows per expert (weights scaled by `depth ** -0.5`)."""
    num_rows = sum(counts)
    ends = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    x = torch.randn(num_rows, depth, device=device, dtype=torch.bfloat16)
    grad = torch.randn(num_rows, width, device=device, dtype=torch.bfloat16) if with_grad else None
    w = torch.randn(len(counts), width, depth, device=device, dtype=torch.bfloat16) / depth ** 0.5
    return GroupedOperands(counts, ends, x, grad, w)


@dataclass
class BlockwiseCasts:
    """The 1x128 casts of the rows (`x_8`, and `grad_8` where there is a gradient) and the 128x128
    casts of the weights (`w_8`) and of their transpose (`w_t_8`, what the input gradient reads)."""
    x_8: FP8Rows
    grad_8: Optional[FP8Rows]
    w_8: tuple[torch.Tensor, torch.Tensor]
    w_t_8: tuple[torch.Tensor, torch.Tensor]


def blockwise_casts(operands: GroupedOperands) -> BlockwiseCasts:
    """`operands` cast the way the FP8 expert MLP casts them."""
    qw, sw, qw_t = per_block_cast_to_fp8_with_transpose(operands.w)
    grad_8 = per_token_cast_to_fp8(operands.grad) if operands.grad is not None else None
    return BlockwiseCasts(per_token_cast_to_fp8(operands.x), grad_8, (qw, sw), (qw_t, sw.transpose(-2, -1)))


def bf16_grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> Callable[[], torch.Tensor]:
    """`a[rows of e] @ b[e].T` (`a [N, K]`, `b [E, N_OUT, K]` BF16, groups ending at `ends`) as BF16
    `torch._grouped_mm`."""
    return partial(torch._grouped_mm, a, b.transpose(-2, -1), offs=ends)


def blockwise_impls(a: torch.Tensor, a_8: FP8Rows, b: torch.Tensor, b_8: tuple[torch.Tensor, torch.Tensor],
                    ends: torch.Tensor) -> tuple[dict, dict]:
    """`a[rows of e] @ b[e].T` (`a [N, K]`, `b [E, N_OUT, K]` BF16) as BF16 `torch._grouped_mm`, and as the
    blockwise FP8 GEMM on their casts `a_8`, `b_8`: Triton (autotuned), and the CUDA kernel where it runs."""
    impls = {"bf16": bf16_grouped_mm(a, b, ends),
             "fp8-triton": partial(gemm.fp8_grouped_mm, *a_8, *b_8, ends, backend="triton")}
    if not gemm.cuda_kernel_runs(a_8[0], b_8[0]):
        return impls, {"fp8-cuda": "the moe_ep._fp8 kernel does not run here (an sm_90a build on an sm_90 GPU)"}
    impls["fp8-cuda"] = partial(gemm.fp8_grouped_mm, *a_8, *b_8, ends, backend="cuda")
    return impls, {}


def weight_grad_operands(counts: list[int], grad: torch.Tensor, x_8: FP8Rows):
    """The depth-grouped GEMM's operands: `grad` and the FP8 rows cast along each expert's tokens."""
    lengths = torch.tensor(counts, device=grad.device, dtype=torch.int32)
    starts = lengths.cumsum(0, dtype=torch.int32) - lengths
    padded_ends = fp8.padded_segment_ends(lengths)

    def casts() -> tuple:
        return (per_column_segments_cast_to_fp8(grad, None, starts, lengths, padded_ends, block_scales=False),
                per_column_segments_cast_to_fp8(*x_8, starts, lengths, padded_ends, block_scales=True))
    return casts, padded_ends


def weight_grad_impls(operands: GroupedOperands, x_8: FP8Rows) -> tuple[dict[str, Callable[[], torch.Tensor]],
                                                                      Callable[[], tuple]]:
    """The weight gradient `grad[rows of e].T @ x[rows of e]` for every expert: BF16 `torch._grouped_mm`
    ("bf16") and the depth-grouped FP8 GEMM on casts made once ("fp8-cuda"; CUDA kernel only), and the
    two casts that GEMM needs, as a callable to time on its own."""
    casts, padded_ends = weight_grad_operands(operands.counts, operands.grad, x_8)
    g_t, x_t = casts()
    impls = {"bf16": bf16_weight_grad(operands),
             "fp8-cuda": partial(gemm.fp8_depth_grouped_mm, *g_t, *x_t, padded_ends)}
    return impls, casts


def bf16_weight_grad(operands: GroupedOperands) -> Callable[[], torch.Tensor]:
    """The weight gradient `grad[rows of e].T @ x[rows of e]` of every expert as BF16 `torch._grouped_mm`."""
    return partial(torch._grouped_mm, operands.grad.t(), operands.x, offs=operands.ends)
