"""Communication handles: NamedTuples that unpack and index exactly like DeepEP V1's tuples."""

from __future__ import annotations

from typing import NamedTuple

import torch


class DispatchHandle(NamedTuple):
    """Layout of one normal-mode dispatch, reused by cached dispatch and by combine.

    On the receiving side rows are laid out source-rank-major, then in the sender's token order.
    """

    rank_prefix_matrix: torch.Tensor  # [R_src, R_dst] int32, inclusive prefix over source ranks
    channel_prefix_matrix: torch.Tensor  # [R_dst, C] int32, sender side, inclusive prefix over channels
    recv_channel_prefix_matrix: torch.Tensor  # [R_src, C] int32, receiver side, start row per block
    recv_src_idx: torch.Tensor  # [N_recv] int32, token index on its source rank (-1 for padding rows)
    is_token_in_rank: torch.Tensor  # [T, R] bool, sender side
    send_head: torch.Tensor  # [T, R] int32, row inside the block sent to each rank, -1 if not sent


class InternodeDispatchHandle(NamedTuple):
    """Layout of one hierarchical (more than one node) dispatch, reused by cached dispatch and by combine.

    The first six fields are those of `DispatchHandle`, with the same values. The others describe the
    two legs (docs/semantics.md, "Internode"): the network leg ("rail": node to node between ranks of
    the same local index) and the forwarding leg inside the destination node.
    """

    rank_prefix_matrix: torch.Tensor  # [R_src, R_dst] int32, inclusive prefix over source ranks
    channel_prefix_matrix: torch.Tensor  # [R_dst, C] int32, sender side, inclusive prefix over channels
    recv_channel_prefix_matrix: torch.Tensor  # [R_src, C] int32, receiver side, start row per block
    recv_src_idx: torch.Tensor  # [N_recv] int32, token index on its source rank (-1 for padding rows)
    is_token_in_rank: torch.Tensor  # [T, R] bool, sender side
    send_head: torch.Tensor  # [T, R] int32, row inside the block sent to each rank, -1 if not sent
    rdma_channel_prefix_matrix: torch.Tensor  # [num_nodes, C] int32, sender side, tokens per node, inclusive
    recv_rdma_channel_prefix_matrix: torch.Tensor  # [num_nodes, C] int32, forwarder side, start rail row per block
    recv_rdma_rank_prefix_sum: torch.Tensor  # [num_nodes] int32, forwarder side, inclusive prefix of rail rows
    send_rdma_head: torch.Tensor  # [T, num_nodes] int32, row inside the block sent to each node, -1 if not sent
    send_nvl_head: torch.Tensor  # [N_rail, L] int32, forwarder side, row inside the block forwarded to each local rank


class LowLatencyHandle(NamedTuple):
    """Layout of one low-latency dispatch, reused by low-latency combine."""

    src_info: torch.Tensor  # [E_local, R * max_tokens] int32, source token index of each packed row
    layout_range: torch.Tensor  # [E_local, R] int64, count | begin << 32
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
