"""The PyTorch backend on GPUs over NCCL gives the dense reference's results, like on gloo. NCCL takes one
GPU per rank, so a world larger than the machine's GPU count is skipped (the other GPU test files run
the torch backend on shared GPUs over gloo)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

import test_buffer_low_latency as low_latency
import test_buffer_normal as normal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("case", normal.CASES, ids=lambda c: c.name)
def test_normal_mode_on_nccl(nccl_pool, world: int, case: normal.Case) -> None:
    received = nccl_pool(world).run(normal._normal_round_trip, asdict(case), "cuda", "torch")
    assert sum(received) > 0


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("case", low_latency.CASES, ids=lambda c: c.name)
def test_low_latency_mode_on_nccl(nccl_pool, world: int, case: low_latency.Case) -> None:
    received = nccl_pool(world).run(low_latency._low_latency_round_trip, asdict(case), "cuda", "torch")
    assert sum(received) > 0
