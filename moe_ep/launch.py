"""A small launcher for examples and scripts: run `fn` on N ranks of one machine.

Under `torchrun` (RANK/WORLD_SIZE set) it joins that job. Otherwise it spawns `world_size` processes.
Either way the ranks of one host get NCCL with one GPU each when the host has enough GPUs for them
(`LOCAL_WORLD_SIZE` under torchrun); gloo with the ranks dealt evenly over the GPUs when there are fewer
GPUs than ranks (`gpu_for_rank`; NCCL refuses two ranks on one GPU; the CUDA kernels work between
processes sharing a GPU, which take turns on it: right results, not multi-GPU speed); gloo on the CPU
without GPUs.

The process group waits at most `MOE_EP_TIMEOUT_S` for a peer (`moe_ep.ops.settings`). When ranks fail,
the launcher waits for the others to fail too (they do within that timeout), then raises one error
that shows every failed rank's traceback, the ranks' own errors first and the errors they caused on
their peers (`PeerInputError`, a lost connection) after: the first error to arrive is often a
peer's, which says nothing about the cause.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .ops.backends.agreement import PeerTimeoutError
from .ops.settings import settings
from .ops.validation import PeerInputError

# How long the launcher lets the other ranks run on after a rank failed, beyond the timeout.
_FAILURE_GRACE_S = 5.0
_POLL_S = 0.2


class RankFailure(NamedTuple):
    """What a spawned rank reports when `fn` (or joining the group) raised."""

    rank: int
    caused_by_peer: bool  # a consequence of another rank's failure (its error says so)
    traceback: str


def free_port() -> int:
    """An unused TCP port on the loopback interface, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gpu_for_rank(local_rank: int, local_size: int, num_gpus: int) -> int:
    """The GPU of the `local_rank`-th of the `local_size` ranks of a host with `num_gpus` GPUs: its own
    where there are enough, else dealt round-robin over the most GPUs that take the same number of ranks
    each (6 ranks on 4 GPUs: 3 GPUs with 2), since NVSHMEM's initialisation hangs when a host's GPUs hold
    different numbers of ranks (`check_even_gpu_sharing`)."""
    used = max(g for g in range(1, min(num_gpus, local_size) + 1) if local_size % g == 0)
    return local_rank % used


def init_distributed(rank: int, world_size: int, timeout_s: Optional[float] = None,
                     store: Optional[dist.Store] = None, local_rank: Optional[int] = None,
                     local_size: Optional[int] = None) -> torch.device:
    """Initialize the default process group for this rank (rendezvous through `store`, else the
    environment); returns the device it should use. `timeout_s` defaults to `MOE_EP_TIMEOUT_S`.
    `local_rank` / `local_size`: this rank's index among the ranks of its host, and their number (default:
    every rank on this host); NCCL is chosen when the host has a GPU for each of them."""
    if local_rank is None or local_size is None:
        local_rank, local_size = rank, world_size
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda", gpu_for_rank(local_rank, local_size, num_gpus)) if num_gpus else torch.device("cpu")
    use_nccl = num_gpus >= local_size
    if num_gpus:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=settings().timeout_s if timeout_s is None else timeout_s)
    dist.init_process_group("nccl" if use_nccl else "gloo", rank=rank, world_size=world_size, timeout=timeout,
                            **({"store": store} if store is not None else {}),
                            **({"device_id": device} if use_nccl else {}))
    return device


def _caused_by_peer(exc: BaseException) -> bool:
    """Whether `exc` reports another rank's failure rather than this rank's own."""
    if isinstance(exc, (PeerInputError, PeerTimeoutError, dist.DistError)):
        return True
    # gloo reports a peer that went away as a plain RuntimeError ("Connection reset by peer").
    return isinstance(exc, RuntimeError) and "by peer" in str(exc)


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, failures: Any) -> None:
    try:
        timeout = datetime.timedelta(seconds=settings().timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        device = init_distributed(rank, world_size, store=store)
        try:
            fn(rank, world_size, device, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # every failure goes to the launcher, which shows them in order
        failures.put(RankFailure(rank, _caused_by_peer(exc), traceback.format_exc()))
        sys.exit(1)


def launch(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run `fn(rank, world_size, device, *args)` on every rank (see the module docstring)."""
    # A launcher reads its job's variables from the environment (torchrun's contract); the library
    # itself reads `moe_ep.ops.settings`.
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = init_distributed(rank, world, local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                                  local_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        try:
            fn(rank, world, device, *args)
        finally:
            dist.destroy_process_group()
        return
    _spawn(fn, world_size, args)


def _spawn(fn: Callable[..., Any], world_size: int, args: tuple) -> None:
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    # The launcher serves the rendezvous store itself, so that it outlives any rank that fails.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=settings().timeout_s))
    procs = [ctx.Process(target=_entry, args=(rank, world_size, store.port, fn, args, failures))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    reports: dict[int, RankFailure] = {}
    try:
        stopped = _wait_for_ranks(procs, failures, reports)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    for rank, proc in enumerate(procs):
        if proc.exitcode != 0 and rank not in reports:
            why = (f"still running {settings().timeout_s + _FAILURE_GRACE_S:g} s after another rank failed: stopped"
                   if rank in stopped else f"exited with code {proc.exitcode} without a Python error")
            reports[rank] = RankFailure(rank, rank in stopped, why + "\n")
    if reports:
        raise RuntimeError(_report(reports, world_size))


def _wait_for_ranks(procs: list, failures: Any, reports: dict[int, RankFailure]) -> set[int]:
    """Collect the ranks' failure reports until every rank ended; once one failed, the others get the
    timeout (plus a grace) to end. Returns the ranks stopped after that."""
    failed_at: Optional[float] = None
    while True:
        try:
            report = failures.get(timeout=_POLL_S)
            reports[report.rank] = report
        except queue.Empty:
            pass
        if failed_at is None and (reports or any(p.exitcode not in (None, 0) for p in procs)):
            failed_at = time.monotonic()
        if all(p.exitcode is not None for p in procs):
            if failed_at is not None:
                _drain(failures, reports)
            return set()
        if failed_at is not None and time.monotonic() - failed_at > settings().timeout_s + _FAILURE_GRACE_S:
            _drain(failures, reports)
            return {rank for rank, p in enumerate(procs) if p.exitcode is None}


def _drain(failures: Any, reports: dict[int, RankFailure]) -> None:
    while True:
        try:
            report = failures.get(timeout=_POLL_S)
        except queue.Empty:
            return
        reports[report.rank] = report


def _report(reports: dict[int, RankFailure], world_size: int) -> str:
    """Every failed rank's traceback: the ranks' own errors first, then those their peers caused."""
    ordered = sorted(reports.values(), key=lambda r: (r.caused_by_peer, r.rank))
    lines = [f"{len(reports)} of {world_size} ranks failed; each rank's own error first, then the errors it caused "
             f"on its peers:"]
    for r in ordered:
        kind = "caused by another rank" if r.caused_by_peer else "its own error"
        lines.append(f"\n--- rank {r.rank} ({kind}) ---\n{r.traceback.rstrip()}")
    return "\n".join(lines)
