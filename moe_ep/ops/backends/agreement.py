"""Each rank's record of one operation, exchanged through the process group's store before any data moves.

Every rank posts a small JSON record under a key numbered by the operation and waits, at most
`MOE_EP_TIMEOUT_S` seconds, for every peer's. Waiting on named keys rather than in a collective has
two consequences the torch backend relies on:

* a peer that never arrives (it exited, it stalls, or it called something else) is named in the error,
  which gloo cannot do (its errors say "Connection reset by peer" or "Timed out" without a rank);
* a wait that gives up leaves no half-done collective in the process group: the rank that gave up
  replaces its record by a note saying so, and a peer arriving late reads the note and raises at once
  instead of going on into the data exchange alone.

Operations are numbered per process and group: every rank issues the same sequence of operations on
a group (the collective contract), so the numbers match. A rank deletes its record of the previous
operation once the current one is agreed: by then every peer has read it.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Iterable, Optional, Sequence

import torch.distributed as dist

from ..settings import settings
from ..validation import PeerInputError

_KEY_PREFIX = "moe_ep/agree"
# Operations numbered so far, per group name, in this process (shared by every backend on the group).
_sequence: dict[str, int] = {}


class PeerTimeoutError(RuntimeError):
    """Raised when a peer did not take part in an operation within `MOE_EP_TIMEOUT_S` seconds (it
    exited, stalled or called another operation), or the process group failed under it."""


def check_same_settings(op: str, names: Iterable[str], per_rank: Sequence[Sequence[int]]) -> None:
    """Raise `PeerInputError` naming the first setting whose value differs between ranks; `per_rank[r]`
    holds rank r's values of `names`, in order (every rank reaches the same verdict from the same table)."""
    for column, name in enumerate(names):
        values = [row[column] for row in per_rank]
        if len(set(values)) > 1:
            raise PeerInputError(f"{op}: ranks disagree on {name}: {values} (rank order)")


def group_store(group: dist.ProcessGroup) -> dist.Store:
    """The store the process group was created with (keys are private to the group)."""
    getter = getattr(group, "get_group_store", None)
    if getter is not None:
        return getter()
    # Releases before the public accessor.
    return dist.distributed_c10d._get_process_group_store(group)


class Agreement:
    """Exchanges one JSON record per rank and operation over `group`'s store (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int) -> None:
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self._store = group_store(group)
        self._name = group.group_name

    def _keys(self, number: int) -> list[str]:
        return [f"{_KEY_PREFIX}/{number}/{rank}" for rank in range(self.num_ranks)]

    def exchange(self, op: str, record: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's `record` for `op`, in rank order; raises `PeerTimeoutError` naming the ranks
        that did not arrive within the timeout, or that gave up waiting before this rank arrived."""
        number = _sequence.get(self._name, 0)
        _sequence[self._name] = number + 1
        keys = self._keys(number)
        timeout_s = settings().timeout_s
        try:
            self._store.set(keys[self.rank], json.dumps({"op": op, **record}))
            missing = self._wait(keys, timeout_s)
            if missing:
                self._store.set(keys[self.rank], json.dumps({"op": op, "gave_up_on": missing}))
                raise PeerTimeoutError(
                    f"{op}: rank(s) {missing} did not arrive within {timeout_s:g} s (MOE_EP_TIMEOUT_S): exited, "
                    f"stalled, or called another operation (this is rank {self.rank})")
            records = [json.loads(value) for value in self._store.multi_get(keys)]
            if number > 0:
                self._store.delete_key(self._keys(number - 1)[self.rank])
        except dist.DistError as exc:
            raise PeerTimeoutError(f"{op}: the process group's store stopped answering ({exc}); the process "
                                   f"serving it (the launcher, or rank 0) has probably exited") from exc
        gave_up = {rank: r["gave_up_on"] for rank, r in enumerate(records) if "gave_up_on" in r}
        if gave_up:
            detail = ", ".join(f"rank {rank} on rank(s) {ranks}" for rank, ranks in gave_up.items())
            raise PeerTimeoutError(f"{op}: peers gave up waiting before this rank ({self.rank}) arrived ({detail}, "
                                   f"after {timeout_s:g} s, MOE_EP_TIMEOUT_S)")
        return records

    def _wait(self, keys: list[str], timeout_s: float) -> Optional[list[int]]:
        """Wait for every key; the ranks whose keys are still missing after `timeout_s` (None: all came)."""
        try:
            self._store.wait(keys, datetime.timedelta(seconds=timeout_s))
            return None
        except dist.DistStoreError:
            missing = [rank for rank, key in enumerate(keys) if not self._store.check([key])]
            return missing or None  # every record arrived as the wait ended
