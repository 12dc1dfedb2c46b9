"""Shared fixtures that return live pools: `dist_pool(world)` (gloo), `nccl_pool(world)` (one GPU per
rank), `shared_gpu_pool(world)` (gloo, ranks dealt round-robin over the GPUs) and `gpu_pool(world)` (one
GPU per rank where the machine has enough, else ranks sharing the GPUs it has)."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest
import torch

from dist_pool import SHARED_GPUS, DistPool, gpu_pool_backend


def _pools(backend: str) -> Iterator[Callable[[int], DistPool]]:
    pools: dict[int, DistPool] = {}

    def get(world: int) -> DistPool:
        if backend == "nccl" and torch.cuda.device_count() < world:
            pytest.skip(f"NCCL needs a GPU per rank: {world} ranks, {torch.cuda.device_count()} GPUs")
        if backend == SHARED_GPUS and not torch.cuda.is_available():
            pytest.skip("needs a GPU")
        if world in pools and pools[world].broken:
            pools.pop(world).close()
        if world not in pools:
            pools[world] = DistPool(world, backend)
        return pools[world]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[Callable[[int], DistPool]]:
    yield from _pools("gloo")


@pytest.fixture(scope="session")
def nccl_pool() -> Iterator[Callable[[int], DistPool]]:
    yield from _pools("nccl")


@pytest.fixture(scope="session")
def shared_gpu_pool() -> Iterator[Callable[[int], DistPool]]:
    yield from _pools(SHARED_GPUS)


@pytest.fixture(scope="session")
def gpu_pool(nccl_pool, shared_gpu_pool) -> Callable[[int], DistPool]:
    """`world` ranks on the GPUs: NCCL with a GPU each where the machine has `world` GPUs, else gloo with
    several ranks to a GPU (CUDA IPC and NVSHMEM work between processes on one GPU; their kernels take
    turns there, so such a run checks correctness, never speed)."""
    def get(world: int) -> DistPool:
        return nccl_pool(world) if gpu_pool_backend(world) == "nccl" else shared_gpu_pool(world)

    return get
