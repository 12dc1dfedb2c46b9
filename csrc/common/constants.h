// Numbers that more than one module uses, and that Python mirrors (moe_ep/ops/constants.py). Plain
// C++, no CUDA needed to parse it. Every constant keeps the form `constexpr int kName = <int>;` on a line
// of its own: a CPU test reads them with a regular expression and compares them with the mirror.
#pragma once

namespace moe_ep {

// Ranks of one NVLink group: the most the normal mode serves.
constexpr int kNumMaxNvlPeers = 8;

// Nodes of internode normal mode (its network leg's team, a rail, has one member per node).
constexpr int kNumMaxNodes = 32;

// Top-k slots per token.
constexpr int kNumMaxTopk = 32;

// Channels of one normal-mode launch (a block each).
constexpr int kNumMaxChannels = 64;

// Experts per rank in normal mode (the notify kernel exchanges a count per local expert).
constexpr int kNumMaxLocalExperts = 256;

// Normal-mode channels per pair of SMs: `Config.num_sms` SMs give num_sms / 2 * this channels, one block
// per channel. A dispatch block runs its channel's send pipeline and its receiver warps side by side (one
// pipeline's per-token chain of latencies cannot keep an SM busy); a combine block its channel's
// senders and reducers.
constexpr int kChannelsPerSmPair = 2;

// FP8 blockwise scaling: one scale per 128 channels of a token row, per 128 x 128 block of a weight; the
// FP8 GEMM's tile is one such block.
constexpr int kFp8Block = 128;

// The largest finite e4m3 value: FP8 scales are amax / 448.
constexpr int kFp8Max = 448;

// Buffer sizes and the regions inside buffers are multiples of this many bytes.
constexpr int kBufferAlignment = 128;

}  // namespace moe_ep
