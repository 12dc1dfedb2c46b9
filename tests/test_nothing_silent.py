"""Nothing fails silently or uncatchably: input that cannot be right is refused on every rank (the rank
at fault raises its own error, the others `PeerInputError` naming it and the argument), no input
makes a collective receive a size it did not expect, an empty batch trains, and a peer that exits or
stalls becomes an error naming the operation and the peer within `MOE_EP_TIMEOUT_S`.

Each worker returns `(exception type name, message)` of what its rank raised, or `("ok", "")`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist

import moe_ep
from dist_pool import DistPool
from moe_ep.layers import MoEConfig, MoELayer, TopKRouter
from moe_ep.ops import routing
from moe_ep.ops.settings import CHECK_VALUES_ENV, TIMEOUT_ENV, reload
from reference import make_inputs

HIDDEN = 128
TOKENS = 16
EXPERTS_PER_RANK = 3
TOPK = 3
ROOT = Path(__file__).resolve().parents[1]


def _outcome(call: Callable[[], object]) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:  # the tests inspect what each rank raised
        return type(exc).__name__, str(exc)
    return "ok", ""


def _with_environment(name: str, value: str, call: Callable[[], object]) -> tuple[str, str]:
    """`_outcome(call)` with the setting `name=value` in this worker, restored afterwards."""
    old = os.environ.get(name)
    os.environ[name] = value
    reload()
    try:
        return _outcome(call)
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old
        reload()


def _inputs(rank: int, world: int, seed: int = 5, tokens: int = TOKENS):
    return make_inputs(seed, world, [tokens] * world, HIDDEN, EXPERTS_PER_RANK * world, TOPK)[rank]


def _assert_refused_everywhere(outcomes: list[tuple[str, str]], bad_rank: int, error: str, message: str) -> None:
    """The bad rank raised `error` with `message`; every other rank a `PeerInputError` quoting it."""
    for rank, (kind, text) in enumerate(outcomes):
        if rank == bad_rank:
            assert kind == error and message in text, (rank, kind, text)
        else:
            assert kind == "PeerInputError" and f"rank(s) [{bad_rank}] rejected" in text and message in text, \
                (rank, kind, text)


# ------------------------------------------------------------------ the MoE layer's hidden size


def _layer_config(world: int, **overrides: object) -> MoEConfig:
    settings = dict(hidden_size=64, moe_intermediate_size=32, num_experts=2 * world, num_experts_per_tok=2)
    settings.update(overrides)
    return MoEConfig(**settings)


def _layer_with_input(rank: int, world: int, bad_shape: list[int], decode: bool) -> tuple[str, str]:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if decode else torch.float32  # low-latency dispatch moves bf16
    layer = MoELayer(_layer_config(world, low_latency_max_tokens=16), backend="torch", dtype=dtype)
    hidden = torch.randn(*(bad_shape if rank == world - 1 else [16, 64]), dtype=dtype)
    return _outcome(lambda: layer.decode(hidden) if decode else layer(hidden))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("bad_shape, decode", [([16, 32], False), ([2, 8, 32], False), ([16, 32], True)])
def test_layer_refuses_another_hidden_size_before_reshaping(dist_pool, world: int, bad_shape: list[int],
                                                            decode: bool) -> None:
    outcomes = dist_pool(world).run(_layer_with_input, bad_shape, decode)
    _assert_refused_everywhere(outcomes, world - 1, "ValueError",
                               f"hidden: expected shape [..., 64] (the last dimension is config.hidden_size), got "
                               f"{bad_shape}")


# ------------------------------------------------------------------ a dispatch layout of another top-k


def _dispatch_with_layout(rank: int, world: int, defect: str) -> tuple[str, str]:
    inp = _inputs(rank, world)
    num_experts = EXPERTS_PER_RANK * world
    layout = routing.dispatch_layout(inp.topk_idx, num_experts, world)
    per_rank, in_rank, per_expert = layout.num_tokens_per_rank, layout.is_token_in_rank, layout.num_tokens_per_expert
    if rank == 1:
        if defect == "layout_of_another_topk":
            other = _inputs(rank, world, seed=6)
            per_rank, _, per_expert, in_rank = routing.dispatch_layout(other.topk_idx, num_experts, world)
        elif defect == "expert_counts_zero":
            per_expert = torch.zeros_like(per_expert)
        elif defect == "rank_column_cleared":
            in_rank = in_rank.clone()
            in_rank[:, 1] = False
            per_rank = in_rank.sum(0, dtype=torch.int32)  # consistent with the mask, not with topk_idx
    buffer = moe_ep.Buffer(dist.group.WORLD, backend="torch")
    return _outcome(lambda: buffer.dispatch(inp.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert, topk_idx=inp.topk_idx,
                                            topk_weights=inp.topk_weights))


@pytest.mark.parametrize("defect, message", [
    ("layout_of_another_topk", "is_token_in_rank: does not match topk_idx (token "),
    ("expert_counts_zero", "num_tokens_per_expert: does not match topk_idx (expert "),
    ("rank_column_cleared", "is_token_in_rank: does not match topk_idx (token "),
])
def test_dispatch_refuses_a_layout_of_another_topk(dist_pool, defect: str, message: str) -> None:
    _assert_refused_everywhere(dist_pool(3).run(_dispatch_with_layout, defect), 1, "ValueError", message)


def _rank_counts_unchecked(rank: int, world: int) -> bool:
    """With value checks off, wrong `num_tokens_per_rank` cannot make the exchange's sizes disagree with
    its data: the rows a rank sends are counted from `is_token_in_rank`."""
    inp = _inputs(rank, world)
    layout = routing.dispatch_layout(inp.topk_idx, EXPERTS_PER_RANK * world, world)
    buffer = moe_ep.Buffer(dist.group.WORLD, backend="torch")

    def dispatch(per_rank: torch.Tensor) -> torch.Tensor:
        return buffer.dispatch(inp.x, num_tokens_per_rank=per_rank, is_token_in_rank=layout.is_token_in_rank,
                               num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=inp.topk_idx)[0]

    want = dispatch(layout.num_tokens_per_rank)
    results = []
    _with_environment(CHECK_VALUES_ENV, "0", lambda: results.append(dispatch(layout.num_tokens_per_rank.flip(0) + 3)))
    return len(results) == 1 and torch.equal(results[0], want)


def test_wrong_rank_counts_without_value_checks_still_move_the_right_rows(dist_pool) -> None:
    assert dist_pool(3).run(_rank_counts_unchecked) == [True] * 3


# ------------------------------------------------------------------ a low-latency combine of another top-k


def _low_latency_combine_with(rank: int, world: int, change: str, check_values: str) -> tuple[str, str]:
    inp = _inputs(rank, world)
    num_experts = EXPERTS_PER_RANK * world
    hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, world, num_experts)
    buffer = moe_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, backend="torch")

    def round_trip() -> None:
        recv, _, handle, _, _ = buffer.low_latency_dispatch(inp.x, inp.topk_idx, TOKENS, num_experts, use_fp8=False)
        topk_idx, weights = inp.topk_idx, inp.topk_weights
        if rank == 1:
            if change == "rolled":  # the same counts per expert, other tokens
                topk_idx = topk_idx.roll(1, 0)
            elif change == "one_slot_masked":  # other counts per expert
                topk_idx = topk_idx.clone()
                topk_idx[topk_idx[:, 0] >= 0, 0] = -1
            elif change == "fewer_tokens":
                topk_idx, weights = topk_idx[:-1].contiguous(), weights[:-1].contiguous()
        buffer.low_latency_combine(recv, topk_idx, weights, handle)

    return _with_environment(CHECK_VALUES_ENV, check_values, round_trip)


def test_low_latency_combine_refuses_another_topk(dist_pool) -> None:
    outcomes = dist_pool(2).run(_low_latency_combine_with, "rolled", "1")
    _assert_refused_everywhere(outcomes, 1, "ValueError", "topk_idx: routes token 0 to experts")


def test_low_latency_combine_refuses_another_token_count_without_value_checks(dist_pool) -> None:
    outcomes = dist_pool(2).run(_low_latency_combine_with, "fewer_tokens", "0")
    _assert_refused_everywhere(outcomes, 1, "ValueError",
                               f"topk_idx: expected the dispatch's top-k of shape [{TOKENS}, {TOPK}]")


# ------------------------------------------------------------------ sizes agreed before every exchange


def _check_group_still_works(rank: int, world: int) -> bool:
    inp = _inputs(rank, world, seed=9)
    layout = routing.dispatch_layout(inp.topk_idx, EXPERTS_PER_RANK * world, world)
    buffer = moe_ep.Buffer(dist.group.WORLD, backend="torch")
    recv = buffer.dispatch(inp.x, num_tokens_per_rank=layout.num_tokens_per_rank,
                           is_token_in_rank=layout.is_token_in_rank,
                           num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=inp.topk_idx)
    combined = buffer.combine(recv[0], recv[4])[0]
    return torch.equal(combined, (inp.x.float() * layout.is_token_in_rank.sum(1, keepdim=True)).to(inp.x.dtype))


def _mixed_handles(rank: int, world: int, op: str) -> tuple[str, str]:
    """Every rank dispatches twice; rank 1 then uses the second handle where the others use the first."""
    buffer = moe_ep.Buffer(dist.group.WORLD, backend="torch")
    handles = []
    for seed in (11, 12):
        inp = _inputs(rank, world, seed=seed)
        layout = routing.dispatch_layout(inp.topk_idx, EXPERTS_PER_RANK * world, world)
        recv, *_, handle, _ = buffer.dispatch(inp.x, num_tokens_per_rank=layout.num_tokens_per_rank,
                                              is_token_in_rank=layout.is_token_in_rank,
                                              num_tokens_per_expert=layout.num_tokens_per_expert,
                                              topk_idx=inp.topk_idx)
        handles.append((inp.x, recv, handle))
    x, recv, handle = handles[1 if rank == 1 else 0]
    if op == "combine":
        return _outcome(lambda: buffer.combine(recv, handle))
    return _outcome(lambda: buffer.dispatch(x, handle=handle))


@pytest.mark.parametrize("op", ["combine", "cached_dispatch"])
def test_handles_of_different_dispatches_are_refused_on_every_rank(dist_pool, op: str) -> None:
    pool = dist_pool(3)
    for rank, (kind, text) in enumerate(pool.run(_mixed_handles, op)):
        assert kind == "PeerInputError" and text.startswith(
            f"{op}: handle: every rank must pass the handle of the same dispatch; the rows to exchange do not match "
            f"(rank "), (rank, kind, text)
    assert pool.run(_check_group_still_works) == [True] * 3  # no rank aborted, the group goes on


def test_low_latency_combine_of_other_counts_is_refused_on_every_rank_without_value_checks(dist_pool) -> None:
    pool = dist_pool(2)
    for rank, (kind, text) in enumerate(pool.run(_low_latency_combine_with, "one_slot_masked", "0")):
        assert kind == "PeerInputError" and "topk_idx: must route every token as the dispatch behind handle did" \
            in text and "which expects" in text, (rank, kind, text)
    assert pool.run(_check_group_still_works) == [True] * 2


# ------------------------------------------------------------------ an empty batch on one rank


def _aux_config(world: int) -> MoEConfig:
    return _layer_config(world, aux_loss_coeff=0.01, seq_aux_loss_coeff=0.001, z_loss_coeff=0.001,
                         n_shared_experts=1)


def test_router_without_tokens_gives_zero_losses_and_zero_gradients() -> None:
    torch.manual_seed(0)
    router = TopKRouter(_aux_config(1))
    hidden = torch.randn(0, 64, requires_grad=True)
    topk_idx, weights = router(hidden, seq_len=4)
    assert topk_idx.shape == (0, 2)
    assert set(router.last_aux_losses) == {"aux_loss", "seq_aux_loss", "z_loss"}
    assert all(loss.item() == 0.0 for loss in router.last_aux_losses.values()), router.last_aux_losses
    weights.sum().backward()
    assert router.weight.grad is not None and torch.count_nonzero(router.weight.grad) == 0


def _train_step_with_an_empty_rank(rank: int, world: int) -> dict:
    torch.manual_seed(3)  # the same weights on every rank
    layer = MoELayer(_aux_config(world), backend="torch", dtype=torch.float64)
    empty = world - 1
    gen = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(0 if rank == empty else 12, 64, generator=gen, dtype=torch.float64, requires_grad=True)
    out = layer(hidden, seq_len=4)
    (out * torch.randn(out.shape, generator=gen, dtype=torch.float64)).sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    # The losses of this rank's tokens alone, from a router with the same weights.
    alone = TopKRouter(layer.config)
    alone.load_state_dict(layer.router.state_dict())
    alone(hidden.detach().float(), seq_len=4)
    return {"losses": {k: v.item() for k, v in layer.router.last_aux_losses.items()},
            "alone": {k: v.item() for k, v in alone.last_aux_losses.items()},
            "finite": all(g is not None and bool(torch.isfinite(g).all()) for g in grads.values()),
            "router_grad_nonzero": int(torch.count_nonzero(grads["router.weight"])), "out_rows": out.size(0)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_empty_batch_on_one_rank_trains_with_zero_aux_losses(dist_pool, world: int) -> None:
    results = dist_pool(world).run(_train_step_with_an_empty_rank)
    for rank, r in enumerate(results):
        assert r["finite"] and len(r["losses"]) == 3, (rank, r)
        if rank == world - 1:
            assert r["out_rows"] == 0 and r["router_grad_nonzero"] == 0
            assert r["losses"] == {"aux_loss": 0.0, "seq_aux_loss": 0.0, "z_loss": 0.0}, r
        else:
            assert r["router_grad_nonzero"] > 0 and all(v > 0 for v in r["losses"].values()), (rank, r)
            assert r["losses"] == r["alone"], (rank, r)


# ------------------------------------------------------------------ the ranks' own input checks


def _layout_and_layer_checks(rank: int, world: int, where: str) -> tuple[str, str]:
    bad = rank == 1
    if where == "get_dispatch_layout":
        inp = _inputs(rank, world)
        num_experts = EXPERTS_PER_RANK * world
        topk_idx = inp.topk_idx.clone()
        if bad:
            topk_idx[2, 0] = num_experts
        buffer = moe_ep.Buffer(dist.group.WORLD, backend="torch")

        def layout_then_dispatch() -> None:  # as a program does: its peers learn of it at their dispatch
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
            buffer.dispatch(inp.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=topk_idx)

        return _outcome(layout_then_dispatch)
    torch.manual_seed(0)
    layer = MoELayer(_aux_config(world), backend="torch")
    return _outcome(lambda: layer(torch.randn(16, 64), seq_len=5 if bad else 4))


@pytest.mark.parametrize("where, message", [
    ("get_dispatch_layout", "get_dispatch_layout: ValueError: topk_idx: expert ids must be -1 (masked) or in [0, 9)"),
    ("router", "MoELayer.forward: ValueError: seq_len: expected a positive divisor of the token count 16, got 5"),
])
def test_input_checks_outside_the_buffer_reach_every_rank(dist_pool, where: str, message: str) -> None:
    outcomes = dist_pool(3).run(_layout_and_layer_checks, where)
    _assert_refused_everywhere(outcomes, 1, "ValueError", message.split(": ", 2)[2])
    for rank in (0, 2):
        assert f"rank 1 in {message}" in outcomes[rank][1], outcomes[rank]


_LAUNCHED = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import moe_ep
    from moe_ep.launch import launch

    def run(rank, world, device, fault):
        buffer = moe_ep.Buffer(dist.group.WORLD, backend="torch")
        topk_idx = torch.arange(8).remainder(2 * world).view(8, 1)
        if rank == 1 and fault == "bad_input":
            topk_idx[3, 0] = 99
        if rank == 1 and fault == "exit":
            os._exit(3)
        layout = buffer.get_dispatch_layout(topk_idx, 2 * world)
        buffer.dispatch(torch.randn(8, 16), num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                        num_tokens_per_expert=layout[2], topk_idx=topk_idx)

    if __name__ == "__main__":
        launch(run, 3, sys.argv[1])
""")


@pytest.mark.parametrize("fault, first", [
    ("bad_input", "--- rank 1 (its own error) ---"),
    ("exit", "--- rank 1 (its own error) ---\nexited with code 3 without a Python error"),
])
def test_launcher_shows_the_failed_ranks_own_error_first(tmp_path: Path, fault: str, first: str) -> None:
    script = tmp_path / "launched.py"
    script.write_text(_LAUNCHED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           TIMEOUT_ENV: "3", "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), fault], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    report = proc.stderr[proc.stderr.index("3 ranks failed"):] if "3 ranks failed" in proc.stderr else proc.stderr
    assert report.index(first) < report.index("--- rank 0 (caused by another rank) ---"), proc.stderr[-4000:]
    assert report.index(first) < report.index("--- rank 2 (caused by another rank) ---"), proc.stderr[-4000:]
    if fault == "bad_input":
        assert "ValueError: topk_idx: expert ids must be -1 (masked) or in [0, 6), found 99" in report
        # The peers learn of it at their next operation on the group: the layout call, whose first use of
        # the Buffer learns the nodes through the same agreement.
        assert report.count("PeerInputError: get_dispatch_layout: rank(s) [1] rejected their input") == 2
    else:
        assert report.count("PeerTimeoutError: get_dispatch_layout: rank(s) [1] did not arrive within 3 s") == 2
        assert time.monotonic() - started < 60


# ------------------------------------------------------------------ one timeout for every wait


def _dispatch_after(rank: int, world: int, fault: str, out_dir: str = "") -> tuple[str, str, float]:
    """Rank 1 exits or stalls (5 s) before a dispatch; the others dispatch, with a 2 s timeout. With
    `out_dir`, each rank also writes its outcome there (the pool reports nothing of a run a rank died in)."""
    os.environ[TIMEOUT_ENV] = "2"  # a pool of its own: nothing to restore
    reload()
    inp = _inputs(rank, world)
    layout = routing.dispatch_layout(inp.topk_idx, EXPERTS_PER_RANK * world, world)
    buffer = moe_ep.Buffer(dist.group.WORLD, backend="torch")
    if rank == 1:
        if fault == "exit":
            os._exit(0)
        time.sleep(5)
    started = time.monotonic()
    kind, text = _outcome(lambda: buffer.dispatch(
        inp.x, num_tokens_per_rank=layout.num_tokens_per_rank, is_token_in_rank=layout.is_token_in_rank,
        num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=inp.topk_idx))
    outcome = (kind, text, time.monotonic() - started)
    if out_dir:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    return outcome


def test_a_peer_that_exits_is_named_within_the_timeout(tmp_path: Path) -> None:
    pool = DistPool(3)
    try:
        with pytest.raises(AssertionError, match=r"--- rank 1 ---\nworker process died \(exit code 0\)"):
            pool.run(_dispatch_after, "exit", str(tmp_path), timeout=60)
    finally:
        pool.close()
    for rank in (0, 2):
        kind, text, waited = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert kind == "PeerTimeoutError" and text.startswith(
            "dispatch: rank(s) [1] did not arrive within 2 s (MOE_EP_TIMEOUT_S)"), (rank, text)
        assert 1.5 < waited < 4.5


def test_a_peer_that_stalls_is_named_within_the_timeout() -> None:
    pool = DistPool(2)
    try:
        (kind_0, text_0, waited_0), (kind_1, text_1, waited_1) = pool.run(_dispatch_after, "stall", timeout=60)
    finally:
        pool.close()
    assert kind_0 == "PeerTimeoutError" and text_0.startswith(
        "dispatch: rank(s) [1] did not arrive within 2 s (MOE_EP_TIMEOUT_S)"), text_0
    assert 1.5 < waited_0 < 4.5
    # The late rank learns at once that its peer gave up, instead of going on into the exchange alone.
    assert kind_1 == "PeerTimeoutError" and "peers gave up waiting before this rank (1) arrived (rank 0 on rank(s) " \
        "[1]" in text_1, text_1
    assert waited_1 < 1.5


def _gpu(index: int, uuid: int) -> bytes:
    """A `_gpu_record` stand-in: the device index and a 16-byte id."""
    return index.to_bytes(4, "little") + uuid.to_bytes(16, "little")


@pytest.mark.parametrize("gpus, error", [
    ([0, 1, 2, 3, 0, 1], r"host 0 hold different numbers of ranks \(GPU 0: ranks \[0, 4\]; GPU 1: ranks \[1, 5\]; "
                         r"GPU 2: ranks \[2\]; GPU 3: ranks \[3\]\)"),
    ([0, 1, 2, 3], None),
    ([0, 1, 2, 3, 0, 1, 2, 3], None),
    ([0, 0, 0, 0, 0, 0], None),
])
def test_nvshmem_refuses_a_host_whose_gpus_hold_different_numbers_of_ranks(gpus: list[int], error) -> None:
    """NVSHMEM's initialisation hangs on such a placement and has no timeout: refused before it starts."""
    from moe_ep.ops.backends.cuda_low_latency import check_even_gpu_sharing

    records = [(b"host-a", _gpu(index, 100 + index)) for index in gpus]
    if error is None:
        check_even_gpu_sharing(records)
    else:
        with pytest.raises(RuntimeError, match=error):
            check_even_gpu_sharing(records)


def test_even_sharing_is_judged_per_host_and_by_gpu_identity() -> None:
    """Processes that each see one GPU report index 0: their GPUs are told apart by the UUID digest."""
    from moe_ep.ops.backends.cuda_low_latency import check_even_gpu_sharing

    per_process_view = [(b"host-a", _gpu(0, uuid)) for uuid in (7, 8, 7, 8)]
    check_even_gpu_sharing(per_process_view + [(b"host-b", _gpu(0, 9))] * 3)  # 2 + 2 on a, 3 on b: even per host
    uneven_b = [(b"host-b", _gpu(index, 9 + index)) for index in (0, 1, 0)]
    with pytest.raises(RuntimeError, match=r"host 1 .*GPU 0: ranks \[4, 6\]; GPU 1: ranks \[5\]"):
        check_even_gpu_sharing(per_process_view + uneven_b)


def test_a_step_that_cannot_time_out_ends_the_process_after_the_timeout() -> None:
    """NVSHMEM's initialisation has no timeout and cannot be interrupted: past `MOE_EP_INIT_TIMEOUT_S` the
    process exits with the reason and its Python stacks instead of hanging."""
    program = textwrap.dedent("""
        import time
        from moe_ep.ops.backends.cuda_low_latency import run_within_timeout
        def stuck_in_nvshmem():
            time.sleep(60)
        run_within_timeout(stuck_in_nvshmem, 1.0, "NVSHMEM's initialisation")
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 20
    assert "moe_ep: NVSHMEM's initialisation did not finish within 1 s (MOE_EP_INIT_TIMEOUT_S)" in done.stderr
    assert "stuck_in_nvshmem" in done.stderr  # the stacks show where it waited


def test_a_step_within_the_timeout_returns_or_raises_as_it_would() -> None:
    from moe_ep.ops.backends.cuda_low_latency import run_within_timeout

    calls = []
    run_within_timeout(lambda: calls.append(1), 30, "a quick step")
    assert calls == [1]

    def fails() -> None:
        raise RuntimeError("nvshmemx_init_attr failed")

    with pytest.raises(RuntimeError, match="nvshmemx_init_attr failed"):
        run_within_timeout(fails, 30, "a failing step")
