"""Programs written for DeepEP find moe_ep under the name `deep_ep`, and their DeepEP code runs on it.

- `install_as_deep_ep()` and the `packaging/deep_ep` distribution (what vLLM's workers look for).
- Megatron-core's own `fused_dispatch` / `fused_combine` (forward and backward) and its flex dispatcher's
  `_DeepepManager`, and torchtitan's own DeepEP module, run on CPU ranks (gloo) when those packages are
  installed (`tests/clients-requirements.txt`), against references computed here from the inputs.
- vLLM and SGLang need a GPU to run at all: their exact call sequences (`client_calls.py`) are replayed.
docs/clients.md lists every call and argument of each client.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Iterator, Optional

import pytest
import torch
import torch.distributed as dist

import client_calls
import moe_ep
from moe_ep.ops import fp8
from reference import (RankInputs, combine_reference, dispatch_reference, expert_output, low_latency_combine_reference,
                       low_latency_expert_output, low_latency_reference, make_inputs, owner, tokens_for)

REPO = Path(__file__).resolve().parents[1]
INSTALL_CLIENTS = "python3 -m pip install --no-deps -r tests/clients-requirements.txt"


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


needs_megatron = pytest.mark.skipif(_version("megatron-core") is None,
                                    reason=f"megatron-core is not installed ({INSTALL_CLIENTS})")
needs_torchtitan = pytest.mark.skipif(_version("torchtitan") is None,
                                      reason=f"torchtitan is not installed ({INSTALL_CLIENTS})")


def _seeded(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Random float32 values every rank can rebuild."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-2) -> None:
    """Equal up to `rel` of the largest reference value (BF16 roundings along the way)."""
    assert got.shape == want.shape
    error = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    assert error <= rel * max(want.abs().max().item() if want.numel() else 0.0, 1e-6), error


# ---------------------------------------------------------------------------------------------- the alias


@pytest.fixture
def restore_deep_ep() -> Iterator[None]:
    """Give the test process back the `deep_ep` modules (none, normally) it had before the test."""
    def entries() -> dict[str, ModuleType]:
        return {k: v for k, v in sys.modules.items() if k == "deep_ep" or k.startswith("deep_ep.")}

    saved = entries()
    yield
    for name in entries():
        del sys.modules[name]
    sys.modules.update(saved)


def test_install_as_deep_ep_serves_deepep_v1_names(restore_deep_ep) -> None:
    sys.modules.pop("deep_ep", None)
    module = moe_ep.install_as_deep_ep()
    assert moe_ep.install_as_deep_ep() is module  # a second call changes nothing
    import deep_ep
    import deep_ep.utils
    from deep_ep import Buffer, Config, EventOverlap, topk_idx_t
    from deep_ep.utils import EventHandle
    from deep_ep.utils import EventOverlap as UtilsEventOverlap

    assert deep_ep is module and Buffer is moe_ep.Buffer and Config is moe_ep.Config
    assert EventOverlap is UtilsEventOverlap is moe_ep.EventOverlap and EventHandle is moe_ep.EventHandle
    assert topk_idx_t is moe_ep.topk_idx_t and deep_ep.utils is sys.modules["deep_ep.utils"]
    assert importlib.util.find_spec("deep_ep") is not None  # what vLLM's has_deep_ep() checks first
    # What clients probe for to choose DeepEP V2 or the hybrid-ep branch stays missing, with a clear message.
    assert not hasattr(deep_ep, "ElasticBuffer")
    with pytest.raises(AttributeError, match="DeepEP V2's ElasticBuffer is not provided by moe_ep"):
        deep_ep.ElasticBuffer
    with pytest.raises(ImportError, match="HybridEPBuffer"):
        from deep_ep import HybridEPBuffer  # noqa: F401
    with pytest.raises(TypeError, match="force: expected a bool"):
        moe_ep.install_as_deep_ep(force="yes")


def test_install_as_deep_ep_refuses_an_imported_deep_ep(restore_deep_ep) -> None:
    other = ModuleType("deep_ep")
    sys.modules["deep_ep"] = other
    with pytest.raises(RuntimeError, match="another deep_ep package is imported from.*pass force=True"):
        moe_ep.install_as_deep_ep()
    assert sys.modules["deep_ep"] is other
    assert moe_ep.install_as_deep_ep(force=True) is sys.modules["deep_ep"] is not other


def _run_python(code: str, *path: Path) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with `path` (then this repository) first on its import path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (*path, REPO)))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def test_install_as_deep_ep_never_shadows_an_importable_deep_ep(tmp_path: Path) -> None:
    """A `deep_ep` found on the import path is left alone (and not imported) unless forced."""
    (tmp_path / "deep_ep").mkdir()
    (tmp_path / "deep_ep" / "__init__.py").write_text("raise SystemExit('the other deep_ep was imported')\n")
    result = _run_python("""
        import sys
        import moe_ep
        try:
            moe_ep.install_as_deep_ep()
        except RuntimeError as exc:
            print("refused:", exc)
        else:
            sys.exit("not refused")
        module = moe_ep.install_as_deep_ep(force=True)
        import deep_ep
        assert deep_ep is module and deep_ep.Buffer is moe_ep.Buffer
        print("forced")
    """, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"refused: install_as_deep_ep: another deep_ep package is importable from {tmp_path}" in result.stdout
    assert "forced" in result.stdout


def test_alias_distribution_provides_deep_ep_to_fresh_processes(tmp_path: Path) -> None:
    """`pip install ./packaging/deep_ep` gives every new process a `deep_ep` that is moe_ep."""
    source, target = tmp_path / "source", tmp_path / "site"
    shutil.copytree(REPO / "packaging" / "deep_ep", source)  # the build writes next to its sources
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(target), str(source)], capture_output=True, text=True,
                         timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    result = _run_python(f"""
        import importlib.util
        spec = importlib.util.find_spec("deep_ep")  # how vLLM's worker processes look for DeepEP
        assert spec is not None and spec.origin.startswith({str(target)!r}), spec
        import deep_ep
        from deep_ep.utils import EventHandle, EventOverlap
        import moe_ep
        assert deep_ep.Buffer is moe_ep.Buffer and deep_ep.Config is moe_ep.Config
        assert EventHandle is moe_ep.EventHandle and EventOverlap is moe_ep.EventOverlap
        assert moe_ep.install_as_deep_ep() is deep_ep  # the installed stand-in is no foreign DeepEP
        print("ok")
    """, target)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


def test_runner_installs_the_alias_for_a_script_or_module(tmp_path: Path) -> None:
    """`python -m moe_ep.deep_ep_alias` runs a DeepEP program (script or `-m` module) with its arguments."""
    (tmp_path / "program.py").write_text(textwrap.dedent("""
        import sys
        import deep_ep
        from deep_ep.utils import EventHandle
        import moe_ep
        assert deep_ep.Buffer is moe_ep.Buffer and EventHandle is moe_ep.EventHandle
        print(__name__, sys.argv[1:])
    """))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for launch in (["program.py"], ["-m", "program"]):
        result = subprocess.run([sys.executable, "-m", "moe_ep.deep_ep_alias", *launch, "--flag", "7"], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.strip() == "__main__ ['--flag', '7']"


def test_event_handle_waits_like_deepeps() -> None:
    handle = moe_ep.EventHandle()
    assert (handle.event is None) == (not torch.cuda.is_available())
    handle.current_stream_wait()
    overlap = moe_ep.EventOverlap(moe_ep.EventHandle())
    with overlap:
        pass
    overlap.current_stream_wait()


# ------------------------------------------------------------------------------------------ Megatron-core


def _dispatch_grads(inputs: list[RankInputs], refs: list, me: int, row_grads: list[torch.Tensor],
                    prob_grads: list[torch.Tensor], num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of rank `me`'s tokens and probabilities, written out: each receiving rank's row gradient
    summed back to its source token in float32 in rank order, and each slot's probability gradient taken
    from the rank that holds its expert."""
    per_rank = num_experts // len(inputs)
    mine = inputs[me]
    grad_x = torch.zeros(mine.x.shape)
    grad_probs = torch.zeros(mine.topk_weights.shape)
    for q, ref in enumerate(refs):
        for i, (s, t) in enumerate(ref.rows):
            if s != me:
                continue
            grad_x[t] += row_grads[q][i].float()
            for j, e in enumerate(mine.topk_idx[t].tolist()):
                if e >= 0 and owner(e, per_rank) == q:
                    grad_probs[t, j] = prob_grads[q][i, j]
    return grad_x.to(mine.x.dtype), grad_probs


def _megatron_fused_a2a(rank: int, world: int) -> int:
    """Megatron-core's `fused_dispatch` / `fused_combine`, forward and backward, synchronous and with
    `async_finish` + `allocate_on_comm_stream` (its flex dispatcher's default)."""
    moe_ep.install_as_deep_ep()
    from megatron.core.transformer.moe.fused_a2a import fused_combine, fused_dispatch

    group = dist.group.WORLD
    hidden, per_rank, topk = 256, 3, 4
    num_experts = per_rank * world
    inputs = make_inputs(41 + world, world, tokens_for((17, 9, 24), world), hidden, num_experts, topk)
    refs = [dispatch_reference(inputs, q, num_experts, 1, 1) for q in range(world)]
    ref, mine = refs[rank], inputs[rank]
    row_grads = [_seeded(100 + q, (len(refs[q].rows), hidden)).to(mine.x.dtype) for q in range(world)]
    prob_grads = [_seeded(200 + q, (len(refs[q].rows), topk)) for q in range(world)]
    token_grads = [_seeded(300 + s, tuple(inputs[s].x.shape)).to(mine.x.dtype) for s in range(world)]
    for async_finish in (False, True):
        x = mine.x.clone().requires_grad_()
        probs = mine.topk_weights.clone().requires_grad_()
        recv_x, recv_idx, recv_probs, tokens_per_expert, handle = fused_dispatch(
            x, mine.topk_idx, probs, num_experts, group, async_finish=async_finish,
            allocate_on_comm_stream=async_finish)
        assert torch.equal(recv_x, ref.recv_x) and torch.equal(recv_idx, ref.recv_topk_idx)
        assert torch.equal(recv_probs, ref.recv_topk_weights) and tokens_per_expert.tolist() == ref.per_expert
        # Like Megatron's experts, the loss reads probabilities only at this rank's experts.
        loss = ((recv_x.float() * row_grads[rank].float()).sum()
                + (recv_probs * prob_grads[rank] * (recv_idx >= 0)).sum())
        loss.backward()
        want_x, want_probs = _dispatch_grads(inputs, refs, rank, row_grads, prob_grads, num_experts)
        assert torch.equal(x.grad, want_x) and torch.equal(probs.grad, want_probs)

        expert_out = expert_output(recv_x.detach(), rank).requires_grad_()
        combined, _ = fused_combine(expert_out, group, handle, async_finish=async_finish,
                                    allocate_on_comm_stream=async_finish)
        assert torch.equal(combined, combine_reference(inputs, rank, num_experts)[0])
        (combined.float() * token_grads[rank].float()).sum().backward()
        want_rows = [token_grads[s][t] for s, t in ref.rows]
        assert torch.equal(expert_out.grad, torch.stack(want_rows) if want_rows else torch.zeros_like(recv_x))
    return len(ref.rows)


def _megatron_flex_manager(rank: int, world: int) -> None:
    """Megatron-core's flex dispatcher manager (`_DeepepManager`) in the order MoEFlexTokenDispatcher calls
    it, with toy experts (row * (1 + e/8) * prob), against the dense result on this rank's tokens."""
    moe_ep.install_as_deep_ep()
    from megatron.core.transformer.moe.token_dispatcher import _DeepepManager

    hidden, per_rank, topk = 128, 2, 3
    num_experts = per_rank * world
    inputs = make_inputs(53 + world, world, tokens_for((13, 6, 19), world), hidden, num_experts, topk, mask_prob=0.0)
    mine = inputs[rank]
    # The router's dense outputs: probabilities over all experts, non-zero at the top-k.
    dense_probs = torch.zeros(mine.x.size(0), num_experts).scatter(1, mine.topk_idx, mine.topk_weights + 0.05)
    routing_map = dense_probs > 0
    probs = dense_probs.clone().requires_grad_()
    x = mine.x.clone().requires_grad_()
    config = SimpleNamespace(moe_router_dtype="fp32", moe_expert_capacity_factor=None, moe_permute_fusion=False,
                             moe_deepep_num_sms=20, moe_router_padding_for_quantization=False)
    manager = _DeepepManager(group=dist.group.WORLD, num_local_experts=per_rank, router_topk=topk,
                             num_experts=num_experts, config=config)
    manager.setup_metadata(routing_map, probs)
    received = manager.dispatch(x, async_finish=True, allocate_on_comm_stream=True)
    rows, row_probs = manager.get_permuted_hidden_states_by_experts(received)
    counts = manager.get_number_of_tokens_per_expert()
    expert = torch.repeat_interleave(torch.arange(per_rank), counts) + rank * per_rank
    out = (rows.float() * (1 + expert / 8)[:, None] * row_probs[:, None]).to(rows.dtype)
    restored = manager.get_restored_hidden_states_by_experts(out)
    y = manager.combine(restored, async_finish=True, allocate_on_comm_stream=True)
    weights = _seeded(400 + rank, tuple(y.shape))
    (y.float() * weights).sum().backward()

    x64 = mine.x.double().requires_grad_()
    probs64 = dense_probs.double().requires_grad_()
    want = x64 * (probs64 * (1 + torch.arange(num_experts) / 8)).sum(1, keepdim=True)
    (want * weights.double()).sum().backward()
    _assert_close(y, want.detach())
    _assert_close(x.grad, x64.grad)
    _assert_close(probs.grad[routing_map], probs64.grad[routing_map])
    assert (probs.grad[~routing_map] == 0).all()


@needs_megatron
@pytest.mark.parametrize("world", [2, 3])
def test_megatron_core_deepep_path(dist_pool, world: int) -> None:
    pool = dist_pool(world)
    assert sum(pool.run(_megatron_fused_a2a)) > 0
    pool.run(_megatron_flex_manager)


# --------------------------------------------------------------------------------------------- torchtitan


def _torchtitan_deepep() -> ModuleType:
    """torchtitan's `torchtitan/distributed/deepep/deepep.py`, loaded from its file (the package's
    `__init__` pulls its trainer's dependencies). Its two ops have CUDA kernels only; here the same
    Python functions are registered for CPU as well."""
    name = "_torchtitan_deepep"
    if name not in sys.modules:
        path = importlib.metadata.distribution("torchtitan").locate_file("torchtitan/distributed/deepep/deepep.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module._lib.impl("dispatch", module._dispatch_op_impl, "CPU")
        module._lib.impl("combine", module._combine_op_impl, "CPU")
        sys.modules[name] = module
    return sys.modules[name]


def _torchtitan_dispatch_combine(rank: int, world: int) -> None:
    """torchtitan's `dispatch_tokens` / `combine_tokens` / `sync_combine` with toy experts (row * (1 + e/8)),
    forward and backward, against the dense result on this rank's tokens."""
    moe_ep.install_as_deep_ep()
    deepep = _torchtitan_deepep()
    hidden, per_rank, topk = 128, 2, 3
    num_experts = per_rank * world
    mine = make_inputs(67 + world, world, tokens_for((15, 8, 21), world), hidden, num_experts, topk)[rank]
    # torchtitan's router always names an expert; a dropped pick has score 0 (it masks those to -1 itself).
    dropped = mine.topk_idx < 0
    indices = torch.where(dropped, 0, mine.topk_idx)
    x = mine.x.clone().requires_grad_()
    scores = torch.where(dropped, 0.0, mine.topk_weights).requires_grad_()
    routed, tokens_per_expert, state = deepep.dispatch_tokens(x, indices, scores, per_rank, num_experts,
                                                              dist.group.WORLD, score_before_experts=True)
    expert = torch.repeat_interleave(torch.arange(per_rank), tokens_per_expert) + rank * per_rank
    y = deepep.combine_tokens((routed.float() * (1 + expert / 8)[:, None]).to(routed.dtype), state)
    deepep.sync_combine()
    weights = _seeded(500 + rank, tuple(y.shape))
    (y.float() * weights).sum().backward()

    x64 = mine.x.double().requires_grad_()
    scores64 = scores.detach().double().requires_grad_()
    want = x64 * (scores64 * (1 + indices / 8)).sum(1, keepdim=True)
    (want * weights.double()).sum().backward()
    _assert_close(y, want.detach())
    _assert_close(x.grad, x64.grad)
    _assert_close(scores.grad[~dropped], scores64.grad[~dropped])
    assert (scores.grad[dropped] == 0).all()


@needs_torchtitan
@pytest.mark.parametrize("world", [2, 3])
def test_torchtitan_deepep_path(dist_pool, world: int) -> None:
    dist_pool(world).run(_torchtitan_dispatch_combine)


# --------------------------------------------------------------------------------------------------- vLLM


def _vllm_high_throughput(rank: int, world: int) -> None:
    """vLLM's DeepEP high-throughput manager and prepare/finalize: BF16 tokens with a synchronous finalize,
    block-FP8 tokens with an asynchronous one; its experts reduce each received row's local top-k."""
    deep_ep = moe_ep.install_as_deep_ep()
    hidden, per_rank, topk = 256, 3, 4
    num_experts = per_rank * world
    inputs = make_inputs(71 + world, world, tokens_for((14, 22, 7), world), hidden, num_experts, topk, mask_prob=0.0)
    mine, ref = inputs[rank], dispatch_reference(inputs, rank, num_experts, 1, 1)
    buffer = client_calls.vllm_ht_buffer(deep_ep, dist.group.WORLD)
    for block_fp8 in (False, True):
        tokens, scales = fp8.per_token_cast_to_fp8(mine.x) if block_fp8 else (mine.x, None)
        expert_x, expert_x_scale, counts, topk_ids, topk_weights, handle = client_calls.vllm_ht_prepare(
            deep_ep, buffer, tokens, scales, mine.topk_idx, mine.topk_weights, num_experts, rank * per_rank, world)
        assert counts == ref.per_expert and torch.equal(topk_weights, ref.recv_topk_weights)
        local = ref.recv_topk_idx >= 0
        assert torch.equal(topk_ids, torch.where(local, ref.recv_topk_idx + rank * per_rank,
                                                 num_experts - 1 if rank == 0 else 0))
        if block_fp8:
            want_q, want_scales = fp8.per_token_cast_to_fp8(ref.recv_x)
            assert torch.equal(expert_x.view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(expert_x_scale, want_scales)
            rows = fp8.per_token_cast_back(expert_x, expert_x_scale)
        else:
            assert expert_x_scale is None and torch.equal(expert_x, ref.recv_x)
            rows = expert_x
        factor = (topk_weights * (1 + topk_ids / 16) * local).sum(1, keepdim=True)
        output = torch.full_like(mine.x, float("nan"))
        client_calls.vllm_ht_finalize(deep_ep, buffer, handle, (rows.float() * factor).to(torch.bfloat16), output,
                                      world, do_async=block_fp8)
        seen = fp8.per_token_cast_back(tokens, scales) if block_fp8 else mine.x
        want = seen.double() * (mine.topk_weights.double() * (1 + mine.topk_idx / 16)).sum(1, keepdim=True)
        _assert_close(output, want)
    buffer.destroy()  # the manager's destroy()


def _vllm_low_latency(rank: int, world: int) -> None:
    """vLLM's DeepEP low-latency manager and prepare/finalize: BF16, FP8 (dequantized by vLLM's own
    `dequant_fp8`) and FP8 with UE8M0 scales; exact against the combine's written-out formula."""
    deep_ep = moe_ep.install_as_deep_ep()
    hidden, per_rank, topk, max_tokens = 2048, 2, 3, 8  # 2048: the smallest of vLLM's low-latency hidden sizes
    num_experts = per_rank * world
    inputs = make_inputs(83 + world, world, tokens_for((5, 8, 3), world), hidden, num_experts, topk, mask_prob=0.0)
    mine, ref = inputs[rank], low_latency_reference(inputs, rank, num_experts)
    # vLLM's fault tolerance: elastic mode, whose mask it queries and cleans.
    tolerant = client_calls.vllm_ll_buffer(deep_ep, dist.group.WORLD, max_tokens, hidden, world, num_experts,
                                           per_rank, enable_fault_tolerance=True)
    mask = torch.full((world,), -1, dtype=torch.int32)
    tolerant.low_latency_query_mask_buffer(mask)
    assert mask.tolist() == [0] * world
    assert tolerant.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).numel() == tolerant.num_rdma_bytes
    tolerant.low_latency_clean_mask_buffer()
    tolerant.destroy()
    buffer = client_calls.vllm_ll_buffer(deep_ep, dist.group.WORLD, max_tokens, hidden, world, num_experts, per_rank)
    for use_fp8, ue8m0 in ((False, False), (True, False), (True, True)):
        expert_x, expert_num_tokens, handle = client_calls.vllm_ll_prepare(buffer, mine.x, mine.topk_idx, max_tokens,
                                                                           num_experts, use_fp8, ue8m0)
        assert expert_num_tokens.tolist() == ref.recv_count
        if use_fp8 and not ue8m0:
            rows = client_calls.vllm_dequant_fp8(*expert_x).to(torch.bfloat16)
        elif use_fp8:
            rows = torch.stack([fp8.per_token_cast_back(q, s) for q, s in zip(*expert_x)])
        else:
            rows = expert_x
        fused = torch.zeros(rows.shape, dtype=torch.bfloat16)
        for e, n in enumerate(ref.recv_count):
            fused[e, :n] = low_latency_expert_output(rows[e, :n], rank * per_rank + e)
        output = torch.full_like(mine.x, float("nan"))
        client_calls.vllm_ll_finalize(buffer, handle, fused, mine.topk_idx, mine.topk_weights, output,
                                      do_async=use_fp8)
        seen = fp8.per_token_cast_back(*fp8.per_token_cast_to_fp8(mine.x, ue8m0, ue8m0)) if use_fp8 else mine.x
        want = low_latency_combine_reference(inputs, rank, num_experts,
                                             lambda t, j, e: low_latency_expert_output(seen[t:t + 1], e)[0])
        assert torch.equal(output, want)
    buffer.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_vllm_call_sequences(dist_pool, world: int) -> None:
    pool = dist_pool(world)
    pool.run(_vllm_high_throughput)
    pool.run(_vllm_low_latency)


# ------------------------------------------------------------------------------------------------- SGLang


def _sglang_auto_mode(rank: int, world: int) -> None:
    """SGLang's DeepEP dispatcher with `--deepep-mode auto` and a `--deepep-config`: one buffer, a prefill
    in normal mode (FP8 tokens, experts aligned to 128 rows as for DeepGEMM), then decode in low-latency
    mode (FP8, receive hooks)."""
    deep_ep = moe_ep.install_as_deep_ep()
    hidden, per_rank, topk, max_tokens = 256, 2, 3, 16
    num_experts = per_rank * world
    configs = client_calls.sglang_configs(deep_ep, client_calls.SGLANG_DEEPEP_CONFIG)
    # SGLang passes use_fabric=True on machines with multi-node NVLink, which moe_ep does not support yet.
    with pytest.raises(ValueError, match="use_fabric: fabric memory handles"):
        client_calls.sglang_buffer_auto_mode(deep_ep, dist.group.WORLD, hidden, 2, max_tokens, num_experts, configs,
                                             use_fabric=True)
    buffer = client_calls.sglang_buffer_auto_mode(deep_ep, dist.group.WORLD, hidden, 2, max_tokens, num_experts,
                                                  configs, use_fabric=False)

    inputs = make_inputs(97 + world, world, tokens_for((11, 30, 4), world), hidden, num_experts, topk, mask_prob=0.0)
    mine, ref = inputs[rank], dispatch_reference(inputs, rank, num_experts, 128, 1)
    recv_x, recv_ids, recv_weights, counts, handle = client_calls.sglang_normal_dispatch(
        deep_ep, buffer, fp8.per_token_cast_to_fp8(mine.x), mine.topk_idx, mine.topk_weights, num_experts, configs[0],
        expert_alignment=128)
    assert counts == ref.per_expert and all(c % 128 == 0 for c in counts)
    assert torch.equal(recv_ids, ref.recv_topk_idx) and torch.equal(recv_weights, ref.recv_topk_weights)
    want_q, want_scales = fp8.per_token_cast_to_fp8(ref.recv_x)
    assert torch.equal(recv_x[0].view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(recv_x[1], want_scales)
    expert_out = expert_output(fp8.per_token_cast_back(*recv_x), rank)
    combined = client_calls.sglang_normal_combine(deep_ep, buffer, expert_out, handle, configs[1])
    seen = [RankInputs(fp8.per_token_cast_back(*fp8.per_token_cast_to_fp8(i.x)), i.topk_idx, i.topk_weights)
            for i in inputs]
    assert torch.equal(combined, combine_reference(seen, rank, num_experts)[0])

    client_calls.sglang_switch_to_low_latency(buffer, max_tokens, hidden, num_experts)
    inputs = make_inputs(101 + world, world, tokens_for((5, 16, 2), world), hidden, num_experts, topk, mask_prob=0.0)
    mine, ref = inputs[rank], low_latency_reference(inputs, rank, num_experts)
    (recv, scales), recv_count, expected_m, handle = client_calls.sglang_low_latency_dispatch(
        buffer, mine.x, mine.topk_idx, max_tokens, num_experts, use_fp8=True, return_recv_hook=True)
    assert recv_count.tolist() == ref.recv_count and expected_m >= 1
    expert_out = torch.zeros(recv.shape, dtype=torch.bfloat16)
    for e, n in enumerate(ref.recv_count):
        expert_out[e, :n] = low_latency_expert_output(fp8.per_token_cast_back(recv[e, :n], scales[e, :n]),
                                                      rank * per_rank + e)
    combined = client_calls.sglang_low_latency_combine(buffer, expert_out, mine.topk_idx, mine.topk_weights, handle,
                                                       return_recv_hook=True)
    seen = fp8.per_token_cast_back(*fp8.per_token_cast_to_fp8(mine.x))
    assert torch.equal(combined, low_latency_combine_reference(
        inputs, rank, num_experts, lambda t, j, e: low_latency_expert_output(seen[t:t + 1], e)[0]))
    # Single-batch overlap passes arguments of SGLang's DeepEP fork, which moe_ep refuses by name.
    with pytest.raises(TypeError, match="overlap"):
        client_calls.sglang_low_latency_combine(buffer, expert_out, mine.topk_idx, mine.topk_weights, handle,
                                                return_recv_hook=True, overlap=None, packed_recv_count=recv_count)


@pytest.mark.parametrize("world", [2, 3])
def test_sglang_call_sequence(dist_pool, world: int) -> None:
    dist_pool(world).run(_sglang_auto_mode)
