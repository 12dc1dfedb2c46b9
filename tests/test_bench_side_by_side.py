"""benchmarks/bench_side_by_side.py: a tiny run on 2 CPU ranks (torch backend over gloo, DeepEP absent)
checked against the routing recomputed here, the table's ratios, and how DeepEP is told from moe_ep's alias."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
# The benchmarks turn moe_ep's value checks off for their own processes when imported; the workers of
# the tests that run after these must keep them.
_ENVIRONMENT = dict(os.environ)
import bench_side_by_side as sbs  # noqa: E402
from bench_internode import _workload  # noqa: E402

os.environ.clear()
os.environ.update(_ENVIRONMENT)

WORLD = 2
TIMEOUT_S = 400


def _expected_counts(tokens: int, per_token: bool) -> torch.Tensor:
    """`[source, destination]` rows of the tiny workload: tokens with an expert on the destination
    (`per_token`), else (token, expert) pairs."""
    shape = sbs.TINY
    counts = torch.zeros(WORLD, WORLD, dtype=torch.int64)
    for source in range(WORLD):
        _, topk_idx, _ = _workload(source, tokens, shape["hidden"], shape["experts"], shape["topk"], torch.device("cpu"))
        owner = topk_idx // (shape["experts"] // WORLD)
        for dest in range(WORLD):
            hits = owner == dest
            counts[source, dest] = int(hits.any(dim=1).sum() if per_token else hits.sum())
    return counts


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("sbs") / "sbs.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_side_by_side.py"), "--tiny", "--backend",
                           "torch", "--world", str(WORLD), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), proc.stdout


def test_tiny_run_receives_what_the_routing_sends(tiny_run) -> None:
    report, _ = tiny_run
    ours, nccl = report["phases"]["moe_ep"], report["phases"]["nccl"]
    assert ours["status"] == 0 and nccl["status"] == 0
    rows = _expected_counts(sbs.TINY["tokens"], per_token=True)
    assert ours["checks_normal"]["recv_rows"] == rows.sum(dim=0).tolist()
    assert ours["checks_normal"]["ok"] and max(ours["checks_normal"]["combine_max_rel_error"]) < 1e-2
    messages = _expected_counts(sbs.TINY["ll_tokens"], per_token=False)
    assert ours["checks_ll"]["recv_messages"] == messages.sum(dim=0).tolist() and ours["checks_ll"]["ok"]
    # NCCL moves the rows that cross between ranks: the off-diagonal.
    remote = rows.sum(dim=0) - rows.diagonal()
    assert nccl["ops"]["bf16_rows"]["remote_recv_rows"] == remote.tolist()
    assert nccl["ops"]["fp8_rows"]["row_bytes"] == sbs.TINY["hidden"] + sbs.TINY["hidden"] // 128 * 4
    assert nccl["ops"]["ll_dispatch_msgs"]["remote_recv_rows"] == (messages.sum(dim=0) - messages.diagonal()).tolist()


def test_tiny_run_times_every_op_and_reports_deepep_absent(tiny_run) -> None:
    report, stdout = tiny_run
    ops = report["phases"]["moe_ep"]["ops"]
    timed = ["layout", "dispatch_bf16", "dispatch_bf16_cached", "dispatch_fp8", "dispatch_fp8_cached", "combine_bf16",
             "ll_dispatch_fp8", "ll_combine_bf16", "ll_dispatch_fp8_hook", "ll_combine_bf16_hook"]
    for op in timed:
        assert ops[op]["call_us"] > 0 and math.isnan(ops[op]["kernel_us"]), op  # no kernels on the CPU
    assert ("call_us" in ops["ll_combine_logfmt"]) != ("unsupported" in ops["ll_combine_logfmt"])
    deep_ep = report["phases"]["deep_ep"]
    assert deep_ep["found"] is False and deep_ep["ops"] == {} and "deep_ep" in deep_ep["where"]
    table = stdout[stdout.index("times in us"):]
    assert "dispatch FP8 cached" in table and "LL combine BF16 hook" in table and "deep_ep: not found" in table


def _report(ours: dict, theirs: dict, nccl: dict) -> dict:
    args = {"world": 4, "backend": "cuda", "tokens": 4096, "hidden": 7168, "topk": 8, "experts": 256, "num_sms": 24,
            "ll_tokens": 128}
    return {"device": "GPU", "args": args, "phases": {
        "moe_ep": {"status": 0, "seconds": 1, "found": True, "ops": ours},
        "deep_ep": {"status": 0, "seconds": 1, "found": True, "where": "/x/deep_ep", "ops": theirs},
        "nccl": {"status": 0, "seconds": 1, "process_group": "nccl", "ops": nccl}}}


def test_table_ratios_are_moe_ep_speedups() -> None:
    ours = {"dispatch_bf16_cached": {"call_us": 540.0, "kernel_us": 573.0, "config": "16:256"},
            "combine_bf16_staged": {"call_us": 698.0, "kernel_us": 521.0, "ran": "rings"}}
    theirs = {"dispatch_bf16_cached": {"call_us": 810.0, "kernel_us": 802.2},
              "combine_bf16": {"call_us": 593.0, "kernel_us": 593.0}}
    nccl = {"bf16_rows": {"call_us": 671.0, "kernel_us": 650.0, "remote_mb_max": 159.0}}
    lines = sbs.table(_report(ours, theirs, nccl)).splitlines()
    cached = next(line for line in lines if line.startswith("dispatch BF16 cached"))
    assert cached.split()[3:] == ["540.0", "810.0", "671.0", "(650.0)", "573.0", "802.2", "1.50x", "1.24x", "1.40x"]
    staged = next(line for line in lines if line.startswith("combine BF16 staged"))
    # moe_ep's staged combine against DeepEP's one combine; slower calls give ratios below 1.
    assert staged.split()[3:12] == ["698.0", "593.0", "671.0", "(650.0)", "521.0", "593.0", "0.85x", "0.96x", "1.14x"]
    assert staged.endswith("(moe_ep ran the rings path)")  # staged asked, rings taken: noted
    assert not any(line.startswith("dispatch FP8") for line in lines)  # rows nobody measured are left out
    assert "bf16_rows 159.00 MB" in sbs.table(_report(ours, theirs, nccl))


def test_moe_ep_alias_is_not_taken_for_deepep(monkeypatch) -> None:
    from moe_ep.deep_ep_alias import deep_ep as alias

    monkeypatch.setitem(sys.modules, "deep_ep", alias)
    module, why = sbs.find_deep_ep("")
    assert module is None and "alias" in why


def test_a_deepep_v1_module_is_found(monkeypatch, tmp_path: Path) -> None:
    fake = types.ModuleType("deep_ep")
    fake.__file__ = str(tmp_path / "deep_ep" / "__init__.py")
    fake.Buffer = type("Buffer", (), {"low_latency_dispatch": lambda self: None})
    fake.Config = object
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    module, where = sbs.find_deep_ep("")
    assert module is fake and where == str(tmp_path / "deep_ep")
    del fake.Buffer.low_latency_dispatch  # a deep_ep without DeepEP V1's Buffer (V2's, say) is refused
    assert sbs.find_deep_ep("")[0] is None


SCRIPT = ROOT / "scripts" / "side_by_side.sh"


def test_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.parametrize("argv", [["ep16"], ["ep4", "build,bench"]])
def test_script_refuses_an_unknown_mode_or_part(argv: list[str], tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(SCRIPT), *argv], env={**os.environ, "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and ("mode 'ep16'" in proc.stderr or "unknown part 'bench'" in proc.stderr)


def test_script_without_a_deepep_snapshot_says_so_and_still_summarizes(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "DEEPEP_DIR": str(tmp_path / "absent"), "CALL_BUDGET_S": "120"}
    proc = subprocess.run(["bash", str(SCRIPT), "ep4", "deepep"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "no DeepEP snapshot at" in (tmp_path / "build.log").read_text()
    summary = proc.stdout[proc.stdout.index("================ summary"):]
    assert "build DeepEP: FAILED" in summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build.log", "files.tgz", "gpus.txt", "side_by_side.log"]
