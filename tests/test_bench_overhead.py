"""The overhead benchmark: its trace reading on a made-up profiler trace, and a tiny run of every
operation on 2 CPU ranks (the torch backend) as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import call_trace  # noqa: E402

# The plain torch calls that tell the host's speed first, then the Buffer's operations.
OPS = ["torch add_", "torch zeros", "torch event+wait", "layout", "dispatch bf16", "cached bf16",
       "dispatch bf16 worst", "dispatch fp8", "cached fp8", "dispatch fp8 worst", "combine bf16", "ll dispatch fp8",
       "ll combine"]


def _event(cat: str, name: str, ts: float, dur: float, correlation: int | None = None) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def test_calls_get_the_gpu_work_their_host_launched() -> None:
    kernel = "void moe_ep::kernels::(anonymous namespace)::dispatch_kernel<4, true>(moe_ep::kernels::DispatchArgs, int)"
    events = [
        _event("user_annotation", "call_0", 1000, 50),
        _event("cuda_runtime", "cudaMemsetAsync", 1010, 3, correlation=7),
        _event("cuda_runtime", "cudaLaunchKernel", 1020, 4, correlation=8),
        _event("gpu_memset", "Memset (Device)", 1015, 2, correlation=7),
        _event("kernel", kernel, 1030, 40, correlation=8),
        _event("kernel", "other_kernel", 1040, 10, correlation=9),  # launched by the next call's setup
        _event("cuda_runtime", "cudaLaunchKernel", 1990, 4, correlation=9),
        _event("user_annotation", "call_1", 2000, 30),
        _event("cuda_runtime", "cudaLaunchKernel", 2005, 4, correlation=10),
        _event("kernel", kernel, 2010, 30, correlation=10),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 2012, 5),  # not linked: by its start
        _event("user_annotation", "unrelated", 2100, 5),
    ]
    calls = call_trace.calls_in_trace({"traceEvents": events}, "call_")
    assert [[l.name for l in c.launches] for c in calls] == [["memset", "dispatch_kernel"],
                                                             ["dispatch_kernel", "memcpy HtoD"]]
    first, second = calls
    assert first.launches[1] == call_trace.Launch("dispatch_kernel", 40.0, 30.0, 20.0)
    assert first.gpu_busy_us == 2 + 40 and first.gpu_end_us == 70
    assert second.gpu_busy_us == 30 and second.launches[1].launched_us is None  # the copy lies inside the kernel
    summary = call_trace.summarize(calls)
    assert [k["name"] for k in summary["kernels"]] == ["memset", "dispatch_kernel", "memcpy HtoD"]
    assert summary["kernels"][1] == {"name": "dispatch_kernel", "launches_per_call": 1.0, "gpu_us": 35.0,
                                     "start_us": 20.0, "launched_us": 12.5}
    assert summary["kernels"][0]["launches_per_call"] == 0.5 and summary["host_us_profiled"] == 40


def test_over_counts_beyond_the_data_kernel_or_both_kernels_of_the_graph() -> None:
    with mock.patch.dict(os.environ):  # the benchmark turns value checks off for its own process
        import bench_overhead

    notify = {"name": "notify_dispatch_kernel", "launches_per_call": 1.0, "gpu_us": 13.0}
    data = {"name": "dispatch_kernel", "launches_per_call": 1.0, "gpu_us": 150.0}
    combine = {"name": "combine_kernel", "launches_per_call": 1.0, "gpu_us": 30.0}
    twice = {"name": "padding_kernel", "launches_per_call": 2.0, "gpu_us": 2.5}
    # A call's notify and padding are overhead; the graph's two calls are both data.
    assert bench_overhead._over_data_kernels("dispatch bf16", 200.0, [notify, data, twice]) == 50.0
    assert bench_overhead._over_data_kernels(bench_overhead.LL_GRAPH, 200.0, [data, combine, twice]) == 15.0
    assert bench_overhead._over_data_kernels("combine bf16", None, [combine]) is None
    assert bench_overhead._over_data_kernels("combine bf16", 40.0, []) is None


def test_tiny_run_of_every_operation_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_overhead.py"), "--backend", "torch",
                           "--tiny", "--worlds", "2", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (world,) = report["reports"]
    assert world["world"] == 2 and list(world["ops"]) == OPS
    for name, op in world["ops"].items():
        assert len(op["host_us_per_rank"]) == 2 and 0 < min(op["host_us_per_rank"]) <= op["host_us"], name
        assert op["sync_us"] > 0 and op["rank0"]["trace"]["calls"] == 2, name
        assert op["rank0"]["trace"]["kernels"] == [], name  # nothing runs on a GPU
        stream = op["rank0"]["stream"]  # the calls back to back: host times, no GPU span on the CPU
        assert stream["host_us"]["median"] > 0 and stream["per_call_us"] > 0 and "span_us" not in stream, name
    table = proc.stdout[proc.stdout.index("whole Buffer calls"):]
    assert all(f"    2  {name} " in table for name in OPS), table


def test_front_end_benchmark_times_every_call_with_the_backend_stubbed(tmp_path: Path) -> None:
    out = tmp_path / "front_end.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_front_end.py"), "--out", str(out),
                           "--tokens", "64", "--hidden", "256", "--experts", "16", "--topk", "4", "--ll-tokens", "8",
                           "--iters", "20", "--repeats", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    times = json.loads(out.read_text())["us_per_call"]
    assert list(times) == ["python loop (1000 additions)", "get_dispatch_layout", "dispatch BF16", "dispatch FP8",
                           "dispatch, cached", "combine", "low-latency dispatch", "low-latency combine"]
    assert all(0 < t["min"] <= t["median"] for t in times.values()), times
    assert "dispatch, cached" in proc.stdout
