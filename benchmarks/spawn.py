"""One process per rank for the benchmarks that start their own ranks (a worker that ends with os._exit,
as NVSHMEM is never finalized), and the wait for their report."""

from __future__ import annotations

import queue
import time
from typing import Any, Callable

import torch.multiprocessing as mp

from moe_ep.launch import free_port


def run_ranks(worker: Callable[..., None], world: int, args: Any, timeout_s: float) -> Any:
    """Start `worker(rank, world, port, args, results)` for every rank and return the first item a rank
    puts on `results`; raises if a rank exits with an error or nothing arrives within `timeout_s`.
    The ranks are joined (killed after 30 s) before returning."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(rank, world, port, args, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                return results.get(timeout=5)
            except queue.Empty:
                dead = [rank for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"world {world}: ranks {dead} died" if dead else
                                       f"world {world}: no result within {timeout_s:g} s")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
