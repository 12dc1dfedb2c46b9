"""Normal-mode Buffer (torch backend over gloo) against the dense reference, at world sizes 1-4."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.ops import fp8
from reference import (combine_reference, dispatch_reference, expert_output, make_inputs, to_cpu,
                       tokens_for)


@dataclass(frozen=True)
class Case:
    name: str
    tokens: tuple[int, ...] = (40, 17, 64, 33)
    hidden: int = 256
    experts_per_rank: int = 6
    topk: int = 4
    dtype: str = "bfloat16"
    routing: str = "random"
    alignment: int = 1
    worst_extra: int = -1  # >= 0: num_worst_tokens = received tokens of the busiest rank + this
    use_fp8: bool = False
    num_sms: int = 6


CASES = [
    Case("random_bf16", alignment=4),
    Case("skewed", routing="skewed", hidden=128, topk=3),
    Case("zero_tokens_and_unused_rank", tokens=(23, 0, 31, 0), routing="one_rank_empty", hidden=384),
    Case("float32_hidden_36", dtype="float32", hidden=36, num_sms=4, alignment=3),
    Case("num_worst_tokens", worst_extra=5, alignment=2),
    Case("fp8", use_fp8=True, hidden=512, num_sms=8),
    Case("fp8_zero_tokens", use_fp8=True, tokens=(20, 0, 13, 0)),
    Case("single_row_fp32_top2", tokens=(1, 0, 0, 0), dtype="float32", hidden=36, topk=2, routing="skewed"),
    Case("topk_32", experts_per_rank=12, topk=32, hidden=128, tokens=(9, 12, 3, 7)),
]


def _normal_round_trip(rank: int, world: int, case: dict, device: str = "cpu", backend: str = "torch") -> int:
    """Every normal-mode output of `backend` on `device` against the dense reference (on the CPU)."""
    c = Case(**case)
    num_experts = c.experts_per_rank * world
    inputs = make_inputs(1234 + world, world, tokens_for(c.tokens, world), c.hidden, num_experts, c.topk,
                         dtype=getattr(torch, c.dtype), routing=c.routing)
    mine = inputs[rank].to(device)
    buffer = moe_ep.Buffer(dist.group.WORLD, backend=backend)
    config = moe_ep.Config(c.num_sms, 6, 256, 6, 128)
    ref = dispatch_reference(inputs, rank, num_experts, c.alignment, config.num_channels)

    num_tokens_per_rank, per_node, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(
        mine.topk_idx, num_experts)
    assert per_node is None
    assert num_tokens_per_rank.tolist() == ref.num_tokens_per_rank
    assert num_tokens_per_expert.tolist() == ref.num_tokens_per_expert
    assert torch.equal(is_token_in_rank.cpu(), ref.is_token_in_rank)

    num_worst = 0
    if c.worst_extra >= 0:
        totals = [len(dispatch_reference(inputs, r, num_experts, 1, 1).rows) for r in range(world)]
        num_worst = max(totals) + c.worst_extra
    x = fp8.per_token_cast_to_fp8(mine.x.float()) if c.use_fp8 else mine.x
    dispatched = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=mine.topk_idx, topk_weights=mine.topk_weights,
        expert_alignment=c.alignment, num_worst_tokens=num_worst, config=config, async_finish=True)
    dispatched[-1].current_stream_wait()
    device_recv_x, device_handle = dispatched[0], dispatched[4]
    recv_x, recv_idx, recv_w, per_expert, handle = to_cpu(dispatched[:5])
    n = len(ref.rows)
    rows = num_worst if num_worst else n

    if c.use_fp8:
        data, scales = recv_x
        ref_q, ref_s = fp8.per_token_cast_to_fp8(ref.recv_x.float()) if n else (data[:0], scales[:0])
        assert data.shape == (rows, c.hidden) and scales.shape == (rows, c.hidden // 128)
        assert torch.equal(data[:n].view(torch.uint8), ref_q.view(torch.uint8))
        assert torch.equal(scales[:n], ref_s)
    else:
        assert recv_x.shape == (rows, c.hidden) and recv_x.dtype == mine.x.dtype
        assert torch.equal(recv_x[:n], ref.recv_x)
        # Provenance: source rank and token index ride in the data (exact) in the reference order.
        assert [(int(r[0]), int(r[1]) * 64 + int(r[2])) for r in recv_x[:n].float()] == ref.rows
    assert torch.equal(recv_idx[:n], ref.recv_topk_idx)
    assert torch.equal(recv_w[:n], ref.recv_topk_weights)
    assert handle.recv_src_idx[:n].tolist() == [t for _, t in ref.rows]
    if num_worst:
        assert per_expert == []
        assert (recv_idx[n:] == -1).all() and (recv_w[n:] == 0).all() and (handle.recv_src_idx[n:] == -1).all()
        padding = recv_x[0][n:] if c.use_fp8 else recv_x[n:]
        assert (padding.float() == 0).all()
    else:
        assert per_expert == ref.per_expert
    assert torch.equal(handle.rank_prefix_matrix, ref.rank_prefix_matrix)
    assert torch.equal(handle.channel_prefix_matrix, ref.channel_prefix_matrix)
    assert torch.equal(handle.recv_channel_prefix_matrix, ref.recv_channel_prefix_matrix)
    assert torch.equal(handle.send_head, ref.send_head)
    assert torch.equal(handle.is_token_in_rank, ref.is_token_in_rank)
    assert handle.rank_prefix_matrix is handle[0] and len(handle) == 6  # a NamedTuple like DeepEP's tuple

    cached = to_cpu(buffer.dispatch(x, handle=device_handle, config=config))
    assert cached[1:5] == (None, None, None, None)
    if c.use_fp8:
        assert torch.equal(cached[0][0].view(torch.uint8), recv_x[0].view(torch.uint8))
        assert torch.equal(cached[0][1], recv_x[1])
        return n

    gen = torch.Generator().manual_seed(99 + rank)
    bias = [torch.randn(mine.x.shape, generator=gen).to(mine.x.dtype) for _ in range(2)]
    expert_out = expert_output(device_recv_x, rank)
    combined, combined_w, _ = to_cpu(buffer.combine(expert_out, device_handle, topk_weights=dispatched[2],
                                                    bias=(bias[0].to(device), bias[1].to(device)), config=config))
    ref_out, ref_w = combine_reference(inputs, rank, num_experts, bias)
    assert torch.equal(combined, ref_out)
    assert torch.allclose(combined_w, ref_w, rtol=0, atol=1e-6)
    # Weights of non-masked slots come back exactly; masked slots give 0.
    valid = inputs[rank].topk_idx >= 0
    assert torch.equal(combined_w[valid], inputs[rank].topk_weights[valid]) and (combined_w[~valid] == 0).all()
    plain, no_weights, _ = to_cpu(buffer.combine(expert_out, device_handle))
    assert no_weights is None and torch.equal(plain, combine_reference(inputs, rank, num_experts)[0])
    return n


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_dispatch_combine_matches_reference(dist_pool, world: int, case: Case) -> None:
    received = dist_pool(world).run(_normal_round_trip, asdict(case))
    assert sum(received) > 0


def test_tokens_per_node() -> None:
    """Per-node counts appear once the group spans more than one node (node size patched to 2)."""
    from moe_ep.ops import routing

    # Experts 0-1 on rank 0, 2-3 on rank 1 (node 0); 4-7 on ranks 2-3 (node 1).
    topk_idx = torch.tensor([[0, 5], [1, -1], [6, 7], [-1, -1]])
    layout = routing.dispatch_layout(topk_idx, num_experts=8, num_ranks=4, num_ranks_per_node=2)
    assert layout.num_tokens_per_rdma_rank.tolist() == [2, 2]


def test_eight_ranks(dist_pool) -> None:
    """EP8 (one full node's worth of ranks, as on an 8-GPU machine) on the torch backend."""
    case = Case("eight_ranks", tokens=(11, 0, 7, 19, 3, 8, 14, 5), experts_per_rank=4, alignment=2)
    assert sum(dist_pool(8).run(_normal_round_trip, asdict(case))) > 0
