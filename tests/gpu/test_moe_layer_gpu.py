"""MoELayer on GPUs: the CPU tests' dense-reference checks, plus shared-expert overlap.

Each case runs the layer with the CUDA backend when it can serve the case (BF16/FP8 tokens; NVSHMEM
for low-latency mode) and the torch backend otherwise; results are compared on the CPU with the
float64 reference of `tests/test_moe_layer.py`. Ranks get a GPU each over NCCL where the machine has
enough, else share the GPUs over gloo (see `gpu_pool`); at most four share one (low-latency mode runs
an NVSHMEM PE per rank).
"""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch

import test_moe_layer as cpu
from moe_ep.ops.backends import cuda_extension_available
from dist_pool import gpu_worlds
from reference import to_cpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")

# Small enough for the float64 per-token reference to take seconds; FP8 needs multiples of 128.
LAYER_CASES = [
    cpu.Case("bf16", dtype="bfloat16", hidden=512, inter=128, experts_per_rank=4, topk=4, tokens=(64, 24, 0, 40)),
    cpu.Case("bf16_static_no_shared", dtype="bfloat16", hidden=512, inter=128, experts_per_rank=4, topk=4,
             tokens=(48, 33, 56, 5), static=True, alignment=16, n_shared=0),
    cpu.Case("fp8_dispatch_and_experts", dtype="bfloat16", hidden=512, inter=128, experts_per_rank=4, topk=4,
             tokens=(64, 24, 48, 40), fp8_dispatch=True, fp8_experts=True),
    cpu.Case("bf16_low_latency", dtype="bfloat16", hidden=512, inter=128, experts_per_rank=4, topk=4,
             tokens=(48, 17, 32, 30), dispatch_mode="low_latency"),
    cpu.Case("float64_torch_backend", tokens=(24, 9, 0, 16)),
]


def _low_latency_kernels() -> bool:
    from moe_ep.ops.backends.cuda_low_latency import low_latency_available

    return low_latency_available()


def backend_for(case: cpu.Case, low_latency: bool = False) -> str:
    """The CUDA backend where it serves the case, else the torch backend (on NCCL)."""
    if not cuda_extension_available() or case.dtype != "bfloat16":
        return "torch"
    if (low_latency or case.dispatch_mode == "low_latency") and not _low_latency_kernels():
        return "torch"
    return "cuda"


def bound(case: cpu.Case) -> float:
    if case.fp8_experts:
        return cpu.FP8_BOUND
    if case.fp8_dispatch:
        return cpu.FP8_DISPATCH_BOUND
    return cpu.FLOAT64_BOUND if case.dtype == "float64" else cpu.BF16_BOUND


@pytest.mark.parametrize("world", gpu_worlds(2, 4, 8, most_sharing=4))
@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: c.name)
def test_layer_matches_dense_reference_on_gpu(gpu_pool, world: int, case: cpu.Case) -> None:
    got = gpu_pool(world).run(cpu._layer_grads, asdict(case), "cuda", backend_for(case))
    cpu.check_against_dense(got, case, world, bound(case))


@pytest.mark.parametrize("world", gpu_worlds(2, 4, 8, most_sharing=4))
@pytest.mark.parametrize("case", [
    cpu.Case("decode_bf16", dtype="bfloat16", hidden=512, inter=128, experts_per_rank=4, topk=4,
             tokens=(64, 1, 31, 0)),
    # Packed FP8 GEMMs want the R * max rows of every expert in multiples of 4 (max = 32 here).
    cpu.Case("decode_fp8", dtype="bfloat16", hidden=512, inter=128, experts_per_rank=4, topk=4,
             tokens=(64, 20, 40, 9), fp8_dispatch=True, fp8_experts=True),
], ids=lambda c: c.name)
def test_low_latency_decode_matches_forward_on_gpu(gpu_pool, world: int, case: cpu.Case) -> None:
    results = gpu_pool(world).run(cpu._decode_vs_forward, asdict(case), "cuda", backend_for(case, low_latency=True))
    ref_ranks, _ = cpu.dense_moe(case, world)
    for (decoded, forward), ref in zip(results, ref_ranks):
        assert decoded.shape == forward.shape == ref["out"].shape
        if ref["out"].numel():
            assert cpu.rel_error(decoded, forward) <= 1e-2
            assert cpu.rel_error(decoded, ref["out"]) <= bound(case)


OVERLAP_CASE = cpu.Case("overlap", dtype="bfloat16", hidden=2048, inter=512, experts_per_rank=8, topk=8,
                        tokens=(2048, 2048, 2048, 2048))


def _overlap_vs_sequential(rank: int, world: int, case: dict, backend: str) -> list[dict]:
    """Forward + backward with the shared experts on the side stream, then on the current stream."""
    c = cpu.Case(**case)
    cfg = replace(cpu.make_config(c, world), shared_expert_intermediate_size=8192)  # long side-stream work
    layer = cpu.build_layer(cfg, torch.bfloat16, "cuda", backend)
    xs, loss_weights = cpu.rank_tokens(c, world, torch.bfloat16)
    runs = []
    for overlap in (True, False, True, False):
        layer.overlap_shared_experts = overlap
        layer.zero_grad(set_to_none=True)
        x = xs[rank].cuda().requires_grad_()
        out = layer(x)
        (out.float() * loss_weights[rank].cuda()).sum().backward()
        assert layer._side_streams  # the first run created (and used) the side stream
        runs.append(to_cpu({"out": out.detach(), "x": x.grad,
                            **{name: p.grad for name, p in layer.named_parameters()}}))
    torch.cuda.synchronize()
    return runs


@pytest.mark.parametrize("world", gpu_worlds(2, 4, most_sharing=4))
def test_shared_expert_overlap_equals_sequential(gpu_pool, world: int) -> None:
    case = replace(OVERLAP_CASE, tokens=OVERLAP_CASE.tokens[:world])
    for runs in gpu_pool(world).run(_overlap_vs_sequential, asdict(case), backend_for(case)):
        # Same kernels on the same data in the same order: any race between the streams shows as a difference.
        for other in runs[1:]:
            for name, value in runs[0].items():
                assert torch.equal(other[name], value), name
