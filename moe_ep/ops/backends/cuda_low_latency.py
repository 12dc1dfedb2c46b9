"""Low-latency mode of the CUDA backend: the `moe_ep._C` kernels over an NVSHMEM symmetric buffer.

`LowLatencyRuntime` implements the four low-latency methods of `CommBackend` with the signatures and
results of the torch backend (docs/semantics.md); `CudaBackend` delegates to it. NVSHMEM joins the
process once, from the torch process group (rank 0's unique id travels by a uint8 tensor broadcast);
each runtime then allocates one symmetric buffer of `num_rdma_bytes`. Peers NVSHMEM maps into this
process (NVLink) are written with direct stores, others through NVSHMEM put-with-signal.

Differences from the torch backend that the semantics allow: rows of `recv_x` past `recv_count` and
their `src_info` are left as they were; messages are packed source-major in token order, so the rows,
`layout_range` and `src_info` of received messages match the torch backend exactly.

Protocol rules the kernels rely on (see csrc/kernels/low_latency.cuh):
* The receive half of an operation must run before the next low-latency operation starts. A pending
  hook is therefore run automatically when the next operation (or a clean) begins, and a hook runs at
  most once.
* Every rank issues the same sequence of low-latency operations with the same sizes. Changing the
  sizes (tokens, hidden, experts) cleans the buffer collectively once.
A kernel that waits more than `MOE_EP_TIMEOUT_S` seconds (default 10) for a peer reports an error;
the next call raises and the runtime stays unusable.
"""

from __future__ import annotations

import functools
import importlib
import os
import socket
import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import fp8
from ..handles import LowLatencyHandle
from ..routing import ceil_div
from .base import LowLatencyDispatchResult, RecvHook

_SEND, _RECV = 1, 2
_DEFAULT_TIMEOUT_S = 10.0
# Global ranks of the group NVSHMEM joined this process with (NVSHMEM initialises once per process).
_nvshmem_members: Optional[tuple[int, ...]] = None


@functools.cache
def _ext():
    return importlib.import_module("moe_ep._C")


def low_latency_available() -> bool:
    """Whether `moe_ep._C` was built with NVSHMEM (low-latency kernels and runtime)."""
    try:
        return bool(getattr(_ext(), "low_latency_available", False))
    except ImportError:
        return False


def _broadcast_bytes(record: Optional[bytes], size: int, group: dist.ProcessGroup, device: torch.device) -> bytes:
    """Rank 0's `record` on every rank, through a tensor collective."""
    tensor = torch.zeros(size, dtype=torch.uint8, device=device)
    if record is not None:
        tensor.copy_(torch.frombuffer(bytearray(record), dtype=torch.uint8))
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    return bytes(tensor.cpu().tolist())


def _single_host(group: dist.ProcessGroup, num_ranks: int, device: torch.device) -> bool:
    host = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64, device=device)
    hosts = torch.empty(num_ranks, dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(hosts, host, group=group)
    return bool((hosts == hosts[0]).all())


def _init_nvshmem(group: dist.ProcessGroup, rank: int, num_ranks: int, device: torch.device) -> None:
    global _nvshmem_members
    members = tuple(dist.get_process_group_ranks(group))
    if _nvshmem_members is not None:
        if members != _nvshmem_members:
            raise RuntimeError(f"low-latency mode: NVSHMEM already joined this process with group {_nvshmem_members}; "
                               f"every low-latency Buffer of a process must use the same group, got {members}")
        return
    # NVLink SHArP (multicast) stays off: it can take down GPUs shared with others. Without another
    # host in the group no remote transport is needed, which also skips probing for InfiniBand.
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    if _single_host(group, num_ranks, device):
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    runtime = _ext().NvshmemRuntime
    unique_id = runtime.create_unique_id() if rank == 0 else None
    runtime.init(_broadcast_bytes(unique_id, runtime.unique_id_bytes(), group, device), rank, num_ranks)
    _nvshmem_members = members


class _ReceiveHook:
    """Launches a receive phase on the stream current at the call; only the first call does anything."""

    def __init__(self, launch: Callable[[], None]) -> None:
        self._launch: Optional[Callable[[], None]] = launch

    def __call__(self) -> None:
        launch, self._launch = self._launch, None
        if launch is not None:
            launch()


class LowLatencyRuntime:
    """The low-latency half of the CUDA backend (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int, num_rdma_bytes: int,
                 timeout_s: Optional[float] = None) -> None:
        if not low_latency_available():
            raise RuntimeError("low-latency mode: moe_ep._C was built without NVSHMEM (install nvidia-nvshmem-cu12/cu13 "
                               "or set NVSHMEM_DIR, then rebuild); use backend='torch'")
        if num_rdma_bytes <= 0:
            raise ValueError("num_rdma_bytes: low-latency mode needs a symmetric buffer; size it with "
                             "Buffer.get_low_latency_rdma_size_hint")
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self.device = torch.device("cuda", torch.cuda.current_device())
        if timeout_s is None:
            timeout_s = float(os.environ.get("MOE_EP_TIMEOUT_S", _DEFAULT_TIMEOUT_S))
        _init_nvshmem(group, rank, num_ranks, self.device)
        self._runtime = _ext().NvshmemRuntime(rank, num_ranks, num_rdma_bytes, timeout_s)
        self._pending: Optional[_ReceiveHook] = None

    def _begin(self) -> None:
        """Before every operation: fail on an earlier kernel error, finish a receive still pending."""
        self._runtime.check_usable()
        pending, self._pending = self._pending, None
        if pending is not None:
            pending()

    def _run(self, launch: Callable[[int], None], return_recv_hook: bool) -> Optional[RecvHook]:
        if not return_recv_hook:
            launch(_SEND | _RECV)
            return None
        launch(_SEND)
        self._pending = _ReceiveHook(lambda: launch(_RECV))
        return self._pending

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
    ) -> tuple[LowLatencyDispatchResult, Optional[RecvHook]]:
        self._begin()
        max_tokens, hidden = num_max_dispatch_tokens_per_rank, x.size(1)
        num_local, slots = num_experts // self.num_ranks, self.num_ranks * num_max_dispatch_tokens_per_rank
        device = x.device
        recv_scales = None
        if use_fp8:
            recv_x = torch.empty(num_local, slots, hidden, dtype=fp8.FP8_DTYPE, device=device)
            if use_ue8m0:
                groups = ceil_div(hidden, fp8.BLOCK * fp8.UE8M0_PER_INT32)
                recv_scales = torch.empty(num_local, groups, slots, dtype=torch.int32, device=device).transpose(1, 2)
            else:
                recv_scales = torch.empty(num_local, hidden // fp8.BLOCK, slots, dtype=torch.float32,
                                          device=device).transpose(1, 2)
        else:
            recv_x = torch.empty(num_local, slots, hidden, dtype=x.dtype, device=device)
        src_info = torch.empty(num_local, slots, dtype=torch.int32, device=device)
        layout_range = torch.empty(num_local, self.num_ranks, dtype=torch.int64, device=device)
        recv_count = torch.empty(num_local, dtype=torch.int32, device=device)
        mode = (2 if use_ue8m0 else 1) if use_fp8 else 0

        def launch(phases: int) -> None:
            _ext().ll_dispatch(self._runtime, x, topk_idx, recv_x, recv_scales, src_info, layout_range, recv_count,
                               cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, max_tokens,
                               num_experts, mode, round_scale, phases)

        hook = self._run(launch, return_recv_hook)
        handle = LowLatencyHandle(src_info, layout_range, max_tokens, hidden, num_experts)
        return LowLatencyDispatchResult(recv_x, recv_scales, recv_count, handle), hook

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
    ) -> tuple[torch.Tensor, Optional[RecvHook]]:
        self._begin()
        combined = out if out is not None else torch.empty(topk_idx.size(0), handle.hidden, dtype=torch.bfloat16,
                                                           device=topk_idx.device)

        def launch(phases: int) -> None:
            _ext().ll_combine(self._runtime, x, zero_copy, handle.src_info, handle.layout_range, topk_idx,
                              topk_weights, combined, combine_wait_recv_cost_stats,
                              handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts, phases)

        return combined, self._run(launch, return_recv_hook)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The send region as `[E_local, R*max, H]` bf16; a zero-copy combine sends from it."""
        return _ext().ll_send_buffer(self._runtime, handle.num_max_dispatch_tokens_per_rank, handle.hidden,
                                     handle.num_experts)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zero the whole symmetric buffer on every rank (collective, on the current stream)."""
        self._begin()
        self._runtime.clean()

    def destroy(self) -> None:
        """Free the symmetric buffer (collective); the runtime is unusable afterwards."""
        self._pending = None
        torch.cuda.synchronize(self.device)
        self._runtime.destroy()
