"""Bad input raises a clear error naming the argument, on every rank, before data moves (a peer that
never arrives: tests/test_nothing_silent.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_ep
from reference import make_inputs

NUM_EXPERTS = 8
HIDDEN = 128


def _normal_call(buffer: moe_ep.Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int = NUM_EXPERTS) -> None:
    layout = moe_ep.ops.routing.dispatch_layout(topk_idx.clamp(-1, num_experts - 1), num_experts, buffer.group_size)
    buffer.dispatch(x, num_tokens_per_rank=layout.num_tokens_per_rank, is_token_in_rank=layout.is_token_in_rank,
                    num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights)


def _bad_input(rank: int, world: int, case: str) -> tuple[str, str]:
    """Rank 1 passes the defect named by `case`; every rank reports what it raised."""
    inp = make_inputs(3, world, [12] * world, HIDDEN, NUM_EXPERTS, 3)[rank]
    x, topk_idx, topk_weights = inp.x, inp.topk_idx, inp.topk_weights
    low_latency = case.startswith("ll_")
    buffer = moe_ep.Buffer(dist.group.WORLD, low_latency_mode=low_latency or case == "not_ll_mode",
                           backend="torch")
    bad = rank == 1
    ll_args = dict(num_max_dispatch_tokens_per_rank=16, num_experts=NUM_EXPERTS)
    try:
        if case == "x_dtype":
            _normal_call(buffer, x.int() if bad else x, topk_idx, topk_weights)
        elif case == "weights_shape":
            _normal_call(buffer, x, topk_idx, topk_weights[:, :2] if bad else topk_weights)
        elif case == "x_not_contiguous":
            wide = torch.cat([x, x], dim=1)
            _normal_call(buffer, wide[:, ::2] if bad else x, topk_idx, topk_weights)
        elif case == "expert_out_of_range":
            if bad:
                topk_idx = topk_idx.clone()
                topk_idx[3, 0] = NUM_EXPERTS
            _normal_call(buffer, x, topk_idx, topk_weights)
        elif case == "expert_repeated":
            if bad:
                topk_idx = topk_idx.clone()
                topk_idx[4] = torch.tensor([2, 5, 2])
            _normal_call(buffer, x, topk_idx, topk_weights)
        elif case == "experts_not_divisible":
            low_experts = torch.arange(3).repeat(x.size(0), 1)  # valid ids for 5 experts as well as for 8
            _normal_call(buffer, x, low_experts, topk_weights, num_experts=5 if bad else NUM_EXPERTS)
        elif case == "hidden_mismatch":
            _normal_call(buffer, torch.cat([x, x], 1) if bad else x, topk_idx, topk_weights)
        elif case == "row_bytes":
            _normal_call(buffer, x[:, :100].contiguous() if bad else x[:, :104].contiguous(), topk_idx, topk_weights)
        elif case == "ll_too_many_tokens":
            n = 20 if bad else 12
            x_ll = torch.cat([x, x])[:n].contiguous()
            buffer.low_latency_dispatch(x_ll, torch.cat([topk_idx, topk_idx])[:n].contiguous(), **ll_args)
        elif case == "ll_fp8_hidden":
            buffer.low_latency_dispatch(x[:, :120].contiguous() if bad else x[:, :128], topk_idx, **ll_args)
        elif case == "ll_ue8m0_without_round_scale":
            buffer.low_latency_dispatch(x, topk_idx, use_ue8m0=bad, round_scale=False, **ll_args)
        elif case == "not_ll_mode":
            plain = moe_ep.Buffer(dist.group.WORLD, backend="torch") if bad else buffer
            plain.low_latency_dispatch(x, topk_idx, **ll_args)
        else:
            raise AssertionError(case)
    except Exception as exc:  # the test inspects what each rank raised
        return type(exc).__name__, str(exc)
    return "ok", ""


BAD_INPUTS = {
    "x_dtype": ("TypeError", "x: expected dtype"),
    "weights_shape": ("ValueError", "topk_weights: expected shape"),
    "x_not_contiguous": ("ValueError", "x: expected a contiguous tensor"),
    "expert_out_of_range": ("ValueError", "topk_idx: expert ids must be -1"),
    "expert_repeated": ("ValueError", "topk_idx: token 4 selects the same expert"),
    "experts_not_divisible": ("ValueError", "num_experts: expected a multiple of the group size"),
    "row_bytes": ("ValueError", "x: a row must be a multiple of 16 bytes"),
    "ll_too_many_tokens": ("ValueError", "x: 20 tokens exceed num_max_dispatch_tokens_per_rank=16"),
    "ll_fp8_hidden": ("ValueError", "x: FP8 needs a hidden size that is a multiple of 128"),
    "ll_ue8m0_without_round_scale": ("ValueError", "use_ue8m0: requires use_fp8=True and round_scale=True"),
    "not_ll_mode": ("ValueError", "low_latency_dispatch: the Buffer was created with low_latency_mode=False"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_on_every_rank(dist_pool, case: str) -> None:
    (good_type, good_msg), (bad_type, bad_msg) = dist_pool(2).run(_bad_input, case)
    want_type, want_msg = BAD_INPUTS[case]
    assert bad_type == want_type and want_msg in bad_msg, (bad_type, bad_msg)
    assert good_type == "PeerInputError" and "rank(s) [1] rejected" in good_msg, (good_type, good_msg)


def test_mismatched_setting_names_it_on_every_rank(dist_pool) -> None:
    for kind, message in dist_pool(2).run(_bad_input, "hidden_mismatch"):
        assert kind == "PeerInputError" and "ranks disagree on hidden (x.shape[1]): [128, 256]" in message
