"""Timing shared by the benchmarks: medians of CUDA-event times."""

from __future__ import annotations

import re
import statistics
from typing import Callable, Optional

import torch
import torch.distributed as dist


def every_rank(value: float) -> list[float]:
    """`value` of every rank, in rank order."""
    values = torch.empty(dist.get_world_size(), dtype=torch.float64, device="cuda")
    dist.all_gather_into_tensor(values, torch.tensor([value], dtype=torch.float64, device="cuda"))
    return values.tolist()


def slowest_rank(value: float) -> float:
    """The largest `value` over all ranks: the slowest rank bounds a collective operation."""
    return max(every_rank(value))


def local_median_us(fn: Callable[[], object], warmup: int = 5, iters: int = 20,
                    before_each: Optional[Callable[[], None]] = None) -> float:
    """Median GPU time of `fn` in microseconds on this process (CUDA events around each run)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if before_each is not None:
            before_each()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _in_step() -> None:
    torch.cuda.synchronize()
    dist.barrier()


def hold_then_start_in_step(matmuls: int = 4) -> None:
    """Keep the GPU busy with matmuls (about 1.5 ms each on a Hopper GPU) while the host queues the work
    that follows, then start every rank together (an all-reduce ends the hold on all of them)."""
    hold = torch.randn(8192, 8192, device="cuda")
    for _ in range(matmuls):
        hold @ hold
    dist.all_reduce(torch.ones(1, device="cuda"))


def queued_time_us(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Mean GPU time per run of `fn`, the runs queued back to back behind `hold_then_start_in_step`, so
    neither host launch time nor the ranks' host skew is included; the slowest rank's."""
    for _ in range(warmup):
        fn()
    _in_step()
    hold_then_start_in_step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return slowest_rank(start.elapsed_time(end) * 1e3 / iters)


def median_time_us(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median GPU time of `fn` with every run started in step on all ranks; the slowest rank's."""
    return slowest_rank(local_median_us(fn, warmup, iters, before_each=_in_step))


def median_time_us_per_rank(fn: Callable[[], object], warmup: int, iters: int) -> list[float]:
    """Median GPU time of `fn` on every rank, runs started in step on all ranks."""
    return every_rank(local_median_us(fn, warmup, iters, before_each=_in_step))


def kernel_median_us(fn: Callable[[], object], kernels: dict[str, str], iters: int) -> dict[str, float]:
    """Median device time of single kernels inside `fn`, read from a torch profiler (kineto) trace, as
    DeepEP's benchmarks time its kernels: `kernels` maps a label to a regular expression searched in
    the kernel's name.
    Runs are started in step on all ranks; the slowest rank's medians are returned."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            _in_step()
            fn()
        torch.cuda.synchronize()
    durations: dict[str, list[float]] = {label: [] for label in kernels}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        for label, pattern in kernels.items():
            if re.search(pattern, event.name):
                durations[label].append(event.time_range.elapsed_us())
    return {label: slowest_rank(statistics.median(times) if times else float("nan"))
            for label, times in durations.items()}
