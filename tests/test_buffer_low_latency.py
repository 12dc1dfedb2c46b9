"""Low-latency Buffer (torch backend over gloo) against the dense reference, at world sizes 1-4, and the
combine's per-rank partial sums against a written-out reference on random expert outputs."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.ops import fp8
from moe_ep.ops.routing import unpack_layout_range
from reference import (low_latency_combine_reference, low_latency_expert_output, low_latency_reference,
                       make_inputs, to_cpu, tokens_for)


@dataclass(frozen=True)
class Case:
    name: str
    tokens: tuple[int, ...] = (20, 9, 31, 14)
    max_tokens: int = 32
    hidden: int = 256
    experts_per_rank: int = 4
    topk: int = 4
    routing: str = "random"
    use_fp8: bool = False
    round_scale: bool = False
    use_ue8m0: bool = False
    hook: bool = False
    zero_copy: bool = False
    use_out: bool = False


CASES = [
    Case("bf16"),
    Case("fp8", hidden=384, topk=8, experts_per_rank=3, use_fp8=True),
    Case("fp8_ue8m0_hidden_2944", hidden=2944, topk=1, use_fp8=True, round_scale=True, use_ue8m0=True,
         tokens=(5, 7, 3, 6), max_tokens=8),
    Case("hooks_zero_copy_out", use_fp8=True, round_scale=True, hook=True, zero_copy=True, use_out=True),
    Case("fp8_empty_rank", tokens=(6, 0, 9, 0), use_fp8=True, topk=3),
    Case("topk16_skewed_empty_rank", tokens=(12, 0, 7, 16), max_tokens=16, topk=16, experts_per_rank=5,
         routing="skewed"),
]


def _low_latency_round_trip(rank: int, world: int, case: dict, device: str = "cpu", backend: str = "torch") -> int:
    """Every low-latency output of `backend` on `device` against the dense reference (exact order)."""
    c = Case(**case)
    num_experts = c.experts_per_rank * world
    inputs = make_inputs(77 + world, world, tokens_for(c.tokens, world), c.hidden, num_experts, c.topk, routing=c.routing)
    mine = inputs[rank].to(device)
    hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(c.max_tokens, c.hidden, world, num_experts)
    buffer = moe_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, backend=backend)
    stats = torch.zeros(c.experts_per_rank, dtype=torch.int32, device=device)
    wait_ns = torch.zeros(world, dtype=torch.int64, device=device)

    recv, recv_count, device_handle, _, hook = buffer.low_latency_dispatch(
        mine.x, mine.topk_idx, c.max_tokens, num_experts, cumulative_local_expert_recv_stats=stats,
        dispatch_wait_recv_cost_stats=wait_ns, use_fp8=c.use_fp8, round_scale=c.round_scale, use_ue8m0=c.use_ue8m0,
        return_recv_hook=c.hook)
    assert (hook is not None) == c.hook
    if hook is not None:
        hook()
    recv, recv_count, handle, stats, wait_ns = to_cpu((recv, recv_count, device_handle, stats, wait_ns))
    ref = low_latency_reference(inputs, rank, num_experts)
    slots = world * c.max_tokens
    data, scales = recv if c.use_fp8 else (recv, None)
    assert data.shape == (c.experts_per_rank, slots, c.hidden)
    assert recv_count.tolist() == ref.recv_count and stats.tolist() == ref.recv_count
    count, begin = unpack_layout_range(handle.layout_range)
    assert torch.equal(torch.stack([count, begin], -1), ref.layout)
    assert (wait_ns >= 0).all()
    if c.use_fp8:
        groups = -(-c.hidden // 512) if c.use_ue8m0 else c.hidden // 128
        assert scales.shape == (c.experts_per_rank, slots, groups)
        assert scales.dtype == (torch.int32 if c.use_ue8m0 else torch.float32)
        assert scales.stride() == (groups * slots, 1, slots)  # token dimension contiguous

    dequantized = []
    for e, rows in enumerate(ref.rows):
        n = len(rows)
        assert handle.src_info[e, :n].tolist() == [t for _, t in rows]
        expected = torch.stack([inputs[s].x[t] for s, t in rows]) if rows else inputs[rank].x.new_zeros(0, c.hidden)
        if c.use_fp8:
            q, s = fp8.per_token_cast_to_fp8(expected, c.round_scale, c.use_ue8m0)
            assert torch.equal(data[e, :n].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(scales[e, :n], s)
            got = fp8.per_token_cast_back(data[e, :n], scales[e, :n])
        else:
            assert torch.equal(data[e, :n], expected)
            # Provenance rides in the data (exact in bf16): source rank and token index.
            assert [(int(v[0]), int(v[1]) * 64 + int(v[2])) for v in data[e, :n].float()] == rows
            got = data[e, :n]
        assert (data[e, n:].float() == 0).all()
        dequantized.append(got)

    if c.zero_copy:
        y = buffer.get_next_low_latency_combine_buffer(device_handle)
    else:
        y = torch.zeros(data.shape, dtype=torch.bfloat16, device=device)
    assert y.shape == (c.experts_per_rank, slots, c.hidden) and y.dtype == torch.bfloat16
    for e, rows in enumerate(dequantized):
        y[e, :rows.size(0)] = low_latency_expert_output(rows, rank * c.experts_per_rank + e).to(device)
    out = torch.full(mine.x.shape, float("nan"), dtype=torch.bfloat16, device=device) if c.use_out else None
    combined, _, hook = buffer.low_latency_combine(y, mine.topk_idx, mine.topk_weights, device_handle,
                                                   zero_copy=c.zero_copy, return_recv_hook=c.hook, out=out)
    if hook is not None:
        hook()
    if out is not None:
        assert combined.data_ptr() == out.data_ptr()
    x = inputs[rank].x
    seen = fp8.per_token_cast_back(*fp8.per_token_cast_to_fp8(x, c.round_scale, c.use_ue8m0)) if c.use_fp8 else x
    want = low_latency_combine_reference(inputs, rank, num_experts,
                                         lambda t, j, e: low_latency_expert_output(seen[t:t + 1], e)[0])
    assert torch.equal(combined.cpu(), want)
    return sum(ref.recv_count)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_low_latency_matches_reference(dist_pool, world: int, case: Case) -> None:
    received = dist_pool(world).run(_low_latency_round_trip, asdict(case))
    assert sum(received) > 0


def test_eight_ranks(dist_pool) -> None:
    """EP8 low-latency mode on the torch backend, FP8 with UE8M0 scales and hooks."""
    case = Case("eight_ranks", tokens=(5, 9, 0, 3, 7, 2, 8, 4), max_tokens=10, experts_per_rank=3, topk=5,
                use_fp8=True, round_scale=True, use_ue8m0=True, hidden=512, hook=True)
    assert sum(dist_pool(8).run(_low_latency_round_trip, asdict(case))) > 0


def _random_expert_outputs(seed: int, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Expert outputs of `rank` that are no function of the received rows (every rank can rebuild them)."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    return (torch.randn(shape, generator=gen) * 8).to(torch.bfloat16)


def _combine_partial_sums(rank: int, world: int, hook: bool) -> tuple[int, bool]:
    """Random expert outputs, masked slots and several of a token's experts on one rank: the combine must
    equal the per-rank partial-sum formula bit for bit. Returns the number of (token, rank) pairs with
    several slots and whether the result differs from one float32 sum over all slots (it should, at
    some element, when tokens reach several ranks: the formula is not the per-slot sum)."""
    seed, max_tokens, hidden, per_rank, topk = 5, 24, 256, 3, 6
    num_experts = per_rank * world
    inputs = make_inputs(seed + world, world, tokens_for((20, 9, 24, 14), world), hidden, num_experts, topk)
    mine = inputs[rank]
    hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, num_experts)
    buffer = moe_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, backend="torch")
    _, _, handle, _, _ = buffer.low_latency_dispatch(mine.x, mine.topk_idx, max_tokens, num_experts)
    shape = (per_rank, world * max_tokens, hidden)
    combined, _, recv_hook = buffer.low_latency_combine(_random_expert_outputs(seed, rank, shape), mine.topk_idx,
                                                        mine.topk_weights, handle, return_recv_hook=hook)
    if recv_hook is not None:
        recv_hook()

    packed = [low_latency_reference(inputs, r, num_experts).rows for r in range(world)]
    outputs = [_random_expert_outputs(seed, r, shape) for r in range(world)]

    def expert_rows(t: int, j: int, e: int) -> torch.Tensor:
        r, local = divmod(e, per_rank)
        return outputs[r][local, packed[r][local].index((rank, t))]

    want = low_latency_combine_reference(inputs, rank, num_experts, expert_rows)
    assert torch.equal(combined, want)

    per_slot = torch.zeros(mine.x.shape)
    shared = 0
    for t, experts in enumerate(mine.topk_idx.tolist()):
        for j, e in enumerate(experts):
            if e >= 0:
                per_slot[t] = per_slot[t] + mine.topk_weights[t, j] * expert_rows(t, j, e).float()
        owners = [e // per_rank for e in experts if e >= 0]
        shared += sum(owners.count(r) > 1 for r in set(owners))
    return shared, not torch.equal(per_slot.to(torch.bfloat16), want)


@pytest.mark.parametrize("world,hook", [(1, False), (2, True), (3, False), (4, True)])
def test_low_latency_combine_partial_sums(dist_pool, world: int, hook: bool) -> None:
    results = dist_pool(world).run(_combine_partial_sums, hook)
    assert sum(shared for shared, _ in results) > 0  # the case exercises several experts per rank
    if world > 1:
        assert any(differs for _, differs in results)
