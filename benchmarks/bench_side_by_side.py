"""moe_ep against DeepEP V1 and NCCL: the same workload, timed the same way, in one table.

Three phases, each in processes of its own (one rank per GPU, `moe_ep.launch`):
  * `nccl`: `all_to_all_single` of the same remote bytes as each operation below;
  * `moe_ep`: moe_ep's Buffer (`--backend`, the CUDA kernels by default);
  * `deep_ep`: DeepEP V1's Buffer, when `import deep_ep` (with `--deepep-path` first on the path) finds the
    real one; moe_ep's `deep_ep` alias does not count.
Separate processes keep the two libraries' NVLink buffers and NVSHMEM jobs apart, and a phase that fails
or hangs (stopped after its timeout) costs only its own rows. Both libraries run the same code through
DeepEP's Buffer API on the same inputs (the same seeds):
  * normal mode: `--tokens` per rank, `--hidden`, top-`--topk` of `--experts` (uniform random routing),
    `--num-sms`: layout; dispatch BF16 and FP8, each uncached (the layout tensors passed: notify and the
    host's wait for the receive count) and cached (the handle passed); combine BF16. Each operation runs
    at its library's fastest config (cached call) among the library's default and `--dispatch-chunks` /
    `--combine-chunks` x `--ring-slots`; moe_ep's combine once per `--combine-paths`;
  * low-latency mode: `--ll-tokens` per rank, FP8 dispatch and BF16 combine, normal and hook mode (the
    send, then the hook), and the LogFMT combine where the library takes `use_logfmt=True`.
Timing, the same for every phase (benchmarks/timing.py):
  * call: CUDA events around each call after warm-up, every call started in step on all ranks; median,
    slowest rank. A timed combine gets its dispatch before it, untimed (low-latency mode);
  * kernel: the data kernel alone from a torch profiler trace, median, slowest rank; the low-latency
    kernels queued behind a matmul and started in step, as DeepEP's tests time them (hook mode: the send
    and receive kernels added up).
NCCL moves per rank the rows the dispatch sends to other ranks (BF16 rows for BF16 dispatch and the
combine, FP8 rows with their scales for FP8 dispatch; low-latency: one message per (token, expert) pair
on another rank, FP8 out and BF16 back, as DeepEP counts them).

Each library phase also checks its results: received rows per rank against the routing, the normal
combine against its inputs, low-latency messages received per rank.

    python benchmarks/bench_side_by_side.py --out sbs.json --world 4 [--deepep-path build/deepep]
    python benchmarks/bench_side_by_side.py --out sbs_cpu.json --tiny --backend torch --world 2   # CPU smoke run

Writes the JSON report to `--out` after every phase and prints the table last. Exit status 1 when a phase
failed, timed out, or `--deepep require` found no DeepEP.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import moe_ep
from bench_internode import _workload
from bench_low_latency import LOW_LATENCY_KERNELS
from moe_ep.deep_ep_alias import ALIAS_MARKER
from moe_ep.launch import launch
from moe_ep.ops import fp8
from moe_ep.ops.config import COMBINE_PATHS
from timing import all_to_all_rows, every_rank, kernel_median_us, kernel_times_by_launch_us, median_time_us

PHASES = ("nccl", "moe_ep", "deep_ep")
OPS = ("normal", "ll")
# Profiler kernel names (regular expressions) of each library's kernels.
KERNELS = {
    "moe_ep": {"layout": r"dispatch_layout_kernel", "notify": r"notify_dispatch_kernel",
               "dispatch": r"(?<![A-Za-z_])dispatch_kernel", "combine": r"(?<![A-Za-z_])combine_kernel",
               "low_latency": LOW_LATENCY_KERNELS},
    "deep_ep": {"layout": r"get_dispatch_layout", "notify": r"intranode::(cached_)?notify_dispatch<",
                "dispatch": r"intranode::dispatch<", "combine": r"intranode::combine<",
                "low_latency": r"internode_ll::(dispatch|combine)<"},
}
NCCL_KERNEL = r"(?i)nccl"
TABLE_MARK = "---------------- side by side"  # the line before the table (scripts/side_by_side.sh prints from it)
TINY = {"tokens": 64, "hidden": 256, "experts": 16, "topk": 4, "ll_tokens": 8, "warmup": 1, "iters": 3,
        "dispatch_chunks": ["default"], "combine_chunks": ["default"], "ring_slots": [256], "nvl_bytes": 1 << 26}


# ---------------------------------------------------------------------------------------------- results


class Part:
    """What one phase measured, kept by rank 0 in a JSON file rewritten after every entry, so that a
    phase that dies later still leaves its earlier rows."""

    def __init__(self, path: str, phase: str, writes: bool) -> None:
        self.path, self.phase, self.writes = path, phase, writes
        self.data: dict[str, Any] = {"ops": {}}

    def set(self, key: str, value: object) -> None:
        self.data[key] = value
        self._flush()

    def op(self, name: str, **fields: object) -> None:
        self.data["ops"][name] = fields
        self._flush()
        if self.writes:
            shown = ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items()
                              if not isinstance(v, (dict, list)))
            print(f"[{self.phase}] {name}: {shown}", flush=True)

    def _flush(self) -> None:
        if not self.writes:
            return
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(self.path + ".tmp", self.path)


# ---------------------------------------------------------------------------------------------- routing


def _num_experts(args: argparse.Namespace, world: int) -> int:
    """Experts are sharded evenly: `--experts` rounded down to a multiple of the world size."""
    return args.experts // world * world


def _gather_rows(vector: torch.Tensor) -> torch.Tensor:
    """`[world, n]`: every rank's `vector` (int64), in rank order."""
    world = dist.get_world_size()
    out = torch.empty(world * vector.numel(), dtype=torch.int64, device=vector.device)
    dist.all_gather_into_tensor(out, vector.to(torch.int64).contiguous())
    return out.view(world, -1)


def _tokens_to_ranks(topk_idx: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """`[world]` int64: tokens of this rank with at least one expert on each rank (the rows a normal
    dispatch sends there)."""
    dest = torch.where(topk_idx >= 0, topk_idx // (num_experts // world), -1)
    return torch.stack([(dest == r).any(dim=1).sum() for r in range(world)]).to(torch.int64)


def _messages_to_ranks(topk_idx: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """`[world]` int64: (token, expert) pairs of this rank whose expert is on each rank (low-latency
    messages)."""
    valid = topk_idx[topk_idx >= 0]
    return torch.bincount(valid // (num_experts // world), minlength=world).to(torch.int64)


def _remote_counts(per_rank: torch.Tensor) -> tuple[list[int], list[int]]:
    """Rows this rank sends to and receives from every other rank (its own rows left out), from the
    `[world]` counts of every rank."""
    rank = dist.get_rank()
    matrix = _gather_rows(per_rank).cpu()  # [source, destination]
    send = [0 if d == rank else int(matrix[rank, d]) for d in range(matrix.size(0))]
    recv = [0 if s == rank else int(matrix[s, rank]) for s in range(matrix.size(0))]
    return send, recv


def _fp8_row_bytes(hidden: int) -> int:
    return hidden + hidden // 128 * 4  # e4m3 data and a float32 scale per 128 channels


# ---------------------------------------------------------------------------------------------- phases


def run_nccl(rank: int, world: int, device: torch.device, args: argparse.Namespace) -> None:
    """The baseline: all_to_all_single of the remote rows of every operation."""
    part = Part(args.part, "nccl", rank == 0)
    part.set("process_group", dist.get_backend())
    num_experts = _num_experts(args, world)
    exchanges = []
    if "normal" in args.ops:
        _, topk_idx, _ = _workload(rank, args.tokens, args.hidden, num_experts, args.topk, device)
        send, recv = _remote_counts(_tokens_to_ranks(topk_idx, num_experts, world))
        exchanges += [("bf16_rows", send, recv, 2 * args.hidden), ("fp8_rows", send, recv, _fp8_row_bytes(args.hidden))]
    if "ll" in args.ops:
        _, topk_idx, _ = _workload(rank, args.ll_tokens, args.hidden, num_experts, args.topk, device)
        send, recv = _remote_counts(_messages_to_ranks(topk_idx, num_experts, world))
        exchanges += [("ll_dispatch_msgs", send, recv, _fp8_row_bytes(args.hidden)),
                      ("ll_combine_msgs", send, recv, 2 * args.hidden)]
    for name, send, recv, row_bytes in exchanges:
        exchange = all_to_all_rows(send, recv, row_bytes, device)
        call = median_time_us(exchange, args.warmup, args.iters)
        kernel = kernel_median_us(exchange, {"k": NCCL_KERNEL}, args.iters)["k"]
        recv_rows = every_rank(sum(recv))
        part.op(name, call_us=call, kernel_us=kernel, row_bytes=row_bytes, remote_recv_rows=recv_rows,
                remote_mb_max=max(recv_rows) * row_bytes / 1e6)


def _library(name: str) -> Any:
    return moe_ep if name == "moe_ep" else importlib.import_module("deep_ep")


def run_library(rank: int, world: int, device: torch.device, args: argparse.Namespace) -> None:
    """Normal and low-latency mode of one library (`args.phase`)."""
    lib = _library(args.phase)
    part = Part(args.part, args.phase, rank == 0)
    part.set("found", True)
    part.set("where", os.path.dirname(os.path.abspath(lib.__file__)))
    # moe_ep picks its backend by name; DeepEP has one.
    extra = {"backend": args.backend} if args.phase == "moe_ep" else {}
    if "normal" in args.ops:
        _normal_mode(lib, rank, world, device, args, part, extra)
    if "ll" in args.ops:
        _low_latency_mode(lib, rank, world, device, args, part, extra)
    if torch.cuda.is_available():
        # moe_ep does not finalise NVSHMEM: skip the interpreter's teardown once every rank is done, as
        # bench_low_latency.py does (the launcher takes exit status 0 as success).
        dist.barrier()
        os._exit(0)


def _configs(lib: Any, world: int, args: argparse.Namespace, kind: str) -> list[tuple[str, Any]]:
    """(label, Config) candidates of `kind` ("dispatch" or "combine"): the library's default for the world
    size (where it has one) and each chunk size x ring size."""
    out = []
    for chunk in args.dispatch_chunks if kind == "dispatch" else args.combine_chunks:
        if chunk == "default":
            getter = lib.Buffer.get_dispatch_config if kind == "dispatch" else lib.Buffer.get_combine_config
            try:
                out.append(("default", getter(world)))
            except (AssertionError, ValueError, RuntimeError):
                pass  # DeepEP has defaults for some world sizes only
            continue
        for ring in args.ring_slots:
            out.append((f"{chunk}:{ring}", lib.Config(args.num_sms, int(chunk), ring, 6, 128)))
    if not out:
        raise ValueError(f"--{kind}-chunks: no config for {world} ranks; list chunk sizes besides 'default'")
    return out


def _fastest(configs: list[tuple[str, Any]], time_us: Callable[[Any], float]) -> tuple[str, Any, dict[str, object]]:
    """The candidate with the smallest `time_us`, and every candidate's time (or why the library refused
    it: a config's sizes are checked on the host, the same on every rank, before anything is sent)."""
    sweep: dict[str, object] = {}
    for label, config in configs:
        try:
            sweep[label] = time_us(config)
        except (ValueError, RuntimeError, AssertionError) as exc:
            sweep[label] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    timed = {k: v for k, v in sweep.items() if isinstance(v, float) and not math.isnan(v)}
    if not timed:
        raise RuntimeError(f"no config ran: {sweep}")
    label = min(timed, key=timed.__getitem__)
    return label, dict(configs)[label], sweep


def _normal_mode(lib: Any, rank: int, world: int, device: torch.device, args: argparse.Namespace, part: Part,
                 extra: dict) -> None:
    kernels = KERNELS[args.phase]
    num_experts = _num_experts(args, world)
    lib.Buffer.set_num_sms(args.num_sms)  # the SMs of the libraries' default configs
    buffer = lib.Buffer(dist.group.WORLD, args.nvl_bytes, 0, explicitly_destroy=True, **extra)
    x, topk_idx, topk_weights = _workload(rank, args.tokens, args.hidden, num_experts, args.topk, device)
    x_fp8 = fp8.per_token_cast_to_fp8(x.float())
    warmup, iters = args.warmup, args.iters

    def layout() -> tuple:
        return buffer.get_dispatch_layout(topk_idx, num_experts)

    per_rank, _, per_expert, in_rank, _ = layout()
    part.op("layout", call_us=median_time_us(layout, warmup, iters),
            kernel_us=kernel_median_us(layout, {"k": kernels["layout"]}, iters)["k"])

    def dispatch(x_in: Any, config: Any, handle: Any = None) -> tuple:
        if handle is not None:
            return buffer.dispatch(x_in, handle=handle, config=config)
        return buffer.dispatch(x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                               config=config)

    dispatch_configs = _configs(lib, world, args, "dispatch")
    first = dispatch_configs[0][1]
    for dtype, x_in in (("bf16", x), ("fp8", x_fp8)):
        handle = dispatch(x_in, first)[4]
        label, config, sweep = _fastest(
            dispatch_configs, lambda c: median_time_us(lambda: dispatch(x_in, c, handle), warmup, iters))
        for suffix, cached in (("", None), ("_cached", handle)):
            def run() -> tuple:
                return dispatch(x_in, config, cached)

            times = kernel_median_us(run, {"k": kernels["dispatch"], "notify": kernels["notify"]}, iters)
            part.op(f"dispatch_{dtype}{suffix}", call_us=median_time_us(run, warmup, iters), kernel_us=times["k"],
                    notify_kernel_us=times["notify"], config=label, sweep_cached_call_us=sweep)

    recv_x, _, recv_weights, _, handle, _ = dispatch(x, first)
    combine_configs = _configs(lib, world, args, "combine")
    _check_normal(part, x, recv_x, topk_idx, num_experts, world,
                  lambda: buffer.combine(recv_x, handle, config=combine_configs[0][1])[0])
    paths = args.combine_paths if args.phase == "moe_ep" else ["auto"]
    for path in paths:
        configs = [(label, dataclasses.replace(c, combine_path=path) if path != "auto" else c)
                   for label, c in combine_configs]

        def combine(config: Any) -> tuple:
            return buffer.combine(recv_x, handle, topk_weights=recv_weights, config=config)

        label, config, sweep = _fastest(configs, lambda c: median_time_us(lambda: combine(c), warmup, iters))
        fields = dict(call_us=median_time_us(lambda: combine(config), warmup, iters),
                      kernel_us=kernel_median_us(lambda: combine(config), {"k": kernels["combine"]}, iters)["k"],
                      config=label, sweep_call_us=sweep)
        cuda_backend = getattr(buffer, "_cuda", None)
        if args.phase == "moe_ep" and hasattr(cuda_backend, "last_combine_path"):
            fields["ran"] = cuda_backend.last_combine_path()
        part.op("combine_bf16" if path == "auto" else f"combine_bf16_{path}", **fields)
    _destroy(buffer)


def _check_normal(part: Part, x: torch.Tensor, recv_x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int,
                  world: int, combine: Callable[[], torch.Tensor]) -> None:
    """Rows received per rank against the routing; the combine of the received rows (no weights) against
    each token times the number of ranks it went to."""
    rank = dist.get_rank()
    per_rank = _tokens_to_ranks(topk_idx, num_experts, world)
    expected = int(_gather_rows(per_rank)[:, rank].sum())
    dest = torch.where(topk_idx >= 0, topk_idx // (num_experts // world), -1)
    copies = torch.stack([(dest == r).any(dim=1) for r in range(world)], dim=1).sum(dim=1, keepdim=True)
    reference = (x.float() * copies).to(torch.bfloat16).float()
    error = float((combine().float() - reference).abs().max() / reference.abs().max().clamp_min(1e-30))
    rows, errors = every_rank(recv_x.size(0)), every_rank(error)
    expected_rows = every_rank(expected)
    part.set("checks_normal", {"recv_rows": rows, "expected_rows": expected_rows, "combine_max_rel_error": errors,
                               "ok": rows == expected_rows and max(errors) < 1e-2})


def _low_latency_mode(lib: Any, rank: int, world: int, device: torch.device, args: argparse.Namespace, part: Part,
                      extra: dict) -> None:
    tokens, hidden = args.ll_tokens, args.hidden
    num_experts = _num_experts(args, world)
    warmup, iters = args.warmup, args.iters
    rdma_bytes = lib.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, world, num_experts)
    buffer = lib.Buffer(dist.group.WORLD, 0, rdma_bytes, low_latency_mode=True,
                        num_qps_per_rank=num_experts // world, explicitly_destroy=True, **extra)
    x, topk_idx, topk_weights = _workload(rank, tokens, hidden, num_experts, args.topk, device)
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    y = torch.randn(num_experts // world, world * tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    pattern = KERNELS[args.phase]["low_latency"]
    state: dict[str, Any] = {}

    def dispatch(hook: bool = False) -> tuple:
        recv, count, handle, _, recv_hook = buffer.low_latency_dispatch(
            x, topk_idx, tokens, num_experts, use_fp8=True, return_recv_hook=hook)
        if hook:
            recv_hook()
        state["handle"] = handle
        return recv, count

    def combine(hook: bool = False, logfmt: bool = False) -> torch.Tensor:
        combined, _, recv_hook = buffer.low_latency_combine(y, topk_idx, topk_weights, state["handle"],
                                                            use_logfmt=logfmt, return_recv_hook=hook)
        if hook:
            recv_hook()
        return combined

    _, count = dispatch()
    expected = int(_gather_rows(_messages_to_ranks(topk_idx, num_experts, world))[:, rank].sum())
    received, expected_all = every_rank(int(count.sum())), every_rank(expected)
    part.set("checks_ll", {"recv_messages": received, "expected_messages": expected_all, "ok": received == expected_all})

    def pair(hook: bool = False, logfmt: bool = False) -> None:
        dispatch(hook)
        combine(hook, logfmt)

    def kernel_times(fn: Callable[[], None], names: list[str]) -> list[float]:
        return kernel_times_by_launch_us(fn, pattern, names, warmup, iters)

    dispatch_k, combine_k = kernel_times(pair, ["dispatch", "combine"])
    part.op("ll_dispatch_fp8", call_us=median_time_us(dispatch, warmup, iters), kernel_us=dispatch_k)
    part.op("ll_combine_bf16", call_us=median_time_us(combine, warmup, iters, before_each=dispatch), kernel_us=combine_k)
    send, recv, combine_send, combine_recv = kernel_times(
        lambda: pair(hook=True), ["dispatch send", "dispatch recv", "combine send", "combine recv"])
    part.op("ll_dispatch_fp8_hook", call_us=median_time_us(lambda: dispatch(True), warmup, iters),
            kernel_us=send + recv, send_kernel_us=send, recv_kernel_us=recv)
    part.op("ll_combine_bf16_hook", call_us=median_time_us(lambda: combine(True), warmup, iters, before_each=dispatch),
            kernel_us=combine_send + combine_recv, send_kernel_us=combine_send, recv_kernel_us=combine_recv)
    try:
        dispatch()
        combine(logfmt=True)
    except (ValueError, RuntimeError, AssertionError, NotImplementedError) as exc:  # every rank rejects it alike
        part.op("ll_combine_logfmt", unsupported=f"{type(exc).__name__}: {exc}".splitlines()[0][:200])
    else:
        _, logfmt_k = kernel_times(lambda: pair(logfmt=True), ["dispatch", "combine"])
        part.op("ll_combine_logfmt", call_us=median_time_us(lambda: combine(logfmt=True), warmup, iters,
                                                            before_each=dispatch), kernel_us=logfmt_k)
    _destroy(buffer)


def _destroy(buffer: Any) -> None:
    """Release a Buffer once its queued work is done, on every rank together."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    buffer.destroy()


# ---------------------------------------------------------------------------------------------- DeepEP


def find_deep_ep(extra_path: str) -> tuple[Optional[Any], str]:
    """The real DeepEP (V1) module, or None, and where it is or why it was not found."""
    if extra_path:
        sys.path.insert(0, os.path.abspath(extra_path))
    try:
        deep_ep = importlib.import_module("deep_ep")
    except Exception as exc:  # an absent package, or a built one whose extension does not load
        return None, f"import deep_ep: {type(exc).__name__}: {exc}"
    where = os.path.dirname(os.path.abspath(getattr(deep_ep, "__file__", "") or "."))
    if getattr(deep_ep, "Buffer", None) is moe_ep.Buffer or os.path.isfile(os.path.join(where, ALIAS_MARKER)):
        return None, f"deep_ep at {where} is moe_ep's alias"
    if not hasattr(deep_ep.Buffer, "low_latency_dispatch") or not hasattr(deep_ep, "Config"):
        return None, f"deep_ep at {where} has no DeepEP V1 Buffer"
    return deep_ep, where


def _phase_main(args: argparse.Namespace) -> int:
    """One phase: launch its ranks (the `deep_ep` phase first finds DeepEP, or records why not)."""
    if args.phase == "deep_ep":
        deep_ep, where = find_deep_ep(args.deepep_path)
        with open(args.part, "w") as f:
            json.dump({"ops": {}, "found": deep_ep is not None, "where": where}, f)
        if deep_ep is None:
            print(f"[deep_ep] not found: {where}", flush=True)
            return 1 if args.deepep == "require" else 0
        print(f"[deep_ep] {where}", flush=True)
    launch(run_nccl if args.phase == "nccl" else run_library, args.world, args)
    return 0


def _run_phase(phase: str, args: argparse.Namespace, part: str, timeout: float) -> dict:
    """Run one phase in a process group of its own; stop the whole group after `timeout` seconds."""
    command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--phase", phase, "--part", part]
    started = time.monotonic()
    proc = subprocess.Popen(command, start_new_session=True)
    status: object = f"stopped after {timeout:.0f} s"
    try:
        status = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:  # also when this process is stopped itself (SIGTERM, see main): no rank outlives it
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result: dict[str, Any] = {"status": status, "seconds": round(time.monotonic() - started, 1)}
    if os.path.exists(part):
        with open(part) as f:
            result.update(json.load(f))
    return result


# ---------------------------------------------------------------------------------------------- table


# (label, op key of both libraries, NCCL exchange of the same bytes)
ROWS = [("layout", "layout", None),
        ("dispatch BF16", "dispatch_bf16", "bf16_rows"), ("dispatch BF16 cached", "dispatch_bf16_cached", "bf16_rows"),
        ("dispatch FP8", "dispatch_fp8", "fp8_rows"), ("dispatch FP8 cached", "dispatch_fp8_cached", "fp8_rows"),
        ("combine BF16", "combine_bf16", "bf16_rows"),
        *[(f"combine BF16 {path}", f"combine_bf16_{path}", "bf16_rows") for path in COMBINE_PATHS if path != "auto"],
        ("LL dispatch FP8", "ll_dispatch_fp8", "ll_dispatch_msgs"), ("LL combine BF16", "ll_combine_bf16", "ll_combine_msgs"),
        ("LL dispatch FP8 hook", "ll_dispatch_fp8_hook", "ll_dispatch_msgs"),
        ("LL combine BF16 hook", "ll_combine_bf16_hook", "ll_combine_msgs"),
        ("LL combine LogFMT", "ll_combine_logfmt", "ll_combine_msgs")]


def _value(phase: dict, op: Optional[str], key: str) -> float:
    entry = phase.get("ops", {}).get(op or "", {})
    value = entry.get(key)
    return float(value) if isinstance(value, (int, float)) else float("nan")


def _us(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _ratio(slower: float, faster: float) -> str:
    return "-" if math.isnan(slower) or math.isnan(faster) or faster <= 0 else f"{slower / faster:.2f}x"


def table(report: dict) -> str:
    """The side-by-side table: times in us; ratios are moe_ep's speed-ups (above 1: moe_ep faster)."""
    phases = report["phases"]
    ours, theirs, nccl = (phases.get(p, {}) for p in ("moe_ep", "deep_ep", "nccl"))
    args = report["args"]
    lines = [f"{report['device']}, {args['world']} ranks ({nccl.get('process_group', '?')}), moe_ep backend "
             f"{args['backend']}; normal: {args['tokens']} tokens/rank, hidden {args['hidden']}, top-{args['topk']} of "
             f"{args['experts']} experts, {args['num_sms']} SMs; low-latency: {args['ll_tokens']} tokens/rank",
             f"DeepEP: {theirs.get('where', 'not run')}",
             "times in us; call = whole Buffer call, kernel = data kernel (profiler); NCCL = all_to_all_single of the "
             "same remote bytes, call (kernel); ratios = DeepEP call / moe_ep call, NCCL call / moe_ep call, "
             "DeepEP kernel / moe_ep kernel",
             f"{'op':22s} {'moe_ep call':>11s} {'DeepEP call':>11s} {'NCCL':>16s} {'moe_ep kernel':>13s} "
             f"{'DeepEP kernel':>13s}  ratios"]
    for label, op, exchange in ROWS:
        if op not in ours.get("ops", {}) and op not in theirs.get("ops", {}):
            continue
        their_op = "combine_bf16" if op.startswith("combine_bf16") else op
        our_call, their_call = _value(ours, op, "call_us"), _value(theirs, their_op, "call_us")
        our_kernel, their_kernel = _value(ours, op, "kernel_us"), _value(theirs, their_op, "kernel_us")
        nccl_call, nccl_kernel = _value(nccl, exchange, "call_us"), _value(nccl, exchange, "kernel_us")
        nccl_cell = "-" if math.isnan(nccl_call) else f"{nccl_call:.1f} ({_us(nccl_kernel)})"
        ours_op, theirs_op = ours.get("ops", {}).get(op, {}), theirs.get("ops", {}).get(their_op, {})
        notes = [f"{who} {entry['unsupported']}" for who, entry in (("moe_ep:", ours_op), ("DeepEP:", theirs_op))
                 if "unsupported" in entry]
        if "ran" in ours_op:
            notes.append(f"moe_ep ran the {ours_op['ran']} path")
        lines.append(f"{label:22s} {_us(our_call):>11s} {_us(their_call):>11s} {nccl_cell:>16s} {_us(our_kernel):>13s} "
                     f"{_us(their_kernel):>13s}  {_ratio(their_call, our_call)} {_ratio(nccl_call, our_call)} "
                     f"{_ratio(their_kernel, our_kernel)}" + (f"  ({'; '.join(notes)})" if notes else ""))
    sizes = [f"{op} {entry['remote_mb_max']:.2f} MB" for op, entry in nccl.get("ops", {}).items()]
    if sizes:
        lines.append(f"remote bytes the busiest rank receives: {', '.join(sizes)}")
    for name in ("moe_ep", "deep_ep", "nccl"):
        phase = phases.get(name)
        if phase is None:
            continue
        status = "ok" if phase["status"] == 0 else phase["status"]
        if phase.get("found") is False:
            status = "not found"
        checks = [f"{key[len('checks_'):]} {'ok' if value['ok'] else 'FAILED'}" for key, value in phase.items()
                  if key.startswith("checks_")]
        configs = [f"{op} {entry['config']}" for op, entry in phase.get("ops", {}).items()
                   if "config" in entry and not op.endswith("_cached")]
        lines.append(f"{name}: {status} in {phase['seconds']} s" + (f"; checks: {', '.join(checks)}" if checks else "")
                     + (f"; configs (send chunk:ring slots): {', '.join(configs)}" if configs else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON report")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--num-sms", type=int, default=24)
    parser.add_argument("--ll-tokens", type=int, default=128)
    parser.add_argument("--nvl-bytes", type=int, default=2 << 30, help="NVLink buffer of both libraries")
    parser.add_argument("--dispatch-chunks", default="default,4,8,16,24",
                        help="dispatch send chunks to try ('default': the library's config for the world size)")
    parser.add_argument("--combine-chunks", default="default,2,4,8,12", help="combine send chunks to try")
    parser.add_argument("--ring-slots", default="256,512", help="receive ring sizes to try with each chunk")
    parser.add_argument("--combine-paths", default="auto",
                        help=f"moe_ep's Config.combine_path values to time, comma-separated ({', '.join(COMBINE_PATHS)})")
    parser.add_argument("--ops", default="normal,ll", help=f"modes to run, comma-separated ({', '.join(OPS)})")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"phases to run ({', '.join(PHASES)})")
    parser.add_argument("--backend", choices=("cuda", "torch", "auto"), default="cuda", help="moe_ep's backend")
    parser.add_argument("--deepep", choices=("auto", "off", "require"), default="auto",
                        help="run DeepEP when found (auto), never, or fail without it")
    parser.add_argument("--deepep-path", default="", help="directory put first on the path to import deep_ep")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized workload (smoke runs)")
    parser.add_argument("--phase-timeout", type=float, default=300, help="seconds one phase may run")
    parser.add_argument("--budget", type=float, default=0, help="seconds all phases may run (0: no limit)")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("dispatch_chunks", "combine_chunks", "ring_slots", "combine_paths", "ops", "phases"):
        setattr(args, name, [v for v in getattr(args, name).split(",") if v])
    if args.tiny:
        for name, value in TINY.items():
            setattr(args, name, value)
    args.ring_slots = [int(v) for v in args.ring_slots]
    for name, allowed in (("combine_paths", COMBINE_PATHS), ("ops", OPS), ("phases", PHASES)):
        wrong = [v for v in getattr(args, name) if v not in allowed]
        if wrong:
            parser.error(f"--{name.replace('_', '-')}: expected values among {', '.join(allowed)}, got {wrong}")
    for chunk in args.dispatch_chunks + args.combine_chunks:
        if chunk != "default" and not chunk.isdigit():
            parser.error(f"--dispatch-chunks/--combine-chunks: expected 'default' or integers, got {chunk!r}")
    return args


def main() -> int:
    # DeepEP does no value checks of topk_idx; time the communication, not moe_ep's input checks (the
    # phases and their ranks inherit it).
    os.environ.setdefault("MOE_EP_CHECK_VALUES", "0")
    args = _parse()
    if args.phase is not None:
        return _phase_main(args)
    # A timeout stopping this process raises SystemExit here, so that the running phase is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "args": vars(args),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU",
        "gpus": torch.cuda.device_count(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "phases": {}}
    started, failed = time.monotonic(), False
    with tempfile.TemporaryDirectory() as parts:
        for phase in args.phases:
            if phase == "deep_ep" and args.deepep == "off":
                continue
            left = args.budget - (time.monotonic() - started) if args.budget else args.phase_timeout
            if left < 20:
                report["phases"][phase] = {"status": "not run: the budget is spent", "seconds": 0}
                failed = True
                continue
            result = _run_phase(phase, args, os.path.join(parts, f"{phase}.json"), min(left, args.phase_timeout))
            report["phases"][phase] = result
            failed |= result["status"] != 0
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    print(f"{TABLE_MARK}\n{table(report)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
