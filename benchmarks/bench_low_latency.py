"""Low-latency (decode) benchmark of the CUDA backend against NCCL all_to_all_single.

Spawns one process per GPU (NCCL group) and runs DeepEP's low-latency workload: T tokens per rank
(a sweep, 128 by default first), hidden 7168, top-8 of 256 experts (uniform random routing, no masked
slots), FP8 dispatch and BF16 combine, with `num_max_dispatch_tokens_per_rank = T`. Reported per T:
  * kernel times (torch profiler, median over iterations, slowest rank): dispatch and combine with
    both phases, and in hook mode the send and receive kernels of each, all with the iterations queued
    behind a long matmul and started in step on all ranks, as DeepEP's benchmarks time them;
    `host_paced_*`: dispatch and combine launched as the host gets to them, not queued behind the
    matmul, so that a kernel also holds the wait for the slowest rank's launch;
  * dispatch + combine: one captured (dispatch, combine) pair replayed, timed with CUDA events after a
    barrier (`dispatch_combine_pair_us`: median, slowest rank; holds the ranks' host skew) and with the
    replays queued and started in step like the kernels (`dispatch_combine_pair_queued_us`: mean per
    replay, slowest rank);
  * bytes: one message per (token, expert) pair, `msg_bytes` each (FP8 dispatch: H + 4 H / 128;
    combine: 2 H); `*_gbps` divide the bytes a rank sends to other ranks by the kernel time. The
    dispatch sends one row per (token, destination rank) (`remote_rows_max`); the combine sends one
    partial row per (token, expert rank) back to the token's rank (`combine_remote_rows_max`: the
    (source rank, token) pairs from other ranks this rank received, plus `combine_meta_bytes` of top-k
    ids and weights per (token, other rank)). `dispatch_remote_gbps` / `combine_remote_gbps` count
    messages (bytes delivered, what DeepEP moves), `combine_remote_rows_gbps` and `hook_*_send_gbps`
    the rows that cross NVLink (`hook_combine_send_messages_gbps`: the combine send counted in messages,
    as DeepEP counts it);
  * NCCL all_to_all_single moving the same messages between the same ranks (uint8 rows), timed both
    ways like the pair above (`nccl_*_bytes_us`, `nccl_*_bytes_queued_us`), in the same run;
  * `module`: the low-latency extension that ran (`moe_ep._low_latency_p2p` on one host with P2P,
    `moe_ep._low_latency` otherwise or with MOE_EP_LOW_LATENCY_TRANSPORT=nvshmem);
  * with `--logfmt`: the combine again with `use_logfmt=True` (`logfmt_combine_us`, its hook send and
    receive kernels, `logfmt_over_bf16_combine` the ratio of kernel times), the expert outputs then
    having expert-output magnitudes (Gaussian, 0.02) so that LogFMT encodes their blocks, and
    `logfmt_bytes_ratio` the bytes of those rows in LogFMT-10 over their BF16 bytes.

    python benchmarks/bench_low_latency.py --out /tmp/low_latency.json [--tokens 128 1 512] [--logfmt]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_ep.launch import free_port
from moe_ep.ops import logfmt
from moe_ep.ops.backends import cuda_low_latency
from moe_ep.ops.backends.cuda_low_latency import LowLatencyRuntime
from moe_ep.ops.config import low_latency_buffer_bytes
from moe_ep.ops.requests import LowLatencyCombineRequest, LowLatencyDispatchRequest
from timing import kernel_times_by_launch_us, median_time_us, queued_time_us, slowest_rank


# The low-latency kernels of moe_ep._low_latency(_p2p): hook mode launches each again for its receive phase.
LOW_LATENCY_KERNELS = r"dispatch_kernel|combine_kernel"


def _kernel_times_us(fn: Callable[[], object], warmup: int, iters: int, names: list[str],
                     queued: bool = True) -> list[float]:
    """Median durations of the low-latency kernels `fn` launches, one per launch of an iteration (in
    launch order; `names` says what each is): `timing.kernel_times_by_launch_us`."""
    return kernel_times_by_launch_us(fn, LOW_LATENCY_KERNELS, names, warmup, iters, queued)


def _routing(tokens: int, num_experts: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random top-k (distinct experts per token) and weights."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    topk_idx = torch.rand(tokens, num_experts, generator=gen, device="cuda").topk(topk, dim=1).indices
    return topk_idx, torch.rand(tokens, topk, generator=gen, device="cuda")


def _nccl_exchange(topk_idx: torch.Tensor, num_experts: int, msg_bytes: int) -> Callable[[], object]:
    """all_to_all_single moving one `msg_bytes` row per (token, expert) pair to the expert's rank."""
    world = dist.get_world_size()
    dest = (topk_idx // (num_experts // world)).flatten()
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    send = torch.randint(0, 255, (int(send_counts.sum()), msg_bytes), dtype=torch.uint8, device="cuda")
    recv = torch.empty(int(recv_counts.sum()), msg_bytes, dtype=torch.uint8, device="cuda")
    splits_in, splits_out = send_counts.tolist(), recv_counts.tolist()
    return lambda: dist.all_to_all_single(recv, send, splits_out, splits_in)


def _remote_messages(topk_idx: torch.Tensor, num_experts: int) -> int:
    world, rank = dist.get_world_size(), dist.get_rank()
    return int((topk_idx // (num_experts // world) != rank).sum())


def _remote_rows(topk_idx: torch.Tensor, num_experts: int) -> int:
    """(token, other rank) pairs with at least one of the token's experts on that rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dest = topk_idx // (num_experts // world)
    return sum(int((dest == r).any(dim=1).sum()) for r in range(world) if r != rank)


def _combine_remote_rows(topk_idx: torch.Tensor, num_experts: int) -> int:
    """(source rank, token) pairs of other ranks with at least one expert on this rank: the partial rows
    this rank's combine sends over NVLink."""
    world, rank = dist.get_world_size(), dist.get_rank()
    every = [torch.empty_like(topk_idx) for _ in range(world)]
    dist.all_gather(every, topk_idx)
    hosts = [((idx >= 0) & (idx // (num_experts // world) == rank)).any(dim=1) for idx in every]
    return sum(int(h.sum()) for s, h in enumerate(hosts) if s != rank)


def _logfmt_bytes_ratio(rows: torch.Tensor, chunk_rows: int = 512) -> float:
    """The LogFMT-10 bytes of BF16 `rows [N, H]` over their BF16 bytes. The Python reference encoder
    expands every value to its bits, so it runs over bounded chunks of rows."""
    wire_bytes = sum(float(logfmt.encode(rows[start:start + chunk_rows]).nbytes.double().sum())
                     for start in range(0, rows.size(0), chunk_rows))
    return wire_bytes / (2 * rows.numel())


def _measure(runtime: LowLatencyRuntime, tokens: int, args: argparse.Namespace) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    hidden, num_experts, topk = args.hidden, args.experts, args.topk
    topk_idx, topk_weights = _routing(tokens, num_experts, topk, 1000 + rank)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    num_local, slots = num_experts // world, world * tokens

    def dispatch(hook: bool):
        return runtime.low_latency_dispatch(LowLatencyDispatchRequest(x, topk_idx, tokens, num_experts, None, None,
                                                                      True, False, False, hook))

    first, _ = dispatch(False)
    y = (torch.randn(num_local, slots, hidden, device="cuda") * (0.02 if args.logfmt else 1.0)).to(torch.bfloat16)

    def combine(handle, hook: bool, use_logfmt: bool = False):
        return runtime.low_latency_combine(LowLatencyCombineRequest(y, topk_idx, topk_weights, handle, False, hook,
                                                                    None, None, use_logfmt))

    def pair(use_logfmt: bool = False) -> None:
        result, _ = dispatch(False)
        combine(result.handle, False, use_logfmt)

    def hooked_pair(use_logfmt: bool = False) -> None:
        result, recv = dispatch(True)
        recv()
        _, combine_recv = combine(result.handle, True, use_logfmt)
        combine_recv()

    dispatch_us, combine_us = _kernel_times_us(pair, args.warmup, args.iters, ["dispatch", "combine"])
    paced_dispatch_us, paced_combine_us = _kernel_times_us(pair, args.warmup, args.iters, ["dispatch", "combine"],
                                                           queued=False)
    send_us, recv_us, combine_send_us, combine_recv_us = _kernel_times_us(
        hooked_pair, args.warmup, args.iters, ["dispatch send", "dispatch recv", "combine send", "combine recv"])
    logfmt_row = {}
    if args.logfmt:
        _, logfmt_combine_us = _kernel_times_us(lambda: pair(True), args.warmup, args.iters, ["dispatch", "combine"])
        _, _, logfmt_send_us, logfmt_recv_us = _kernel_times_us(
            lambda: hooked_pair(True), args.warmup, args.iters,
            ["dispatch send", "dispatch recv", "combine send", "combine recv"])
        logfmt_row = {"logfmt_combine_us": logfmt_combine_us, "logfmt_over_bf16_combine": logfmt_combine_us / combine_us,
                      "logfmt_hook_combine_send_us": logfmt_send_us, "logfmt_hook_combine_recv_us": logfmt_recv_us,
                      "logfmt_bytes_ratio": _logfmt_bytes_ratio(y.view(-1, hidden))}

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # the NCCL watchdog thread runs on
        pair()
    pair_us = median_time_us(graph.replay, args.warmup, args.iters)
    pair_queued_us = queued_time_us(graph.replay, args.warmup, args.iters)

    dispatch_msg, combine_msg = hidden + hidden // 128 * 4, 2 * hidden
    remote = slowest_rank(_remote_messages(topk_idx, num_experts))
    remote_rows = slowest_rank(_remote_rows(topk_idx, num_experts))
    combine_rows = slowest_rank(_combine_remote_rows(topk_idx, num_experts))
    meta_bytes = remote_rows * (8 * topk + 8)  # the source's (id, weight) entries and flag per (token, rank)
    nccl = {}
    for name, msg_bytes in (("dispatch", dispatch_msg), ("combine", combine_msg)):
        exchange = _nccl_exchange(topk_idx, num_experts, msg_bytes)
        nccl[f"nccl_{name}_bytes_us"] = median_time_us(exchange, args.warmup, args.iters)
        nccl[f"nccl_{name}_bytes_queued_us"] = queued_time_us(exchange, args.warmup, args.iters)
    torch.cuda.synchronize()
    dist.barrier()
    del graph, first
    return {
        "tokens_per_rank": tokens, "messages_per_rank": tokens * topk, "remote_messages_max": int(remote),
        "remote_rows_max": int(remote_rows), "combine_remote_rows_max": int(combine_rows),
        "dispatch_msg_bytes": dispatch_msg, "combine_msg_bytes": combine_msg,
        "combine_remote_message_bytes": int(remote * combine_msg), "combine_remote_row_bytes": int(combine_rows * combine_msg),
        "combine_meta_bytes": int(meta_bytes),
        "dispatch_us": dispatch_us, "combine_us": combine_us, "dispatch_plus_combine_kernels_us": dispatch_us + combine_us,
        "dispatch_combine_pair_us": pair_us, "dispatch_combine_pair_queued_us": pair_queued_us,
        "host_paced_dispatch_us": paced_dispatch_us, "host_paced_combine_us": paced_combine_us,
        "hook_dispatch_send_us": send_us, "hook_dispatch_recv_us": recv_us,
        "hook_combine_send_us": combine_send_us, "hook_combine_recv_us": combine_recv_us,
        "dispatch_remote_gbps": remote * dispatch_msg / dispatch_us / 1e3,
        "combine_remote_gbps": remote * combine_msg / combine_us / 1e3,
        "combine_remote_rows_gbps": combine_rows * combine_msg / combine_us / 1e3,
        "hook_dispatch_send_gbps": remote_rows * dispatch_msg / send_us / 1e3,
        "hook_combine_send_gbps": (combine_rows * combine_msg + meta_bytes) / combine_send_us / 1e3,
        "hook_combine_send_messages_gbps": remote * combine_msg / combine_send_us / 1e3,
        **nccl,
        **logfmt_row,
    }


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results: "mp.Queue") -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", rank))
    torch.manual_seed(rank)
    # One buffer for the sweep: each new token count cleans it once (collectively).
    runtime = LowLatencyRuntime(dist.group.WORLD, rank, world,
                                max(low_latency_buffer_bytes(t, args.hidden, world, args.experts) for t in args.tokens))
    rows = []
    for tokens in args.tokens:
        row = _measure(runtime, tokens, args)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        results.put((cuda_low_latency._ext().__name__, rows))
    runtime.destroy()
    dist.destroy_process_group()
    os._exit(0)  # NVSHMEM is not finalised: skip the interpreter's teardown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1, 8, 32, 64, 256, 512])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--logfmt", action="store_true",
                        help="also time the combine with use_logfmt=True (expert outputs of magnitude 0.02)")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.world:
        sys.exit(f"needs {args.world} GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, results)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    module, rows = results.get()
    for proc in procs:
        proc.join()
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "world": args.world,
              "hidden": args.hidden, "experts": args.experts, "topk": args.topk,
              "module": module, "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
