"""`moe_ep.Buffer`: a drop-in for DeepEP V1's `deep_ep.Buffer` over interchangeable backends."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, NoReturn, Optional, TypeVar, Union

import torch
import torch.distributed as dist

from . import validation as check
from .backends import create_backend, cuda_extension_available
from .backends.base import CommBackend
from .comm_group import group_from_comm
from .config import Config, default_combine_config, default_dispatch_config, low_latency_buffer_bytes
from .constants import NUM_MAX_NVL_PEERS
from .event import EventOverlap, capture_event
from .handles import DispatchedRouting, DispatchHandle, HandleOrigin, LowLatencyHandle
from .requests import DispatchRequest, Request
from .streams import CommStreams, open_scope
from .topology import (NodeTopology, check_num_tokens_per_rdma_rank, requested_num_ranks_per_node,
                       resolve_node_topology)

topk_idx_t = torch.int64
"""dtype of top-k expert indices everywhere in the API."""

Tokens = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
Bias = Union[None, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
RequestT = TypeVar("RequestT", bound=Request)


class Buffer:
    """Expert-parallel communication buffer: normal mode (throughput) and low-latency mode (decode).

    Same constructor, methods, arguments and return tuples as DeepEP V1's `deep_ep.Buffer`, plus
    `backend`: `"torch"` (torch.distributed collectives; gloo on CPU, NCCL on GPU), `"cuda"` (the
    `moe_ep._C` kernels) or `"auto"` (CUDA kernels for GPU tensors when the extension is built,
    the torch backend otherwise, e.g. beyond one node of 8 ranks or without buffer bytes). Any world
    size works; see docs/semantics.md for exact outputs.

    Nodes are the hosts, or `num_ranks_per_node` consecutive ranks (1 to 8, dividing the group size;
    default: the setting `MOE_EP_NUM_RANKS_PER_NODE`), which splits a host into virtual nodes. Across
    nodes, normal mode runs hierarchically on the torch backend (docs/semantics.md, "Internode").

    DeepEP's other arguments: `group=None` with `comm` (an mpi4py communicator) makes the group of the
    communicator's processes (`moe_ep.ops.comm_group`); without either, the default group serves.
    `enable_shrink=True` keeps a rank mask for elastic low-latency mode (`low_latency_update_mask_buffer`
    and its siblings): a dead rank then costs its experts, not the job (CUDA backend). `use_fabric=True` is refused (multi-node NVLink is not supported);
    `num_qps_per_rank`, `allow_nvlink_for_low_latency_mode` and `allow_mnnvl` change nothing.
    """

    num_sms: int = 20

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        backend: str = "auto",
        *,
        num_ranks_per_node: Optional[int] = None,
        use_fabric: bool = False,
        enable_shrink: bool = False,
        comm: Optional[object] = None,
    ) -> None:
        if backend not in ("auto", "torch", "cuda"):
            raise ValueError(f"backend: expected 'auto', 'torch' or 'cuda', got {backend!r}")
        if use_fabric:
            raise ValueError("use_fabric: fabric memory handles (multi-node NVLink) are not supported yet; pass "
                             "use_fabric=False (the NVLink of one node needs none)")
        if group is None and comm is not None:
            group = group_from_comm(comm)
        if not dist.is_initialized():
            raise RuntimeError("group: torch.distributed is not initialized; call init_process_group first")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            check.check_positive_int(name, value, minimum=0)
        check.check_positive_int("num_qps_per_rank", num_qps_per_rank)
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.use_fabric = use_fabric
        self.enable_shrink = enable_shrink
        self.explicitly_destroy = explicitly_destroy
        self.backend = backend
        self._streams = CommStreams()
        self._requested_ranks_per_node = requested_num_ranks_per_node(num_ranks_per_node, self.group_size)
        self._topology: Optional[NodeTopology] = None
        self._torch = create_backend("torch", self.group, self.rank, self.group_size)
        self._cuda: Optional[CommBackend] = None
        # Creating the CUDA backend is collective anyway, so the nodes are learned first; otherwise on the
        # first normal-mode call (creating a torch-backend Buffer stays local).
        if backend == "cuda" or (backend == "auto" and self._cuda_may_fit()):
            if self._internode_normal_mode():
                if backend == "cuda" or num_rdma_bytes > 0:
                    self._cuda = create_backend("cuda_internode", self.group, self.rank, self.group_size,
                                                torch_backend=self._torch, num_rdma_bytes=num_rdma_bytes)
            elif backend == "cuda" or self._cuda_fits():
                # Low-latency mode reaches ranks of other (virtual) nodes through NVSHMEM puts.
                nodes = self.node_topology() if low_latency_mode else None
                self._cuda = create_backend(
                    "cuda", self.group, self.rank, self.group_size, num_nvl_bytes=num_nvl_bytes,
                    num_rdma_bytes=num_rdma_bytes, low_latency_mode=low_latency_mode,
                    explicitly_destroy=explicitly_destroy, enable_shrink=enable_shrink,
                    num_ranks_per_node=nodes.num_ranks_per_node if nodes is not None and nodes.num_nodes > 1 else 0)
        self._host_buffers: dict[bool, torch.Tensor] = {}  # get_local_buffer_tensor's memory without CUDA kernels
        self._destroyed = False

    def _internode_normal_mode(self) -> bool:
        """Whether this is a normal-mode Buffer over several nodes (the internode kernels serve it)."""
        return not self.low_latency_mode and self.node_topology().num_nodes > 1

    def node_topology(self, op: str = "node_topology") -> NodeTopology:
        """Which ranks form a node: learned from the hosts and `num_ranks_per_node` on first use (a
        collective on the Buffer's group: the first normal-mode call, or creating the CUDA backend)."""
        if self._topology is None:
            device = torch.device("cuda", torch.cuda.current_device()) if _is_nccl(self.group) else torch.device("cpu")
            # Through the agreement first, like every operation: a peer whose own input check failed just
            # before (a layer's, say) is reported here instead of leaving this rank in the gather below.
            self._torch.agree(op, {}, None, device)
            self._topology = resolve_node_topology(self.group, self.rank, self.group_size,
                                                   self._requested_ranks_per_node, device, self.allow_mnnvl)
            if self._topology.num_nodes > 1:
                from .backends.hierarchical import InternodePath

                self._torch.internode = InternodePath(self._torch, self._topology)
        return self._topology

    def _cuda_may_fit(self) -> bool:
        """`auto` may pick the CUDA kernels: NCCL ranks with the extension built and a buffer to work in."""
        return cuda_extension_available() and _is_nccl(self.group) and (self.num_nvl_bytes > 0 or self.num_rdma_bytes > 0)

    def _cuda_fits(self) -> bool:
        """`auto` picks the intranode or low-latency kernels for one NVLink node with buffers to work in
        (across nodes in normal mode: the internode kernels, given `num_rdma_bytes`)."""
        has_buffer = self.num_rdma_bytes > 0 if self.low_latency_mode else self.num_nvl_bytes > 0
        return self._cuda_may_fit() and self.group_size <= NUM_MAX_NVL_PEERS and has_buffer

    # ------------------------------------------------------------------ static helpers

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the CUDA extension was built with Hopper (sm_90) kernels."""
        if not cuda_extension_available():
            return False
        from .backends.cuda_backend import is_sm90_compiled

        return is_sm90_compiled()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs used by normal-mode kernels (must be even: one channel is two SMs)."""
        if not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2 != 0:
            raise ValueError(f"new_num_sms: expected a positive even integer, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current CUDA stream (empty on CPU)."""
        return capture_event()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of symmetric buffer low-latency mode needs for these sizes."""
        return low_latency_buffer_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Recommended dispatch `Config` for a world size (any size is accepted)."""
        check.check_positive_int("num_ranks", num_ranks)
        return default_dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Recommended combine `Config` for a world size (any size is accepted)."""
        check.check_positive_int("num_ranks", num_ranks)
        return default_combine_config(num_ranks, Buffer.num_sms)

    def get_comm_stream(self) -> Optional[torch.cuda.Stream]:
        """The communication stream of the current CUDA device (None without CUDA)."""
        if not torch.cuda.is_available():
            return None
        return self._streams.get(torch.device("cuda", torch.cuda.current_device()))

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """This rank's raw buffer memory as a `dtype` tensor, from byte `offset` to the end of the buffer:
        the NVLink buffer (`num_nvl_bytes`), or with `use_rdma_buffer` the low-latency symmetric buffer
        (`num_rdma_bytes`). With `size`, its first `size.numel()` elements viewed as `size`.

        With the CUDA backend these are views of the memory its kernels work in (the normal-mode NVLink
        buffer; the NVSHMEM buffer of low-latency mode): writing there while an operation runs corrupts
        it. The torch backend moves data with collectives and has no buffers: it returns memory of the
        same size (on the GPU with NCCL, else on the CPU) that nothing else uses.
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__}")
        check.check_positive_int("offset", offset, minimum=0)
        raw = self._local_buffer(bool(use_rdma_buffer))
        item = torch.empty((), dtype=dtype).element_size()
        if offset % item != 0 or offset >= raw.numel():
            raise ValueError(f"offset: expected a multiple of {item} bytes ({dtype}) below the buffer's {raw.numel()} "
                             f"bytes, got {offset}")
        tensor = raw[offset:offset + (raw.numel() - offset) // item * item].view(dtype)
        if size is None:
            return tensor
        shape = torch.Size(size)
        if shape.numel() > tensor.numel():
            raise ValueError(f"size: {tuple(shape)} needs {shape.numel()} elements, the buffer holds {tensor.numel()} "
                             f"{dtype} elements from offset {offset}")
        return tensor[:shape.numel()].view(shape)

    def _local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        """`get_local_buffer_tensor`'s whole buffer as uint8."""
        if self._destroyed:
            raise RuntimeError("Buffer: used after destroy()")
        name = "num_rdma_bytes" if use_rdma_buffer else "num_nvl_bytes"
        num_bytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        if num_bytes == 0:
            raise ValueError(f"use_rdma_buffer={use_rdma_buffer}: the Buffer was created with {name}=0")
        if self._cuda is not None:
            local_buffer = getattr(self._cuda, "local_buffer", None)
            if local_buffer is None:
                raise ValueError("get_local_buffer_tensor: normal mode across nodes keeps no buffer a caller may "
                                 "write (its rings live in NVSHMEM memory its kernels own)")
            return local_buffer(use_rdma_buffer)
        if use_rdma_buffer not in self._host_buffers:
            device = torch.device("cuda", torch.cuda.current_device()) if _is_nccl(self.group) else torch.device("cpu")
            self._host_buffers[use_rdma_buffer] = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        return self._host_buffers[use_rdma_buffer]

    def destroy(self) -> None:
        """Release the backends' resources; requires `explicitly_destroy=True` as in DeepEP."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy: the Buffer was created with explicitly_destroy=False")
        for backend in (self._cuda, self._torch):
            if backend is not None:
                backend.destroy()
        self._cuda = None
        self._host_buffers.clear()
        self._destroyed = True

    def check_errors(self) -> None:
        """Wait for this rank's queued CUDA work, then raise what the CUDA backend's kernels reported and
        no call raised yet: the `ValueError` of a dispatch whose `num_worst_tokens` was too small (found
        without a host wait, see docs/semantics.md) or the `RuntimeError` of a failed kernel, normal or
        low-latency. The torch backend raises in the call itself."""
        if self._cuda is not None:
            self._cuda.check_errors()

    def backend_name_for(self, tensor: torch.Tensor) -> str:
        """Which backend ("torch" or "cuda") serves operations on tensors like `tensor`."""
        return self._backend_for(tensor).name

    # ------------------------------------------------------------------ internals

    def _backend_for(self, tensor: torch.Tensor) -> CommBackend:
        if self._destroyed:
            raise RuntimeError("Buffer: used after destroy()")
        if self.backend == "torch" or (self.backend == "auto" and (self._cuda is None or not tensor.is_cuda)):
            return self._torch
        if not tensor.is_cuda:
            raise ValueError(f"x: backend='cuda' needs CUDA tensors, got a tensor on {tensor.device}")
        assert self._cuda is not None
        return self._cuda

    def _normal_backend_for(self, tensor: torch.Tensor, op: str) -> CommBackend:
        """`_backend_for` in normal mode, which first learns the nodes. Across nodes a low-latency Buffer's
        normal-mode calls take the torch backend (its CUDA backend holds no internode buffers)."""
        backend = self._backend_for(tensor)
        across_nodes = self.node_topology(op).num_nodes > 1
        return self._torch if backend is self._cuda and across_nodes and self.low_latency_mode else backend

    @contextlib.contextmanager
    def input_check(self, op: str, device: torch.device, low_latency: bool = False) -> Iterator[None]:
        """Run this rank's own argument checks for `op` (on the backend `device`'s normal-mode calls take, or
        with `low_latency` its low-latency calls) so that every rank learns of a failure: a `TypeError` or
        `ValueError` raised inside is re-raised here once the peers know, and they raise `PeerInputError`
        naming this rank and the argument at the start of their next operation on the group (torch backend;
        with the CUDA backend they time out instead). Nothing is exchanged while the checks pass. The
        Buffer's own calls and the layers' checks use it."""
        try:
            yield
        except (TypeError, ValueError) as exc:
            self._refuse_input(op, device, low_latency, exc)

    def _refuse_input(self, op: str, device: torch.device, low_latency: bool, error: Exception) -> NoReturn:
        """`input_check`'s refusal of this rank's input `error`, raised once the peers know of it."""
        tensor = torch.empty(0, device=device)
        if low_latency:
            backend = self._backend_for(tensor)
        else:  # the peers' next exchange: learning the nodes (torch backend), or the operation's own
            backend = self._torch if self._topology is None else self._normal_backend_for(tensor, op)
        self._refuse(op, backend, device, error)

    def _refuse(self, op: str, backend: CommBackend, device: torch.device, error: Exception) -> NoReturn:
        """Raise this rank's input `error` once its peers know of it (`input_check`), through the backend
        the operation runs on: the one whose exchange the peers make next."""
        backend.agree(op, {}, error, device)  # raises `error`
        raise error

    def _request(self, op: str, x: object, build: Callable[..., RequestT], args: tuple,
                 low_latency: bool = False) -> tuple[CommBackend, RequestT]:
        """The backend for `x`'s device and the checked request `build(*args)` returns, the operation started
        on it; if any rank's checks failed, every rank raises (the failing rank its own error). (The
        arguments come as a tuple: a closure over them costs twice as much.)"""
        tensor = x if isinstance(x, torch.Tensor) else torch.empty(0)
        backend = self._backend_for(tensor) if low_latency else self._normal_backend_for(tensor, op)
        try:  # `input_check`, without a context manager's cost on every call
            if low_latency:
                self._require_low_latency(op)
            request = build(*args)
        except (TypeError, ValueError) as exc:
            self._refuse(op, backend, tensor.device, exc)
        backend.start(op, request)
        return backend, request

    def _require_low_latency(self, op: str) -> None:
        if not self.low_latency_mode:
            raise ValueError(f"{op}: the Buffer was created with low_latency_mode=False")

    def _dispatch_request(self, x: object, handle: object, num_tokens_per_rank: object,
                          num_tokens_per_rdma_rank: object, is_token_in_rank: object, num_tokens_per_expert: object,
                          topk_idx: object, topk_weights: object, expert_alignment: object, num_worst_tokens: object,
                          config: Config) -> DispatchRequest:
        """The checked request of a `dispatch` call; a fresh dispatch's `num_tokens_per_rdma_rank` is checked
        against the nodes."""
        request = check.dispatch_request(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                         topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                                         self.group_size)
        if request.handle is None:
            check_num_tokens_per_rdma_rank(num_tokens_per_rdma_rank, request.is_token_in_rank, self.node_topology(),
                                           request.x.device)
        return request

    # ------------------------------------------------------------------ normal mode

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """Where each token goes, from its experts (local: no communication).

        Args:
            topk_idx: `[T, k]` int64 expert ids, -1 for a masked slot.
            num_experts: E, a multiple of the group size (rank r owns experts `[r*E/R, (r+1)*E/R)`).
            previous_event, async_finish, allocate_on_comm_stream: stream ordering, as in `dispatch`.

        Returns `(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank (None in one node),
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)`.
        """
        try:  # `input_check`, without a context manager's cost on every call
            check.check_topk_idx("topk_idx", topk_idx, None, None)  # any device: the layout's is topk_idx's
            check.check_num_experts(num_experts, self.group_size)
            check.check_topk_values("topk_idx", topk_idx, num_experts)
        except (TypeError, ValueError) as exc:
            self._refuse_input("get_dispatch_layout", getattr(topk_idx, "device", torch.device("cpu")), False, exc)
        backend = self._normal_backend_for(topk_idx, "get_dispatch_layout")
        scope = open_scope(self._streams, topk_idx, previous_event, async_finish, allocate_on_comm_stream)
        layout = scope.call(backend.get_dispatch_layout, topk_idx, num_experts)
        return (*layout, scope.finish((topk_idx,), layout))

    def dispatch(
        self,
        x: Tokens,
        handle: Optional[DispatchHandle] = None,
        num_tokens_per_rank: Optional[torch.Tensor] = None,
        num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
        is_token_in_rank: Optional[torch.Tensor] = None,
        num_tokens_per_expert: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Tokens, Optional[torch.Tensor], Optional[torch.Tensor], Optional[list[int]], Optional[DispatchHandle],
               EventOverlap]:
        """Send each token once to every rank holding one of its experts.

        Args:
            x: `[T, H]` tokens (bf16, fp16, fp32 or fp64; rows a multiple of 16 bytes), or FP8
                `(data [T, H] float8_e4m3fn, scales [T, H/128] float32)` (H a multiple of 128).
            handle: a previous dispatch's handle: move `x` along the same layout (a cached
                dispatch, which takes no layout, top-k or `topk_weights`).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert:
                `get_dispatch_layout`'s outputs for `topk_idx` (the rdma one is unused in one node).
            topk_idx: `[T, k]` int64 expert ids (-1 masked), sent along with the tokens.
            topk_weights: `[T, k]` float32, sent along (needs `topk_idx`).
            expert_alignment: each count of `num_recv_tokens_per_expert_list` is rounded up to it.
            num_worst_tokens: > 0: every output has exactly this many rows (padding after the received
                ones) and the call does not wait on the host; receiving more is an error.
            config: SMs and chunk sizes (`get_dispatch_config` by default).
            previous_event: the communication stream waits for it (else for the current stream).
            async_finish: do not make the current stream wait; wait for the returned event instead.
            allocate_on_comm_stream: outputs belong to the communication stream (needs
                `previous_event` and `async_finish`).
            Without `previous_event` and `async_finish` the work runs on the current stream: the
            same order as the communication stream waiting for it and it for the communication
            stream, without events.

        Returns `(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event)`: `recv_x [N, H]` (`(data, scales)` for FP8) with rows source-rank-major, then in the
        sender's token order; `recv_topk_idx [N, k]` local expert ids (-1 elsewhere) and
        `recv_topk_weights [N, k]` (0 there); the received tokens per local expert (aligned; empty with
        `num_worst_tokens`); the `DispatchHandle` for `combine` and cached dispatch. A cached dispatch
        sets only `recv_x` and `event`. Exact values: docs/semantics.md.
        """
        # The default config without `get_dispatch_config`'s check of a group size known to be valid.
        config = config if config is not None else default_dispatch_config(self.group_size, Buffer.num_sms)
        _await_for_value_checks(previous_event)
        backend, request = self._request(
            "dispatch" if handle is None else "cached_dispatch", x[0] if isinstance(x, tuple) and x else x,
            self._dispatch_request, (x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                     num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                     num_worst_tokens, config))
        scope = open_scope(self._streams, request.x, previous_event, async_finish, allocate_on_comm_stream)
        fp8 = request.x_scales is not None
        if request.handle is not None:  # a cached dispatch
            recv_x, recv_scales = scope.call(backend.cached_dispatch, request)
            event = scope.finish(request, (recv_x, recv_scales))
            return (recv_x, recv_scales) if fp8 else recv_x, None, None, None, None, event
        result = scope.call(backend.dispatch, request)
        if isinstance(result.handle, DispatchHandle):  # an internode handle keeps no origin: checked in full
            result.handle.origin = HandleOrigin(self.group_size, request.x.device, request.x.shape[0])
        event = scope.finish(request, result)
        recv = (result.recv_x, result.recv_x_scales) if fp8 else result.recv_x
        return (recv, result.recv_topk_idx, result.recv_topk_weights, result.num_recv_tokens_per_expert_list,
                result.handle, event)

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: Optional[torch.Tensor] = None,
        bias: Bias = None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Sum every dispatched row back onto its source token (no weights applied), plus `bias`.

        Args:
            x: `[N, H]` rows in the dispatch's receive order (bf16, fp16, fp32 or fp64).
            handle: that dispatch's handle.
            topk_weights: `[N, k]` float32, summed back as `x` is (restores the sent weights).
            bias: `[T, H]` in x's dtype, or a pair of them, added to the sums.
            config: SMs and chunk sizes (`get_combine_config` by default); its `combine_path` picks
                the CUDA backend's path.
            previous_event, async_finish, allocate_on_comm_stream: stream ordering, as in `dispatch`.

        Returns `(combined_x [T, H], combined_topk_weights [T, k] or None, event)`, summed in float32
        (float64 for fp64) in rank order (docs/semantics.md).
        """
        config = config if config is not None else default_combine_config(self.group_size, Buffer.num_sms)
        _await_for_value_checks(previous_event)
        backend, request = self._request("combine", x, check.combine_request,
                                         (x, handle, topk_weights, bias, config, self.group_size))
        scope = open_scope(self._streams, request.x, previous_event, async_finish, allocate_on_comm_stream)
        combined_x, combined_weights = scope.call(backend.combine, request)
        return combined_x, combined_weights, scope.finish(request, (combined_x, combined_weights))

    # ------------------------------------------------------------------ low-latency mode

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency buffers (needed after normal-mode use of the same memory)."""
        self._require_low_latency("clean_low_latency_buffer")
        check.check_positive_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        check.check_positive_int("hidden", hidden)
        check.check_num_experts(num_experts, self.group_size)
        for backend in (self._cuda, self._torch):
            if backend is not None:
                backend.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
        dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Tokens, torch.Tensor, LowLatencyHandle, EventOverlap, Optional[Callable[[], None]]]:
        """Send one message per (token, expert) into the packed `[E_local, R*max, H]` layout.

        Args:
            x: `[T, H]` bf16 tokens, T <= `num_max_dispatch_tokens_per_rank`.
            topk_idx: `[T, k]` int64 expert ids, -1 for a masked slot.
            num_max_dispatch_tokens_per_rank: `max`, the same on every rank and call of a run.
            num_experts: E, a multiple of the group size.
            cumulative_local_expert_recv_stats: `[E_local]` int32, the received counts are added to it.
            dispatch_wait_recv_cost_stats: `[R]` int64, nanoseconds waited for each source are added.
            use_fp8: send e4m3 with 1x128 scales (H a multiple of 128); `round_scale`: power-of-two
                scales; `use_ue8m0`: packed exponent bytes (needs both).
            async_finish: do not make the current stream wait; wait for the returned event instead.
            return_recv_hook: send only; the data arrives when `hook()` is called.

        Returns `(recv_x or (recv_x, scales), recv_count [E_local] int32, handle, event, hook)`:
        `recv_x [E_local, R*max, H]`, expert e's messages in rows `[0, recv_count[e])`; scales
        `[E_local, R*max, H/128]` float32 or `[E_local, R*max, ceil(H/512)]` int32, token dimension
        contiguous; `hook` None without `return_recv_hook`.
        """
        backend, request = self._request("low_latency_dispatch", x, check.low_latency_dispatch_request, (
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
            self.group_size), low_latency=True)
        scope = open_scope(self._streams, request.x, None, async_finish, False)
        result, hook = scope.call(backend.low_latency_dispatch, request)
        # The combine must route as this dispatch did: the handle, made for this call, records it (the values,
        # copied on the current stream where topk_idx was made, only while value checks are on, which compare
        # them).
        topk_idx = request.topk_idx
        result.handle.routing = DispatchedRouting(self.group_size, topk_idx.shape,
                                                  topk_idx.clone() if check.value_checks_enabled() else None)
        event = scope.finish(request, result)
        recv = (result.recv_x, result.recv_x_scales) if use_fp8 else result.recv_x
        return recv, result.recv_count, result.handle, event, hook

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Optional[torch.Tensor] = None,
        combine_wait_recv_cost_stats: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, EventOverlap, Optional[Callable[[], None]]]:
        """Return the expert outputs to their tokens, reduced with `topk_weights` per expert rank first.

        For token `t` and each rank `r` hosting at least one of its valid (non `-1`) slots, the partial sum
        `P[r, t] = bf16(sum over those slots j in slot order of float32(w[t, j]) * float32(y_j))` is taken in
        float32 with the multiply and the add rounded separately (`y_j`: the row expert `topk_idx[t, j]`
        returned for `t`); then `combined_x[t] = bf16(sum over r in ascending order of float32(P[r, t]))`,
        also in float32. Tokens with no valid slot get zeros. The rank holding the experts reduces before
        sending, so one row per (token, rank) crosses the link instead of one per (token, expert); the
        result differs from DeepEP's (one float32 sum over all slots) by at most the BF16 rounding of the
        per-rank partial sums. Both backends compute exactly this (docs/semantics.md).

        Args:
            x: `[E_local, R*max, H]` bf16 expert outputs in the dispatch's packed layout.
            topk_idx: `[T, k]` int64, routing every token as the dispatch behind `handle` did.
            topk_weights: `[T, k]` float32.
            handle: that dispatch's handle.
            use_logfmt: the partial rows travel in LogFMT-10 (`moe_ep.ops.logfmt`: blocks of 128 channels
                below 1 in magnitude as 10-bit log codes, about 0.64x the bytes of BF16; hidden a multiple
                of 128 up to 8192; not with `zero_copy`); the receiver sums what it decodes.
            zero_copy: read the outputs from `get_next_low_latency_combine_buffer(handle)`, not `x`.
            async_finish, return_recv_hook: as in `low_latency_dispatch`.
            out: `[T, H]` bf16 receiving the result in place.
            combine_wait_recv_cost_stats: `[R]` int64, nanoseconds waited for each rank are added.

        Returns `(combined_x [T, H] bf16, event, hook)`.
        """
        backend, request = self._request("low_latency_combine", x, check.low_latency_combine_request, (
            x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook, out,
            combine_wait_recv_cost_stats, self.group_size), low_latency=True)
        scope = open_scope(self._streams, request.x, None, async_finish, False)
        combined, hook = scope.call(backend.low_latency_combine, request)
        return combined, scope.finish(request, (combined,)), hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The `[E_local, R*max, H]` bf16 buffer a `zero_copy` combine reads: write expert outputs into it."""
        self._require_low_latency("get_next_low_latency_combine_buffer")
        hdl = check.check_low_latency_handle(handle, self.group_size)
        return self._backend_for(hdl.layout_range).get_next_low_latency_combine_buffer(hdl)

    # ------------------------------------------------------------------ elastic low-latency mode

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (`mask=True`) or unmask rank `rank_to_mask` in this rank's low-latency operations (elastic
        mode, `enable_shrink=True`; docs/semantics.md, "Elastic mode"): nothing is sent to a masked rank
        or awaited from it, and a combine leaves out the top-k terms of its experts; a rank masked in its
        own mask sends and receives nothing. Every rank should mask the same ranks: the torch backend
        requires it, and the CUDA backend also masks, on its own, a peer that one of its waits gave up on
        (`MOE_EP_TIMEOUT_S`). On CUDA the change is ordered on the current stream."""
        masks = self._rank_masks("low_latency_update_mask_buffer")
        if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, int) or not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"rank_to_mask: expected a rank in [0, {self.group_size}), got {rank_to_mask!r}")
        for rank_mask in masks:
            rank_mask[rank_to_mask] = int(bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the rank mask into `mask_status` (`[R]` int32, 1 for a masked rank): the mask of the backend
        that serves tensors on `mask_status`'s device (on CUDA it includes the ranks masked by timeouts)."""
        self._rank_masks("low_latency_query_mask_buffer")
        check.check_tensor("mask_status", mask_status, dtype=torch.int32, shape=(self.group_size,))
        on_cuda = mask_status.is_cuda and self._cuda is not None and self.backend != "torch"
        mask_status.copy_((self._cuda if on_cuda else self._torch).rank_mask())

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        for rank_mask in self._rank_masks("low_latency_clean_mask_buffer"):
            rank_mask.zero_()

    def _rank_masks(self, op: str) -> list[torch.Tensor]:
        """The rank mask of every backend of this Buffer, for `op` (elastic mode only)."""
        if self._destroyed:
            raise RuntimeError("Buffer: used after destroy()")
        self._require_low_latency(op)
        if not self.enable_shrink:
            raise ValueError(f"{op}: the Buffer was created with enable_shrink=False (elastic mode is off)")
        return [backend.rank_mask() for backend in (self._cuda, self._torch) if backend is not None]

    # ------------------------------------------------------------------ DeepEP's internode entry points

    def internode_dispatch(self, x: Tokens, handle: Optional[DispatchHandle] = None,
                           num_tokens_per_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                           is_token_in_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_expert: Optional[torch.Tensor] = None, topk_idx: Optional[torch.Tensor] = None,
                           topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1,
                           config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                           async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """`dispatch` (which takes the internode path itself when the group spans several nodes); DeepEP's
        `dispatch` calls its namesake across nodes, and programs may call it directly."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, 0, config, previous_event,
                             async_finish, allocate_on_comm_stream)

    def internode_combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                          bias: Bias = None, config: Optional[Config] = None,
                          previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor],
                                                                           EventOverlap]:
        """`combine` (see `internode_dispatch`)."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)


def _await_for_value_checks(previous_event: Optional[EventOverlap]) -> None:
    """With value checks on, the current stream first waits for `previous_event`: the checks read the
    layout or handle tensors on the current stream, and an asynchronous `get_dispatch_layout` or
    dispatch may still be writing them on the comm stream (the checks synchronize the host anyway)."""
    if previous_event is not None and check.value_checks_enabled():
        previous_event.current_stream_wait()


def _is_nccl(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) == "nccl"
