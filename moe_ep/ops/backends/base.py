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

from ..handles import DispatchHandle, LowLatencyHandle
from ..requests import CombineRequest, DispatchRequest, LowLatencyCombineRequest, LowLatencyDispatchRequest, Request
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
    """Moves tokens between the ranks of `group`. Requests arrive already validated."""

    name: str = "abstract"

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int) -> None:
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks

    @abstractmethod
    def agree(self, op: str, fields: Mapping[str, int], local_error: Optional[Exception], device: torch.device) -> None:
        """Make every rank fail together when any rank rejected its input or the ranks disagree on a
        setting in `fields`; re-raise `local_error` on the rank that found it."""

    def start(self, op: str, request: Request) -> None:
        """Begin `op` with its checked `request`, whose settings (`request.agreed()`) every rank must
        share: a backend that exchanges counts checks them in that exchange (as `agree` would, without
        an exchange of their own); by default nothing is checked."""

    @abstractmethod
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout: ...

    @abstractmethod
    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        """A dispatch with its layout (`request.handle` is None)."""

    @abstractmethod
    def cached_dispatch(self, request: DispatchRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`(recv_x, recv_x_scales)` of a dispatch along `request.handle`'s layout."""

    @abstractmethod
    def combine(self, request: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`(combined_x, combined_topk_weights)`."""

    @abstractmethod
    def low_latency_dispatch(self, request: LowLatencyDispatchRequest
                             ) -> tuple[LowLatencyDispatchResult, Optional[RecvHook]]: ...

    @abstractmethod
    def low_latency_combine(self, request: LowLatencyCombineRequest) -> tuple[torch.Tensor, Optional[RecvHook]]: ...

    @abstractmethod
    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor: ...

    @abstractmethod
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None: ...

    def rank_mask(self) -> torch.Tensor:
        """`[R]` int32, 1 for every rank that this rank's low-latency operations leave out (elastic mode,
        docs/semantics.md): the tensor itself, which the Buffer's mask methods read and write."""
        raise NotImplementedError(f"the {self.name} backend has no rank mask")

    def destroy(self) -> None:
        """Release resources; the backend is unusable afterwards."""

    def check_errors(self) -> None:
        """Raise what the backend's kernels reported and no call raised yet (nothing where every call
        raises its own errors, as on the torch backend)."""
