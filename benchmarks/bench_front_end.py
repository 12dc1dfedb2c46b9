"""The Python front end of every Buffer call, on the CPU, its backend stubbed out.

A Buffer call is the front end (argument checks, the checked request, the stream scope, the result
and its event), then the backend (the binding's allocations and launches, or the torch backend's
collectives). This benchmark replaces every backend operation of a one-rank torch-backend Buffer by a
stub that returns outputs made beforehand, so what it times is the front end alone: the host time
that no kernel, binding or GPU change can remove, and that runs in the same Python whether the data
then moves over NVLink or over gloo. It needs no GPU: on a machine with a slower host the figures
scale with its single-thread speed (compare the "python loop" row, timed alongside). Medians of
--repeats runs of --iters calls each; value checks off (MOE_EP_CHECK_VALUES=0), as in the other
benchmarks.

    python benchmarks/bench_front_end.py --out front_end.json [--iters 2000 --repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from typing import Callable

os.environ.setdefault("MOE_EP_CHECK_VALUES", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import moe_ep  # noqa: E402
from moe_ep.launch import free_port  # noqa: E402
from moe_ep.ops import fp8  # noqa: E402
from moe_ep.ops.backends.base import DispatchResult, LowLatencyDispatchResult  # noqa: E402


def _python_loop() -> None:
    """A fixed amount of plain Python work: this host's single-thread speed."""
    total = 0
    for i in range(1000):
        total += i


def operations(args: argparse.Namespace) -> dict[str, Callable[[], object]]:
    """The Buffer calls to time, on a one-rank torch-backend Buffer whose backend operations return
    outputs computed once beforehand."""
    tokens, hidden, experts, topk, ll_tokens = args.tokens, args.hidden, args.experts, args.topk, args.ll_tokens
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    x_fp8 = fp8.per_token_cast_to_fp8(x.float())
    topk_idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
    weights = torch.rand(tokens, topk, generator=gen)
    ll_bytes = moe_ep.Buffer.get_low_latency_rdma_size_hint(ll_tokens, hidden, 1, experts)
    buffer = moe_ep.Buffer(dist.group.WORLD, 0, ll_bytes, low_latency_mode=True, backend="torch")
    layout = buffer.get_dispatch_layout(topk_idx, experts)[:4]
    per_rank, _, per_expert, in_rank = layout
    recv_x, recv_topk, recv_weights, per_expert_list, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=weights)
    ll_x, ll_topk, ll_weights = x[:ll_tokens], topk_idx[:ll_tokens], weights[:ll_tokens]
    ll_recv, ll_count, ll_handle, _, _ = buffer.low_latency_dispatch(ll_x, ll_topk, ll_tokens, experts, use_fp8=False)

    backend = buffer._torch
    result = DispatchResult(recv_x, None, recv_topk, recv_weights, per_expert_list, handle)
    ll_result = LowLatencyDispatchResult(ll_recv, None, ll_count, ll_handle)
    backend.start = lambda op, request: None
    backend.get_dispatch_layout = lambda t, e: layout
    backend.dispatch = lambda request: result
    backend.cached_dispatch = lambda request: (recv_x, None)
    backend.combine = lambda request: (x, weights)
    backend.low_latency_dispatch = lambda request: (ll_result, None)
    backend.low_latency_combine = lambda request: (ll_x, None)

    def dispatch(tokens_in: object) -> object:
        return buffer.dispatch(tokens_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)

    return {
        "python loop (1000 additions)": _python_loop,
        "get_dispatch_layout": lambda: buffer.get_dispatch_layout(topk_idx, experts),
        "dispatch BF16": lambda: dispatch(x),
        "dispatch FP8": lambda: dispatch(x_fp8),
        "dispatch, cached": lambda: buffer.dispatch(x, handle=handle),
        "combine": lambda: buffer.combine(recv_x, handle, topk_weights=recv_weights),
        "low-latency dispatch": lambda: buffer.low_latency_dispatch(ll_x, ll_topk, ll_tokens, experts,
                                                                     use_fp8=False),
        "low-latency combine": lambda: buffer.low_latency_combine(ll_recv, ll_topk, ll_weights, ll_handle),
    }


def time_us(fn: Callable[[], object], iters: int, repeats: int) -> dict[str, float]:
    """Microseconds per call: the median and the minimum over `repeats` runs of `iters` calls."""
    for _ in range(max(10, iters // 10)):
        fn()
    runs = []
    for _ in range(repeats):
        started = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter_ns() - started) / 1e3 / iters)
    return {"median": statistics.median(runs), "min": min(runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--ll-tokens", type=int, default=128)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        results = {name: time_us(fn, args.iters, args.repeats) for name, fn in operations(args).items()}
    finally:
        dist.destroy_process_group()
    report = {"args": vars(args), "date": datetime.date.today().isoformat(), "cpu": platform.processor() or
              platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
              "us_per_call": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"Buffer front end, backend stubbed ({args.tokens} tokens x {args.hidden}, top-{args.topk} of "
          f"{args.experts} experts; Python {report['python']}, torch {report['torch']}): us per call, median (min)")
    for name, r in results.items():
        print(f"  {name:32s} {r['median']:8.2f} ({r['min']:.2f})")


if __name__ == "__main__":
    main()
