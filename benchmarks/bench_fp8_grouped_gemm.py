"""Blockwise FP8 grouped GEMMs (CUDA and Triton) and FP8 casts against BF16 `torch._grouped_mm` on one GPU,
with a per-kernel profile: TFLOP/s beside the SM clock and power sampled during each kernel's run.

`--shapes ours` (DeepSeek-V3 expert shapes on one rank): 64 local experts, about 32768 expert-major
rows in uneven segments padded to 16 rows; the gate/up projection (K 7168 -> N 4096) and the down
projection (K 2048 -> N 7168). For each: forward and input gradient (dgrad: the same kernel against the
transposed FP8 weight), FP8 (the `moe_ep._fp8` wgmma kernel where built, and Triton) vs BF16;
Triton's autotuned tile and every tile's time; where the CUDA kernel runs, the weight gradient too
(BF16 `torch._grouped_mm` against the depth-grouped FP8 GEMM, and the two casts along the tokens it
needs); the forward also as what a user could pick instead: `torch._scaled_grouped_mm` with row-wise
scales (with and without fast accumulation), where `fbgemm_gpu` GenAI imports its row-wise and
blockwise grouped GEMMs, and where `deep_gemm` imports (gpu_check.sh's deepgemm part builds it) DeepGEMM's
grouped contiguous FP8 GEMM on our casts, at the shapes whose groups meet its 128-row alignment (a
missing one is listed as not run, with the reason);
the fused Triton casts (1x128 rows of the GEMM input and of the output gradient, the input rows cast
back to BF16, 128x128 weight cast with its transposed copy) against the torch reference casts, which
they must equal bit for bit. Then the whole expert MLP (`GroupedMLP`, SwiGLU, forward+backward on
the same segments, hidden 7168, intermediate 2048): BF16, FP8 with the weights cast on every step (as
after each optimizer step), FP8 with cached casts (gradient-accumulation micro-batches), the same
with FP8 weight gradients (CUDA GEMMs only), and the weight cast alone, with the CUDA GEMMs and again
with the Triton ones; `--profile` adds the kernels by GPU time of the BF16 step, the FP8 step with the
weights cast every step and, on the CUDA GEMMs, the one with cached weight casts and FP8 weight gradients.

`--shapes deepgemm`: DeepGEMM's published grouped contiguous shapes, 4 experts of 8192 rows, N 4096 / K
7168 and N 7168 / K 2048, forward only: the FP8 CUDA and Triton kernels, BF16, and the alternatives above.

Every GEMM row of the profile is timed over at least `--sample-seconds` (default 1 s; CUDA-event median
of the runs) while `nvidia-smi` samples the SM clock and power every 100 ms (`gpu_clocks.py`): a row
gets the median clock and power of its run, and its TFLOP/s at the board's maximum SM clock (the
measured rate x max clock / median clock), so that a kernel held back by the power cap is told apart
from a slow one. Runs this long settle lower than the 20-run medians this benchmark used to take
(the clock falls within seconds under load); `--sample-seconds 0` gives 20-run medians again, mostly
without clock samples. Errors are relative to float64 of the BF16 operands before any cast, on up to
4096 rows spread over the groups, so row-wise and blockwise scaling are compared at stated accuracy.
Prints each profile row as it is measured, then the JSON, then the tables (and writes the JSON with --out).

    python benchmarks/bench_fp8_grouped_gemm.py --out fp8_grouped_gemm.json [--profile] [--shapes ours,deepgemm]

About a minute on one H200 without the profile, most of it compiling the autotuned tiles (two
specializations each); the profile adds `--sample-seconds` for each of its 30 rows (both shape sets,
where the CUDA kernel and `torch._scaled_grouped_mm` run), so about 1.5 minutes in all by default.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable, Optional

import torch
import triton

from moe_ep.kernels import fp8_grouped_gemm as gemm
from moe_ep.kernels.fp8_backend import fp8_backend_for
from moe_ep.kernels.fp8_casts import (FP8Rows, cuda_weight_cast_runs, per_block_cast_to_fp8_with_transpose,
                                      per_token_cast_back, per_token_cast_to_fp8)
from moe_ep.layers import GroupedMLP
from moe_ep.ops import fp8
from fp8_operands import (ALIGNMENT, HIDDEN, INTERMEDIATE, PROJECTIONS, GroupedOperands, blockwise_casts,
                          blockwise_impls, grouped_operands, segment_counts, weight_grad_impls)
from fp8_profile import (DEEPGEMM_SHAPES, KernelTimer, alternative_impls, deepgemm_counts, deepgemm_impls,
                         grouped_gemm_flops, parse_shape_sets, profile_table, relative_error)
from gpu_clocks import ClockSampler, find_gpu, gpu_id_candidates
from timing import local_median_us

EXPERT_RUNS = {"bf16": "bf16", "fp8": "fp8, weights cast every step", "fp8_cached": "fp8, cached weight casts",
               "fp8_cached_wgrad": "fp8, cached, fp8 weight grads"}


def same_bits(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(g.view(torch.uint8) if g.dtype == fp8.FP8_DTYPE else g,
                           w.view(torch.uint8) if w.dtype == fp8.FP8_DTYPE else w) for g, w in zip(got, want))


def tile_name(config: triton.Config) -> str:
    k = config.kwargs
    columns = f"{k['BLOCK_N']}" if k["SPLIT_N"] == 1 else f"{k['SPLIT_N']}*{k['BLOCK_N']}"
    return f"{k['BLOCK_M']}x{columns} w{config.num_warps} s{config.num_stages}"


def time_each_tile(run: Callable[[Optional[triton.Config]], object], n_out: int) -> dict[str, Optional[float]]:
    """Median time of `run(config)` for every tile that fits; None where it does not compile."""
    times = {}
    for config in gemm.CONFIGS:
        if n_out % gemm.tile_width(config):
            continue
        try:
            times[tile_name(config)] = local_median_us(lambda: run(config), warmup=2, iters=5)
        except Exception as error:  # noqa: BLE001 - a tile that fails to compile is a result, not a crash
            print(f"tile {tile_name(config)}: {type(error).__name__}: {str(error)[:200]}")
            times[tile_name(config)] = None
    return times


def weight_cast_backends(w: torch.Tensor) -> list[str]:
    """The weight cast's backends here, the one "auto" picks first."""
    return ["cuda", "triton"] if cuda_weight_cast_runs(w) else ["triton"]


def bench_casts(x: torch.Tensor, grad: torch.Tensor, w: torch.Tensor) -> dict:
    """Fused Triton casts vs the torch reference: equality, times, and the Triton casts' bandwidth."""
    want_q, want_scales = fp8.per_block_cast_to_fp8(w)
    want_weight = (want_q, want_scales, want_q.transpose(-2, -1))
    backends = weight_cast_backends(w)
    results = {"casts_bitwise": (same_bits(per_token_cast_to_fp8(x), fp8.per_token_cast_to_fp8(x))
                                 and same_bits(per_token_cast_to_fp8(grad), fp8.per_token_cast_to_fp8(grad))
                                 and all(same_bits(per_block_cast_to_fp8_with_transpose(w, backend=backend),
                                                   want_weight) for backend in backends))}
    for name, tensor in (("rows", x), ("grad_rows", grad)):
        results[f"cast_{name}_us"] = local_median_us(lambda: per_token_cast_to_fp8(tensor))
        results[f"cast_{name}_torch_us"] = local_median_us(lambda: fp8.per_token_cast_to_fp8(tensor), iters=5)
        bytes_moved = tensor.numel() * (tensor.element_size() + 1)
        results[f"cast_{name}_gbps"] = bytes_moved / results[f"cast_{name}_us"] / 1e3
    q, scales = per_token_cast_to_fp8(x)
    results["casts_bitwise"] &= torch.equal(per_token_cast_back(q, scales), fp8.per_token_cast_back(q, scales))
    results["cast_back_rows_us"] = local_median_us(lambda: per_token_cast_back(q, scales))
    results["cast_back_rows_torch_us"] = local_median_us(lambda: fp8.per_token_cast_back(q, scales), iters=5)
    results["cast_back_rows_gbps"] = x.numel() * (1 + x.element_size()) / results["cast_back_rows_us"] / 1e3
    for backend in backends:  # "cast_weight": the default ("auto") choice
        name = "cast_weight" if backend == backends[0] else f"cast_weight_{backend}"
        results[f"{name}_us"] = local_median_us(lambda: per_block_cast_to_fp8_with_transpose(w, backend=backend))
        results[f"{name}_gbps"] = w.numel() * (w.element_size() + 2) / results[f"{name}_us"] / 1e3
    results["cast_weight_torch_us"] = local_median_us(lambda: fp8.per_block_cast_to_fp8(w), iters=5)
    # The memory's own speed beside it: a BF16 copy of the weight reads and writes 2 x its bytes.
    copy = torch.empty_like(w)
    results["copy_weight_us"] = local_median_us(lambda: copy.copy_(w))
    results["copy_weight_gbps"] = 2 * w.numel() * w.element_size() / results["copy_weight_us"] / 1e3
    return results


def bench_projection(timer: KernelTimer, num_experts: int, rows: int, depth: int, width: int, seed: int,
                     proj: str) -> dict:
    """Forward `[N, depth] -> [N, width]`, its dgrad and wgrad, FP8 vs BF16 grouped GEMMs (the forward also
    row-wise), the casts, and every Triton tile."""
    operands = grouped_operands(segment_counts(num_experts, rows, seed), depth, width)
    counts, ends, x, grad, w_bf16 = operands.counts, operands.ends, operands.x, operands.grad, operands.w
    num_rows = sum(counts)
    casts = bench_casts(x, grad, w_bf16)
    blockwise = blockwise_casts(operands)
    (qx, sx), (qg, sg) = blockwise.x_8, blockwise.grad_8
    (qw, sw), (qw_t, sw_t) = blockwise.w_8, blockwise.w_t_8
    w = fp8.per_block_cast_back(qw, sw, torch.bfloat16)  # the weights the FP8 GEMMs multiply

    def forward(config: Optional[triton.Config] = None, backend: str = "triton") -> torch.Tensor:
        return gemm.fp8_grouped_mm(qx, sx, qw, sw, ends, config=config, backend=backend)

    def dgrad(config: Optional[triton.Config] = None, backend: str = "triton") -> torch.Tensor:
        return gemm.fp8_grouped_mm(qg, sg, qw_t, sw_t, ends, config=config, backend=backend)

    # Correctness on the first expert's rows against the dequantized math (FP32 dense).
    first = slice(0, counts[0])
    dense_w = w[0].float()
    checks = {
        "forward_rel_err": relative_error(forward()[first], fp8.per_token_cast_back(qx, sx, torch.float32)[first]
                                          @ dense_w.t()),
        "forward_tile": tile_name(gemm._grouped_mm_kernel.best_config),
        "dgrad_rel_err": relative_error(dgrad()[first], fp8.per_token_cast_back(qg, sg, torch.float32)[first]
                                        @ dense_w),
        "dgrad_tile": tile_name(gemm._grouped_mm_kernel.best_config),
    }
    del w, dense_w
    cuda = gemm.cuda_kernel_runs(qx, qw)
    if cuda:
        for op, run in (("forward", forward), ("dgrad", dgrad)):
            got, want = run(backend="cuda"), run()
            checks[f"cuda_{op}_rel_err_vs_triton"] = relative_error(got, want)
            same = got.view(torch.int16) == want.view(torch.int16)
            checks[f"cuda_{op}_bitwise_share"] = float(same.double().mean())

    # The profile: every implementation's error against float64 and its time, the clock sampled meanwhile.
    shape, flops = f"ours {proj}", grouped_gemm_flops(num_rows, depth, width)
    impls, skipped = blockwise_impls(x, (qx, sx), w_bf16, (qw, sw), ends)
    alternatives, alternatives_skipped = alternative_impls(x, w_bf16, ends, counts)
    peer, peer_skipped = deepgemm_impls((qx, sx), (qw, sw), counts)
    forwards = timer.profile(shape, "forward", {**impls, **alternatives, **peer},
                             {**skipped, **alternatives_skipped, **peer_skipped}, x, w_bf16, counts, flops)
    del alternatives  # their row-wise copies of the weights
    w_t_bf16 = w_bf16.transpose(-2, -1)  # dgrad: grad [N, width] @ w[e] [width, depth]
    dgrad_impls, dgrad_skipped = blockwise_impls(grad, (qg, sg), w_t_bf16, (qw_t, sw_t), ends)
    dgrads = timer.profile(shape, "dgrad", dgrad_impls, dgrad_skipped, grad, w_t_bf16, counts, flops)
    times = {}
    for op, measured in (("forward", forwards), ("dgrad", dgrads)):
        times[f"bf16_{op}_us"], times[f"fp8_{op}_us"] = measured["bf16"]["us"], measured["fp8-triton"]["us"]
        checks[f"bf16_{op}_rel_err_fp64"] = measured["bf16"]["rel_err"]
        checks[f"fp8_{op}_rel_err_fp64"] = measured["fp8-triton"]["rel_err"]
        if cuda:
            times[f"cuda_fp8_{op}_us"] = measured["fp8-cuda"]["us"]
            checks[f"cuda_fp8_{op}_rel_err_fp64"] = measured["fp8-cuda"]["rel_err"]
    for impl in [impl for impl in forwards if impl not in impls]:  # the alternatives that ran
        times[f"{impl}_forward_us"] = forwards[impl]["us"]
        checks[f"{impl}_forward_rel_err_fp64"] = forwards[impl]["rel_err"]
    if cuda:
        wgrad = bench_weight_grad(timer, shape, operands, (qx, sx))
        times.update({k: v for k, v in wgrad.items() if k.endswith("_us")})
        checks.update({k: v for k, v in wgrad.items() if not k.endswith("_us")})
    tflops = {name.replace("_us", "_tflops"): flops / (t * 1e-6) / 1e12 for name, t in times.items()
              if "casts" not in name}
    tiles = {"forward_tiles_us": time_each_tile(forward, width), "dgrad_tiles_us": time_each_tile(dgrad, depth)}
    return {"num_experts": num_experts, "rows": num_rows, "K": depth, "M": width,
            **checks, **times, **tflops, **casts, **tiles,
            **{f"{kind}fp8_over_bf16_{op}": times[f"bf16_{op}_us"] / times[f"{kind}fp8_{op}_us"]
               for kind in ("", "cuda_")[:1 + cuda] for op in ("forward", "dgrad", "wgrad")
               if f"{kind}fp8_{op}_us" in times}}


def bench_weight_grad(timer: KernelTimer, shape: str, operands: GroupedOperands, x_8: FP8Rows) -> dict:
    """BF16 weight gradient and the FP8 depth-grouped GEMM (their first expert against float64 of the
    unquantized values), timed with the clock sampled; the FP8 GEMM's two casts, timed alone."""
    counts, x, grad = operands.counts, operands.x, operands.grad
    impls, casts = weight_grad_impls(operands, x_8)
    first = slice(0, counts[0])
    want = grad[first].double().t() @ x[first].double()
    errors = {"bf16_wgrad_rel_err": relative_error(impls["bf16"]()[0], want),
              "wgrad_rel_err": relative_error(impls["fp8-cuda"]()[0], want)}
    flops = grouped_gemm_flops(sum(counts), x.size(1), grad.size(1))
    return {**errors,
            "bf16_wgrad_us": timer.time(impls["bf16"], shape=shape, op="wgrad", impl="bf16", flops=flops,
                                        rel_err=errors["bf16_wgrad_rel_err"]),
            "cuda_fp8_wgrad_us": timer.time(impls["fp8-cuda"], shape=shape, op="wgrad", impl="fp8-cuda",
                                            flops=flops, rel_err=errors["wgrad_rel_err"]),
            "cuda_fp8_wgrad_casts_us": local_median_us(casts)}


def bench_deepgemm_shape(timer: KernelTimer, name: str, depth: int, width: int) -> dict:
    """DeepGEMM's grouped contiguous layout (equal groups, `deepgemm_counts`), forward only:
    `{impl: {"us", "rel_err"}}` of the FP8 kernels, BF16 and the alternatives."""
    operands = grouped_operands(deepgemm_counts(), depth, width, with_grad=False)
    counts, ends, x, w = operands.counts, operands.ends, operands.x, operands.w
    blockwise = blockwise_casts(operands)
    impls, skipped = blockwise_impls(x, blockwise.x_8, w, blockwise.w_8, ends)
    alternatives, alternatives_skipped = alternative_impls(x, w, ends, counts)
    peer, peer_skipped = deepgemm_impls(blockwise.x_8, blockwise.w_8, counts)
    return timer.profile(name, "forward", {**impls, **alternatives, **peer},
                         {**skipped, **alternatives_skipped, **peer_skipped}, x, w, counts,
                         grouped_gemm_flops(sum(counts), depth, width))


def bench_experts(num_experts: int, rows: int, profile: bool) -> dict:
    """`GroupedMLP` forward+backward in BF16 and FP8 (weights cast every step, and cached)."""
    counts = segment_counts(num_experts, rows, seed=len(PROJECTIONS))
    mlp = GroupedMLP(num_experts, HIDDEN, INTERMEDIATE, segment_alignment=ALIGNMENT, device="cuda",
                     dtype=torch.bfloat16)
    x = torch.randn(sum(counts), HIDDEN, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    tokens_per_expert = torch.tensor(counts, device="cuda")

    def step() -> None:
        mlp.zero_grad(set_to_none=True)
        mlp(x.detach().requires_grad_(), tokens_per_expert, tokens_per_expert_list=counts).backward(grad)

    results = {"rows": x.size(0), "gemm": "cuda" if gemm.cuda_kernel_runs(x, x) else "triton"}
    for name in EXPERT_RUNS:
        if name == "fp8_cached_wgrad" and results["gemm"] != "cuda":
            continue
        mlp.use_fp8, mlp.cache_fp8_weights = name != "bf16", name.startswith("fp8_cached")
        mlp.fp8_weight_grads = name == "fp8_cached_wgrad"
        results[f"{name}_us"] = local_median_us(step, warmup=3, iters=10)
        results[f"{name}_speedup"] = results["bf16_us"] / results[f"{name}_us"]
    if results["gemm"] == "cuda":  # the FP8 runs again on the Triton GEMMs
        runs_cuda = gemm.cuda_kernel_runs
        gemm.cuda_kernel_runs = lambda a, b: False
        mlp.fp8_weight_grads = False
        for name in ("fp8", "fp8_cached"):
            mlp.cache_fp8_weights = name == "fp8_cached"
            results[f"triton_{name}_us"] = local_median_us(step, warmup=3, iters=10)
            results[f"triton_{name}_speedup"] = results["bf16_us"] / results[f"triton_{name}_us"]
        gemm.cuda_kernel_runs = runs_cuda
    mlp.cache_fp8_weights = False
    weights = [p.detach() for p in (mlp.gate_up_proj, mlp.down_proj)]
    fp8_casts = fp8_backend_for(weights[0].device)
    results["fp8_weight_cast_us"] = local_median_us(lambda: [fp8_casts.cast_weight(w) for w in weights], iters=10)
    if profile:
        # (label, use_fp8, cache_fp8_weights, fp8_weight_grads); the last is the fastest FP8 step.
        steps = [("BF16", False, False, False), ("FP8, weights cast every step", True, False, False)]
        if results["gemm"] == "cuda":
            steps.append(("FP8, cached weight casts, FP8 weight gradients", True, True, True))
        for label, use_fp8, cached, weight_grads in steps:
            mlp.use_fp8, mlp.cache_fp8_weights, mlp.fp8_weight_grads = use_fp8, cached, weight_grads
            step()  # fills the weight cache where there is one, outside the trace
            torch.cuda.synchronize()
            span = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                span[0].record()
                step()
                span[1].record()
                torch.cuda.synchronize()
            # One stream: the kernels' own times add up to the busy part of the step's span; the rest is
            # the GPU waiting for the host (launches, synchronizations).
            busy_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
            span_ms = span[0].elapsed_time(span[1])
            print(f"{label} expert step: {span_ms:.2f} ms on the GPU's clock, kernels {busy_ms:.2f} ms, "
                  f"idle {span_ms - busy_ms:.2f} ms (under the profiler); kernels by GPU time")
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
        mlp.cache_fp8_weights = mlp.fp8_weight_grads = False
    return results


def tile_lines(results: dict) -> list[str]:
    columns = [f"{p} {op}" for p in PROJECTIONS for op in ("fwd", "dgrad")]
    lines = ["tile (us)          " + " ".join(f"{c:>14s}" for c in columns)]
    for tile in (tile_name(c) for c in gemm.CONFIGS):
        cells = [results[p][f"{op}_tiles_us"].get(tile) for p in PROJECTIONS for op in ("forward", "dgrad")]
        lines.append(f"{tile:18s} " + " ".join(f"{'-' if c is None else f'{c:.0f}':>14s}" for c in cells))
    return lines


def cast_lines(results: dict) -> list[str]:
    lines = [f"{'cast':21s} {'torch us':>8s} {'ours us':>8s} {'GB/s':>8s}  (weight: CUDA where it runs; bitwise equal: "
             + ", ".join(f"{p} {results[p]['casts_bitwise']}" for p in PROJECTIONS) + ")"]
    for proj in PROJECTIONS:
        r = results[proj]
        for name in ("rows", "grad_rows", "back_rows", "weight", "weight_triton"):
            if f"cast_{name}_us" in r:
                torch_us = r[f"cast_{name.removesuffix('_triton')}_torch_us"]
                lines.append(f"{proj + ' ' + name:21s} {torch_us:8.0f} {r[f'cast_{name}_us']:8.0f} "
                             f"{r[f'cast_{name}_gbps']:8.0f}")
        if "copy_weight_us" in r:
            lines.append(f"{proj + ' weight copy':21s} {r['copy_weight_us']:8.0f} {'-':>8s} "
                         f"{r['copy_weight_gbps']:8.0f}  (torch copy_ of the BF16 weight: the memory's speed)")
    return lines


def gemm_lines(results: dict) -> list[str]:
    lines = [f"{'GEMM':16s} {'bf16 us':>8s} {'triton':>8s} {'TF/s':>6s} {'cuda':>8s} {'TF/s':>6s} {'cuda/bf16':>9s} "
             f"{'rel err':>8s} {'bitwise':>7s}  triton tile"]
    for proj in PROJECTIONS:
        r = results[proj]
        for op in ("forward", "dgrad"):
            cuda = (f"{r[f'cuda_fp8_{op}_us']:8.0f} {r[f'cuda_fp8_{op}_tflops']:6.0f} "
                    f"{r[f'cuda_fp8_over_bf16_{op}']:9.2f}" if f"cuda_fp8_{op}_us" in r
                    else f"{'-':>8s} {'-':>6s} {'-':>9s}")
            bitwise = f"{r[f'cuda_{op}_bitwise_share']:7.4f}" if f"cuda_{op}_bitwise_share" in r else f"{'-':>7s}"
            lines.append(f"{proj + ' ' + op:16s} {r[f'bf16_{op}_us']:8.0f} {r[f'fp8_{op}_us']:8.0f} "
                         f"{r[f'fp8_{op}_tflops']:6.0f} {cuda} {r[f'{op}_rel_err']:8.1e} {bitwise}  {r[f'{op}_tile']}")
        if "cuda_fp8_wgrad_us" in r:
            lines.append(f"{proj + ' wgrad':16s} {r['bf16_wgrad_us']:8.0f} {'-':>8s} {'-':>6s} "
                         f"{r['cuda_fp8_wgrad_us']:8.0f} {r['cuda_fp8_wgrad_tflops']:6.0f} "
                         f"{r['cuda_fp8_over_bf16_wgrad']:9.2f} {r['wgrad_rel_err']:8.1e} {'-':>7s}  "
                         f"+ casts {r['cuda_fp8_wgrad_casts_us']:.0f} us")
    return lines


def expert_lines(results: dict) -> list[str]:
    e = results["experts"]
    lines = [f"experts fwd+bwd ({e['rows']} rows, {e['gemm']} FP8 GEMMs)  time(us)  vs bf16"]
    for name, label in EXPERT_RUNS.items():
        if f"{name}_us" in e:
            lines.append(f"  {label:30s} {e[f'{name}_us']:9.0f}  {e[f'{name}_speedup']:5.2f}x")
    for name in ("fp8", "fp8_cached"):
        if f"triton_{name}_us" in e:
            label = EXPERT_RUNS[name] + " (triton)"
            lines.append(f"  {label:30s} {e[f'triton_{name}_us']:9.0f}  {e[f'triton_{name}_speedup']:5.2f}x")
    lines.append(f"  {'fp8 weight cast alone':30s} {e['fp8_weight_cast_us']:9.0f}")
    return lines


def table(results: dict) -> str:
    """With our shapes: every tile's time, the casts (Triton vs torch), the GEMMs (BF16 vs FP8, autotuned
    tile) and the whole expert MLP; then the profile, one line per shape x op x implementation."""
    lines = [f"{results['device']}, torch {results['torch']}, triton {results['triton']}"]
    if "experts" in results:
        lines += tile_lines(results) + cast_lines(results) + gemm_lines(results) + expert_lines(results)
    return "\n".join(lines + [profile_table(results["kernels"], results["not_run"])])


def clock_sampler() -> ClockSampler:
    """`nvidia-smi` sampling the current GPU, found by its UUID (else its index), or a sampler that
    reports why there is none."""
    index = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    gpu, reason = find_gpu(gpu_id_candidates(str(uuid) if uuid else None, index,
                                             os.environ.get("CUDA_VISIBLE_DEVICES")))
    if gpu is None:
        print(f"no clock or power samples: {reason}")
    return ClockSampler(gpu, reason)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--profile", action="store_true", help="print the expert steps' kernels by GPU time")
    parser.add_argument("--shapes", default="ours,deepgemm",
                        help="comma list: ours (DeepSeek-V3 experts: forward, dgrad, wgrad, the MLP), deepgemm "
                             "(DeepGEMM's 4 x 8192-row shapes, forward)")
    parser.add_argument("--sample-seconds", type=float, default=1.0,
                        help="the least time each profiled GEMM runs, with the clock and power sampled meanwhile")
    args = parser.parse_args()
    try:
        shapes = parse_shape_sets(args.shapes)
    except ValueError as error:
        parser.error(str(error))
    if args.sample_seconds < 0:
        parser.error(f"--sample-seconds: expected a number >= 0, got {args.sample_seconds}")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    with clock_sampler() as sampler:
        timer = KernelTimer(sampler, args.sample_seconds)
        results["clock_sampler"] = {"gpu": sampler.gpu, "reason": sampler.reason, "sample_seconds": args.sample_seconds}
        for shape_set in shapes:
            if shape_set == "ours":
                for seed, (proj, (depth, width)) in enumerate(PROJECTIONS.items()):
                    results[proj] = bench_projection(timer, args.experts, args.rows, depth, width, seed, proj)
                    torch.cuda.empty_cache()
            else:
                results["deepgemm"] = {}
                for name, (depth, width) in DEEPGEMM_SHAPES.items():
                    results["deepgemm"][name] = bench_deepgemm_shape(timer, name, depth, width)
                    torch.cuda.empty_cache()
        if "ours" in shapes:
            results["experts"] = bench_experts(args.experts, args.rows, args.profile)
    results["kernels"], results["not_run"] = timer.rows, timer.skipped
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
