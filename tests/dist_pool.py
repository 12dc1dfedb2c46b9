"""Persistent pools of worker processes, one pool per (backend, world size), shared by the tests.

A test sends a module-level function to every rank of a pool; each rank runs `fn(rank, world, *args)`
inside an initialized process group and the results come back in rank order. Spawning once per
world size keeps the suite fast on two cores; a pool whose ranks stop answering is torn down, so a
hang becomes a test failure after `timeout` seconds, and a worker that dies is reported within seconds.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import queue
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_ep.launch import gpu_for_rank

GLOO_TIMEOUT_S = 30
FAILURE_GRACE_S = 15
POLL_S = 5  # how often a waiting pool checks that its workers are alive
STACK_WAIT_S = 1.0  # how long a hang report waits for the hung ranks to write their stacks
# Caps every run's timeout (seconds), so that a device run hunting a hang gets its stacks early.
RUN_TIMEOUT_CAP_ENV = "MOE_EP_TEST_RUN_TIMEOUT_S"
# Pool backend: gloo, with the ranks dealt round-robin over the visible GPUs, several to a GPU when
# the world is larger than the machine (NCCL refuses two ranks on one GPU), evenly (`gpu_for_rank`).
SHARED_GPUS = "gloo_shared_gpus"


def gpu_pool_backend(world: int) -> str:
    """The pool backend `gpu_pool` uses for `world` ranks on this machine: "nccl" with a GPU per rank when
    there are enough GPUs, else `SHARED_GPUS`."""
    return "nccl" if torch.cuda.device_count() >= world else SHARED_GPUS


def gpu_worlds(*worlds: int, most_sharing: int = 8) -> list:
    """`worlds` as pytest parameters for `gpu_pool`: a world runs with a GPU per rank where the machine
    has enough GPUs, else with its ranks sharing the GPUs when there are at most `most_sharing` of them
    (per test: what fits in GPU memory and time), else it is skipped with the reason."""
    count = torch.cuda.device_count()
    params = []
    for world in worlds:
        fits = count >= world or (count > 0 and world <= most_sharing)
        reason = f"{world} ranks need {world} GPUs (found {count}); ranks sharing GPUs are tested up to {most_sharing}"
        params.append(pytest.param(world, marks=() if fits else pytest.mark.skip(reason=reason)))
    return params


def _stack_file(pool_id: str, rank: int) -> str:
    """Where rank `rank` of a pool writes its Python stacks when the pool finds it hung."""
    return os.path.join(tempfile.gettempdir(), f"moe_ep_pool_{pool_id}_rank{rank}.txt")


def _worker(rank: int, world: int, port: int, backend: str, tasks: Any, results: Any, pool_id: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A rank that stops answering is asked for its stacks (SIGUSR1); they land in the hang report.
    stack_file = open(_stack_file(pool_id, rank), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    import torch

    torch.set_num_threads(1)
    options = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        options["device_id"] = torch.device("cuda", rank)
    elif backend == SHARED_GPUS:
        torch.cuda.set_device(gpu_for_rank(rank, world, torch.cuda.device_count()))
        backend = "gloo"
    timeout = datetime.timedelta(seconds=GLOO_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **options)
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
    """`world` spawned ranks in one process group: gloo on CPU, NCCL with GPU `rank` per rank, or
    `SHARED_GPUS`."""

    def __init__(self, world: int, backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        # The pool serves the rendezvous itself on a port the OS assigns when it binds: a port picked
        # first and bound later by a worker can be taken in between (NVSHMEM and NCCL open sockets too).
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
        port = self.store.port
        self.pool_id = f"{os.getpid()}_{port}"
        self.procs = [ctx.Process(target=_worker,
                                  args=(r, world, port, backend, self.tasks[r], self.results, self.pool_id),
                                  daemon=True)
                      for r in range(world)]
        for proc in self.procs:
            proc.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 240, **kwargs: Any) -> list[Any]:
        """Run `fn(rank, world, *args, **kwargs)` on every rank; raise if any rank failed or died."""
        timeout = min(timeout, float(os.environ.get(RUN_TIMEOUT_CAP_ENV, timeout)))
        for task_queue in self.tasks:
            task_queue.put((fn, args, kwargs))
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        failed_at: Optional[float] = None  # once a rank has failed or died, its peers get a short grace
        while len(outcomes) < self.world:
            now = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + FAILURE_GRACE_S)
            if now >= limit:
                break
            try:
                rank, ok, value = self.results.get(timeout=min(POLL_S, limit - now))
                outcomes[rank] = (ok, value)
                if not ok and failed_at is None:
                    failed_at = time.monotonic()
            except queue.Empty:
                # A worker that died (segfault, abort, the NCCL watchdog) never answers: say so at once.
                for rank, proc in enumerate(self.procs):
                    if rank not in outcomes and not proc.is_alive():
                        outcomes[rank] = (False, f"worker process died (exit code {proc.exitcode})")
                        failed_at = failed_at or time.monotonic()
        missing = sorted(set(range(self.world)) - set(outcomes))
        self.broken = bool(missing) or any(not proc.is_alive() for proc in self.procs)
        failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
        if missing:
            failures.append(f"ranks {missing} did not answer within {timeout} s (hang)" if not failures
                            else f"ranks {missing} stopped answering after the failure above")
            failures += self._stacks(missing)
        if failures:
            raise AssertionError("\n".join(failures))
        return [outcomes[r][1] for r in range(self.world)]

    def _stacks(self, ranks: list[int]) -> list[str]:
        """The Python stacks of the ranks that still run (each writes its own on SIGUSR1)."""
        alive = [r for r in ranks if self.procs[r].is_alive()]
        for r in alive:
            os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(STACK_WAIT_S if alive else 0)
        stacks = []
        for r in alive:
            path = _stack_file(self.pool_id, r)
            text = open(path).read() if os.path.exists(path) else "(it wrote none)"
            stacks.append(f"--- rank {r}, where it waits ---\n{text}")
        return stacks

    def close(self) -> None:
        for task_queue in self.tasks:
            task_queue.put(None)
        for proc in self.procs:
            proc.join(timeout=1 if self.broken else 10)  # a hung rank will not take its task
            if proc.is_alive():
                proc.kill()
        for rank in range(self.world):
            try:
                os.remove(_stack_file(self.pool_id, rank))
            except FileNotFoundError:
                pass
