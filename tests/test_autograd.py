"""Gradients of the autograd ops against autograd on a dense single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep import ops
from moe_ep.ops import fp8
from reference import make_inputs

TOKENS = [13, 7, 0, 10]
HIDDEN = 128
TOPK = 3


def _scales(world: int, device: str = "cpu") -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Per-rank expert scale vectors, loss weights and biases, identical on every process."""
    gen = torch.Generator().manual_seed(5)
    per_rank_scale = torch.randn(world, HIDDEN, generator=gen, dtype=torch.float64)
    loss_weights = [torch.randn(TOKENS[r], HIDDEN, generator=gen, dtype=torch.float64) for r in range(world)]
    biases = [torch.randn(TOKENS[r], HIDDEN, generator=gen, dtype=torch.float64) for r in range(world)]
    return per_rank_scale.to(device), [w.to(device) for w in loss_weights], [b.to(device) for b in biases]


def _normal_grads(rank: int, world: int, use_fp8: bool, device: str = "cpu",
                  backend: str = "torch") -> tuple[torch.Tensor, ...]:
    num_experts = 4 * world
    dtype = torch.bfloat16 if use_fp8 else torch.float64
    mine = make_inputs(11, world, TOKENS[:world], HIDDEN, num_experts, TOPK, dtype=dtype)[rank].to(device)
    per_rank_scale, loss_weights, biases = _scales(world, device)
    nvl_bytes = moe_ep.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(HIDDEN * 8, world)
    buffer = moe_ep.Buffer(dist.group.WORLD, nvl_bytes, backend=backend)
    x = mine.x.clone().requires_grad_()
    w = mine.topk_weights.clone().requires_grad_()
    bias = biases[rank].to(dtype).requires_grad_()
    out = ops.dispatch(buffer, x, mine.topk_idx, w, num_experts, use_fp8=use_fp8, expert_alignment=4)
    if use_fp8:
        tokens = fp8.per_token_cast_back(out.recv_x, out.recv_x_scales) + out.grad_carrier
    else:
        tokens = out.recv_x
    y = tokens * per_rank_scale[rank].to(dtype) * out.recv_topk_weights.to(dtype).sum(1, keepdim=True)
    combined = ops.combine(buffer, y, out.handle, bias=bias)
    (combined.double() * loss_weights[rank]).sum().backward()
    return x.grad.double().cpu(), w.grad.double().cpu(), bias.grad.double().cpu()


def _dense_normal_grads(world: int, use_fp8: bool) -> list[tuple[torch.Tensor, ...]]:
    num_experts = 4 * world
    per_rank = num_experts // world
    dtype = torch.bfloat16 if use_fp8 else torch.float64
    inputs = make_inputs(11, world, TOKENS[:world], HIDDEN, num_experts, TOPK, dtype=dtype)
    per_rank_scale, loss_weights, biases = _scales(world)
    grads = []
    for src, inp in enumerate(inputs):
        x = inp.x.double().requires_grad_()
        w = inp.topk_weights.clone().requires_grad_()  # float32 leaf, like the ops' weights
        bias = biases[src].clone().requires_grad_()
        # FP8 is straight-through: values are dequantized, the gradient is the identity.
        seen = fp8.per_token_cast_back(*fp8.per_token_cast_to_fp8(inp.x), torch.float64) if use_fp8 else x
        seen = x + (seen - x).detach()
        out = bias.clone()
        owners = torch.where(inp.topk_idx >= 0, inp.topk_idx // per_rank, -1)
        for dst in range(world):
            local = owners == dst
            sent = local.any(1, keepdim=True)
            weight_sum = (w.double() * local).sum(1, keepdim=True)
            out = out + sent * seen * per_rank_scale[dst] * weight_sum
        (out * loss_weights[src]).sum().backward()
        grads.append((x.grad, w.grad.double(), bias.grad))
    return grads


def check_float64_grads(got: list, world: int) -> None:
    for (gx, gw, gb), (rx, rw, rb) in zip(got, _dense_normal_grads(world, False)):
        torch.testing.assert_close(gx, rx, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw, rw.double(), rtol=1e-6, atol=1e-6)  # float32 weights
        torch.testing.assert_close(gb, rb, rtol=0, atol=0)


def check_fp8_grads(got: list, world: int) -> None:
    for (gx, gw, _), (rx, rw, _) in zip(got, _dense_normal_grads(world, True)):
        # BF16 gradients through bf16 expert math: compare with bf16-level tolerance, relative to scale.
        assert (gx - rx).norm() <= 2e-2 * rx.norm()
        assert (gw - rw).norm() <= 2e-2 * rw.norm()


@pytest.mark.parametrize("world", [2, 3])
def test_normal_gradients_exact_in_float64(dist_pool, world: int) -> None:
    check_float64_grads(dist_pool(world).run(_normal_grads, False), world)


def test_fp8_dispatch_gradients_straight_through(dist_pool) -> None:
    check_fp8_grads(dist_pool(2).run(_normal_grads, True), 2)


MAX_TOKENS = 16


def _expert_scale(global_expert: int) -> float:
    return 1 + global_expert / 8


def _low_latency_grads(rank: int, world: int, device: str = "cpu",
                       backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    num_experts = 4 * world
    per_rank = num_experts // world
    mine = make_inputs(21, world, TOKENS[:world], HIDDEN, num_experts, TOPK)[rank].to(device)
    _, loss_weights, _ = _scales(world, device)
    hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, world, num_experts)
    buffer = moe_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, backend=backend)
    x = mine.x.clone().requires_grad_()
    w = mine.topk_weights.clone().requires_grad_()
    out = ops.low_latency_dispatch(buffer, x, mine.topk_idx, MAX_TOKENS, num_experts)
    scale = torch.tensor([_expert_scale(rank * per_rank + e) for e in range(per_rank)], dtype=torch.bfloat16,
                         device=device)
    y = out.recv_x * scale[:, None, None]
    combined = ops.low_latency_combine(buffer, y, mine.topk_idx, w, out.handle)
    (combined.double() * loss_weights[rank]).sum().backward()
    return x.grad.double().cpu(), w.grad.double().cpu()


def check_low_latency_grads(got: list, world: int) -> None:
    _, loss_weights, _ = _scales(world)
    inputs = make_inputs(21, world, TOKENS[:world], HIDDEN, 4 * world, TOPK)
    for rank, ((gx, gw), inp) in enumerate(zip(got, inputs)):
        x = inp.x.double().requires_grad_()
        w = inp.topk_weights.double().requires_grad_()
        valid = inp.topk_idx >= 0
        scale = torch.where(valid, 1 + inp.topk_idx.double() / 8, 0.0)
        out = ((w * scale).sum(1, keepdim=True)) * x
        (out * loss_weights[rank]).sum().backward()
        assert (gx - x.grad).norm() <= 2e-2 * x.grad.norm()
        assert (gw - w.grad).norm() <= 2e-2 * w.grad.norm()
        assert (gw[~valid] == 0).all()


def test_low_latency_gradients(dist_pool) -> None:
    check_low_latency_grads(dist_pool(3).run(_low_latency_grads), 3)
