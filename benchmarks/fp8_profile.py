"""The per-kernel profile of the FP8 grouped GEMM benchmark: shapes, FLOP counts, errors against a
float64 reference, timed rows with the clock and power sampled during each, and their table.

A row is one kernel at one shape: `shape` ("ours gate_up", "deepgemm N4096 K7168", ...), `op`
(forward, dgrad, wgrad), `impl` (a key of IMPLEMENTATIONS), its median time, TFLOP/s, TFLOP/s at the
board's maximum SM clock (the measured rate scaled by max clock / median clock during the run: what
the kernel would do unthrottled, so a power cap is told apart from the kernel), the median SM clock
and power, and the relative error. Everything here runs on the CPU too (the tests use it there).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import torch

from gpu_clocks import ClockSampler
from timing import sustained_median_us

# DeepGEMM's published grouped contiguous shapes: 4 experts of 8192 rows each; (K, N) per shape.
DEEPGEMM_GROUPS, DEEPGEMM_ROWS_PER_GROUP = 4, 8192
DEEPGEMM_SHAPES = {"deepgemm N4096 K7168": (7168, 4096), "deepgemm N7168 K2048": (2048, 7168)}
SHAPE_SETS = ("ours", "deepgemm")
REFERENCE_ROWS = 4096
"""Rows (spread evenly over the groups) on which outputs are compared with the float64 reference."""
WARMUP = 5
FP8Pair = tuple[torch.Tensor, torch.Tensor]
"""`(e4m3 values, float32 scales that multiply them)`."""

IMPLEMENTATIONS = {
    "bf16": "BF16 torch._grouped_mm",
    "fp8-cuda": "FP8, 1x128 / 128x128 blockwise scales, the moe_ep._fp8 CUDA kernel",
    "fp8-triton": "FP8, 1x128 / 128x128 blockwise scales, Triton",
    "rowwise": "FP8, one scale per row / per weight column, torch._scaled_grouped_mm",
    "rowwise-fastacc": "the same with use_fast_accum=True (no FP32 promotion of the accumulator)",
    "fbgemm-rowwise": "FP8 row-wise, fbgemm_gpu GenAI f8f8bf16_rowwise_grouped_stacked",
    "fbgemm-blockwise": "FP8 1x128 / 128x128, fbgemm_gpu GenAI f8f8bf16_groupwise_grouped (its own casts)",
    "deepgemm": "FP8 1x128 / 128x128 on our casts, DeepGEMM m_grouped_fp8_gemm_nt_contiguous (a peer built on the "
                "device: gpu_check.sh's deepgemm part)",
}
OPTIONAL_IMPLS = frozenset({"rowwise", "rowwise-fastacc", "fbgemm-rowwise", "fbgemm-blockwise", "deepgemm"})
"""Implementations from other libraries: one that raises is recorded as not run, with the error."""


def parse_shape_sets(text: str) -> list[str]:
    """`--shapes`: a comma list of SHAPE_SETS, in the order given."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SHAPE_SETS]
    if not names or unknown:
        raise ValueError(f"--shapes: expected a comma list of {', '.join(SHAPE_SETS)}, got {text!r}")
    return list(dict.fromkeys(names))


def deepgemm_counts() -> list[int]:
    """Rows per expert of DeepGEMM's grouped contiguous benchmark shapes."""
    return [DEEPGEMM_ROWS_PER_GROUP] * DEEPGEMM_GROUPS


def grouped_gemm_flops(rows: int, depth: int, width: int) -> int:
    """Multiply-adds times two of a grouped GEMM whose groups hold `rows` rows in all, each `[., depth]
    x [depth, width]`: the same for the weight gradient, whose groups split the `rows` tokens instead."""
    return 2 * rows * depth * width


def tflops(flops: int, time_us: float) -> float:
    return flops / (time_us * 1e-6) / 1e12


def at_max_clock(rate: float, max_clock_mhz: Optional[float], clock_mhz: Optional[float]) -> Optional[float]:
    """`rate` scaled from the median SM clock of its run to the board's maximum; None without clocks."""
    if not max_clock_mhz or not clock_mhz:
        return None
    return rate * max_clock_mhz / clock_mhz


def reference_slices(counts: list[int], total: int = REFERENCE_ROWS) -> list[tuple[int, int, int]]:
    """`(group, first row, end row)`: the first `ceil(total / groups)` rows of every non-empty group."""
    per_group = math.ceil(total / max(len(counts), 1))
    slices, start = [], 0
    for group, count in enumerate(counts):
        if count:
            slices.append((group, start, start + min(count, per_group)))
        start += count
    return slices


def grouped_reference(a: torch.Tensor, b: torch.Tensor, slices: list[tuple[int, int, int]]) -> torch.Tensor:
    """`a[rows] @ b[group].T` in float64 for every slice, stacked: `a [N, K]`, `b [E, N_OUT, K]`."""
    return torch.cat([a[start:end].double() @ b[group].double().t() for group, start, end in slices])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """`||got - want|| / ||want||` in float64."""
    return float((got.double() - want.double()).norm() / want.double().norm())


def sliced_relative_error(out: torch.Tensor, reference: torch.Tensor, slices: list[tuple[int, int, int]]) -> float:
    """`relative_error` of `out`'s rows in `slices` against `grouped_reference` on the same slices."""
    return relative_error(torch.cat([out[start:end] for _, start, end in slices]), reference)


def rowwise_cast_to_fp8(t: torch.Tensor, chunk_rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., K]` to e4m3 with one float32 scale per row over all K (row-wise scaling, what
    `torch._scaled_grouped_mm` takes): `scale = max(amax, 1e-4) / 448`, `q = e4m3(x / scale)`, so
    `x ~= q * scale`. `chunk_rows` rows at a time, to bound the float32 temporaries."""
    finfo = torch.finfo(torch.float8_e4m3fn)
    rows = t.reshape(-1, t.size(-1))
    q = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=t.device)
    scales = torch.empty(rows.size(0), dtype=torch.float32, device=t.device)
    for start in range(0, rows.size(0), chunk_rows):
        chunk = rows[start:start + chunk_rows].float()
        scale = chunk.abs().amax(-1).clamp(min=1e-4) / finfo.max
        q[start:start + chunk_rows] = (chunk / scale[:, None]).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn)
        scales[start:start + chunk_rows] = scale
    return q.view(t.shape), scales.view(t.shape[:-1])


def kernel_row(shape: str, op: str, impl: str, time_us: float, flops: int, clocks: dict,
               rel_err: Optional[float]) -> dict:
    """One profile row: time, TFLOP/s, TFLOP/s at the maximum clock, the sampled clock and power."""
    rate = tflops(flops, time_us)
    return {"shape": shape, "op": op, "impl": impl, "time_us": time_us, "tflops": rate,
            "tflops_at_max_clock": at_max_clock(rate, clocks.get("max_sm_clock_mhz"), clocks.get("sm_clock_mhz")),
            "sm_clock_mhz": clocks.get("sm_clock_mhz"), "power_w": clocks.get("power_w"), "rel_err": rel_err,
            "clocks": clocks}


def _cell(value: Optional[float], spec: str, width: int) -> str:
    return f"{'-' if value is None else format(value, spec):>{width}s}"


def row_line(row: dict) -> str:
    return (f"{row['shape']:20s} {row['op']:7s} {row['impl']:16s} {row['time_us']:9.0f} {row['tflops']:7.0f} "
            f"{_cell(row['tflops_at_max_clock'], '.0f', 7)} {_cell(row['sm_clock_mhz'], '.0f', 6)} "
            f"{_cell(row['power_w'], '.0f', 5)} {_cell(row['rel_err'], '.2e', 8)}")


def profile_table(rows: list[dict], skipped: list[dict]) -> str:
    """One line per shape x op x implementation, then the limits, the legend and what did not run."""
    lines = [f"{'shape':20s} {'op':7s} {'impl':16s} {'time us':>9s} {'TF/s':>7s} {'@maxclk':>7s} {'SM MHz':>6s} "
             f"{'W':>5s} {'rel err':>8s}"]
    lines += [row_line(row) for row in rows]
    limits = next((row["clocks"] for row in rows if row["clocks"].get("max_sm_clock_mhz")), None)
    if limits is not None:
        lines.append(f"board: max SM clock {limits['max_sm_clock_mhz']:.0f} MHz, power limit "
                     f"{_cell(limits['power_limit_w'], '.0f', 0)} W (nvidia-smi, sampled during each timed loop)")
    else:
        reason = next((row["clocks"].get("reason") for row in rows), None)
        lines.append(f"no clock or power samples: {reason}")
    lines.append("rel err: against float64 of the BF16 operands before any FP8 cast, on up to "
                 f"{REFERENCE_ROWS} rows spread over the groups (wgrad: the first expert)")
    lines += [f"  {name:16s} {text}" for name, text in IMPLEMENTATIONS.items()]
    lines += [f"not run: {s['shape']} {s['op']} {s['impl']}: {s['reason']}" for s in skipped]
    return "\n".join(lines)


def _why(error: Exception) -> str:
    """An exception in one line of at most 200 characters."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


class KernelTimer:
    """Times kernels with the GPU's clock and power sampled during each timed loop, keeping one profile
    row per kernel (printed as it is measured) and the implementations that did not run."""

    def __init__(self, sampler: ClockSampler, seconds: float) -> None:
        self.sampler = sampler
        self.seconds = seconds
        self.rows: list[dict] = []
        self.skipped: list[dict] = []

    def time(self, fn: Callable[[], object], *, shape: str, op: str, impl: str, flops: int,
             rel_err: Optional[float] = None) -> float:
        """Median time of `fn` in microseconds over at least `seconds` (see `sustained_median_us`)."""
        for _ in range(WARMUP):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        with self.sampler.window() as clocks:
            time_us = sustained_median_us(fn, self.seconds)
        self.rows.append(kernel_row(shape, op, impl, time_us, flops, clocks, rel_err))
        print(row_line(self.rows[-1]), flush=True)
        return time_us

    def skip(self, shape: str, op: str, impl: str, reason: str) -> None:
        self.skipped.append({"shape": shape, "op": op, "impl": impl, "reason": reason})
        print(f"not run: {shape} {op} {impl}: {reason}", flush=True)

    def profile(self, shape: str, op: str, impls: dict[str, Callable[[], torch.Tensor]], skipped: dict[str, str],
                a: torch.Tensor, b: torch.Tensor, counts: list[int], flops: int) -> dict[str, dict]:
        """Every implementation of `a[rows of e] @ b[e].T` (`a [N, K]` and `b [E, N_OUT, K]` the BF16
        operands, groups of `counts` rows): its error against the float64 reference, then its timed
        row. Returns `{impl: {"us", "rel_err"}}`; one of OPTIONAL_IMPLS that raises is skipped."""
        for impl, reason in skipped.items():
            self.skip(shape, op, impl, reason)
        slices = reference_slices(counts)
        reference = grouped_reference(a, b, slices)
        results = {}
        for impl, fn in impls.items():
            try:
                rel_err = sliced_relative_error(fn(), reference, slices)
                time_us = self.time(fn, shape=shape, op=op, impl=impl, flops=flops, rel_err=rel_err)
            except Exception as error:  # noqa: BLE001 - another library's kernel failing here is a result
                if impl not in OPTIONAL_IMPLS:
                    raise
                self.skip(shape, op, impl, _why(error))
                continue
            results[impl] = {"us": time_us, "rel_err": rel_err}
        return results


def optional_impl(impls: dict, skipped: dict, name: str, build: Callable[[], Callable[[], torch.Tensor]]) -> None:
    """`impls[name] = build()`, or `skipped[name]` = why `build` raised (its operands or API missing)."""
    try:
        impls[name] = build()
    except Exception as error:  # noqa: BLE001 - a missing optional piece is reported, not fatal
        skipped[name] = _why(error)


def scaled_grouped_mm_impls(x_8: FP8Pair, w_8: FP8Pair, ends: torch.Tensor) -> tuple[dict, dict]:
    """`torch._scaled_grouped_mm` on row-wise FP8 casts `x_8 = (qx [N, K], sx [N])` and `w_8 = (qw [E, N_OUT,
    K], sw [E, N_OUT])` (`rowwise_cast_to_fp8`), with and without fast accumulation: `out[rows of e] =
    (qx * sx[:, None]) @ (qw[e] * sw[e][:, None]).T` in BF16, `ends` the int32 cumulative group ends.

    Its accuracy class differs from the blockwise kernels' (one scale per 1x128 / 128x128 block): one
    outlier sets the scale of a whole row or weight column, so the relative errors differ; they are
    reported beside the times so that the comparison is made at stated accuracy.
    """
    (qx, sx), (qw, sw) = x_8, w_8
    impls: dict = {}
    skipped: dict = {}
    for name, fast in (("rowwise", False), ("rowwise-fastacc", True)):
        # The weights as the transposed view `[E, K, N_OUT]` (K contiguous): the layout the op requires.
        optional_impl(impls, skipped, name, lambda fast=fast: partial(
            torch._scaled_grouped_mm, qx, qw.transpose(-2, -1), sx, sw, offs=ends, out_dtype=torch.bfloat16,
            use_fast_accum=fast))
    return impls, skipped


def fbgemm_impls(x: torch.Tensor, w: torch.Tensor, counts: list[int], x_8: FP8Pair, w_8: FP8Pair) -> tuple[dict, dict]:
    """fbgemm_gpu GenAI's grouped FP8 GEMMs where the package imports: row-wise on the same casts as
    `scaled_grouped_mm_impls`, and 1x128 / 128x128 blockwise (the accuracy class of ours) on fbgemm's
    own casts of the BF16 `x [N, K]` and `w [E, N_OUT, K]`; groups of `counts` rows."""
    names = ("fbgemm-rowwise", "fbgemm-blockwise")
    try:
        import fbgemm_gpu.experimental.gen_ai  # noqa: F401 - registers the torch.ops.fbgemm GenAI kernels
        from fbgemm_gpu.experimental.gemm.triton_gemm.fp8_gemm import quantize_fp8_block, quantize_fp8_group
    except Exception as error:  # noqa: BLE001 - not installed, or a build that does not load here
        return {}, dict.fromkeys(names, f"fbgemm_gpu GenAI not importable ({_why(error)})")
    m_sizes = torch.tensor(counts, dtype=torch.int64, device=x.device)
    (qx, sx), (qw, sw) = x_8, w_8
    impls: dict = {}
    skipped: dict = {}
    optional_impl(impls, skipped, names[0], lambda: partial(
        torch.ops.fbgemm.f8f8bf16_rowwise_grouped_stacked, qx, qw, sx, sw, m_sizes))

    def blockwise() -> Callable[[], torch.Tensor]:
        bx, bsx = quantize_fp8_group(x, m_sizes=m_sizes)
        blocks = [quantize_fp8_block(w[e], block_m=128, block_k=128, k_major=False) for e in range(w.size(0))]
        bw, bsw = (torch.stack(parts).contiguous() for parts in zip(*blocks))
        return partial(torch.ops.fbgemm.f8f8bf16_groupwise_grouped, bx, bw, bsx, bsw, m_sizes)

    optional_impl(impls, skipped, names[1], blockwise)
    return impls, skipped


def deepgemm_impls(x_8: FP8Pair, w_8: FP8Pair, counts: list[int]) -> tuple[dict, dict]:
    """DeepGEMM's grouped contiguous FP8 GEMM where `deep_gemm` imports, on the blockwise casts ours
    reads: `x_8 = (qx [N, K], sx [N, K/128])` (1x128), `w_8 = (qw [E, N_OUT, K], sw [E, N_OUT/128, K/128])`
    (128x128), groups of `counts` rows. The row scales move once, beforehand, into the TMA-aligned
    MN-major layout it reads, so the timed call is the GEMM alone. Its groups must start at multiples of
    its M alignment: where they do not (our segments are padded to 16 rows), it is recorded as not run."""
    name = "deepgemm"
    try:
        import deep_gemm
    except Exception as error:  # noqa: BLE001 - not built here, or a build that does not load
        return {}, {name: f"deep_gemm not importable ({_why(error)})"}
    alignment = deep_gemm.get_mk_alignment_for_contiguous_layout()
    if any(count % alignment for count in counts):
        return {}, {name: f"DeepGEMM needs groups of a multiple of {alignment} rows; these are multiples of "
                          f"{math.gcd(*counts)}"}
    (qx, sx), (qw, sw) = x_8, w_8
    group_of_row = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32, device=qx.device),
                                           torch.tensor(counts, device=qx.device))
    out = torch.empty(qx.size(0), qw.size(1), dtype=torch.bfloat16, device=qx.device)

    def build() -> Callable[[], torch.Tensor]:
        sx_mn_major = deep_gemm.transform_sf_into_required_layout(sx, qx.size(0), qx.size(1), (1, 128, 128),
                                                                  is_sfa=True, disable_ue8m0_cast=True)

        def run() -> torch.Tensor:
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous((qx, sx_mn_major), (qw, sw), out, group_of_row,
                                                       disable_ue8m0_cast=True)
            return out
        return run

    impls: dict = {}
    skipped: dict = {}
    optional_impl(impls, skipped, name, build)
    return impls, skipped


def alternative_impls(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, counts: list[int]) -> tuple[dict, dict]:
    """What a user could pick instead of the blockwise FP8 kernels for `x[rows of e] @ w[e].T` (BF16 `x [N,
    K]`, `w [E, N_OUT, K]`): `scaled_grouped_mm_impls` and `fbgemm_impls`, as `(impls, skipped)`."""
    x_8, w_8 = rowwise_cast_to_fp8(x), rowwise_cast_to_fp8(w)
    impls, skipped = scaled_grouped_mm_impls(x_8, w_8, ends)
    more, more_skipped = fbgemm_impls(x, w, counts, x_8, w_8)
    return {**impls, **more}, {**skipped, **more_skipped}
