"""One grouped GEMM of the FP8 benchmark, run a few times for Nsight Compute: a few untimed warm-up
launches, then `--iters` timed launches inside the NVTX push/pop range NVTX_RANGE, so that ncu profiles
those only (`ncu --nvtx --nvtx-include "fp8_kernel_once/"`, with `-k regex:fp8_grouped_gemm` to keep
just our kernel). The operands are the benchmark's (`fp8_operands.py`), at its shapes.

    python benchmarks/fp8_kernel_once.py --op forward|dgrad|wgrad [--proj gate_up|down]
        [--shape deepgemm-4096x7168|deepgemm-7168x2048] [--impl ours|bf16|rowwise|deepgemm] [--warmup 3] [--iters 2]

`--impl`: ours (the blockwise FP8 CUDA kernel of `moe_ep._fp8`; the weight gradient is its
depth-grouped mode on operands cast once beforehand), bf16 (`torch._grouped_mm`), rowwise
(`torch._scaled_grouped_mm` with one scale per row / weight column; forward and dgrad only), deepgemm
(DeepGEMM's grouped contiguous GEMM on our casts where `deep_gemm` imports; forward only, at the `--shape`
ones: its groups must be multiples of 128 rows). The
`--proj` shapes are DeepSeek-V3's experts (64 by default, about 32768 rows in uneven segments); the
`--shape` ones DeepGEMM's (4 groups of 8192 rows, N x K). Prints the median CUDA-event time and its
TFLOP/s; under ncu these times include its replays and mean nothing.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple, Optional

import torch

from moe_ep.kernels.fp8_backend import cuda_kernels_run
from fp8_operands import (PROJECTIONS, GroupedOperands, bf16_grouped_mm, bf16_weight_grad, blockwise_casts,
                          blockwise_impls, grouped_operands, segment_counts, weight_grad_impls)
from fp8_profile import (DEEPGEMM_SHAPES, deepgemm_counts, deepgemm_impls, grouped_gemm_flops, rowwise_cast_to_fp8,
                         scaled_grouped_mm_impls, tflops)
from timing import local_median_us

OPS = ("forward", "dgrad", "wgrad")
IMPLS = {"ours": "fp8-cuda", "bf16": "bf16", "rowwise": "rowwise", "deepgemm": "deepgemm"}
"""`--impl` name: the benchmark's name for the same implementation."""
NVTX_RANGE = "fp8_kernel_once"
DEEPGEMM_CLI_SHAPES = {f"deepgemm-{n}x{k}": name for name, (k, n) in DEEPGEMM_SHAPES.items()}
"""`--shape` (DeepGEMM's N x K): the benchmark's shape name."""


class Shape(NamedTuple):
    """A shape of the benchmark: its name, rows per expert, and the forward's depth K and width N."""
    name: str
    counts: list[int]
    depth: int
    width: int


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The options, checked: exits with status 2 and the option's name on a bad one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", required=True, choices=OPS)
    parser.add_argument("--impl", default="ours", choices=tuple(IMPLS))
    shapes = parser.add_mutually_exclusive_group()
    shapes.add_argument("--proj", choices=tuple(PROJECTIONS), help="DeepSeek-V3 expert shape (default gate_up)")
    shapes.add_argument("--shape", choices=tuple(DEEPGEMM_CLI_SHAPES), help="DeepGEMM's shape, N x K")
    parser.add_argument("--experts", type=int, default=64, help="experts of the --proj shapes")
    parser.add_argument("--rows", type=int, default=32768, help="rows of the --proj shapes, before padding")
    parser.add_argument("--warmup", type=int, default=3, help="untimed launches before the NVTX range")
    parser.add_argument("--iters", type=int, default=2, help="timed launches inside the NVTX range")
    args = parser.parse_args(argv)
    for name, least in (("experts", 1), ("rows", 1), ("warmup", 0), ("iters", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name}: expected an integer >= {least}, got {getattr(args, name)}")
    if args.impl == "rowwise" and args.op == "wgrad":
        parser.error("--impl rowwise: expected --op forward or dgrad (the row-wise weight gradient would need "
                     "scales along each expert's tokens, which the benchmark does not build)")
    if args.impl == "deepgemm" and args.op != "forward":
        parser.error("--impl deepgemm: expected --op forward (the benchmark compares DeepGEMM's forward)")
    if args.shape is None and args.proj is None:
        args.proj = "gate_up"
    return args


def select_shape(args: argparse.Namespace) -> Shape:
    """The shape `args` name: DeepGEMM's equal groups, or the expert segments the benchmark draws for
    that projection (the same seed, so the same counts)."""
    if args.shape is not None:
        name = DEEPGEMM_CLI_SHAPES[args.shape]
        depth, width = DEEPGEMM_SHAPES[name]
        return Shape(name, deepgemm_counts(), depth, width)
    depth, width = PROJECTIONS[args.proj]
    seed = list(PROJECTIONS).index(args.proj)
    return Shape(f"ours {args.proj}", segment_counts(args.experts, args.rows, seed), depth, width)


def kernel_call(op: str, impl: str, operands: GroupedOperands) -> Callable[[], torch.Tensor]:
    """The GEMM `op` of `operands` as implementation `impl` (a key of IMPLS), its inputs cast beforehand.
    Raises RuntimeError where that implementation does not run here, saying why."""
    name = IMPLS[impl]
    if impl == "ours" and not cuda_kernels_run(operands.x):
        raise RuntimeError("--impl ours: needs the moe_ep._fp8 kernel (an sm_90a build on an sm_90 GPU)")
    if op == "wgrad":
        if impl == "bf16":
            return bf16_weight_grad(operands)
        impls, _ = weight_grad_impls(operands, blockwise_casts(operands).x_8)
        return impls[name]
    # The input gradient is grad [N, width] @ w[e] [width, depth]: the forward's GEMM on w's transpose.
    a, b = (operands.x, operands.w) if op == "forward" else (operands.grad, operands.w.transpose(-2, -1))
    if impl == "bf16":
        return bf16_grouped_mm(a, b, operands.ends)
    if impl == "rowwise":
        impls, skipped = scaled_grouped_mm_impls(rowwise_cast_to_fp8(a), rowwise_cast_to_fp8(b), operands.ends)
    elif impl == "deepgemm":
        casts = blockwise_casts(operands)
        impls, skipped = deepgemm_impls(casts.x_8, casts.w_8, operands.counts)
    else:
        casts = blockwise_casts(operands)
        a_8, b_8 = (casts.x_8, casts.w_8) if op == "forward" else (casts.grad_8, casts.w_t_8)
        impls, skipped = blockwise_impls(a, a_8, b, b_8, operands.ends)
    if name not in impls:
        raise RuntimeError(f"--impl {impl}: does not run here: {skipped.get(name, 'not built')}")
    return impls[name]


@contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """An NVTX push/pop range around the block where CUDA runs (no NVTX without it)."""
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def run_once(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """`warmup` untimed calls of `fn`, then the median time (us) of `iters` calls inside NVTX_RANGE."""
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with nvtx_range(NVTX_RANGE):
        return local_median_us(fn, warmup=0, iters=iters)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("fp8_kernel_once.py: needs a CUDA GPU")
    shape = select_shape(args)
    operands = grouped_operands(shape.counts, shape.depth, shape.width, with_grad=args.op != "forward")
    try:
        fn = kernel_call(args.op, args.impl, operands)
    except RuntimeError as error:
        sys.exit(f"fp8_kernel_once.py: {error}")
    time_us = run_once(fn, args.warmup, args.iters)
    rate = tflops(grouped_gemm_flops(sum(shape.counts), shape.depth, shape.width), time_us)
    print(f"{shape.name} {args.op} {args.impl}: {sum(shape.counts)} rows in {len(shape.counts)} groups, "
          f"K {shape.depth} N {shape.width}: median {time_us:.0f} us over {args.iters} launches, {rate:.0f} TFLOP/s "
          f"(on {torch.cuda.get_device_name()}; under ncu, the times include its replays)")


if __name__ == "__main__":
    main()
