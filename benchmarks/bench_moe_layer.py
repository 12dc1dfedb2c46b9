"""MoELayer benchmark on a DeepSeek-V3-like layer slice over NCCL (one process per GPU).

Defaults: hidden 7168, expert intermediate 2048, 256 routed experts (top-8, sigmoid scores over 8
groups, 4 kept, as DeepSeek-V3), 1 shared expert, 4096 tokens per rank, 4 ranks. Reports, as the
median over iterations of the slowest rank (CUDA events, after warm-up):

* layer forward+backward with the CUDA backend and with the torch backend (NCCL collectives), each
  in BF16 and with FP8 dispatch + FP8 experts;
* the dispatcher round trip alone (dispatch, permute, un-permute, combine, forward+backward) with the
  same routing, and its share of the layer time: the time in communication;
* the expert MLP alone, forward+backward on the same expert-major tokens: BF16 experts, FP8 experts
  on BF16 tokens, FP8 experts on FP8 tokens (as FP8 dispatch delivers them). FP8 experts are timed
  twice: with the weights cast on every forward (as after each optimizer step, which changes them)
  and with cached casts (`cache_fp8_weights`: micro-batches of gradient accumulation reuse them).

Memory per rank: 64 local experts are ~5.6 GB of BF16 weights, as much again in gradients, plus a few
GB of activations at 4096 tokens.

    python benchmarks/bench_moe_layer.py --out /tmp/moe_layer.json [--world 4]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from moe_ep.launch import launch
from moe_ep.layers import MoEConfig, MoELayer, MoETokenDispatcher
from moe_ep.layers.moe_layer import shared_buffer
from moe_ep.ops import fp8
from moe_ep.ops.backends import cuda_extension_available
from timing import every_rank, median_time_us, median_time_us_per_rank


def make_config(args: argparse.Namespace, use_fp8: bool) -> MoEConfig:
    return MoEConfig(
        hidden_size=args.hidden, moe_intermediate_size=args.inter, num_experts=args.experts,
        num_experts_per_tok=args.topk, score_func="sigmoid", norm_topk_prob=True, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, n_shared_experts=1, use_fp8_dispatch=use_fp8, use_fp8_experts=use_fp8,
        # One layout for both precisions: FP8 GEMMs need aligned expert segments, and BF16 vs FP8 experts
        # are compared on the same tokens.
        expert_alignment=16, num_worst_tokens=args.tokens * dist.get_world_size() if args.static_layout else 0)


class LayerBench:
    """One MoELayer whose dispatcher is swapped between backends and precisions."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args = args
        config = make_config(args, False)
        self.buffers = {backend: shared_buffer(dist.group.WORLD, config, torch.bfloat16, backend=backend)
                        for backend in ("cuda", "torch")}
        self.layer = MoELayer(config, buffer=self.buffers["cuda"], device=device, dtype=torch.bfloat16)
        gen = torch.Generator(device=device).manual_seed(dist.get_rank())
        self.x = torch.randn(args.tokens, args.hidden, device=device, generator=gen).to(torch.bfloat16)
        self.grad = torch.randn(args.tokens, args.hidden, device=device, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            self.topk_idx, self.topk_weights = self.layer.router(self.x)

    def use(self, backend: str, use_fp8: bool) -> None:
        self.layer.config = make_config(self.args, use_fp8)
        self.layer.dispatcher = MoETokenDispatcher(self.layer.config, self.buffers[backend])
        self.layer.experts.use_fp8 = use_fp8

    def layer_step(self) -> None:
        self.layer.zero_grad(set_to_none=True)
        x = self.x.detach().requires_grad_()
        self.layer(x).backward(self.grad)

    def dispatcher_round_trip(self) -> None:
        """Dispatch and combine with identity experts, forward+backward (FP8 tokens are cast back)."""
        x = self.x.detach().requires_grad_()
        weights = self.topk_weights.detach().requires_grad_()
        routed = self.layer.dispatcher.dispatch(x, self.topk_idx, weights)
        tokens = routed.tokens
        if isinstance(tokens, tuple):
            tokens = fp8.per_token_cast_back(*tokens) + routed.carrier
        self.layer.dispatcher.combine(tokens).backward(self.grad)

    def expert_inputs(self) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
        """Expert-major BF16 tokens of a real dispatch, with their counts."""
        self.use("cuda", False)
        with torch.no_grad():
            routed = self.layer.dispatcher.dispatch(self.x, self.topk_idx, self.topk_weights)
            self.layer.dispatcher.combine(routed.tokens)  # closes the step
        return routed.tokens, routed.tokens_per_expert, routed.tokens_per_expert_list


def profile_expert_step(step, label: str) -> None:
    """Print the kernels of one expert step by GPU time (rank 0)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        print(f"{label} expert step on rank 0, kernels by GPU time", flush=True)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=70))


def expert_results(bench: LayerBench, args: argparse.Namespace) -> dict:
    """Expert MLP times: the slowest rank's as `<run>_us`, and every rank's rows and times under `per_rank`."""
    experts = bench.layer.experts
    tokens, counts, counts_list = bench.expert_inputs()
    gen = torch.Generator(device=tokens.device).manual_seed(7)
    grad = torch.randn(tokens.shape, device=tokens.device, generator=gen).to(torch.bfloat16)
    tokens_8 = fp8.per_token_cast_to_fp8(tokens)
    per_rank = {"rows": every_rank(float(tokens.size(0))),
                "largest_expert_rows": every_rank(float(counts.max())),
                "empty_experts": every_rank(float((counts == 0).sum()))}

    def run(name: str, use_fp8: bool, fp8_tokens: bool, cached_casts: bool = False) -> None:
        experts.use_fp8 = use_fp8
        experts.cache_fp8_weights = cached_casts  # off again: the next forward drops the cached casts

        def step() -> None:
            experts.zero_grad(set_to_none=True)
            if fp8_tokens:  # a zero-storage carrier takes the tokens' gradient, as after an FP8 dispatch
                carrier = torch.zeros((), dtype=torch.bfloat16, device=tokens.device).expand(tokens.shape)
                out = experts(tokens_8, counts, carrier=carrier.requires_grad_(), tokens_per_expert_list=counts_list)
            else:
                out = experts(tokens.detach().requires_grad_(), counts, tokens_per_expert_list=counts_list)
            out.backward(grad)

        try:
            per_rank[f"{name}_us"] = median_time_us_per_rank(step, args.warmup, args.iters)
            if args.profile_experts and name in ("bf16", "fp8_cached"):
                profile_expert_step(step, name)
        finally:
            experts.cache_fp8_weights = False

    run("bf16", False, False)
    run("fp8", True, False)
    run("fp8_cached", True, False, cached_casts=True)
    run("fp8_tokens", True, True)
    run("fp8_tokens_cached", True, True, cached_casts=True)
    result = {"rows": tokens.size(0), "per_rank": per_rank}
    for name in ("bf16", "fp8", "fp8_cached", "fp8_tokens", "fp8_tokens_cached"):
        result[f"{name}_us"] = max(per_rank[f"{name}_us"])
        if name != "bf16":
            result[f"{name}_speedup"] = result["bf16_us"] / result[f"{name}_us"]
    return result


def run(rank: int, world: int, device: torch.device, args: argparse.Namespace) -> None:
    if device.type != "cuda":
        raise SystemExit("bench_moe_layer: needs one GPU per rank")
    args.experts = args.experts // world * world
    bench = LayerBench(args, device)
    layer = {}
    for backend in ("cuda", "torch"):
        for use_fp8 in (False, True):
            bench.use(backend, use_fp8)
            name = f"{backend}_{'fp8' if use_fp8 else 'bf16'}"
            total = median_time_us(bench.layer_step, args.warmup, args.iters)
            comm = median_time_us(bench.dispatcher_round_trip, args.warmup, args.iters)
            layer[name] = {"fwd_bwd_us": total, "comm_us": comm, "comm_share": comm / total}
            if rank == 0:
                print(f"{name}: {layer[name]}", flush=True)
    experts = expert_results(bench, args)
    report = {
        "args": vars(args), "world": world, "device": torch.cuda.get_device_name(device),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30, "layer": layer, "experts": experts,
        "speedups": {"cuda_vs_torch_bf16": layer["torch_bf16"]["fwd_bwd_us"] / layer["cuda_bf16"]["fwd_bwd_us"],
                     "cuda_vs_torch_fp8": layer["torch_fp8"]["fwd_bwd_us"] / layer["cuda_fp8"]["fwd_bwd_us"],
                     "fp8_vs_bf16_experts": experts["fp8_speedup"]},
    }
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(table(report))


def table(report: dict) -> str:
    lines = [f"{report['device']} x{report['world']}, {report['args']['tokens']} tokens/rank",
             "layer fwd+bwd     time(us)   comm(us)  comm share"]
    for name, row in report["layer"].items():
        lines.append(f"{name:16s} {row['fwd_bwd_us']:9.0f}  {row['comm_us']:9.0f}  {row['comm_share']:9.0%}")
    e = report["experts"]
    rows = ", ".join(f"{r:.0f}" for r in e["per_rank"]["rows"])
    lines.append(f"experts fwd+bwd (rows per rank: {rows}; slowest rank)  time(us)  vs bf16")
    for name, label in (("bf16", "bf16"), ("fp8", "fp8, weights cast every step"),
                        ("fp8_cached", "fp8, cached weight casts"), ("fp8_tokens", "fp8 tokens, cast every step"),
                        ("fp8_tokens_cached", "fp8 tokens, cached casts")):
        speedup = 1.0 if name == "bf16" else e[f"{name}_speedup"]
        lines.append(f"  {label:30s} {e[f'{name}_us']:9.0f}  {speedup:5.2f}x")
    lines.append("speedups: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["speedups"].items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--inter", type=int, default=2048, help="expert intermediate size")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--static-layout", action="store_true",
                        help="num_worst_tokens = all tokens: static shapes, no host sync (larger layout)")
    parser.add_argument("--profile-experts", action="store_true",
                        help="print the kernels of one BF16 and one cached FP8 expert step (rank 0)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if not cuda_extension_available():
        raise SystemExit("bench_moe_layer: needs GPUs and the built moe_ep._C extension")
    launch(run, args.world, args)


if __name__ == "__main__":
    main()
