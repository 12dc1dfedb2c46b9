"""What a whole Buffer call costs besides its data kernel, measured on one GPU that the ranks share.

Each world's ranks share the machine's GPUs (on one GPU, all of them) in a gloo process group, as the
tests' shared-GPU pools do, so the data kernels take turns on the GPU and their times mean nothing
(nor does waiting for them). What is real there: the host's time per call and the kernels besides
the data's (layout, notify, ring preparation, padding, memsets). Per operation:
  * host: CPU wall time from the call to its return, no synchronization: what a program waits before
    it can go on (a dispatch without num_worst_tokens includes the host's wait for its receive counts,
    which on a shared GPU waits for the peers' turns too); the slowest rank's median;
  * call+sync: the call followed by torch.cuda.synchronize(), CPU wall time; the slowest rank's median
    (both start from an idle GPU, after a synchronize and a barrier: one call's latency, host included);
  * in a stream: the calls back to back with no sync between them, as a training step issues them (rank
    0): each call's host time, and its GPU span between CUDA events recorded just before and just after
    it. Where the host keeps ahead of the GPU the span is the call's GPU work with the gaps inside it;
    where it does not, the span grows by the host's lateness. "over" is the span beyond the call's
    longest kernel (the data kernel): what the call adds to it when the host keeps up;
  * every kernel, memset and copy of the call, from a torch profiler trace (rank 0, medians): its GPU
    time, when it started on the GPU and when the host launched it, counted from the call's start
    (under the profiler, whose host is slower); the GPU time the call's work covers, and when its last
    GPU work ended.
Operations: get_dispatch_layout; dispatch BF16 and FP8, each uncached (the host waits for the counts),
uncached with num_worst_tokens (it does not) and cached (the handle passed); combine BF16;
low-latency dispatch (FP8) and combine, paced by the host (no hook), and the two replayed from one CUDA
graph, as a decode step runs them (CUDA backend: no host work per call; "over" is its span beyond both
kernels). First, plain torch calls timed
the same way (one launch; an allocation and a memset; an event record and a stream wait) tell how fast
this machine's host is, since host times move by up to 2x between machines of one kind. Printed as one
table, saved as JSON under --out. With --host-profile, rank 0 also runs each operation under cProfile
and lists the functions (Python and the C++ bindings) that take its host time: where the microseconds
go. Value checks are off (MOE_EP_CHECK_VALUES=0), as DeepEP has none.

    python benchmarks/bench_overhead.py --out overhead.json [--worlds 2,4] [--tokens 4096 --hidden 7168 ...]
    python benchmarks/bench_overhead.py --backend torch --tiny --worlds 2 --out /tmp/overhead.json   # CPU
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import statistics
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

os.environ.setdefault("MOE_EP_CHECK_VALUES", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import call_trace  # noqa: E402
from spawn import run_ranks  # noqa: E402
import moe_ep  # noqa: E402
from moe_ep.ops import fp8  # noqa: E402

_MARK = "moe_ep_overhead_call_"
LL_GRAPH = "ll pair, CUDA graph"
"""The low-latency dispatch and combine captured in one CUDA graph: its "over" counts beyond both kernels."""
# The shapes of `--tiny`: a CPU smoke run of every operation.
_TINY = dict(tokens=32, hidden=128, experts=16, topk=4, ll_tokens=16, warmup=1, iters=3, profile_iters=2,
             nvl_bytes=64 << 20)

Op = tuple[str, Callable[[], object], Optional[Callable[[], None]]]  # name, call, untimed work before each


class Workload:
    """One rank's inputs, Buffers and the outputs the cached and combine calls start from."""

    def __init__(self, rank: int, world: int, args: argparse.Namespace, device: torch.device) -> None:
        self.world, self.num_experts = world, args.experts // world * world
        gen = torch.Generator().manual_seed(17 + rank)
        self.x = torch.randn(args.tokens, args.hidden, generator=gen).to(torch.bfloat16).to(device)
        self.topk_idx = torch.rand(args.tokens, self.num_experts, generator=gen).topk(args.topk, dim=1).indices.to(device)
        self.topk_weights = torch.rand(args.tokens, args.topk, generator=gen).to(device)
        self.x_fp8 = fp8.per_token_cast_to_fp8(self.x.float())
        self.ll_x = torch.randn(args.ll_tokens, args.hidden, generator=gen).to(torch.bfloat16).to(device)
        self.ll_topk_idx = torch.rand(args.ll_tokens, self.num_experts, generator=gen).topk(args.topk, dim=1).indices
        self.ll_topk_idx = self.ll_topk_idx.to(device)
        self.ll_topk_weights = torch.rand(args.ll_tokens, args.topk, generator=gen).to(device)
        self.ll_tokens = args.ll_tokens
        group = dist.group.WORLD
        nvl_bytes = args.nvl_bytes if args.backend == "cuda" else 0
        self.normal = moe_ep.Buffer(group, nvl_bytes, backend=args.backend)
        self.low_latency: Optional[moe_ep.Buffer] = None
        if not args.skip_ll and (args.backend == "torch" or _low_latency_built()):
            ll_bytes = moe_ep.Buffer.get_low_latency_rdma_size_hint(args.ll_tokens, args.hidden, world, self.num_experts)
            self.low_latency = moe_ep.Buffer(group, 0, ll_bytes, low_latency_mode=True, backend=args.backend)
        self.layout = self.normal.get_dispatch_layout(self.topk_idx, self.num_experts)[:4]
        self.num_worst_tokens = _most_received(self.layout[0], world)
        recv_x, _, self.recv_weights, _, self.handle, _ = self.dispatch(self.x)
        self.recv_x = recv_x
        self.ll_handle = None
        self.ll_graph: Optional[torch.cuda.CUDAGraph] = None
        if self.low_latency is not None:
            num_local = self.num_experts // world
            self.ll_expert_out = torch.empty(num_local, world * args.ll_tokens, args.hidden, dtype=torch.bfloat16,
                                             device=device).normal_()
            if args.backend == "cuda":
                self.ll_graph = self._capture_low_latency_pair()

    def _capture_low_latency_pair(self) -> torch.cuda.CUDAGraph:
        """Dispatch then combine, captured once (every rank at once): a replay is a decode step's two
        calls with no host work between them. A dispatch of the same sizes first, so that the capture
        holds no buffer clean."""
        self.refresh_low_latency_handle()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the process group's watchdog thread may touch CUDA while this one captures.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.ll_handle = self.low_latency_dispatch()[2]
            self.low_latency_combine()
        torch.cuda.synchronize()
        return graph

    def dispatch(self, x: object, num_worst_tokens: int = 0) -> tuple:
        per_rank, _, per_expert, in_rank = self.layout
        return self.normal.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert, topk_idx=self.topk_idx,
                                    topk_weights=self.topk_weights, num_worst_tokens=num_worst_tokens)

    def low_latency_dispatch(self) -> tuple:
        assert self.low_latency is not None
        return self.low_latency.low_latency_dispatch(self.ll_x, self.ll_topk_idx, self.ll_tokens, self.num_experts,
                                                     use_fp8=True)

    def refresh_low_latency_handle(self) -> None:
        self.ll_handle = self.low_latency_dispatch()[2]

    def low_latency_combine(self) -> tuple:
        assert self.low_latency is not None and self.ll_handle is not None
        return self.low_latency.low_latency_combine(self.ll_expert_out, self.ll_topk_idx, self.ll_topk_weights,
                                                    self.ll_handle)

    def reference_ops(self) -> list[Op]:
        """Plain torch calls timed the same way: what this machine's host takes for one launch, one
        allocation plus a launch, and one event record plus a wait, so that the Buffer calls' host times
        read against the machine they ran on (host speed differs a lot between machines)."""
        w = self
        small = torch.zeros(256, device=w.x.device)
        event = torch.cuda.Event() if w.x.is_cuda else None

        def record_and_wait() -> None:
            if event is not None:
                event.record()
                torch.cuda.current_stream().wait_event(event)

        return [("torch add_", lambda: small.add_(1), None),
                ("torch zeros", lambda: torch.zeros(w.topk_idx.size(0), w.world, device=w.x.device), None),
                ("torch event+wait", record_and_wait, None)]

    def ops(self) -> list[Op]:
        w = self
        ops: list[Op] = [("layout", lambda: w.normal.get_dispatch_layout(w.topk_idx, w.num_experts), None)]
        # The cached dispatch before the num_worst_tokens one, as a Buffer used without num_worst_tokens
        # runs it (after one with it, a cached dispatch keeps its padding pass: docs/design/intranode.md).
        for label, x in (("bf16", w.x), ("fp8", w.x_fp8)):
            ops += [(f"dispatch {label}", lambda x=x: w.dispatch(x), None),
                    (f"cached {label}", lambda x=x: w.normal.dispatch(x, handle=w.handle), None),
                    (f"dispatch {label} worst", lambda x=x: w.dispatch(x, w.num_worst_tokens), None)]
        ops.append(("combine bf16", lambda: w.normal.combine(w.recv_x, w.handle, topk_weights=w.recv_weights), None))
        if w.low_latency is not None:
            ops += [("ll dispatch fp8", w.low_latency_dispatch, None),
                    ("ll combine", w.low_latency_combine, w.refresh_low_latency_handle)]
        if w.ll_graph is not None:
            ops.append((LL_GRAPH, w.ll_graph.replay, None))
        return ops


def _low_latency_built() -> bool:
    from moe_ep.ops.backends.cuda_low_latency import low_latency_available

    return low_latency_available()


def _most_received(num_tokens_per_rank: torch.Tensor, world: int) -> int:
    """The most rows any rank receives (every rank's num_worst_tokens: no padding beyond it)."""
    mine = num_tokens_per_rank.to("cpu", torch.int64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return int(torch.stack(every).sum(0).max())


class Timer:
    """Runs one operation on every rank in step and times it (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, cuda: bool) -> None:
        self.args, self.cuda = args, cuda

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def _ready(self, before: Optional[Callable[[], None]]) -> None:
        if before is not None:
            before()
        self.settle()

    def _wall_us(self, fn: Callable[[], object], before: Optional[Callable[[], None]], sync: bool) -> list[float]:
        times = []
        for _ in range(self.args.iters):
            self._ready(before)
            started = time.perf_counter_ns()
            fn()
            if sync and self.cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter_ns() - started) / 1e3)
        return times

    def _trace(self, fn: Callable[[], object], before: Optional[Callable[[], None]]) -> dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=activities) as prof:
            for i in range(self.args.profile_iters + 1):
                self._ready(before)
                with record_function(f"{_MARK}{i}"):
                    fn()
            self.settle()
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        return call_trace.summarize(call_trace.calls_in_trace(trace, _MARK)[1:])  # the first starts the profiler

    def _host_profile(self, fn: Callable[[], object], before: Optional[Callable[[], None]]) -> list[dict[str, Any]]:
        """The functions with the most own host time per call (cProfile over `iters` calls; its own
        overhead inflates Python-heavy entries, so read them relative to each other)."""
        profiler = cProfile.Profile()
        for _ in range(self.args.iters):
            self._ready(before)
            profiler.enable()
            fn()
            profiler.disable()
        rows = []
        for (path, line, name), (_, calls, own, total, _) in pstats.Stats(profiler).stats.items():  # type: ignore
            where = name if path == "~" else f"{os.path.basename(path)}:{line}({name})"
            rows.append({"function": where, "calls_per_call": calls / self.args.iters,
                         "own_us": own / self.args.iters * 1e6, "total_us": total / self.args.iters * 1e6})
        return sorted(rows, key=lambda r: -r["own_us"])[:self.args.host_profile_top]

    def _in_a_stream(self, fn: Callable[[], object], before: Optional[Callable[[], None]]) -> dict[str, Any]:
        """The calls back to back, as a training step issues them: no sync or barrier between them, so the
        host runs ahead of the GPU where it can. host: each call's CPU time; span: GPU time from an event
        recorded just before the call to one just after it (the call's GPU work plus the gaps the host
        leaves in it); per_call: the burst's wall time, synchronized at its end, over its calls (it
        includes the untimed work before each call, if any)."""
        self.settle()
        iters = self.args.iters
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters if self.cuda else 0)]
        host = []
        burst_started = time.perf_counter_ns()
        for i in range(iters):
            if before is not None:
                before()
            if self.cuda:
                events[i][0].record()
            started = time.perf_counter_ns()
            fn()
            host.append((time.perf_counter_ns() - started) / 1e3)
            if self.cuda:
                events[i][1].record()
        if self.cuda:
            torch.cuda.synchronize()
        result: dict[str, Any] = {"host_us": _stats(host),
                                  "per_call_us": (time.perf_counter_ns() - burst_started) / 1e3 / iters}
        if self.cuda:
            result["span_us"] = _stats([start.elapsed_time(end) * 1e3 for start, end in events])
        return result

    def measure(self, fn: Callable[[], object], before: Optional[Callable[[], None]],
                host_profile: bool = False) -> dict[str, Any]:
        for _ in range(self.args.warmup):
            self._ready(before)
            fn()
        host = self._wall_us(fn, before, sync=False)
        synced = self._wall_us(fn, before, sync=True)
        result = {"host_us": _stats(host), "sync_us": _stats(synced), "stream": self._in_a_stream(fn, before),
                  "trace": self._trace(fn, before)}
        if host_profile:
            result["host_profile"] = self._host_profile(fn, before)
        return result


def _stats(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def _measure_world(rank: int, world: int, port: int, args: argparse.Namespace) -> Optional[dict]:
    cuda = args.backend == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    moe_ep.Buffer.set_num_sms(args.num_sms)
    work = Workload(rank, world, args, device)
    timer = Timer(args, cuda)
    mine = {}
    for name, fn, before in work.reference_ops() + work.ops():
        mine[name] = timer.measure(fn, before, host_profile=args.host_profile)  # on every rank: calls in step
    every: list[Optional[dict]] = [None] * world
    dist.all_gather_object(every, {name: r["host_us"]["median"] for name, r in mine.items()} |
                           {f"{name} sync": r["sync_us"]["median"] for name, r in mine.items()})
    dist.barrier()
    if rank != 0:
        return None
    ops = {}
    for name, result in mine.items():
        host = [r[name] for r in every]
        synced = [r[f"{name} sync"] for r in every]
        ops[name] = {"host_us": max(host), "host_us_per_rank": host, "sync_us": max(synced),
                     "sync_us_per_rank": synced, "rank0": result}
    return {"world": world, "experts": work.num_experts, "num_worst_tokens": work.num_worst_tokens,
            "recv_rows_rank0": int(work.recv_x.size(0)), "ops": ops}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    try:
        report = _measure_world(rank, world, port, args)
        if report is not None:
            results.put(("ok", report))
    except BaseException:
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    results.close()
    results.join_thread()  # the queue's thread has sent everything
    os._exit(0)  # NVSHMEM is not finalized: skip the interpreter's teardown


def _run_world(world: int, args: argparse.Namespace) -> dict:
    kind, value = run_ranks(_worker, world, args, args.timeout)
    if kind != "ok":
        raise RuntimeError(f"world {world} failed on {value}")
    return value


def _kernel_cell(kernel: dict[str, Any]) -> str:
    count = kernel["launches_per_call"]
    times = f"x{count:g} " if count != 1 else ""
    launched = "" if kernel["launched_us"] is None else f"/{kernel['launched_us']:.0f}"
    return f"{kernel['name']} {times}{kernel['gpu_us']:.1f} @{kernel['start_us']:.0f}{launched}"


def _over_data_kernels(name: str, span_us: Optional[float], kernels: list[dict[str, Any]]) -> Optional[float]:
    """What a call's GPU span takes beyond its data kernels: beyond its longest kernel (the other kernels,
    the memsets and the gaps between them count), or beyond every kernel for the graph of two calls."""
    if span_us is None or not kernels:
        return None
    times = [k["gpu_us"] * k["launches_per_call"] for k in kernels]
    return span_us - (sum(times) if name == LL_GRAPH else max(k["gpu_us"] for k in kernels))


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(report: dict[str, Any]) -> str:
    """The results as one table: a line per world and operation."""
    a = report["args"]
    lines = [f"whole Buffer calls, {a['backend']} backend on {report['device']}: {a['tokens']} tokens x {a['hidden']}, "
             f"top-{a['topk']} of {a['experts']} experts, {a['num_sms']} SMs; low-latency {a['ll_tokens']} tokens",
             "host: the call on the CPU, no sync; call+sync: with torch.cuda.synchronize() (us, slowest rank's "
             "median); GPU (rank 0, under the profiler): busy = time its work covers, end = its last work ends, "
             "kernels = name [xlaunches per call] us @GPU start/host launch (us from the call's start)",
             "in a stream (rank 0, calls back to back, medians): s.host = the call on the CPU, span = GPU "
             "time from an event before the call to one after it, over = span - the call's longest kernel "
             f"('{LL_GRAPH}': - both kernels)",
             f"{'world':>5}  {'op':20s} {'host':>8} {'call+sync':>10} {'s.host':>8} {'span':>8} {'over':>8} "
             f"{'busy':>8} {'end':>8}  kernels"]
    for rep in report["reports"]:
        for name, op in rep["ops"].items():
            trace, stream = op["rank0"]["trace"], op["rank0"]["stream"]
            kernels = " | ".join(_kernel_cell(k) for k in trace["kernels"]) or "-"
            span = stream["span_us"]["median"] if "span_us" in stream else None
            over = _over_data_kernels(name, span, trace["kernels"])
            lines.append(f"{rep['world']:5d}  {name:20s} {op['host_us']:8.1f} {op['sync_us']:10.1f} "
                         f"{stream['host_us']['median']:8.1f} {_fmt(span):>8} {_fmt(over):>8} "
                         f"{_fmt(trace['gpu_busy_us']):>8} {_fmt(trace['gpu_end_us']):>8}  {kernels}")
    profiled = [(rep["world"], name, op["rank0"]["host_profile"]) for rep in report["reports"]
                for name, op in rep["ops"].items() if "host_profile" in op["rank0"]]
    if profiled:
        lines.append("host profile (rank 0, cProfile): function own/total us per call")
    for world, name, rows in profiled:
        cells = " | ".join(f"{r['function']} {r['own_us']:.0f}/{r['total_us']:.0f}" for r in rows)
        lines.append(f"{world:5d}  {name:20s} {cells}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--backend", choices=("cuda", "torch"), default="cuda",
                        help="cuda: the kernels, ranks sharing the GPUs; torch: the torch backend on the CPU")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--ll-tokens", type=int, default=128, help="tokens per rank of the low-latency calls")
    parser.add_argument("--skip-ll", action="store_true", help="leave the low-latency calls out")
    parser.add_argument("--num-sms", type=int, default=24)
    parser.add_argument("--nvl-bytes", type=int, default=1 << 30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--profile-iters", type=int, default=5)
    parser.add_argument("--host-profile", action="store_true",
                        help="rank 0 also profiles each operation's host time by function (cProfile)")
    parser.add_argument("--host-profile-top", type=int, default=8, help="functions listed per operation")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per world")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and few iterations (a smoke run)")
    args = parser.parse_args()
    if args.tiny:
        for key, value in _TINY.items():
            setattr(args, key, value)
    if args.backend == "cuda" and not torch.cuda.is_available():
        parser.error("--backend cuda needs a GPU; --backend torch runs on the CPU")
    device = torch.cuda.get_device_name(0) if args.backend == "cuda" else "CPU"
    if args.backend == "cuda":
        device += f" (x{torch.cuda.device_count()}, shared by the ranks)"
    report: dict[str, Any] = {"args": vars(args), "device": device, "torch": torch.__version__, "reports": []}
    failed = []
    for world in [int(w) for w in args.worlds.split(",") if w]:
        started = time.monotonic()
        try:
            report["reports"].append(_run_world(world, args))
        except RuntimeError as exc:
            failed.append(str(exc))
            print(exc, flush=True)
            continue
        print(f"world {world}: {time.monotonic() - started:.0f} s", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(table(report))
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
