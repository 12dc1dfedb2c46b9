"""The Triton un-permute kernels against the dispatcher's torch code, and the dispatcher wired to them.

Compiled on a GPU, in Triton's interpreter elsewhere (see `triton_kernels`). Skipped without Triton.

Tolerances (random data; the kernels do the torch code's float32 arithmetic, so on a GPU most
results are bitwise equal): a result in the output dtype may be one unit in its last place (ulp)
off the torch result, as float32 rounding differences can move a rounding, and the interpreter
truncates to bfloat16 instead of rounding. Float32 sums may differ by their rounding errors: the
selection sums (same slot order; fused multiply-adds or not) by `k * 2**-23` of the sum of the
terms' magnitudes, the dot products (another summation order) by `2**-18` of it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Optional

import pytest
import torch

from moe_ep.layers import dispatcher
from moe_ep.ops.routing import ExpertLayout, expert_major_layout
from triton_kernels import DEVICE, import_kernels, interpret_without_cuda

kernels = import_kernels("moe_ep.kernels.permute_kernels")

NUM_ROWS, NUM_LOCAL, ALIGNMENT = 37, 12, 4
EMPTY_ROWS = [0, 5]  # received rows with no local expert
# 8 * odd: one partial column block, and two blocks of 1024 with an 8-column tail; on a GPU also
# DeepSeek-V3's hidden size and one with a tail (rows not 16-element aligned).
WIDTHS = [104, 1032] + ([7168, 7176] if DEVICE == "cuda" else [])
DOT_REL = 2.0 ** -18


@pytest.fixture(autouse=True)
def _interpret(monkeypatch) -> None:
    interpret_without_cuda(monkeypatch)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def routed_rows(num_topk: int, seed: int) -> tuple[ExpertLayout, torch.Tensor]:
    """The expert-major layout (with padding rows) of received rows as a dispatch delivers them: each
    row's local experts distinct, about a third of the slots -1, `EMPTY_ROWS` all -1; and float32
    weights, nonzero also where the slot is -1 (the kernels must ignore them there)."""
    g = generator(seed)
    idx = torch.rand(NUM_ROWS, NUM_LOCAL, generator=g).argsort(1)[:, :num_topk]
    idx = idx.masked_fill(torch.rand(idx.shape, generator=g) < 0.3, -1)
    idx[EMPTY_ROWS] = -1
    layout = expert_major_layout(idx, NUM_LOCAL, ALIGNMENT)
    assert (layout.src_row < 0).any()
    return layout, torch.rand(idx.shape, generator=g)


def randn(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=generator(seed)).to(dtype)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype`'s values at |x| (float32 x; at least that of its normal numbers)."""
    info = torch.finfo(dtype)
    exponent = torch.frexp(x.abs().clamp(min=info.tiny)).exponent  # |x| = m * 2**e, m in [0.5, 1)
    return torch.ldexp(torch.full_like(x, info.eps / 2), exponent)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    assert got.shape == want.shape
    excess = (got.cpu().double() - want.double()).abs() - bound.double()
    assert (excess <= 0).all(), f"off by up to {excess.max().item():.3g} beyond the bound"


def on_device(*tensors: Optional[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    return [None if t is None else t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("num_topk", [1, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weighted_selection_sum_is_the_torch_sum(dtype: torch.dtype, num_topk: int, weighted: bool,
                                                 width: int) -> None:
    layout, weights = routed_rows(num_topk, seed=num_topk)
    y = randn(layout.src_row.numel(), width, dtype, seed=width)
    w = weights if weighted else None
    got = kernels.weighted_selection_sum(*on_device(y, layout.dest_row, w))
    want = dispatcher._sum_selections_torch(y, layout.dest_row, w)  # float32
    magnitude = dispatcher._sum_selections_torch(y.abs(), layout.dest_row, None if w is None else w.abs())
    assert got.dtype == dtype
    assert_within(got, want, ulp(want, dtype) + num_topk * 2.0 ** -23 * magnitude)
    assert (got[EMPTY_ROWS] == 0).all()


@pytest.mark.parametrize("wanted", [(True, True), (True, False), (False, True)], ids=["both", "grad_y", "dots"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unpermute_backward_is_the_torch_backward(dtype: torch.dtype, wanted: tuple[bool, bool]) -> None:
    with_grad_y, with_dots = wanted
    layout, _ = routed_rows(8, seed=2)
    num_layout, width = layout.src_row.numel(), WIDTHS[-1]
    grad, y = randn(NUM_ROWS, width, dtype, seed=3), randn(num_layout, width, dtype, seed=4)
    row_weight = torch.rand(num_layout, generator=generator(5)) if with_grad_y else None  # also on padding rows
    got_y, got_dots = kernels.unpermute_backward(*on_device(grad, y, layout.src_row, row_weight), with_dots)
    want_y, want_dots = dispatcher._unpermute_backward_torch(grad, y, layout.src_row, row_weight, with_dots)
    padding = layout.src_row < 0
    if with_grad_y:
        assert got_y.dtype == dtype
        assert_within(got_y, want_y, ulp(want_y.float(), dtype))
        assert (got_y[padding.to(got_y.device)] == 0).all()
    else:
        assert got_y is None
    if with_dots:
        _, magnitude = dispatcher._unpermute_backward_torch(grad.abs(), y.abs(), layout.src_row, None, True)
        assert got_dots.dtype == torch.float32
        assert_within(got_dots, want_dots, DOT_REL * magnitude)
        assert (got_dots[padding.to(got_dots.device)] == 0).all()
    else:
        assert got_dots is None


def test_kernels_read_strided_rows() -> None:
    layout, weights = routed_rows(8, seed=6)
    width = WIDTHS[0]
    y = randn(layout.src_row.numel(), 2 * width, torch.bfloat16, seed=7)[:, ::2]
    grad = randn(NUM_ROWS, width + 8, torch.bfloat16, seed=8)[:, 8:]
    got = kernels.weighted_selection_sum(*on_device(y, layout.dest_row, weights))
    want = dispatcher._sum_selections_torch(y, layout.dest_row, weights)
    magnitude = dispatcher._sum_selections_torch(y.abs(), layout.dest_row, weights)
    assert_within(got, want, ulp(want, torch.bfloat16) + 8 * 2.0 ** -23 * magnitude)
    _, got_dots = kernels.unpermute_backward(*on_device(grad, y, layout.src_row), None, True)
    _, want_dots = dispatcher._unpermute_backward_torch(grad, y, layout.src_row, None, True)
    _, magnitude = dispatcher._unpermute_backward_torch(grad.abs(), y.abs(), layout.src_row, None, True)
    assert_within(got_dots, want_dots, DOT_REL * magnitude)


def spy_on_kernels(calls: list[str]) -> SimpleNamespace:
    """The kernels, recording the names of those called in `calls`."""
    def spy(name: str) -> Callable:
        def call(*args: object) -> object:
            calls.append(name)
            return getattr(kernels, name)(*args)
        return call
    return SimpleNamespace(weighted_selection_sum=spy("weighted_selection_sum"),
                           unpermute_backward=spy("unpermute_backward"))


def permute_round_trip(x: torch.Tensor, weights: torch.Tensor, layout: ExpertLayout,
                       grad: torch.Tensor) -> list[torch.Tensor]:
    """`_Permute`, stand-in experts, `_Unpermute`, then backward: `[out, x.grad, weights.grad]`."""
    x, weights = (t.to(DEVICE).requires_grad_() for t in (x, weights))
    layout = ExpertLayout(*on_device(*layout))
    tokens = dispatcher._Permute.apply(x, layout.src_row, layout.dest_row, False)
    out = dispatcher._Unpermute.apply(tokens * 1.5, weights, layout)
    out.backward(grad.to(DEVICE))
    return [out.detach(), x.grad, weights.grad]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dispatcher_runs_the_kernels_in_both_permutations(monkeypatch, dtype: torch.dtype) -> None:
    layout, weights = routed_rows(8, seed=9)
    x, grad = randn(NUM_ROWS, WIDTHS[0], dtype, seed=10), randn(NUM_ROWS, WIDTHS[0], dtype, seed=11)
    calls: list[str] = []
    fused = spy_on_kernels(calls)
    monkeypatch.setattr(dispatcher, "_triton_kernels", lambda *tensors: fused)
    got = permute_round_trip(x, weights, layout, grad)
    assert sorted(calls) == ["unpermute_backward", "weighted_selection_sum", "weighted_selection_sum"]
    monkeypatch.setattr(dispatcher, "_triton_kernels", lambda *tensors: None)
    want = permute_round_trip(x, weights, layout, grad)
    # End to end, the kernels' differences (see the module docstring) add up over a few roundings:
    # within 4 units in the last place at the scale of the largest result.
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        assert_within(g, w.cpu(), 4 * torch.finfo(g.dtype).eps * w.abs().max().cpu().float().expand_as(w))


def test_dispatcher_picks_the_kernels_on_cuda_for_their_dtypes() -> None:
    rows = torch.zeros(2, 8, dtype=torch.bfloat16)
    assert dispatcher._triton_kernels(rows) is None
    if DEVICE == "cuda":
        assert dispatcher._triton_kernels(rows.cuda(), rows.float().cuda()) is kernels
        assert dispatcher._triton_kernels(rows.cuda(), rows.double().cuda()) is None


def test_kernels_reject_bad_input() -> None:
    layout, weights = routed_rows(8, seed=12)
    y = torch.zeros(layout.src_row.numel(), 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="y"):
        kernels.weighted_selection_sum(y, *on_device(layout.dest_row, weights))
    with pytest.raises(ValueError, match="weights"):
        kernels.weighted_selection_sum(y.float(), *on_device(layout.dest_row, weights[:1]))
    with pytest.raises(ValueError, match="src_row"):
        kernels.unpermute_backward(y.float()[:NUM_ROWS], y.float(), *on_device(layout.src_row[1:]), None, True)
