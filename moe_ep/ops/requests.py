"""One frozen request per communication operation: its checked arguments, as every backend takes them.

`moe_ep.ops.validation` builds them from a `Buffer` call (raising on bad input); a backend reads
them and moves data. Shapes use the notation of docs/semantics.md (`T` tokens, `H` hidden, `k` top-k
slots, `R` ranks, `E` experts). Requests are named tuples: one is built per call, and a tuple costs a
quarter of a frozen dataclass to build; its fields are the operation's inputs.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol

import torch

from .config import Config
from .handles import DispatchHandle, LowLatencyHandle

DTYPE_CODES = {dtype: code for code, dtype in enumerate(
    (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int32))}
"""A number per token dtype, so that ranks can compare dtypes in an integer all-gather."""


class Request(Protocol):
    """What every request offers the `Buffer`; its fields (tensors and handles) are the operation's inputs."""

    def agreed(self) -> dict[str, int]:
        """The settings every rank must share for this operation, by the name an error shows."""


class DispatchRequest(NamedTuple):
    """A normal-mode dispatch; with `handle`, a cached dispatch (no layout, top-k or alignment then)."""

    x: torch.Tensor  # [T, H] bf16/fp16/fp32/fp64, or float8_e4m3fn with x_scales
    x_scales: Optional[torch.Tensor]  # [T, H/128] float32 (or packed UE8M0 int32) with FP8 x
    topk_idx: Optional[torch.Tensor]  # [T, k] int64, -1 = masked
    topk_weights: Optional[torch.Tensor]  # [T, k] float32
    num_tokens_per_rank: Optional[torch.Tensor]  # [R] int32
    is_token_in_rank: Optional[torch.Tensor]  # [T, R] bool
    num_tokens_per_expert: Optional[torch.Tensor]  # [E] int32
    expert_alignment: int
    num_worst_tokens: int
    config: Config
    handle: Optional[DispatchHandle] = None

    @property
    def cached(self) -> bool:
        return self.handle is not None

    @property
    def num_experts(self) -> int:
        """E (0 for a cached dispatch, which does not route)."""
        return 0 if self.num_tokens_per_expert is None else self.num_tokens_per_expert.numel()

    def agreed(self) -> dict[str, int]:
        return {"cached": int(self.cached), "hidden (x.shape[1])": self.x.size(1), "x.dtype": DTYPE_CODES[self.x.dtype],
                "x scales": -1 if self.x_scales is None else self.x_scales.size(1),
                "topk_idx.shape[1]": 0 if self.topk_idx is None else self.topk_idx.size(1),
                "topk_weights given": int(self.topk_weights is not None), "num_experts": self.num_experts,
                "config.num_sms": self.config.num_sms}


class CombineRequest(NamedTuple):
    """A normal-mode combine of the rows a dispatch delivered, back onto their source tokens."""

    x: torch.Tensor  # [N, H], the rows of the dispatch behind `handle`
    handle: DispatchHandle
    topk_weights: Optional[torch.Tensor]  # [N, k] float32
    bias_0: Optional[torch.Tensor]  # [T, H] in x's dtype
    bias_1: Optional[torch.Tensor]  # [T, H] in x's dtype
    config: Config

    def agreed(self) -> dict[str, int]:
        return {"hidden (x.shape[1])": self.x.size(1), "x.dtype": DTYPE_CODES[self.x.dtype],
                "topk_weights.shape[1]": -1 if self.topk_weights is None else self.topk_weights.size(1)}


class LowLatencyDispatchRequest(NamedTuple):
    """A low-latency dispatch into the packed `[E/R, R * num_max_dispatch_tokens_per_rank, H]` layout."""

    x: torch.Tensor  # [T, H] bf16, T <= num_max_dispatch_tokens_per_rank
    topk_idx: torch.Tensor  # [T, k] int64, -1 = masked
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    cumulative_local_expert_recv_stats: Optional[torch.Tensor]  # [E/R] int32, added to
    dispatch_wait_recv_cost_stats: Optional[torch.Tensor]  # [R] int64, added to (ns)
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    return_recv_hook: bool

    def agreed(self) -> dict[str, int]:
        return {"hidden (x.shape[1])": self.x.size(1), "num_experts": self.num_experts,
                "num_max_dispatch_tokens_per_rank": self.num_max_dispatch_tokens_per_rank,
                "use_fp8": int(self.use_fp8), "round_scale": int(self.round_scale), "use_ue8m0": int(self.use_ue8m0)}


class LowLatencyCombineRequest(NamedTuple):
    """A low-latency combine: expert outputs back to their tokens, weighted and summed."""

    x: torch.Tensor  # [E/R, R * max, H] bf16 (read from the send buffer instead with zero_copy)
    topk_idx: torch.Tensor  # [T, k] int64, routing as the dispatch behind `handle`
    topk_weights: torch.Tensor  # [T, k] float32
    handle: LowLatencyHandle
    zero_copy: bool
    return_recv_hook: bool
    out: Optional[torch.Tensor]  # [T, H] bf16, written in place
    combine_wait_recv_cost_stats: Optional[torch.Tensor]  # [R] int64, added to (ns)
    use_logfmt: bool = False  # partial rows travel in LogFMT-10 (moe_ep.ops.logfmt)

    def agreed(self) -> dict[str, int]:
        return {"hidden": self.handle.hidden, "num_experts": self.handle.num_experts,
                "num_max_dispatch_tokens_per_rank": self.handle.num_max_dispatch_tokens_per_rank,
                "use_logfmt": int(self.use_logfmt)}
