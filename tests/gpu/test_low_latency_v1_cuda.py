"""DeepEP V1 features of the CUDA low-latency mode against the torch backend on the same inputs: elastic
mode (ranks masked by hand; a rank that starts an operation late is masked by timeout while the others
finish without it, and rejoins once unmasked; a clean without one rank masks it), the LogFMT-10 combine
(its encoding bit for bit, the combine equal to the torch backend's), the Buffer's mask API and its
buffer views. Worlds of 2-4 ranks: a GPU per rank over NCCL where there are enough GPUs, else NVSHMEM
PEs sharing a GPU over gloo (correctness, not speed), as in test_low_latency_cuda.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.ops import fp8, logfmt
from moe_ep.ops.backends.base import LowLatencyDispatchResult
from moe_ep.ops.backends.cuda_low_latency import LowLatencyRuntime
from moe_ep.ops.backends.torch_backend import TorchBackend
from moe_ep.ops.config import low_latency_buffer_bytes
from moe_ep.ops.requests import LowLatencyCombineRequest
from dist_pool import DistPool, gpu_pool_backend, gpu_worlds
from test_buffer_low_latency import Case
from test_logfmt import _rows
from test_low_latency_cuda import (CASES, MOST_SHARING, _assert_same_combine, _assert_same_dispatch, _combine,
                                   _dispatch, _inputs, needs_gpu)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ELASTIC_CASES = [c for c in CASES if c.name in ("bf16_h128_top1", "fp8_round_h2944_top8_hook",
                                                "ue8m0_h7168_top8_hook_zero_copy", "bf16_h8192_top16_out")]
MASKED = {2: [1], 3: [0], 4: [1, 3]}  # ranks masked by hand, per world size

_runtimes: dict[int, LowLatencyRuntime] = {}


def _elastic_runtime(rank: int, world: int) -> LowLatencyRuntime:
    """One elastic-mode symmetric buffer per worker process and world, sized for ELASTIC_CASES."""
    if world not in _runtimes:
        num_bytes = max(low_latency_buffer_bytes(c.max_tokens, c.hidden, world, c.experts_per_rank * world)
                        for c in ELASTIC_CASES)
        _runtimes[world] = LowLatencyRuntime(dist.group.WORLD, rank, world, num_bytes, shrink=True)
    return _runtimes[world]


def _set_masks(backends: tuple, masked: list[int]) -> None:
    for backend in backends:
        backend.rank_mask().zero_()
        for r in masked:
            backend.rank_mask()[r] = 1


def _compare(cuda: LowLatencyRuntime, reference: TorchBackend, c: Case, rank: int, world: int, seed: int) -> int:
    """One dispatch and combine on both backends (whatever their masks), equal bit for bit."""
    mine, num_experts = _inputs(c, world, rank, seed)
    got, got_stats, got_wait = _dispatch(cuda, mine, c, num_experts, c.max_tokens)
    want, want_stats, _ = _dispatch(reference, mine, c, num_experts, c.max_tokens)
    _assert_same_dispatch(got, want, c.max_tokens)
    assert torch.equal(got_stats, want_stats) and (got_wait >= 0).all()
    _assert_same_combine(_combine(cuda, mine, got, c, rank), _combine(reference, mine, want, c, rank))
    torch.cuda.synchronize()
    return int(got.recv_count.sum())


# ------------------------------------------------------------------ ranks masked by hand


def _masked_by_hand(rank: int, world: int, cases: list[dict], masked: list[int]) -> tuple[int, int]:
    """Every case with `masked` masked on every rank, then unmasked: equal to the torch backend each time."""
    cuda, reference = _elastic_runtime(rank, world), TorchBackend(dist.group.WORLD, rank, world)
    without = full = 0
    for i, case in enumerate(cases):
        c = Case(**case)
        _set_masks((cuda, reference), masked)
        without += _compare(cuda, reference, c, rank, world, 600 + i)
        _set_masks((cuda, reference), [])
        full += _compare(cuda, reference, c, rank, world, 600 + i)
    return without, full


def _check_masked_outcomes(outcomes: list[tuple[int, int]], masked: list[int]) -> None:
    for rank, (without, full) in enumerate(outcomes):
        assert without <= full
        if rank in masked:
            assert without == 0  # a masked rank receives nothing
    assert 0 < sum(w for w, _ in outcomes) < sum(f for _, f in outcomes)


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(2, 3, 4, most_sharing=MOST_SHARING))
def test_masked_ranks_match_torch(gpu_pool, world: int) -> None:
    masked = MASKED[world]
    outcomes = gpu_pool(world).run(_masked_by_hand, [asdict(c) for c in ELASTIC_CASES], masked, timeout=600)
    _check_masked_outcomes(outcomes, masked)


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(3, most_sharing=MOST_SHARING))
def test_masks_and_logfmt_match_torch_over_nvshmem_puts(monkeypatch, world: int) -> None:
    """Masks by hand and the LogFMT combine over NVSHMEM puts to every peer (the multi-node path)."""
    monkeypatch.setenv("MOE_EP_LOW_LATENCY_TRANSPORT", "nvshmem_puts")  # spawned workers inherit it
    pool = DistPool(world, gpu_pool_backend(world))
    try:
        cases = [asdict(c) for c in ELASTIC_CASES if c.name in ("bf16_h128_top1", "ue8m0_h7168_top8_hook_zero_copy")]
        outcomes = pool.run(_masked_by_hand, cases, MASKED[world], timeout=600)
        logfmt_outcomes = pool.run(_logfmt_combines, [asdict(c) for c in LOGFMT_CASES], timeout=600)
    finally:
        pool.close()
    _check_masked_outcomes(outcomes, MASKED[world])
    _check_logfmt_outcomes(logfmt_outcomes)


# ------------------------------------------------------------------ LogFMT-10


def _logfmt_modules() -> list:
    names = ("moe_ep._low_latency_p2p", "moe_ep._low_latency")
    return [pytest.param(name, marks=() if importlib.util.find_spec(name) else pytest.mark.skip(reason="not built"))
            for name in names]


@needs_gpu
@pytest.mark.parametrize("module", _logfmt_modules())
@pytest.mark.parametrize("hidden", [128, 1408, 7168, 8192])
def test_logfmt_kernels_match_the_python_format(module: str, hidden: int) -> None:
    """The kernels' encoder writes the bytes moe_ep.ops.logfmt writes, and decodes them to the same BF16."""
    ext = importlib.import_module(module)
    rows = _rows(hidden, 6, hidden)
    want = logfmt.encode(rows)
    wire, compact, nbytes = ext.ll_logfmt_encode(rows.cuda())
    assert torch.equal(compact.cpu().bool(), want.compact) and torch.equal(nbytes.cpu().long(), want.nbytes)
    assert torch.equal(wire.cpu(), want.wire)
    decoded = ext.ll_logfmt_decode(want.wire.cuda(), want.compact.int().cuda(), hidden)
    assert torch.equal(decoded.cpu().view(torch.int16),
                       logfmt.decode(want.wire, want.compact, hidden).view(torch.int16))


LOGFMT_CASES = [
    Case("logfmt_h7168_top8_hook_out", hidden=7168, topk=8, use_fp8=True, hook=True, use_out=True),
    Case("logfmt_h2048_top16_skewed", hidden=2048, topk=16, experts_per_rank=5, routing="skewed",
         tokens=(12, 0, 7, 16), max_tokens=16),
    Case("logfmt_h8192_top4", hidden=8192, topk=4),
]


def _small_expert_outputs(result: LowLatencyDispatchResult, rank: int) -> torch.Tensor:
    """Fake experts whose outputs have expert-output magnitudes (mostly below 1, a wide range): most
    blocks of the partial rows travel encoded."""
    num_local, slots, hidden = result.recv_x.shape
    rows = result.recv_x.reshape(-1, hidden)
    if result.recv_x_scales is not None:
        rows = fp8.per_token_cast_back(rows, result.recv_x_scales.reshape(num_local * slots, -1))
    rows = rows.view(num_local, slots, hidden).float()
    scale = (1 + (rank * num_local + torch.arange(num_local, device=rows.device)) / 16) / 64
    return (rows * scale[:, None, None]).to(torch.bfloat16)


def _logfmt_combine(backend, inputs, result: LowLatencyDispatchResult, c: Case, use_logfmt: bool) -> torch.Tensor:
    y = _small_expert_outputs(result, dist.get_rank())
    out = torch.full(inputs.x.shape, float("nan"), dtype=torch.bfloat16, device="cuda") if c.use_out else None
    combined, hook = backend.low_latency_combine(LowLatencyCombineRequest(
        y, inputs.topk_idx, inputs.topk_weights, result.handle, False, c.hook, out, None, use_logfmt))
    if hook is not None:
        hook()
    return combined


def _logfmt_combines(rank: int, world: int, cases: list[dict]) -> list[tuple[float, bool]]:
    """Each case's LogFMT combine equals the torch backend's bit for bit, and stays close to the BF16
    combine (returns its relative error and whether it differs at all)."""
    num_bytes = max(low_latency_buffer_bytes(c["max_tokens"], c["hidden"], world, c["experts_per_rank"] * world)
                    for c in cases)
    cuda = LowLatencyRuntime(dist.group.WORLD, rank, world, num_bytes)
    reference = TorchBackend(dist.group.WORLD, rank, world)
    outcomes = []
    for i, case in enumerate(cases):
        c = Case(**case)
        mine, num_experts = _inputs(c, world, rank, 800 + i)
        got, _, _ = _dispatch(cuda, mine, c, num_experts, c.max_tokens)
        want, _, _ = _dispatch(reference, mine, c, num_experts, c.max_tokens)
        _assert_same_dispatch(got, want, c.max_tokens)
        encoded = _logfmt_combine(cuda, mine, got, c, True)
        _assert_same_combine(encoded, _logfmt_combine(reference, mine, want, c, True))
        plain = _logfmt_combine(cuda, mine, got, c, False)
        torch.cuda.synchronize()
        error = float((encoded.float() - plain.float()).norm() / plain.float().norm().clamp(min=1e-30))
        outcomes.append((error, not torch.equal(encoded, plain)))
    torch.cuda.synchronize()
    cuda.destroy()
    return outcomes


def _check_logfmt_outcomes(outcomes: list[list[tuple[float, bool]]]) -> None:
    for per_rank in outcomes:
        assert all(error < 1e-2 for error, _ in per_rank), per_rank
    assert all(any(per_rank[i][1] for per_rank in outcomes) for i in range(len(outcomes[0])))


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(2, 4, most_sharing=MOST_SHARING))
def test_logfmt_combine_matches_torch(gpu_pool, world: int) -> None:
    _check_logfmt_outcomes(gpu_pool(world).run(_logfmt_combines, [asdict(c) for c in LOGFMT_CASES], timeout=600))


# ------------------------------------------------------------------ a rank that comes late

TIMEOUT_S = 3.0
LATE = 1
LATE_CASE = Case("late", tokens=(24, 17, 30, 9), max_tokens=32, hidden=1024, experts_per_rank=4, topk=4, use_fp8=True,
                 round_scale=True)


def _late_rank(rank: int, world: int) -> tuple[float, list[int]]:
    """Rank LATE starts a dispatch and its combine 2.5 timeouts late: the others' waits time out, mask it
    and finish without it, equal to the torch backend with LATE masked; the late rank finishes too (its
    own waits mask the others). Unmasked everywhere afterwards, the next round is whole again."""
    c = LATE_CASE
    num_experts = c.experts_per_rank * world
    runtime = LowLatencyRuntime(dist.group.WORLD, rank, world,
                                low_latency_buffer_bytes(c.max_tokens, c.hidden, world, num_experts),
                                timeout_s=TIMEOUT_S, shrink=True)
    reference = TorchBackend(dist.group.WORLD, rank, world)
    _compare(runtime, reference, c, rank, world, 71)  # everyone on time

    mine, _ = _inputs(c, world, rank, 72)
    if rank == LATE:
        time.sleep(2.5 * TIMEOUT_S)
    start = time.monotonic()
    got, _, _ = _dispatch(runtime, mine, c, num_experts, c.max_tokens)
    got_out = _combine(runtime, mine, got, c, rank)
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    runtime.check_usable()  # the timeouts masked the peer instead of failing
    status = runtime.rank_mask().tolist()

    _set_masks((reference,), [LATE])  # every rank takes part in the torch backend's collectives
    want, _, _ = _dispatch(reference, mine, c, num_experts, c.max_tokens)
    want_out = _combine(reference, mine, want, c, rank)
    if rank != LATE:
        _assert_same_dispatch(got, want, c.max_tokens)
        _assert_same_combine(got_out, want_out)

    dist.barrier()  # the late rank has finished: every rank issued the same operations
    _set_masks((runtime, reference), [])
    assert _compare(runtime, reference, c, rank, world, 73) > 0
    torch.cuda.synchronize()
    runtime.destroy()
    return elapsed, status


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(3, most_sharing=MOST_SHARING))
def test_late_rank_is_masked_by_timeout(gpu_pool, world: int) -> None:
    outcomes = gpu_pool(world).run(_late_rank, timeout=300)
    for rank, (elapsed, status) in enumerate(outcomes):
        if rank != LATE:
            assert status == [int(r == LATE) for r in range(world)]
            # It waited for the late rank's counts one timeout, and finished before that rank even started.
            assert 0.9 * TIMEOUT_S <= elapsed < 2.5 * TIMEOUT_S, elapsed


def _clean_without_one(rank: int, world: int) -> tuple[float, list[int]]:
    """Every rank but the last cleans: their barrier masks the absent rank instead of failing, and a round
    among them equals the torch backend with it masked. The destroys then refuse (the absent rank made
    one barrier call fewer)."""
    c = replace(LATE_CASE, name="clean_without_one", use_fp8=False, round_scale=False)
    num_experts = c.experts_per_rank * world
    runtime = LowLatencyRuntime(dist.group.WORLD, rank, world,
                                low_latency_buffer_bytes(c.max_tokens, c.hidden, world, num_experts),
                                timeout_s=2.0, shrink=True)
    absent = world - 1
    mine, _ = _inputs(c, world, rank, 91)
    elapsed, status = 0.0, []
    if rank != absent:
        start = time.monotonic()
        runtime.clean_low_latency_buffer(c.max_tokens, c.hidden, num_experts)
        torch.cuda.synchronize()
        elapsed = time.monotonic() - start
        runtime.check_usable()
        status = runtime.rank_mask().tolist()
        got, _, _ = _dispatch(runtime, mine, c, num_experts, c.max_tokens)
        got_out = _combine(runtime, mine, got, c, rank)
        torch.cuda.synchronize()
    dist.barrier()
    reference = TorchBackend(dist.group.WORLD, rank, world)
    _set_masks((reference,), [absent])
    want, _, _ = _dispatch(reference, mine, c, num_experts, c.max_tokens)
    want_out = _combine(reference, mine, want, c, rank)
    if rank != absent:
        _assert_same_dispatch(got, want, c.max_tokens)
        _assert_same_combine(got_out, want_out)
    with pytest.raises(RuntimeError, match="destroy gave up"):
        runtime.destroy()
    return elapsed, status


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(3, most_sharing=MOST_SHARING))
def test_clean_masks_an_absent_rank(gpu_pool, world: int) -> None:
    # Everything here takes seconds (2 s timeouts); a hang is reported with every rank's stacks.
    outcomes = gpu_pool(world).run(_clean_without_one, timeout=90)
    for elapsed, status in outcomes[:-1]:
        assert status == [0] * (world - 1) + [1]
        assert 1.8 <= elapsed < 10, elapsed


# ------------------------------------------------------------------ the DeepEP-style example


def _deepep_style_example(rank: int, world: int) -> None:
    """examples/deepep_style.py's per-rank program on the CUDA backend (it checks its own results)."""
    sys.path.insert(0, str(EXAMPLES))
    import deepep_style

    deepep_style.run(rank, world, torch.device("cuda", torch.cuda.current_device()),
                     deepep_style.parse_args(["--backend", "cuda"]))


@needs_gpu
def test_deepep_style_example_on_the_cuda_backend(gpu_pool) -> None:
    gpu_pool(2).run(_deepep_style_example, timeout=300)


# ------------------------------------------------------------------ the Buffer's mask API and buffer views


def _buffer_api(rank: int, world: int) -> None:
    hidden, max_tokens, num_experts = 256, 8, 2 * world
    hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, num_experts)
    nvl_bytes = 1 << 20
    buffer = moe_ep.Buffer(dist.group.WORLD, nvl_bytes, hint, low_latency_mode=True, enable_shrink=True,
                           backend="cuda", explicitly_destroy=True)
    status = torch.full((world,), -1, dtype=torch.int32, device="cuda")
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * world
    buffer.low_latency_update_mask_buffer(world - 1, True)
    buffer.low_latency_query_mask_buffer(status)
    host_status = torch.zeros(world, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(host_status)  # the torch backend's copy, masked alike
    assert status.tolist() == host_status.tolist() == [0] * (world - 1) + [1]
    buffer.low_latency_clean_mask_buffer()
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * world

    rdma = buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
    assert rdma.is_cuda and rdma.numel() >= hint
    nvl = buffer.get_local_buffer_tensor(torch.int32, size=torch.Size([16, 4]), offset=128)
    assert nvl.is_cuda and nvl.shape == (16, 4)
    nvl.copy_(torch.arange(64, dtype=torch.int32, device="cuda").view(16, 4) + rank)
    assert torch.equal(buffer.get_local_buffer_tensor(torch.int32, offset=128)[:64].cpu(),
                       torch.arange(64, dtype=torch.int32) + rank)
    # The zero-copy combine buffer lies inside the symmetric buffer.
    x = torch.randn(max_tokens, hidden, device="cuda").to(torch.bfloat16)
    topk_idx = torch.arange(max_tokens, device="cuda").remainder(num_experts).view(-1, 1)
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, max_tokens, num_experts, use_fp8=False)
    combine_buffer = buffer.get_next_low_latency_combine_buffer(handle)
    assert rdma.data_ptr() <= combine_buffer.data_ptr() < rdma.data_ptr() + rdma.numel()
    torch.cuda.synchronize()
    buffer.destroy()


@needs_gpu
def test_buffer_mask_api_and_views(gpu_pool) -> None:
    gpu_pool(2).run(_buffer_api, timeout=300)
