"""The CUDA backend against the torch backend (the oracle) on the same inputs, at 2-8 ranks: a GPU per
rank over NCCL where the machine has enough GPUs, else ranks sharing the GPUs over gloo.

Every output must be bitwise identical: dispatch data, scales, top-k ids and weights, expert counts,
every handle tensor; combine (same float32 summation order) through both of its paths, the staging
area and the rings; cached dispatch; padding.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.ops import fp8, routing
from moe_ep.ops.requests import DispatchRequest
from moe_ep.ops.settings import reload as reload_settings
from dist_pool import DistPool, gpu_worlds
from reference import assert_same_bits, expert_output, make_inputs, tokens_for

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("moe_ep._C") is not None),
    reason="needs a CUDA device and the built moe_ep._C extension")

NVL_BYTES = 1 << 30
EXACT_FIT = -2  # Case.num_worst_extra: num_worst_tokens = the most rows any rank receives
_BUFFERS: dict[str, moe_ep.Buffer] = {}


@dataclass(frozen=True)
class Case:
    name: str
    tokens: tuple[int, ...] = (300, 257, 128, 411)
    hidden: int = 7168
    experts_per_rank: int = 8
    topk: int = 4
    dtype: str = "bfloat16"
    routing: str = "random"
    alignment: int = 1
    num_worst_extra: int = -1  # >= 0: num_worst_tokens = all tokens of the group + this; or EXACT_FIT
    use_fp8: bool = False
    strided_scales: bool = False
    with_weights: bool = True
    with_bias: int = 2
    config: tuple[int, int, int] = (8, 6, 256)  # num_sms, send chunk, ring slots


CASES = [
    Case("bf16_h7168", alignment=4),
    Case("bf16_h2056_odd", hidden=2056, with_bias=1),
    Case("fp32_h36", hidden=36, dtype="float32", config=(4, 3, 32)),
    Case("fp16_h8192", hidden=8192, dtype="float16", with_bias=0),
    Case("fp64_h64", hidden=64, dtype="float64", topk=3),
    Case("bf16_h128_many_sms", hidden=128, config=(24, 4, 64)),
    Case("fp8_h512", hidden=512, use_fp8=True),
    Case("fp8_h7168_strided_scales", use_fp8=True, strided_scales=True),
    Case("skewed_all_to_rank0", routing="skewed", hidden=1024),
    Case("zero_tokens_and_unused_rank", tokens=(23, 0, 31, 0), routing="one_rank_empty", hidden=384),
    Case("topk_32_no_weights", experts_per_rank=16, topk=32, hidden=256, with_weights=False),
    Case("num_worst_tokens", num_worst_extra=7, alignment=2),
    Case("num_worst_tokens_exact_fit", routing="skewed", hidden=512, num_worst_extra=EXACT_FIT),
    Case("fp8_num_worst_tokens", hidden=512, use_fp8=True, num_worst_extra=0),
    Case("tiny_ring_wraps", tokens=(1500, 1300, 1700, 900), hidden=256, config=(4, 2, 8)),
]


def _buffers(group: dist.ProcessGroup) -> tuple[moe_ep.Buffer, moe_ep.Buffer]:
    if "cuda" not in _BUFFERS:
        _BUFFERS["torch"] = moe_ep.Buffer(group, backend="torch")
        _BUFFERS["cuda"] = moe_ep.Buffer(group, NVL_BYTES, backend="cuda")
    return _BUFFERS["torch"], _BUFFERS["cuda"]


def _inputs(c: Case, rank: int, world: int, seed: int) -> tuple[object, torch.Tensor, torch.Tensor, int]:
    num_experts = c.experts_per_rank * world
    inputs = make_inputs(seed, world, tokens_for(c.tokens, world), c.hidden, num_experts, c.topk,
                         dtype=getattr(torch, c.dtype), routing=c.routing)
    mine = inputs[rank].to("cuda")
    x: object = mine.x
    if c.use_fp8:
        data, scales = fp8.per_token_cast_to_fp8(mine.x.float())
        if c.strided_scales:
            wide = torch.zeros(scales.size(0), scales.size(1) + 5, device=scales.device)
            wide[:, :scales.size(1)] = scales
            scales = wide[:, :scales.size(1)]
        x = (data, scales)
    return x, mine.topk_idx, mine.topk_weights, num_experts


def _num_worst_tokens(c: Case, topk_idx: torch.Tensor, num_experts: int, world: int) -> int:
    if c.num_worst_extra == EXACT_FIT:
        owner = topk_idx.div(num_experts // world, rounding_mode="floor")
        rows = torch.stack([((owner == r) & (topk_idx >= 0)).any(1).sum() for r in range(world)])
        dist.all_reduce(rows)
        return int(rows.max())
    return sum(tokens_for(c.tokens, world)) + c.num_worst_extra if c.num_worst_extra >= 0 else 0


def _round_trip(buffer: moe_ep.Buffer, c: Case, x: object, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                num_experts: int, num_worst: int, bias: Optional[tuple[torch.Tensor, ...]], rank: int,
                async_mode: bool = False, staging_fits: bool = True) -> dict[str, object]:
    config = moe_ep.Config(c.config[0], c.config[1], c.config[2], 6, 128)
    out: dict[str, object] = {}
    out["layout"] = buffer.get_dispatch_layout(topk_idx, num_experts)[:4]
    per_rank, _, per_expert, in_rank = out["layout"]
    extra = {}
    if async_mode:
        extra = dict(previous_event=moe_ep.Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
    recv = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                           topk_weights=topk_weights if c.with_weights else None, expert_alignment=c.alignment,
                           num_worst_tokens=num_worst, config=config, **extra)
    recv[-1].current_stream_wait()
    out["dispatch"] = recv[:5]
    handle = recv[4]
    cached = buffer.dispatch(x, handle=handle, config=config)
    out["cached"] = cached[0]
    recv_x = recv[0][0] if c.use_fp8 else recv[0]
    if not c.use_fp8:
        y = expert_output(recv_x, rank)
        cuda = buffer._cuda
        # The CUDA backend combines through the staging area when it fits, else (or when told) the rings.
        runs = [("torch", "staged")]
        if cuda is not None:
            runs = [("staged", "staged"), ("rings", "rings")] if staging_fits else [("rings", "staged")]
        for path, combine_path in runs:
            combined = buffer.combine(y, handle, topk_weights=recv[2], bias=bias,
                                      config=replace(config, combine_path=combine_path), **extra)
            combined[-1].current_stream_wait()
            if cuda is not None:
                assert cuda.last_combine_path() == path, f"combine ran {cuda.last_combine_path()}, not {path}"
            out[f"combine_{path}"] = combined[:2]
    torch.cuda.synchronize()
    return out


def _compare_backends(rank: int, world: int, case: dict, seed: int = 1234, async_mode: bool = False,
                      small_buffer_bytes: int = 0) -> int:
    """`small_buffer_bytes`: run the CUDA side on a Buffer that size, too small for the staging area."""
    c = Case(**case)
    torch_buf, cuda_buf = _buffers(dist.group.WORLD)
    if small_buffer_bytes:
        cuda_buf = moe_ep.Buffer(dist.group.WORLD, small_buffer_bytes, backend="cuda", explicitly_destroy=True)
    x, topk_idx, topk_weights, num_experts = _inputs(c, rank, world, seed + world)
    num_worst = _num_worst_tokens(c, topk_idx, num_experts, world)
    gen = torch.Generator().manual_seed(99 + rank)
    shape = (topk_idx.size(0), c.hidden)  # this rank's tokens
    bias = tuple(torch.randn(shape, generator=gen).to(getattr(torch, c.dtype)).cuda() for _ in range(c.with_bias))
    bias_arg = None if not bias else (bias[0] if len(bias) == 1 else bias)
    expected = _round_trip(torch_buf, c, x, topk_idx, topk_weights, num_experts, num_worst, bias_arg, rank)
    got = _round_trip(cuda_buf, c, x, topk_idx, topk_weights, num_experts, num_worst, bias_arg, rank, async_mode,
                      staging_fits=not small_buffer_bytes)
    if small_buffer_bytes:
        cuda_buf.destroy()
    assert_same_bits(got["layout"], expected["layout"], "layout")
    assert_same_bits(got["dispatch"], expected["dispatch"], "dispatch")
    assert_same_bits(got["cached"], got["dispatch"][0], "cached dispatch")
    if "combine_torch" in expected:
        paths = [key for key in got if key.startswith("combine_")]
        assert paths, "the CUDA backend ran no combine"
        for key in paths:
            assert_same_bits(got[key], expected["combine_torch"], key)
    recv_x = got["dispatch"][0]
    return (recv_x[0] if isinstance(recv_x, tuple) else recv_x).size(0)


def _run_cases(rank: int, world: int, cases: list[dict]) -> dict[str, str]:
    """Every case in one task (one process group per world size); failures are collected per case."""
    failures = {}
    for case in cases:
        try:
            _compare_backends(rank, world, case)
        except Exception as exc:  # report and go on with the next case
            failures[case["name"]] = f"{type(exc).__name__}: {exc}"
            # Said at once too: a rank that failed before a collective leaves its peers waiting there,
            # and the NCCL watchdog may end every rank before the failures travel back.
            print(f"rank {rank}, case {case['name']}: {failures[case['name']]}", file=sys.stderr, flush=True)
    return failures


def _check_every_case(pool: DistPool, timeout: float) -> None:
    per_rank = pool.run(_run_cases, [asdict(c) for c in CASES], timeout=timeout)
    failed = {f"rank {r} {name}": why for r, failures in enumerate(per_rank) for name, why in failures.items()}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())


@pytest.mark.parametrize("world", gpu_worlds(2, 3, 4, 8))
def test_cuda_matches_torch_backend(gpu_pool, world: int) -> None:
    """On machines with fewer GPUs than ranks the ranks share them: the kernels' multi-rank logic (the
    staged combine's plan and claims among it) is checked there too, but not their speed."""
    _check_every_case(gpu_pool(world), timeout=900)


PLACEMENTS = ["gpu_per_rank", "shared_gpus"]


def _up_to_four_ranks(placement: str, nccl_pool, shared_gpu_pool) -> DistPool:
    """A GPU per rank for up to four ranks; or, on machines with fewer than four GPUs, four ranks
    sharing them (correctness only)."""
    count = torch.cuda.device_count()
    if placement == "gpu_per_rank":
        if count < 2:
            pytest.skip(f"a GPU per rank needs at least 2 GPUs, found {count}; the shared_gpus placement runs instead")
        return nccl_pool(min(4, count))
    if count >= 4:
        pytest.skip("the GPU-per-rank run already has four ranks")
    return shared_gpu_pool(4)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_async_previous_event_mode(nccl_pool, shared_gpu_pool, placement: str) -> None:
    pool = _up_to_four_ranks(placement, nccl_pool, shared_gpu_pool)
    pool.run(_compare_backends, asdict(Case("async", hidden=1024)), async_mode=True)
    pool.run(_compare_backends, asdict(Case("async_worst", hidden=1024, num_worst_extra=3)), async_mode=True)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_combine_falls_back_to_rings_when_staging_does_not_fit(nccl_pool, shared_gpu_pool, placement: str) -> None:
    """512 KiB holds the rings of this case (4 channels x 8 slots of 640 bytes per rank pair) but not
    its staging area (0.9 MB at 2 ranks, 2.3 MB at 4)."""
    case = Case("rings_fallback", tokens=(1500, 1300, 1700, 900), hidden=256, config=(4, 2, 8))
    _up_to_four_ranks(placement, nccl_pool, shared_gpu_pool).run(_compare_backends, asdict(case),
                                                                  small_buffer_bytes=1 << 19)


def _calls_on_changing_streams(rank: int, world: int) -> None:
    """Synchronous calls run on the caller's stream; one Buffer's calls must still never overlap. Each call
    here runs on another stream than the one before, after a GPU sleep on its own stream, and the caller
    orders nothing between them: a call that did not wait for the previous one's stream would start
    first (reading a handle not yet written, or two kernels in one buffer)."""
    c = Case("stream_hops", hidden=1024)
    torch_buf, cuda_buf = _buffers(dist.group.WORLD)
    x, topk_idx, topk_weights, num_experts = _inputs(c, rank, world, 31)
    expected = _round_trip(torch_buf, c, x, topk_idx, topk_weights, num_experts, 0, None, rank)
    per_rank, _, per_expert, in_rank, _ = cuda_buf.get_dispatch_layout(topk_idx, num_experts)
    config = moe_ep.Config(c.config[0], c.config[1], c.config[2], 6, 128)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    sleep_cycles = 50_000_000  # tens of milliseconds: far longer than the host takes to queue the next call
    with torch.cuda.stream(streams[0]):
        torch.cuda._sleep(sleep_cycles)
        recv_x, recv_idx, recv_w, counts, handle, _ = cuda_buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, config=config)
    with torch.cuda.stream(streams[1]):
        torch.cuda._sleep(sleep_cycles // 10)
        cached = cuda_buf.dispatch(x, handle=handle, config=config)[0]
    with torch.cuda.stream(streams[0]):
        torch.cuda._sleep(sleep_cycles // 10)
        combined, combined_w, _ = cuda_buf.combine(expert_output(recv_x, rank), handle, topk_weights=recv_w,
                                                   config=config)
    torch.cuda.synchronize()
    assert_same_bits([recv_x, recv_idx, recv_w, counts], list(expected["dispatch"][:4]), "dispatch")
    assert_same_bits(cached, recv_x, "cached dispatch")
    assert_same_bits([combined, combined_w], list(expected["combine_torch"]), "combine")


def test_calls_on_changing_streams_stay_ordered(gpu_pool) -> None:
    gpu_pool(2).run(_calls_on_changing_streams, timeout=120)


def _hashes(rank: int, world: int, repeats: int) -> list[str]:
    c = Case("pressure", tokens=(1024, 1024, 1024, 1024), hidden=4096, config=(24, 6, 128))
    _, cuda_buf = _buffers(dist.group.WORLD)
    digests = []
    for _ in range(repeats):
        x, topk_idx, topk_weights, num_experts = _inputs(c, rank, world, 777)
        out = _round_trip(cuda_buf, c, x, topk_idx, topk_weights, num_experts, 0, None, rank)
        h = hashlib.sha256()
        for tensor in _flatten(out):
            h.update(tensor.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
        digests.append(h.hexdigest())
    return digests


def _flatten(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flatten(v)]
    return []


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_pressure_same_seed_same_hash(nccl_pool, shared_gpu_pool, placement: str) -> None:
    for digests in _up_to_four_ranks(placement, nccl_pool, shared_gpu_pool).run(_hashes, 20):
        assert len(set(digests)) == 1, "outputs differ between identical runs"


def _replay_equals_eager(calls: Callable[[], object]) -> object:
    """Run `calls` eagerly, then captured in a CUDA graph and replayed: the replay's outputs must have the
    eager ones' bits. Returns the eager outputs."""
    eager = calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        captured = calls()
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bits(captured, eager, "graph replay")
    return eager


def _graph_captured_dispatch(rank: int, world: int) -> None:
    """With num_worst_tokens the call only enqueues work: a host wait for the counts could not end
    while capturing (nothing runs), so capture would fail."""
    c = Case("graph", hidden=512, num_worst_extra=5)
    _, cuda_buf = _buffers(dist.group.WORLD)
    backend = cuda_buf._cuda
    x, topk_idx, topk_weights, num_experts = _inputs(c, rank, world, 21)
    num_worst = _num_worst_tokens(c, topk_idx, num_experts, world)
    config = moe_ep.Config(c.config[0], c.config[1], c.config[2], 6, 128)
    per_rank, _, per_expert, in_rank, _ = cuda_buf.get_dispatch_layout(topk_idx, num_experts)

    def dispatch() -> object:
        return backend.dispatch(DispatchRequest(x, None, topk_idx, topk_weights, per_rank, in_rank, per_expert, 1,
                                                num_worst, config))

    _replay_equals_eager(dispatch)


def test_num_worst_tokens_dispatch_captures_in_cuda_graph(gpu_pool) -> None:
    gpu_pool(2).run(_graph_captured_dispatch, timeout=120)


def _graph_captured_buffer_calls(rank: int, world: int) -> None:
    """Whole Buffer calls, front end included, in one CUDA graph: a dispatch with num_worst_tokens (no host
    wait), a cached dispatch and a combine with its handle; the replay gives the eager calls' outputs."""
    c = Case("graph_buffer_calls", hidden=512, num_worst_extra=5)
    _, cuda_buf = _buffers(dist.group.WORLD)
    x, topk_idx, topk_weights, num_experts = _inputs(c, rank, world, 23)
    num_worst = _num_worst_tokens(c, topk_idx, num_experts, world)
    config = moe_ep.Config(c.config[0], c.config[1], c.config[2], 6, 128)
    per_rank, _, per_expert, in_rank, _ = cuda_buf.get_dispatch_layout(topk_idx, num_experts)

    def calls() -> tuple[torch.Tensor, ...]:
        recv_x, recv_idx, recv_w, _, handle, _ = cuda_buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=num_worst, config=config)
        cached = cuda_buf.dispatch(x * 2, handle=handle, config=config)[0]
        combined, combined_w, _ = cuda_buf.combine(recv_x, handle, topk_weights=recv_w, config=config)
        return recv_x, recv_idx, recv_w, cached, combined, combined_w

    eager = _replay_equals_eager(calls)
    assert bool((eager[1] >= 0).any()), "no token was routed here: the case moves nothing"


def test_whole_buffer_calls_capture_in_cuda_graph(gpu_pool) -> None:
    gpu_pool(2).run(_graph_captured_buffer_calls, timeout=120)


def _limit(scenario: str, rank: int, world: int, fits: int) -> int:
    """num_worst_tokens of `rank`: 1 is too small for every rank (each receives far more rows)."""
    if scenario == "every_rank_too_small":
        return 1
    if scenario == "waiting_rank" and rank == 0:
        return 0  # no limit: this rank waits for the counts and learns the verdict in the call
    return 1 if rank == world - 1 else fits


def _assert_all_padding(recv: tuple) -> None:
    recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle, _ = recv
    assert not recv_x.any() and bool((recv_topk_idx == -1).all()) and not recv_topk_weights.any()
    assert bool((handle.recv_src_idx == -1).all()) and per_expert == []


def _worst_tokens_overflow(rank: int, world: int, scenario: str) -> str:
    """An overflow cancels the dispatch on every rank (outputs all padding) and raises a ValueError on every
    rank: in the call for a rank without limit, else by the next call after the device ran it or by
    check_errors(). The Buffer is unusable afterwards."""
    c = Case("overflow", hidden=256)
    buffer = moe_ep.Buffer(dist.group.WORLD, 1 << 26, backend="cuda", explicitly_destroy=True)
    x, topk_idx, topk_weights, num_experts = _inputs(c, rank, world, 5)
    limit = _limit(scenario, rank, world, sum(tokens_for(c.tokens, world)) + 3)
    config = moe_ep.Config(c.config[0], c.config[1], c.config[2], 6, 128)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    try:
        recv = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                               num_worst_tokens=limit, config=config)
        assert limit > 0, "the rank without limit waits for the verdict and raises in the call"
        torch.cuda.synchronize()
        assert recv[0].size(0) == limit
        _assert_all_padding(recv)
        if scenario == "every_rank_too_small":
            buffer.dispatch(x, handle=recv[4], config=config)
        else:
            buffer.check_errors()
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"num_worst_tokens={limit}: no error")
    with pytest.raises(RuntimeError, match="unusable"):
        buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=topk_idx, config=config)
    buffer.destroy()
    return message


@pytest.mark.parametrize("scenario", ["every_rank_too_small", "one_rank_too_small", "waiting_rank"])
def test_num_worst_tokens_overflow_raises_everywhere(gpu_pool, scenario: str) -> None:
    world = 4
    messages = gpu_pool(world).run(_worst_tokens_overflow, scenario, timeout=120)
    overflowing = 0 if scenario == "every_rank_too_small" else world - 1
    for message in messages:
        assert message.startswith(f"num_worst_tokens: too small, rank {overflowing} receives"), message
    # Other Buffers of the same ranks are unaffected.
    gpu_pool(world).run(_compare_backends, asdict(Case("after_overflow", hidden=256, num_worst_extra=0)))


def _layouts_at_every_grid_size(rank: int, world: int) -> None:
    """The layout kernel counts per block in shared memory and adds the blocks' counts into the zeroed
    outputs: token counts from none to 157 blocks, skewed experts (some empty) with masked slots, each
    called twice, equal to the torch reference."""
    buffer = moe_ep.Buffer(dist.group.WORLD, 1 << 26, backend="cuda", explicitly_destroy=True)
    num_experts, topk = 64 * world, 8
    gen = torch.Generator().manual_seed(31 + rank)
    for tokens in (0, 1, 255, 257, 5000, 40_000):
        scores = torch.rand(tokens, num_experts, generator=gen) * torch.linspace(1, 1.5, num_experts)
        topk_idx = scores.topk(topk, dim=1).indices
        topk_idx[torch.rand(tokens, topk, generator=gen) < 0.2] = -1
        want = routing.dispatch_layout(topk_idx, num_experts, world)
        for _ in range(2):
            per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx.cuda(), num_experts)
            assert per_rdma is None
            assert_same_bits(per_rank.cpu(), want.num_tokens_per_rank, f"num_tokens_per_rank at {tokens} tokens")
            assert_same_bits(per_expert.cpu(), want.num_tokens_per_expert, f"num_tokens_per_expert at {tokens} tokens")
            assert_same_bits(in_rank.cpu(), want.is_token_in_rank, f"is_token_in_rank at {tokens} tokens")
        assert tokens == 0 or int(want.num_tokens_per_rank.sum()) > 0
    buffer.destroy()


def test_layout_matches_reference_at_every_grid_size(gpu_pool) -> None:
    gpu_pool(2).run(_layouts_at_every_grid_size, timeout=120)


def _exact_handle_after_overflow(rank: int, world: int) -> str:
    """A cached dispatch skips the padding pass when its handle's dispatch received exactly its rows,
    but not after a num_worst_tokens dispatch: one that overflows cancels the data kernels of every
    cached dispatch until the next notify, and their rows must then read as padding (zeros). Issued
    before the device ran the overflowing notify (the stream sleeps first), the cached dispatch returns
    zeros and the overflow comes from the next check."""
    c = Case("exact_after_overflow", hidden=256)
    buffer = moe_ep.Buffer(dist.group.WORLD, 1 << 26, backend="cuda", explicitly_destroy=True)
    x, topk_idx, _, num_experts = _inputs(c, rank, world, 7)
    config = moe_ep.Config(c.config[0], c.config[1], c.config[2], 6, 128)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, config=config)
    exact = buffer.dispatch(x, **layout)
    handle = exact[4]
    assert handle.exact_rows and not buffer.dispatch(x, num_worst_tokens=10_000, **layout)[4].exact_rows
    assert torch.equal(buffer.dispatch(x, handle=handle, config=config)[0], exact[0]) and exact[0].any()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(200_000_000)  # about 0.1 s: the host queues the next calls before the notify runs
    buffer.dispatch(x, num_worst_tokens=1, **layout)  # every rank receives more: cancelled everywhere
    stale = torch.full_like(exact[0], 7)
    del stale  # its block, freed with 7s in it, is what the cached dispatch's output is likely to get
    try:
        cached = buffer.dispatch(x, handle=handle, config=config)[0]
        torch.cuda.synchronize()
        assert cached.shape == exact[0].shape and not cached.any(), "a cancelled cached dispatch left rows unset"
        buffer.check_errors()
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError("num_worst_tokens=1: no error")
    buffer.destroy()
    return message


def test_exact_handle_after_an_overflow_reads_as_padding(gpu_pool) -> None:
    world = 2
    for message in gpu_pool(world).run(_exact_handle_after_overflow, timeout=120):
        assert message.startswith("num_worst_tokens: too small"), message


def _absent_peer(rank: int, world: int) -> str:
    os.environ["MOE_EP_TIMEOUT_S"] = "2"
    reload_settings()
    buffer = moe_ep.Buffer(dist.group.WORLD, 1 << 24, backend="cuda", explicitly_destroy=True)
    del os.environ["MOE_EP_TIMEOUT_S"]
    reload_settings()
    outcome = "skipped"
    if rank == 0:
        topk_idx = torch.zeros(8, 2, dtype=torch.int64, device="cuda")
        topk_idx[:, 1] = 1
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 2 * world)
        try:
            buffer.dispatch(torch.ones(8, 128, dtype=torch.bfloat16, device="cuda"), num_tokens_per_rank=per_rank,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                            config=moe_ep.Config(4, 2, 16, 6, 128))
        except RuntimeError as exc:
            outcome = str(exc)
        else:
            outcome = "no error"
    dist.barrier()
    return outcome


def test_absent_peer_times_out_and_raises(gpu_pool) -> None:
    outcomes = gpu_pool(2).run(_absent_peer, timeout=120)
    assert "peer rank never reached the barrier" in outcomes[0], outcomes[0]
