"""Internode normal-mode benchmark: the hierarchical path against the flat one and all_to_all_single.

Runs on every rank of a job: under `torchrun` across real nodes (nodes = hosts), or spawned on one host
(NCCL with one GPU per rank when there are enough GPUs, else gloo on the CPU) with virtual nodes
(`--ranks-per-node`). Workload: `--shape deepep` is DeepEP's internode test (4096 tokens per rank, hidden
7168, top-8 of 256 experts, uniform random routing), `--shape small` a CPU-sized one; FP8 dispatch and
BF16 combine, as DeepEP measures. Reports, for the slowest rank:
  * the network leg: rows and bytes that cross between nodes per dispatch, hierarchical (one copy per
    token and destination node, checked against the torch backend's counter) against a flat all-to-all
    (one copy per token and destination rank), and their ratio (the dedup factor);
  * whole-call times (front end, count exchange, both legs) of dispatch (fresh and cached) and combine,
    on the hierarchical path and on the flat path (torch backend), and network-leg GB/s per rank;
  * all_to_all_single over the whole group moving the flat path's bytes (FP8 rows out, BF16 rows back).

    torchrun --nnodes 2 --nproc-per-node 8 ... benchmarks/bench_internode.py --out internode.json
    python benchmarks/bench_internode.py --world 4 --ranks-per-node 2 --shape small --out internode_cpu.json

`--backend cuda` runs the CUDA backend (both legs as NVSHMEM kernels; its network-row counter is checked
the same way). On one GPU its ranks share the GPU: the figures then prove the dedup and the path, not speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

import moe_ep
from moe_ep.launch import launch
from moe_ep.ops import fp8
from moe_ep.ops.backends.collectives import all_gather_into
from moe_ep.ops.topology import node_mask
from timing import median_time_us

# DeepEP does no value checks of topk_idx; time the communication, not the front end's input checks.
os.environ.setdefault("MOE_EP_CHECK_VALUES", "0")
SHAPES = {"deepep": (4096, 7168, 256, 8), "small": (512, 2048, 64, 8)}  # tokens, hidden, experts, top-k


def _gather(value: float, device: torch.device) -> list[float]:
    values = torch.empty(dist.get_world_size(), dtype=torch.float64, device=device)
    all_gather_into(values, torch.tensor([value], dtype=torch.float64, device=device), dist.group.WORLD)
    return values.tolist()


def _time_us(fn: Callable[[], object], warmup: int, iters: int, device: torch.device) -> float:
    """Median time of `fn` (every run started in step on all ranks), the slowest rank's: CUDA events on
    GPUs (benchmarks/timing.py), wall clock on the CPU."""
    if device.type == "cuda":
        return median_time_us(fn, warmup, iters)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return max(_gather(statistics.median(times), device))


def _workload(rank: int, tokens: int, hidden: int, num_experts: int, topk: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(17 + rank)
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    scores = torch.randn(tokens, num_experts, device=device, generator=gen).abs() + 1
    topk_idx = scores.topk(topk, dim=1).indices
    topk_weights = torch.rand(tokens, topk, device=device, generator=gen)
    return x, topk_idx, topk_weights


def run(rank: int, world: int, device: torch.device, args: argparse.Namespace) -> None:
    tokens, hidden, num_experts, topk = SHAPES[args.shape]
    num_experts = num_experts // world * world
    config = moe_ep.Config(args.num_sms, 8, 256, 8, 128)
    hidden_bytes = hidden * 2
    nvl_bytes = rdma_bytes = 0
    if args.backend != "torch":
        nvl_bytes = config.get_nvl_buffer_size_hint(hidden_bytes, world)
        rdma_bytes = config.get_rdma_buffer_size_hint(hidden_bytes, world, args.ranks_per_node or 8)
    buffer = moe_ep.Buffer(dist.group.WORLD, nvl_bytes, rdma_bytes, backend=args.backend,
                           num_ranks_per_node=args.ranks_per_node)
    nodes = buffer.node_topology()
    if nodes.num_nodes < 2:
        raise SystemExit(f"one node of {world} ranks: nothing crosses a network (set --ranks-per-node)")
    # The path whose network-row counter is checked: the CUDA backend's own, or the torch backend's.
    internode = buffer._cuda.path if buffer.backend_name_for(torch.empty(0, device=device)) == "cuda" \
        else buffer._torch.internode
    x, topk_idx, topk_weights = _workload(rank, tokens, hidden, num_experts, topk, device)
    x_fp8 = fp8.per_token_cast_to_fp8(x.float())
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)

    def dispatch(cached_handle=None):
        if cached_handle is not None:
            return buffer.dispatch(x_fp8, handle=cached_handle, config=config)
        return buffer.dispatch(x_fp8, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                               is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                               topk_weights=topk_weights, config=config)

    # Network leg: per-node unique copies (hierarchical) against per-rank copies (flat), this rank's sends.
    other_nodes = torch.arange(nodes.num_nodes, device=device) != nodes.node
    other_ranks = torch.repeat_interleave(other_nodes, nodes.num_ranks_per_node)
    hier_rows = int(node_mask(in_rank, nodes.num_ranks_per_node)[:, other_nodes].sum())
    flat_rows = int(in_rank[:, other_ranks].sum())
    fp8_row = hidden + hidden // 128 * 4  # data and scales; top-k ids, weights and index ride along
    report: dict = {"world": world, "nodes": nodes.num_nodes, "ranks_per_node": nodes.num_ranks_per_node,
                    "tokens": tokens, "hidden": hidden, "experts": num_experts, "topk": topk,
                    "backend": args.backend, "device": str(device)}

    recv, _, recv_w, _, handle, _ = dispatch()
    counted = internode is not None and internode.last_path == "hierarchical"
    if counted and internode.last_network_rows != hier_rows:
        raise AssertionError(f"rank {rank}: the {args.backend} backend sent {internode.last_network_rows} rows to other "
                             f"nodes, the per-node unique copies are {hier_rows}")
    packed_row = internode.last_network_bytes // max(hier_rows, 1) if counted else float("nan")
    y = fp8.per_token_cast_back(*recv, torch.bfloat16)
    rows_hier, rows_flat = _gather(hier_rows, device), _gather(flat_rows, device)
    report["network"] = {
        "dispatch_rows_hierarchical": rows_hier, "dispatch_rows_flat": rows_flat,
        "dedup_factor": sum(rows_flat) / max(sum(rows_hier), 1),
        "fp8_payload_bytes_hierarchical_max": max(rows_hier) * fp8_row,
        "fp8_payload_bytes_flat_max": max(rows_flat) * fp8_row,
        "packed_row_bytes": packed_row, "counter_checked": counted,
    }

    # The torch backend runs both paths (same outputs); another backend runs its own.
    on_torch = buffer.backend_name_for(x) == "torch"
    for name, hierarchical in ({"hierarchical": True, "flat": False} if on_torch else {args.backend: True}).items():
        if on_torch:
            internode.hierarchical = hierarchical
        recv, _, recv_w, _, handle, _ = dispatch()
        times = {
            "dispatch_fp8_us": _time_us(dispatch, args.warmup, args.iters, device),
            "cached_dispatch_fp8_us": _time_us(lambda: dispatch(handle), args.warmup, args.iters, device),
            "combine_bf16_us": _time_us(lambda: buffer.combine(y, handle, topk_weights=recv_w, config=config),
                                        args.warmup, args.iters, device),
        }
        rows = max(rows_hier) if hierarchical else max(rows_flat)
        times["dispatch_network_gbs_per_rank"] = rows * fp8_row / times["dispatch_fp8_us"] / 1e3
        times["combine_network_gbs_per_rank"] = rows * hidden_bytes / times["combine_bf16_us"] / 1e3
        report[name] = times

    # all_to_all_single over the whole group with the flat path's bytes: FP8 rows out, BF16 rows back.
    counts = torch.empty(world * world, dtype=torch.int64, device=device)
    all_gather_into(counts, per_rank.to(torch.int64), dist.group.WORLD)
    counts = counts.view(world, world).cpu()
    send, recv_counts = counts[rank].tolist(), counts[:, rank].tolist()
    baseline = {}
    for name, row_bytes in (("a2a_fp8_us", fp8_row), ("a2a_bf16_back_us", hidden_bytes)):
        out_rows = torch.empty(sum(send), row_bytes, dtype=torch.uint8, device=device)
        in_rows = torch.empty(sum(recv_counts), row_bytes, dtype=torch.uint8, device=device)
        baseline[name] = _time_us(lambda: dist.all_to_all_single(in_rows, out_rows, recv_counts, send),
                                  args.warmup, args.iters, device)
    report["all_to_all_single"] = baseline
    if rank == 0:
        print(_table(report), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)


def _table(r: dict) -> str:
    net = r["network"]
    lines = [f"{r['world']} ranks = {r['nodes']} nodes x {r['ranks_per_node']} ({r['device']}, "
             f"backend {r['backend']}); {r['tokens']} tokens x hidden {r['hidden']}, top-{r['topk']} of {r['experts']} experts",
             f"network leg per dispatch, all ranks: {sum(net['dispatch_rows_hierarchical']):.0f} rows hierarchical "
             f"(per-node copies) vs {sum(net['dispatch_rows_flat']):.0f} flat (per-rank copies): dedup "
             f"{net['dedup_factor']:.2f}x; busiest rank {net['fp8_payload_bytes_hierarchical_max'] / 1e6:.2f} MB vs "
             f"{net['fp8_payload_bytes_flat_max'] / 1e6:.2f} MB of FP8 rows"
             + (f" ({r['backend']} backend's counter checked)" if net["counter_checked"] else ""),
             "whole calls, slowest rank (us); network-leg GB/s per rank (dispatch / combine)",
             "path           dispatch fp8    cached fp8  combine bf16   net GB/s"]
    for name in ("hierarchical", "flat", "cuda", "auto"):
        if name in r:
            t = r[name]
            lines.append(f"{name:13s}  {t['dispatch_fp8_us']:12.1f}  {t['cached_dispatch_fp8_us']:12.1f}  "
                         f"{t['combine_bf16_us']:12.1f}   {t['dispatch_network_gbs_per_rank']:.3f} / "
                         f"{t['combine_network_gbs_per_rank']:.3f}")
    base = r["all_to_all_single"]
    lines.append(f"all_to_all_single of the flat bytes: FP8 rows {base['a2a_fp8_us']:.1f} us, BF16 rows back "
                 f"{base['a2a_bf16_back_us']:.1f} us")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="")
    parser.add_argument("--world", type=int, default=4, help="ranks to spawn on this host (ignored under torchrun)")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="virtual nodes (default: the hosts)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deepep")
    parser.add_argument("--backend", choices=("torch", "cuda", "auto"), default="torch")
    parser.add_argument("--num-sms", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    launch(run, args.world, args)


if __name__ == "__main__":
    main()
