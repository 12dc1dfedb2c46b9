"""Nsight Compute profiles of the FP8 grouped GEMMs as a short table of what limits each kernel, and
the metric list to ask ncu for (the `fp8ncu` part of scripts/gpu_check.sh).

    python benchmarks/ncu_table.py metrics QUERY_FILE [--exclude M,...]  # ncu --query-metrics output -> --metrics
    python benchmarks/ncu_table.py table [--brief] LABEL=CSV [LABEL=CSV ...]
    python benchmarks/ncu_table.py source SOURCE_CSV [--top N]  # where the warp-state samples fall

`metrics` picks, for every column of the table, the first of its candidate metrics (METRICS) that
`ncu --query-metrics` lists for the GPU (ncu refuses a whole run for one unknown name; the Hopper
tensor-pipe metric of wgmma has had other names), leaving out those ncu refused before (`--exclude`);
without a list, the first candidates. The warp stall reasons come from ncu's WarpStateStats section,
whose reasons differ between GPUs and versions, so every
`smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio` column is read.

`table` reads raw-page CSVs (`ncu --import R.ncu-rep --csv --page raw --print-units base`): one row per
profiled launch, the metric names in the header, their units in the row below. Per kernel of each
profile (launches of one kernel averaged): time, tensor pipe active, SM throughput, DRAM and L2
throughput (all % of peak over the kernel's elapsed cycles), achieved occupancy and issue-slot use
(% of the active cycles), the SM clock ncu measured, and the three largest stall reasons in cycles per
issued instruction. `--brief` prints one line per kernel instead, for the run's summary.

`source` reads a source-page CSV (`ncu --import R.ncu-rep --page source --csv --print-source sass`, from a
profile with the SourceCounters section): the share of all warp-state samples per reason, and the SASS
instructions holding the most samples with their two largest reasons, so that two kernels' stalls can be
placed instruction by instruction.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
from pathlib import Path
from typing import NamedTuple, Optional

METRICS: dict[str, tuple[str, ...]] = {
    "time_us": ("gpu__time_duration.sum",),
    "tensor_pct": ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
                   "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
                   "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_elapsed"),
    "sm_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "dram_pct": ("dram__throughput.avg.pct_of_peak_sustained_elapsed",
                 "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    "l2_pct": ("lts__throughput.avg.pct_of_peak_sustained_elapsed",),
    "occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "issue_pct": ("smsp__issue_active.avg.pct_of_peak_sustained_active",),
    "clock_mhz": ("sm__cycles_elapsed.avg.per_second", "smsp__cycles_elapsed.avg.per_second",
                  "gpc__cycles_elapsed.avg.per_second"),
}
"""Table column: the metrics that give it, best first."""
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
NOT_STALLS = frozenset({"selected"})
"""Reasons of the WarpStateStats section that are no stall ("selected": the warp issued)."""
TOP_STALLS = 3
TIME_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6,
           "s": 1e6}
FREQUENCY_MHZ = {"hz": 1e-6, "khz": 1e-3, "mhz": 1.0, "ghz": 1e3, "cycle/second": 1e-6, "cycle/msecond": 1e-3,
                 "cycle/usecond": 1.0, "cycle/nsecond": 1e3}
"""Units ncu prints (`--print-units base` or not): the factor to microseconds, or to MHz."""


def offered_metrics(query_output: str) -> set[str]:
    """The base metric names in `ncu --query-metrics` output (the first word of each metric's line)."""
    names = set()
    for line in query_output.splitlines():
        match = re.match(r"^([a-z0-9]+__\w+)\s", line.strip() + " ")
        if match:
            names.add(match.group(1))
    return names


def choose_metrics(offered: set[str], excluded: frozenset[str] = frozenset()) -> list[str]:
    """Per column of METRICS, its first candidate not `excluded` (ncu refused it) whose base name is in
    `offered` (with nothing offered, no list: any); a column left without candidates is left out."""
    chosen = []
    for candidates in METRICS.values():
        chosen += [name for name in candidates
                   if name not in excluded and (not offered or name.split(".")[0] in offered)][:1]
    return chosen


def _number(cell: str) -> Optional[float]:
    try:
        return float(cell.replace(",", ""))
    except ValueError:  # "n/a", "", a string-valued metric
        return None


def in_table_units(value: Optional[float], unit: str) -> Optional[float]:
    """`value` in microseconds if `unit` is a time, in MHz if a frequency, else unchanged."""
    if value is None:
        return None
    unit = unit.strip().lower()
    return value * TIME_US.get(unit, FREQUENCY_MHZ.get(unit, 1.0))


class Launch(NamedTuple):
    """One profiled launch: its kernel's name and its metrics (name -> value in table units)."""
    kernel: str
    metrics: dict[str, Optional[float]]


def read_raw_csv(text: str) -> list[Launch]:
    """The launches of an ncu raw-page CSV; lines before its header (ncu's own) are skipped. Raises
    ValueError when there is no header with a "Kernel Name" column."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"') and '"Kernel Name"' in line), None)
    if start is None:
        raise ValueError("no ncu raw CSV header (a line starting with \"ID\" that names \"Kernel Name\")")
    rows = [cells for cells in csv.reader(lines[start:]) if cells]
    header, rows = rows[0], rows[1:]
    units = [""] * len(header)
    if rows and not rows[0][header.index("ID")]:  # the units row
        units, rows = rows[0], rows[1:]
    launches = []
    for cells in rows:
        if len(cells) != len(header):  # ncu's own lines after the table
            continue
        metrics = {name: in_table_units(_number(cell), unit)
                   for name, unit, cell in zip(header, units, cells) if "__" in name}
        launches.append(Launch(cells[header.index("Kernel Name")], metrics))
    return launches


def short_kernel_name(name: str, width: int = 44) -> str:
    """A kernel's name without return type, namespaces and parameters, cut to `width` characters."""
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    depth, cut = 0, len(name)
    for i, char in enumerate(name):  # the parameter list: the first "(" outside template arguments
        depth += (char == "<") - (char == ">")
        if char == "(" and depth == 0:
            cut = i
            break
    name, depth, start = name[:cut], 0, 0
    for i, char in enumerate(name):  # the last "::" outside template arguments
        depth += (char == "<") - (char == ">")
        if depth == 0 and name.startswith("::", i):
            start = i + 2
    name = name[start:]
    return name if len(name) <= width else name[:width - 3] + "..."


class KernelProfile(NamedTuple):
    """A kernel of one profile: its launches' mean of every table column (None where not measured) and
    its largest stall reasons, `(reason, cycles per issued instruction)`, largest first."""
    label: str
    kernel: str
    launches: int
    columns: dict[str, Optional[float]]
    stalls: list[tuple[str, float]]


def _mean(values: list[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _column(metrics: dict[str, Optional[float]], column: str) -> Optional[float]:
    return next((metrics[name] for name in METRICS[column] if metrics.get(name) is not None), None)


def summarize(label: str, launches: list[Launch]) -> list[KernelProfile]:
    """One KernelProfile per kernel of `launches`, in the order the kernels first ran."""
    kernels: dict[str, list[Launch]] = {}
    for launch in launches:
        kernels.setdefault(launch.kernel, []).append(launch)
    profiles = []
    for kernel, runs in kernels.items():
        columns = {column: _mean([_column(run.metrics, column) for run in runs]) for column in METRICS}
        stalls: dict[str, list[Optional[float]]] = {}
        for run in runs:
            for name, value in run.metrics.items():
                match = STALL.match(name)
                if match and match.group(1) not in NOT_STALLS:
                    stalls.setdefault(match.group(1), []).append(value)
        means = {reason: _mean(values) for reason, values in stalls.items()}
        top = sorted(((reason, v) for reason, v in means.items() if v is not None), key=lambda rv: -rv[1])
        profiles.append(KernelProfile(label, short_kernel_name(kernel), len(runs), columns, top[:TOP_STALLS]))
    return profiles


def _cell(value: Optional[float], width: int, spec: str = ".1f") -> str:
    return f"{'-' if value is None else format(value, spec):>{width}s}"


def _stalls(profile: KernelProfile) -> str:
    return ", ".join(f"{reason} {value:.2f}" for reason, value in profile.stalls) or "-"


HEADER = (f"{'profile':16s} {'kernel':44s} {'n':>2s} {'time us':>8s} {'tensor%':>7s} {'SM%':>5s} {'DRAM%':>5s} "
          f"{'L2%':>5s} {'occ%':>5s} {'issue%':>6s} {'SM MHz':>6s}  top stalls (cycles per issued instruction)")


def table_line(profile: KernelProfile) -> str:
    c = profile.columns
    return (f"{profile.label:16s} {profile.kernel:44s} {profile.launches:2d} {_cell(c['time_us'], 8, '.0f')} "
            f"{_cell(c['tensor_pct'], 7)} {_cell(c['sm_pct'], 5)} {_cell(c['dram_pct'], 5)} "
            f"{_cell(c['l2_pct'], 5)} {_cell(c['occupancy_pct'], 5)} {_cell(c['issue_pct'], 6)} "
            f"{_cell(c['clock_mhz'], 6, '.0f')}  {_stalls(profile)}")


def brief_line(profile: KernelProfile) -> str:
    c = profile.columns
    return (f"{profile.label}: {profile.kernel}: tensor {_cell(c['tensor_pct'], 0, '.0f')} %, SM "
            f"{_cell(c['sm_pct'], 0, '.0f')} %, DRAM {_cell(c['dram_pct'], 0, '.0f')} %, L2 "
            f"{_cell(c['l2_pct'], 0, '.0f')} %, {_cell(c['clock_mhz'], 0, '.0f')} MHz, {_cell(c['time_us'], 0, '.0f')}"
            f" us; stalls: {_stalls(profile)}")


def legend(launches: list[Launch]) -> list[str]:
    """Which metric gave each column (the first candidate present in any launch)."""
    present = {name for launch in launches for name, value in launch.metrics.items() if value is not None}
    lines = []
    for column, candidates in METRICS.items():
        name = next((n for n in candidates if n in present), None)
        lines.append(f"  {column:13s} {name or 'not measured (none of ' + ', '.join(candidates) + ')'}")
    return lines


def load(label: str, path: Path) -> tuple[list[KernelProfile], list[Launch], Optional[str]]:
    """`(profiles, launches, None)` of the CSV at `path`, or `([], [], why there are none)`."""
    try:
        launches = read_raw_csv(path.read_text())
    except (OSError, ValueError) as error:
        return [], [], f"{type(error).__name__}: {error}"
    if not launches:
        return [], [], "no launch profiled (the NVTX range or kernel filter matched nothing)"
    return summarize(label, launches), launches, None


class SourceLine(NamedTuple):
    index: int
    sass: str
    samples: float
    reasons: dict[str, float]


SAMPLES = "Warp Stall Sampling (All Samples)"
SOURCE_STALL = re.compile(r"^stall_(\w+)$")


def read_source_csv(text: str) -> list[SourceLine]:
    """The instructions of a source-page CSV: its first line names the kernel, the second the columns
    (`Source`, the samples, one `stall_<reason>` column per reason and its "(Not Issued)" twin)."""
    rows = list(csv.reader(text.splitlines()))
    header = next((row for row in rows if "Source" in row and SAMPLES in row), None)
    if header is None:
        raise ValueError(f"no header with 'Source' and {SAMPLES!r}")
    source, samples = header.index("Source"), header.index(SAMPLES)
    reasons = [(i, m.group(1)) for i, name in enumerate(header) if (m := SOURCE_STALL.match(name))]
    lines = []
    for index, row in enumerate(rows[rows.index(header) + 1:]):
        if len(row) != len(header):
            continue
        lines.append(SourceLine(index, row[source].strip(), _number(row[samples]) or 0.0,
                                {reason: _number(row[i]) or 0.0 for i, reason in reasons}))
    return lines


def _with_unlisted(line: SourceLine) -> dict[str, float]:
    """The line's reasons, with the samples that no exported reason column holds as "unlisted" (this ncu
    leaves some out, e.g. the first `wgmma` of a group waiting for the tensor pipe)."""
    unlisted = line.samples - sum(line.reasons.values())
    return {**line.reasons, "unlisted": unlisted} if unlisted > 0 else line.reasons


def source_summary(lines: list[SourceLine], top: int) -> list[str]:
    """The reasons' shares of all samples, then the `top` instructions by samples, in program order."""
    total = sum(line.samples for line in lines)
    if total <= 0:
        return ["no warp-state samples (was the SourceCounters section collected?)"]
    shares: dict[str, float] = {}
    for line in lines:
        for reason, value in _with_unlisted(line).items():
            shares[reason] = shares.get(reason, 0.0) + value
    ranked = sorted(((v, r) for r, v in shares.items() if v / total >= 0.005), reverse=True)
    out = [f"{total:.0f} samples over {len(lines)} instructions: "
           + ", ".join(f"{reason} {100 * v / total:.1f} %" for v, reason in ranked)]
    for line in sorted(sorted(lines, key=lambda ln: -ln.samples)[:top], key=lambda ln: ln.index):
        main = sorted(((v, r) for r, v in _with_unlisted(line).items() if v > 0), reverse=True)[:2]
        out.append(f"{line.index:6d} {100 * line.samples / total:5.1f} %  {line.sass[:64]:64s} "
                   + ", ".join(f"{reason} {100 * v / total:.1f}" for v, reason in main))
    return out


def parse_profile_arg(text: str) -> tuple[str, Path]:
    """`LABEL=CSV` as `(label, path)`; ValueError naming the form otherwise."""
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise ValueError(f"expected LABEL=CSV, got {text!r}")
    return label, Path(path)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    metrics = commands.add_parser("metrics", help="the --metrics list from `ncu --query-metrics` output")
    metrics.add_argument("query_file", type=Path)
    metrics.add_argument("--exclude", default="", help="comma list of metrics ncu refused")
    table = commands.add_parser("table", help="the table of raw-page CSVs")
    table.add_argument("--brief", action="store_true", help="one line per kernel, for the run's summary")
    table.add_argument("profiles", nargs="+", metavar="LABEL=CSV")
    source = commands.add_parser("source", help="where a source-page CSV's warp-state samples fall")
    source.add_argument("source_csv", type=Path)
    source.add_argument("--top", type=int, default=16, help="instructions to list (default 16)")
    args = parser.parse_args(argv)
    if args.command == "source":
        if args.top < 1:
            parser.error(f"--top: expected an integer >= 1, got {args.top}")
        try:
            print("\n".join(source_summary(read_source_csv(args.source_csv.read_text()), args.top)))
        except (OSError, ValueError) as error:
            print(f"{args.source_csv}: no source data: {type(error).__name__}: {error}")
        return
    if args.command == "metrics":
        text = args.query_file.read_text() if args.query_file.is_file() else ""
        excluded = frozenset(name for name in args.exclude.split(",") if name)
        print(",".join(choose_metrics(offered_metrics(text), excluded)))
        return
    try:
        profile_args = [parse_profile_arg(text) for text in args.profiles]
    except ValueError as error:
        parser.error(f"table: {error}")
    lines, notes, every_launch = [], [], []
    for label, path in profile_args:
        profiles, launches, why = load(label, path)
        every_launch += launches
        if why is not None:
            notes.append(f"{label}: no ncu data: {why}")
        lines += [brief_line(p) if args.brief else table_line(p) for p in profiles]
    if args.brief:
        print("\n".join(lines + notes))
        return
    print("\n".join([HEADER, *lines, *notes, "columns from:", *legend(every_launch)]))


if __name__ == "__main__":
    main()
