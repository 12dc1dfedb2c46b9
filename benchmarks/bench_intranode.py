"""Intranode normal-mode benchmark of the CUDA backend against NCCL all_to_all_single.

Spawns one process per GPU (NCCL group), builds DeepEP's standard workload (tokens per rank, hidden,
top-k of E experts, uniform random routing) and reports for dispatch BF16, dispatch FP8 and combine
BF16 the time (median over iterations, slowest rank) and the bandwidth in two metrics:
  * DeepEP's: bytes of the receive buffer on a rank, its own tokens included (FP8: data + scales);
  * remote: bytes that cross NVLink (rows received from other ranks).
NCCL all_to_all_single moving the same remote rows (BF16) is timed in the same run. A tuning sweep
over Config values picks the defaults per world size.

    python benchmarks/bench_intranode.py --out results.json [--worlds 4] [--quick | --configs 24:16:256,...] [--profile]

--profile (needs moe_ep._C built with MOE_EP_PROFILE=1) prints and stores the per-phase breakdown of one
dispatch (BF16, FP8) and one combine at the main workload with the best configs, and skips the timings at
other pipeline lags and the token sweep (a profiling build's timings are not the reference numbers).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import time
from dataclasses import replace

import torch
import torch.distributed as dist

import moe_ep
from moe_ep.ops import fp8
from moe_ep.ops.config import COMBINE_PATHS
from spawn import run_ranks
from timing import kernel_median_us, median_time_us

NVL_BYTES = 2 << 30
# DeepEP does no value checks of topk_idx; time the communication, not the front end's input checks.
os.environ.setdefault("MOE_EP_CHECK_VALUES", "0")
PIPELINE_LAGS = (1, 3, 0, 12)  # bulk stores in flight per storer thread; 0 = the default (half the stages)


def _workload(rank: int, world: int, tokens: int, hidden: int, num_experts: int, topk: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    scores = torch.randn(tokens, num_experts, device="cuda", generator=gen).abs() + 1
    topk_idx = scores.topk(topk, dim=1).indices
    topk_weights = torch.rand(tokens, topk, device="cuda", generator=gen)
    return x, topk_idx, topk_weights


class Bench:
    """One workload on one Buffer: timed dispatch (BF16, FP8), combine and the NCCL baseline."""

    def __init__(self, buffer: moe_ep.Buffer, rank: int, world: int, tokens: int, hidden: int, num_experts: int,
                 topk: int, warmup: int, iters: int) -> None:
        self.buffer, self.rank, self.world, self.hidden = buffer, rank, world, hidden
        self.warmup, self.iters = warmup, iters
        self.num_experts = num_experts
        self.x, self.topk_idx, self.topk_weights = _workload(rank, world, tokens, hidden, num_experts, topk, 17)
        self.x_fp8 = fp8.per_token_cast_to_fp8(self.x.float())
        self.layout = buffer.get_dispatch_layout(self.topk_idx, num_experts)[:4]
        per_rank = self.layout[0]
        counts = torch.empty(world * world, dtype=torch.int32, device="cuda")
        dist.all_gather_into_tensor(counts, per_rank)
        counts = counts.view(world, world).cpu()  # [src, dst]
        self.recv_rows = int(counts[:, rank].sum())
        self.remote_rows = self.recv_rows - int(counts[rank, rank])
        self.send_remote = [0 if d == rank else int(counts[rank, d]) for d in range(world)]
        self.recv_remote = [0 if s == rank else int(counts[s, rank]) for s in range(world)]

    def dispatch(self, config: moe_ep.Config, use_fp8: bool):
        per_rank, _, per_expert, in_rank = self.layout
        return self.buffer.dispatch(self.x_fp8 if use_fp8 else self.x, num_tokens_per_rank=per_rank,
                                    is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                    topk_idx=self.topk_idx, topk_weights=self.topk_weights, config=config)

    def measure(self, dispatch_config: moe_ep.Config, combine_config: moe_ep.Config) -> dict[str, float]:
        row_bf16 = self.hidden * 2
        row_fp8 = self.hidden + self.hidden // 128 * 4
        out: dict[str, float] = {}
        for name, use_fp8, row in (("dispatch_bf16", False, row_bf16), ("dispatch_fp8", True, row_fp8)):
            t = median_time_us(lambda: self.dispatch(dispatch_config, use_fp8), self.warmup, self.iters)
            out[f"{name}_us"] = t
            out[f"{name}_deepep_gbs"] = self.recv_rows * row / t / 1e3
            out[f"{name}_remote_gbs"] = self.remote_rows * row / t / 1e3
        recv_x, _, recv_w, _, handle, _ = self.dispatch(dispatch_config, False)
        t = median_time_us(lambda: self.buffer.combine(recv_x, handle, topk_weights=recv_w, config=combine_config),
                     self.warmup, self.iters)
        out["combine_bf16_us"] = t
        out["combine_bf16_deepep_gbs"] = self.recv_rows * row_bf16 / t / 1e3
        out["combine_bf16_remote_gbs"] = self.remote_rows * row_bf16 / t / 1e3
        return out

    def measure_kernels(self, dispatch_config: moe_ep.Config, combine_config: moe_ep.Config) -> dict[str, float]:
        """Kernel-only times (profiler trace, as DeepEP reports its kernels) and DeepEP-metric bandwidths."""
        out: dict[str, float] = {}
        kernels = {"notify": "notify_dispatch_kernel", "dispatch": "(?<![A-Za-z_])dispatch_kernel"}
        for name, use_fp8, row in (("bf16", False, self.hidden * 2),
                                   ("fp8", True, self.hidden + self.hidden // 128 * 4)):
            times = kernel_median_us(lambda: self.dispatch(dispatch_config, use_fp8), kernels, self.iters)
            out[f"dispatch_{name}_kernel_us"] = times["dispatch"]
            out[f"dispatch_{name}_kernel_deepep_gbs"] = self.recv_rows * row / times["dispatch"] / 1e3
            out[f"notify_{name}_kernel_us"] = times["notify"]
        recv_x, _, recv_w, _, handle, _ = self.dispatch(dispatch_config, False)
        # Staged (when it fits), then the rings, then staged again: alternated, so that a drift in the
        # machine shows as a difference between the two staged runs.
        for key, path in (("combine_bf16", "staged"), ("combine_bf16_rings", "rings"), ("combine_bf16_again", "staged")):
            config = replace(combine_config, combine_path=path)
            t = kernel_median_us(lambda: self.buffer.combine(recv_x, handle, topk_weights=recv_w, config=config),
                                 {"combine": "combine_kernel"}, self.iters)["combine"]
            out[f"{key}_kernel_us"] = t
            out[f"{key}_kernel_deepep_gbs"] = self.recv_rows * self.hidden * 2 / t / 1e3
            out[f"{key}_path"] = self.buffer._cuda.last_combine_path()
        return out

    def measure_layout(self) -> float:
        return median_time_us(lambda: self.buffer.get_dispatch_layout(self.topk_idx, self.num_experts), self.warmup,
                        self.iters)

    def measure_nccl(self) -> dict[str, float]:
        """all_to_all_single of the same remote BF16 rows (each rank sends what dispatch sends remotely)."""
        send = torch.randn(sum(self.send_remote), self.hidden, device="cuda").to(torch.bfloat16)
        recv = torch.empty(sum(self.recv_remote), self.hidden, device="cuda", dtype=torch.bfloat16)
        t = median_time_us(lambda: dist.all_to_all_single(recv, send, self.recv_remote, self.send_remote), self.warmup,
                     self.iters)
        return {"nccl_a2a_us": t, "nccl_a2a_remote_gbs": self.remote_rows * self.hidden * 2 / t / 1e3,
                "nccl_a2a_deepep_equiv_gbs": self.recv_rows * self.hidden * 2 / t / 1e3}


_PROFILE_COLUMNS = ("start_us", "first_us", "end_us", "span_us", "wait_stage_us", "wait_remote_us", "copy_us",
                    "copy_wait_us", "publish_us", "meta_us", "other_us", "items", "wait_events")


def _profile_table(title: str, summary: dict) -> str:
    """One line per role: mean/max over channels of every phase (us) and count."""
    lines = [f"--- {title}: kernel {summary.get('kernel_us', float('nan')):.1f} us, "
             f"{summary['num_channels']} channels (mean/max over channels; us)"]
    short = [c.replace("_us", "") for c in _PROFILE_COLUMNS]
    lines.append(f"{'role':14s} " + " ".join(f"{c:>13s}" for c in short))
    for role, row in summary.get("roles", {}).items():
        cells = []
        for c in _PROFILE_COLUMNS:
            m, x = row[c]["mean"], row[c]["max"]
            cells.append(f"{'-':>13s}" if m is None else f"{m:6.1f}/{x:6.1f}")
        lines.append(f"{role:14s} " + " ".join(cells))
    latest = sorted(summary.get("channels", []), key=lambda ch: -ch["end_us"])[:8]
    if latest:
        lines.append("latest channels (channel/SM: end us): " +
                     ", ".join(f"{ch['channel']}/{ch['sm']}: {ch['end_us']:.1f}" for ch in latest))
    return "\n".join(lines)


def _profile(main: "Bench", dispatch_config: moe_ep.Config, combine_config: moe_ep.Config) -> dict:
    """Per-phase breakdown of one dispatch (BF16, FP8) and one combine after a warm-up call each."""
    backend = main.buffer._cuda
    if backend is None or backend.profile() is None:
        raise RuntimeError("--profile: rebuild moe_ep._C with MOE_EP_PROFILE=1 (setup.py)")
    out: dict = {}
    for name, use_fp8 in (("dispatch_bf16", False), ("dispatch_fp8", True)):
        for _ in range(2):  # the second call is the one recorded
            main.dispatch(dispatch_config, use_fp8)
        torch.cuda.synchronize()
        prof = backend.profile()
        out[name] = {"host_notify_wait_us": prof["host_notify_wait_us"], **prof["dispatch"]}
        dist.barrier()
    recv_x, _, recv_w, _, handle, _ = main.dispatch(dispatch_config, False)
    for _ in range(2):
        main.buffer.combine(recv_x, handle, topk_weights=recv_w, config=combine_config)
    torch.cuda.synchronize()
    out["combine_bf16"] = backend.profile()["combine"]
    dist.barrier()
    return out


def _sweep_configs(quick: bool, configs: str = "") -> list[tuple[int, int, int]]:
    if configs:
        return [tuple(int(v) for v in c.split(":")) for c in configs.split(",")]  # type: ignore[misc]
    if quick:
        return [(24, 16, 256), (24, 4, 256)]  # the default dispatch and combine settings at 24 SMs
    return list(itertools.product((20, 24), (4, 8, 16, 32), (256, 512)))


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", rank))
    buffer = moe_ep.Buffer(dist.group.WORLD, NVL_BYTES, backend="cuda")

    def config(num_sms: int, send_chunk: int, ring: int) -> moe_ep.Config:
        return moe_ep.Config(num_sms, send_chunk, ring, 6, 128, combine_path=args.combine_path)

    args.experts = args.experts // world * world  # experts are sharded evenly (255 at world 3)
    report: dict[str, object] = {"world": world, "experts": args.experts}
    main = Bench(buffer, rank, world, args.tokens, args.hidden, args.experts, args.topk, args.warmup, args.iters)
    report["recv_rows_rank0"] = main.recv_rows
    report["remote_rows_rank0"] = main.remote_rows
    report["layout_us"] = main.measure_layout()
    report["nccl"] = main.measure_nccl()

    sweep = []
    for num_sms, send_chunk, ring in _sweep_configs(args.quick, args.configs):
        started = time.time()
        result = main.measure(config(num_sms, send_chunk, ring), config(num_sms, send_chunk, ring))
        sweep.append({"num_sms": num_sms, "send_chunk": send_chunk, "ring_slots": ring, **result})
        if rank == 0:
            print(f"[world {world}] sms={num_sms:2d} chunk={send_chunk:2d} ring={ring:3d}: "
                  f"dispatch {result['dispatch_bf16_us']:7.1f} us, fp8 {result['dispatch_fp8_us']:7.1f} us, "
                  f"combine {result['combine_bf16_us']:7.1f} us ({time.time() - started:.1f} s)", flush=True)
    report["sweep"] = sweep
    max_sms = args.max_sms
    eligible = [s for s in sweep if s["num_sms"] <= max_sms]
    best_dispatch = min(eligible, key=lambda s: s["dispatch_bf16_us"] + s["dispatch_fp8_us"])
    best_combine = min(eligible, key=lambda s: s["combine_bf16_us"])
    report["best_dispatch"] = best_dispatch
    report["best_combine"] = best_combine
    dispatch_config = config(best_dispatch["num_sms"], best_dispatch["send_chunk"], best_dispatch["ring_slots"])
    combine_config = config(best_combine["num_sms"], best_combine["send_chunk"], best_combine["ring_slots"])

    if args.profile:
        profile = _profile(main, dispatch_config, combine_config)
        if rank == 0:
            report["profile"] = profile
            print(f"[world {world}] per-phase profile, rank 0, dispatch config {dispatch_config}, "
                  f"combine config {combine_config}:", flush=True)
            for name, summary in profile.items():
                extra = (f", host notify wait {summary['host_notify_wait_us']:.1f} us"
                         if "host_notify_wait_us" in summary else "")
                print(_profile_table(name + extra, summary), flush=True)
        if rank == 0:
            results.put(report)
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)

    report["kernels"] = main.measure_kernels(dispatch_config, combine_config)
    if rank == 0:
        print(f"[world {world}] kernel times: {report['kernels']}", flush=True)
    by_lag = []
    for lag in PIPELINE_LAGS:
        timed = main.measure(replace(dispatch_config, pipeline_lag=lag), replace(combine_config, pipeline_lag=lag))
        by_lag.append({"pipeline_lag": lag, **timed})
        if rank == 0:
            print(f"[world {world}] pipeline lag {lag}: {by_lag[-1]}", flush=True)
    report["pipeline_lag_variants"] = by_lag

    token_sweep = []
    for tokens in args.token_sweep:
        bench = Bench(buffer, rank, world, tokens, args.hidden, args.experts, args.topk, args.warmup, args.iters)
        token_sweep.append({"tokens": tokens, "recv_rows_rank0": bench.recv_rows,
                            **bench.measure(dispatch_config, combine_config), **bench.measure_nccl()})
        if rank == 0:
            print(f"[world {world}] tokens={tokens}: {token_sweep[-1]}", flush=True)
    report["token_sweep"] = token_sweep
    if rank == 0:
        results.put(report)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _run_world(world: int, args: argparse.Namespace) -> dict:
    return run_ranks(_worker, world, args, args.timeout)


def _table(reports: list[dict]) -> str:
    lines = ["call = whole Buffer call (notify, host wait, launches); kernel = the data kernel alone (profiler)",
             "world  op             SMs  call(us)  DeepEP GB/s  remote GB/s  kernel(us)  DeepEP GB/s"
             "  | NCCL a2a same remote bytes"]
    for rep in reports:
        nccl, kernels = rep["nccl"], rep.get("kernels", {})
        for op, key, best in (("dispatch bf16", "dispatch_bf16", rep["best_dispatch"]),
                              ("dispatch fp8", "dispatch_fp8", rep["best_dispatch"]),
                              ("combine bf16", "combine_bf16", rep["best_combine"])):
            kernel_us = kernels.get(key + "_kernel_us", float("nan"))
            kernel_gbs = kernels.get(key + "_kernel_deepep_gbs", float("nan"))
            lines.append(f"{rep['world']:5d}  {op:13s}  {best['num_sms']:3d}  {best[key + '_us']:8.1f}  "
                         f"{best[key + '_deepep_gbs']:11.1f}  {best[key + '_remote_gbs']:11.1f}  "
                         f"{kernel_us:10.1f}  {kernel_gbs:11.1f}  | "
                         f"{nccl['nccl_a2a_us']:.1f} us, {nccl['nccl_a2a_remote_gbs']:.1f} GB/s")
        for key in ("combine_bf16_rings", "combine_bf16_again"):
            if key + "_kernel_us" in kernels:
                lines.append(f"{rep['world']:5d}  {key.replace('_bf16', '').replace('_', ' ')} ({kernels[key + '_path']})"
                             f"{'':>34s}{kernels[key + '_kernel_us']:10.1f}  "
                             f"{kernels[key + '_kernel_deepep_gbs']:11.1f}")
        lines.append(f"{rep['world']:5d}  layout kernel {rep['layout_us']:.1f} us")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--worlds", default="4")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--max-sms", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--token-sweep", default="128,512,1024,2048,4096,8192")
    parser.add_argument("--quick", action="store_true", help="two configs instead of the full sweep")
    parser.add_argument("--combine-path", choices=COMBINE_PATHS, default="auto",
                        help="Config.combine_path of every timed call but the kernel comparison (which times both): "
                             "the default per world size, staged when it fits, or the rings")
    parser.add_argument("--configs", default="",
                        help="NUM_SMS:CHUNK:RING,... measured instead of the sweep (kernels alone at the fastest)")
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--profile", action="store_true",
                        help="per-phase kernel breakdown (moe_ep._C built with MOE_EP_PROFILE=1)")
    args = parser.parse_args()
    args.token_sweep = [int(t) for t in args.token_sweep.split(",") if t]
    reports = []
    for world in [int(w) for w in args.worlds.split(",")]:
        if world > torch.cuda.device_count():
            print(f"skipping world {world}: only {torch.cuda.device_count()} GPUs")
            continue
        try:
            reports.append(_run_world(world, args))
        except RuntimeError as exc:
            print(exc)
            continue
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(0), "reports": reports}, f, indent=1)
    print(_table(reports))


if __name__ == "__main__":
    main()
