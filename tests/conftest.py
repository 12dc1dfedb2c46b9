"""Shared fixtures: `dist_pool(world)` returns a live gloo process pool of that size."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest

from dist_pool import DistPool


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[Callable[[int], DistPool]]:
    pools: dict[int, DistPool] = {}

    def get(world: int) -> DistPool:
        if world in pools and pools[world].broken:
            pools.pop(world).close()
        if world not in pools:
            pools[world] = DistPool(world)
        return pools[world]

    yield get
    for pool in pools.values():
        pool.close()
