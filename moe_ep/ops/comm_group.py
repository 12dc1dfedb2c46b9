"""The torch.distributed group of an mpi4py communicator: DeepEP's `Buffer(group=None, comm=...)`.

moe_ep moves data with torch.distributed, so a communicator only says which processes form the group.
Its mpi4py methods `Get_rank`, `Get_size`, `bcast` and `allgather` are all that is called: mpi4py is
never imported here (a program that passes a communicator has imported it already).
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

from .settings import settings


def group_from_comm(comm: object) -> dist.ProcessGroup:
    """The process group of `comm`'s processes, ranked as `comm` ranks them.

    torch.distributed already initialized: the default group when `comm` spans it, else a new group of
    `comm`'s processes (created by them alone); their ranks must follow the default group's order.
    Not initialized: the default group is initialized over `comm`'s processes, through a TCP store that
    `comm`'s rank 0 serves (its address travels by `comm.bcast`), with `moe_ep.launch.init_distributed`'s
    choice of NCCL or gloo and of the device.
    """
    for method in ("Get_rank", "Get_size", "bcast", "allgather"):
        if not callable(getattr(comm, method, None)):
            raise TypeError(f"comm: expected an mpi4py communicator (with {method}()), got {type(comm).__name__}")
    rank, size = comm.Get_rank(), comm.Get_size()
    if not dist.is_initialized():
        _init_default_group(comm, rank, size)
        return dist.group.WORLD
    members = list(comm.allgather(dist.get_rank()))
    if members != sorted(members):
        raise ValueError(f"comm: its ranks must be in torch.distributed's rank order, got global ranks {members} "
                         "in communicator order")
    if members == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(members, use_local_synchronization=True)


def _init_default_group(comm: object, rank: int, size: int) -> None:
    """Initialize the default group over `comm`'s processes (see `group_from_comm`)."""
    from ..launch import init_distributed  # the launcher imports moe_ep.ops: import it on use

    timeout = datetime.timedelta(seconds=settings().timeout_s)
    host = socket.gethostname()
    store = None
    if rank == 0:
        store = dist.TCPStore(host, 0, world_size=size, is_master=True, wait_for_workers=False, timeout=timeout)
    hosts = list(comm.allgather(host))
    master, port = comm.bcast((host, store.port) if store is not None else None, root=0)
    if store is None:
        store = dist.TCPStore(master, port, world_size=size, is_master=False, timeout=timeout)
    init_distributed(rank, size, store=store, local_rank=hosts[:rank].count(host), local_size=hosts.count(host))
