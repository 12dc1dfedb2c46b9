"""The test process pool itself: a worker that dies is reported at once, not after the hang timeout; a
worker that hangs is reported with its Python stack, after the timeout (capped from the environment)."""

from __future__ import annotations

import os
import time

import pytest

from dist_pool import FAILURE_GRACE_S, POLL_S, RUN_TIMEOUT_CAP_ENV, DistPool


def _rank_one_dies(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)  # no exception, no answer: what a segfault or a watchdog abort looks like
    return rank


def _identity(rank: int, world: int) -> int:
    return rank


def _rank_one_hangs(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)  # what a rank stuck in a collective or a kernel wait looks like from the pool
    return rank


def test_dead_worker_is_reported_with_its_exit_code() -> None:
    pool = DistPool(2)
    try:
        assert pool.run(_identity) == [0, 1]
        started = time.monotonic()
        with pytest.raises(AssertionError, match=r"rank 1 ---\nworker process died \(exit code 3\)"):
            pool.run(_rank_one_dies, timeout=120)
        assert time.monotonic() - started < 2 * POLL_S + FAILURE_GRACE_S
        assert pool.broken
    finally:
        pool.close()


def test_hung_worker_is_reported_with_its_stack() -> None:
    pool = DistPool(2)
    try:
        assert pool.run(_identity) == [0, 1]
        started = time.monotonic()
        with pytest.raises(AssertionError) as failure:
            pool.run(_rank_one_hangs, timeout=3)
        message = str(failure.value)
        assert "ranks [1] did not answer within 3 s (hang)" in message
        assert "--- rank 1, where it waits ---" in message and "_rank_one_hangs" in message
        assert time.monotonic() - started < 3 + POLL_S + 5
        assert pool.broken
    finally:
        pool.close()


def test_run_timeout_cap_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = DistPool(2)
    try:
        assert pool.run(_identity) == [0, 1]  # both ranks up: spawning alone can take seconds on a busy machine
        monkeypatch.setenv(RUN_TIMEOUT_CAP_ENV, "2")
        started = time.monotonic()
        with pytest.raises(AssertionError, match=r"ranks \[1\] did not answer within 2.0 s \(hang\)"):
            pool.run(_rank_one_hangs, timeout=120)
        assert time.monotonic() - started < 2 + POLL_S + 5
    finally:
        pool.close()
