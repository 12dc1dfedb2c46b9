"""Timing shared by the benchmarks: CUDA-event medians, every run started in step on all ranks."""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.distributed as dist


def slowest_rank(value: float) -> float:
    """The largest `value` over all ranks: the slowest rank bounds a collective operation."""
    tensor = torch.tensor([value], device="cuda")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def median_time_us(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median GPU time of `fn` in microseconds (CUDA events after a host barrier), slowest rank."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return slowest_rank(statistics.median(times))
