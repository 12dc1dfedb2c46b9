"""The examples in their short modes, as subprocesses on 2 CPU ranks: the loss falls (each script
checks that itself with --short), a preempted and resumed run ends exactly where an uninterrupted
one does, and the merged checkpoint computes the same validation loss on a single rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 300


def _run(*args: str | Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def _metrics(folder: Path) -> dict:
    return json.loads((folder / "metrics.json").read_text())


def test_train_deepseek_v3_resume_and_convert(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    train = EXAMPLES / "train_deepseek_v3.py"
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _run(train, "--short", "--out-dir", whole)
    _run(train, "--short", "--out-dir", resumed, "--stop-at", "20")
    assert _metrics(resumed)["step"] == 20
    _run(train, "--short", "--out-dir", resumed, "--resume")
    expected = _metrics(whole)
    assert expected["final_val_loss"] < 0.85 * expected["initial_val_loss"]
    assert _metrics(resumed) == expected
    assert (whole / "loss.png").stat().st_size > 0

    full = tmp_path / "full.pt"
    _run(EXAMPLES / "convert_checkpoint.py", whole / "checkpoint", full)
    _run(train, "--world", "1", "--init-from", full, "--steps", "0", "--out-dir", tmp_path / "single")
    single = _metrics(tmp_path / "single")["final_val_loss"]
    assert single == pytest.approx(expected["final_val_loss"], rel=1e-5)


def test_finetune_hf_moe(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    out = _run("-m", "torch.distributed.run", "--nproc-per-node", "2", EXAMPLES / "finetune_hf_moe.py", "--short",
               "--out-dir", tmp_path / "tuned")
    assert "2 MoE blocks on 2 ranks" in out
    assert (tmp_path / "tuned" / "config.json").exists()


def test_deepep_style_program() -> None:
    """examples/deepep_style.py: DeepEP-style normal and low-latency mode (hooks, cached dispatch, elastic
    mode, LogFMT) on the torch backend; the script checks its own results."""
    out = _run(EXAMPLES / "deepep_style.py", "--world", "2")
    assert out.strip().endswith("OK") and "rank 1 masked" in out
