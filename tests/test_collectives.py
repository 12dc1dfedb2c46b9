"""The byte-exchange helpers the CUDA backends use to share IPC handles and NVSHMEM ids."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_ep.ops.backends.collectives import all_gather_bytes, broadcast_bytes


def _exchange(rank: int, world: int) -> tuple[list[bytes], bytes]:
    record = bytes([rank, 255 - rank, 7 * rank % 256]) * 5
    gathered = all_gather_bytes(record, dist.group.WORLD, world, torch.device("cpu"))
    first = broadcast_bytes(b"unique-id-%d" % rank if rank == 0 else None, 11, dist.group.WORLD,
                            torch.device("cpu"))
    return gathered, first


def test_all_gather_and_broadcast_bytes(dist_pool) -> None:
    results = dist_pool(3).run(_exchange)
    expected = [bytes([r, 255 - r, 7 * r % 256]) * 5 for r in range(3)]
    for gathered, first in results:
        assert gathered == expected
        assert first == b"unique-id-0"
