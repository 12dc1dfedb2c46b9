"""Internode normal mode of the CUDA backend: both legs as NVSHMEM kernels (csrc/internode/).

The hierarchical path (`hierarchical.InternodePath`: the count exchange, packing, ordering and the
two-level reductions, docs/semantics.md "Internode") runs over `NvshmemLegs`, whose legs are one kernel
each: a chunked row exchange between the members of a team of NVSHMEM PEs through rings in the
Buffer's symmetric buffer (`num_rdma_bytes`), with head/tail flow control, per-chunk signals and
timeouts (csrc/internode/kernels/exchange.cu). It uses NVSHMEM's standard device API only, so the
network leg runs over whichever remote transport NVSHMEM picks (IBGDA, IBRC, UCX, libfabric/EFA) and
the node leg over NVLink; virtual nodes on one host run both over P2P. The results are the torch
backend's bit for bit, by construction: only the byte transport differs.

A fresh dispatch's counts travel as DeepEP's notify does, in two steps: each rank's count row to its
rail peers (network), then the rail's rows to the node's ranks (NVLink), through the same kernel; the
host waits for them once (it needs them for the output sizes). Nothing goes through the process group's
store on the way: a cached dispatch or a combine exchanges nothing but its rows. The operation's
settings ride in the count rows, so ranks that disagree on one raise `PeerInputError` on every rank
before any data moves, as on the torch backend; a rank that rejects its own input raises alone, and its
peers' kernels give up after `MOE_EP_TIMEOUT_S` (the CUDA backends' convention, docs/semantics.md).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

import torch
import torch.distributed as dist

from ..config import Config
from ..constants import ROW_ALIGNMENT_BYTES
from ..handles import LowLatencyHandle
from ..requests import CombineRequest, DispatchRequest, LowLatencyCombineRequest, LowLatencyDispatchRequest
from ..routing import DispatchLayout
from ..settings import settings
from ..topology import NodeTopology
from ..validation import PeerInputError
from .base import CommBackend, DispatchResult, LowLatencyDispatchResult, RecvHook
from .cuda_low_latency import init_nvshmem, low_latency_available, nvshmem_module
from .hierarchical import GatheredRows, InternodePath
from .torch_backend import TorchBackend


def exchange_channels(config: Config) -> int:
    """Channels of one leg's kernel: a sending and a receiving block each, so `num_sms / 2`."""
    return max(1, config.num_sms // 2)


class _Geometry(NamedTuple):
    """How one exchange splits its streams: channels (a sending and a receiving block each), rows per chunk
    and per ring (whole chunks, at least two)."""

    channels: int
    chunk_rows: int
    ring_rows: int


def _leg_geometry(config: Config) -> _Geometry:
    return _Geometry(exchange_channels(config), config.num_max_rdma_chunked_send_tokens,
                     config.num_max_rdma_chunked_recv_tokens)


# The first word of every gathered count row ("notify" in ASCII): with the gather's number and the
# sender's rank after it, it tells a row that arrived from whatever a ring slot held before.
_ROW_STAMP = 0x6E6F74696679
_STAMP_WORDS = 3


class NvshmemLegs:
    """The two legs of `InternodePath` and its count exchange as NVSHMEM exchanges over one
    `InternodeRuntime` (see the module docstring). Team members are ranks of the Buffer's group, which are
    its NVSHMEM PEs."""

    row_alignment = ROW_ALIGNMENT_BYTES
    checks_settings = False  # the path carries them in the gathered rows

    def __init__(self, runtime: object, topology: NodeTopology, device: torch.device) -> None:
        self.runtime = runtime
        self.topology = topology
        self.device = device
        self._rail = (list(topology.rail_ranks(topology.local_rank)), topology.node)
        self._node = (list(topology.node_ranks(topology.node)), topology.local_rank)
        self._gathers = 0  # count rows gathered so far: the same number on every rank

    def _check_fits(self, row_bytes: int, rail: _Geometry, node: _Geometry) -> None:
        """Both teams' rings must fit before the first exchange of a call: every rank finds the same answer."""
        for (members, _), geometry in ((self._rail, rail), (self._node, node)):
            self.runtime.check_fits(geometry.channels, len(members), geometry.chunk_rows, geometry.ring_rows,
                                    row_bytes)

    def _run(self, team: tuple[list[int], int], rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
             geometry: _Geometry) -> torch.Tensor:
        recv = torch.empty(sum(recv_counts), rows.size(1), dtype=torch.uint8, device=self.device)
        pes, me = team
        nvshmem_module().internode_exchange(self.runtime, rows.contiguous(), recv, pes, me, send_counts, recv_counts,
                                            *geometry)
        return recv

    def _leg(self, team: tuple[list[int], int], rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
             config: Config) -> torch.Tensor:
        geometry = _leg_geometry(config)
        self._check_fits(rows.size(1), geometry, geometry)
        return self._run(team, rows, send_counts, recv_counts, geometry)

    def rail(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], config: Config) -> torch.Tensor:
        return self._leg(self._rail, rows, send_counts, recv_counts, config)

    def node(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], config: Config) -> torch.Tensor:
        return self._leg(self._node, rows, send_counts, recv_counts, config)

    def gather_rows(self, row: torch.Tensor) -> GatheredRows:
        """Every rank's int64 `row [n]` as `[R, n]` in rank order, on the device and on the CPU: the row to
        every rail member (network), then the rail's rows to every node member (NVLink), then one copy to
        the host, which waits for both.

        The gather's rings have one channel and one chunk per stream, whatever the call's `Config`, so
        ranks whose rows differ in size (another `num_experts` or `num_sms`) still meet in the same flags;
        each then reads whatever its ring slot held, which the stamp in front of every row tells apart:
        `PeerInputError` on every rank. An exchange that timed out raises its `RuntimeError` instead."""
        topo, n = self.topology, row.numel()
        self._gathers += 1
        words = _STAMP_WORDS + n
        width = -(-words * 8 // self.row_alignment) * self.row_alignment // 8
        stamped = torch.zeros(width, dtype=torch.int64, device=self.device)
        stamped[:_STAMP_WORDS] = torch.tensor([_ROW_STAMP, self._gathers, topo.rank], dtype=torch.int64)
        stamped[_STAMP_WORDS:words] = row
        mine = stamped.view(torch.uint8).view(1, -1)
        num_nodes, size = topo.num_nodes, topo.num_ranks_per_node
        rail_geometry, node_geometry = _Geometry(1, 1, 1), _Geometry(1, num_nodes, num_nodes)
        self._check_fits(mine.size(1), rail_geometry, node_geometry)
        # Row m: rank (m, l) of this rail.
        rail = self._run(self._rail, mine.expand(num_nodes, -1), [1] * num_nodes, [1] * num_nodes, rail_geometry)
        # Row j * M + m: rank (m, j), from node member j's rail rows.
        gathered = rail if size == 1 else self._run(self._node, rail.repeat(size, 1), [num_nodes] * size,
                                                    [num_nodes] * size, node_geometry)
        table = gathered.view(size, num_nodes, -1).transpose(0, 1).reshape(topo.num_ranks, -1).view(torch.int64)
        host = table.cpu()  # waits for both exchanges: the one copy the path's host side reads
        self.runtime.check_usable()
        expected = torch.tensor([[_ROW_STAMP, self._gathers, r] for r in range(topo.num_ranks)], dtype=torch.int64)
        garbled = (host[:, :_STAMP_WORDS] != expected).any(1).nonzero().flatten().tolist()
        if garbled:
            raise PeerInputError(
                f"count exchange: the rows of rank(s) {garbled} are not of this rank's size ({n} values): the ranks "
                f"disagree on a setting that sizes the counts (num_experts or config.num_sms of a dispatch), or a "
                f"rank called another operation")
        return GatheredRows(table[:, _STAMP_WORDS:words], host[:, _STAMP_WORDS:words])

    def agree_started(self) -> None:
        """Nothing: no host exchange on the CUDA backend (a cached dispatch or a combine compares no settings)."""

    def destroy(self) -> None:
        """Nothing of its own: the runtime belongs to the backend."""


class CudaInternodeBackend(CommBackend):
    """Normal mode across nodes on CUDA tensors (see the module docstring). `torch_backend` is the Buffer's
    torch backend over the same group, with its internode path attached: it computes the layout and checks
    `num_worst_tokens`; nothing goes through its store agreement on the hot path."""

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
        # As the intranode CUDA backend: no host exchange on the hot path, so a rank that rejects its input
        # raises here and its peers' kernels time out. (`start` keeps the base class's: a fresh dispatch
        # compares the settings in its count exchange, `InternodePath.dispatch`.)
        if local_error is not None:
            raise local_error

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
