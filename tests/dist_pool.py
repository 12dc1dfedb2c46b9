"""Persistent pools of worker processes, one pool per (backend, world size), shared by the tests.

A test sends a module-level function to every rank of a pool; each rank runs `fn(rank, world, *args)`
inside an initialized process group and the results come back in rank order. Spawning once per
world size keeps the suite fast on two cores; a pool whose ranks stop answering is torn down, so a
hang becomes a test failure after `timeout` seconds.
"""

from __future__ import annotations

import datetime
import os
import queue
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from moe_ep.launch import free_port

GLOO_TIMEOUT_S = 30
FAILURE_GRACE_S = 15


def _worker(rank: int, world: int, port: int, backend: str, tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    options = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        options["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S), **options)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(rank, world, *args, **kwargs)))
        except BaseException:  # report everything, the test decides
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    """`world` spawned ranks in one process group: gloo on CPU, or NCCL with GPU `rank` per rank."""

    def __init__(self, world: int, backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, backend, self.tasks[r], self.results),
                                daemon=True)
                      for r in range(world)]
        for proc in self.procs:
            proc.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 240, **kwargs: Any) -> list[Any]:
        """Run `fn(rank, world, *args, **kwargs)` on every rank; raise if any rank failed."""
        for task_queue in self.tasks:
            task_queue.put((fn, args, kwargs))
        outcomes: dict[int, tuple[bool, Any]] = {}
        missing: list[int] = []
        try:
            while len(outcomes) < self.world:
                # Once a rank has failed, its peers may wait on it inside a collective forever: give
                # them a short grace, then report the failure rather than a hang.
                failed = any(not ok for ok, _ in outcomes.values())
                rank, ok, value = self.results.get(timeout=min(timeout, FAILURE_GRACE_S) if failed else timeout)
                outcomes[rank] = (ok, value)
        except queue.Empty:
            self.broken = True
            missing = sorted(set(range(self.world)) - set(outcomes))
        failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
        if missing:
            failures.append(f"ranks {missing} did not answer within {timeout} s (hang)" if not failures
                            else f"ranks {missing} stopped answering after the failure above")
        if failures:
            raise AssertionError("\n".join(failures))
        return [outcomes[r][1] for r in range(self.world)]

    def close(self) -> None:
        for task_queue in self.tasks:
            task_queue.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
