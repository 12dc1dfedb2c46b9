"""Validation turns a Buffer call into one frozen request per operation, checked, as the backends take it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.ops import fp8, routing, validation
from moe_ep.ops.handles import DispatchedRouting, DispatchHandle, HandleOrigin, LowLatencyHandle
from moe_ep.ops.requests import DispatchRequest
from reference import make_inputs

RANKS, TOKENS, HIDDEN, EXPERTS = 2, 12, 256, 8


def routed(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, routing.DispatchLayout]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    topk_idx = torch.rand(TOKENS, EXPERTS, generator=g).topk(3, dim=1).indices
    topk_idx[0, 2] = -1
    weights = torch.rand(TOKENS, 3, generator=g)
    return x, topk_idx, weights, routing.dispatch_layout(topk_idx, EXPERTS, RANKS)


def dispatch_request(x: object, topk_idx: torch.Tensor, weights: torch.Tensor,
                     layout: routing.DispatchLayout) -> DispatchRequest:
    return validation.dispatch_request(x, None, layout.num_tokens_per_rank, layout.is_token_in_rank,
                                       layout.num_tokens_per_expert, topk_idx, weights, 4, 0, moe_ep.Config(), RANKS)


def test_dispatch_request_keeps_the_arguments_and_names_the_shared_settings() -> None:
    x, topk_idx, weights, layout = routed(1)
    request = dispatch_request(x, topk_idx, weights, layout)
    assert request.x is x and request.topk_idx is topk_idx and request.x_scales is None and not request.cached
    assert request.num_experts == EXPERTS and request.expert_alignment == 4
    assert request.agreed() == {"cached": 0, "hidden (x.shape[1])": HIDDEN, "x.dtype": 0, "x scales": -1,
                                "topk_idx.shape[1]": 3, "topk_weights given": 1, "num_experts": EXPERTS,
                                "config.num_sms": 20}
    with pytest.raises(AttributeError):  # frozen: a named tuple
        request.num_worst_tokens = 3
    q, scales = fp8.per_token_cast_to_fp8(x.float())
    fp8_request = dispatch_request((q, scales), topk_idx, weights, layout)
    assert fp8_request.x is q and fp8_request.x_scales is scales
    assert fp8_request.agreed()["x scales"] == HIDDEN // 128 and fp8_request.agreed()["x.dtype"] == 4


def test_cached_dispatch_and_combine_take_the_handle_as_a_named_tuple() -> None:
    x, _, _, layout = routed(2)
    num_recv = 17
    handle = (torch.zeros(RANKS, RANKS, dtype=torch.int32), torch.zeros(RANKS, 4, dtype=torch.int32),
              torch.zeros(RANKS, 4, dtype=torch.int32), torch.arange(num_recv, dtype=torch.int32),
              layout.is_token_in_rank, torch.zeros(TOKENS, RANKS, dtype=torch.int32))
    cached = validation.dispatch_request(x, handle, None, None, None, None, None, 1, 0, moe_ep.Config(), RANKS)
    assert cached.cached and isinstance(cached.handle, DispatchHandle) and cached.handle.recv_src_idx is handle[3]
    assert cached.agreed()["cached"] == 1 and cached.agreed()["num_experts"] == 0
    rows = torch.randn(num_recv, HIDDEN).bfloat16()
    bias = torch.randn(TOKENS, HIDDEN).bfloat16()
    combine = validation.combine_request(rows, handle, None, (bias, bias), moe_ep.Config(), RANKS)
    assert isinstance(combine.handle, DispatchHandle) and combine.bias_0 is bias and combine.bias_1 is bias
    assert combine.agreed() == {"hidden (x.shape[1])": HIDDEN, "x.dtype": 0, "topk_weights.shape[1]": -1}
    with pytest.raises(ValueError, match="x: expected 17 rows"):
        validation.combine_request(rows[:5], handle, None, None, moe_ep.Config(), RANKS)
    with pytest.raises(ValueError, match="bias: expected None, a tensor or a tuple of two tensors"):
        validation.combine_request(rows, handle, None, [bias], moe_ep.Config(), RANKS)


def test_bad_token_tuples_are_named() -> None:
    x, topk_idx, weights, layout = routed(3)
    with pytest.raises(ValueError, match=r"x: expected a tensor or a \(data, scales\) pair, got a tuple of 3"):
        dispatch_request((x, x, x), topk_idx, weights, layout)
    with pytest.raises(TypeError, match="x\\[0\\]: expected dtype torch.float8_e4m3fn"):
        dispatch_request((x, x), topk_idx, weights, layout)


def test_low_latency_requests() -> None:
    x, topk_idx, weights, _ = routed(4)
    stats = torch.zeros(EXPERTS // RANKS, dtype=torch.int32)
    request = validation.low_latency_dispatch_request(x, topk_idx, 16, EXPERTS, stats, None, True, True, True,
                                                      False, True, RANKS)
    assert request.cumulative_local_expert_recv_stats is stats and request.return_recv_hook
    assert request.agreed() == {"hidden (x.shape[1])": HIDDEN, "num_experts": EXPERTS,
                                "num_max_dispatch_tokens_per_rank": 16, "use_fp8": 1, "round_scale": 1, "use_ue8m0": 1}
    with pytest.raises(ValueError, match="return_recv_hook: cannot be combined with async_finish"):
        validation.low_latency_dispatch_request(x, topk_idx, 16, EXPERTS, None, None, True, False, False, True, True,
                                                RANKS)
    handle = (torch.full((EXPERTS // RANKS, RANKS * 16), -1, dtype=torch.int32),
              torch.zeros(EXPERTS // RANKS, RANKS, dtype=torch.int64), 16, HIDDEN, EXPERTS)
    y = torch.randn(EXPERTS // RANKS, RANKS * 16, HIDDEN).bfloat16()
    combine = validation.low_latency_combine_request(y, topk_idx, weights, handle, False, True, False, False, None,
                                                     None, RANKS)
    assert isinstance(combine.handle, LowLatencyHandle) and combine.zero_copy
    assert combine.agreed() == {"hidden": HIDDEN, "num_experts": EXPERTS, "num_max_dispatch_tokens_per_rank": 16,
                                "use_logfmt": 0}
    assert validation.low_latency_combine_request(y, topk_idx, weights, handle, True, False, False, False, None, None,
                                                  RANKS).use_logfmt
    with pytest.raises(ValueError, match="use_logfmt: cannot be combined with zero_copy"):
        validation.low_latency_combine_request(y, topk_idx, weights, handle, True, True, False, False, None, None,
                                               RANKS)


def test_dispatch_handle_is_a_six_tuple_that_may_mark_exact_rows() -> None:
    """A handle unpacks like DeepEP's 6-tuple; only a dispatch's own marking says its rows are exact (no
    padding), and a handle rebuilt from the six fields or replaced field by field is not marked."""
    fields = tuple(torch.full((2,), i, dtype=torch.int32) for i in range(6))
    plain = DispatchHandle(*fields)
    exact = plain.with_exact_rows()
    assert not plain.exact_rows and exact.exact_rows and len(exact) == 6
    assert all(a is b for a, b in zip(exact, fields)) and exact.send_head is fields[5]
    assert not DispatchHandle(*exact).exact_rows and not exact._replace(send_head=fields[0]).exact_rows
    rank_prefix, *_ = exact
    assert rank_prefix is fields[0]


def test_a_handle_is_checked_in_full_unless_its_origin_is_a_call_like_this_one() -> None:
    """A handle's tensor checks are skipped only for a handle whose origin (or low-latency routing) names this
    group size and device, and for a cached dispatch this token count; any other is checked in full."""
    x, _, _, layout = routed(5)
    cpu = torch.device("cpu")
    wrong = DispatchHandle(torch.zeros(RANKS, RANKS, dtype=torch.int64), torch.zeros(RANKS, 4, dtype=torch.int32),
                           torch.zeros(RANKS, 4, dtype=torch.int32), torch.arange(5, dtype=torch.int32),
                           layout.is_token_in_rank, torch.zeros(TOKENS, RANKS, dtype=torch.int32))
    for origin in (None, HandleOrigin(RANKS + 1, cpu, TOKENS), HandleOrigin(RANKS, torch.device("meta"), TOKENS),
                   HandleOrigin(RANKS, cpu, TOKENS + 1)):
        wrong.origin = origin
        with pytest.raises(TypeError, match="handle.rank_prefix_matrix: expected dtype torch.int32"):
            validation.check_dispatch_handle(wrong, TOKENS, RANKS, cpu)
    wrong.origin = HandleOrigin(RANKS, cpu, TOKENS)  # (as no backend would make it: shows the checks skipped)
    assert validation.check_dispatch_handle(wrong, TOKENS, RANKS, cpu) is wrong
    assert validation.check_dispatch_handle(wrong, None, RANKS, cpu) is wrong
    with pytest.raises(TypeError, match="handle.rank_prefix_matrix"):  # rebuilt from its fields: no origin
        validation.check_dispatch_handle(DispatchHandle(*wrong), TOKENS, RANKS, cpu)
    with pytest.raises(TypeError, match="handle.rank_prefix_matrix"):  # DeepEP's plain tuple
        validation.check_dispatch_handle(tuple(wrong), TOKENS, RANKS, cpu)

    wrong_ll = LowLatencyHandle(torch.zeros(EXPERTS // RANKS, RANKS * 16, dtype=torch.int32),
                                torch.zeros(EXPERTS // RANKS, RANKS, dtype=torch.int32), 16, HIDDEN, EXPERTS)
    for routed_over in (None, DispatchedRouting(RANKS + 1, (TOKENS, 3), None)):
        wrong_ll.routing = routed_over
        with pytest.raises(TypeError, match="handle.layout_range: expected dtype torch.int64"):
            validation.check_low_latency_handle(wrong_ll, RANKS)
    wrong_ll.routing = DispatchedRouting(RANKS, (TOKENS, 3), None)
    assert validation.check_low_latency_handle(wrong_ll, RANKS) is wrong_ll
    with pytest.raises(TypeError, match="handle.layout_range"):
        validation.check_low_latency_handle(tuple(wrong_ll), RANKS)


def _handles_made(rank: int, world: int) -> None:
    """The handles a Buffer's dispatches return record their origin, and what it vouches for holds: their
    fields pass the full checks."""
    inp = make_inputs(11, world, [12] * world, HIDDEN, EXPERTS, 3)[rank]
    buffer = moe_ep.Buffer(dist.group.WORLD, low_latency_mode=True, backend="torch")
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp.topk_idx, EXPERTS)
    x = inp.x.bfloat16()
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=inp.topk_idx)
    assert handle.origin == HandleOrigin(world, x.device, 12)
    validation.check_dispatch_handle(tuple(handle), 12, world, x.device)
    bad = DispatchHandle(*handle)._replace(recv_src_idx=handle.recv_src_idx.long())
    with pytest.raises(TypeError, match="handle.recv_src_idx: expected dtype torch.int32"):
        buffer.combine(recv_x, bad)
    with pytest.raises(ValueError, match=r"handle.is_token_in_rank: expected shape \[11, 2\]"):
        buffer.dispatch(x[:11], handle=handle)  # the origin's token count differs: checked in full
    _, _, ll_handle, _, _ = buffer.low_latency_dispatch(x, inp.topk_idx, 16, EXPERTS, use_fp8=False)
    assert ll_handle.routing.num_ranks == world and ll_handle.routing.shape == (12, 3)
    validation.check_low_latency_handle(tuple(ll_handle), world)


def test_the_handles_a_dispatch_makes_record_their_origin(dist_pool) -> None:
    dist_pool(RANKS).run(_handles_made)
