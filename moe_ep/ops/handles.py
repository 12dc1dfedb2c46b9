"""Communication handles: NamedTuples that unpack and index exactly like DeepEP V1's tuples."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class HandleOrigin(NamedTuple):
    """The `Buffer.dispatch` call that made a handle. The backend made the handle's tensors with the dtypes,
    shapes and device that the checks of a handle want for this group size and device (a handle's tensors
    keep them: it is a tuple), so a later call with the same group size and device skips those checks; a
    handle rebuilt from its fields has no origin and is checked in full."""

    num_ranks: int  # R, the Buffer's group size
    device: torch.device  # where the dispatch's tokens were
    num_tokens: int  # T, the dispatch's source tokens


class _DispatchHandleFields(NamedTuple):
    rank_prefix_matrix: torch.Tensor  # [R_src, R_dst] int32, inclusive prefix over source ranks
    channel_prefix_matrix: torch.Tensor  # [R_dst, C] int32, sender side, inclusive prefix over channels
    recv_channel_prefix_matrix: torch.Tensor  # [R_src, C] int32, receiver side, start row per block
    recv_src_idx: torch.Tensor  # [N_recv] int32, token index on its source rank (-1 for padding rows)
    is_token_in_rank: torch.Tensor  # [T, R] bool, sender side
    send_head: torch.Tensor  # [T, R] int32, row inside the block sent to each rank, -1 if not sent


class DispatchHandle(_DispatchHandleFields):
    """Layout of one normal-mode dispatch, reused by cached dispatch and by combine; a 6-tuple like DeepEP's.

    On the receiving side rows are laid out source-rank-major, then in the sender's token order.
    Besides its six fields, a handle made by a dispatch without `num_worst_tokens` carries
    `exact_rows=True`: it describes exactly the rows received, none of padding, so that a cached dispatch
    with it needs no padding pass. A handle rebuilt from the six fields has False (padding is then
    written wherever the counts leave rows over). `Buffer.dispatch` also records its `origin`.
    """

    exact_rows: bool = False
    origin: Optional[HandleOrigin] = None

    def with_exact_rows(self) -> "DispatchHandle":
        """This handle, marked as describing exactly the rows its dispatch received."""
        handle = DispatchHandle(*self)
        handle.exact_rows = True
        return handle


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


class DispatchedRouting(NamedTuple):
    """What a low-latency combine must repeat of its dispatch's routing. The backend made the handle's
    `layout_range` `[E/R, R]` int64 for the dispatch's group size (a handle's tensors keep their dtype and
    shape: it is a tuple), so a combine over as many ranks needs not check it."""

    num_ranks: int  # R, the dispatch's group size
    shape: tuple[int, int]  # (T, k) of the dispatch's topk_idx
    topk_idx: Optional[torch.Tensor]  # a copy of it, kept while value checks are on


class _LowLatencyHandleFields(NamedTuple):
    src_info: torch.Tensor  # [E_local, R * max_tokens] int32, source token index of each packed row
    layout_range: torch.Tensor  # [E_local, R] int64, count | begin << 32
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


class LowLatencyHandle(_LowLatencyHandleFields):
    """Layout of one low-latency dispatch, reused by low-latency combine; a 5-tuple like DeepEP's.

    Besides its five fields, a handle made by `Buffer.low_latency_dispatch` carries `routing`, the
    dispatch's group size and top-k that the combine must repeat (`Buffer` checks them); a handle rebuilt
    from the five fields has none, and its combine is checked only as far as the exchanged sizes go.
    """

    routing: Optional[DispatchedRouting] = None
