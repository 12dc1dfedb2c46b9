"""A small launcher for examples and scripts: run `fn` on N ranks of one machine.

Under `torchrun` (RANK/WORLD_SIZE set) it joins that job. Otherwise it spawns `world_size` processes:
NCCL with one GPU each when enough GPUs are visible; gloo with the ranks dealt round-robin over the
GPUs when there are fewer GPUs than ranks (NCCL refuses two ranks on one GPU; the CUDA kernels work
between processes sharing a GPU, which take turns on it: right results, not multi-GPU speed); gloo on
the CPU without GPUs.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """An unused TCP port on the loopback interface, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(rank: int, world_size: int, timeout_s: float = 300) -> torch.device:
    """Initialize the default process group for this rank; returns the device it should use."""
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda", rank % num_gpus) if num_gpus else torch.device("cpu")
    use_nccl = num_gpus >= world_size
    if num_gpus:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_nccl else "gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            **({"device_id": device} if use_nccl else {}))
    return device


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    device = init_distributed(rank, world_size)
    try:
        fn(rank, world_size, device, *args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run `fn(rank, world_size, device, *args)` on every rank (see the module docstring)."""
    # A launcher reads its job's variables from the environment (torchrun's contract), and sets the
    # rendezvous address of the workers it spawns (`_entry`); the library itself reads `moe_ep.ops.settings`.
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = init_distributed(rank, world)
        try:
            fn(rank, world, device, *args)
        finally:
            dist.destroy_process_group()
        return
    mp.spawn(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)
