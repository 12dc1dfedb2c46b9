"""The environment variables moe_ep reads at run time: read once, on first use, and checked.

| variable                       | default | meaning                                                         |
| ------------------------------ | ------- | --------------------------------------------------------------- |
| `MOE_EP_TIMEOUT_S`             | `100`   | seconds any wait for a peer may last before it becomes an error |
|                                |         | naming the operation (and the peer where it can be known): the  |
|                                |         | torch backend's agreement and collectives, the CUDA kernels     |
|                                |         | (normal and low-latency mode) and the launcher's process group; |
|                                |         | a positive number                                               |
| `MOE_EP_INIT_TIMEOUT_S`        | `600`   | seconds NVSHMEM's initialisation may take (it has no timeout of |
|                                |         | its own and cannot be interrupted: past it the process exits    |
|                                |         | with status 1 and its Python stacks); a positive number         |
| `MOE_EP_CHECK_VALUES`          | `1`     | `0` skips the front end's checks of tensor values (expert ids   |
|                                |         | in range, no repeats), which read device data                   |
| `MOE_EP_LOW_LATENCY_TRANSPORT` | `auto`  | low-latency module: `auto`, `p2p`, `nvshmem` or `nvshmem_puts`  |
|                                |         | (see `backends/cuda_low_latency.py`)                            |
| `MOE_EP_NUM_RANKS_PER_NODE`    | unset   | ranks per node (1-8, dividing the group size) for Buffers that  |
|                                |         | pass no `num_ranks_per_node`: virtual nodes; unset: the hosts   |

Build-time variables (`MOE_EP_BUILD_*`, `MOE_EP_PROFILE`) belong to `setup.py`, and the launcher's
(`RANK`, `WORLD_SIZE`) to `moe_ep/launch.py`. A program that changes a variable after moe_ep has
used it calls `reload()`; tests do the same.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping, Optional

TIMEOUT_ENV = "MOE_EP_TIMEOUT_S"
INIT_TIMEOUT_ENV = "MOE_EP_INIT_TIMEOUT_S"
CHECK_VALUES_ENV = "MOE_EP_CHECK_VALUES"
LOW_LATENCY_TRANSPORT_ENV = "MOE_EP_LOW_LATENCY_TRANSPORT"
LOW_LATENCY_TRANSPORTS = ("auto", "p2p", "nvshmem", "nvshmem_puts")
NUM_RANKS_PER_NODE_ENV = "MOE_EP_NUM_RANKS_PER_NODE"


@dataclass(frozen=True)
class Settings:
    """What the environment asked for; `Settings()` holds the defaults."""

    timeout_s: float = 100.0  # DeepEP's kernels give up after about 100 s too
    init_timeout_s: float = 600.0  # NVSHMEM's start across many nodes takes far longer than one wait
    check_values: bool = True
    low_latency_transport: str = "auto"
    num_ranks_per_node: Optional[int] = None  # checked against the group size by `moe_ep.ops.topology`

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> "Settings":
        """Settings from `environ`; a malformed value raises a `ValueError` naming its variable."""
        defaults = cls()
        return cls(
            timeout_s=_positive_seconds(environ, TIMEOUT_ENV, defaults.timeout_s),
            init_timeout_s=_positive_seconds(environ, INIT_TIMEOUT_ENV, defaults.init_timeout_s),
            check_values=_switch(environ, CHECK_VALUES_ENV, defaults.check_values),
            low_latency_transport=_choice(environ, LOW_LATENCY_TRANSPORT_ENV, LOW_LATENCY_TRANSPORTS,
                                          defaults.low_latency_transport),
            num_ranks_per_node=_optional_int(environ, NUM_RANKS_PER_NODE_ENV),
        )


def _positive_seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a positive number of seconds, got {raw!r}")
    return value


def _optional_int(environ: Mapping[str, str], name: str) -> Optional[int]:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None


def _switch(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name)
    if raw is None:
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name}: expected 0 or 1, got {raw!r}")
    return raw == "1"


def _choice(environ: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    raw = environ.get(name, default)
    if raw not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {raw!r}")
    return raw


_current: Optional[Settings] = None


def settings() -> Settings:
    """The settings of this process, read from the environment on first use."""
    return _current if _current is not None else reload()


def reload() -> Settings:
    """Read the environment again and return the new settings (kept only if every value is valid)."""
    global _current
    _current = Settings.from_environment(os.environ)
    return _current
