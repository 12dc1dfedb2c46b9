"""What each call did on the GPU, read from a torch profiler (kineto) trace in Chrome's JSON format.

A call is the span of a `record_function` annotation; its GPU work is every kernel, memset and copy
the host launched inside that span (the trace links GPU work to its runtime call by `correlation`),
or, for GPU work without that link, what started on the GPU between the call's start and the next
call's (the caller synchronizes after each call). For each launch: the GPU time, and when it started
on the GPU and when the host launched it, both counted from the call's start.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Optional

GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")


def short_name(name: str, category: str) -> str:
    """A kernel's function name without namespaces, template and function arguments; `memset` and
    `memcpy <kind>` for the others."""
    if category == "gpu_memset":
        return "memset"
    if category == "gpu_memcpy":
        words = name.split()
        return "memcpy " + words[1] if len(words) > 1 else "memcpy"
    plain = name.replace("(anonymous namespace)::", "")
    plain = plain[len("void "):] if plain.startswith("void ") else plain
    plain = plain.split("(", 1)[0].split("<", 1)[0]
    return plain.rsplit("::", 1)[-1].strip() or name


@dataclass(frozen=True)
class Launch:
    name: str
    gpu_us: float  # how long it ran
    start_us: float  # when it started on the GPU, from the call's start
    launched_us: Optional[float]  # when the host launched it, from the call's start (None: not linked)


@dataclass(frozen=True)
class Call:
    host_us: float  # the annotation's span: the call on the host (under the profiler)
    launches: tuple[Launch, ...]

    @property
    def gpu_end_us(self) -> Optional[float]:
        """When its last GPU work ended, from the call's start."""
        return max((l.start_us + l.gpu_us for l in self.launches), default=None)

    @property
    def gpu_busy_us(self) -> float:
        """GPU time covered by at least one of its launches."""
        busy, reach = 0.0, -math.inf
        for launch in sorted(self.launches, key=lambda l: l.start_us):
            end = launch.start_us + launch.gpu_us
            busy += max(0.0, end - max(reach, launch.start_us))
            reach = max(reach, end)
        return busy


def calls_in_trace(trace: dict[str, Any], prefix: str) -> list[Call]:
    """Every call annotated with a name starting with `prefix`, in order, with its GPU work."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = sorted((e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix)),
                   key=lambda e: float(e["ts"]))
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: float(e["ts"]))
    launched_at = {e["args"]["correlation"]: float(e["ts"]) for e in events
                   if e.get("cat") in RUNTIME_CATEGORIES and "correlation" in e.get("args", {})}
    calls = []
    for i, mark in enumerate(marks):
        begin, span = float(mark["ts"]), float(mark.get("dur", 0.0))
        next_begin = float(marks[i + 1]["ts"]) if i + 1 < len(marks) else math.inf
        launches = []
        for event in gpu:
            start = float(event["ts"])
            at = launched_at.get(event.get("args", {}).get("correlation"))
            mine = (begin <= at <= begin + span) if at is not None else (begin <= start < next_begin)
            if mine:
                launches.append(Launch(short_name(str(event["name"]), event["cat"]), float(event.get("dur", 0.0)),
                                       start - begin, None if at is None else at - begin))
        calls.append(Call(span, tuple(launches)))
    return calls


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def summarize(calls: list[Call]) -> dict[str, Any]:
    """Medians over `calls`: per kernel name (in launch order), launches per call, GPU time per launch,
    GPU start and host launch from the call's start; per call, the GPU time covered, the end of its
    last GPU work and the host's time (all in us)."""
    names: list[str] = []
    by_name: dict[str, list[Launch]] = {}
    for call in calls:
        for launch in sorted(call.launches, key=lambda l: l.start_us):
            if launch.name not in by_name:
                names.append(launch.name)
                by_name[launch.name] = []
            by_name[launch.name].append(launch)
    kernels = []
    for name in names:
        launches = by_name[name]
        kernels.append({
            "name": name,
            "launches_per_call": len(launches) / max(len(calls), 1),
            "gpu_us": _median([l.gpu_us for l in launches]),
            "start_us": _median([l.start_us for l in launches]),
            "launched_us": _median([l.launched_us for l in launches if l.launched_us is not None]),
        })
    return {
        "calls": len(calls),
        "kernels": kernels,
        "gpu_busy_us": _median([c.gpu_busy_us for c in calls if c.launches]),
        "gpu_end_us": _median([c.gpu_end_us for c in calls if c.gpu_end_us is not None]),
        "host_us_profiled": _median([c.host_us for c in calls]),
    }
