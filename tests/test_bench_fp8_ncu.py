"""The Nsight Compute tooling of the FP8 grouped GEMMs without a GPU: `fp8_kernel_once.py`'s options,
shapes and BF16 GEMMs (on the CPU, against float64), and `ncu_table.py`'s metric choice and its table of
ncu raw-page CSVs written here by hand. The one-kernel run itself needs CUDA and skips without it."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fp8_kernel_once as once  # noqa: E402
import ncu_table  # noqa: E402
from fp8_operands import PROJECTIONS, grouped_operands, segment_counts  # noqa: E402
from moe_ep.ops import fp8  # noqa: E402

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the one-kernel run needs a CUDA GPU")


# ---------------------------------------------------------------- fp8_kernel_once.py

def test_defaults_are_our_kernel_at_the_gate_up_shape() -> None:
    args = once.parse_args(["--op", "wgrad"])
    assert (args.op, args.impl, args.proj, args.shape, args.warmup, args.iters) == ("wgrad", "ours", "gate_up",
                                                                                  None, 3, 2)


@pytest.mark.parametrize("argv, message", [
    (["--op", "wgrad", "--impl", "rowwise"], "--impl rowwise: expected --op forward or dgrad"),
    (["--op", "dgrad", "--impl", "deepgemm"], "--impl deepgemm: expected --op forward"),
    (["--op", "forward", "--iters", "0"], "--iters: expected an integer >= 1, got 0"),
    (["--op", "forward", "--warmup", "-1"], "--warmup: expected an integer >= 0, got -1"),
    (["--op", "forward", "--experts", "0"], "--experts: expected an integer >= 1"),
    (["--op", "forward", "--proj", "down", "--shape", "deepgemm-4096x7168"], "not allowed with argument"),
    (["--op", "forward", "--shape", "deepgemm-4096x4096"], "invalid choice"),
    (["--op", "backward"], "invalid choice"),
    (["--impl", "bf16"], "the following arguments are required: --op"),
])
def test_bad_options_exit_naming_the_option(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        once.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("proj", list(PROJECTIONS))
def test_projection_shapes_are_the_benchmarks_segments(proj: str) -> None:
    seed = list(PROJECTIONS).index(proj)  # the benchmark's seed for this projection
    rng = random.Random(seed)
    for experts, rows in ((64, 32768), (rng.randint(3, 20), rng.randint(100, 5000))):
        shape = once.select_shape(once.parse_args(["--op", "dgrad", "--proj", proj, "--experts", str(experts),
                                                   "--rows", str(rows)]))
        assert shape.counts == segment_counts(experts, rows, seed) and len(shape.counts) == experts
        assert all(c % 16 == 0 for c in shape.counts) and rows <= sum(shape.counts) < rows + 16 * experts
        assert (shape.depth, shape.width) == PROJECTIONS[proj] and shape.name == f"ours {proj}"
    gate_up = once.select_shape(once.parse_args(["--op", "forward"]))
    assert (sum(gate_up.counts), gate_up.depth, gate_up.width) == (33248, 7168, 4096)


@pytest.mark.parametrize("cli, depth, width", [("deepgemm-4096x7168", 7168, 4096), ("deepgemm-7168x2048", 2048, 7168)])
def test_deepgemm_shapes_are_four_groups_of_8192_rows_n_by_k(cli: str, depth: int, width: int) -> None:
    shape = once.select_shape(once.parse_args(["--op", "forward", "--shape", cli, "--experts", "3"]))
    assert shape.counts == [8192] * 4 and (shape.depth, shape.width) == (depth, width)
    assert shape.name == f"deepgemm N{width} K{depth}"


@pytest.mark.parametrize("op", once.OPS)
def test_bf16_gemms_match_float64_per_expert(op: str) -> None:
    torch.manual_seed(len(op))
    counts = [48, 0, 16, 80]
    operands = grouped_operands(counts, 256, 128, device="cpu")
    got = once.kernel_call(op, "bf16", operands)()
    x, grad, w = operands.x.double(), operands.grad.double(), operands.w.double()
    ends = torch.tensor(counts).cumsum(0).tolist()
    parts = []
    for e, (count, end) in enumerate(zip(counts, ends)):
        rows = slice(end - count, end)
        parts.append({"forward": lambda: x[rows] @ w[e].t(), "dgrad": lambda: grad[rows] @ w[e],
                      "wgrad": lambda: grad[rows].t() @ x[rows]}[op]())
    want = torch.stack(parts) if op == "wgrad" else torch.cat(parts)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert float((got.double() - want).norm() / want.norm()) < 1e-2
    if op == "wgrad":
        assert torch.count_nonzero(got[1]) == 0  # an expert without tokens


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without our CUDA kernel")
@pytest.mark.parametrize("op", once.OPS)
def test_our_kernel_without_its_build_says_why(op: str) -> None:
    operands = grouped_operands([32, 16], 256, 128, device="cpu")
    with pytest.raises(RuntimeError, match="--impl ours: needs the moe_ep._fp8 kernel"):
        once.kernel_call(op, "ours", operands)


def test_deepgemm_without_its_module_or_off_its_alignment_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reference casts (the benchmark's are Triton's, which needs a GPU).
    monkeypatch.setattr(once, "blockwise_casts", lambda ops: SimpleNamespace(
        x_8=fp8.per_token_cast_to_fp8(ops.x), w_8=fp8.per_block_cast_to_fp8(ops.w)))
    operands = grouped_operands([128, 128], 256, 128, with_grad=False, device="cpu")
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # not installed
    with pytest.raises(RuntimeError, match="--impl deepgemm: does not run here: deep_gemm not importable"):
        once.kernel_call("forward", "deepgemm", operands)
    monkeypatch.setitem(sys.modules, "deep_gemm", SimpleNamespace(get_mk_alignment_for_contiguous_layout=lambda: 128))
    odd = grouped_operands([48, 80], 256, 128, with_grad=False, device="cpu")
    with pytest.raises(RuntimeError, match="needs groups of a multiple of 128 rows; these are multiples of 16"):
        once.kernel_call("forward", "deepgemm", odd)


def test_timed_launches_follow_the_warmup() -> None:
    calls = []
    for warmup, iters in ((0, 1), (3, 2), (random.randint(1, 4), random.randint(1, 5))):
        calls.clear()
        time_us = once.run_once(lambda: calls.append(len(calls)), warmup, iters)
        assert len(calls) == warmup + iters and time_us > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_without_cuda_the_run_says_it_needs_a_gpu() -> None:
    with pytest.raises(SystemExit) as exit_info:
        once.main(["--op", "forward", "--impl", "bf16"])
    assert "needs a CUDA GPU" in str(exit_info.value.code)


@NEEDS_CUDA
@pytest.mark.parametrize("impl", list(once.IMPLS))
def test_one_kernel_runs_on_the_gpu(impl: str, capsys: pytest.CaptureFixture) -> None:
    try:
        once.main(["--op", "forward", "--impl", impl, "--experts", "4", "--rows", "1024", "--warmup", "1"])
    except SystemExit as exit_info:  # our kernel or the row-wise op not available on this GPU or build
        pytest.skip(str(exit_info.code))
    out = capsys.readouterr().out
    assert f"ours gate_up forward {impl}:" in out and "TFLOP/s" in out


# ---------------------------------------------------------------- ncu_table.py

QUERY_OUTPUT = """Device NVIDIA H100 80GB HBM3 (GH100)
------------------------------------------------- -------------------------------------------------
Metric Name                                       Metric Description
------------------------------------------------- -------------------------------------------------
dram__throughput                                  DRAM throughput
gpu__time_duration                                total duration in nanoseconds
lts__throughput                                   L2 Cache throughput
sm__cycles_elapsed                                # of cycles elapsed on SM
sm__pipe_tensor_cycles_active                     # of cycles where the tensor pipe was active
sm__throughput                                    SM throughput
smsp__issue_active                                # of cycles where an SMSP issued an instruction
"""


def test_metric_choice_takes_the_first_candidate_ncu_offers() -> None:
    offered = ncu_table.offered_metrics(QUERY_OUTPUT)
    assert "sm__pipe_tensor_cycles_active" in offered and "Metric" not in offered and "Device" not in offered
    chosen = ncu_table.choose_metrics(offered)
    # No gmma name offered: the generic tensor-pipe metric; no occupancy metric offered: that column is left out.
    assert chosen == ["gpu__time_duration.sum", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
                      "sm__throughput.avg.pct_of_peak_sustained_elapsed",
                      "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                      "lts__throughput.avg.pct_of_peak_sustained_elapsed",
                      "smsp__issue_active.avg.pct_of_peak_sustained_active", "sm__cycles_elapsed.avg.per_second"]
    without_list = ncu_table.choose_metrics(set())
    assert without_list == [candidates[0] for candidates in ncu_table.METRICS.values()]
    refused = frozenset({without_list[1]})
    assert ncu_table.choose_metrics(set(), refused)[1] == ncu_table.METRICS["tensor_pct"][1]


GEMM = "void moe_ep::kernels::(anonymous namespace)::fp8_grouped_gemm_kernel<256>(CUtensorMap, CUtensorMap, " \
       "moe_ep::kernels::Fp8GroupedGemmArgs)"
HELPER = "void at::cuda::detail::prepare_grouped_gemm_data<cutlass::float_e4m3_t>(long *, int const *)"
STALLS = ("barrier", "long_scoreboard", "math_pipe_throttle", "selected", "short_scoreboard", "wait")
COLUMNS = {  # the table column each metric feeds, for the random values below
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "gpu__time_duration.sum": "time_us",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_pct",
    "sm__cycles_elapsed.avg.per_second": "clock_mhz",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed": "tensor_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_pct",
}


def _quoted(cells: list[str]) -> str:
    return ",".join(f'"{cell}"' for cell in cells)


def raw_csv(launches: list[tuple[str, dict[str, float]]], base_units: bool) -> str:
    """An ncu raw-page CSV as `ncu --import R --csv --page raw [--print-units base]` writes it: values in
    `launches` are in table units (us, MHz, %, cycles per instruction), written in ncu's units with
    thousands separators; ncu's own lines around it, as when its output is captured whole."""
    metrics = sorted(COLUMNS) + [f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS]
    time_unit, clock_unit = ("nsecond", "cycle/second") if base_units else ("msecond", "cycle/nsecond")
    time_factor, clock_factor = (1e3, 1e6) if base_units else (1e-3, 1e-3)
    info = ["ID", "Process ID", "Process Name", "Host Name",
            "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg", "Kernel Name", "Context",
            "Stream", "Block Size", "Grid Size", "Device", "CC"]
    units = {"gpu__time_duration.sum": time_unit, "sm__cycles_elapsed.avg.per_second": clock_unit}
    factors = {"gpu__time_duration.sum": time_factor, "sm__cycles_elapsed.avg.per_second": clock_factor}
    lines = ['==PROF== Connected to process 31337 (/usr/bin/python3.12)', _quoted(info + metrics),
             _quoted([""] * len(info) + [units.get(m, "inst" if "stalled" in m else "%") for m in metrics])]
    for i, (kernel, values) in enumerate(launches):
        cells = [f"{values[m] * factors.get(m, 1):,.6f}" for m in metrics]
        lines.append(_quoted([str(i), "31337", "python3.12", "127.0.0.1", "<default domain>:fp8_kernel_once:none",
                              kernel, "1", "7", "(384, 1, 1)", "(4224, 1, 1)", "0", "9.0"] + cells))
    return "\n".join(lines + ["==PROF== Disconnected from process 31337"]) + "\n"


def random_launch(rng: random.Random) -> dict[str, float]:
    values = {m: rng.uniform(5, 95) for m in COLUMNS}
    values["gpu__time_duration.sum"] = rng.uniform(1500, 5000)
    values["sm__cycles_elapsed.avg.per_second"] = rng.uniform(1400, 1980)
    values.update({f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio": rng.uniform(0, 4) for s in STALLS})
    return values


@pytest.mark.parametrize("base_units", [True, False])
def test_raw_csv_becomes_one_row_per_kernel_with_its_launches_averaged(base_units: bool) -> None:
    rng = random.Random(7 + base_units)
    gemm_runs, helper_run = [random_launch(rng) for _ in range(3)], random_launch(rng)
    launches = ncu_table.read_raw_csv(raw_csv([(GEMM, gemm_runs[0]), (HELPER, helper_run), (GEMM, gemm_runs[1]),
                                               (GEMM, gemm_runs[2])], base_units))
    assert [launch.kernel for launch in launches] == [GEMM, HELPER, GEMM, GEMM]
    gemm, helper = ncu_table.summarize("forward rowwise", launches)
    assert (gemm.kernel, gemm.launches, helper.kernel, helper.launches) == (
        "fp8_grouped_gemm_kernel<256>", 3, "prepare_grouped_gemm_data<cutlass::float_...", 1)  # cut to 44
    for metric, column in COLUMNS.items():  # to 6 decimals, as written
        assert gemm.columns[column] == pytest.approx(statistics.fmean(r[metric] for r in gemm_runs), abs=1e-3)
        assert helper.columns[column] == pytest.approx(helper_run[metric], abs=1e-3)
    stall = {s: statistics.fmean(r[f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio"]
                                 for r in gemm_runs) for s in STALLS if s != "selected"}
    want = sorted(stall.items(), key=lambda item: -item[1])[:3]
    assert [reason for reason, _ in gemm.stalls] == [reason for reason, _ in want]
    assert [value for _, value in gemm.stalls] == pytest.approx([value for _, value in want], abs=1e-3)
    line = ncu_table.table_line(gemm)
    assert line.startswith("forward rowwise  fp8_grouped_gemm_kernel<256>")
    assert f"{gemm.columns['tensor_pct']:.1f}" in line and f"{gemm.columns['clock_mhz']:.0f}" in line
    assert f"{want[0][0]} {want[0][1]:.2f}" in line
    brief = ncu_table.brief_line(gemm)
    assert brief.startswith("forward rowwise: fp8_grouped_gemm_kernel<256>: tensor ")
    assert f"L2 {gemm.columns['l2_pct']:.0f} %" in brief


def test_table_command_notes_profiles_without_data(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rng = random.Random(11)
    run = random_launch(rng)
    (tmp_path / "forward.csv").write_text(raw_csv([(GEMM, run)], base_units=True))
    (tmp_path / "failed.csv").write_text("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission\n")
    ncu_table.main(["table", f"forward ours={tmp_path / 'forward.csv'}", f"wgrad ours={tmp_path / 'failed.csv'}",
                    f"dgrad ours={tmp_path / 'missing.csv'}"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ncu_table.HEADER and lines[1].startswith("forward ours     fp8_grouped_gemm_kernel<256>")
    assert lines[2].startswith("wgrad ours: no ncu data: ValueError: no ncu raw CSV header")
    assert lines[3].startswith("dgrad ours: no ncu data: FileNotFoundError")
    assert "  tensor_pct    sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed" in lines
    with pytest.raises(SystemExit):
        ncu_table.main(["table", str(tmp_path / "forward.csv")])  # no LABEL=


def test_metrics_command_prints_the_list(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "query.txt").write_text(QUERY_OUTPUT)
    ncu_table.main(["metrics", str(tmp_path / "query.txt"),
                    "--exclude", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"])
    chosen = capsys.readouterr().out.strip().split(",")
    assert chosen[:2] == ["gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed"]
    ncu_table.main(["metrics", str(tmp_path / "no_query.txt")])
    assert capsys.readouterr().out.strip().split(",")[1] == ncu_table.METRICS["tensor_pct"][0]


def test_kernel_names_lose_return_type_namespaces_and_parameters() -> None:
    assert ncu_table.short_kernel_name(GEMM) == "fp8_grouped_gemm_kernel<256>"
    assert ncu_table.short_kernel_name("fp8_grouped_gemm_kernel") == "fp8_grouped_gemm_kernel"
    cutlass = ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int>>>"
               "(T1::Params)")
    assert ncu_table.short_kernel_name(cutlass, width=30) == "device_kernel<cutlass::gemm..."
    assert ncu_table.in_table_units(2.5, "msecond") == 2500 and ncu_table.in_table_units(1.98, "cycle/nsecond") == 1980
    assert ncu_table.in_table_units(1.5e9, "hz") == 1500 and ncu_table.in_table_units(42.0, "%") == 42.0


# ---------------------------------------------------------------- ncu_table.py source

def _source_csv(rows: list[tuple[str, int, int, int]]) -> str:
    """A source-page CSV as ncu writes it: the kernel's name, the header, one row per SASS instruction
    with its samples and two reasons (and their "(Not Issued)" twins, which the summary ignores)."""
    header = ["Address", "Source", ncu_table.SAMPLES, "stall_barrier", "stall_wait", "stall_barrier (Not Issued)",
              "stall_wait (Not Issued)"]
    lines = ['"Kernel Name","gemm_kernel(int)",', ",".join(f'"{h}"' for h in header)]
    for address, (sass, samples, barrier, wait) in enumerate(rows):
        lines.append(",".join(f'"{c}"' for c in (hex(address), sass, samples, barrier, wait, 9999, 9999)))
    return "\n".join(lines)


def test_source_summary_places_the_samples_per_instruction() -> None:
    rng = random.Random(7)
    rows = [(f"FFMA R{i}, R{i}, R1, R{i}", s, 0, s) for i, s in enumerate(rng.randint(0, 20) for _ in range(30))]
    rows[11] = ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 500, 480, 20)
    rows[25] = ("QGMMA.64x128x32.F32.E4M3.E4M3 R24", 300, 0, 300)
    total = sum(r[1] for r in rows)
    lines = ncu_table.read_source_csv(_source_csv(rows))
    assert [ln.sass for ln in lines] == [r[0] for r in rows] and lines[11].reasons == {"barrier": 480, "wait": 20}
    summary = ncu_table.source_summary(lines, top=2)
    barrier, wait = 480, total - 480
    assert summary[0] == (f"{total} samples over 30 instructions: " + ", ".join(
        f"{name} {100 * v / total:.1f} %" for v, name in sorted(((barrier, "barrier"), (wait, "wait")), reverse=True)))
    # The two busiest instructions, in program order, each with its largest reasons.
    assert summary[1].split()[:3] == ["11", f"{100 * 500 / total:.1f}", "%"] and "DEPBAR" in summary[1]
    assert summary[1].endswith(f"barrier {100 * 480 / total:.1f}, wait {100 * 20 / total:.1f}")
    assert summary[2].split()[0] == "25" and summary[2].endswith(f"wait {100 * 300 / total:.1f}")
    assert len(summary) == 3


def test_source_summary_without_samples_or_header_says_why(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert ncu_table.source_summary(ncu_table.read_source_csv(_source_csv([("NOP", 0, 0, 0)])), top=4) == [
        "no warp-state samples (was the SourceCounters section collected?)"]
    with pytest.raises(ValueError, match="no header"):
        ncu_table.read_source_csv('"Kernel Name","k",\n"Address","Source"\n"0x0","NOP"')
    missing = tmp_path / "missing.csv"
    ncu_table.main(["source", str(missing)])
    assert capsys.readouterr().out.startswith(f"{missing}: no source data: FileNotFoundError")
    with pytest.raises(SystemExit):
        ncu_table.main(["source", str(missing), "--top", "0"])


def test_samples_no_reason_column_holds_count_as_unlisted() -> None:
    rows = [("QGMMA.64x128x32.F32.E4M3.E4M3 R24", 80, 5, 15), ("FFMA R1, R2, R3, R1", 20, 0, 20)]
    summary = ncu_table.source_summary(ncu_table.read_source_csv(_source_csv(rows)), top=1)
    assert summary[0] == "100 samples over 2 instructions: unlisted 60.0 %, wait 35.0 %, barrier 5.0 %"
    assert summary[1].endswith("unlisted 60.0, wait 15.0") and len(summary) == 2
