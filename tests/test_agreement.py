"""The torch backend's agreement rides on each operation's exchange of counts: an operation costs one
exchange through the group's store (input errors, shared settings and counts together) and its data
collective, nothing more, and a disagreement found there still raises on every rank."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.ops import routing
from moe_ep.ops.backends.agreement import Agreement
from reference import make_inputs

HIDDEN = 64
TOKENS = 10
EXPERTS_PER_RANK = 2
TOPK = 2


@contextlib.contextmanager
def _counting() -> Iterator[Counter]:
    """Counts store exchanges and tensor collectives made inside the block (in this process)."""
    calls: Counter = Counter()
    originals = {"exchange": Agreement.exchange}

    def exchange(self, op, record):
        calls["exchange"] += 1
        return originals["exchange"](self, op, record)

    Agreement.exchange = exchange
    for name in ("all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_gather", "all_reduce",
                 "broadcast"):
        if hasattr(dist, name):
            originals[name] = getattr(dist, name)

            def counted(*args, _name=name, **kwargs):
                calls[_name] += 1
                return originals[_name](*args, **kwargs)

            setattr(dist, name, counted)
    try:
        yield calls
    finally:
        Agreement.exchange = originals.pop("exchange")
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _calls_per_operation(rank: int, world: int) -> dict:
    num_experts = EXPERTS_PER_RANK * world
    inp = make_inputs(21, world, [TOKENS + rank for rank in range(world)], HIDDEN, num_experts, TOPK)[rank]
    normal = moe_ep.Buffer(dist.group.WORLD, backend="torch")
    hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(TOKENS + world, HIDDEN, world, num_experts)
    low_latency = moe_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, backend="torch")
    per_rank, _, per_expert, in_rank, _ = normal.get_dispatch_layout(inp.topk_idx, num_experts)  # learns the nodes
    counted: dict[str, dict] = {}
    with _counting() as calls:
        recv, _, recv_w, _, handle, _ = normal.dispatch(
            inp.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)
    counted["dispatch"] = dict(calls)
    with _counting() as calls:
        again = normal.dispatch(inp.x * 2, handle=handle)[0]
    counted["cached_dispatch"] = dict(calls)
    with _counting() as calls:
        combined, combined_w, _ = normal.combine(recv, handle, topk_weights=recv_w)
    counted["combine"] = dict(calls)
    with _counting() as calls:
        ll_recv, _, ll_handle, _, _ = low_latency.low_latency_dispatch(inp.x, inp.topk_idx, TOKENS + world,
                                                                       num_experts, use_fp8=False)
    counted["low_latency_dispatch"] = dict(calls)
    with _counting() as calls:
        low_latency.low_latency_combine(ll_recv, inp.topk_idx, inp.topk_weights, ll_handle)
    counted["low_latency_combine"] = dict(calls)
    # The round trip is right: each token comes back once per rank it went to, the weights once.
    copies = in_rank.sum(1, keepdim=True)
    ok = (torch.equal(combined, (inp.x.float() * copies).to(inp.x.dtype)) and torch.equal(again, recv * 2)
          and torch.equal(combined_w, inp.topk_weights * (inp.topk_idx >= 0)))
    return {"calls": counted, "round_trip": ok}


@pytest.mark.parametrize("world", [2, 3])
def test_every_operation_costs_one_exchange_and_its_data_collective(dist_pool, world: int) -> None:
    for rank, result in enumerate(dist_pool(world).run(_calls_per_operation)):
        assert result["round_trip"], rank
        for op, calls in result["calls"].items():
            assert calls == {"exchange": 1, "all_to_all_single": 1}, (rank, op, calls)


def _num_experts_differ(rank: int, world: int) -> tuple[str, str]:
    num_experts = EXPERTS_PER_RANK * world * (2 if rank == 1 else 1)  # counts of another length on rank 1
    inp = make_inputs(22, world, [TOKENS] * world, HIDDEN, EXPERTS_PER_RANK * world, TOPK)[rank]
    layout = routing.dispatch_layout(inp.topk_idx, num_experts, world)
    buffer = moe_ep.Buffer(dist.group.WORLD, backend="torch")
    try:
        buffer.dispatch(inp.x, num_tokens_per_rank=layout.num_tokens_per_rank, is_token_in_rank=layout.is_token_in_rank,
                        num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=inp.topk_idx)
    except Exception as exc:  # the test inspects what each rank raised
        return type(exc).__name__, str(exc)
    return "ok", ""


def test_a_setting_that_differs_is_refused_in_the_exchange_of_counts(dist_pool) -> None:
    want = "dispatch: ranks disagree on num_experts: [4, 8] (rank order)"
    assert dist_pool(2).run(_num_experts_differ) == [("PeerInputError", want)] * 2
