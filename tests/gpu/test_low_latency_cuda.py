"""CUDA low-latency mode (NVSHMEM kernels) against the torch backend on the same inputs, at 2-4 ranks (8
with 8 GPUs): a GPU per rank over NCCL where the machine has enough GPUs, else several NVSHMEM PEs sharing
a GPU over gloo. NVSHMEM maps PEs of one GPU into each other like peers over NVLink, so both transports
(direct stores, NVSHMEM puts) run there too; such runs check correctness, never speed.

Every rank runs both backends on identical inputs and compares, per local expert, the set of
(source rank, token) rows received with their data and scales bit for bit, `recv_count`, the counts of
`layout_range` and the cumulative statistics; then both combine the same fake expert outputs and must
agree bit for bit (per-rank partial sums, docs/semantics.md). Hook and non-hook modes, FP8 / round_scale / UE8M0 / BF16, zero-copy, `out=`,
masked slots, CUDA-graph replay with new data, a repeated-seed pressure test and a missing peer.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, replace
import pytest
import torch
import torch.distributed as dist

from moe_ep.ops import fp8
from moe_ep.ops.backends.base import LowLatencyDispatchResult
from moe_ep.ops.backends.cuda_low_latency import LowLatencyRuntime, low_latency_available
from moe_ep.ops.backends.torch_backend import TorchBackend
from moe_ep.ops.config import low_latency_buffer_bytes
from moe_ep.ops.requests import LowLatencyCombineRequest, LowLatencyDispatchRequest
from moe_ep.ops.routing import expand_blocks, unpack_layout_range
from dist_pool import DistPool, gpu_pool_backend, gpu_worlds
from reference import make_inputs, tokens_for
from test_buffer_low_latency import Case

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or not low_latency_available(),
                               reason="needs CUDA GPUs and the moe_ep._low_latency extension (built with NVSHMEM)")


def gpu_case(name: str, **fields: object) -> Case:
    """A case of the CPU test's table, defaulting to FP8, hidden 2048 and top-8 on GPUs."""
    return Case(name, **{"hidden": 2048, "topk": 8, "use_fp8": True, **fields})


CASES = [
    gpu_case("bf16_h128_top1", hidden=128, topk=1, use_fp8=False),
    gpu_case("fp8_h2048_top8"),
    gpu_case("fp8_round_h2944_top8_hook", hidden=2944, round_scale=True, hook=True),
    gpu_case("ue8m0_h2944_top1", hidden=2944, topk=1, round_scale=True, use_ue8m0=True, tokens=(5, 7, 3, 6),
             max_tokens=8),
    gpu_case("ue8m0_h7168_top8_hook_zero_copy", hidden=7168, round_scale=True, use_ue8m0=True, hook=True,
             zero_copy=True),
    gpu_case("bf16_h8192_top16_out", hidden=8192, topk=16, experts_per_rank=5, use_fp8=False, use_out=True),
    gpu_case("fp8_h7168_top16_skewed_empty_rank", hidden=7168, topk=16, experts_per_rank=5, routing="skewed",
             tokens=(12, 0, 7, 16), max_tokens=16, hook=True, use_out=True),
    gpu_case("fp8_h7168_decode_shape", hidden=7168, tokens=(128, 128, 128, 128), max_tokens=128,
             experts_per_rank=64),
]
# Most PEs put on one GPU: each holds its own NVSHMEM heap and CUDA context, and their kernels take turns.
MOST_SHARING = 4

_runtimes: dict[int, LowLatencyRuntime] = {}


def _cuda_runtime(rank: int, world: int, cases: list[Case] = CASES) -> LowLatencyRuntime:
    """One symmetric buffer per worker process, sized for `cases` at this world size, serves every case of
    the process (changing sizes cleans it). Sized per world, not for the largest world: ranks sharing a
    GPU each hold one, and the decode shape alone needs 2.6 GB per rank at 8 ranks."""
    if world not in _runtimes:
        num_bytes = max(low_latency_buffer_bytes(c.max_tokens, c.hidden, world, c.experts_per_rank * world)
                        for c in cases)
        _runtimes[world] = LowLatencyRuntime(dist.group.WORLD, rank, world, num_bytes)
    return _runtimes[world]


# ------------------------------------------------------------------ one round trip on one backend


def _dispatch(backend, inputs, c: Case, num_experts: int, max_tokens: int):
    stats = torch.zeros(num_experts // dist.get_world_size(), dtype=torch.int32, device="cuda")
    wait_ns = torch.zeros(dist.get_world_size(), dtype=torch.int64, device="cuda")
    result, hook = backend.low_latency_dispatch(LowLatencyDispatchRequest(
        inputs.x, inputs.topk_idx, max_tokens, num_experts, stats, wait_ns, c.use_fp8, c.round_scale, c.use_ue8m0,
        c.hook))
    assert (hook is not None) == c.hook
    if hook is not None:
        hook()
    return result, stats, wait_ns


def _expert_outputs(result: LowLatencyDispatchResult, rank: int) -> torch.Tensor:
    """The fake experts applied to every packed row (a function of the row alone, so any row order works)."""
    num_local, slots, hidden = result.recv_x.shape
    rows = result.recv_x.reshape(-1, hidden)
    if result.recv_x_scales is not None:
        rows = fp8.per_token_cast_back(rows, result.recv_x_scales.reshape(num_local * slots, -1))
    rows = rows.view(num_local, slots, hidden).float()
    scale = 1 + (rank * num_local + torch.arange(num_local, device=rows.device)) / 16
    return (rows * scale[:, None, None] - 0.25).to(torch.bfloat16)


def _combine(backend, inputs, result: LowLatencyDispatchResult, c: Case, rank: int) -> torch.Tensor:
    y = _expert_outputs(result, rank)
    if c.zero_copy:
        backend.get_next_low_latency_combine_buffer(result.handle).copy_(y)
    out = torch.full(inputs.x.shape, float("nan"), dtype=torch.bfloat16, device="cuda") if c.use_out else None
    wait_ns = torch.zeros(dist.get_world_size(), dtype=torch.int64, device="cuda")
    combined, hook = backend.low_latency_combine(LowLatencyCombineRequest(
        y, inputs.topk_idx, inputs.topk_weights, result.handle, c.zero_copy, c.hook, out, wait_ns))
    if hook is not None:
        hook()
    if out is not None:
        assert combined.data_ptr() == out.data_ptr()
    assert (wait_ns >= 0).all()
    return combined


# ------------------------------------------------------------------ comparisons


def _canonical_rows(result: LowLatencyDispatchResult, max_tokens: int) -> tuple[torch.Tensor, ...]:
    """Every valid row of every local expert, experts in order and each expert's rows sorted by their
    (source rank * max_tokens + token) key: (expert, key, data bytes, scale words), gathered at once
    (kernels of ranks sharing a GPU take turns on it, so every small operation and sync is slow there)."""
    count, begin = unpack_layout_range(result.handle.layout_range)  # [El, R]
    num_local, num_ranks = count.shape
    counts = count.flatten()
    rows = expand_blocks(begin.flatten(), counts)
    experts = torch.arange(num_local, device=counts.device).repeat_interleave(num_ranks).repeat_interleave(counts)
    sources = torch.arange(num_ranks, device=counts.device).repeat(num_local).repeat_interleave(counts)
    keys = sources * max_tokens + result.handle.src_info[experts, rows].long()
    order = torch.argsort(experts * (num_ranks * max_tokens) + keys, stable=True)
    experts, rows, keys = experts[order], rows[order], keys[order]
    data = result.recv_x.view(torch.uint8)[experts, rows]  # index bytes: FP8 indexing is not needed
    scales = result.recv_x_scales[experts, rows].contiguous().view(torch.int32) \
        if result.recv_x_scales is not None else torch.empty(0, dtype=torch.int32, device=data.device)
    return experts, keys, data, scales


def _assert_same_dispatch(g: LowLatencyDispatchResult, w: LowLatencyDispatchResult, max_tokens: int) -> None:
    assert torch.equal(g.recv_count, w.recv_count)
    g_count, g_begin = unpack_layout_range(g.handle.layout_range)
    w_count, w_begin = unpack_layout_range(w.handle.layout_range)
    assert torch.equal(g_count, w_count)
    # Not required by the semantics, but the kernels pack source-major in token order like the torch backend.
    assert torch.equal(g_begin, w_begin)
    assert g.recv_x.dtype == w.recv_x.dtype and g.recv_x.shape == w.recv_x.shape
    if w.recv_x_scales is not None:
        assert g.recv_x_scales.dtype == w.recv_x_scales.dtype and g.recv_x_scales.shape == w.recv_x_scales.shape
        assert g.recv_x_scales.stride() == w.recv_x_scales.stride()
    experts, *got = _canonical_rows(g, max_tokens)
    _, *want = _canonical_rows(w, max_tokens)
    for what, got_rows, want_rows in zip(("(source, token) rows", "data bytes", "scales"), got, want):
        if not torch.equal(got_rows, want_rows):
            differs = (got_rows != want_rows).reshape(got_rows.size(0), -1).any(1).nonzero()
            raise AssertionError(f"local expert {int(experts[differs[0, 0]])}: different {what}")


def _assert_same_combine(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit: both backends compute the per-rank partial sums and their sum with the same float32
    operations in the same order (docs/semantics.md)."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    assert not got.isnan().any()
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    worst = int(ulps.max()) if ulps.numel() else 0
    assert worst == 0, f"combine differs in {int((ulps != 0).sum())} of {ulps.numel()} values, by up to {worst} BF16 steps"


def _inputs(c: Case, world: int, rank: int, seed: int):
    num_experts = c.experts_per_rank * world
    inputs = make_inputs(seed, world, tokens_for(c.tokens, world), c.hidden, num_experts, c.topk, routing=c.routing)
    return inputs[rank].to("cuda"), num_experts


def _compare_case(rank: int, world: int, case: dict, seed: int = 1234) -> int:
    c = Case(**case)
    mine, num_experts = _inputs(c, world, rank, seed + world)
    cuda, reference = _cuda_runtime(rank, world), TorchBackend(dist.group.WORLD, rank, world)
    got, got_stats, got_wait = _dispatch(cuda, mine, c, num_experts, c.max_tokens)
    want, want_stats, _ = _dispatch(reference, mine, c, num_experts, c.max_tokens)
    _assert_same_dispatch(got, want, c.max_tokens)
    assert torch.equal(got_stats, want_stats) and torch.equal(got_stats, want.recv_count)
    assert (got_wait >= 0).all()
    _assert_same_combine(_combine(cuda, mine, got, c, rank), _combine(reference, mine, want, c, rank))
    torch.cuda.synchronize()
    return int(got.recv_count.sum())


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(2, 3, 4, 8, most_sharing=MOST_SHARING))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_low_latency_cuda_matches_torch(gpu_pool, world: int, case: Case) -> None:
    received = gpu_pool(world).run(_compare_case, asdict(case), timeout=600)
    assert sum(received) > 0


def _transport(rank: int, world: int) -> tuple[str, str, bool]:
    from moe_ep.ops.backends import cuda_low_latency as module

    runtime = _cuda_runtime(rank, world)
    return module._transport, module._ext().__name__, runtime._runtime.all_peers_mapped


@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() >= 2 and not torch.cuda.can_device_access_peer(0, 1),
                    reason="GPUs 0 and 1 have no peer access")
def test_low_latency_uses_whole_program_module_on_one_host(gpu_pool) -> None:
    """One host with P2P everywhere (or PEs sharing one GPU): the P2P-only module (whole-program kernels)
    is chosen."""
    for transport, module, mapped in gpu_pool(2).run(_transport):
        assert (transport, module, mapped) == ("p2p", "moe_ep._low_latency_p2p", True)


def _compare_cases(rank: int, world: int, cases: list[dict]) -> tuple[str, bool, int]:
    from moe_ep.ops.backends import cuda_low_latency as module

    runtime = _cuda_runtime(rank, world, [Case(**case) for case in cases])
    received = sum(_compare_case(rank, world, case) for case in cases)
    return module._ext().__name__, runtime._runtime.all_peers_mapped, received


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(2, 3, 4, 8, most_sharing=MOST_SHARING))
@pytest.mark.parametrize("transport", ["nvshmem", "nvshmem_puts"])
def test_low_latency_relocatable_module_matches_torch(monkeypatch, transport: str, world: int) -> None:
    """MOE_EP_LOW_LATENCY_TRANSPORT=nvshmem: the relocatable module (NVSHMEM device library) gives the same
    results on the cases that exercise BF16, FP8 with UE8M0, hooks, zero-copy, skew and an empty rank;
    =nvshmem_puts: the same with every peer reached through NVSHMEM puts (the multi-node path)."""
    monkeypatch.setenv("MOE_EP_LOW_LATENCY_TRANSPORT", transport)  # spawned workers inherit it
    names = ("bf16_h128_top1", "ue8m0_h7168_top8_hook_zero_copy", "fp8_h7168_top16_skewed_empty_rank")
    pool = DistPool(world, gpu_pool_backend(world))
    try:
        outcomes = pool.run(_compare_cases, [asdict(c) for c in CASES if c.name in names], timeout=600)
    finally:
        pool.close()
    for module, mapped, received in outcomes:
        assert module == "moe_ep._low_latency" and received > 0
        assert mapped == (transport == "nvshmem")


def test_transport_setting_is_checked(monkeypatch) -> None:
    from moe_ep.ops.settings import reload as reload_settings

    monkeypatch.setenv("MOE_EP_LOW_LATENCY_TRANSPORT", "ibgda")
    with pytest.raises(ValueError, match="MOE_EP_LOW_LATENCY_TRANSPORT"):
        reload_settings()


# ------------------------------------------------------------------ operations in flight


def _two_micro_batches(rank: int, world: int, case: dict) -> int:
    """MoELayer.decode's pattern: both dispatches are sent before either is received, each combine is
    sent before the other micro-batch is received. The second dispatch hook is called first (the
    runtime completes the older receive first); a third dispatch whose hook is never called is
    completed by the next operation."""
    c = Case(**case)
    cuda, reference = _cuda_runtime(rank, world), TorchBackend(dist.group.WORLD, rank, world)
    (a, num_experts), (b, _), (d, _) = (_inputs(c, world, rank, seed) for seed in (21, 22, 23))

    def send(inputs):
        return cuda.low_latency_dispatch(LowLatencyDispatchRequest(
            inputs.x, inputs.topk_idx, c.max_tokens, num_experts, None, None, c.use_fp8, c.round_scale, c.use_ue8m0,
            True))

    def combine_send(inputs, result):
        return cuda.low_latency_combine(LowLatencyCombineRequest(
            _expert_outputs(result, rank), inputs.topk_idx, inputs.topk_weights, result.handle, False, True, None,
            None))

    (got_a, hook_a), (got_b, hook_b) = send(a), send(b)
    hook_b()
    hook_a()  # already completed by hook_b: only orders the stream
    out_a, combine_hook_a = combine_send(a, got_a)
    out_b, combine_hook_b = combine_send(b, got_b)
    combine_hook_a()
    combine_hook_b()
    got_d, _ = send(d)  # its hook is dropped
    after, _, _ = _dispatch(cuda, a, replace(c, hook=False), num_experts, c.max_tokens)
    plain = replace(c, hook=False)
    for inputs, got, out in ((a, got_a, out_a), (b, got_b, out_b), (d, got_d, None), (a, after, None)):
        want, _, _ = _dispatch(reference, inputs, plain, num_experts, c.max_tokens)
        _assert_same_dispatch(got, want, c.max_tokens)
        if out is not None:
            _assert_same_combine(out, _combine(reference, inputs, want, plain, rank))
    return int(got_a.recv_count.sum())


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(2, 4, 8, most_sharing=MOST_SHARING))
def test_low_latency_cuda_two_in_flight(gpu_pool, world: int) -> None:
    case = Case("two_in_flight", hidden=7168, tokens=(48, 33, 48, 40), max_tokens=48, experts_per_rank=8)
    assert sum(gpu_pool(world).run(_two_micro_batches, asdict(case), timeout=600)) > 0


# ------------------------------------------------------------------ CUDA graphs


def _graph_replay(rank: int, world: int, case: dict) -> int:
    """Capture dispatch + experts + combine once, replay with new tokens and routing each time."""
    c = Case(**case)
    cuda, reference = _cuda_runtime(rank, world), TorchBackend(dist.group.WORLD, rank, world)
    first, num_experts = _inputs(c, world, rank, 0)
    static = type(first)(first.x.clone(), first.topk_idx.clone(), first.topk_weights.clone())
    _dispatch(cuda, static, c, num_experts, c.max_tokens)  # same sizes before capture: no clean is captured
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # the NCCL watchdog thread runs on
        captured, _ = cuda.low_latency_dispatch(LowLatencyDispatchRequest(
            static.x, static.topk_idx, c.max_tokens, num_experts, None, None, c.use_fp8, c.round_scale, c.use_ue8m0,
            False))
        y = _expert_outputs(captured, rank)
        combined, _ = cuda.low_latency_combine(LowLatencyCombineRequest(
            y, static.topk_idx, static.topk_weights, captured.handle, False, False, None, None))
    received = 0
    for seed in (11, 12, 13, 11):
        mine, _ = _inputs(c, world, rank, seed)
        static.x.copy_(mine.x)
        static.topk_idx.copy_(mine.topk_idx)
        static.topk_weights.copy_(mine.topk_weights)
        graph.replay()
        torch.cuda.synchronize()
        want, _, _ = _dispatch(reference, mine, c, num_experts, c.max_tokens)
        _assert_same_dispatch(captured, want, c.max_tokens)
        _assert_same_combine(combined, _combine(reference, mine, want, c, rank))
        received += int(captured.recv_count.sum())
    return received


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(2, 4, 8, most_sharing=MOST_SHARING))
def test_low_latency_cuda_graph_replay(gpu_pool, world: int) -> None:
    case = Case("graph", hidden=7168, tokens=(64, 64, 64, 64), max_tokens=64, experts_per_rank=8, round_scale=True,
                use_ue8m0=True)
    assert sum(gpu_pool(world).run(_graph_replay, asdict(case), timeout=600)) > 0


# ------------------------------------------------------------------ pressure


def _digest(result: LowLatencyDispatchResult, combined: torch.Tensor, max_tokens: int) -> str:
    h = hashlib.sha256()
    for t in _canonical_rows(result, max_tokens):
        h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    h.update(combined.cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _pressure(rank: int, world: int, case: dict, rounds: int) -> int:
    """Rounds cycle through a few seeds back to back; the same seed must give the same bytes every time."""
    c = Case(**case)
    cuda, reference = _cuda_runtime(rank, world), TorchBackend(dist.group.WORLD, rank, world)
    seen: dict[int, str] = {}
    for i in range(rounds):
        seed = i % 5
        mine, num_experts = _inputs(c, world, rank, seed)
        result, _, _ = _dispatch(cuda, mine, replace(c, hook=i % 2 == 1), num_experts, c.max_tokens)
        combined = _combine(cuda, mine, result, replace(c, hook=i % 3 == 1, zero_copy=i % 4 == 0), rank)
        if seed not in seen:  # first time: check against the torch backend too
            want, _, _ = _dispatch(reference, mine, c, num_experts, c.max_tokens)
            _assert_same_dispatch(result, want, c.max_tokens)
            _assert_same_combine(combined, _combine(reference, mine, want, c, rank))
        digest = _digest(result, combined, c.max_tokens)
        assert seen.setdefault(seed, digest) == digest, f"round {i}: seed {seed} gave different bytes"
    return len(seen)


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(3, 4, most_sharing=MOST_SHARING))
def test_low_latency_cuda_repeated_seeds(gpu_pool, world: int) -> None:
    case = Case("pressure", hidden=7168, tokens=(128, 96, 128, 77), max_tokens=128, experts_per_rank=16)
    assert gpu_pool(world).run(_pressure, asdict(case), 40, timeout=900) == [5] * world


# ------------------------------------------------------------------ a missing peer


def _runtime_with_short_timeout(name: str, rank: int, world: int) -> tuple[Case, int, LowLatencyRuntime]:
    """A small case and a runtime whose waits give up after 2 s."""
    c = Case(name, tokens=(8, 8), max_tokens=8, hidden=256, use_fp8=False)
    num_experts = c.experts_per_rank * world
    runtime = LowLatencyRuntime(dist.group.WORLD, rank, world,
                                low_latency_buffer_bytes(c.max_tokens, c.hidden, world, num_experts), timeout_s=2.0)
    return c, num_experts, runtime


def _absent_peer(rank: int, world: int) -> str:
    """Rank 1 never dispatches: rank 0's kernel gives up after the timeout and its next call raises."""
    c, num_experts, runtime = _runtime_with_short_timeout("timeout", rank, world)
    message = ""
    if rank == 0:
        mine, _ = _inputs(c, world, rank, 5)
        runtime.low_latency_dispatch(LowLatencyDispatchRequest(
            mine.x, mine.topk_idx, c.max_tokens, num_experts, None, None, False, False, False, False))
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="gave up") as error:
            runtime.low_latency_dispatch(LowLatencyDispatchRequest(
                mine.x, mine.topk_idx, c.max_tokens, num_experts, None, None, False, False, False, False))
        message = str(error.value)
    dist.barrier()
    runtime.destroy()
    return message


@needs_gpu
def test_low_latency_cuda_missing_peer_times_out(gpu_pool) -> None:
    outcomes = gpu_pool(2).run(_absent_peer, timeout=300)
    assert "peer" in outcomes[0]


def _clean_without_peer(rank: int, world: int) -> tuple[str, str]:
    """Only rank 0 cleans: its barrier gives up, its next call raises; then both ranks destroy, having
    made a different number of barrier calls, and both destroys raise instead of one entering the
    collective free and hanging."""
    c, num_experts, runtime = _runtime_with_short_timeout("clean_timeout", rank, world)
    call_error = ""
    if rank == 0:
        runtime.clean_low_latency_buffer(c.max_tokens, c.hidden, num_experts)
        torch.cuda.synchronize()
        mine, _ = _inputs(c, world, rank, 5)
        with pytest.raises(RuntimeError, match="gave up") as error:
            runtime.low_latency_dispatch(LowLatencyDispatchRequest(
                mine.x, mine.topk_idx, c.max_tokens, num_experts, None, None, False, False, False, False))
        call_error = str(error.value)
    dist.barrier()
    with pytest.raises(RuntimeError, match="destroy gave up") as error:
        runtime.destroy()
    return call_error, str(error.value)


@needs_gpu
def test_low_latency_barriers_time_out(gpu_pool) -> None:
    outcomes = gpu_pool(2).run(_clean_without_peer, timeout=300)
    assert "peer" in outcomes[0][0]
    for _, destroy_error in outcomes:
        assert "not freed" in destroy_error


@needs_gpu
def test_buffer_size_formula_matches_kernels() -> None:
    from moe_ep.ops.backends.cuda_low_latency import _ext

    # 16 ranks: the per-rank words at the start (16 bytes a rank) outgrow one 128-byte line past 8 ranks.
    for sizes in [(1, 128, 2, 2), (128, 7168, 4, 256), (512, 16384, 8, 288), (33, 2944, 3, 9), (16, 1024, 16, 32)]:
        assert _ext().ll_buffer_bytes(*sizes) == low_latency_buffer_bytes(*sizes)


# ------------------------------------------------------------------ receive ordering (no GPU needed)


class _FakeEvent:
    def record(self) -> None:
        pass


class _FakeStream:
    def wait_event(self, event: _FakeEvent) -> None:
        pass


def test_receives_complete_in_send_order(monkeypatch) -> None:
    """At most two operations in flight, receives in send order, each once; new sizes drain everything."""
    from moe_ep.ops.backends import cuda_low_latency as module

    monkeypatch.setattr(module.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(module.torch.cuda, "current_stream", lambda: _FakeStream())
    runtime = object.__new__(module.LowLatencyRuntime)
    runtime._runtime = type("Checked", (), {"check_usable": lambda self: None})()
    runtime._in_flight, runtime._sizes = [], None
    log: list[str] = []

    def op(name: str, hook: bool, sizes: tuple[int, int, int] = (8, 128, 4)):
        phases = {1: "send", 2: "recv", 3: "both"}
        return runtime._run(sizes, lambda p: log.append(f"{name}.{phases[p]}"), hook)

    hook_a, hook_b = op("a", True), op("b", True)
    hook_b()
    hook_a()
    assert log == ["a.send", "b.send", "a.recv", "b.recv"]
    log.clear()
    op("c", True), op("d", True), op("e", True)
    assert log == ["c.send", "d.send", "c.recv", "e.send"]
    log.clear()
    assert op("f", False) is None
    assert log == ["d.recv", "e.recv", "f.both"]
    log.clear()
    op("g", True)
    op("h", True, sizes=(16, 128, 4))
    assert log == ["g.send", "g.recv", "h.send"]

