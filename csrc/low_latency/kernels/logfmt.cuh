// LogFMT-10, the wire format of a low-latency combine with use_logfmt: bit for bit the format of
// moe_ep/ops/logfmt.py, whose docstring defines it (integer arithmetic on BF16 bits only). A row's
// 128-channel blocks whose magnitudes are all below 1 travel as a sign and a 9-bit code each between
// the block's smallest and largest magnitude (10 bits a value, 160 bytes a block), the others as BF16;
// header words first. The constants mirror the Python module's (tests/test_logfmt.py compares them).
#pragma once

#include <cstdint>

#include "common/common.cuh"
#include "low_latency/api.cuh"

namespace moe_ep::kernels::ll {

namespace {  // local to each translation unit (csrc/README.md)

// kLogfmtBlock (channels per block) and kLogfmtMaxHidden are in api.cuh.
constexpr int kLogfmtSmall = 16256;        // 0x3f80, the BF16 bits of 1.0: blocks below it are encoded
constexpr int kLogfmtRange = 4096;         // widest range of an encoded block, in magnitude steps (2^32)
constexpr int kLogfmtSteps = 510;          // codes 1 .. 511 divide [lo, hi] into this many steps
constexpr int kLogfmtEncodedBytes = 160;   // an encoded block: 128 values of 10 bits
constexpr int kLogfmtMaxGroups = kLogfmtMaxHidden / kLogfmtBlock;  // header words a lane pair holds
constexpr int kLogfmtRawBytes = 2 * kLogfmtBlock;

MOE_EP_DEVICE int logfmt_header_bytes(int groups) { return (groups * 4 + 15) / 16 * 16; }

// The header word of the block whose 16-byte vectors lanes 16 h .. 16 h + 15 hold (`v`: 8 BF16 values),
// on every lane of that half-warp; every lane of the warp calls it.
MOE_EP_DEVICE uint32_t logfmt_block_header(const int4& v) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&v);
    int hi = 0, smallest = kLogfmtSmall;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int a = h[i] & 0x7fff;
        hi = max(hi, a);
        smallest = a > 0 ? min(smallest, a) : smallest;
    }
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) {
        hi = max(hi, __shfl_xor_sync(kFullMask, hi, offset));
        smallest = min(smallest, __shfl_xor_sync(kFullMask, smallest, offset));
    }
    if (hi >= kLogfmtSmall) return 0u;
    const int lo = hi > 0 ? max(smallest, hi - kLogfmtRange) : 0;
    return 0x80000000u | (static_cast<uint32_t>(hi) << 16) | static_cast<uint32_t>(lo);
}

// The 10-bit fields (sign << 9 | code) of 8 BF16 values, as an 80-bit little-endian integer (value j
// at bits [10 j, 10 j + 10)): `low` bits 0-63, `high` bits 64-79.
MOE_EP_DEVICE void logfmt_encode_chunk(const int4& v, uint32_t header, uint64_t& low, uint32_t& high) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&v);
    const uint32_t lo = header & 0x7fffu, span = ((header >> 16) & 0x7fffu) - lo;
    low = 0;
    high = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const uint32_t a = h[j] & 0x7fffu;
        uint32_t code = 0;
        if (a != 0 && a >= lo) code = 1 + (span > 0 ? ((a - lo) * (2 * kLogfmtSteps) + span) / (2 * span) : 0);
        const uint64_t field = (static_cast<uint32_t>(h[j] >> 15) << 9) | code;
        if (j < 6) {
            low |= field << (10 * j);
        } else if (j == 6) {
            low |= field << 60;  // its low 4 bits
            high |= static_cast<uint32_t>(field >> 4);
        } else {
            high |= static_cast<uint32_t>(field) << 6;
        }
    }
}

// 8 BF16 values from their 10-byte chunk (2-byte aligned) of a block with header `header`.
MOE_EP_DEVICE int4 logfmt_decode_chunk(const uint8_t* chunk, uint32_t header) {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(chunk);
    const uint64_t low = static_cast<uint64_t>(w[0]) | (static_cast<uint64_t>(w[1]) << 16) |
                         (static_cast<uint64_t>(w[2]) << 32) | (static_cast<uint64_t>(w[3]) << 48);
    const uint32_t high = w[4];
    const uint32_t lo = header & 0x7fffu, span = ((header >> 16) & 0x7fffu) - lo;
    uint32_t out[4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        uint32_t field;
        if (j < 6) field = static_cast<uint32_t>(low >> (10 * j)) & 0x3ffu;
        else if (j == 6) field = (static_cast<uint32_t>(low >> 60) | (high << 4)) & 0x3ffu;
        else field = (high >> 6) & 0x3ffu;
        const uint32_t code = field & 0x1ffu;
        const uint32_t magnitude = code == 0 ? 0u : lo + ((code - 1) * 2 * span + kLogfmtSteps) / (2 * kLogfmtSteps);
        const uint32_t bits = ((field >> 9) << 15) | magnitude;
        if (j % 2 == 0) out[j / 2] = bits;
        else out[j / 2] |= bits << 16;
    }
    return make_int4(static_cast<int>(out[0]), static_cast<int>(out[1]), static_cast<int>(out[2]),
                     static_cast<int>(out[3]));
}

// Encodes the BF16 row `src` (hidden channels, a multiple of 128 up to kLogfmtMaxHidden) into `dst` with
// the whole warp. Returns the bytes of the LogFMT row, or 0 when the row travels as its BF16 bytes
// (then `dst` holds nothing meaningful). A half-warp handles a block: lane 16 h + s its vector s.
MOE_EP_DEVICE int logfmt_encode_row(const int4* src, uint8_t* dst, int hidden, int lane) {
    const int groups = hidden / kLogfmtBlock, half = lane >> 4, sub = lane & 15;
    // Lane b % 32 keeps block b's header: in `first` for b < 32, else in `second`.
    uint32_t first = 0u, second = 0u;
    for (int b0 = 0; b0 < groups; b0 += 2) {
        const int b = b0 + half;
        const int4 v = b < groups ? src[b * 16 + sub] : make_int4(0, 0, 0, 0);
        const uint32_t header = logfmt_block_header(v);
        const uint32_t even = __shfl_sync(kFullMask, header, 0), odd = __shfl_sync(kFullMask, header, 16);
        uint32_t& kept = b0 < 32 ? first : second;  // b0 is even: b0 and b0 + 1 share the register
        if (lane == b0 % 32) kept = even;
        if (b0 + 1 < groups && lane == (b0 + 1) % 32) kept = odd;
    }
    const uint32_t encoded_first = __ballot_sync(kFullMask, first >> 31);
    const uint32_t encoded_second = __ballot_sync(kFullMask, second >> 31);
    const int num_encoded = __popc(encoded_first) + __popc(encoded_second);
    const int header_bytes = logfmt_header_bytes(groups);
    if (96 * num_encoded < header_bytes) return 0;
    uint32_t* words = reinterpret_cast<uint32_t*>(dst);
    if (lane < header_bytes / 4) words[lane] = lane < groups ? first : 0u;
    if (lane + 32 < header_bytes / 4) words[lane + 32] = lane + 32 < groups ? second : 0u;
    for (int b0 = 0; b0 < groups; b0 += 2) {
        const int b = b0 + half;
        const uint32_t header = __shfl_sync(kFullMask, b0 < 32 ? first : second, b % 32);
        if (b >= groups) continue;
        const int before = b < 32 ? __popc(encoded_first & ((1u << b) - 1u))
                                  : __popc(encoded_first) + __popc(encoded_second & ((1u << (b - 32)) - 1u));
        uint8_t* block = dst + header_bytes + kLogfmtEncodedBytes * before + kLogfmtRawBytes * (b - before);
        const int4 v = src[b * 16 + sub];
        if (header >> 31) {
            uint64_t low;
            uint32_t high;
            logfmt_encode_chunk(v, header, low, high);
            uint16_t* chunk = reinterpret_cast<uint16_t*>(block + 10 * sub);
            chunk[0] = static_cast<uint16_t>(low);
            chunk[1] = static_cast<uint16_t>(low >> 16);
            chunk[2] = static_cast<uint16_t>(low >> 32);
            chunk[3] = static_cast<uint16_t>(low >> 48);
            chunk[4] = static_cast<uint16_t>(high);
        } else {
            reinterpret_cast<int4*>(block)[sub] = v;
        }
    }
    return header_bytes + kLogfmtEncodedBytes * num_encoded + kLogfmtRawBytes * (groups - num_encoded);
}

// The header and byte offset of blocks `lane` and `lane + 32` of the LogFMT row `row` (groups blocks),
// with the whole warp (0 for blocks past the row).
struct LogfmtBlocks {
    uint32_t header[2];  // of blocks lane and lane + 32 (0 past the row)
    int offset[2];       // their byte offsets in the row
};

// Where blocks `lane` and `lane + 32` of the LogFMT row `row` (groups blocks) lie, with the whole warp.
MOE_EP_DEVICE LogfmtBlocks logfmt_row_layout(const uint8_t* row, int groups, int lane) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(row);
    LogfmtBlocks blocks;
    blocks.header[0] = lane < groups ? words[lane] : 0u;
    blocks.header[1] = lane + 32 < groups ? words[lane + 32] : 0u;
    const uint32_t encoded_first = __ballot_sync(kFullMask, blocks.header[0] >> 31);
    const uint32_t encoded_second = __ballot_sync(kFullMask, blocks.header[1] >> 31);
    const int header_bytes = logfmt_header_bytes(groups);
    const int before_first = __popc(encoded_first & ((1u << lane) - 1u));
    const int before_second = __popc(encoded_first) + __popc(encoded_second & ((1u << lane) - 1u));
    blocks.offset[0] = header_bytes + kLogfmtEncodedBytes * before_first + kLogfmtRawBytes * (lane - before_first);
    blocks.offset[1] =
        header_bytes + kLogfmtEncodedBytes * before_second + kLogfmtRawBytes * (lane + 32 - before_second);
    return blocks;
}

// The 16-byte vector `vec` (8 BF16 values) of a LogFMT row whose block vec / 16 has `header` and starts
// at byte `offset`.
MOE_EP_DEVICE int4 logfmt_load_vector(const uint8_t* row, uint32_t header, int offset, int vec) {
    const int sub = vec % 16;
    if (header >> 31) return logfmt_decode_chunk(row + offset + 10 * sub, header);
    return reinterpret_cast<const int4*>(row + offset)[sub];
}

}  // namespace

}  // namespace moe_ep::kernels::ll
