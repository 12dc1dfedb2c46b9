"""Internode normal mode of the CUDA backend: both legs as NVSHMEM kernels (csrc/internode/).

The hierarchical path (`hierarchical.InternodePath`: the count exchange, packing, ordering and the
two-level reductions, docs/semantics.md "Internode") runs over `NvshmemLegs`, whose legs are one kernel
each: a chunked row exchange between the members of a team of NVSHMEM PEs through rings in the
Buffer's symmetric buffer (`num_rdma_bytes`), with head/tail flow control, per-chunk signals and
timeouts (csrc/internode/kernels/exchange.cu). It uses NVSHMEM's standard device API only, so the
network leg runs over whichever remote transport NVSHMEM picks (IBGDA, IBRC, UCX, libfabric/EFA) and
the node leg over NVLink; virtual nodes on one host run both over P2P. The results are the torch
backend's bit for bit, by construction: only the byte transport differs.

The counts travel with the operation's agreement through the process group's store (as on the torch
path), and the host waits for them: a call costs that exchange and a host sync besides the kernels.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ..config import Config
from ..constants import ROW_ALIGNMENT_BYTES
from ..handles import LowLatencyHandle
from ..requests import (CombineRequest, DispatchRequest, LowLatencyCombineRequest, LowLatencyDispatchRequest,
                        Request)
from ..routing import DispatchLayout
from ..settings import settings
from ..topology import NodeTopology
from .base import CommBackend, DispatchResult, LowLatencyDispatchResult, RecvHook
from .cuda_low_latency import init_nvshmem, low_latency_available, nvshmem_module
from .hierarchical import InternodePath
from .torch_backend import TorchBackend


def exchange_channels(config: Config) -> int:
    """Channels of one leg's kernel: a sending and a receiving block each, so `num_sms / 2`."""
    return max(1, config.num_sms // 2)


class NvshmemLegs:
    """The two legs of `InternodePath` as NVSHMEM exchanges over one `InternodeRuntime` (see the module
    docstring). Team members are ranks of the Buffer's group, which are its NVSHMEM PEs."""

    row_alignment = ROW_ALIGNMENT_BYTES

    def __init__(self, runtime: object, topology: NodeTopology, device: torch.device) -> None:
        self.runtime = runtime
        self.device = device
        self._rail = (list(topology.rail_ranks(topology.local_rank)), topology.node)
        self._node = (list(topology.node_ranks(topology.node)), topology.local_rank)

    def _run(self, team: tuple[list[int], int], rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
             config: Config) -> torch.Tensor:
        channels, chunk, ring = (exchange_channels(config), config.num_max_rdma_chunked_send_tokens,
                                 config.num_max_rdma_chunked_recv_tokens)
        # Both teams' rings must fit before the first leg runs: every rank finds the same answer.
        for members, _ in (self._rail, self._node):
            self.runtime.check_fits(channels, len(members), chunk, ring, rows.size(1))
        recv = torch.empty(sum(recv_counts), rows.size(1), dtype=torch.uint8, device=self.device)
        pes, me = team
        nvshmem_module().internode_exchange(self.runtime, rows.contiguous(), recv, pes, me, send_counts, recv_counts,
                                            channels, chunk, ring)
        return recv

    def rail(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], config: Config) -> torch.Tensor:
        return self._run(self._rail, rows, send_counts, recv_counts, config)

    def node(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], config: Config) -> torch.Tensor:
        return self._run(self._node, rows, send_counts, recv_counts, config)

    def destroy(self) -> None:
        """Nothing of its own: the runtime belongs to the backend."""


class CudaInternodeBackend(CommBackend):
    """Normal mode across nodes on CUDA tensors (see the module docstring). `torch_backend` is the Buffer's
    torch backend over the same group, with its internode path attached: it exchanges the counts, checks
    the arguments on every rank and computes the layout."""

    name = "cuda"

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int, torch_backend: TorchBackend,
                 num_rdma_bytes: int) -> None:
        super().__init__(group, rank, num_ranks)
        internode = torch_backend.internode
        if internode is None:
            raise ValueError("group: the CUDA internode backend needs more than one node")
        if not low_latency_available():
            raise RuntimeError("internode mode: moe_ep._low_latency was not built (it needs NVSHMEM: install "
                               "nvidia-nvshmem-cu12/cu13 or set NVSHMEM_DIR, then rebuild); use backend='torch'")
        if num_rdma_bytes <= 0:
            raise ValueError("num_rdma_bytes: backend='cuda' across nodes needs a symmetric buffer; size it with "
                             "Config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, num_ranks_per_node)")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.topology = internode.topology
        self._torch = torch_backend
        init_nvshmem(group, rank, num_ranks, self.device, device_api=True)
        self._runtime = nvshmem_module().InternodeRuntime(rank, num_ranks, num_rdma_bytes, settings().timeout_s)
        self.path = InternodePath(torch_backend, self.topology, NvshmemLegs(self._runtime, self.topology, self.device))

    def agree(self, op: str, fields: Mapping[str, int], local_error: Optional[Exception], device: torch.device) -> None:
        self._torch.agree(op, fields, local_error, device)

    def start(self, op: str, request: Request) -> None:
        # The torch backend's agreement carries the operation's count exchange (hierarchical.py).
        self._torch.start(op, request)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        return self._torch.get_dispatch_layout(topk_idx, num_experts)

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        self._runtime.check_usable()
        return self.path.dispatch(request)

    def cached_dispatch(self, request: DispatchRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        self._runtime.check_usable()
        return self.path.cached_dispatch(request)

    def combine(self, request: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        self._runtime.check_usable()
        return self.path.combine(request)

    def check_errors(self) -> None:
        """Wait for this device's queued work, then raise the `RuntimeError` of an exchange that gave up."""
        torch.cuda.synchronize(self.device)
        self._runtime.check_usable()

    # ------------------------------------------------------------------ low-latency mode: not on this backend

    def _no_low_latency(self) -> ValueError:
        return ValueError("low_latency_mode: this Buffer runs normal mode across nodes; create one with "
                          "low_latency_mode=True for the low-latency operations")

    def low_latency_dispatch(self, request: LowLatencyDispatchRequest
                             ) -> tuple[LowLatencyDispatchResult, Optional[RecvHook]]:
        raise self._no_low_latency()

    def low_latency_combine(self, request: LowLatencyCombineRequest) -> tuple[torch.Tensor, Optional[RecvHook]]:
        raise self._no_low_latency()

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        raise self._no_low_latency()

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        raise self._no_low_latency()

    def destroy(self) -> None:
        """Wait for this rank's kernels and every peer, then free the symmetric buffer (collective)."""
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group, device_ids=[self.device.index])
        self._runtime.destroy()
