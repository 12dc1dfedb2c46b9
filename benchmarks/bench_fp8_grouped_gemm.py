"""Triton blockwise FP8 grouped GEMMs against BF16 `torch._grouped_mm` on one GPU.

DeepSeek-V3 expert shapes on one rank: 64 local experts, about 32768 expert-major rows in uneven
segments padded to 16 rows; the gate/up projection (K 7168 -> M 4096) and the down projection
(K 2048 -> M 7168). For each: forward and input gradient (dgrad), FP8 vs BF16, CUDA-event medians.
The FP8 dgrad includes its K-major copy of the FP8 weight; `fp8_dgrad_strided_weight` skips the
copy (Triton transposes tiles on chip) to show whether the copy pays. `cast_rows_us` is the 1x128
cast of the GEMM's input rows, which the FP8 path adds. Prints JSON (and writes it with --out).

    python benchmarks/bench_fp8_grouped_gemm.py --out benchmarks/results/fp8_grouped_gemm.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from moe_ep.layers.fp8_grouped_gemm import fp8_grouped_dgrad, fp8_grouped_mm
from moe_ep.ops import fp8
from timing import local_median_us

ALIGNMENT = 16


def segment_counts(num_experts: int, rows: int, seed: int) -> list[int]:
    """Uneven rows per expert (a skewed multinomial), each padded up to 16 rows."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.rand(num_experts, generator=g) ** 2 + 0.05
    counts = torch.multinomial(popularity, rows, replacement=True, generator=g).bincount(minlength=num_experts)
    return [int(c + (-c) % ALIGNMENT) for c in counts]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def bench_projection(num_experts: int, rows: int, depth: int, width: int, seed: int) -> dict:
    """Forward `[N, depth] -> [N, width]` and its dgrad, FP8 Triton vs BF16 grouped GEMMs."""
    counts = segment_counts(num_experts, rows, seed)
    num_rows = sum(counts)
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(num_rows, depth, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(num_rows, width, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(num_experts, width, depth, device="cuda", dtype=torch.bfloat16) / depth ** 0.5
    qx, sx = fp8.per_token_cast_to_fp8(x)
    qg, sg = fp8.per_token_cast_to_fp8(grad)
    qw, sw = fp8.per_block_cast_to_fp8(w)
    del w
    w = fp8.per_block_cast_back(qw, sw, torch.bfloat16)  # both paths multiply the same weights

    # Correctness on the first expert's rows against the dequantized math (FP32 dense).
    first = slice(0, counts[0])
    dense_w = w[0].float()
    dense_x = fp8.per_token_cast_back(qx[first], sx[first], torch.float32)
    dense_g = fp8.per_token_cast_back(qg[first], sg[first], torch.float32)
    checks = {
        "forward_rel_err": relative_error(fp8_grouped_mm(qx, sx, qw, sw, ends)[first], dense_x @ dense_w.t()),
        "dgrad_rel_err": relative_error(fp8_grouped_dgrad(qg, sg, qw, sw, ends)[first], dense_g @ dense_w),
    }

    flops = 2 * num_rows * depth * width
    w_t = w.transpose(-2, -1)
    times = {
        "bf16_forward_us": local_median_us(lambda: torch._grouped_mm(x, w_t, offs=ends)),
        "fp8_forward_us": local_median_us(lambda: fp8_grouped_mm(qx, sx, qw, sw, ends)),
        "bf16_dgrad_us": local_median_us(lambda: torch._grouped_mm(grad, w, offs=ends)),
        "fp8_dgrad_us": local_median_us(lambda: fp8_grouped_dgrad(qg, sg, qw, sw, ends)),
        "fp8_dgrad_strided_weight_us": local_median_us(
            lambda: fp8_grouped_mm(qg, sg, qw.transpose(-2, -1), sw.transpose(-2, -1), ends)),
        "cast_rows_us": local_median_us(lambda: fp8.per_token_cast_to_fp8(x)),
    }
    tflops = {name.replace("_us", "_tflops"): flops / (t * 1e-6) / 1e12
              for name, t in times.items() if name != "cast_rows_us"}
    return {"num_experts": num_experts, "rows": num_rows, "K": depth, "M": width,
            **checks, **times, **tflops,
            "fp8_over_bf16_forward": times["bf16_forward_us"] / times["fp8_forward_us"],
            "fp8_over_bf16_dgrad": times["bf16_dgrad_us"] / times["fp8_dgrad_us"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gate_up": bench_projection(args.experts, args.rows, 7168, 4096, seed=0),
        "down": bench_projection(args.experts, args.rows, 2048, 7168, seed=1),
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
