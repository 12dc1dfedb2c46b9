"""The fused Triton FP8 casts are bit for bit the reference casts of `moe_ep.ops.fp8`.

Compiled on a GPU, in Triton's interpreter elsewhere (see `triton_kernels`). Skipped without Triton.
"""

from __future__ import annotations

import pytest
import torch

from moe_ep.ops import fp8
from triton_kernels import DEVICE, import_kernels, interpret_without_cuda

casts = import_kernels("moe_ep.kernels.fp8_casts")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch) -> None:
    interpret_without_cuda(monkeypatch)


def awkward_rows(num_rows: int, depth: int, seed: int) -> torch.Tensor:
    """Rows over twelve decades, with all-zero, below-floor, huge and exact-tie blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, depth, generator=g) * torch.logspace(-8, 4, num_rows)[:, None]
    x[0] = 0.0
    x[1, :fp8.BLOCK] = 1e-9
    x[2, 3] = -3e4
    # amax 448 makes the scale exactly 1: halfway values must round to the even neighbour, also
    # across a binade (15.5 -> 16) and among the subnormals (2**-10 -> 0, 3 * 2**-10 -> 2**-8).
    x[3, :8] = torch.tensor([448.0, 1.0625, 1.1875, -15.5, 2.0 ** -10, 3 * 2.0 ** -10, -(2.0 ** -10), 0.0])
    x[3, 8] = -0.0
    return x


def assert_same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == fp8.FP8_DTYPE and got.shape == want.shape
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_per_token_cast_is_bitwise_the_reference(dtype: torch.dtype) -> None:
    x = awkward_rows(77, 3 * fp8.BLOCK, seed=0).to(dtype)  # 77 rows: a partial row block
    q, scales = casts.per_token_cast_to_fp8(x.to(DEVICE))
    want_q, want_scales = fp8.per_token_cast_to_fp8(x)
    assert_same_fp8(q, want_q)
    assert scales.dtype == torch.float32 and torch.equal(scales.cpu(), want_scales)
    assert q[3, :9].float().tolist() == [448.0, 1.0, 1.25, -16.0, 0.0, 2.0 ** -8, 0.0, 0.0, 0.0]
    assert q[3, 6].view(torch.uint8) == q[3, 8].view(torch.uint8) == 0x80  # -0.0


def test_per_token_cast_of_strided_batched_rows() -> None:
    x = awkward_rows(2 * 5, 4 * fp8.BLOCK, seed=1).bfloat16().view(2, 5, -1)[..., fp8.BLOCK:]
    q, scales = casts.per_token_cast_to_fp8(x.to(DEVICE))
    want_q, want_scales = fp8.per_token_cast_to_fp8(x)
    assert_same_fp8(q, want_q)
    assert torch.equal(scales.cpu(), want_scales)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_token_cast_back_is_bitwise_the_reference(dtype: torch.dtype) -> None:
    x = awkward_rows(77, 3 * fp8.BLOCK, seed=3)
    q, scales = fp8.per_token_cast_to_fp8(x)
    # q = 1 times 1 + 2**-8 and 1 + 3 * 2**-8: halfway between bfloat16 values, to even (1 and 1 + 2**-6).
    q[4, :fp8.BLOCK], scales[4, 0], scales[5, 0], q[5, :fp8.BLOCK] = 1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1.0
    for rows, row_scales in ((q, scales), casts.per_token_cast_to_fp8(x.to(DEVICE))):  # row- and column-major scales
        got = casts.per_token_cast_back(rows.to(DEVICE), row_scales.to(DEVICE), dtype).cpu()
        assert got.dtype == dtype and torch.equal(got, fp8.per_token_cast_back(rows.cpu(), row_scales.cpu(), dtype))
        if rows is q and dtype == torch.bfloat16:
            assert got[4, 0] == 1.0 and got[5, 0] == 1 + 2 ** -6


def swiglu_operands(num_rows: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 `z = [gate, up]` rows `[num_rows, 2 * width]` (one all-zero row) and output gradients."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(num_rows, 2 * width, generator=g) * 3).bfloat16()
    z[1] = 0.0
    return z, torch.randn(num_rows, width, generator=g).bfloat16()


def test_swiglu_to_fp8_is_the_cast_of_the_float32_swiglu() -> None:
    z, _ = swiglu_operands(45, 2 * fp8.BLOCK, seed=4)
    q, scales = casts.swiglu_to_fp8(z.to(DEVICE))
    gate, up = z.float().chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up
    want_q, want_scales = fp8.per_token_cast_to_fp8(h)
    # The kernel's sigmoid may differ from torch's in the last float32 bit, which can move an amax
    # (so a scale) by an ulp and flip an e4m3 rounding: compare values within those rounding errors.
    torch.testing.assert_close(scales.cpu(), want_scales, rtol=2 ** -20, atol=0)
    got = fp8.per_token_cast_back(q.cpu(), scales.cpu(), torch.float32)
    bound = h.abs() * (2 ** -4 + 1e-6) + want_scales.repeat_interleave(fp8.BLOCK, -1) * 2 ** -9
    assert ((got - h).abs() <= bound).all()
    assert (q[1].cpu().float() == 0).all()


def test_swiglu_backward_to_fp8_is_the_gradient_and_its_exact_cast() -> None:
    z, grad = swiglu_operands(45, 2 * fp8.BLOCK, seed=5)
    grad_z, (q, scales) = casts.swiglu_backward_to_fp8(z.to(DEVICE), grad.to(DEVICE))
    leaf = z.float().requires_grad_()
    gate, up = leaf.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).backward(grad.float())
    assert grad_z.dtype == torch.bfloat16
    torch.testing.assert_close(grad_z.cpu().float(), leaf.grad, rtol=2 ** -7, atol=1e-6)
    want_q, want_scales = fp8.per_token_cast_to_fp8(grad_z.cpu())
    assert_same_fp8(q, want_q)
    assert torch.equal(scales.cpu(), want_scales)


def test_swiglu_kernels_reject_bad_input() -> None:
    z, grad = swiglu_operands(4, fp8.BLOCK, seed=6)
    with pytest.raises(ValueError, match="z"):
        casts.swiglu_to_fp8(z[:, :fp8.BLOCK].to(DEVICE))  # I = 64
    with pytest.raises(ValueError, match="grad"):
        casts.swiglu_backward_to_fp8(z.to(DEVICE), grad[:2].to(DEVICE))


@pytest.mark.parametrize("shape", [(3, 200, 300), (2, 256, 384), (128, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "transposed_view"])
def test_per_block_cast_and_transpose_are_bitwise_the_reference(shape: tuple[int, ...], dtype: torch.dtype,
                                                                strided: bool) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(shape, generator=g) * 0.02
    w[..., :fp8.BLOCK, :fp8.BLOCK] = 0.0  # an all-zero block takes the amax floor
    w[..., -1, -1] = 3e4  # a huge value in the last (possibly partial) block
    w = w.to(dtype)
    on_device = w.to(DEVICE)
    if strided:  # the same values read through a transposed view's strides
        on_device = on_device.transpose(-2, -1).contiguous().transpose(-2, -1)
    q, scales, q_t = casts.per_block_cast_to_fp8_with_transpose(on_device)
    want_q, want_scales = fp8.per_block_cast_to_fp8(w)
    assert_same_fp8(q, want_q)
    assert torch.equal(scales.cpu(), want_scales)
    assert q_t.is_contiguous()
    assert_same_fp8(q_t, want_q.transpose(-2, -1))


def test_casts_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="x"):
        casts.per_token_cast_to_fp8(torch.zeros(4, 200, device=DEVICE))
    with pytest.raises(TypeError, match="x"):
        casts.per_token_cast_to_fp8(torch.zeros(4, 128, dtype=torch.int32, device=DEVICE))
    q, scales = casts.per_token_cast_to_fp8(torch.ones(4, 256, device=DEVICE))
    with pytest.raises(ValueError, match="scales"):
        casts.per_token_cast_back(q, scales[:, :1])
    with pytest.raises(TypeError, match="dtype"):
        casts.per_token_cast_back(q, scales, torch.float16)
    with pytest.raises(ValueError, match="w"):
        casts.per_block_cast_to_fp8_with_transpose(torch.zeros(128, device=DEVICE))
    with pytest.raises(TypeError, match="w"):
        casts.per_block_cast_to_fp8_with_transpose(torch.zeros(128, 128, dtype=torch.float64, device=DEVICE))


@pytest.mark.parametrize("block_scales", [False, True], ids=["per_channel", "blocks"])
@pytest.mark.parametrize("fp8_input", [False, True], ids=["bf16_rows", "fp8_rows"])
def test_per_column_segments_cast_is_bitwise_the_reference(block_scales: bool, fp8_input: bool) -> None:
    """Skewed segments (one empty, one over two column blocks, one exactly 128) with junk rows
    between and after them; BF16 rows or 1x128 e4m3 rows with their scales."""
    x = awkward_rows(420, 2 * fp8.BLOCK, seed=8)[torch.randperm(420, generator=torch.Generator().manual_seed(8))]
    starts, counts = torch.tensor([0, 131, 131, 270, 300]), torch.tensor([131, 0, 128, 30, 101])
    x[259:270] = float("nan")  # rows of no segment
    x[401:] = float("nan")
    ends = fp8.padded_segment_ends(counts)
    if fp8_input:
        rows = fp8.per_token_cast_to_fp8(x)
        dense = fp8.per_token_cast_back(*rows, torch.float32)
        args = (rows[0].to(DEVICE), rows[1].to(DEVICE))
    else:
        dense = x.bfloat16()
        args = (dense.to(DEVICE), None)
    device_index = (starts.int().to(DEVICE), counts.int().to(DEVICE), ends.to(DEVICE))
    q, scales = casts.per_column_segments_cast_to_fp8(*args, *device_index, block_scales=block_scales)
    want_q, want_scales = fp8.per_column_segments_cast_to_fp8(dense, starts, counts, block_scales=block_scales)
    written = int(ends[-1])
    assert q.shape == want_q.shape and scales.shape == want_scales.shape
    assert_same_fp8(q[:, :written], want_q[:, :written])
    assert torch.equal(scales.cpu()[:, :written // fp8.BLOCK], want_scales[:, :written // fp8.BLOCK])
    if not block_scales:
        assert scales.stride(0) == 1  # rows adjacent, as the GEMM reads them
