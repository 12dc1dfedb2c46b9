"""The test pool on GPUs: a rank that hangs after the process group, CUDA and our Buffers have run in its
process is still reported with its Python stack (NCCL and NVSHMEM start threads of their own, which
must not keep the hung rank from writing it on SIGUSR1)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.ops.backends import cuda_extension_available
from moe_ep.ops.backends.cuda_low_latency import low_latency_available
from test_dist_pool import _rank_one_hangs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")


def _use_group_and_buffers(rank: int, world: int) -> float:
    """An all-reduce, then every Buffer this build can make (normal mode; low latency, which starts
    NVSHMEM), as the layer tests do before a case can hang."""
    value = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(value)
    buffers = []
    if cuda_extension_available():
        buffers.append(moe_ep.Buffer(dist.group.WORLD, 1 << 24, backend="cuda", explicitly_destroy=True))
    if low_latency_available():
        rdma_bytes = moe_ep.Buffer.get_low_latency_rdma_size_hint(16, 512, world, 4 * world)
        buffers.append(moe_ep.Buffer(dist.group.WORLD, 0, rdma_bytes, low_latency_mode=True, backend="cuda",
                                     explicitly_destroy=True))
    for buffer in buffers:
        buffer.destroy()
    return float(value[0])


def test_hung_gpu_worker_is_reported_with_its_stack(gpu_pool) -> None:
    pool = gpu_pool(2)
    assert pool.run(_use_group_and_buffers) == [3.0, 3.0]
    with pytest.raises(AssertionError) as failure:
        pool.run(_rank_one_hangs, timeout=3)
    message = str(failure.value)
    assert "ranks [1] did not answer within 3 s (hang)" in message
    assert "--- rank 1, where it waits ---" in message and "_rank_one_hangs" in message, message[-2000:]
