"""LogFMT-10: the wire format of a low-latency combine with `use_logfmt=True` (docs/semantics.md).

A BF16 row of `H` channels (H a multiple of 128, at most `MAX_HIDDEN`) travels as 128-channel blocks.
Integer arithmetic on the BF16 bits only, so that the CUDA kernels (csrc/low_latency/kernels/logfmt.cuh)
produce the same bytes and values on any device:

* A value's magnitude `a` is its bits without the sign (15 bits): `a / 128 - 127` is a piecewise-linear
  log2 of `|x|`, so `a` is a log scale in steps of 1/128 binade.
* A block whose magnitudes are all below that of 1.0 (`SMALL`) is **encoded**: with `hi` its largest
  magnitude and `lo` its smallest non-zero one, raised to `hi - RANGE` if lower (a range of at most
  2^32), each value keeps its sign and a 9-bit code: 0 for zero and for magnitudes below `lo` (flushed
  to zero), else `1 + round_half_up((a - lo) * STEPS / (hi - lo))` (1 when `hi == lo`). It decodes to
  magnitude `lo + round_half_up((code - 1) * (hi - lo) / STEPS)`. Other blocks (some `|x| >= 1`, or an
  infinity or NaN) stay BF16, bit for bit.
* A row is `G = H / 128` header words (little-endian uint32, zero-padded to a multiple of 16 bytes),
  then the blocks in order: an encoded block is `ENCODED_BYTES`, where bytes `[10 l, 10 l + 10)` hold
  values `8 l .. 8 l + 7` as an 80-bit little-endian integer with value `8 l + j` at bits
  `[10 j, 10 j + 10)` as `sign << 9 | code`; a BF16 block is its 256 bytes. Header word `g` is
  `1 << 31 | hi << 16 | lo` for an encoded block, 0 for a BF16 one.
* A row in which that layout would take more bytes than BF16 (`96 * encoded blocks < header bytes`)
  travels as its plain BF16 bytes instead (its values unchanged).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 128
"""Channels per block: one header word, encoded or kept BF16 as a whole (`kLogfmtBlock`)."""
SMALL = 0x3F80
"""A block is encoded when every magnitude is below this, the BF16 bits of 1.0 (`kLogfmtSmall`)."""
RANGE = 4096
"""The widest range an encoded block spans, in magnitude steps: 32 binades (`kLogfmtRange`)."""
STEPS = 510
"""Codes 1 .. STEPS + 1 divide `[lo, hi]` into this many steps (`kLogfmtSteps`)."""
ENCODED_BYTES = 160
"""Bytes of an encoded block: 128 values of 10 bits (`kLogfmtEncodedBytes`)."""
MAX_HIDDEN = 8192
"""The largest hidden size LogFMT supports (`kLogfmtMaxHidden`)."""

_RAW_BYTES = 2 * BLOCK
_CHUNKS = 16  # 10-byte chunks of an encoded block, 8 values each


class EncodedRows(NamedTuple):
    """Rows in LogFMT-10: each wire row holds `nbytes` meaningful bytes (zeros after them)."""

    wire: torch.Tensor  # [N, 2H] uint8
    compact: torch.Tensor  # [N] bool: the LogFMT layout (else the plain BF16 bytes)
    nbytes: torch.Tensor  # [N] int64


def header_bytes(hidden: int) -> int:
    """Bytes of a row's header words, padded to a multiple of 16."""
    return (4 * (hidden // BLOCK) + 15) // 16 * 16


def check_hidden(name: str, hidden: int) -> None:
    """Raise `ValueError` naming `name` unless LogFMT supports rows of `hidden` channels."""
    if hidden <= 0 or hidden % BLOCK != 0 or hidden > MAX_HIDDEN:
        raise ValueError(f"{name}: LogFMT needs a hidden size that is a multiple of {BLOCK} up to {MAX_HIDDEN}, "
                         f"got {hidden}")


def _block_headers(magnitudes: torch.Tensor) -> torch.Tensor:
    """`[N, G]` int64 header words of `[N, G, 128]` magnitudes."""
    hi = magnitudes.amax(-1)
    smallest = torch.where(magnitudes > 0, magnitudes, SMALL).amin(-1)
    lo = torch.where(hi > 0, torch.maximum(smallest, hi - RANGE), 0)
    return torch.where(hi < SMALL, (1 << 31) | (hi << 16) | lo, 0)


def _header_fields(headers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(encoded, lo, span) of `[N, G]` header words, each `[N, G, 1]`."""
    return ((headers >> 31) & 1).bool()[..., None], (headers & 0x7FFF)[..., None], \
        (((headers >> 16) & 0x7FFF) - (headers & 0x7FFF))[..., None]


def _payload_offsets(encoded: torch.Tensor, hidden: int) -> torch.Tensor:
    """`[N, G]` byte offset of each block in its row (after the header words)."""
    sizes = torch.where(encoded, ENCODED_BYTES, _RAW_BYTES)
    return header_bytes(hidden) + sizes.cumsum(-1) - sizes


def encode(rows: torch.Tensor) -> EncodedRows:
    """The LogFMT-10 wire rows of BF16 `rows [N, H]` (see the module docstring)."""
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.bfloat16 or rows.dim() != 2:
        raise TypeError("rows: expected a [N, H] torch.bfloat16 tensor")
    num_rows, hidden = rows.shape
    check_hidden("rows", hidden)
    groups, device = hidden // BLOCK, rows.device
    bits = rows.contiguous().view(torch.int16).long() & 0xFFFF
    magnitudes, signs = (bits & 0x7FFF).view(num_rows, groups, BLOCK), (bits >> 15).view(num_rows, groups, BLOCK)
    headers = _block_headers(magnitudes)
    encoded, lo, span = _header_fields(headers)
    scaled = ((magnitudes - lo) * (2 * STEPS) + span) // (2 * span).clamp(min=1)
    codes = torch.where((magnitudes == 0) | (magnitudes < lo), 0, 1 + torch.where(span > 0, scaled, 0))
    fields = (signs << 9) | codes  # [N, G, 128], 10 bits each
    # Value 8 l + j at bits [10 j, 10 j + 10) of chunk l; bytes little-endian.
    chunk_bits = (fields.view(num_rows, groups, _CHUNKS, 8, 1) >> torch.arange(10, device=device)) & 1
    packed = (chunk_bits.view(num_rows, groups, _CHUNKS, 10, 8) << torch.arange(8, device=device)).sum(-1)
    payload = torch.zeros(num_rows, groups, _RAW_BYTES, dtype=torch.uint8, device=device)
    payload[..., :ENCODED_BYTES] = packed.view(num_rows, groups, ENCODED_BYTES).to(torch.uint8)
    raw = rows.contiguous().view(torch.uint8).view(num_rows, groups, _RAW_BYTES)
    payload = torch.where(encoded, payload, raw)

    encoded = encoded[..., 0]
    compact = 96 * encoded.sum(-1) >= header_bytes(hidden)
    wire = torch.zeros(num_rows, 2 * hidden, dtype=torch.uint8, device=device)
    header_words = (headers[..., None] >> torch.arange(0, 32, 8, device=device)) & 0xFF
    wire[:, :4 * groups] = header_words.view(num_rows, 4 * groups).to(torch.uint8)
    offsets = _payload_offsets(encoded, hidden)
    sizes = torch.where(encoded, ENCODED_BYTES, _RAW_BYTES)
    position = offsets[..., None] + torch.arange(_RAW_BYTES, device=device)
    within = (torch.arange(_RAW_BYTES, device=device) < sizes[..., None]) & compact[:, None, None]
    row = torch.arange(num_rows, device=device)[:, None, None].expand_as(position)
    wire[row[within], position[within]] = payload[within]
    wire = torch.where(compact[:, None], wire, rows.contiguous().view(torch.uint8))
    nbytes = torch.where(compact, header_bytes(hidden) + sizes.sum(-1), 2 * hidden)
    return EncodedRows(wire, compact, nbytes)


def decode(wire: torch.Tensor, compact: torch.Tensor, hidden: int) -> torch.Tensor:
    """BF16 `[N, hidden]` rows from their LogFMT-10 wire rows `[N, >= 2 hidden]` uint8 and formats."""
    check_hidden("hidden", hidden)
    num_rows, groups, device = wire.size(0), hidden // BLOCK, wire.device
    wire = wire[:, :2 * hidden].contiguous()
    headers = wire[:, :4 * groups].view(num_rows, groups, 4).long()
    headers = (headers << torch.arange(0, 32, 8, device=device)).sum(-1)
    encoded, lo, span = _header_fields(headers)
    offsets = _payload_offsets(encoded[..., 0], hidden)
    position = (offsets[..., None] + torch.arange(_RAW_BYTES, device=device)).clamp(max=2 * hidden - 1)
    payload = wire.gather(1, position.view(num_rows, groups * _RAW_BYTES)).view(num_rows, groups, _RAW_BYTES)

    chunks = payload[..., :ENCODED_BYTES].long().view(num_rows, groups, _CHUNKS, 10, 1)
    chunk_bits = ((chunks >> torch.arange(8, device=device)) & 1).view(num_rows, groups, _CHUNKS, 8, 10)
    fields = (chunk_bits << torch.arange(10, device=device)).sum(-1).view(num_rows, groups, BLOCK)
    codes, signs = fields & 0x1FF, fields >> 9
    magnitudes = torch.where(codes == 0, 0, lo + ((codes - 1) * 2 * span + STEPS) // (2 * STEPS))
    decoded = (signs << 15) | magnitudes
    raw = payload.view(torch.int16).long() & 0xFFFF  # the BF16 block's bits
    bits = torch.where(encoded, decoded, raw).view(num_rows, hidden)
    bits = torch.where(compact[:, None], bits, wire.view(torch.int16).long() & 0xFFFF)
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


def round_trip(rows: torch.Tensor) -> torch.Tensor:
    """What a receiver decodes of `rows [N, H]` bf16 sent in LogFMT-10."""
    encoded = encode(rows)
    return decode(encoded.wire, encoded.compact, rows.size(1))
