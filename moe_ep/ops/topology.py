"""Which ranks of a Buffer's group form a node (one NVLink domain), found from the hosts or set by hand.

Nodes are equal-sized groups of consecutive ranks: rank `r` is local rank `r % L` of node `r // L`
(`L` ranks per node). Without an override a node is a host, and the hosts must hold equal groups of
consecutive ranks. `num_ranks_per_node` (the Buffer keyword, or the setting `MOE_EP_NUM_RANKS_PER_NODE`)
splits hosts into **virtual nodes** of 1 to 8 ranks, so that the internode path runs on one machine.
Every rank must agree on the grouping; `resolve_node_topology` checks that with one tensor all-gather.
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .backends.collectives import all_gather_bytes
from .constants import NUM_MAX_NVL_PEERS
from .settings import NUM_RANKS_PER_NODE_ENV, settings
from .validation import check_tensor, value_checks_enabled

_HOST_ID_BYTES = 8


@dataclass(frozen=True)
class NodeTopology:
    """`num_ranks` ranks in nodes of `num_ranks_per_node` consecutive ranks; `rank` is this process."""

    num_ranks: int
    num_ranks_per_node: int
    rank: int

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.num_ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.num_ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.num_ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """Group ranks of `node`, ascending."""
        first = node * self.num_ranks_per_node
        return list(range(first, first + self.num_ranks_per_node))

    def rail_ranks(self, local_rank: int) -> list[int]:
        """Group ranks with local index `local_rank` on every node (a "rail"), ascending (node order)."""
        return list(range(local_rank, self.num_ranks, self.num_ranks_per_node))


def check_num_ranks_per_node(value: object, num_ranks: int, name: str = "num_ranks_per_node") -> int:
    """A virtual node size: an integer from 1 to 8 that divides the group size."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= NUM_MAX_NVL_PEERS:
        raise ValueError(f"{name}: expected an integer from 1 to {NUM_MAX_NVL_PEERS}, got {value!r}")
    if num_ranks % value != 0:
        raise ValueError(f"{name}: expected a divisor of the group size {num_ranks} (equal-sized nodes), "
                         f"got {value}")
    return value


def requested_num_ranks_per_node(value: Optional[int], num_ranks: int) -> Optional[int]:
    """The Buffer keyword if given, else the setting; checked; None to use the hosts."""
    if value is not None:
        return check_num_ranks_per_node(value, num_ranks)
    setting = settings().num_ranks_per_node
    return None if setting is None else check_num_ranks_per_node(setting, num_ranks, NUM_RANKS_PER_NODE_ENV)


def expected_ranks_per_node(num_ranks: int) -> int:
    """Ranks per node a Buffer of `num_ranks` ranks will use, as far as known before it learns the hosts:
    the setting `MOE_EP_NUM_RANKS_PER_NODE`, else DeepEP's assumption of 8 GPUs per node (for sizing
    buffers; the Buffer itself learns the hosts)."""
    setting = requested_num_ranks_per_node(None, num_ranks)
    return setting if setting is not None else min(num_ranks, NUM_MAX_NVL_PEERS)


def host_id() -> bytes:
    """A fixed-size id of this process's host (a hash of its name)."""
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=_HOST_ID_BYTES).digest()


def gather_host_records(group: dist.ProcessGroup, num_ranks: int, device: torch.device,
                        payload: bytes = b"") -> list[tuple[bytes, bytes]]:
    """Every rank's `(host id, payload)` in rank order (`payload` has the same length on every rank)."""
    records = all_gather_bytes(host_id() + payload, group, num_ranks, device)
    return [(record[:_HOST_ID_BYTES], record[_HOST_ID_BYTES:]) for record in records]


def host_runs(hosts: list[bytes]) -> list[int]:
    """Sizes of the runs of consecutive ranks on the same host, in rank order."""
    runs: list[int] = []
    for index, host in enumerate(hosts):
        if index > 0 and host == hosts[index - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def resolve_node_topology(group: dist.ProcessGroup, rank: int, num_ranks: int, requested: Optional[int],
                          device: torch.device, allow_mnnvl: bool = False) -> NodeTopology:
    """The node grouping every rank agrees on (collective: one all-gather of host ids and requests).

    `requested` (from `requested_num_ranks_per_node`) sets virtual nodes, which must not span hosts
    unless `allow_mnnvl` (an NVLink domain across hosts); None makes every host one node, which needs
    the same number of consecutive ranks on every host. Errors are raised on every rank alike.
    """
    records = gather_host_records(group, num_ranks, device, (requested or 0).to_bytes(4, "little"))
    per_rank = [int.from_bytes(payload, "little") or None for _, payload in records]
    if len(set(per_rank)) > 1:
        raise ValueError(f"num_ranks_per_node: the ranks disagree (rank order, None = the hosts): {per_rank}; "
                         f"pass the same value (or set the same {NUM_RANKS_PER_NODE_ENV}) on every rank")
    hosts = [host for host, _ in records]
    runs = host_runs(hosts)
    if requested is None:
        if len(runs) != len(set(hosts)):
            raise ValueError(f"group: the ranks of a host are not consecutive (ranks per run of one host: {runs}); "
                             f"launch the ranks host by host, or set num_ranks_per_node (or "
                             f"{NUM_RANKS_PER_NODE_ENV})")
        if len(set(runs)) > 1:
            raise ValueError(f"group: the hosts hold different numbers of ranks ({runs} in rank order); nodes "
                             f"must be equal, so set num_ranks_per_node (or {NUM_RANKS_PER_NODE_ENV})")
        return NodeTopology(num_ranks, runs[0], rank)
    if not allow_mnnvl:
        starts = [sum(runs[:i]) for i in range(len(runs))]
        spanning = [s for s in starts if s % requested != 0]
        if spanning:
            raise ValueError(f"num_ranks_per_node: {requested} puts ranks of different hosts in one node (a host "
                             f"starts at rank {spanning[0]}; ranks per host {runs}); pick a divisor of every "
                             f"host's rank count, or pass allow_mnnvl=True for an NVLink domain across hosts")
    return NodeTopology(num_ranks, requested, rank)


def node_mask(is_token_in_rank: torch.Tensor, num_ranks_per_node: int) -> torch.Tensor:
    """`[T, num_nodes]` bool: whether a token goes to at least one rank of each node."""
    num_tokens, num_ranks = is_token_in_rank.shape
    return is_token_in_rank.reshape(num_tokens, num_ranks // num_ranks_per_node, num_ranks_per_node).any(2)


def check_num_tokens_per_rdma_rank(value: Optional[torch.Tensor], is_token_in_rank: torch.Tensor,
                                   topology: NodeTopology, device: torch.device) -> None:
    """`dispatch`'s optional per-node counts: ignored in one node (DeepEP passes None there); across nodes
    `[num_nodes] int32` equal to what `get_dispatch_layout` returns."""
    if value is None or topology.num_nodes == 1:
        return
    check_tensor("num_tokens_per_rdma_rank", value, dtype=torch.int32, shape=(topology.num_nodes,), device=device)
    if value_checks_enabled():
        expected = node_mask(is_token_in_rank, topology.num_ranks_per_node).sum(0, dtype=torch.int32)
        if not torch.equal(expected, value):
            raise ValueError("num_tokens_per_rdma_rank: does not match the tokens per node of is_token_in_rank "
                             f"({value.tolist()} given, {expected.tolist()} expected)")
