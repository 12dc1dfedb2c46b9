"""GroupedMLP and SharedExpertMLP against dense per-expert references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_ep.kernels.grouped as grouped_module
from moe_ep.kernels.fp8_experts import ReferenceFP8
from moe_ep.layers import GroupedMLP, SharedExpertMLP
from moe_ep.ops import fp8

HIDDEN, INTER, NUM_EXPERTS = 256, 128, 4
COUNTS = [5, 0, 11, 7]  # expert 1 receives nothing
NUM_ROWS = sum(COUNTS) + 3  # three trailing rows that belong to no expert

# FP8 (e4m3, 1x128 / 128x128 scales) against exact float64, relative Frobenius error. One e4m3 cast
# is about 2.6% rms; the four casts of a SwiGLU MLP measure 5-7% on these shapes.
FP8_FORWARD_BOUND = 0.10
FP8_GRAD_BOUND = 0.12
BF16_BOUND = 0.01


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_experts(dtype: torch.dtype = torch.float64, use_fp8: bool = False, seed: int = 0) -> GroupedMLP:
    torch.manual_seed(seed)
    return GroupedMLP(NUM_EXPERTS, HIDDEN, INTER, use_fp8=use_fp8, dtype=dtype)


def clone_experts(module: GroupedMLP, dtype: torch.dtype, use_fp8: bool = False) -> GroupedMLP:
    other = GroupedMLP(NUM_EXPERTS, HIDDEN, INTER, use_fp8=use_fp8, dtype=dtype)
    other.load_state_dict({k: v.to(dtype) for k, v in module.state_dict().items()})
    return other


def tokens(num_rows: int = NUM_ROWS, seed: int = 1, junk: float = float("nan")) -> torch.Tensor:
    """Random rows; rows past the experts' total hold `junk` that must never reach any result."""
    x = torch.randn(num_rows, HIDDEN, generator=generator(seed), dtype=torch.float64)
    x[sum(COUNTS):] = junk
    return x


def routing_weights(num_rows: int = NUM_ROWS, seed: int = 2) -> torch.Tensor:
    return torch.rand(num_rows, generator=generator(seed))


def counts_tensor(counts=COUNTS) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int32)


def reference(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor,
              weights: torch.Tensor | None = None, cast_h=lambda h: h) -> torch.Tensor:
    """Dense float64 SwiGLU per expert over its contiguous rows (`cast_h` applied to the SwiGLU
    output); other rows stay 0."""
    out = torch.zeros(x.size(0), down.size(1), dtype=torch.float64)
    begin = 0
    for e, count in enumerate(counts):
        rows = x[begin:begin + count].double()
        gate = rows @ gate_up[e, :INTER].double().t()
        up = rows @ gate_up[e, INTER:].double().t()
        out[begin:begin + count] = cast_h(F.silu(gate) * up) @ down[e].double().t()
        begin += count
    if weights is not None:
        out = out * weights.double()[:, None]
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


def run_with_grads(module: GroupedMLP, x: torch.Tensor, upstream: torch.Tensor, **kwargs):
    """Forward + backward with `upstream` as the output gradient; returns (out, dx, dgate_up, ddown)."""
    x = x.detach().clone().requires_grad_()
    out = module(x, counts_tensor(), **kwargs)
    out.backward(upstream.to(out.dtype))
    return out, x.grad, module.gate_up_proj.grad, module.down_proj.grad


def reference_with_grads(module: GroupedMLP, x: torch.Tensor, upstream: torch.Tensor, weights=None):
    x = x.detach().double().clone().requires_grad_()
    gate_up = module.gate_up_proj.detach().double().requires_grad_()
    down = module.down_proj.detach().double().requires_grad_()
    out = reference(x, COUNTS, gate_up, down, weights)
    out.backward(upstream.double())
    return out, x.grad, gate_up.grad, down.grad


def test_float64_forward_backward_match_dense_reference() -> None:
    module = make_experts()
    x, weights = tokens(), routing_weights().double().requires_grad_()
    upstream = torch.randn(NUM_ROWS, HIDDEN, generator=generator(3), dtype=torch.float64)
    got = run_with_grads(module, x, upstream, routing_weights=weights)
    grad_weights = weights.grad
    weights_ref = weights.detach().clone().requires_grad_()
    want = reference_with_grads(module, x, upstream, weights_ref)
    for name, g, w in zip(("out", "dx", "dgate_up", "ddown"), got, want):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(grad_weights, weights_ref.grad, rtol=1e-10, atol=1e-12)
    assert got[0][sum(COUNTS):].abs().sum() == 0 and got[1][sum(COUNTS):].abs().sum() == 0
    assert got[2][1].abs().sum() == 0 and got[3][1].abs().sum() == 0, "an expert without tokens gets no gradient"


def test_hf_v5_weight_layout_gate_rows_first() -> None:
    """Expert e computes down_e(silu(gate_e x) * up_e x) with gate_up_proj[e] = cat(gate_e, up_e)."""
    g = generator(5)
    gate = torch.randn(NUM_EXPERTS, INTER, HIDDEN, generator=g, dtype=torch.float64) / 16
    up = torch.randn(NUM_EXPERTS, INTER, HIDDEN, generator=g, dtype=torch.float64) / 16
    down = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g, dtype=torch.float64) / 16
    module = make_experts()
    module.load_state_dict({"gate_up_proj": torch.cat([gate, up], dim=1), "down_proj": down})
    x = tokens(junk=0.0)
    out = module(x, counts_tensor())
    e, row = 2, 7  # a row of expert 2 (rows 5..15)
    hf_linear = F.linear(F.silu(F.linear(x[row], gate[e])) * F.linear(x[row], up[e]), down[e])
    torch.testing.assert_close(out[row], hf_linear)
    swapped = F.linear(F.silu(F.linear(x[row], up[e])) * F.linear(x[row], gate[e]), down[e])
    assert not torch.allclose(out[row], swapped)


def test_padding_rows_inside_an_expert_produce_zeros() -> None:
    module = make_experts()
    x = tokens()
    x[3:5] = 0.0  # alignment padding at the end of expert 0's segment
    out = module(x, counts_tensor())
    assert out[3:5].abs().sum() == 0 and out[:3].abs().sum() > 0


def test_no_tokens_at_all() -> None:
    module = make_experts()
    x = torch.full((6, HIDDEN), float("nan"), dtype=torch.float64, requires_grad=True)
    out = module(x, counts_tensor([0, 0, 0, 0]))
    out.sum().backward()
    assert out.abs().sum() == 0 and x.grad.abs().sum() == 0
    assert module.gate_up_proj.grad.abs().sum() == 0 and module.down_proj.grad.abs().sum() == 0


def test_packed_layout_ignores_rows_past_each_count() -> None:
    module = make_experts()
    slots = 12
    counts = [5, 0, 11, 7]
    packed = torch.full((NUM_EXPERTS, slots, HIDDEN), float("nan"), dtype=torch.float64)
    contiguous = tokens(junk=0.0)
    begin = 0
    for e, count in enumerate(counts):
        packed[e, :count] = contiguous[begin:begin + count]
        begin += count
    packed.requires_grad_()
    out = module(packed, counts_tensor(counts))
    assert out.shape == packed.shape
    want = module(contiguous, counts_tensor(counts))
    begin = 0
    for e, count in enumerate(counts):
        torch.testing.assert_close(out[e, :count], want[begin:begin + count])
        assert out[e, count:].abs().sum() == 0
        begin += count
    out.sum().backward()
    assert torch.isfinite(packed.grad).all() and torch.isfinite(module.gate_up_proj.grad).all()
    assert packed.grad[0, 5:].abs().sum() == 0


@pytest.mark.parametrize("num_rows", [NUM_ROWS, sum(COUNTS)], ids=["nan_tail", "no_tail"])
@pytest.mark.parametrize("host_counts", [False, True], ids=["device_counts", "host_counts"])
def test_grouped_mm_path_matches_reference(monkeypatch, num_rows: int, host_counts: bool) -> None:
    """The GPU path (one grouped GEMM per projection, device offsets), run through torch's CPU kernel.
    Host counts that cover every row let it skip the masks; NaN rows past the segments must still
    never reach a result."""
    module = make_experts()
    upstream = torch.randn(num_rows, HIDDEN, generator=generator(3), dtype=torch.float64)
    want = reference_with_grads(module, tokens(num_rows), upstream, routing_weights(num_rows))
    monkeypatch.setattr(grouped_module, "_uses_grouped_mm", lambda x, seg: x.dtype != torch.float64)
    got = run_with_grads(clone_experts(module, torch.float32), tokens(num_rows).float(), upstream,
                         routing_weights=routing_weights(num_rows),
                         tokens_per_expert_list=COUNTS if host_counts else None)
    for name, g, w in zip(("out", "dx", "dgate_up", "ddown"), got, want):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("num_rows, host_counts, expected", [
    (sum(COUNTS), True, True), (NUM_ROWS, True, False), (sum(COUNTS), False, False)])
def test_segments_know_when_no_row_is_ignored(num_rows: int, host_counts: bool, expected: bool) -> None:
    seg = grouped_module.ExpertSegments(counts_tensor(), num_rows,
                                        tokens_per_expert_list=COUNTS if host_counts else None)
    assert seg.all_rows_valid is expected
    rows = tokens(num_rows)
    masked = seg.mask(rows)
    assert (masked is rows) is expected
    assert torch.isfinite(masked).all()


def test_grouped_mm_path_fp8_matches_loop_path(monkeypatch) -> None:
    module = make_experts(torch.bfloat16, use_fp8=True)
    upstream = torch.randn(NUM_ROWS, HIDDEN, generator=generator(3), dtype=torch.float64)
    want = run_with_grads(module, tokens().bfloat16(), upstream)
    monkeypatch.setattr(grouped_module, "_uses_grouped_mm", lambda x, seg: x.dtype != torch.float64)
    got = run_with_grads(clone_experts(module, torch.bfloat16, use_fp8=True), tokens().bfloat16(), upstream)
    for name, g, w in zip(("out", "dx", "dgate_up", "ddown"), got, want):
        assert torch.isfinite(g).all(), name
        assert relative_error(g, w) < 5e-3, name


def test_bf16_close_to_float64() -> None:
    module = make_experts()
    upstream = torch.randn(NUM_ROWS, HIDDEN, generator=generator(3), dtype=torch.float64)
    got = run_with_grads(clone_experts(module, torch.bfloat16), tokens().bfloat16(), upstream)
    want = reference_with_grads(module, tokens(), upstream)
    assert got[0].dtype == torch.bfloat16
    for name, g, w in zip(("out", "dx", "dgate_up", "ddown"), got, want):
        assert relative_error(g, w) < BF16_BOUND, name


def emulated_fp8_reference(module: GroupedMLP, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The FP8 forward spelled out: dequantized operands, float64 products, BF16 at each GEMM output."""
    def gemm(rows_q, rows_s, weight):
        w_q, w_s = fp8.per_block_cast_to_fp8(weight.detach())
        dense_w = fp8.per_block_cast_back(w_q, w_s, torch.float64)
        dense_x = fp8.per_token_cast_back(rows_q, rows_s, torch.float64)
        out = torch.zeros(dense_x.size(0), weight.size(1), dtype=torch.float64)
        begin = 0
        for e, count in enumerate(COUNTS):
            out[begin:begin + count] = dense_x[begin:begin + count] @ dense_w[e].t()
            begin += count
        return out.bfloat16()

    z = gemm(*x, module.gate_up_proj)
    h = F.silu(z[:, :INTER]) * z[:, INTER:]
    return gemm(*fp8.per_token_cast_to_fp8(h), module.down_proj)


def test_fp8_forward_is_the_blockwise_emulation() -> None:
    module = make_experts(torch.bfloat16, use_fp8=True)
    x = tokens(junk=0.0).bfloat16()
    out = module(x, counts_tensor())
    want = emulated_fp8_reference(module, fp8.per_token_cast_to_fp8(x))
    assert out.dtype == torch.bfloat16
    # Both round to BF16 at the same points; only FP32 vs float64 accumulation differs.
    scale = want.float().abs().max()
    assert (out.float() - want.float()).abs().max() < 0.02 * scale
    assert relative_error(out, want) < 2e-3


def test_fp8_within_bound_of_exact_and_bf16() -> None:
    exact = make_experts()
    upstream = torch.randn(NUM_ROWS, HIDDEN, generator=generator(3), dtype=torch.float64)
    weights = routing_weights()
    got = run_with_grads(clone_experts(exact, torch.bfloat16, use_fp8=True), tokens().bfloat16(), upstream,
                         routing_weights=weights)
    bf16 = run_with_grads(clone_experts(exact, torch.bfloat16), tokens().bfloat16(), upstream,
                          routing_weights=weights)
    want = reference_with_grads(exact, tokens(), upstream, weights)
    assert got[0].dtype == torch.bfloat16
    for name, g, b, w in zip(("out", "dx", "dgate_up", "ddown"), got, bf16, want):
        assert torch.isfinite(g).all(), name
        bound = FP8_FORWARD_BOUND if name == "out" else FP8_GRAD_BOUND
        assert relative_error(g, w) < bound, name
        assert relative_error(g, b) < bound, name
        # FP8 really is coarser than BF16 (the FP8 path is not silently BF16).
        assert relative_error(g, w) > 2 * relative_error(b, w), name
    assert got[0][sum(COUNTS):].abs().sum() == 0 and got[1][sum(COUNTS):].abs().sum() == 0


def fp8_straight_through(t: torch.Tensor, cast, cast_back) -> torch.Tensor:
    """`t` with the value of its FP8 round trip and the gradient of the identity."""
    return t + (cast_back(*cast(t.detach()), torch.float64) - t).detach()


def test_fp8_backward_is_the_straight_through_gradient() -> None:
    """The documented backward: exact gradients of the FP8 forward with every cast as identity, so
    dW uses the dequantized activations and dx the dequantized weights."""
    module = make_experts(torch.bfloat16, use_fp8=True)
    upstream = torch.randn(NUM_ROWS, HIDDEN, generator=generator(3), dtype=torch.float64)
    x = tokens(junk=0.0).bfloat16()
    got = run_with_grads(module, x, upstream)

    tokens_8 = lambda t: fp8_straight_through(t, fp8.per_token_cast_to_fp8, fp8.per_token_cast_back)  # noqa: E731
    blocks_8 = lambda t: fp8_straight_through(t, fp8.per_block_cast_to_fp8, fp8.per_block_cast_back)  # noqa: E731
    x_ref = x.double().requires_grad_()
    gate_up = module.gate_up_proj.detach().double().requires_grad_()
    down = module.down_proj.detach().double().requires_grad_()
    out = reference(tokens_8(x_ref), COUNTS, blocks_8(gate_up), blocks_8(down), cast_h=tokens_8)
    out.backward(upstream)
    # The reference quantizes the float64 SwiGLU output, the module its BF16 one: up to ~1.6% apart
    # (the forward itself is checked exactly above); other gradient choices are over 5% off.
    for name, g, w in zip(("dx", "dgate_up", "ddown"), got[1:], (x_ref.grad, gate_up.grad, down.grad)):
        assert relative_error(g, w) < 0.025, name


def test_fp8_weight_grads_are_the_column_cast_products() -> None:
    """With `fp8_weight_grads` the forward and the input gradient are unchanged; each weight gradient
    is `grad.T @ x` of the operands cast along the tokens (`per_column_segments_cast_to_fp8`), and
    stays within the FP8 bound of the exact gradient."""
    exact = make_experts()
    upstream = torch.randn(NUM_ROWS, HIDDEN, generator=generator(3), dtype=torch.float64)
    x = tokens().bfloat16()
    bf16_grads = run_with_grads(clone_experts(exact, torch.bfloat16, use_fp8=True), x, upstream)
    module = clone_experts(exact, torch.bfloat16, use_fp8=True)
    module.fp8_weight_grads = True
    fp8_grads = run_with_grads(module, x, upstream)
    want = reference_with_grads(exact, tokens(), upstream)
    assert torch.equal(fp8_grads[0], bf16_grads[0]) and torch.equal(fp8_grads[1], bf16_grads[1])
    for name, g, b, w in zip(("dgate_up", "ddown"), fp8_grads[2:], bf16_grads[2:], want[2:]):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all(), name
        assert relative_error(g, w) < FP8_GRAD_BOUND, name
        assert relative_error(g, b) > 1e-3, name  # really computed differently
    assert (fp8_grads[2][1] == 0).all() and (fp8_grads[3][1] == 0).all()  # expert 1 has no tokens


def test_fp8_grouped_weight_grad_formula() -> None:
    counts = [5, 0, 11, 7]
    grad = torch.randn(NUM_ROWS, 2 * INTER, generator=generator(5)).bfloat16()
    x = fp8.per_token_cast_to_fp8(tokens(junk=0.0).bfloat16())
    seg = grouped_module.ExpertSegments(counts_tensor(counts), NUM_ROWS)
    got = ReferenceFP8().weight_grad(grad, x, seg)
    starts, lengths = torch.tensor([0, 5, 5, 16]), torch.tensor(counts)
    g_t = fp8.per_token_cast_back(*fp8.per_column_segments_cast_to_fp8(grad, starts, lengths, block_scales=False),
                                  torch.float64)
    x_t = fp8.per_block_cast_back(*fp8.per_column_segments_cast_to_fp8(
        fp8.per_token_cast_back(*x, torch.float32), starts, lengths, block_scales=True), torch.float64)
    assert got.shape == (NUM_EXPERTS, 2 * INTER, HIDDEN) and got.dtype == torch.bfloat16
    for e, column in enumerate([0, 128, 128, 256]):
        want = g_t[:, column:column + counts[e]] @ x_t[:, column:column + counts[e]].t()
        torch.testing.assert_close(got[e].double(), want, rtol=2 ** -8, atol=1e-6)


def test_fp8_weight_grads_in_the_packed_layout() -> None:
    module = make_experts(torch.bfloat16, use_fp8=True)
    module.fp8_weight_grads = True
    slots, counts = 16, [5, 0, 11, 7]
    x = torch.randn(NUM_EXPERTS, slots, HIDDEN, generator=generator(4)).bfloat16()
    q, scales = fp8.per_token_cast_to_fp8(x)
    for e, count in enumerate(counts):
        q[e, count:] = float("nan")
    module((q, scales), counts_tensor(counts)).float().sum().backward()
    dense = GroupedMLP(NUM_EXPERTS, HIDDEN, INTER, use_fp8=True, fp8_weight_grads=True, dtype=torch.bfloat16)
    dense.load_state_dict(module.state_dict())
    rows = torch.cat([q[e, :count] for e, count in enumerate(counts)]), torch.cat(
        [scales[e, :count] for e, count in enumerate(counts)])
    dense(rows, counts_tensor(counts)).float().sum().backward()
    # The same values; only the forward's CPU matmuls see other row counts (16 slots against the
    # counts), which some BLAS builds sum in another order.
    for packed_grad, dense_grad in ((module.gate_up_proj.grad, dense.gate_up_proj.grad),
                                    (module.down_proj.grad, dense.down_proj.grad)):
        assert torch.isfinite(packed_grad).all() and relative_error(packed_grad, dense_grad) < 1e-2
    assert module.down_proj.grad[2].abs().sum() > 0 and (module.down_proj.grad[1] == 0).all()


def test_fp8_weight_grads_need_fp8() -> None:
    with pytest.raises(ValueError, match="fp8_weight_grads"):
        GroupedMLP(NUM_EXPERTS, HIDDEN, INTER, fp8_weight_grads=True)


def zero_carrier(num_rows: int) -> torch.Tensor:
    return torch.zeros((), dtype=torch.bfloat16).expand(num_rows, HIDDEN).requires_grad_()


def test_fp8_prequantized_input_equals_quantize_inside() -> None:
    upstream = torch.randn(NUM_ROWS, HIDDEN, generator=generator(3)).bfloat16()
    x = tokens(junk=0.0).bfloat16()
    q, scales = fp8.per_token_cast_to_fp8(x)
    dense = fp8.per_token_cast_back(q, scales).requires_grad_()

    inside = make_experts(torch.bfloat16, use_fp8=True)
    out_inside = inside(dense, counts_tensor())
    out_inside.backward(upstream)

    outside = make_experts(torch.bfloat16, use_fp8=True)
    carrier = zero_carrier(NUM_ROWS)
    out_outside = outside((q, scales), counts_tensor(), carrier=carrier)
    out_outside.backward(upstream)

    # `dense` re-quantizes to exactly (q, scales), so both paths see the same FP8 tokens.
    assert torch.equal(out_inside, out_outside)
    assert carrier.grad.dtype == torch.bfloat16 and carrier.grad.shape == (NUM_ROWS, HIDDEN)
    assert torch.equal(carrier.grad, dense.grad)
    assert torch.equal(inside.gate_up_proj.grad, outside.gate_up_proj.grad)
    assert torch.equal(inside.down_proj.grad, outside.down_proj.grad)
    assert carrier.grad.abs().sum() > 0


def test_fp8_tokens_with_packed_ue8m0_scales() -> None:
    module = make_experts(torch.bfloat16, use_fp8=True)
    q, packed = fp8.per_token_cast_to_fp8(tokens(junk=0.0).bfloat16(), use_ue8m0=True)
    assert packed.dtype == torch.int32
    unpacked = fp8.unpack_ue8m0(packed)[:, :HIDDEN // fp8.BLOCK]
    out = module((q, packed), counts_tensor())
    assert torch.equal(out, module((q, unpacked), counts_tensor()))
    want = emulated_fp8_reference(module, (q, unpacked))
    assert relative_error(out, want) < 2e-3


def test_fp8_carrier_gradient_close_to_bf16_gradient() -> None:
    exact = make_experts()
    upstream = torch.randn(NUM_ROWS, HIDDEN, generator=generator(3), dtype=torch.float64)
    x = tokens(junk=0.0).bfloat16()
    carrier = zero_carrier(NUM_ROWS)
    out = clone_experts(exact, torch.bfloat16, use_fp8=True)(fp8.per_token_cast_to_fp8(x), counts_tensor(),
                                                               carrier=carrier)
    out.backward(upstream.bfloat16())
    bf16_dx = run_with_grads(clone_experts(exact, torch.bfloat16), x, upstream)[1]
    assert relative_error(carrier.grad, bf16_dx) < FP8_GRAD_BOUND


def test_fp8_tokens_into_bf16_experts_route_gradient_to_carrier() -> None:
    module = make_experts(torch.bfloat16)
    upstream = torch.randn(NUM_ROWS, HIDDEN, generator=generator(3)).bfloat16()
    q, scales = fp8.per_token_cast_to_fp8(tokens(junk=0.0).bfloat16())
    carrier = zero_carrier(NUM_ROWS)
    out = module((q, scales), counts_tensor(), carrier=carrier)
    out.backward(upstream)
    dense = fp8.per_token_cast_back(q, scales).requires_grad_()
    module.zero_grad()
    want = module(dense, counts_tensor())
    want.backward(upstream)
    assert torch.equal(out, want) and torch.equal(carrier.grad, dense.grad)


def test_fp8_packed_layout_with_garbage_rows() -> None:
    module = make_experts(torch.bfloat16, use_fp8=True)
    slots, counts = 16, [5, 0, 11, 7]
    x = torch.randn(NUM_EXPERTS, slots, HIDDEN, generator=generator(4)).bfloat16()
    q, scales = fp8.per_token_cast_to_fp8(x)
    for e, count in enumerate(counts):
        q[e, count:] = float("nan")  # unspecified rows (e4m3 NaN bytes)
    carrier = torch.zeros((), dtype=torch.bfloat16).expand(NUM_EXPERTS, slots, HIDDEN).requires_grad_()
    out = module((q, scales), counts_tensor(counts), routing_weights=torch.rand(NUM_EXPERTS, slots), carrier=carrier)
    out.float().sum().backward()
    assert out.shape == x.shape
    for grad in (out, carrier.grad, module.gate_up_proj.grad, module.down_proj.grad):
        assert torch.isfinite(grad.float()).all()
    for e, count in enumerate(counts):
        assert out[e, count:].abs().sum() == 0 and carrier.grad[e, count:].abs().sum() == 0
    assert out[2, :11].abs().sum() > 0


def test_fp8_weight_cache_follows_in_place_updates(monkeypatch) -> None:
    casts = []
    original_cast = ReferenceFP8.cast_weight
    monkeypatch.setattr(ReferenceFP8, "cast_weight", lambda self, w: casts.append(w) or original_cast(self, w))
    x = tokens(junk=0.0).bfloat16()
    uncached = make_experts(torch.bfloat16, use_fp8=True)
    uncached(x, counts_tensor())
    uncached(x, counts_tensor())
    assert len(casts) == 4

    casts.clear()
    module = make_experts(torch.bfloat16, use_fp8=True)
    module.cache_fp8_weights = True
    first = module(x, counts_tensor())
    assert torch.equal(module(x, counts_tensor()), first) and len(casts) == 2
    with torch.no_grad():
        module.down_proj.mul_(2)  # an optimizer-style in-place update
    second = module(x, counts_tensor())
    assert len(casts) == 4
    torch.testing.assert_close(second, 2 * first, rtol=0, atol=0)  # power-of-two scaling is exact in FP8


def test_input_validation_names_the_argument() -> None:
    module = make_experts()
    with pytest.raises(ValueError, match="tokens_per_expert"):
        module(tokens(), counts_tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="tokens_per_expert"):
        module(tokens(), counts_tensor().float())
    with pytest.raises(ValueError, match="tokens_per_expert"):
        module(tokens(), counts_tensor([100, 0, 0, 0]))
    with pytest.raises(TypeError, match="x"):
        module((tokens().bfloat16(), torch.ones(NUM_ROWS, 2)), counts_tensor())
    with pytest.raises(ValueError, match="use_fp8"):
        GroupedMLP(2, 192, 128, use_fp8=True)


@pytest.mark.parametrize("gated", [False, True])
def test_shared_expert(gated: bool) -> None:
    torch.manual_seed(0)
    module = SharedExpertMLP(HIDDEN, INTER, gate=gated, dtype=torch.float64)
    x = torch.randn(9, HIDDEN, generator=generator(6), dtype=torch.float64)
    g, u, d = module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight
    want = (F.silu(x @ g.t()) * (x @ u.t())) @ d.t()
    if gated:
        want = torch.sigmoid(x @ module.shared_expert_gate.weight.t()) * want
    torch.testing.assert_close(module(x), want)
    assert (module.shared_expert_gate is not None) == gated
