"""The launcher's placement: which GPU each rank of a host takes, and the process group it joins."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_ep.launch import gpu_for_rank
from moe_ep.ops.comm_group import group_from_comm


@pytest.mark.parametrize("local_size, num_gpus, gpus", [
    (4, 4, [0, 1, 2, 3]),  # a GPU each
    (2, 8, [0, 1]),
    (6, 4, [0, 1, 2, 0, 1, 2]),  # the most GPUs that take the same number of ranks each
    (8, 4, [0, 1, 2, 3] * 2),
    (3, 2, [0, 0, 0]),
    (4, 1, [0, 0, 0, 0]),
])
def test_ranks_of_a_host_share_its_gpus_evenly(local_size: int, num_gpus: int, gpus: list[int]) -> None:
    placed = [gpu_for_rank(rank, local_size, num_gpus) for rank in range(local_size)]
    assert placed == gpus
    assert len({placed.count(gpu) for gpu in set(placed)}) == 1


class _OneProcessComm:
    """An mpi4py-like communicator of one process."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def bcast(self, value: object, root: int = 0) -> object:
        return value

    def allgather(self, value: object) -> list:
        return [value]


def test_a_communicator_initialises_the_default_group_over_its_processes() -> None:
    """Without torch.distributed initialised, `comm=` starts the default group over the communicator's
    processes: NCCL where this host has a GPU for each of its ranks, gloo on a CPU machine."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    try:
        assert group_from_comm(_OneProcessComm()) is dist.group.WORLD
        expected = "nccl" if torch.cuda.is_available() else "gloo"
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, expected)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_under_torchrun_the_job_is_joined_with_its_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's variables: the rank joins that job (no processes spawned), its host's ranks counted by
    `LOCAL_WORLD_SIZE`."""
    from moe_ep.launch import free_port, launch

    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    seen = []
    launch(lambda rank, world, device: seen.append((rank, world, device.type, dist.get_backend())), 4)
    expected = ("cuda", "nccl") if torch.cuda.is_available() else ("cpu", "gloo")
    assert seen == [(0, 1, *expected)]
    assert not dist.is_initialized()
