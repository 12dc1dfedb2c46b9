"""Normal mode of the torch backend across nodes: a network leg between rails, then a leg inside the node.

A token crosses the network once per destination node, to the rank with its own local index there
(its "rail"), which forwards it to the ranks of that node that need it; combine reverses the two legs
and reduces inside the expert-side node first, so one partial row per (token, node) crosses the
network. The legs move packed byte rows between the members of a team: the rail (the ranks with this
rank's local index, one per node) and the node (its ranks), and gather every rank's count row (the
notify). `TorchLegs` runs them as `all_to_all_single` over sub-groups created once per Buffer and gathers
the counts with the torch backend's store agreement; the CUDA backend's `NvshmemLegs` (cuda_internode.py)
runs all three as NVSHMEM kernels. Everything else (what the counts are, packing, ordering and the
reductions) is this module's, so both backends give the same bits. Outputs are exactly those of the
flat path (docs/semantics.md, "Internode"), which the same module makes use the two-level combine
reduction across nodes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol

import torch
import torch.distributed as dist

from .. import routing
from ..config import Config
from ..handles import InternodeDispatchHandle
from ..requests import CombineRequest, DispatchRequest
from ..topology import NodeTopology, node_mask
from .agreement import check_same_settings
from .base import DispatchResult
from .torch_backend import (TorchBackend, _handle_counts, _pad_rows, _RowCodec, _sum_in_rank_order, _take_rows,
                            dispatch_payload, rank_handle, recv_tokens_per_expert, unpack_dispatched)


class NodeGroups(NamedTuple):
    """This rank's sub-groups; None where the group would be this rank alone (no collective needed)."""

    rail: Optional[dist.ProcessGroup]
    node: Optional[dist.ProcessGroup]
    created: tuple[dist.ProcessGroup, ...]  # the groups this object owns (destroyed with it)


def create_node_groups(group: dist.ProcessGroup, topology: NodeTopology) -> NodeGroups:
    """The rail and node groups of `group` (collective over `group`, in the same order on every rank).

    A Buffer over the whole world creates every rail and node group on every rank, as `dist.new_group`
    requires. Over a part of the world only the member ranks take part (`use_local_synchronization`);
    torch names such groups from their ranks and the number of groups the process already has, so every
    rank of the Buffer must have created the same number of process groups before.
    """
    if topology.num_ranks_per_node == 1:  # the rail is the whole group and the node leg a local copy
        return NodeGroups(group, None, ())
    members = dist.get_process_group_ranks(group)
    backend = dist.get_backend(group)
    whole_world = len(members) == dist.get_world_size()
    me = members[topology.rank]
    size, count = topology.num_ranks_per_node, topology.num_nodes
    # A sub-group's ranks must keep our order (node order on a rail): torch sorts them by global rank,
    # which is our order unless the Buffer's group itself is not in ascending order (newer torch only).
    options = {} if members == sorted(members) else {"sort_ranks": False}
    mine: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for local_ranks in [topology.rail_ranks(i) for i in range(size)] + [topology.node_ranks(n) for n in range(count)]:
        ranks = [members[r] for r in local_ranks]
        if whole_world or me in ranks:
            sub = dist.new_group(ranks, backend=backend, use_local_synchronization=not whole_world, **options)
            if me in ranks:
                mine[tuple(ranks)] = sub
    rail = mine[tuple(members[r] for r in topology.rail_ranks(topology.local_rank))]
    node = mine[tuple(members[r] for r in topology.node_ranks(topology.node))]
    return NodeGroups(rail, node, (rail, node))


def _exchange(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
              group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Byte rows to the group's ranks (`send_counts` each, in group order); None: a rank alone."""
    if group is None:
        return rows
    recv = torch.empty(sum(recv_counts), rows.size(1), dtype=rows.dtype, device=rows.device)
    dist.all_to_all_single(recv, rows, recv_counts, send_counts, group=group)
    return recv


class GatheredRows(NamedTuple):
    """A count exchange's table `[R, n]` int64, where the path needs it: on the rows' device (outputs,
    handle) and on the CPU (sizes, checks), each copied once."""

    device: torch.Tensor
    host: torch.Tensor


class Legs(Protocol):
    """How the two legs move rows (`[N, row_bytes]` uint8, grouped by destination member in team order),
    and how the ranks exchange their counts and agree on an operation.

    `rail` exchanges with the rail's members (node order), `node` with the node's (local-rank order);
    each returns the rows received, grouped by source member. Every rank makes the same calls with the
    same `config` (the CUDA legs size their rings by it). Rows are padded to `row_alignment` bytes.

    `gather_rows` is a fresh dispatch's count exchange, `agree_started` what a cached dispatch or a
    combine (no counts) exchanges instead. `checks_settings` says whether these two compare the started
    operation's settings themselves (the torch store agreement does); if not, the path appends them to
    the gathered row and compares them there, so a cached dispatch or a combine compares none."""

    row_alignment: int
    checks_settings: bool

    def rail(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], config: Config) -> torch.Tensor:
        ...

    def node(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], config: Config) -> torch.Tensor:
        ...

    def gather_rows(self, row: torch.Tensor) -> GatheredRows:
        """Every rank's int64 `row [n]` as `[R, n]` in rank order, on `row`'s device and on the CPU."""
        ...

    def agree_started(self) -> None:
        ...

    def destroy(self) -> None:
        ...


class TorchLegs:
    """Both legs as `all_to_all_single` over the rail and node sub-groups (any torch.distributed backend);
    the counts and the agreement go through `backend`'s store agreement (`TorchBackend._agree`)."""

    checks_settings = True

    def __init__(self, backend: TorchBackend, topology: NodeTopology, row_alignment: int = 1) -> None:
        self.backend = backend
        self.groups = create_node_groups(backend.group, topology)
        self.row_alignment = row_alignment

    def rail(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], config: Config) -> torch.Tensor:
        return _exchange(rows, send_counts, recv_counts, self.groups.rail)

    def node(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], config: Config) -> torch.Tensor:
        return _exchange(rows, send_counts, recv_counts, self.groups.node)

    def gather_rows(self, row: torch.Tensor) -> GatheredRows:
        host = self.backend._gather_counts(row)  # the store hands the rows to the host
        return GatheredRows(host.to(row.device), host)

    def agree_started(self) -> None:
        self.backend.agree_started()

    def destroy(self) -> None:
        for group in self.groups.created:
            dist.destroy_process_group(group)
        self.groups = NodeGroups(None, None, ())


def _counts_from_prefix(prefix: torch.Tensor) -> list[int]:
    counts = prefix.long().clone()
    counts[1:] -= prefix[:-1].long()
    return counts.tolist()


def _arrival_order(counts_to_me: list[int], topology: NodeTopology,
                   device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Rows arrive from the forwarders (local ranks) in turn, each sending its sources `(m, f)` node by
    node in token order; the final order is source-rank-major. Returns `order` (`final = arrival[order]`)
    and the rows from each forwarder."""
    num_nodes, size = topology.num_nodes, topology.num_ranks_per_node
    grid = torch.tensor(counts_to_me, dtype=torch.int64, device=device).view(num_nodes, size)  # [m, f]
    source = torch.arange(topology.num_ranks, device=device).view(num_nodes, size).t().reshape(-1)
    source_of_row = torch.repeat_interleave(source, grid.t().reshape(-1))
    return torch.argsort(source_of_row, stable=True), grid.sum(0).tolist()


class InternodePath:
    """Normal mode across nodes over `legs` (default `TorchLegs` over `backend`, a torch backend over the
    Buffer's group); the Buffer attaches the torch backend's as `TorchBackend.internode`, the CUDA backend
    runs one over `NvshmemLegs`. The legs exchange the counts; `backend` checks `num_worst_tokens`.

    `hierarchical` (default True) selects the two-leg path for fresh dispatches; False keeps the flat
    all-to-all (the tests' and benchmarks' baseline: same outputs). A cached dispatch or a combine
    follows its handle: an `InternodeDispatchHandle` takes the two legs, a `DispatchHandle` the flat
    path. `last_path` says which ran last; `last_network_rows` and `last_network_bytes` count the rows
    (and their packed bytes) this rank's last hierarchical call sent to other nodes.
    """

    def __init__(self, backend: TorchBackend, topology: NodeTopology, legs: Optional[Legs] = None) -> None:
        if topology.num_nodes < 2:
            raise ValueError(f"topology: the internode path needs more than one node, got {topology}")
        self.backend = backend
        self.topology = topology
        self.legs: Legs = legs if legs is not None else TorchLegs(backend, topology)
        self.hierarchical = True
        self.last_path: Optional[str] = None
        self.last_network_rows = 0
        self.last_network_bytes = 0

    def takes(self, handle: Optional[tuple] = None) -> bool:
        """Whether this call runs the two legs (fresh dispatch: `hierarchical`; otherwise the handle's kind)."""
        two_legs = self.hierarchical if handle is None else len(handle) == len(InternodeDispatchHandle._fields)
        if not two_legs:
            self.last_path = "flat"
        return two_legs

    def destroy(self) -> None:
        self.legs.destroy()

    def _codec(self, tensors: list[torch.Tensor], extra_bytes: int = 0) -> _RowCodec:
        return _RowCodec.like(tensors, extra_bytes, self.legs.row_alignment)

    def _count_network(self, send_counts: list[int], row_bytes: int) -> None:
        rows = sum(send_counts) - send_counts[self.topology.node]
        self.last_network_rows, self.last_network_bytes = rows, rows * row_bytes

    # ------------------------------------------------------------------ the two legs

    def _rail_leg(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                  config: Config) -> torch.Tensor:
        """Network leg (either way): rows to the rail rank of each node, counted; returns the rows received."""
        self.last_path = "hierarchical"
        self._count_network(send_counts, rows.size(1))
        return self.legs.rail(rows, send_counts, recv_counts, config)

    def _to_rails(self, rows: torch.Tensor, to_node: torch.Tensor, from_nodes: list[int], config: Config) -> torch.Tensor:
        """Dispatch's network leg: rows (node-major) to the rail rank of each node; returns the rows received."""
        return self._rail_leg(rows, to_node.sum(0).tolist(), from_nodes, config)

    def _forward(self, rail_rows: torch.Tensor, forward: torch.Tensor, counts_to_me: list[int],
                 config: Config) -> torch.Tensor:
        """Node leg: each rail row to the local ranks `forward [N_rail, L]` names; returns the received rows in
        the final (source-rank-major) order."""
        _, row = routing.send_order(forward)
        order, from_forwarders = _arrival_order(counts_to_me, self.topology, rail_rows.device)
        received = self._node_leg(_take_rows(rail_rows, row), forward.sum(0).tolist(), from_forwarders, config)
        return _take_rows(received, order)

    def _node_leg(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                  config: Config) -> torch.Tensor:
        if self.topology.num_ranks_per_node == 1:  # the node is this rank alone
            return rows
        return self.legs.node(rows, send_counts, recv_counts, config)

    # ------------------------------------------------------------------ normal mode

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        x, num_tokens_per_rank, is_token_in_rank = request.x, request.num_tokens_per_rank, request.is_token_in_rank
        num_tokens_per_expert, config = request.num_tokens_per_expert, request.config
        num_worst_tokens = request.num_worst_tokens
        topo, device = self.topology, x.device
        num_ranks, num_nodes, me = topo.num_ranks, topo.num_nodes, topo.rank
        num_experts, num_channels = num_tokens_per_expert.numel(), config.num_channels
        num_local = num_experts // num_ranks
        to_node = node_mask(is_token_in_rank, topo.num_ranks_per_node)
        channel_prefix = routing.channel_prefix_matrix(is_token_in_rank, num_channels)
        rdma_channel_prefix = routing.channel_prefix_matrix(to_node, num_channels)

        # Notify: every rank learns all send counts, expert counts and channel prefixes, per rank and per
        # node, and the receive bounds. The operation's settings ride along where the legs do not compare
        # them themselves, so that ranks that disagree raise on every rank before any data moves.
        agreed = {} if self.legs.checks_settings else request.agreed()
        header = torch.cat([
            num_tokens_per_rank.to(device=device, dtype=torch.int64),
            num_tokens_per_expert.to(device=device, dtype=torch.int64),
            channel_prefix.to(device=device, dtype=torch.int64).reshape(-1),
            rdma_channel_prefix.to(device=device, dtype=torch.int64).reshape(-1),
            torch.tensor([num_worst_tokens, *agreed.values()], dtype=torch.int64, device=device),
        ])
        table, host = self.legs.gather_rows(header)
        rank_columns = num_ranks + num_experts
        rdma_columns = rank_columns + num_ranks * num_channels
        worst_column = rdma_columns + num_nodes * num_channels
        if agreed:
            check_same_settings("dispatch", agreed, host[:, worst_column + 1:].tolist())
        send_matrix = table[:, :num_ranks]
        expert_counts = table[:, num_ranks:rank_columns]
        sender_channel_prefix = table[:, rank_columns:rdma_columns].view(num_ranks, num_ranks, num_channels)[:, me]
        rail_sources = topo.rail_ranks(topo.local_rank)
        sender_rdma_prefix = table[rail_sources, rdma_columns:worst_column].view(
            num_nodes, num_nodes, num_channels)[:, topo.node]  # [source node, C]
        host_sends = host[:, :num_ranks]
        self.backend._check_worst_tokens(host_sends.sum(0).tolist(), host[:, worst_column].tolist())
        recv_rdma_rank_prefix_sum = sender_rdma_prefix[:, -1].cumsum(0).to(torch.int32)

        # Network leg: each token once per destination node, with the node's slice of its rank mask.
        dest_node, token = routing.send_order(to_node)
        payload = dispatch_payload(request)
        codec = self._codec(payload, extra_bytes=topo.num_ranks_per_node)
        in_node = is_token_in_rank.reshape(x.size(0), num_nodes, topo.num_ranks_per_node)[token, dest_node]
        from_nodes = host[rail_sources, rdma_columns:worst_column].view(num_nodes, num_nodes, num_channels)[
            :, topo.node, -1].tolist()
        rail_rows = self._to_rails(codec.pack(payload, token, extra=in_node), to_node, from_nodes, config)

        # Node leg: the rail rank forwards each row to the ranks of its node that need it.
        forward = codec.extra(rail_rows).bool()
        to_me = host_sends[:, me].tolist()
        received = codec.unpack(self._forward(rail_rows, forward, to_me, config))

        num_rows = num_worst_tokens if num_worst_tokens > 0 else sum(to_me)
        out = unpack_dispatched(received, request, num_rows, me, num_local)
        handle = InternodeDispatchHandle(
            *rank_handle(send_matrix, channel_prefix, sender_channel_prefix, out.recv_src_idx, is_token_in_rank, me),
            rdma_channel_prefix_matrix=rdma_channel_prefix.to(device),
            recv_rdma_channel_prefix_matrix=routing.recv_channel_prefix_matrix(
                recv_rdma_rank_prefix_sum[:, None], sender_rdma_prefix, 0),
            recv_rdma_rank_prefix_sum=recv_rdma_rank_prefix_sum,
            send_rdma_head=routing.send_head(to_node),
            send_nvl_head=routing.send_head(forward),
        )
        return DispatchResult(out.recv_x, out.recv_x_scales, out.recv_topk_idx, out.recv_topk_weights,
                              recv_tokens_per_expert(expert_counts, request, me, num_local), handle)

    def cached_dispatch(self, request: DispatchRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        self.legs.agree_started()
        x, x_scales = request.x, request.x_scales
        hdl = InternodeDispatchHandle(*request.handle)
        to_node = hdl.send_rdma_head >= 0
        _, token = routing.send_order(to_node)
        payload = [x] + ([x_scales] if x_scales is not None else [])
        codec = self._codec(payload)
        from_nodes = _counts_from_prefix(hdl.recv_rdma_rank_prefix_sum)
        rail_rows = self._to_rails(codec.pack(payload, token), to_node, from_nodes, request.config)
        forward = hdl.send_nvl_head[:sum(from_nodes)] >= 0
        received = codec.unpack(self._forward(rail_rows, forward, _handle_counts(hdl, self.topology.rank)[1],
                                              request.config))
        num_rows = hdl.recv_src_idx.numel()
        recv_scales = _pad_rows(received[1], num_rows, 0) if x_scales is not None else None
        return _pad_rows(received[0], num_rows, 0), recv_scales

    def combine(self, request: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        self.legs.agree_started()
        x, topk_weights, bias_0, bias_1 = request.x, request.topk_weights, request.bias_0, request.bias_1
        hdl = InternodeDispatchHandle(*request.handle)
        topo, device = self.topology, x.device
        acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32

        # Node leg back: every row to the rail rank that forwarded it (the reverse of the dispatch's order).
        counts_to_me = _handle_counts(hdl, topo.rank)[1]
        order, to_forwarders = _arrival_order(counts_to_me, topo, device)
        arrival = torch.empty_like(order)
        arrival[order] = torch.arange(order.numel(), device=device)
        num_real = sum(counts_to_me)
        payload = [x[:num_real]] + ([topk_weights[:num_real]] if topk_weights is not None else [])
        codec = self._codec(payload)
        from_nodes = _counts_from_prefix(hdl.recv_rdma_rank_prefix_sum)
        forward = hdl.send_nvl_head[:sum(from_nodes)] >= 0
        back = codec.unpack(self._node_leg(codec.pack(payload, arrival), to_forwarders, forward.sum(0).tolist(),
                                           request.config))

        # The rail rank reduces each token's rows of its node in local-rank order, rounded to x's dtype.
        local_rank, rail_row = routing.send_order(forward)
        partials = [_sum_in_rank_order(torch.zeros(forward.size(0), x.size(1), dtype=acc_dtype, device=device),
                                       back[0], local_rank, rail_row, topo.num_ranks_per_node).to(x.dtype)]
        if topk_weights is not None:
            zeros = torch.zeros(forward.size(0), topk_weights.size(1), dtype=torch.float32, device=device)
            partials.append(_sum_in_rank_order(zeros, back[1], local_rank, rail_row, topo.num_ranks_per_node))

        # Network leg back: one partial row per (token, node); the source adds them in node order.
        to_node = hdl.send_rdma_head >= 0
        partial_codec = self._codec(partials)
        node_partials = partial_codec.unpack(self._rail_leg(partial_codec.pack(partials), from_nodes,
                                                            to_node.sum(0).tolist(), request.config))
        dest_node, token = routing.send_order(to_node)
        combined = torch.zeros(to_node.size(0), x.size(1), dtype=acc_dtype, device=device)
        for bias in (bias_0, bias_1):
            if bias is not None:
                combined += bias.to(acc_dtype)
        combined = _sum_in_rank_order(combined, node_partials[0], dest_node, token, topo.num_nodes)
        combined_weights = None
        if topk_weights is not None:
            zeros = torch.zeros(to_node.size(0), topk_weights.size(1), dtype=torch.float32, device=device)
            combined_weights = _sum_in_rank_order(zeros, node_partials[1], dest_node, token, topo.num_nodes)
        return combined.to(x.dtype), combined_weights

    def reduce_flat(self, acc: torch.Tensor, rows: torch.Tensor, dest: torch.Tensor, token: torch.Tensor,
                    partial_dtype: torch.dtype) -> torch.Tensor:
        """The flat path's combine sum with the internode formula: per node, the rows of its ranks in rank
        order (from zero, in `acc`'s dtype) rounded to `partial_dtype`; then the node partials in node order."""
        size = self.topology.num_ranks_per_node
        node_of = dest // size
        for node in range(self.topology.num_nodes):
            mine = node_of == node
            partial = _sum_in_rank_order(torch.zeros_like(acc), rows[mine], dest[mine] - node * size, token[mine],
                                         size)
            hit = torch.unique(token[mine])
            acc.index_add_(0, hit, partial[hit].to(partial_dtype).to(acc.dtype))
        return acc
