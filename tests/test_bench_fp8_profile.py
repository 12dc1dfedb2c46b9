"""The FP8 grouped GEMM benchmark's profile, without a GPU: nvidia-smi lines parsed and summarised, the
background sampler against a stand-in `nvidia-smi` script, FLOP counts, the float64 reference and
errors, the row-wise cast, the timer's rows and skips, the table, and the benchmark's argument checks."""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

from moe_ep.ops import fp8 as fp8_ops

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fp8_profile as prof  # noqa: E402
import gpu_clocks  # noqa: E402
from gpu_clocks import ClockSampler, Sample  # noqa: E402

# A stand-in for nvidia-smi: one line per call, or a line every 20 ms with -lms; "-i bad" fails as the
# real one does for an unknown id.
FAKE_NVIDIA_SMI = """#!/bin/sh
case "$*" in *"-i bad"*) echo "No devices were found"; exit 6;; esac
case "$*" in
  *-lms*) while :; do echo "1500, 1980, 650.25, 700.00, 61"; sleep 0.02; done;;
  *) echo "1980, 1980, 80.00, 700.00, 40";;
esac
"""


@pytest.fixture
def fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "nvidia-smi"
    script.write_text(FAKE_NVIDIA_SMI)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return script


def _grouped_product(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`a[rows of e] @ b[e].T` group by group, in a's dtype."""
    ends = torch.tensor(counts).cumsum(0).tolist()
    return torch.cat([a[end - count:end] @ b[e].t() for e, (count, end) in enumerate(zip(counts, ends))])


def test_nvidia_smi_lines_parse_and_other_lines_are_dropped() -> None:
    assert gpu_clocks.parse_sample("1755, 1980, 412.35, 700.00, 45\n") == Sample(1755, 1980, 412.35, 700, 45)
    assert gpu_clocks.parse_sample("1410, 1980, [N/A], 700.00, 38") == Sample(1410, 1980, None, 700, 38)
    assert gpu_clocks.parse_sample("[N/A], 1980, 80.0, 700.00, 38") is None
    assert gpu_clocks.parse_sample("No devices were found") is None
    assert gpu_clocks.parse_sample("clocks.current.sm [MHz], clocks.max.sm [MHz]") is None
    assert gpu_clocks.parse_sample("") is None


def test_summary_is_the_median_and_extremes_of_random_samples() -> None:
    g = torch.Generator().manual_seed(3)
    clocks = (1300 + 700 * torch.rand(23, generator=g)).tolist()
    powers = (300 + 400 * torch.rand(23, generator=g)).tolist()
    samples = [Sample(c, 1980.0, p if i % 5 else None, 700.0, 40.0 + i) for i, (c, p) in enumerate(zip(clocks, powers))]
    stats = gpu_clocks.summarize(samples)
    known_powers = [p for i, p in enumerate(powers) if i % 5]
    assert stats["samples"] == 23 and "reason" not in stats
    assert stats["sm_clock_mhz"] == statistics.median(clocks)
    assert (stats["sm_clock_min_mhz"], stats["sm_clock_max_mhz"]) == (min(clocks), max(clocks))
    assert stats["power_w"] == statistics.median(known_powers) and stats["power_max_w"] == max(known_powers)
    assert (stats["max_sm_clock_mhz"], stats["power_limit_w"], stats["temperature_max_c"]) == (1980, 700, 62)
    empty = gpu_clocks.summarize([], "nvidia-smi not found")
    assert empty["samples"] == 0 and empty["sm_clock_mhz"] is None and empty["reason"] == "nvidia-smi not found"


def test_gpu_ids_to_try_put_the_uuid_first() -> None:
    uuid = "5f0c3a8e-1d2b-4c3d-9e8f-0123456789ab"
    assert gpu_clocks.gpu_id_candidates(uuid, 1, "3,5") == [f"GPU-{uuid}", "5", "1"]
    assert gpu_clocks.gpu_id_candidates(f"GPU-{uuid}", 0, None) == [f"GPU-{uuid}", "0"]
    assert gpu_clocks.gpu_id_candidates(None, 0, "0") == ["0"]


def test_find_gpu_skips_an_id_nvidia_smi_rejects(fake_nvidia_smi: Path) -> None:
    assert gpu_clocks.find_gpu(["bad", "0"]) == ("0", None)
    gpu, reason = gpu_clocks.find_gpu(["bad"])
    assert gpu is None and "-i bad: rc=6" in reason and "No devices were found" in reason


def test_find_gpu_without_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    assert gpu_clocks.find_gpu(["0"]) == (None, "nvidia-smi not found")


def test_sampler_windows_keep_the_samples_of_their_own_block(fake_nvidia_smi: Path) -> None:
    with ClockSampler("0") as sampler:
        with sampler.window() as during:
            time.sleep(0.3)
        with sampler.window() as instant:
            pass
    assert during["samples"] >= 3, during
    assert (during["sm_clock_mhz"], during["max_sm_clock_mhz"], during["power_w"]) == (1500, 1980, 650.25)
    assert instant["sm_clock_mhz"] is None and "no nvidia-smi sample" in instant["reason"]
    assert sampler._process.poll() is not None  # stopped with the block


def test_sampler_whose_nvidia_smi_exits_reports_its_message(fake_nvidia_smi: Path) -> None:
    with ClockSampler("bad") as sampler:
        time.sleep(0.2)
        with sampler.window() as stats:
            pass
    assert stats["sm_clock_mhz"] is None and stats["reason"] == "nvidia-smi exited with 6: No devices were found"


def test_sampler_without_a_gpu_reports_why() -> None:
    with ClockSampler(None, "nvidia-smi not found") as sampler:
        with sampler.window() as stats:
            pass
    assert stats["sm_clock_mhz"] is None and stats["reason"] == "nvidia-smi not found"


def test_grouped_gemm_flops_sum_over_the_groups() -> None:
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 700, (64,), generator=g).tolist()
    depth, width = 7168, 4096
    per_group = sum(2 * count * depth * width for count in counts)  # one multiply-add = 2 FLOPs
    assert prof.grouped_gemm_flops(sum(counts), depth, width) == per_group
    # DeepGEMM's first shape: 4 x 8192 rows, N 4096, K 7168 is 1.924 TFLOP; 1250 TF/s takes 1.539 ms.
    flops = prof.grouped_gemm_flops(sum(prof.deepgemm_counts()), *prof.DEEPGEMM_SHAPES["deepgemm N4096 K7168"])
    assert flops == 2 * 32768 * 7168 * 4096
    assert prof.tflops(flops, 1539.3) == pytest.approx(1250, rel=1e-4)


def test_rate_at_the_maximum_clock() -> None:
    assert prof.at_max_clock(800.0, 1980.0, 1500.0) == pytest.approx(1056.0)
    assert prof.at_max_clock(800.0, None, 1500.0) is None and prof.at_max_clock(800.0, 1980.0, None) is None


def test_shape_sets_parse_and_bad_ones_name_the_option() -> None:
    assert prof.parse_shape_sets("ours,deepgemm") == ["ours", "deepgemm"]
    assert prof.parse_shape_sets(" deepgemm ,ours,deepgemm") == ["deepgemm", "ours"]
    for bad in ("", "ours,theirs", ","):
        with pytest.raises(ValueError, match="--shapes"):
            prof.parse_shape_sets(bad)


def test_reference_rows_spread_over_the_groups() -> None:
    assert prof.reference_slices([5, 0, 300, 17], total=64) == [(0, 0, 5), (2, 5, 21), (3, 305, 321)]
    deepgemm = prof.reference_slices(prof.deepgemm_counts())
    assert deepgemm == [(g, g * 8192, g * 8192 + 1024) for g in range(4)]


def test_errors_against_the_float64_reference() -> None:
    g = torch.Generator().manual_seed(1)
    counts = [40, 0, 130, 7, 64]
    a = torch.randn(sum(counts), 96, generator=g)
    b = torch.randn(len(counts), 48, 96, generator=g)
    slices = prof.reference_slices(counts, total=100)
    reference = prof.grouped_reference(a, b, slices)
    exact = _grouped_product(a.double(), b.double(), counts)
    assert reference.dtype == torch.float64 and reference.shape == (sum(e - s for _, s, e in slices), 48)
    assert prof.sliced_relative_error(exact, reference, slices) < 1e-15
    assert prof.sliced_relative_error(exact * 1.01, reference, slices) == pytest.approx(0.01, rel=1e-9)
    assert prof.sliced_relative_error(_grouped_product(a, b, counts).bfloat16(), reference, slices) < 5e-3
    shuffled = exact[torch.randperm(exact.size(0), generator=g)]
    assert prof.sliced_relative_error(shuffled, reference, slices) > 0.5


def test_rowwise_cast_one_scale_per_row() -> None:
    g = torch.Generator().manual_seed(2)
    t = torch.randn(3, 50, 256, generator=g)
    t[1, 7] *= 1000  # an outlier row gets its own scale
    q, scales = prof.rowwise_cast_to_fp8(t.bfloat16(), chunk_rows=16)
    assert q.dtype == torch.float8_e4m3fn and q.shape == t.shape and scales.shape == (3, 50)
    amax = t.bfloat16().float().abs().amax(-1)
    assert torch.allclose(scales, amax / 448, rtol=1e-6)
    assert torch.equal(q.float().abs().amax(-1), torch.full((3, 50), 448.0))
    assert prof.relative_error(q.float() * scales[..., None], t) < 0.05
    same_q, same_scales = prof.rowwise_cast_to_fp8(t.bfloat16())
    assert torch.equal(q.view(torch.uint8), same_q.view(torch.uint8)) and torch.equal(scales, same_scales)


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="torch without _scaled_mm")
def test_rowwise_scales_multiply_as_torch_scaled_mm_expects() -> None:
    """The row-wise casts in torch's scaled-GEMM convention (scales multiply the FP8 product), one group
    at a time with `torch._scaled_mm`, where this torch runs it on the CPU."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(64, 256, generator=g), torch.randn(2, 32, 256, generator=g)
    (qx, sx), (qw, sw) = prof.rowwise_cast_to_fp8(x), prof.rowwise_cast_to_fp8(w)
    try:
        out = torch.cat([torch._scaled_mm(qx[32 * e:32 * (e + 1)], qw[e].t(), sx[32 * e:32 * (e + 1), None],
                                          sw[e][None, :], out_dtype=torch.float32) for e in range(2)])
    except (RuntimeError, NotImplementedError) as error:
        pytest.skip(f"torch._scaled_mm does not run on this CPU: {error}")
    assert prof.relative_error(out, _grouped_product(x.double(), w.double(), [32, 32])) < 0.06


def _timer(sampler: ClockSampler, seconds: float = 0.0) -> prof.KernelTimer:
    return prof.KernelTimer(sampler, seconds)


def test_timer_profiles_every_implementation_and_skips_a_failing_optional_one() -> None:
    g = torch.Generator().manual_seed(5)
    counts = [24, 0, 40]
    a, b = torch.randn(64, 128, generator=g), torch.randn(3, 32, 128, generator=g)
    noisy = _grouped_product(a, b, counts) + 0.02 * torch.randn(64, 32, generator=g)

    def unavailable() -> torch.Tensor:
        raise NotImplementedError("not on this backend")

    timer = _timer(ClockSampler(None, "nvidia-smi not found"))
    with timer.sampler:
        results = timer.profile("toy", "forward", {"bf16": lambda: _grouped_product(a, b, counts),
                                                   "fp8-triton": lambda: noisy, "rowwise": unavailable},
                                {"fp8-cuda": "no CUDA here"}, a, b, counts, prof.grouped_gemm_flops(64, 128, 32))
    assert list(results) == ["bf16", "fp8-triton"]
    assert results["bf16"]["rel_err"] < 1e-6 and 1e-3 < results["fp8-triton"]["rel_err"] < 0.1
    assert [(r["impl"], r["op"], r["shape"]) for r in timer.rows] == [("bf16", "forward", "toy"),
                                                                      ("fp8-triton", "forward", "toy")]
    for row in timer.rows:
        assert row["time_us"] > 0 and row["tflops"] == pytest.approx(64 * 128 * 32 * 2 / row["time_us"] / 1e6)
        assert row["sm_clock_mhz"] is None and row["tflops_at_max_clock"] is None
        assert row["clocks"]["reason"] == "nvidia-smi not found"
    assert [(s["impl"], s["reason"].split(":")[0]) for s in timer.skipped] == [("fp8-cuda", "no CUDA here"),
                                                                              ("rowwise", "NotImplementedError")]
    with pytest.raises(NotImplementedError):  # our own kernels failing is not a result
        timer.profile("toy", "forward", {"fp8-cuda": unavailable}, {}, a, b, counts, 1)


def test_scaled_grouped_mm_rows_run_or_say_why() -> None:
    g = torch.Generator().manual_seed(6)
    counts = [32, 0, 48, 16]
    x, w = torch.randn(96, 256, generator=g).bfloat16(), torch.randn(4, 64, 256, generator=g).bfloat16()
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    impls, skipped = prof.scaled_grouped_mm_impls(prof.rowwise_cast_to_fp8(x), prof.rowwise_cast_to_fp8(w), ends)
    assert not skipped and list(impls) == ["rowwise", "rowwise-fastacc"]
    timer = _timer(ClockSampler(None, "none"))
    results = timer.profile("toy", "forward", impls, skipped, x, w, counts, 1)
    for impl in impls:  # the op is CUDA-only in most builds; where it runs, its error is the row-wise cast's
        assert (impl in results and results[impl]["rel_err"] < 0.1) or any(s["impl"] == impl for s in timer.skipped)


class _FakeDeepGemm:
    """Stands in for the `deep_gemm` module: DeepGEMM's grouped contiguous GEMM computed in float32 from
    the dequantized operands, recording how it was called."""

    def __init__(self, alignment: int) -> None:
        self.alignment, self.transforms, self.calls = alignment, [], []

    def get_mk_alignment_for_contiguous_layout(self) -> int:
        return self.alignment

    def transform_sf_into_required_layout(self, sf, mn, k, recipe, is_sfa, disable_ue8m0_cast):
        self.transforms.append((mn, k, recipe, is_sfa, disable_ue8m0_cast))
        return sf.t().contiguous().t()  # MN-major, as the GPU version returns it

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, grouped_layout, disable_ue8m0_cast):
        (qa, sa), (qb, sb) = a, b
        self.calls.append((grouped_layout.tolist(), sa.stride(), disable_ue8m0_cast))
        x = qa.float() * sa.repeat_interleave(128, dim=1)
        w = qb.float() * sb.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
        d.copy_(torch.einsum("mk,mnk->mn", x, w[grouped_layout.long()]))


def test_deepgemm_rows_run_on_our_casts_or_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(8)
    counts = [128, 256, 128]
    x, w = torch.randn(512, 256, generator=g), torch.randn(3, 128, 256, generator=g) / 16
    x_8 = fp8_ops.per_token_cast_to_fp8(x)
    w_8 = fp8_ops.per_block_cast_to_fp8(w)
    fake = _FakeDeepGemm(alignment=128)
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    impls, skipped = prof.deepgemm_impls(x_8, w_8, counts)
    assert not skipped and list(impls) == ["deepgemm"]
    assert fake.transforms == [(512, 256, (1, 128, 128), True, True)]  # once, before any timed call
    timer = _timer(ClockSampler(None, "none"))
    results = timer.profile("toy", "forward", impls, skipped, x, w, counts, 1)
    assert results["deepgemm"]["rel_err"] < 0.1  # the FP8 casts' error, not a wrong group
    rows, strides, no_ue8m0 = fake.calls[0]
    assert rows == [0] * 128 + [1] * 256 + [2] * 128 and strides == (1, 512) and no_ue8m0
    # Groups off its alignment, and no module at all: recorded as not run, with the reason.
    _, skipped = prof.deepgemm_impls(x_8, w_8, [16, 368, 128])
    assert "multiple of 128 rows; these are multiples of 16" in skipped["deepgemm"]
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    assert "not importable" in prof.deepgemm_impls(x_8, w_8, counts)[1]["deepgemm"]


def test_timer_rows_carry_the_sampled_clock(fake_nvidia_smi: Path) -> None:
    a, b = torch.randn(32, 64), torch.randn(1, 16, 64)
    with ClockSampler("0") as sampler:
        timer = _timer(sampler, seconds=0.25)
        timer.time(lambda: a @ b[0].t(), shape="toy", op="forward", impl="bf16", flops=10**9, rel_err=0.01)
    row = timer.rows[0]
    assert (row["sm_clock_mhz"], row["power_w"]) == (1500, 650.25)
    assert row["tflops_at_max_clock"] == pytest.approx(row["tflops"] * 1980 / 1500)
    table = prof.profile_table(timer.rows, [{"shape": "toy", "op": "forward", "impl": "rowwise", "reason": "why"}])
    lines = table.splitlines()
    assert lines[0].split() == ["shape", "op", "impl", "time", "us", "TF/s", "@maxclk", "SM", "MHz", "W", "rel", "err"]
    cells = lines[1].split()
    assert cells[:3] == ["toy", "forward", "bf16"] and cells[-3:] == ["1500", "650", "1.00e-02"]
    assert float(cells[5]) == pytest.approx(row["tflops"] * 1980 / 1500, abs=0.5)
    assert "board: max SM clock 1980 MHz, power limit 700 W" in table
    assert "not run: toy forward rowwise: why" in table
    assert all(f"  {name}" in table for name in prof.IMPLEMENTATIONS)


def test_table_without_clock_samples_says_why() -> None:
    row = prof.kernel_row("deepgemm N7168 K2048", "forward", "fp8-cuda", 1500.0, 10**12, {"reason": "no nvidia-smi"},
                          None)
    assert row["tflops"] == pytest.approx(10**12 / 1.5e-3 / 1e12)
    table = prof.profile_table([row], [])
    assert "no clock or power samples: no nvidia-smi" in table
    cells = table.splitlines()[1].split()
    assert cells[-4:] == ["-", "-", "-", "-"] and math.isclose(float(cells[-5]), 667, abs_tol=1)


def test_benchmark_rejects_bad_options_before_touching_a_gpu(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    import bench_fp8_grouped_gemm as bench

    for argv, message in ((["--shapes", "ours,mine"], "--shapes: expected a comma list of ours, deepgemm"),
                          (["--sample-seconds", "-1"], "--sample-seconds: expected a number >= 0")):
        monkeypatch.setattr(sys, "argv", ["bench_fp8_grouped_gemm.py", *argv])
        with pytest.raises(SystemExit) as exit_info:
            bench.main()
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
