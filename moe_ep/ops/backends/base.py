"""The interface every communication backend implements behind `moe_ep.Buffer`.

The Buffer front end validates arguments, orders streams and events, and converts results to
DeepEP's return tuples; a backend only moves data. Both implementations (`torch`, `cuda`) must give
identical results and orderings (see docs/semantics.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Mapping, NamedTuple, Optional

import torch
import torch.distributed as dist

from ..config import Config
from ..handles import DispatchHandle, LowLatencyHandle
from ..routing import DispatchLayout

RecvHook = Callable[[], None]


class DispatchResult(NamedTuple):
    recv_x: torch.Tensor  # [N, H]
    recv_x_scales: Optional[torch.Tensor]  # [N, H/128] float32 when x was FP8
    recv_topk_idx: Optional[torch.Tensor]  # [N, k] int64, local expert ids or -1
    recv_topk_weights: Optional[torch.Tensor]  # [N, k] float32, 0 where not local
    num_recv_tokens_per_expert_list: list[int]  # aligned counts; empty with num_worst_tokens
    handle: DispatchHandle


class LowLatencyDispatchResult(NamedTuple):
    recv_x: torch.Tensor  # [E_local, R * max, H] float8_e4m3fn or bfloat16
    recv_x_scales: Optional[torch.Tensor]  # [E_local, R * max, G] float32 or int32 (UE8M0), token-dim contiguous
    recv_count: torch.Tensor  # [E_local] int32
    handle: LowLatencyHandle


class CommBackend(ABC):
    """Moves tokens between the ranks of `group`. Arguments arrive already validated."""

    name: str = "abstract"

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int) -> None:
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks

    @staticmethod
    def supports(tensor: torch.Tensor) -> bool:
        """Whether this backend can serve an operation on tensors like `tensor`."""
        return True

    @abstractmethod
    def agree(self, op: str, fields: Mapping[str, int], local_error: Optional[Exception], device: torch.device) -> None:
        """Make every rank fail together when any rank rejected its input or the ranks disagree on a
        setting in `fields`; re-raise `local_error` on the rank that found it."""

    @abstractmethod
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout: ...

    @abstractmethod
    def dispatch(
        self,
        x: torch.Tensor,
        x_scales: Optional[torch.Tensor],
        topk_idx: Optional[torch.Tensor],
        topk_weights: Optional[torch.Tensor],
        num_tokens_per_rank: torch.Tensor,
        is_token_in_rank: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
        expert_alignment: int,
        num_worst_tokens: int,
        config: Config,
    ) -> DispatchResult: ...

    @abstractmethod
    def cached_dispatch(
        self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle, config: Config
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]: ...

    @abstractmethod
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: Optional[torch.Tensor],
        bias_0: Optional[torch.Tensor],
        bias_1: Optional[torch.Tensor],
        config: Config,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]: ...

    @abstractmethod
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[torch.Tensor],
        dispatch_wait_recv_cost_stats: Optional[torch.Tensor],
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        return_recv_hook: bool,
    ) -> tuple[LowLatencyDispatchResult, Optional[RecvHook]]: ...

    @abstractmethod
    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        zero_copy: bool,
        return_recv_hook: bool,
        out: Optional[torch.Tensor],
        combine_wait_recv_cost_stats: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, Optional[RecvHook]]: ...

    @abstractmethod
    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor: ...

    @abstractmethod
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None: ...

    def destroy(self) -> None:
        """Release resources; the backend is unusable afterwards."""
