"""Internode normal mode on the torch backend over gloo, with virtual nodes on one host: the hierarchical
path against the flat path (bit for bit) and an independent reference of the internode semantics."""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, replace
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep import ops
from moe_ep.layers import MoEConfig, MoELayer
from moe_ep.ops import fp8, routing
from moe_ep.ops.settings import reload as reload_settings
from reference import RankInputs, dispatch_reference, expert_output, make_inputs, owner, tokens_for
from test_agreement import _counting

# Buffers of this module's workers, one per (group ranks, ranks per node): each creates sub-groups once.
_BUFFERS: dict[tuple, moe_ep.Buffer] = {}


def _buffer(ranks_per_node: int, group: dist.ProcessGroup | None = None) -> moe_ep.Buffer:
    group = group if group is not None else dist.group.WORLD
    key = (tuple(dist.get_process_group_ranks(group)), ranks_per_node)
    if key not in _BUFFERS:
        buffer = moe_ep.Buffer(group, backend="torch", num_ranks_per_node=ranks_per_node)
        assert buffer.node_topology().num_nodes > 1  # learns the nodes now: `_torch.internode` exists
        _BUFFERS[key] = buffer
    return _BUFFERS[key]


@dataclass(frozen=True)
class Case:
    name: str
    tokens: tuple[int, ...] = (40, 17, 0, 33, 25, 9)
    hidden: int = 256
    experts_per_rank: int = 4
    topk: int = 4
    dtype: str = "bfloat16"
    routing: str = "random"  # random, skewed, one_rank_empty (make_inputs), every_node, node_silent
    alignment: int = 1
    worst_extra: int = -1  # >= 0: num_worst_tokens = rows of the busiest rank + this
    use_fp8: bool = False
    num_sms: int = 4


RANDOM = Case("random_aligned", alignment=4)
SKEWED = Case("skewed", routing="skewed", hidden=128, topk=3)
EMPTY_RANK = Case("one_rank_empty", routing="one_rank_empty", hidden=128)
NODE_SILENT = Case("node_silent", routing="node_silent", alignment=2)
EVERY_NODE = Case("every_node", routing="every_node", hidden=128)
FP8 = Case("fp8_2048", use_fp8=True, hidden=2048, tokens=(24, 11, 30, 5, 17, 8))
WORST = Case("num_worst_tokens", worst_extra=3, alignment=2, dtype="float32")
BIG_BF16 = Case("bf16_7168", hidden=7168, tokens=(12, 5, 9, 0, 7, 3))
BIG_FP8 = Case("fp8_7168", hidden=7168, use_fp8=True, tokens=(9, 4, 11, 6, 2, 8), routing="every_node")

# (nodes, ranks per node) -> cases; every feature runs on several shapes.
SHAPES = {
    (2, 1): [RANDOM, EVERY_NODE, FP8],
    (2, 2): [RANDOM, SKEWED, NODE_SILENT, EVERY_NODE, FP8, WORST, BIG_FP8],
    (3, 2): [RANDOM, SKEWED, NODE_SILENT, EVERY_NODE, FP8, BIG_BF16],
    (2, 3): [RANDOM, EMPTY_RANK, NODE_SILENT, WORST],
    (4, 1): [RANDOM, EMPTY_RANK, EVERY_NODE],
}


def _inputs(c: Case, world: int, ranks_per_node: int) -> list[RankInputs]:
    """The case's inputs for every rank (identical on every process)."""
    num_experts = c.experts_per_rank * world
    tokens = tokens_for(c.tokens, world)
    routing = c.routing
    if routing == "node_silent":  # the ranks of node 1 have no tokens: that node sends nothing
        tokens = [0 if r // ranks_per_node == 1 else n for r, n in enumerate(tokens)]
        routing = "random"
    every_node = routing == "every_node"
    inputs = make_inputs(4321 + world, world, tokens, c.hidden, num_experts, c.topk,
                         dtype=getattr(torch, c.dtype), routing="random" if every_node else routing,
                         mask_prob=0 if every_node else 0.2)
    if every_node:  # one expert on every node, in shuffled slots; the other slots masked
        num_nodes = world // ranks_per_node
        per_node = num_experts // num_nodes
        gen = torch.Generator().manual_seed(77)
        for inp in inputs:
            num_tokens = inp.x.size(0)
            idx = torch.full((num_tokens, c.topk), -1, dtype=torch.int64)
            idx[:, :num_nodes] = torch.arange(num_nodes) * per_node + torch.randint(per_node, (num_tokens, num_nodes),
                                                                                   generator=gen)
            inp.topk_idx = idx.gather(1, torch.rand(num_tokens, c.topk, generator=gen).argsort(1))
    return inputs


# ---------------------------------------------------------------------------------------------- reference


def _sent(inputs: list[RankInputs], src: int, token: int, per_rank: int) -> set[int]:
    return {owner(e, per_rank) for e in inputs[src].topk_idx[token].tolist() if e >= 0}


def internode_handle_reference(inputs: list[RankInputs], me: int, num_experts: int, size: int,
                               num_channels: int) -> dict:
    """The internode handle fields of rank `me` and its network rows, from the semantics with plain loops."""
    world = len(inputs)
    per_rank, num_nodes = num_experts // world, world // size
    node, local = me // size, me % size

    def nodes_of(src: int, t: int) -> set[int]:
        return {r // size for r in _sent(inputs, src, t, per_rank)}

    def channel(t: int, num_tokens: int) -> int:
        return t // -(-num_tokens // num_channels)

    mine = inputs[me].x.size(0)
    send_rdma_head = torch.full((mine, num_nodes), -1, dtype=torch.int32)
    rdma_prefix = torch.zeros(num_nodes, num_channels, dtype=torch.int32)
    for n in range(num_nodes):
        sent = [t for t in range(mine) if n in nodes_of(me, t)]
        for position, t in enumerate(sent):
            send_rdma_head[t, n] = position
        for c in range(num_channels):
            rdma_prefix[n, c] = sum(1 for t in sent if channel(t, mine) <= c)
    rail_rows, prefix = [], []
    recv_rdma_prefix = torch.zeros(num_nodes, num_channels, dtype=torch.int32)
    for m in range(num_nodes):
        src = m * size + local
        rows = [t for t in range(inputs[src].x.size(0)) if node in nodes_of(src, t)]
        for c in range(num_channels):
            recv_rdma_prefix[m, c] = len(rail_rows) + sum(1 for t in rows if channel(t, inputs[src].x.size(0)) < c)
        rail_rows += [(src, t) for t in rows]
        prefix.append(len(rail_rows))
    send_nvl_head = torch.full((len(rail_rows), size), -1, dtype=torch.int32)
    for j in range(size):
        forwarded = [i for i, (src, t) in enumerate(rail_rows) if node * size + j in _sent(inputs, src, t, per_rank)]
        for position, i in enumerate(forwarded):
            send_nvl_head[i, j] = position
    network_rows = sum(len(nodes_of(me, t) - {node}) for t in range(mine))
    return {"rdma_channel_prefix_matrix": rdma_prefix, "recv_rdma_channel_prefix_matrix": recv_rdma_prefix,
            "recv_rdma_rank_prefix_sum": torch.tensor(prefix, dtype=torch.int32),
            "send_rdma_head": send_rdma_head, "send_nvl_head": send_nvl_head, "network_rows": network_rows}


def combine_two_level_reference(inputs: list[RankInputs], me: int, num_experts: int, size: int,
                                rows_seen: list[torch.Tensor], bias: list[torch.Tensor]) -> torch.Tensor:
    """`cast(bias_0 + bias_1 + sum over nodes of cast(sum over the node's ranks of expert rows))` in float32
    (float64 for float64), node and rank order ascending. `rows_seen[s][t]`: token t of rank s as received."""
    world = len(inputs)
    per_rank = num_experts // world
    dtype = inputs[me].x.dtype
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.zeros(inputs[me].x.shape, dtype=acc_dtype)
    for t in range(inputs[me].x.size(0)):
        acc = torch.zeros(inputs[me].x.size(1), dtype=acc_dtype)
        for b in bias:
            acc = acc + b[t].to(acc_dtype)
        ranks = _sent(inputs, me, t, per_rank)
        for n in range(world // size):
            on_node = [r for r in range(n * size, (n + 1) * size) if r in ranks]
            if not on_node:
                continue
            partial = torch.zeros(inputs[me].x.size(1), dtype=acc_dtype)
            for r in on_node:
                partial = partial + expert_output(rows_seen[me][t:t + 1], r)[0].to(acc_dtype)
            acc = acc + partial.to(dtype).to(acc_dtype)
        out[t] = acc
    return out.to(dtype)


# ---------------------------------------------------------------------------------------------- round trip


def _run_path(buffer: moe_ep.Buffer, hierarchical: bool, mine: RankInputs, x: object, num_experts: int,
              c: Case, num_worst: int, config: moe_ep.Config, expert_in: object, bias: list[torch.Tensor]) -> dict:
    """Layout, dispatch, combine (with and without weights and bias) and cached dispatch on one path, and the
    store exchanges (`Agreement.exchange`) each of the last four made."""
    internode = buffer._torch.internode
    internode.hierarchical = hierarchical
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(mine.topk_idx, num_experts)
    exchanges = []
    with _counting() as calls:
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=mine.topk_idx, topk_weights=mine.topk_weights,
            expert_alignment=c.alignment, num_worst_tokens=num_worst, config=config)
    exchanges.append(calls["exchange"])
    paths, network_rows = [internode.last_path], internode.last_network_rows
    y = expert_output(expert_in(recv_x), buffer.rank)
    with _counting() as calls:
        combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w, bias=tuple(bias), config=config)
    exchanges.append(calls["exchange"])
    paths.append(internode.last_path)
    with _counting() as calls:
        plain, no_weights, _ = buffer.combine(y, handle, config=config)
    exchanges.append(calls["exchange"])
    with _counting() as calls:
        cached = buffer.dispatch(x, handle=handle, config=config)[0]
    exchanges.append(calls["exchange"])
    paths.append(internode.last_path)
    return {"per_node": per_node, "recv_x": recv_x, "recv_idx": recv_idx, "recv_w": recv_w, "counts": counts,
            "handle": handle, "combined": combined, "combined_w": combined_w, "plain": plain,
            "no_weights": no_weights, "cached": cached, "paths": paths, "network_rows": network_rows,
            "exchanges": exchanges}


def _equal(a: object, b: object) -> bool:
    """Bit-for-bit equality of nested outputs (FP8 compared as bytes)."""
    if isinstance(a, torch.Tensor):
        def raw(t: torch.Tensor) -> torch.Tensor:
            return t.view(torch.uint8) if t.dtype == fp8.FP8_DTYPE else t

        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _round_trip(rank: int, world: int, ranks_per_node: int, case: dict, store_exchanges: int = 1) -> int:
    """Both paths against each other and the reference; each hierarchical call makes `store_exchanges`
    store exchanges (the flat path one)."""
    c = Case(**case)
    num_experts = c.experts_per_rank * world
    inputs = _inputs(c, world, ranks_per_node)
    mine = inputs[rank]
    buffer = _buffer(ranks_per_node)
    config = moe_ep.Config(c.num_sms, 6, 256, 6, 128)
    ref = dispatch_reference(inputs, rank, num_experts, c.alignment, config.num_channels)
    num_worst = 0
    if c.worst_extra >= 0:
        busiest = max(len(dispatch_reference(inputs, r, num_experts, 1, 1).rows) for r in range(world))
        num_worst = busiest + c.worst_extra
    x = fp8.per_token_cast_to_fp8(mine.x.float()) if c.use_fp8 else mine.x

    def expert_in(recv: object) -> torch.Tensor:  # what the fake experts see: dequantized FP8 in BF16
        return fp8.per_token_cast_back(*recv, torch.bfloat16) if c.use_fp8 else recv

    gen = torch.Generator().manual_seed(99 + rank)
    bias = [torch.randn(mine.x.shape, generator=gen).to(mine.x.dtype if not c.use_fp8 else torch.bfloat16)
            for _ in range(2)]
    flat = _run_path(buffer, False, mine, x, num_experts, c, num_worst, config, expert_in, bias)
    hier = _run_path(buffer, True, mine, x, num_experts, c, num_worst, config, expert_in, bias)
    assert flat["paths"] == ["flat"] * 3 and hier["paths"] == ["hierarchical"] * 3
    assert flat["exchanges"] == [1] * 4 and hier["exchanges"] == [store_exchanges] * 4, (flat, hier)

    # The two paths agree bit for bit; the handles share their first six fields.
    for key in ("per_node", "recv_x", "recv_idx", "recv_w", "counts", "combined", "combined_w", "plain",
                "no_weights", "cached"):
        assert _equal(flat[key], hier[key]), key
    assert isinstance(flat["handle"], ops.DispatchHandle)
    assert _equal(tuple(flat["handle"]), tuple(hier["handle"])[:6])

    # Against the reference: layout, rows, metadata, handle, combine, dedup count.
    size, n = ranks_per_node, len(ref.rows)
    nodes = [sum(1 for t in range(mine.x.size(0)) if any(r // size == m for r in _sent(inputs, rank, t,
                                                                                         c.experts_per_rank)))
             for m in range(world // size)]
    assert hier["per_node"].tolist() == nodes
    recv_x = hier["recv_x"][0] if c.use_fp8 else hier["recv_x"]
    rows = num_worst if num_worst else n
    assert recv_x.shape == (rows, c.hidden)
    if c.use_fp8:
        ref_q, ref_s = fp8.per_token_cast_to_fp8(ref.recv_x.float()) if n else (recv_x[:0], hier["recv_x"][1][:0])
        assert torch.equal(recv_x[:n].view(torch.uint8), ref_q.view(torch.uint8))
        assert torch.equal(hier["recv_x"][1][:n], ref_s)
    else:
        assert torch.equal(recv_x[:n], ref.recv_x)
    assert torch.equal(hier["recv_idx"][:n], ref.recv_topk_idx)
    assert torch.equal(hier["recv_w"][:n], ref.recv_topk_weights)
    handle = hier["handle"]
    assert handle.recv_src_idx[:n].tolist() == [t for _, t in ref.rows]
    if num_worst:
        assert hier["counts"] == [] and (handle.recv_src_idx[n:] == -1).all() and (hier["recv_idx"][n:] == -1).all()
        assert (recv_x[n:].float() == 0).all()
    else:
        assert hier["counts"] == ref.per_expert
    for field in ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "send_head",
                  "is_token_in_rank"):
        assert torch.equal(getattr(handle, field), getattr(ref, field)), field
    internode = internode_handle_reference(inputs, rank, num_experts, size, config.num_channels)
    for field, expected in internode.items():
        got = hier["network_rows"] if field == "network_rows" else getattr(handle, field)
        assert _equal(got, expected), (field, got, expected)

    rows_seen = [expert_in(fp8.per_token_cast_to_fp8(inp.x.float())) if c.use_fp8 else inp.x for inp in inputs]
    combined_ref = combine_two_level_reference(inputs, rank, num_experts, size, rows_seen, bias)
    assert torch.equal(hier["combined"], combined_ref)
    assert torch.equal(hier["plain"], combine_two_level_reference(inputs, rank, num_experts, size, rows_seen, []))
    valid = mine.topk_idx >= 0
    assert torch.equal(hier["combined_w"][valid], mine.topk_weights[valid]) and (hier["combined_w"][~valid] == 0).all()
    assert hier["no_weights"] is None
    assert _equal(hier["cached"], hier["recv_x"])
    return n


@pytest.mark.parametrize("shape,case", [(s, c) for s, cases in SHAPES.items() for c in cases],
                         ids=lambda v: f"{v[0]}x{v[1]}" if isinstance(v, tuple) else v.name)
def test_hierarchical_matches_flat_and_reference(dist_pool, shape: tuple[int, int], case: Case) -> None:
    nodes, size = shape
    received = dist_pool(nodes * size).run(_round_trip, size, asdict(case))
    assert sum(received) > 0


def _padded_round_trip(rank: int, world: int, ranks_per_node: int, case: dict) -> int:
    """`_round_trip` with rows padded to 16 bytes, as the CUDA backend's NVSHMEM legs move them."""
    legs = _buffer(ranks_per_node)._torch.internode.legs
    legs.row_alignment = 16
    try:
        return _round_trip(rank, world, ranks_per_node, case)
    finally:
        legs.row_alignment = 1


@pytest.mark.parametrize("case", [RANDOM, FP8, WORST], ids=lambda c: c.name)
def test_rows_padded_for_the_cuda_legs_give_the_same_results(dist_pool, case: Case) -> None:
    assert sum(dist_pool(4).run(_padded_round_trip, 2, asdict(case))) > 0


class _ExchangeOverGloo:
    """Stands in for `moe_ep._low_latency.internode_exchange` on the CPU: checks the team and counts the
    CUDA legs pass, then moves the same rows with one `all_to_all_single` over the whole group (nothing
    to ranks outside the team). As in the kernel, a receiver whose rows are of another size than its
    sender's does not find the sender's rows where it reads: it gets zeros here."""

    def internode_exchange(self, runtime: object, send: torch.Tensor, recv: torch.Tensor, pes: list[int], me: int,
                           send_counts: list[int], recv_counts: list[int], channels: int, chunk_rows: int,
                           ring_rows: int) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        assert pes == sorted(set(pes)) and pes[me] == rank, (pes, me, rank)
        assert send.size(1) % 16 == 0 and send.size(0) == sum(send_counts) and recv.size(0) == sum(recv_counts)
        assert channels >= 1 and 1 <= chunk_rows <= ring_rows
        widths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(widths, torch.tensor([send.size(1)]))
        width = send.size(1)
        full_send, full_recv, parts = [0] * world, [0] * world, []
        for pe, rows, received in zip(pes, send.split(send_counts), recv_counts):
            theirs = int(widths[pe])
            parts.append(rows.reshape(-1) if theirs == width else torch.zeros(rows.size(0) * theirs, dtype=torch.uint8))
            full_send[pe], full_recv[pe] = parts[-1].numel(), received * width
        dist.all_to_all_single(recv.view(-1), torch.cat(parts), full_recv, full_send)


class _RuntimeStandIn:
    """An `InternodeRuntime` whose rings always fit and whose exchanges never time out."""

    def check_fits(self, *sizes: int) -> None:
        pass

    def check_usable(self) -> None:
        pass


@contextlib.contextmanager
def _cuda_legs(ranks_per_node: int) -> Iterator[moe_ep.Buffer]:
    """The torch Buffer with its internode path over the CUDA backend's `NvshmemLegs` (teams, members,
    counts, padding, the count exchange), the kernel replaced by `_ExchangeOverGloo`."""
    from moe_ep.ops.backends import cuda_internode

    buffer = _buffer(ranks_per_node)
    internode = buffer._torch.internode
    saved_legs, saved_module = internode.legs, cuda_internode.nvshmem_module
    internode.legs = cuda_internode.NvshmemLegs(_RuntimeStandIn(), internode.topology, torch.device("cpu"))
    cuda_internode.nvshmem_module = _ExchangeOverGloo
    try:
        yield buffer
    finally:
        internode.legs, cuda_internode.nvshmem_module = saved_legs, saved_module


def _cuda_legs_round_trip(rank: int, world: int, ranks_per_node: int, case: dict) -> int:
    """`_round_trip` through `_cuda_legs`: the same results, and no hierarchical call uses the store."""
    with _cuda_legs(ranks_per_node):
        return _round_trip(rank, world, ranks_per_node, case, store_exchanges=0)


@pytest.mark.parametrize("shape,case", [((2, 3), RANDOM), ((4, 1), EVERY_NODE), ((2, 2), FP8), ((3, 2), WORST)],
                         ids=lambda v: f"{v[0]}x{v[1]}" if isinstance(v, tuple) else v.name)
def test_cuda_legs_pass_the_teams_and_counts_the_path_needs(dist_pool, shape: tuple[int, int], case: Case) -> None:
    nodes, size = shape
    assert sum(dist_pool(nodes * size).run(_cuda_legs_round_trip, size, asdict(case))) > 0


def disagreeing_dispatches(buffer: moe_ep.Buffer, rank: int, world: int, device: torch.device) -> dict:
    """Three dispatches over `buffer` (2x2 nodes): ranks 2-3 pass another hidden size, then rank 1 another
    number of experts (count rows of another size), then every rank the same settings. What each raised
    (or whether its rows are the reference's), and the store exchanges all three made."""
    c = replace(RANDOM, tokens=(15, 9, 22, 4))
    num_experts = c.experts_per_rank * world
    inputs = _inputs(c, world, 2)
    mine = inputs[rank]
    x, topk_idx = mine.x.to(device), mine.topk_idx.to(device)
    attempts = {"hidden": (torch.cat([x, x], 1) if rank >= 2 else x, num_experts),
                "num_experts": (x, 2 * num_experts if rank == 1 else num_experts),
                "agreeing": (x, num_experts)}
    out: dict[str, object] = {}
    with _counting() as calls:
        for name, (tokens, experts) in attempts.items():
            layout = routing.dispatch_layout(topk_idx, experts, world, 2)
            try:
                recv_x = buffer.dispatch(tokens, num_tokens_per_rank=layout.num_tokens_per_rank,
                                         num_tokens_per_rdma_rank=layout.num_tokens_per_rdma_rank,
                                         is_token_in_rank=layout.is_token_in_rank,
                                         num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=topk_idx)[0]
                out[name] = torch.equal(recv_x.cpu(), dispatch_reference(inputs, rank, num_experts, 1, 1).recv_x)
            except Exception as exc:  # the test inspects what each rank raised
                out[name] = (type(exc).__name__, str(exc))
    out["exchanges"] = calls["exchange"]
    return out


def check_disagreeing_dispatches(outcomes: list[dict]) -> None:
    """Every rank raised `PeerInputError` for both disagreements, before any store exchange or data, and the
    Buffer still serves the dispatch that agrees."""
    for rank, out in enumerate(outcomes):
        assert out["hidden"] == ("PeerInputError", "dispatch: ranks disagree on hidden (x.shape[1]): "
                                                   "[256, 256, 512, 512] (rank order)"), (rank, out)
        kind, message = out["num_experts"]
        assert kind == "PeerInputError" and message.startswith("count exchange: the rows of rank(s) "), (rank, out)
        assert out["agreeing"] is True and out["exchanges"] == 0, (rank, out)


def _disagreeing_over_cuda_legs(rank: int, world: int) -> dict:
    with _cuda_legs(2) as buffer:
        return disagreeing_dispatches(buffer, rank, world, torch.device("cpu"))


def test_ranks_that_disagree_raise_on_every_rank_through_the_cuda_legs(dist_pool) -> None:
    outcomes = dist_pool(4).run(_disagreeing_over_cuda_legs)
    check_disagreeing_dispatches(outcomes)
    # Rank 1 reads none of its peers' rows; the others miss its row, and rank 0 also rank 3's, which
    # reaches node 0 through rank 1.
    for rank, garbled in enumerate(([1, 3], [0, 2, 3], [1], [1])):
        assert outcomes[rank]["num_experts"][1].startswith(f"count exchange: the rows of rank(s) {garbled} "), rank


def test_the_cuda_internode_backend_raises_a_rejected_input_alone() -> None:
    """Its `agree` exchanges nothing (its peers' kernels time out): the rank's own error, or nothing."""
    from moe_ep.ops.backends.cuda_internode import CudaInternodeBackend

    backend = object.__new__(CudaInternodeBackend)  # no NVSHMEM here, and `agree` needs none of its state
    with _counting() as calls:
        backend.agree("dispatch", {"hidden": 128}, None, torch.device("cpu"))
        with pytest.raises(ValueError, match="^x: expected 2 dimensions$"):
            backend.agree("dispatch", {}, ValueError("x: expected 2 dimensions"), torch.device("cpu"))
    assert calls["exchange"] == 0


def _formula_matters(rank: int, world: int) -> bool:
    """Whether the two-level combine differs from the one-level sum somewhere (so the tests can tell them apart)."""
    c = replace(RANDOM, topk=6)
    inputs = _inputs(c, world, 2)
    mine, num_experts = inputs[rank], c.experts_per_rank * world
    buffer = _buffer(2)
    buffer._torch.internode.hierarchical = True
    layout = buffer.get_dispatch_layout(mine.topk_idx, num_experts)
    recv_x, _, _, _, handle, _ = buffer.dispatch(mine.x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                 num_tokens_per_expert=layout[2], topk_idx=mine.topk_idx)
    combined = buffer.combine(expert_output(recv_x, rank), handle)[0]
    one_level = torch.zeros(mine.x.shape)
    for r in range(world):
        for t in range(mine.x.size(0)):
            if r in _sent(inputs, rank, t, c.experts_per_rank):
                one_level[t] += expert_output(mine.x[t:t + 1], r)[0].float()
    return not torch.equal(combined, one_level.to(mine.x.dtype))


def test_two_level_combine_differs_from_one_level(dist_pool) -> None:
    assert any(dist_pool(4).run(_formula_matters))


# ---------------------------------------------------------------------------------------------- above the Buffer


def _autograd(rank: int, world: int) -> dict:
    """Float64 gradients of dispatch -> per-rank scaling -> combine on both paths, and the dense reference."""
    num_experts, hidden, size = 4 * world, 128, 2
    inputs = make_inputs(11, world, tokens_for((13, 7, 0, 10), world), hidden, num_experts, 3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    scale = torch.randn(world, hidden, generator=gen, dtype=torch.float64)
    loss_w = [torch.randn(inp.x.shape, generator=gen, dtype=torch.float64) for inp in inputs]
    mine = inputs[rank]
    buffer = _buffer(size)
    grads = {}
    for hierarchical in (False, True):
        buffer._torch.internode.hierarchical = hierarchical
        x, w = mine.x.clone().requires_grad_(), mine.topk_weights.clone().requires_grad_()
        bias = torch.zeros_like(mine.x).requires_grad_()
        out = ops.dispatch(buffer, x, mine.topk_idx, w, num_experts, expert_alignment=4)
        y = out.recv_x * scale[rank] * out.recv_topk_weights.double().sum(1, keepdim=True)
        combined = ops.combine(buffer, y, out.handle, bias=bias)
        (combined * loss_w[rank]).sum().backward()
        assert buffer._torch.internode.last_path == ("hierarchical" if hierarchical else "flat")
        grads[hierarchical] = (x.grad, w.grad, bias.grad)
    # Dense reference of this rank's tokens: out = bias + sum over receiving ranks of x * scale * weights.
    x, w = mine.x.clone().requires_grad_(), mine.topk_weights.clone().requires_grad_()
    owners = torch.where(mine.topk_idx >= 0, mine.topk_idx // (num_experts // world), -1)
    out = torch.zeros_like(x)
    for dst in range(world):
        local = owners == dst
        out = out + local.any(1, keepdim=True) * x * scale[dst] * (w.double() * local).sum(1, keepdim=True)
    (out * loss_w[rank]).sum().backward()
    return {"same": all(torch.equal(a, b) for a, b in zip(grads[False], grads[True])),
            "x": torch.allclose(grads[True][0], x.grad, rtol=0, atol=1e-12),
            "w": torch.allclose(grads[True][1], w.grad, rtol=0, atol=1e-6),  # float32 weights
            "bias": torch.equal(grads[True][2], loss_w[rank])}


def test_autograd_backward_through_both_legs(dist_pool) -> None:
    for got in dist_pool(4).run(_autograd):
        assert got == {"same": True, "x": True, "w": True, "bias": True}


def _layer(rank: int, world: int) -> bool:
    """MoELayer forward and backward with virtual nodes: both paths give the same bits."""
    cfg = MoEConfig(hidden_size=128, moe_intermediate_size=64, num_experts=4 * world, num_experts_per_tok=3,
                    n_shared_experts=1)
    torch.manual_seed(3)
    buffer = _buffer(2)
    layer = MoELayer(cfg, buffer=buffer, dtype=torch.bfloat16)
    x = torch.randn(21 + 4 * rank, 128, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    results = []
    for hierarchical in (False, True):
        buffer._torch.internode.hierarchical = hierarchical
        layer.zero_grad()
        inp = x.clone().requires_grad_()
        out = layer(inp)
        out.float().square().sum().backward()
        assert buffer._torch.internode.last_path == ("hierarchical" if hierarchical else "flat")
        results.append([out.detach(), inp.grad] + [p.grad.clone() for p in layer.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*results))


def test_moe_layer_uses_internode_transparently(dist_pool) -> None:
    assert all(dist_pool(4).run(_layer))


# ---------------------------------------------------------------------------------------------- node grouping


def _subgroup(rank: int, world: int) -> bool:
    """A Buffer over part of the world (ranks 1-4, two virtual nodes): sub-groups with local synchronization."""
    group = dist.new_group([1, 2, 3, 4])
    if not 1 <= rank <= 4:
        return True
    c = replace(RANDOM, tokens=(15, 9, 22, 4))
    inputs = _inputs(c, 4, 2)
    me = dist.get_rank(group)
    mine, num_experts = inputs[me], c.experts_per_rank * 4
    buffer = _buffer(2, group)
    layout = buffer.get_dispatch_layout(mine.topk_idx, num_experts)
    recv_x, _, _, _, handle, _ = buffer.dispatch(mine.x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                 num_tokens_per_expert=layout[2], topk_idx=mine.topk_idx)
    combined = buffer.combine(expert_output(recv_x, me), handle)[0]
    ref = dispatch_reference(inputs, me, num_experts, 1, 1)
    rows_seen = [inp.x for inp in inputs]
    return (buffer._torch.internode.last_path == "hierarchical" and torch.equal(recv_x, ref.recv_x)
            and torch.equal(combined, combine_two_level_reference(inputs, me, num_experts, 2, rows_seen, [])))


def test_buffer_over_part_of_the_world(dist_pool) -> None:
    assert all(dist_pool(6).run(_subgroup))


def _grouping(rank: int, world: int) -> dict:
    """Node grouping from the keyword, the setting and the hosts; bad values; ranks that disagree."""
    out = {}
    for bad in (0, 9, 3, True, "2"):
        try:
            moe_ep.Buffer(dist.group.WORLD, backend="torch", num_ranks_per_node=bad)
            out[repr(bad)] = "no error"
        except ValueError as exc:
            out[repr(bad)] = str(exc)
    hosts = moe_ep.Buffer(dist.group.WORLD, backend="torch")
    topk_idx = torch.tensor([[0, 7], [3, -1], [6, 5]])
    out["hosts"] = (hosts.node_topology().num_nodes, hosts.get_dispatch_layout(topk_idx, 8)[1])
    saved = os.environ.get("MOE_EP_NUM_RANKS_PER_NODE")
    try:
        os.environ["MOE_EP_NUM_RANKS_PER_NODE"] = "1"
        reload_settings()
        from_setting = moe_ep.Buffer(dist.group.WORLD, backend="torch")
        out["setting"] = from_setting.get_dispatch_layout(topk_idx, 8)[1].tolist()
        os.environ["MOE_EP_NUM_RANKS_PER_NODE"] = "two"
        try:
            reload_settings()
            moe_ep.Buffer(dist.group.WORLD, backend="torch")
        except ValueError as exc:
            out["bad setting"] = str(exc)
    finally:
        if saved is None:
            os.environ.pop("MOE_EP_NUM_RANKS_PER_NODE", None)
        else:
            os.environ["MOE_EP_NUM_RANKS_PER_NODE"] = saved
        reload_settings()
    try:  # ranks 0-1 ask for nodes of 2 ranks, ranks 2-3 for nodes of 1
        moe_ep.Buffer(dist.group.WORLD, backend="torch", num_ranks_per_node=2 if rank < 2 else 1).get_dispatch_layout(
            topk_idx, 8)
    except ValueError as exc:
        out["disagree"] = str(exc)
    try:  # no GPU here: the internode kernels cannot serve it
        moe_ep.Buffer(dist.group.WORLD, backend="cuda", num_ranks_per_node=2)
    except RuntimeError as exc:
        out["cuda"] = str(exc)
    return out


def test_node_grouping_and_bad_values(dist_pool) -> None:
    for out in dist_pool(4).run(_grouping):
        for bad in ("0", "9", "True", "'2'"):
            assert out[bad].startswith("num_ranks_per_node: expected an integer from 1 to 8"), out[bad]
        assert out["3"].startswith("num_ranks_per_node: expected a divisor of the group size 4"), out["3"]
        assert out["hosts"] == (1, None)  # one host: one node, no per-node counts
        # Experts 0-1 on rank 0, ..., 6-7 on rank 3: nodes of one rank.
        assert out["setting"] == [1, 1, 1, 2]
        assert out["bad setting"].startswith("MOE_EP_NUM_RANKS_PER_NODE: expected an integer"), out["bad setting"]
        assert out["disagree"].startswith("num_ranks_per_node: the ranks disagree"), out["disagree"]
        assert "[2, 2, 1, 1]" in out["disagree"]
        assert out["cuda"].startswith("backend='cuda'"), out["cuda"]
