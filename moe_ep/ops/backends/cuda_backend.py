"""CUDA backend: normal mode over NVLink with the `moe_ep._C` kernels (one node, 1 to 8 ranks).

Every rank allocates one NVLink buffer and shares it through a CUDA IPC handle exchanged with a
tensor all-gather; after that the kernels synchronize among themselves through that memory. Outputs
are exactly those of the torch backend (docs/semantics.md). Kernels that wait on a peer give up after
`MOE_EP_TIMEOUT_S` seconds (default 100, see `moe_ep.ops.settings`): the call raises and the Buffer becomes unusable.

A dispatch with `num_worst_tokens > 0` does not wait on the host: the kernels find a too small
`num_worst_tokens` themselves, move nothing on any rank, and the `ValueError` comes from the next call
on the Buffer that finds the report, or from `check_errors()`.
"""

from __future__ import annotations

import functools
import importlib
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ..handles import DispatchHandle, LowLatencyHandle
from ..requests import CombineRequest, DispatchRequest, LowLatencyCombineRequest, LowLatencyDispatchRequest
from ..constants import NUM_MAX_NVL_PEERS
from ..routing import DispatchLayout
from ..settings import settings
from . import cuda_extension_available
from .base import CommBackend, DispatchResult, LowLatencyDispatchResult, RecvHook
from .collectives import all_gather_bytes
from .cuda_low_latency import LowLatencyRuntime
from .profile_summary import summarize_profile


@functools.cache
def _ext():
    """The compiled extension, imported on first use so that CPU installs never touch it."""
    return importlib.import_module("moe_ep._C")


def is_sm90_compiled() -> bool:
    """Whether `moe_ep._C` holds kernels compiled for Hopper (sm_90)."""
    return cuda_extension_available() and bool(_ext().is_sm90_compiled())


class CudaBackend(CommBackend):
    """Normal-mode dispatch/combine with NVLink kernels; low-latency mode over NVSHMEM (delegated), whose
    peers on other nodes (`num_ranks_per_node` > 0: virtual nodes of that many ranks) are reached by puts.

    The kernels take `Config.pipeline_lag`, and a combine returns the rows through the staging area or
    the rings as `Config.combine_path` says; `last_combine_path()` tells which ran.
    """

    name = "cuda"

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        num_ranks: int,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        num_ranks_per_node: int = 0,
    ) -> None:
        super().__init__(group, rank, num_ranks)
        if num_ranks > NUM_MAX_NVL_PEERS:
            raise ValueError(f"group: the CUDA backend serves at most {NUM_MAX_NVL_PEERS} ranks (one node), "
                             f"got {num_ranks}; use backend='torch'")
        self.num_nvl_bytes = num_nvl_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._runtime = _ext().NvlRuntime(rank, num_ranks, num_nvl_bytes, settings().timeout_s)
        handles = all_gather_bytes(self._runtime.local_handle(), group, num_ranks, self.device)
        self._runtime.open_peers(handles)
        self._low_latency: Optional[LowLatencyRuntime] = None
        if low_latency_mode and num_rdma_bytes > 0:
            self._low_latency = LowLatencyRuntime(group, rank, num_ranks, num_rdma_bytes, shrink=enable_shrink,
                                                  num_ranks_per_node=num_ranks_per_node)

    def agree(self, op: str, fields: Mapping[str, int], local_error: Optional[Exception], device: torch.device) -> None:
        # No collective on the hot path: a rank that rejects its input raises here, its peers time out.
        if local_error is not None:
            raise local_error

    # ------------------------------------------------------------------ normal mode

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        per_rank, per_expert, in_rank = _ext().get_dispatch_layout(topk_idx, num_experts, self.num_ranks)
        return DispatchLayout(per_rank, None, per_expert, in_rank)

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        r, config = request, request.config
        (recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, rank_prefix, channel_prefix,
         recv_channel_prefix, recv_src_idx, send_head) = _ext().dispatch(
            self._runtime, r.x, r.x_scales, r.topk_idx, r.topk_weights, r.num_tokens_per_rank, r.is_token_in_rank,
            r.num_tokens_per_expert, r.expert_alignment, r.num_worst_tokens, config.num_sms,
            config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens, config.pipeline_lag)
        handle = DispatchHandle(rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, r.is_token_in_rank,
                                send_head)
        if r.num_worst_tokens == 0:
            handle = handle.with_exact_rows()
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, list(per_expert), handle)

    def cached_dispatch(self, request: DispatchRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        handle, config = request.handle, request.config
        exact_rows = getattr(handle, "exact_rows", False)  # an internode handle has no such mark
        recv_x, recv_scales = _ext().cached_dispatch(
            self._runtime, request.x, request.x_scales, handle.rank_prefix_matrix, handle.channel_prefix_matrix,
            handle.recv_channel_prefix_matrix, handle.is_token_in_rank, handle.recv_src_idx.numel(), exact_rows,
            config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens, config.pipeline_lag)
        return recv_x, recv_scales

    def combine(self, request: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        handle, config = request.handle, request.config
        combined, combined_weights = _ext().combine(
            self._runtime, request.x, request.topk_weights, request.bias_0, request.bias_1, handle.rank_prefix_matrix,
            handle.channel_prefix_matrix, handle.recv_channel_prefix_matrix, handle.is_token_in_rank, handle.send_head,
            config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
            config.combines_staged(self.num_ranks), config.pipeline_lag)
        return combined, combined_weights

    def last_combine_path(self) -> Optional[str]:
        """How this rank's latest combine returned the rows: "staged", "rings", or None before any
        combine. Waits for the device."""
        torch.cuda.synchronize(self.device)
        return {1: "staged", 2: "rings"}.get(self._runtime.last_combine_path())

    def check_errors(self) -> None:
        """Wait for this device's queued work, then raise what the kernels reported and no call raised
        yet: a `num_worst_tokens` overflow (`ValueError`, once) or a failed kernel, normal or
        low-latency (`RuntimeError`)."""
        torch.cuda.synchronize(self.device)
        self._runtime.check_usable()
        if self._low_latency is not None:
            self._low_latency.check_usable()

    def profile(self) -> Optional[dict]:
        """Per-phase timing of this rank's last dispatch and combine kernels (`summarize_profile`), or
        None unless `moe_ep._C` was built with `MOE_EP_PROFILE=1`. Waits for the device."""
        last_profile = getattr(_ext(), "last_profile", None)
        return None if last_profile is None else summarize_profile(last_profile(self._runtime))

    # ------------------------------------------------------------------ low-latency mode

    def _low_latency_runtime(self) -> LowLatencyRuntime:
        if self._low_latency is None:
            raise ValueError("num_rdma_bytes: low-latency mode needs low_latency_mode=True and a symmetric buffer "
                             "(num_rdma_bytes >= Buffer.get_low_latency_rdma_size_hint(...))")
        return self._low_latency

    def low_latency_dispatch(self, request: LowLatencyDispatchRequest
                             ) -> tuple[LowLatencyDispatchResult, Optional[RecvHook]]:
        return self._low_latency_runtime().low_latency_dispatch(request)

    def low_latency_combine(self, request: LowLatencyCombineRequest) -> tuple[torch.Tensor, Optional[RecvHook]]:
        return self._low_latency_runtime().low_latency_combine(request)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        return self._low_latency_runtime().get_next_low_latency_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self._low_latency_runtime().clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def rank_mask(self) -> torch.Tensor:
        return self._low_latency_runtime().rank_mask()

    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        """This rank's NVLink buffer, or with `use_rdma_buffer` its low-latency symmetric buffer, as uint8
        views of the memory the kernels use."""
        if not use_rdma_buffer:
            return self._runtime.local_buffer()
        if self._low_latency is None:
            raise ValueError("use_rdma_buffer: the CUDA backend has an RDMA (symmetric) buffer in low-latency mode "
                             "only (low_latency_mode=True)")
        return self._low_latency.local_buffer()

    def destroy(self) -> None:
        """Wait for this rank's kernels and every peer, then unmap and free the NVLink buffer."""
        if self._low_latency is not None:
            self._low_latency.destroy()
            self._low_latency = None
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group, device_ids=[self.device.index])
        self._runtime.destroy()
