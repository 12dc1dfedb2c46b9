"""Constants the Python side shares with the CUDA kernels: the one home of each value.

Each mirrors the `constexpr` named in its docstring, of csrc/common/constants.h unless another file
is named; tests/test_constants.py checks that they agree.
"""

NUM_MAX_TOPK = 32
"""Most top-k slots per token (`kNumMaxTopk`): the kernels size per-token metadata by it."""

FP8_BLOCK = 128
"""Channels per FP8 scale: 1x128 for tokens, 128x128 for weights (`kFp8Block`)."""

BUFFER_ALIGNMENT = 128
"""Bytes every region of the communication buffers is aligned to (`kBufferAlignment`)."""

CHANNELS_PER_SM_PAIR = 2
"""Channels (token ranges, one block each) per pair of SMs (`kChannelsPerSmPair`)."""

NUM_MAX_NVL_PEERS = 8
"""Ranks of one NVLink node, the most the intranode kernels serve (`kMaxRanks` of the intranode API)."""

ROW_ALIGNMENT_BYTES = 16
"""Rows move as 16-byte vectors: a token row's bytes must be a multiple of this (no C++ name: the
kernels' `int4` loads and stores)."""

NUM_MAX_NODES = 32
"""Nodes internode normal mode serves (`kNumMaxNodes`): the network leg's team has one member per node."""
