"""The experts' arithmetic in BF16 (any dtype): expert segments of an expert-major tensor, the grouped
GEMMs over them, and SwiGLU.

On CUDA in BF16 the grouped GEMMs are torch's grouped GEMM with device offsets (no host sync); elsewhere
an exact loop over the experts.
"""

from __future__ import annotations

from functools import cached_property
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUPED_MM_ROW_ALIGNMENT = 8
"""Rows per expert segment (a multiple of) that the BF16 grouped GEMMs need on CUDA: their weight
gradients contract over each segment, in 16-byte aligned groups."""


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
