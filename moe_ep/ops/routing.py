"""Routing and permutation math shared by every backend, the layers and the tests' callers.

Everything here is pure tensor arithmetic on one rank (no communication), vectorized, and defines
the orderings the whole package relies on:

* normal mode: a rank sends each token at most once to each destination rank; the tokens bound for
  one rank keep their token order, and a receiver lays its rows out source-rank-major, then in the
  sender's token order;
* low-latency mode: one message per (token, expert) pair; a receiver packs the rows of each local
  expert source-rank-major, then in token order.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

NUM_MAX_NVL_PEERS = 8
"""The most ranks of one NVLink domain the CUDA kernels serve (and of a virtual node); `dispatch_layout`'s
default node size (the Buffer passes its own node grouping, see `moe_ep/ops/topology.py`)."""


class DispatchLayout(NamedTuple):
    """What `get_dispatch_layout` computes from `topk_idx` on one rank."""

    num_tokens_per_rank: torch.Tensor  # [R] int32
    num_tokens_per_rdma_rank: Optional[torch.Tensor]  # [num_nodes] int32, None inside one node
    num_tokens_per_expert: torch.Tensor  # [E] int32
    is_token_in_rank: torch.Tensor  # [T, R] bool


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def align_up(values: torch.Tensor, alignment: int) -> torch.Tensor:
    """Round every entry up to a multiple of `alignment`."""
    if alignment <= 1:
        return values
    return (values + alignment - 1) // alignment * alignment


def expert_ranks(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """Owning rank of every top-k slot (experts are sharded contiguously), -1 for masked slots."""
    per_rank = num_experts // num_ranks
    return torch.where(topk_idx >= 0, topk_idx // per_rank, torch.full_like(topk_idx, -1))


def token_rank_mask(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """`is_token_in_rank [T, R]`: whether a token has at least one expert on each rank."""
    ranks = expert_ranks(topk_idx, num_experts, num_ranks)
    mask = torch.zeros(topk_idx.size(0), num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    # Masked slots land in an extra column that is dropped.
    mask.scatter_(1, torch.where(ranks >= 0, ranks, num_ranks), True)
    return mask[:, :num_ranks].contiguous()


def tokens_per_expert(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Number of (token, slot) selections of each expert, int32 [E]."""
    valid = topk_idx[topk_idx >= 0]
    return torch.bincount(valid, minlength=num_experts).to(torch.int32)


def dispatch_layout(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int, num_ranks_per_node: int = NUM_MAX_NVL_PEERS
) -> DispatchLayout:
    """Per-rank, per-node and per-expert counts and the token-to-rank mask of one rank's routing."""
    is_token_in_rank = token_rank_mask(topk_idx, num_experts, num_ranks)
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    per_node = None
    num_nodes = ceil_div(num_ranks, num_ranks_per_node)
    if num_nodes > 1:
        padded = torch.zeros(topk_idx.size(0), num_nodes * num_ranks_per_node, dtype=torch.bool,
                             device=topk_idx.device)
        padded[:, :num_ranks] = is_token_in_rank
        per_node = padded.view(-1, num_nodes, num_ranks_per_node).any(-1).sum(0, dtype=torch.int32)
    return DispatchLayout(num_tokens_per_rank, per_node, tokens_per_expert(topk_idx, num_experts), is_token_in_rank)


def channel_bounds(num_tokens: int, num_channels: int, device: torch.device) -> torch.Tensor:
    """Token range of each channel: channel c covers `[bounds[c], bounds[c+1])`, equal contiguous chunks."""
    per_channel = ceil_div(num_tokens, num_channels) if num_channels > 0 else 0
    return (torch.arange(num_channels + 1, device=device, dtype=torch.int64) * per_channel).clamp_(max=num_tokens)


def channel_prefix_matrix(is_token_in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
    """`[R, C]` int32: tokens sent to each rank by channels `0..c` inclusive."""
    num_tokens = is_token_in_rank.size(0)
    bounds = channel_bounds(num_tokens, num_channels, is_token_in_rank.device)
    prefix = torch.zeros(num_tokens + 1, is_token_in_rank.size(1), dtype=torch.int64, device=is_token_in_rank.device)
    prefix[1:] = is_token_in_rank.long().cumsum(0)
    return prefix[bounds[1:]].t().to(torch.int32).contiguous()


def rank_prefix_matrix(send_counts: torch.Tensor) -> torch.Tensor:
    """`[R_src, R_dst]` int32 inclusive prefix over source ranks of the token counts matrix."""
    return send_counts.cumsum(0).to(torch.int32)


def recv_channel_prefix_matrix(
    rank_prefix: torch.Tensor, sender_channel_prefix: torch.Tensor, rank: int
) -> torch.Tensor:
    """`[R_src, C]` int32 start row of every (source rank, channel) block in this rank's receive buffer.

    `sender_channel_prefix[s]` is source rank `s`'s inclusive channel prefix row for this rank.
    """
    rank_start = torch.zeros_like(rank_prefix[:, rank])
    rank_start[1:] = rank_prefix[:-1, rank]
    channel_start = torch.zeros_like(sender_channel_prefix)
    channel_start[:, 1:] = sender_channel_prefix[:, :-1]
    return (rank_start[:, None] + channel_start).to(torch.int32)


def send_order(is_token_in_rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens to send, destination-rank-major then in token order: `(dest_rank, token_idx)` int64."""
    dest, token = is_token_in_rank.t().nonzero(as_tuple=True)
    return dest, token


def send_head(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """`[T, R]` int32: row of each token inside the block its destination receives from us, -1 if unsent."""
    position = is_token_in_rank.int().cumsum(0, dtype=torch.int32) - 1
    return torch.where(is_token_in_rank, position, torch.full_like(position, -1))


def localize_topk(
    topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor], rank: int, num_local_experts: int
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Global expert ids to this rank's local ids (-1 when not local); weights of non-local slots become 0."""
    begin = rank * num_local_experts
    is_local = (topk_idx >= begin) & (topk_idx < begin + num_local_experts)
    local_idx = torch.where(is_local, topk_idx - begin, torch.full_like(topk_idx, -1))
    if topk_weights is None:
        return local_idx, None
    return local_idx, torch.where(is_local, topk_weights, torch.zeros_like(topk_weights))


def recv_tokens_per_expert(recv_counts_per_expert: torch.Tensor, alignment: int) -> torch.Tensor:
    """Tokens each local expert receives (summed over sources), rounded up to `alignment`."""
    return align_up(recv_counts_per_expert.sum(0), alignment)


# ---------------------------------------------------------------------------------------------
# Low-latency mode: one message per (token, expert) pair, packed expert-major on the receiver.
# ---------------------------------------------------------------------------------------------


class ExpertPairs(NamedTuple):
    """A rank's valid (token, slot) selections, sorted by (global expert, token)."""

    token: torch.Tensor  # [P] int64
    slot: torch.Tensor  # [P] int64
    expert: torch.Tensor  # [P] int64, non-decreasing
    count_per_expert: torch.Tensor  # [E] int64


def expert_major_pairs(topk_idx: torch.Tensor, num_experts: int) -> ExpertPairs:
    """Valid selections ordered by expert then token: the send order of low-latency messages."""
    num_tokens, num_topk = topk_idx.shape
    flat = topk_idx.reshape(-1)
    valid = (flat >= 0).nonzero(as_tuple=True)[0]
    expert = flat[valid]
    token = valid // num_topk
    order = torch.argsort(expert * max(num_tokens, 1) + token, stable=True)
    valid, expert, token = valid[order], expert[order], token[order]
    counts = torch.bincount(expert, minlength=num_experts)
    return ExpertPairs(token, valid % num_topk, expert, counts)


def pack_layout_range(count: torch.Tensor, begin: torch.Tensor) -> torch.Tensor:
    """Pack (count, begin) into int64 as `count | begin << 32` (count in the low word)."""
    return (count.long() & 0xFFFFFFFF) | (begin.long() << 32)


def unpack_layout_range(layout_range: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_layout_range`: `(count, begin)` int64."""
    return layout_range & 0xFFFFFFFF, layout_range >> 32


def expand_blocks(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Concatenated row ranges `[starts[i], starts[i] + counts[i])`, int64."""
    counts = counts.long()
    first = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    offsets = torch.arange(int(counts.sum()), device=counts.device) - first
    return torch.repeat_interleave(starts.long(), counts) + offsets


def packed_row_index(counts: torch.Tensor, slots_per_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the packed `[E_local * slots_per_expert]` buffer for messages grouped by (source, expert).

    `counts [R_src, E_local]` are message counts. Messages arrive source-major, then expert, then
    token; within each expert they are packed source-major from row 0. Returns the flat destination
    row of every message in arrival order and the `[E_local, R_src]` begin offsets.
    """
    counts = counts.long()
    num_src, num_local = counts.shape
    begin = counts.cumsum(0) - counts  # [R_src, E_local] exclusive prefix over sources
    base = torch.arange(num_local, device=counts.device) * slots_per_expert + begin  # [R_src, E_local]
    return expand_blocks(base.reshape(-1), counts.reshape(-1)), begin.t().contiguous()


def gather_rows_by_layout(layout_range: torch.Tensor, slots_per_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat packed rows to send back in combine, destination-rank-major then expert then row order.

    Returns the rows and the number of rows per destination (source) rank.
    """
    count, begin = unpack_layout_range(layout_range)  # [E_local, R]
    count_t, begin_t = count.t().reshape(-1), begin.t().reshape(-1)  # rank-major
    num_local = layout_range.size(0)
    expert = torch.arange(num_local, device=layout_range.device).repeat(layout_range.size(1))
    return expand_blocks(expert * slots_per_expert + begin_t, count_t), count.sum(0)


# ---------------------------------------------------------------------------------------------
# Expert-major permutation of received rows (the token dispatcher's layout).
# ---------------------------------------------------------------------------------------------


class ExpertLayout(NamedTuple):
    """Where the `(row, slot)` selections of received rows go in an expert-major layout.

    Expert `e` owns the layout rows `[offset_e, offset_e + tokens_per_expert[e])`: its selections in
    (row, slot) order, then zero padding up to the alignment. Layout rows past the last expert (a
    static layout) are padding too.
    """

    tokens_per_expert: torch.Tensor  # [E_local] int32, each rounded up to the alignment
    dest_row: torch.Tensor  # [N, k] int64 layout row of every selection, -1 for slots without a local expert
    src_row: torch.Tensor  # [N_layout] int64 received row of every layout row, -1 for padding
    src_slot: torch.Tensor  # [N_layout] int64 top-k slot of every layout row, -1 for padding


def static_layout_rows(num_worst_tokens: int, num_topk: int, num_local_experts: int, alignment: int) -> int:
    """Layout rows that always suffice for `num_worst_tokens` received rows (no host sync needed).

    A row selects each expert at most once, so at most `V = num_worst_tokens * min(k, E_local)`
    selections arrive, and each of the at most `min(E_local, V)` non-empty experts adds less than
    `alignment` rows of padding; every expert also holds at most `align_up(num_worst_tokens)` rows.
    """
    selections = num_worst_tokens * min(num_topk, num_local_experts)
    padded_total = (selections + min(num_local_experts, selections) * (alignment - 1)) // alignment * alignment
    per_expert = ceil_div(num_worst_tokens, alignment) * alignment
    return min(padded_total, num_local_experts * per_expert)


def expert_major_layout(
    recv_topk_idx: torch.Tensor, num_local_experts: int, alignment: int = 1, num_rows: Optional[int] = None
) -> ExpertLayout:
    """Expert-major layout of received rows from their local expert ids `recv_topk_idx [N, k]` (-1: none).

    Selections are ordered by expert, then row, then slot (stable, deterministic). `num_rows` fixes
    the layout size (e.g. `static_layout_rows(...)` or the sum of the host-side aligned counts);
    `None` computes the exact padded size, which synchronizes with the host. Apart from that, no
    host synchronization.
    """
    num_recv, num_topk = recv_topk_idx.shape
    device = recv_topk_idx.device
    flat = recv_topk_idx.reshape(-1)
    valid = flat >= 0
    # Slots without a local expert get the key `E_local`: sorted after every expert, then dropped.
    key = torch.where(valid, flat, num_local_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_local_experts]
    padded = align_up(counts, alignment)
    zero = counts.new_zeros(1)
    sorted_start = torch.cat([counts.cumsum(0) - counts, zero])  # first sorted position of each key
    layout_start = torch.cat([padded.cumsum(0) - padded, zero])  # first layout row of each key
    sorted_key = key[order]
    position = torch.arange(flat.numel(), device=device)
    dest_sorted = layout_start[sorted_key] + position - sorted_start[sorted_key]
    dest = torch.empty_like(flat).scatter_(0, order, dest_sorted)
    dest = torch.where(valid, dest, -1)
    if num_rows is None:
        num_rows = int(padded.sum())
    # Invalid slots all write the extra last row, which is dropped.
    src = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device)
    src.scatter_(0, torch.where(valid, dest, num_rows), position)
    src = src[:num_rows]
    is_row, width = src >= 0, max(num_topk, 1)
    return ExpertLayout(padded.to(torch.int32), dest.view(num_recv, num_topk),
                        torch.where(is_row, src // width, -1), torch.where(is_row, src % width, -1))
