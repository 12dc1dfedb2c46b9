"""Draws the figures of benchmarks/RESULTS.md from the JSON files in benchmarks/data/.

    python benchmarks/plot.py [--data benchmarks/data] [--out benchmarks/data]

Writes one PNG per mode: intranode.png (dispatch and combine against NCCL and DeepEP V1),
low_latency.png (time against tokens per rank), moe_layer.png (forward + backward of the layer
slice) and fp8_gemm.png (TFLOP/s per grouped GEMM). The inputs are the JSON files that
`scripts/gpu_check.sh` and the `benchmarks/bench_*.py` scripts write, renamed by what they hold;
replace one with a newer run of the same benchmark and run this again. Needs matplotlib
(`pip install matplotlib`, or the `examples` extra), imported only when the script runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
DPI = 110
# Input files, by what they hold (see benchmarks/RESULTS.md for the command that made each).
INTRANODE = {4: "intranode_ep4_h200.json", 8: "intranode_ep8_h200.json"}
NVLINK_PROBE = "nvlink_probe_4xh200.jsonl"
DEEPEP = "deepep_v1_4xh200.json"
LOW_LATENCY = {"EP4": "low_latency_ep4_h200.json", "EP8": "low_latency_ep8_h200.json",
               "EP8, NVSHMEM puts": "low_latency_puts_ep8_h200.json"}
MOE_LAYER = {4: "moe_layer_ep4_h200.json", 8: "moe_layer_ep8_h200.json"}
FP8_GEMM = "fp8_grouped_gemm_h200.json"

Json = dict[str, Any]


def _pyplot() -> Any:
    """matplotlib.pyplot on a file-only backend, or a clear exit when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("benchmarks/plot.py needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load(data: Path, name: str) -> Json:
    with open(data / name) as f:
        return json.load(f)


def _label_bars(ax: Any, bars: Any, fmt: str = "{:.0f}") -> None:
    for bar in bars:
        height = bar.get_height()
        if height > 0:
            ax.annotate(fmt.format(height), (bar.get_x() + bar.get_width() / 2, height), ha="center",
                        va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")


def _nvlink_floor_us(data: Path, num_sms: int = 24) -> float:
    """The 4-GPU probe's time to push the benchmark's remote BF16 rows with bulk stores from `num_sms` SMs."""
    with open(data / NVLINK_PROBE) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return next(r["time_us"] for r in rows if r["mode"] == "push_bulk" and r["sms"] == num_sms)


def plot_intranode(plt: Any, data: Path, out: Path) -> Path:
    """Kernel and whole-call times of dispatch (BF16, FP8) and combine at 4 and 8 ranks."""
    deepep = _load(data, DEEPEP)
    ops = [("dispatch BF16", "dispatch_bf16", "best_dispatch"), ("dispatch FP8", "dispatch_fp8", "best_dispatch"),
           ("combine BF16", "combine_bf16", "best_combine")]
    fig, axes = plt.subplots(1, len(INTRANODE), figsize=(11, 4.6), sharey=True)
    highest = 0.0
    for ax, (world, name) in zip(axes, INTRANODE.items()):
        report = _load(data, name)["reports"][0]
        xs = range(len(ops))
        width = 0.27
        kernel = [report["kernels"][f"{key}_kernel_us"] for _, key, _ in ops]
        call = [report[best][f"{key}_us"] for _, key, best in ops]
        highest = max(highest, *kernel, *call)
        _label_bars(ax, ax.bar([x - width for x in xs], kernel, width, label="moe_ep kernel"))
        _label_bars(ax, ax.bar(list(xs), call, width, label="moe_ep whole call"))
        if world == deepep["world"]:  # DeepEP and the NVLink probe were measured on the 4-GPU machine
            ref = [deepep["intranode"][f"{key}_kernel_us"] for _, key, _ in ops]
            _label_bars(ax, ax.bar([x + width for x in xs], ref, width, label="DeepEP V1 kernel"))
            ax.axhline(_nvlink_floor_us(data), color="grey", linestyle=":",
                       label="NVLink floor, remote BF16 rows (probe)")
        ax.axhline(report["nccl"]["nccl_a2a_us"], color="black", linestyle="--",
                   label="NCCL all_to_all_single, remote BF16 rows")
        ax.set_xticks(list(xs), [label for label, _, _ in ops])
        ax.set_title(f"EP{world}, {report['best_dispatch']['num_sms']} SMs: rank 0 receives "
                     f"{report['remote_rows_rank0']} remote rows")
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    axes[0].set_ylim(0, highest * 1.45)  # room for the legends above the bars
    axes[0].set_ylabel("time (us), lower is better")
    fig.suptitle("Intranode normal mode on H200: 4096 tokens per rank, hidden 7168, top-8 of 256 experts")
    return _save(plt, fig, out / "intranode.png")


def _mean_by_tokens(runs: list[Json], key: str) -> tuple[list[int], list[float]]:
    """(tokens per rank, mean of `key` over the runs) in increasing token order."""
    by_tokens: dict[int, list[float]] = {}
    for run in runs:
        for row in run["results"]:
            by_tokens.setdefault(row["tokens_per_rank"], []).append(row[key])
    tokens = sorted(by_tokens)
    return tokens, [sum(by_tokens[t]) / len(by_tokens[t]) for t in tokens]


def plot_low_latency(plt: Any, data: Path, out: Path) -> Path:
    """Dispatch and combine kernel times (queued, in step) against tokens per rank, with NCCL moving the same bytes."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, op in zip(axes, ("dispatch", "combine")):
        nccl_drawn, ticks = set(), set()
        for label, name in LOW_LATENCY.items():
            loaded = _load(data, name)  # one benchmark run, or several keyed by name
            runs = [loaded] if "results" in loaded else list(loaded.values())
            tokens, times = _mean_by_tokens(runs, f"{op}_us")
            ticks.update(tokens)
            ax.plot(tokens, times, marker="o", markersize=3, label=f"moe_ep, {label}")
            world = label.split(",")[0]
            if world not in nccl_drawn:
                nccl_drawn.add(world)
                ax.plot(*_mean_by_tokens(runs, f"nccl_{op}_bytes_queued_us"), linestyle="--", marker="x",
                        markersize=3, label=f"NCCL all_to_all_single, same bytes, {world}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        ax.minorticks_off()
        ax.set_xlabel("tokens per rank")
        ax.set_title(f"{op} ({'FP8' if op == 'dispatch' else 'BF16'})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("kernel time (us), queued and in step")
    fig.suptitle("Low-latency mode on H200: hidden 7168, top-8 of 256 experts")
    return _save(plt, fig, out / "low_latency.png")


def plot_moe_layer(plt: Any, data: Path, out: Path) -> Path:
    """Forward + backward of the DeepSeek-V3 layer slice, split into communication and the rest."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    labels, comm, rest = [], [], []
    for world, name in MOE_LAYER.items():
        layer = _load(data, name)["layer"]
        for key in ("cuda_bf16", "torch_bf16", "cuda_fp8", "torch_fp8"):
            backend, precision = key.split("_")
            labels.append(f"EP{world}\n{backend}\n{precision.upper()}")
            comm.append(layer[key]["comm_us"] / 1e3)
            rest.append((layer[key]["fwd_bwd_us"] - layer[key]["comm_us"]) / 1e3)
    xs = range(len(labels))
    ax.bar(xs, rest, label="the rest: experts, router, shared expert")
    bars = ax.bar(xs, comm, bottom=rest, label="dispatcher round trip (communication)", hatch="//")
    for bar, total in zip(bars, (c + r for c, r in zip(comm, rest))):
        ax.annotate(f"{total:.1f}", (bar.get_x() + bar.get_width() / 2, total), ha="center", va="bottom",
                    fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylim(0, max(c + r for c, r in zip(comm, rest)) * 1.3)  # room for the legend
    ax.set_ylabel("forward + backward (ms), lower is better")
    ax.set_title("MoE layer slice on H200: 4096 tokens per rank, hidden 7168, 256 experts, top-8")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    return _save(plt, fig, out / "moe_layer.png")


def plot_fp8_gemm(plt: Any, data: Path, out: Path) -> Path:
    """TFLOP/s of the expert GEMMs: BF16 against the Triton and CUDA blockwise FP8 kernels."""
    result = _load(data, FP8_GEMM)
    kernels = [("BF16 torch._grouped_mm", "bf16_{}_tflops"), ("FP8 Triton", "fp8_{}_tflops"),
               ("FP8 CUDA (TMA + wgmma)", "cuda_fp8_{}_tflops")]
    shapes = [(f"{proj}\n{op}", proj.replace("/", "_"), op) for proj in ("gate/up", "down")
              for op in ("forward", "dgrad", "wgrad")]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.27
    for i, (label, key) in enumerate(kernels):
        values = [result[proj].get(key.format(op), 0.0) for _, proj, op in shapes]
        xs = [x + (i - 1) * width for x in range(len(shapes))]
        _label_bars(ax, ax.bar(xs, values, width, label=label))
    ax.set_xticks(list(range(len(shapes))), [label for label, _, _ in shapes])
    ax.set_ylabel("TFLOP/s, higher is better")
    ax.set_title(f"Grouped GEMMs of 64 experts on one H200 ({result['gate_up']['rows']} rows); "
                 "FP8 weight gradients: CUDA only")
    ax.legend(fontsize=7, loc="upper right")
    return _save(plt, fig, out / "fp8_gemm.png")


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


PLOTS: tuple[Callable[[Any, Path, Path], Path], ...] = (plot_intranode, plot_low_latency, plot_moe_layer,
                                                          plot_fp8_gemm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=HERE / "data", help="folder of the benchmark JSON files")
    parser.add_argument("--out", type=Path, default=HERE / "data", help="folder for the PNG files")
    args = parser.parse_args()
    plt = _pyplot()
    args.out.mkdir(parents=True, exist_ok=True)
    for plot in PLOTS:
        print(f"wrote {plot(plt, args.data, args.out)}")


if __name__ == "__main__":
    main()
