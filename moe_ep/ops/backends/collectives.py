"""Small tensor collectives shared by the backends (no pickled objects travel)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup,
                    async_op: bool = False) -> Optional[dist.Work]:
    """`output [R * n]` = every rank's `tensor [n]`, rank-major (with `async_op`, once the returned work is waited for)."""
    # torch 2.13 renames all_gather_into_tensor; older releases only have the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def all_gather_bytes(record: bytes, group: dist.ProcessGroup, num_ranks: int, device: torch.device) -> list[bytes]:
    """Every rank's `record` (the same length on every rank), in rank order."""
    mine = torch.frombuffer(bytearray(record), dtype=torch.uint8).to(device)
    table = torch.empty(num_ranks * mine.numel(), dtype=torch.uint8, device=device)
    all_gather_into(table, mine, group)
    return [bytes(row.tolist()) for row in table.view(num_ranks, -1).cpu()]


def broadcast_bytes(record: Optional[bytes], size: int, group: dist.ProcessGroup, device: torch.device) -> bytes:
    """The group's first rank's `record` (`size` bytes; None elsewhere) on every rank."""
    tensor = torch.zeros(size, dtype=torch.uint8, device=device)
    if record is not None:
        tensor.copy_(torch.frombuffer(bytearray(record), dtype=torch.uint8))
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    return bytes(tensor.cpu().tolist())
