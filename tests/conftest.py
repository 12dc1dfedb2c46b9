"""Shared fixtures that return live pools: `dist_pool(world)` (gloo), `nccl_pool(world)` (one GPU per
rank) and `shared_gpu_pool(world)` (gloo, ranks dealt round-robin over the GPUs)."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest
import torch

from dist_pool import SHARED_GPUS, DistPool


def _pools(backend: str) -> Iterator[Callable[[int], DistPool]]:
    pools: dict[int, DistPool] = {}

    def get(world: int) -> DistPool:
        if backend == "nccl" and torch.cuda.device_count() < world:
            pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
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
