"""Timing shared by the benchmarks: medians of CUDA-event times (wall clock on a machine without CUDA,
so that a benchmark's CPU smoke run takes the same code path), kernel times from profiler traces, and
the all-to-all baseline."""

from __future__ import annotations

import re
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist


def _device() -> torch.device:
    """Where timing tensors and collectives live: the current GPU, or the CPU without CUDA."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def every_rank(value: float) -> list[float]:
    """`value` of every rank, in rank order."""
    device = _device()
    values = torch.empty(dist.get_world_size(), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(values, torch.tensor([value], dtype=torch.float64, device=device))
    return values.tolist()


def slowest_rank(value: float) -> float:
    """The largest `value` over all ranks: the slowest rank bounds a collective operation."""
    return max(every_rank(value))


def _elapsed_us(fn: Callable[[], object]) -> float:
    """Time of one run of `fn` in microseconds: CUDA events around it, or the wall clock without CUDA."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def local_median_us(fn: Callable[[], object], warmup: int = 5, iters: int = 20,
                    before_each: Optional[Callable[[], None]] = None) -> float:
    """Median GPU time of `fn` in microseconds on this process (CUDA events around each run);
    `before_each` runs untimed before every run, warm-up runs included."""
    times = []
    for i in range(warmup + iters):
        if before_each is not None:
            before_each()
        if i < warmup:
            fn()
        else:
            times.append(_elapsed_us(fn))
    return statistics.median(times)


def sustained_median_us(fn: Callable[[], object], seconds: float, iters: int = 20) -> float:
    """Median GPU time of `fn` (already warmed up) in microseconds over at least `iters` runs and at
    least `seconds` of wall clock: long enough for the clock and power a kernel settles at to show,
    and for a sampler (e.g. `nvidia-smi -lms 100`) to see it."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < iters or time.perf_counter() - start < seconds:
        times.append(_elapsed_us(fn))
    return statistics.median(times)


def _in_step() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def hold_then_start_in_step(matmuls: int = 4) -> None:
    """Keep the GPU busy with matmuls (about 1.5 ms each on a Hopper GPU) while the host queues the work
    that follows, then start every rank together (an all-reduce ends the hold on all of them)."""
    if torch.cuda.is_available():
        hold = torch.randn(8192, 8192, device="cuda")
        for _ in range(matmuls):
            hold @ hold
    dist.all_reduce(torch.ones(1, device=_device()))


def queued_time_us(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Mean GPU time per run of `fn`, the runs queued back to back behind `hold_then_start_in_step`, so
    neither host launch time nor the ranks' host skew is included; the slowest rank's."""
    for _ in range(warmup):
        fn()
    _in_step()
    hold_then_start_in_step()

    def runs() -> None:
        for _ in range(iters):
            fn()

    return slowest_rank(_elapsed_us(runs) / iters)


def median_time_us(fn: Callable[[], object], warmup: int, iters: int,
                   before_each: Optional[Callable[[], None]] = None) -> float:
    """Median GPU time of `fn` with every run started in step on all ranks; the slowest rank's.
    `before_each` runs untimed before every run (e.g. the dispatch a timed combine needs)."""
    def prepare() -> None:
        if before_each is not None:
            before_each()
        _in_step()

    return slowest_rank(local_median_us(fn, warmup, iters, before_each=prepare))


def median_time_us_per_rank(fn: Callable[[], object], warmup: int, iters: int) -> list[float]:
    """Median GPU time of `fn` on every rank, runs started in step on all ranks."""
    return every_rank(local_median_us(fn, warmup, iters, before_each=_in_step))


def _cuda_kernels(prof: object) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_median_us(fn: Callable[[], object], kernels: dict[str, str], iters: int) -> dict[str, float]:
    """Median device time of single kernels inside `fn`, read from a torch profiler (kineto) trace, as
    DeepEP's benchmarks time its kernels: `kernels` maps a label to a regular expression searched in
    the kernel's name (NaN for a label no kernel matched, and for every label without CUDA).
    Runs are started in step on all ranks; the slowest rank's medians are returned."""
    from torch.profiler import ProfilerActivity, profile

    durations: dict[str, list[float]] = {label: [] for label in kernels}
    if torch.cuda.is_available():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                _in_step()
                fn()
            torch.cuda.synchronize()
        for event in _cuda_kernels(prof):
            for label, pattern in kernels.items():
                if re.search(pattern, event.name):
                    durations[label].append(event.time_range.elapsed_us())
    return {label: slowest_rank(statistics.median(times) if times else float("nan"))
            for label, times in durations.items()}


def kernel_times_by_launch_us(fn: Callable[[], object], pattern: str, names: list[str], warmup: int, iters: int,
                              queued: bool = True) -> list[float]:
    """Median durations of the kernels whose names match `pattern` that `fn` launches, one entry per
    launch of an iteration (in launch order; `names` says what each is: `fn` must launch exactly that
    many matching kernels); the slowest rank's. NaN for each without CUDA.

    `queued` (as DeepEP's benchmarks time the low-latency kernels): a long matmul holds the GPU while the
    host queues every iteration, then an all-reduce starts all ranks together, so the kernels run back to
    back in step. Without it, each iteration starts when the host launches it, and a kernel also holds
    the wait for the slowest rank's launch."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    _in_step()
    if not torch.cuda.is_available():
        for _ in range(iters):
            fn()
        return [float("nan")] * len(names)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if queued:
            hold_then_start_in_step()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in _cuda_kernels(prof) if re.search(pattern, e.name)), key=lambda e: e.time_range.start)
    if len(kernels) != iters * len(names):
        raise RuntimeError(f"profiler saw {len(kernels)} kernels matching {pattern!r}, expected {iters * len(names)} "
                           f"({iters} iterations of {', '.join(names)})")
    per_slot = [[kernels[i * len(names) + j].time_range.elapsed_us() for i in range(iters)] for j in range(len(names))]
    return [slowest_rank(statistics.median(times)) for times in per_slot]


def all_to_all_rows(send_counts: list[int], recv_counts: list[int], row_bytes: int,
                    device: torch.device) -> Callable[[], object]:
    """`all_to_all_single` moving `send_counts[r]` rows of `row_bytes` bytes to each rank r and receiving
    `recv_counts[r]` from it (the baseline a benchmark compares its exchange with)."""
    send = torch.randint(0, 255, (sum(send_counts), row_bytes), dtype=torch.uint8, device=device)
    recv = torch.empty(sum(recv_counts), row_bytes, dtype=torch.uint8, device=device)
    return lambda: dist.all_to_all_single(recv, send, recv_counts, send_counts)
