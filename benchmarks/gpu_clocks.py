"""The GPU's SM clock, power and temperature sampled by `nvidia-smi` while a benchmark runs, so that a
kernel held back by the power cap (the board lowering its clock) is told apart from a slow kernel.

One `nvidia-smi --query-gpu=... -lms 100` process runs in the background for the sampler's lifetime and
a reader thread stamps every line it prints with the host clock; `ClockSampler.window()` keeps the
samples printed while its block ran (a timed loop) and summarises them: median, min and max SM clock,
the board's maximum SM clock, median and max power, the power limit, the highest temperature. Without
`nvidia-smi`, or where it cannot read the GPU, every value is None and `reason` says why.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple, Optional

QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu"
INTERVAL_MS = 100
PROBE_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 3.0


class Sample(NamedTuple):
    """One line of `nvidia-smi --query-gpu=QUERY`: None for a field the board does not report."""
    sm_clock_mhz: Optional[float]
    max_sm_clock_mhz: Optional[float]
    power_w: Optional[float]
    power_limit_w: Optional[float]
    temperature_c: Optional[float]


def _number(field: str) -> Optional[float]:
    try:
        return float(field)
    except ValueError:  # "[N/A]", "[Not Supported]", ...
        return None


def parse_sample(line: str) -> Optional[Sample]:
    """A `--format=csv,noheader,nounits` line of QUERY's five fields; None for any other line (an
    error message, a blank line) or one whose SM clock is not a number."""
    fields = [f.strip() for f in line.strip().split(",")]
    if len(fields) != len(Sample._fields):
        return None
    sample = Sample(*(_number(f) for f in fields))
    return sample if sample.sm_clock_mhz is not None else None


def _median(values: list[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _extreme(values: list[Optional[float]], pick: Callable[[list[float]], float]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return pick(known) if known else None


def summarize(samples: list[Sample], reason: Optional[str] = None) -> dict:
    """Median / min / max SM clock (MHz), the maximum SM clock, median / max power (W), the power limit,
    the highest temperature (C) and the number of samples; without samples, None values and `reason`."""
    clocks = [s.sm_clock_mhz for s in samples]
    powers = [s.power_w for s in samples]
    return {
        "samples": len(samples),
        "sm_clock_mhz": _median(clocks),
        "sm_clock_min_mhz": _extreme(clocks, min),
        "sm_clock_max_mhz": _extreme(clocks, max),
        "max_sm_clock_mhz": _median([s.max_sm_clock_mhz for s in samples]),
        "power_w": _median(powers),
        "power_max_w": _extreme(powers, max),
        "power_limit_w": _median([s.power_limit_w for s in samples]),
        "temperature_max_c": _extreme([s.temperature_c for s in samples], max),
        **({} if samples else {"reason": reason or "no nvidia-smi sample during the run"}),
    }


def gpu_id_candidates(uuid: Optional[str], cuda_index: int, visible_devices: Optional[str]) -> list[str]:
    """What to pass `nvidia-smi -i` for the CUDA device `cuda_index`, best first: its UUID (the same
    under any CUDA_VISIBLE_DEVICES or device order), the entry of CUDA_VISIBLE_DEVICES it maps to,
    its index itself. `uuid` as torch prints it (with or without the "GPU-" prefix)."""
    candidates = []
    if uuid:
        candidates.append(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    entries = [e.strip() for e in visible_devices.split(",")] if visible_devices else []
    if cuda_index < len(entries) and entries[cuda_index]:
        candidates.append(entries[cuda_index])
    candidates.append(str(cuda_index))
    return list(dict.fromkeys(candidates))


def _command(gpu: str, loop: bool) -> list[str]:
    command = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", gpu]
    if not loop:
        return command
    # Line-buffered output where `stdbuf` exists: each sample must reach the reader when it is taken.
    return (["stdbuf", "-oL"] if shutil.which("stdbuf") else []) + command + ["-lms", str(INTERVAL_MS)]


def find_gpu(candidates: list[str]) -> tuple[Optional[str], Optional[str]]:
    """`(the first candidate nvidia-smi reads a sample of, None)`, or `(None, why none)`."""
    if shutil.which("nvidia-smi") is None:
        return None, "nvidia-smi not found"
    errors = []
    for gpu in candidates:
        try:
            done = subprocess.run(_command(gpu, loop=False), capture_output=True, text=True,
                                  timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as error:
            errors.append(f"-i {gpu}: {type(error).__name__}: {error}")
            continue
        if done.returncode == 0 and any(parse_sample(line) for line in done.stdout.splitlines()):
            return gpu, None
        errors.append(f"-i {gpu}: rc={done.returncode} {(done.stdout + done.stderr).strip()[:200]}")
    return None, "; ".join(errors) or "no GPU id to try"


class ClockSampler:
    """`nvidia-smi` sampling GPU `gpu` every INTERVAL_MS in the background while the `with` block runs;
    `window()` summarises the samples taken during its own block. With `gpu` None (no nvidia-smi, or
    no id it reads), windows hold None values and `reason`."""

    def __init__(self, gpu: Optional[str], reason: Optional[str] = None) -> None:
        self.gpu = gpu
        self.reason = reason if gpu is None else None
        self._process: Optional[subprocess.Popen] = None
        self._reader: Optional[threading.Thread] = None
        self._stamped: list[tuple[float, Sample]] = []
        self._note = ""  # the last line that was not a sample (an error message)

    def __enter__(self) -> "ClockSampler":
        if self.gpu is None:
            return self
        try:
            self._process = subprocess.Popen(_command(self.gpu, loop=True), stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True, bufsize=1)
        except OSError as error:
            self.reason = f"nvidia-smi did not start: {error}"
            return self
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        """Until nvidia-smi exits: every sample with the time it arrived, and the last other line."""
        for line in self._process.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self._stamped.append((time.monotonic(), sample))
            elif line.strip():
                self._note = line.strip()[:200]

    def __exit__(self, *exc: object) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=STOP_TIMEOUT_S)
        self._process.stdout.close()

    def _why_none(self) -> str:
        if self.reason is not None:
            return self.reason
        if self._process is not None and self._process.poll() is not None:
            return f"nvidia-smi exited with {self._process.returncode}: {self._note}"
        return f"no nvidia-smi sample during the run (one every {INTERVAL_MS} ms)"

    @contextmanager
    def window(self) -> Iterator[dict]:
        """Yields a dict that, when the block ends, holds `summarize` of the samples taken during it."""
        stats: dict = {}
        start = time.monotonic()
        yield stats
        end = time.monotonic()
        samples = [s for t, s in list(self._stamped) if start <= t <= end]
        stats.update(summarize(samples, None if samples else self._why_none()))
