"""LogFMT-10 (`moe_ep.ops.logfmt`, the wire format of `low_latency_combine(use_logfmt=True)`): its bytes
against a value-by-value reference written from the format's definition, its error on realistic
activations, blocks of magnitude >= 1 kept exactly, the row fallback to BF16, the CUDA header's
constants, and the torch backend's combine against the written-out formula."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.ops import logfmt
from reference import low_latency_combine_reference, low_latency_reference, make_inputs, tokens_for

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "low_latency"
MIRRORED = {"BLOCK": ("api.cuh", "kLogfmtBlock"), "MAX_HIDDEN": ("api.cuh", "kLogfmtMaxHidden"),
            "SMALL": ("kernels/logfmt.cuh", "kLogfmtSmall"), "RANGE": ("kernels/logfmt.cuh", "kLogfmtRange"),
            "STEPS": ("kernels/logfmt.cuh", "kLogfmtSteps"),
            "ENCODED_BYTES": ("kernels/logfmt.cuh", "kLogfmtEncodedBytes")}


@pytest.mark.parametrize("python_name", sorted(MIRRORED))
def test_cuda_constants_match(python_name: str) -> None:
    path, cxx_name = MIRRORED[python_name]
    found = re.findall(rf"constexpr\s+int\s+{cxx_name}\s*=\s*(\d+)\s*;", (CSRC / path).read_text())
    assert [int(v) for v in found] == [getattr(logfmt, python_name)]


# ------------------------------------------------------------------ the format, value by value


def _reference_row(bits: list[int]) -> tuple[bytes, bool]:
    """One BF16 row (its 16-bit patterns) in LogFMT-10, written from the definition with Python ints."""
    groups = len(bits) // 128
    headers, blocks = [], []
    for g in range(groups):
        block = bits[128 * g:128 * (g + 1)]
        magnitudes = [b & 0x7FFF for b in block]
        hi = max(magnitudes)
        if hi >= 0x3F80:
            headers.append(0)
            blocks.append(b"".join(b.to_bytes(2, "little") for b in block))
            continue
        nonzero = [a for a in magnitudes if a > 0]
        lo = max(min(nonzero), hi - 4096) if nonzero else 0
        headers.append(1 << 31 | hi << 16 | lo)
        chunks = b""
        for lane in range(16):
            chunk = 0
            for j in range(8):
                value = block[8 * lane + j]
                a, sign = value & 0x7FFF, value >> 15
                if a == 0 or a < lo:
                    code = 0
                elif hi == lo:
                    code = 1
                else:
                    code = 1 + ((a - lo) * 1020 + (hi - lo)) // (2 * (hi - lo))
                chunk |= (sign << 9 | code) << (10 * j)
            chunks += chunk.to_bytes(10, "little")
        blocks.append(chunks)
    header = b"".join(h.to_bytes(4, "little") for h in headers)
    header += bytes(-len(header) % 16)
    encoded = sum(h >> 31 for h in headers)
    if 96 * encoded < len(header):
        return b"".join(b.to_bytes(2, "little") for b in bits), False
    return header + b"".join(blocks), True


def _reference_decode(wire: bytes, compact: bool, hidden: int) -> list[int]:
    if not compact:
        return [int.from_bytes(wire[2 * i:2 * i + 2], "little") for i in range(hidden)]
    groups = hidden // 128
    offset = -(-4 * groups // 16) * 16
    out = []
    for g in range(groups):
        header = int.from_bytes(wire[4 * g:4 * g + 4], "little")
        if header >> 31 == 0:
            out += [int.from_bytes(wire[offset + 2 * i:offset + 2 * i + 2], "little") for i in range(128)]
            offset += 256
            continue
        lo, span = header & 0x7FFF, ((header >> 16) & 0x7FFF) - (header & 0x7FFF)
        for lane in range(16):
            chunk = int.from_bytes(wire[offset + 10 * lane:offset + 10 * lane + 10], "little")
            for j in range(8):
                field = chunk >> (10 * j) & 0x3FF
                code = field & 0x1FF
                magnitude = 0 if code == 0 else lo + ((code - 1) * 2 * span + 510) // 1020
                out.append((field >> 9) << 15 | magnitude)
        offset += 160
    return out


def _rows(seed: int, num_rows: int, hidden: int) -> torch.Tensor:
    """Activations of several scales, with whole blocks of large values, zeros, tiny values, -0.0, inf
    and NaN mixed in, and one row that is mostly large (it travels as BF16)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_rows, hidden, generator=gen) * torch.logspace(-4, 0, num_rows)[:, None] * 0.3
    rows[0, 5:70] = 0
    rows[0, 70] = -0.0
    rows[1, :128] *= 40  # a block >= 1
    rows[1, hidden - 3] = 1e-30  # flushed: below 2^-32 of the block's largest
    rows[2] *= 500  # every block >= 1: the row travels as BF16
    rows[3, 7] = float("inf")
    rows[3, hidden - 20] = float("nan")
    return rows.to(torch.bfloat16)


@pytest.mark.parametrize("hidden", [128, 512, 1408, 7168])
def test_encode_and_decode_follow_the_definition(hidden: int) -> None:
    rows = _rows(hidden, 6, hidden)
    encoded = logfmt.encode(rows)
    decoded = logfmt.decode(encoded.wire, encoded.compact, hidden)
    for r in range(rows.size(0)):
        bits = (rows[r].view(torch.int16).long() & 0xFFFF).tolist()
        wire, compact = _reference_row(bits)
        assert bool(encoded.compact[r]) == compact and int(encoded.nbytes[r]) == len(wire)
        assert bytes(encoded.wire[r, :len(wire)].tolist()) == wire
        assert not encoded.wire[r, len(wire):].any()
        assert (decoded[r].view(torch.int16).long() & 0xFFFF).tolist() == _reference_decode(wire, compact, hidden)
    assert not bool(encoded.compact[2]) and bool(encoded.compact[0])
    assert torch.equal(logfmt.round_trip(rows).view(torch.int16), decoded.view(torch.int16))


def test_no_rows_round_trip() -> None:
    """A rank with no tokens encodes and decodes zero rows (the combine's receive calls it so)."""
    rows = torch.empty(0, 512, dtype=torch.bfloat16)
    encoded = logfmt.encode(rows)
    assert encoded.wire.size(0) == 0 and logfmt.round_trip(rows).shape == (0, 512)


def test_blocks_of_magnitude_one_and_more_pass_exactly() -> None:
    rows = _rows(7, 5, 1024)
    decoded = logfmt.round_trip(rows).view(torch.int16).view(5, 8, 128)
    blocks = rows.view(torch.int16).view(5, 8, 128)
    big = (rows.float().abs().view(5, 8, 128).nan_to_num(nan=float("inf")) >= 1).any(-1)
    assert big.sum() > 8  # rows 1 (one block), 2 (all), 3 (inf, NaN)
    assert torch.equal(decoded[big], blocks[big])
    assert not torch.equal(decoded[~big], blocks[~big])


def test_error_on_realistic_activations_is_fp8_class() -> None:
    """Expert-output-like rows (Gaussian, a few large channels): elementwise error below FP8 e4m3's
    (2^-4 of the value at most), and 0.64x the bytes of BF16 at hidden 7168."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(64, 7168, generator=gen) * 0.05
    rows[:, ::97] *= 4  # outlier channels, still below 1
    rows = rows.to(torch.bfloat16)
    encoded = logfmt.encode(rows)
    decoded = logfmt.decode(encoded.wire, encoded.compact, 7168).float()
    exact = rows.float()
    relative = ((decoded - exact).abs() / exact.abs()).nan_to_num(0)
    flushed = exact.abs() < exact.abs().amax(1, keepdim=True) * 2.0 ** -31
    assert relative[~flushed].max() < 2 ** -4
    assert (decoded - exact).norm() / exact.norm() < 1e-2
    assert encoded.compact.all()
    assert (encoded.nbytes.float() / (2 * 7168)).max() < 0.645


def test_checks_its_input() -> None:
    with pytest.raises(ValueError, match="multiple of 128 up to 8192"):
        logfmt.encode(torch.zeros(2, 200, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 128 up to 8192"):
        logfmt.encode(torch.zeros(2, 8320, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        logfmt.encode(torch.zeros(2, 128))


# ------------------------------------------------------------------ the combine with use_logfmt


def _expert_outputs(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Expert outputs of `rank` of realistic magnitudes (every rank can rebuild every rank's)."""
    gen = torch.Generator().manual_seed(17 * 1009 + rank)
    return (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)


def _logfmt_combine(rank: int, world: int, hidden: int) -> tuple[float, bool]:
    max_tokens, per_rank, topk = 24, 3, 6
    num_experts = per_rank * world
    inputs = make_inputs(13 + world, world, tokens_for((20, 9, 24, 14), world), hidden, num_experts, topk)
    mine = inputs[rank]
    hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, num_experts)
    buffer = moe_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, backend="torch")
    _, _, handle, _, _ = buffer.low_latency_dispatch(mine.x, mine.topk_idx, max_tokens, num_experts, use_fp8=False)
    shape = (per_rank, world * max_tokens, hidden)
    y = _expert_outputs(rank, shape)
    with pytest.raises(ValueError, match="use_logfmt: cannot be combined with zero_copy"):
        buffer.low_latency_combine(y, mine.topk_idx, mine.topk_weights, handle, use_logfmt=True, zero_copy=True)
    plain, _, _ = buffer.low_latency_combine(y, mine.topk_idx, mine.topk_weights, handle)
    combined, _, hook = buffer.low_latency_combine(y, mine.topk_idx, mine.topk_weights, handle, use_logfmt=True,
                                                   return_recv_hook=True)
    hook()

    packed = [low_latency_reference(inputs, r, num_experts).rows for r in range(world)]
    outputs = [_expert_outputs(r, shape) for r in range(world)]

    def expert_rows(t: int, j: int, e: int) -> torch.Tensor:
        r, local = divmod(e, per_rank)
        return outputs[r][local, packed[r][local].index((rank, t))]

    want = low_latency_combine_reference(inputs, rank, num_experts, expert_rows,
                                         transport=lambda partial: logfmt.round_trip(partial[None])[0])
    assert torch.equal(combined, want)
    error = float((combined.float() - plain.float()).norm() / plain.float().norm())
    return error, not torch.equal(combined, plain)


@pytest.mark.parametrize("world", [1, 3])
def test_torch_backend_combine_with_logfmt(dist_pool, world: int) -> None:
    outcomes = dist_pool(world).run(_logfmt_combine, 1024)
    assert all(error < 1e-2 for error, _ in outcomes)
    assert any(differs for _, differs in outcomes)  # LogFMT did change some values


def _logfmt_hidden_checked(rank: int, world: int) -> None:
    hidden, max_tokens, num_experts = 136, 8, 2 * world
    mine = make_inputs(1, world, [5] * world, hidden, num_experts, 2)[rank]
    hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, num_experts)
    buffer = moe_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, backend="torch")
    recv, _, handle, _, _ = buffer.low_latency_dispatch(mine.x, mine.topk_idx, max_tokens, num_experts, use_fp8=False)
    with pytest.raises(ValueError, match="use_logfmt: LogFMT needs a hidden size that is a multiple of 128"):
        buffer.low_latency_combine(recv, mine.topk_idx, mine.topk_weights, handle, use_logfmt=True)


def test_logfmt_refuses_other_hidden_sizes(dist_pool) -> None:
    dist_pool(2).run(_logfmt_hidden_checked)
