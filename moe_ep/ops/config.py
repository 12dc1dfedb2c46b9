"""Performance settings of the normal-mode kernels and the buffer sizes they imply."""

from __future__ import annotations

import functools
from dataclasses import KW_ONLY, dataclass

from .constants import (BUFFER_ALIGNMENT, CHANNELS_PER_SM_PAIR, FP8_BLOCK, NUM_MAX_NODES, NUM_MAX_NVL_PEERS,
                        NUM_MAX_TOPK, ROW_ALIGNMENT_BYTES)

# Per-token metadata carried next to the hidden bytes: source index, top-k ids and weights.
_TOKEN_META_BYTES = 4 + NUM_MAX_TOPK * (8 + 4)


def _align(num_bytes: int, alignment: int = BUFFER_ALIGNMENT) -> int:
    return (num_bytes + alignment - 1) // alignment * alignment


COMBINE_PATHS = ("auto", "staged", "rings")
STAGED_COMBINE_WORLDS = frozenset({2, 3, 4})
"""World sizes where `combine_path="auto"` picks the staged combine: measured faster than the rings
there with benchmarks/bench_intranode.py on H200s (5-8 ranks not measured, so they keep the rings)."""


@dataclass(frozen=True)
class Config:
    """Normal-mode tuning: SMs used and the chunk sizes of each channel's ring buffers.

    Positional order matches DeepEP's `Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)`.
    `num_sms` must be even (as in DeepEP); every pair of SMs serves `CHANNELS_PER_SM_PAIR` channels
    (contiguous token ranges), each with its own ring per rank pair.

    Keyword-only settings of the CUDA backend (the torch backend ignores them); every rank must pass
    the same values, or the kernels time out:
      * `pipeline_lag`: bulk stores a storer thread leaves in flight; 0 (default) = half the stages.
      * `combine_path`: how a combine returns the rows. "staged" through a staging area in each
        owner's NVLink buffer, which must hold every rank's returned rows (the rows it dispatched x
        (hidden + top-k weights) bytes, rounded to 128; the kernel takes the rings when they do not
        fit); "rings" through per-channel rings; "auto" (default) staged at the world sizes in
        `STAGED_COMBINE_WORLDS`, rings elsewhere.
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 128
    _: KW_ONLY
    pipeline_lag: int = 0
    combine_path: str = "auto"

    def __post_init__(self) -> None:
        if self.num_sms <= 0 or self.num_sms % 2 != 0:
            raise ValueError(f"num_sms: expected a positive even number, got {self.num_sms}")
        if not 0 < self.num_max_nvl_chunked_send_tokens < self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                "num_max_nvl_chunked_send_tokens: expected 0 < send chunk < num_max_nvl_chunked_recv_tokens, got "
                f"{self.num_max_nvl_chunked_send_tokens} and {self.num_max_nvl_chunked_recv_tokens}"
            )
        if not 0 < self.num_max_rdma_chunked_send_tokens <= self.num_max_rdma_chunked_recv_tokens:
            raise ValueError(
                "num_max_rdma_chunked_send_tokens: expected 0 < send chunk <= num_max_rdma_chunked_recv_tokens, got "
                f"{self.num_max_rdma_chunked_send_tokens} and {self.num_max_rdma_chunked_recv_tokens}"
            )
        if isinstance(self.pipeline_lag, bool) or not isinstance(self.pipeline_lag, int) or self.pipeline_lag < 0:
            raise ValueError(f"pipeline_lag: expected an integer >= 0 (0 = half the stages), got {self.pipeline_lag!r}")
        if self.combine_path not in COMBINE_PATHS:
            raise ValueError(f"combine_path: expected one of {', '.join(COMBINE_PATHS)}, got {self.combine_path!r}")

    def combines_staged(self, num_ranks: int) -> bool:
        """Whether a combine at `num_ranks` ranks returns the rows through the staging area (when they
        fit) rather than the rings, per `combine_path`."""
        if self.combine_path == "auto":
            return num_ranks in STAGED_COMBINE_WORLDS
        return self.combine_path == "staged"

    @property
    def num_channels(self) -> int:
        """Channels (contiguous token ranges) the work is split into: `CHANNELS_PER_SM_PAIR` per SM pair
        (the CUDA kernels run one block per channel)."""
        return self.num_sms // 2 * CHANNELS_PER_SM_PAIR

    def _token_bytes(self, hidden_bytes: int) -> int:
        # Hidden bytes, FP8 scales (one float per 128 hidden bytes at most) and metadata, in whole
        # 128-byte lines as the CUDA kernels' ring slots (`kSlotAlign`).
        return _align(_align(hidden_bytes, 16) + _align(hidden_bytes // FP8_BLOCK * 4, 16) + _TOKEN_META_BYTES)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer one rank needs: a receive ring per (channel, source rank) plus counters."""
        ring = self.num_max_nvl_chunked_recv_tokens * self._token_bytes(hidden_bytes)
        counters = num_ranks * (num_ranks + 2 * self.num_channels + 64) * 4
        return _align(self.num_channels * num_ranks * ring + counters)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, num_ranks_per_node: int = 8) -> int:
        """Bytes of symmetric (RDMA) buffer one rank needs in normal mode across nodes, zero in one node.

        `hidden_bytes` = hidden * max(element size, 2), as DeepEP asks (it bounds FP8 rows with their
        scales, and BF16 combine rows). Both legs' rings must fit (`internode_rdma_bytes`): the network
        leg has one member per node, the node leg one per local rank."""
        num_nodes = (num_ranks + num_ranks_per_node - 1) // num_ranks_per_node
        if num_nodes <= 1:
            return 0
        row_bytes = _align(self._token_bytes(hidden_bytes) + NUM_MAX_NVL_PEERS, ROW_ALIGNMENT_BYTES)
        return max(internode_rdma_bytes(self, team, row_bytes) for team in (num_nodes, num_ranks_per_node))


def internode_rdma_bytes(config: Config, team: int, row_bytes: int) -> int:
    """Symmetric buffer one internode exchange needs (the mirror of `make_layout` in
    csrc/internode/kernels/layout.cpp): handshake words per PE, then per (channel, member) a head counter,
    a flag per ring chunk, and a send and a receive ring of whole chunks, at least two."""
    channels = max(1, config.num_sms // 2)
    chunk = config.num_max_rdma_chunked_send_tokens
    chunks_per_ring = max(2, config.num_max_rdma_chunked_recv_tokens // chunk)
    rings = channels * team
    ring_bytes = _align(rings * chunks_per_ring * chunk * row_bytes)
    return (_align(8 * NUM_MAX_NODES * NUM_MAX_NVL_PEERS) + _align(8 * rings) + _align(8 * rings * chunks_per_ring)
            + 2 * ring_bytes)


@functools.cache  # a frozen Config, shared: calls without a config build none
def default_dispatch_config(num_ranks: int, num_sms: int) -> Config:
    """Dispatch settings for a world size, measured with benchmarks/bench_intranode.py on H200s.

    At 4 ranks and 24 SMs, ring tails published every 16 tokens took the FP8 dispatch kernel to
    311-321 us against 340 us every 8, with the BF16 one unchanged (573-574 against 569 us); whole
    calls over the full sweep agreed (FP8 492-496 against 521-546 us). At 8 ranks every 8 tokens was
    best at 20 and 24 SMs (BF16 + FP8 whole calls 2031-2067 us against 2144-2172 every 16 and
    2056-2188 every 4), so worlds above 4 publish every 8 (5-7 ranks not measured).
    """
    return Config(num_sms, 16 if num_ranks <= 4 else 8, 256, 8, 128)


@functools.cache  # a frozen Config, shared: calls without a config build none
def default_combine_config(num_ranks: int, num_sms: int) -> Config:
    """Combine settings for a world size, measured with benchmarks/bench_intranode.py on 4 x H200
    (whole calls): publishing every 4 rows was best (611-635 us at 20 SMs, 642-647 us at 24), 8-32
    rows slower (674-718 us and 735-768 us)."""
    return Config(num_sms, 4, 256, 8, 128)


def low_latency_buffer_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Symmetric buffer bytes for low-latency mode (the layout of `make_layout` in csrc/low_latency/):
    a u64 acknowledgement word and a u64 barrier signal per rank (`persistent_bytes`); two (even/odd) halves, each with a u64 count
    per (local expert, source rank), a u64 signal and a 2*hidden-byte row per (expert, token) slot, and
    the combine's metadata (a u64 flag and `NUM_MAX_TOPK` 8-byte (id, weight) entries per (source rank,
    token)); then one send region of as many rows as a half (the zero-copy combine buffer), the combine's
    row map (a u64 per (expert, token)) and its staging area (a row per (source rank, token), metadata
    per token). A dispatch row holds BF16 or FP8 data with its scales; combine rows are BF16."""
    max_tokens = num_max_dispatch_tokens_per_rank
    rows = num_experts * max_tokens
    tokens = num_ranks * max_tokens
    row_bytes = 2 * hidden
    meta_bytes = NUM_MAX_TOPK * 8
    half = (_align(8 * num_experts) + _align(8 * rows) + _align(rows * row_bytes) + _align(8 * tokens)
            + _align(tokens * meta_bytes))
    once = _align(rows * row_bytes) + _align(8 * rows) + _align(tokens * row_bytes) + _align(max_tokens * meta_bytes)
    return _align(16 * num_ranks) + 2 * half + once
