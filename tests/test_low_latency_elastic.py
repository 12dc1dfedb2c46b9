"""Elastic low-latency mode on the torch backend (CPU): ranks masked by hand give exactly the results of
the same routing without them (masked ranks send and receive nothing, the combine leaves their experts'
terms out), unmasking restores the full results, and the mask API checks its arguments."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.ops import fp8
from moe_ep.ops.routing import unpack_layout_range
from reference import (RankInputs, low_latency_combine_reference, low_latency_expert_output, low_latency_reference,
                       make_inputs, tokens_for)
from test_buffer_low_latency import Case


def without_ranks(inputs: list[RankInputs], masked: set[int], num_experts: int) -> list[RankInputs]:
    """The inputs as elastic mode routes them with `masked` left out: slots of their experts are -1, and a
    masked rank routes nothing."""
    per_rank = num_experts // len(inputs)
    routed = []
    for rank, inp in enumerate(inputs):
        owner = inp.topk_idx.clamp(min=0) // per_rank
        keep = (inp.topk_idx >= 0) & torch.tensor([r not in masked for r in range(len(inputs))])[owner]
        if rank in masked:
            keep = torch.zeros_like(keep)
        routed.append(RankInputs(inp.x, torch.where(keep, inp.topk_idx, -1), inp.topk_weights))
    return routed


def _expert_outputs(data: torch.Tensor, scales: torch.Tensor | None, rank: int, per_rank: int) -> torch.Tensor:
    rows = fp8.per_token_cast_back(data.flatten(0, 1), scales.flatten(0, 1)).view(data.shape) \
        if scales is not None else data
    return torch.stack([low_latency_expert_output(rows[e], rank * per_rank + e) for e in range(per_rank)])


def round_trip(buffer: moe_ep.Buffer, inputs: list[RankInputs], rank: int, c: Case, num_experts: int,
               expected: list[RankInputs]) -> int:
    """One dispatch and combine of `inputs[rank]` on `buffer`, checked exactly against the reference of
    `expected` (the inputs as routed); returns the messages received."""
    mine = inputs[rank]
    recv, recv_count, handle, _, hook = buffer.low_latency_dispatch(
        mine.x, mine.topk_idx, c.max_tokens, num_experts, use_fp8=c.use_fp8, round_scale=c.round_scale,
        use_ue8m0=c.use_ue8m0, return_recv_hook=c.hook)
    if hook is not None:
        hook()
    ref = low_latency_reference(expected, rank, num_experts)
    assert recv_count.tolist() == ref.recv_count
    count, begin = unpack_layout_range(handle.layout_range)
    assert torch.equal(torch.stack([count, begin], -1), ref.layout)
    data, scales = recv if c.use_fp8 else (recv, None)
    for e, rows in enumerate(ref.rows):
        assert handle.src_info[e, :len(rows)].tolist() == [t for _, t in rows]
    combined, _, hook = buffer.low_latency_combine(_expert_outputs(data, scales, rank, c.experts_per_rank),
                                                   mine.topk_idx, mine.topk_weights, handle, return_recv_hook=c.hook)
    if hook is not None:
        hook()
    x = mine.x
    seen = fp8.per_token_cast_back(*fp8.per_token_cast_to_fp8(x, c.round_scale, c.use_ue8m0)) if c.use_fp8 else x
    want = low_latency_combine_reference(expected, rank, num_experts,
                                         lambda t, j, e: low_latency_expert_output(seen[t:t + 1], e)[0])
    assert torch.equal(combined, want)
    return sum(ref.recv_count)


def _masked_by_hand(rank: int, world: int, case: dict, masked: list[int]) -> tuple[int, int, list[int]]:
    c = Case(**case)
    num_experts = c.experts_per_rank * world
    inputs = make_inputs(31 + world, world, tokens_for(c.tokens, world), c.hidden, num_experts, c.topk)
    hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(c.max_tokens, c.hidden, world, num_experts)
    buffer = moe_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, enable_shrink=True, backend="torch")
    full = round_trip(buffer, inputs, rank, c, num_experts, inputs)
    for r in masked:
        buffer.low_latency_update_mask_buffer(r, True)
    status = torch.full((world,), -1, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(status)
    without = round_trip(buffer, inputs, rank, c, num_experts, without_ranks(inputs, set(masked), num_experts))
    buffer.low_latency_update_mask_buffer(masked[0], False)  # unmasking one rank, then all
    buffer.low_latency_clean_mask_buffer()
    assert round_trip(buffer, inputs, rank, c, num_experts, inputs) == full
    return full, without, status.tolist()


@pytest.mark.parametrize("world,masked", [(2, [1]), (3, [0]), (4, [1, 2])])
@pytest.mark.parametrize("case", [Case("bf16_hooks", hook=True), Case("fp8", hidden=384, topk=8, use_fp8=True)],
                         ids=lambda c: c.name)
def test_masked_ranks_give_the_reference_without_them(dist_pool, world: int, masked: list[int], case: Case) -> None:
    outcomes = dist_pool(world).run(_masked_by_hand, asdict(case), masked)
    for rank, (full, without, status) in enumerate(outcomes):
        assert status == [int(r in masked) for r in range(world)]
        assert without <= full
        if rank in masked:
            assert without == 0  # a masked rank receives nothing
    assert sum(without for _, without, _ in outcomes) < sum(full for full, _, _ in outcomes)


def _masked_between_dispatch_and_combine(rank: int, world: int) -> None:
    """A rank masked after a dispatch: the combine leaves out the terms of its experts (no renormalisation)."""
    c = Case("late_mask", topk=6)
    num_experts = c.experts_per_rank * world
    inputs = make_inputs(41, world, tokens_for(c.tokens, world), c.hidden, num_experts, c.topk)
    mine = inputs[rank]
    hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(c.max_tokens, c.hidden, world, num_experts)
    buffer = moe_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, enable_shrink=True, backend="torch")
    recv, _, handle, _, _ = buffer.low_latency_dispatch(mine.x, mine.topk_idx, c.max_tokens, num_experts, use_fp8=False)
    buffer.low_latency_update_mask_buffer(world - 1, True)
    combined, _, _ = buffer.low_latency_combine(_expert_outputs(recv, None, rank, c.experts_per_rank), mine.topk_idx,
                                                mine.topk_weights, handle)
    expected = without_ranks(inputs, {world - 1}, num_experts)
    want = low_latency_combine_reference(expected, rank, num_experts,
                                         lambda t, j, e: low_latency_expert_output(mine.x[t:t + 1], e)[0])
    assert torch.equal(combined, want)
    if rank == world - 1:
        assert not combined.any()


def test_mask_between_dispatch_and_combine(dist_pool) -> None:
    dist_pool(3).run(_masked_between_dispatch_and_combine)


def _disagreeing_masks(rank: int, world: int) -> str:
    c = Case("disagree")
    num_experts = c.experts_per_rank * world
    mine = make_inputs(5, world, tokens_for(c.tokens, world), c.hidden, num_experts, c.topk)[rank]
    hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(c.max_tokens, c.hidden, world, num_experts)
    buffer = moe_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, enable_shrink=True, backend="torch")
    if rank == 0:
        buffer.low_latency_update_mask_buffer(1, True)
    with pytest.raises(moe_ep.PeerInputError, match="the ranks mask different ranks") as error:
        buffer.low_latency_dispatch(mine.x, mine.topk_idx, c.max_tokens, num_experts, use_fp8=False)
    return str(error.value)


def test_ranks_masking_different_ranks_raise_everywhere(dist_pool) -> None:
    for message in dist_pool(2).run(_disagreeing_masks):
        assert "{0: [1], 1: []}" in message


def _mask_api_checks(rank: int, world: int) -> None:
    hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(8, 128, world, 2 * world)
    plain = moe_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, backend="torch")
    for call in (lambda b: b.low_latency_update_mask_buffer(0, True), lambda b: b.low_latency_clean_mask_buffer(),
                 lambda b: b.low_latency_query_mask_buffer(torch.zeros(world, dtype=torch.int32))):
        with pytest.raises(ValueError, match="enable_shrink=False"):
            call(plain)
    normal = moe_ep.Buffer(dist.group.WORLD, 1 << 20, enable_shrink=True, backend="torch")
    with pytest.raises(ValueError, match="low_latency_mode=False"):
        normal.low_latency_clean_mask_buffer()
    elastic = moe_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, enable_shrink=True, backend="torch")
    for bad in (world, -1, True, 0.0):
        with pytest.raises(ValueError, match="rank_to_mask: expected a rank in"):
            elastic.low_latency_update_mask_buffer(bad, True)
    with pytest.raises(TypeError, match="mask_status: expected dtype torch.int32"):
        elastic.low_latency_query_mask_buffer(torch.zeros(world, dtype=torch.int64))
    with pytest.raises(ValueError, match="mask_status: expected shape"):
        elastic.low_latency_query_mask_buffer(torch.zeros(world + 1, dtype=torch.int32))


def test_mask_api_checks_its_arguments(dist_pool) -> None:
    dist_pool(2).run(_mask_api_checks)
