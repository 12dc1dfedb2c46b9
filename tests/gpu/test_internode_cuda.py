"""CUDA internode normal mode (NVSHMEM legs) against the torch backend, with virtual nodes.

Shapes 2x1, 2x2, 3x2 and 4x2 (nodes x ranks per node): a GPU per rank over NCCL where the machine has
enough GPUs, else every rank an NVSHMEM PE sharing the GPUs over gloo (NVSHMEM carries the puts of
both legs over P2P; correctness only, never speed). Every rank runs the same inputs through a CUDA
Buffer and a torch Buffer (on the CPU when the pool is gloo) and compares bit for bit: the layout, every
dispatch output and handle field, the cached dispatch, combine with and without weights and biases, the
network rows counted, and gradients through autograd; none of the CUDA calls goes through the store
(the counts travel in the notify's two NVSHMEM exchanges). Small rings (chunks of 4 rows, rings of 16)
make every stream wrap. More tests leave a rank out of an exchange (its rail peer's kernel gives up
within the timeout and the next call raises, while ranks that never wait on it finish) and out of a
dispatch (every other rank's notify gives up and the dispatch raises), and make the ranks disagree on a
setting (`PeerInputError` on every rank, the Buffer still usable).
"""

from __future__ import annotations

import os
from dataclasses import asdict, replace
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep import ops
from moe_ep.ops import fp8
from moe_ep.ops.backends.cuda_low_latency import low_latency_available
from moe_ep.ops.settings import reload as reload_settings
from dist_pool import gpu_worlds
from reference import assert_same_bits, expert_output, make_inputs, to_cpu, tokens_for
from test_agreement import _counting
from test_internode import BIG_BF16, BIG_FP8, EMPTY_RANK, EVERY_NODE, FP8, NODE_SILENT, RANDOM, SKEWED, WORST, Case
from test_internode import _inputs, check_disagreeing_dispatches, disagreeing_dispatches

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or not low_latency_available(),
                               reason="needs CUDA GPUs and the moe_ep._low_latency extension (built with NVSHMEM)")

# (nodes, ranks per node) -> cases.
SHAPES = {
    (2, 1): [RANDOM, FP8, WORST],
    (2, 2): [RANDOM, SKEWED, NODE_SILENT, WORST, BIG_FP8],
    (3, 2): [EVERY_NODE, EMPTY_RANK, BIG_BF16],
    (4, 2): [RANDOM, FP8],
}
RDMA_BYTES = 64 << 20
# Chunks of 4 rows in rings of 16: every stream of the cases wraps its ring.
CONFIG = dict(num_max_rdma_chunked_send_tokens=4, num_max_rdma_chunked_recv_tokens=16)

_BUFFERS: dict[tuple[int, str], moe_ep.Buffer] = {}


def _reference_device() -> torch.device:
    """The torch backend runs on the CPU over gloo (shared GPUs), on the GPUs over NCCL."""
    return torch.device("cpu") if dist.get_backend() == "gloo" else torch.device("cuda")


def _buffer(ranks_per_node: int, kind: str) -> moe_ep.Buffer:
    key = (ranks_per_node, kind)
    if key not in _BUFFERS:
        if kind == "cuda":
            _BUFFERS[key] = moe_ep.Buffer(dist.group.WORLD, num_rdma_bytes=RDMA_BYTES, backend="cuda",
                                          num_ranks_per_node=ranks_per_node)
        else:
            _BUFFERS[key] = moe_ep.Buffer(dist.group.WORLD, backend="torch", num_ranks_per_node=ranks_per_node)
        assert _BUFFERS[key].node_topology().num_nodes > 1
    return _BUFFERS[key]


def _round_trip(buffer: moe_ep.Buffer, c: Case, inputs: list, rank: int, device: torch.device,
                num_worst: int, config: moe_ep.Config) -> dict[str, object]:
    mine = inputs[rank]
    # FP8 cast on the CPU for both Buffers: the same input bits.
    x = tuple(t.to(device) for t in fp8.per_token_cast_to_fp8(mine.x.float())) if c.use_fp8 else mine.x.to(device)
    topk_idx, topk_weights = mine.topk_idx.to(device), mine.topk_weights.to(device)
    num_experts = c.experts_per_rank * len(inputs)
    gen = torch.Generator().manual_seed(99 + rank)
    bias = tuple(torch.randn(mine.x.shape, generator=gen).to(torch.bfloat16 if c.use_fp8 else mine.x.dtype).to(device)
                 for _ in range(2))
    out: dict[str, object] = {}
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    out["layout"] = layout[:4]
    recv = buffer.dispatch(x, num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
                           is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], topk_idx=topk_idx,
                           topk_weights=topk_weights, expert_alignment=c.alignment, num_worst_tokens=num_worst,
                           config=config)
    out["dispatch"], handle = recv[:4], recv[4]
    out["handle"] = tuple(handle)
    internode = buffer._cuda.path if buffer._cuda is not None else buffer._torch.internode
    out["network_rows"] = internode.last_network_rows
    out["cached"] = buffer.dispatch(x, handle=handle, config=config)[0]
    recv_x = fp8.per_token_cast_back(*recv[0], torch.bfloat16) if c.use_fp8 else recv[0]
    y = expert_output(recv_x, rank)
    out["combine"] = buffer.combine(y, handle, topk_weights=recv[2], bias=bias, config=config)[:2]
    out["combine_plain"] = buffer.combine(y, handle, config=config)[:2]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return to_cpu(out)


def _compare(rank: int, world: int, ranks_per_node: int, cases: list[dict]) -> dict[str, str]:
    """Every case of a shape in one task; failures are collected per case."""
    failures = {}
    for case in cases:
        c = Case(**case)
        try:
            inputs = _inputs(c, world, ranks_per_node)
            num_worst = 0
            if c.worst_extra >= 0:
                num_worst = sum(inp.x.size(0) for inp in inputs) + c.worst_extra
            config = moe_ep.Config(c.num_sms, 6, 256, **CONFIG)
            expected = _round_trip(_buffer(ranks_per_node, "torch"), c, inputs, rank, _reference_device(), num_worst,
                                   config)
            cuda_buffer = _buffer(ranks_per_node, "cuda")
            with _counting() as calls:
                got = _round_trip(cuda_buffer, c, inputs, rank, torch.device("cuda"), num_worst, config)
            assert calls["exchange"] == 0, "a CUDA call went through the store"
            assert got["network_rows"] > 0 or expected["network_rows"] == 0
            for key in expected:
                assert_same_bits(got[key], expected[key], key)
        except Exception as exc:  # report and go on with the next case
            failures[c.name] = f"{type(exc).__name__}: {exc}"
    return failures


@needs_gpu
@pytest.mark.parametrize("shape", [pytest.param(s, marks=p.marks, id=f"{s[0]}x{s[1]}")
                                   for s, p in zip(SHAPES, gpu_worlds(*(n * l for n, l in SHAPES)))])
def test_cuda_internode_matches_torch_backend(gpu_pool, shape: tuple[int, int]) -> None:
    nodes, size = shape
    cases = [asdict(c) for c in SHAPES[shape]]
    failures = gpu_pool(nodes * size).run(_compare, size, cases, timeout=600)
    problems = {f"rank {r}: {name}": msg for r, f in enumerate(failures) for name, msg in f.items()}
    assert not problems, "\n".join(f"{k}: {v}" for k, v in problems.items())


def _autograd(rank: int, world: int) -> list[torch.Tensor]:
    """Float64 gradients of dispatch -> per-rank scaling -> combine, on the CUDA and the torch Buffer."""
    num_experts, hidden, size = 4 * world, 128, 2
    inputs = make_inputs(11, world, tokens_for((13, 7, 0, 10), world), hidden, num_experts, 3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    scale = torch.randn(world, hidden, generator=gen, dtype=torch.float64)
    mine = inputs[rank]
    loss_w = torch.randn(mine.x.shape, generator=gen, dtype=torch.float64)
    grads = []
    for kind, device in (("torch", _reference_device()), ("cuda", torch.device("cuda"))):
        buffer = _buffer(size, kind)
        x = mine.x.detach().to(device, copy=True).requires_grad_()
        w = mine.topk_weights.detach().to(device, copy=True).requires_grad_()
        out = ops.dispatch(buffer, x, mine.topk_idx.to(device), w, num_experts, expert_alignment=4)
        y = out.recv_x * scale[rank].to(device) * out.recv_topk_weights.double().sum(1, keepdim=True)
        combined = ops.combine(buffer, y, out.handle)
        (combined * loss_w.to(device)).sum().backward()
        grads += [x.grad.cpu(), w.grad.cpu()]
    return grads


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(4))
def test_cuda_internode_gradients_match_torch_backend(gpu_pool, world: int) -> None:
    for torch_x, torch_w, cuda_x, cuda_w in gpu_pool(world).run(_autograd):
        assert torch.equal(torch_x, cuda_x) and torch.equal(torch_w, cuda_w)


def _layer(rank: int, world: int) -> list[torch.Tensor]:
    """MoELayer forward and backward over the CUDA internode Buffer and over the torch Buffer, both on the
    GPU (the same expert GEMMs): the output, the input gradient and every parameter gradient."""
    from moe_ep.layers import MoEConfig, MoELayer

    cfg = MoEConfig(hidden_size=256, moe_intermediate_size=128, num_experts=4 * world, num_experts_per_tok=3,
                    n_shared_experts=1)
    x = torch.randn(21 + 4 * rank, 256, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).cuda()
    results = []
    for kind in ("torch", "cuda"):
        torch.manual_seed(3)
        layer = MoELayer(cfg, buffer=_buffer(2, kind), dtype=torch.bfloat16).cuda()
        inp = x.clone().requires_grad_()
        out = layer(inp)
        out.float().square().sum().backward()
        results.append([out.detach().cpu(), inp.grad.cpu()] + [p.grad.cpu() for p in layer.parameters()])
    return results


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(4))
def test_moe_layer_over_cuda_internode(gpu_pool, world: int) -> None:
    for over_torch, over_cuda in gpu_pool(world).run(_layer):
        assert torch.equal(over_torch[0], over_cuda[0])  # the forward: same rows, same reductions
        for a, b in zip(over_torch[1:], over_cuda[1:]):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-3)


def _buffer_giving_up_after(seconds: int) -> moe_ep.Buffer:
    """A 2x2 CUDA Buffer whose kernels give up after `seconds` (the timeout is read at creation)."""
    saved = os.environ.get("MOE_EP_TIMEOUT_S")
    os.environ["MOE_EP_TIMEOUT_S"] = str(seconds)
    reload_settings()
    try:
        return moe_ep.Buffer(dist.group.WORLD, num_rdma_bytes=RDMA_BYTES, backend="cuda", num_ranks_per_node=2,
                             explicitly_destroy=True)
    finally:
        if saved is None:
            os.environ.pop("MOE_EP_TIMEOUT_S")
        else:
            os.environ["MOE_EP_TIMEOUT_S"] = saved
        reload_settings()


def _absent_rank(rank: int, world: int) -> Optional[str]:
    """2x2 virtual nodes: ranks 0-2 run a rail exchange, rank 3 does not. Rank 1 (rank 3's rail peer)
    gives up after the timeout; ranks 0 and 2 (the other rail) finish."""
    buffer = _buffer_giving_up_after(2)
    if rank == 3:
        return None
    rows = torch.arange(6 * 32, dtype=torch.uint8, device="cuda").view(6, 32)
    received = buffer._cuda.path.legs.rail(rows, [3, 3], [3, 3], moe_ep.Config(4, 6, 256, **CONFIG))
    try:
        buffer.check_errors()
    except RuntimeError as exc:
        return str(exc)
    # Member j of the rail sends rows [3j, 3j + 3) of its matrix to member j; every rank's matrix is the same.
    assert torch.equal(received.view(2, 3, 32), rows.view(2, 3, 32)[rank // 2].expand(2, 3, 32))
    return None


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(4))
def test_rank_missing_from_an_exchange_times_out(gpu_pool, world: int) -> None:
    outcomes = gpu_pool(world).run(_absent_rank, timeout=120)
    assert outcomes[0] is None and outcomes[2] is None and outcomes[3] is None, outcomes
    assert outcomes[1] is not None and "gave up" in outcomes[1], outcomes


def _absent_from_dispatch(rank: int, world: int) -> Optional[str]:
    """2x2 virtual nodes: ranks 0-2 dispatch, rank 3 does not. The notify's rail exchange gives up on rank 1
    (rank 3's rail peer), its node exchange on rank 2 (rank 3's node) and on rank 0 (waiting for rank 1):
    each of them raises from the dispatch itself, which waits for the counts."""
    buffer = _buffer_giving_up_after(2)
    if rank == 3:
        return None
    c = replace(RANDOM, tokens=(15, 9, 22, 4))
    mine = _inputs(c, world, 2)[rank]
    topk_idx = mine.topk_idx.cuda()
    layout = buffer.get_dispatch_layout(topk_idx, c.experts_per_rank * world)
    try:
        buffer.dispatch(mine.x.cuda(), num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
                        is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], topk_idx=topk_idx)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(4))
def test_rank_missing_from_a_dispatch_makes_the_notify_give_up(gpu_pool, world: int) -> None:
    outcomes = gpu_pool(world).run(_absent_from_dispatch, timeout=120)
    assert outcomes[3] is None, outcomes
    for rank in range(3):
        assert outcomes[rank].startswith("internode mode: an exchange gave up"), (rank, outcomes)


def _disagreeing(rank: int, world: int) -> dict:
    """`disagreeing_dispatches` over a CUDA Buffer of its own (2x2 virtual nodes)."""
    buffer = moe_ep.Buffer(dist.group.WORLD, num_rdma_bytes=RDMA_BYTES, backend="cuda", num_ranks_per_node=2)
    return disagreeing_dispatches(buffer, rank, world, torch.device("cuda"))


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(4))
def test_ranks_that_disagree_raise_on_every_rank(gpu_pool, world: int) -> None:
    check_disagreeing_dispatches(gpu_pool(world).run(_disagreeing, timeout=120))


@needs_gpu
def test_buffer_size_formula_matches_kernels() -> None:
    """The Python mirror of the symmetric buffer's layout against the kernels' own."""
    from moe_ep.ops.backends.cuda_internode import exchange_channels
    from moe_ep.ops.backends.cuda_low_latency import nvshmem_module
    from moe_ep.ops.config import internode_rdma_bytes

    for num_sms, chunk, ring, team, row_bytes in ((4, 4, 16, 2, 32), (24, 16, 128, 8, 15104), (20, 6, 128, 32, 7696),
                                                  (2, 8, 8, 1, 16)):
        config = moe_ep.Config(num_sms, 6, 256, chunk, ring)
        kernels = nvshmem_module().internode_buffer_bytes(exchange_channels(config), team, chunk, ring, row_bytes)
        assert internode_rdma_bytes(config, team, row_bytes) == kernels


def _low_latency_virtual_nodes(rank: int, world: int) -> dict[str, object]:
    """Low-latency dispatch and combine with 2 virtual nodes of `world / 2` ranks (peers on the other node
    reached through NVSHMEM puts) on the CUDA Buffer and the torch Buffer, BF16 then FP8."""
    max_tokens, hidden, experts_per_rank, topk = 24, 2048, 3, 4
    num_experts = experts_per_rank * world
    inputs = make_inputs(31, world, tokens_for((20, 7, 0, 24), world), hidden, num_experts, topk)
    mine = inputs[rank]
    rdma_bytes = moe_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, num_experts)
    buffers = {
        "cuda": moe_ep.Buffer(dist.group.WORLD, 0, rdma_bytes, low_latency_mode=True, backend="cuda",
                              num_ranks_per_node=world // 2),
        "torch": moe_ep.Buffer(dist.group.WORLD, 0, rdma_bytes, low_latency_mode=True, backend="torch",
                               num_ranks_per_node=world // 2),
    }
    devices = {"cuda": torch.device("cuda"), "torch": _reference_device()}
    results: dict[str, object] = {"mapped": buffers["cuda"]._cuda._low_latency._runtime.all_peers_mapped}
    for use_fp8 in (False, True):
        for kind, buffer in buffers.items():
            device = devices[kind]
            topk_idx = mine.topk_idx.to(device)
            recv, count, handle, _, _ = buffer.low_latency_dispatch(mine.x.to(device), topk_idx, max_tokens,
                                                                    num_experts, use_fp8=use_fp8)
            data, scales = recv if use_fp8 else (recv, None)
            # Rows past recv_count are unspecified: keep the received ones of each local expert.
            count = count.cpu()
            rows = [data[e, :n].cpu() for e, n in enumerate(count.tolist())]
            if scales is not None:
                rows += [scales[e, :n].cpu() for e, n in enumerate(count.tolist())]
            src = [handle[0][e, :n].cpu() for e, n in enumerate(count.tolist())]
            y = (fp8.per_token_cast_back(data.flatten(0, 1), scales.flatten(0, 1), torch.bfloat16).view_as(data)
                 if use_fp8 else data)
            combined = buffer.low_latency_combine(y, topk_idx, mine.topk_weights.to(device), handle)[0]
            results[f"{kind}_{use_fp8}"] = (count, rows, src, handle[1].cpu(), combined.cpu())
    return results


@needs_gpu
@pytest.mark.parametrize("world", gpu_worlds(4, most_sharing=4))
def test_low_latency_reaches_other_virtual_nodes_by_puts(gpu_pool, world: int) -> None:
    for result in gpu_pool(world).run(_low_latency_virtual_nodes, timeout=300):
        assert result["mapped"] is False  # peers of the other node go through NVSHMEM puts
        for use_fp8 in (False, True):
            assert_same_bits(result[f"cuda_{use_fp8}"], result[f"torch_{use_fp8}"], f"low-latency fp8={use_fp8}")
