// Row movement of the low-latency kernels: warp-wide copies of 16-byte vectors, the fan-out of one
// loaded row to several ranks, and the per-token FP8 cast (bit for bit like fp8.per_token_cast_to_fp8).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/common.cuh"
#include "low_latency/api.cuh"

namespace moe_ep::kernels::ll {

namespace {  // local to each translation unit (csrc/README.md)

constexpr int kCopyUnroll = 8;  // 16-byte loads in flight per lane when copying a row
constexpr int kCastUnroll = 4;  // 32-byte steps in flight per lane when casting a row to FP8
constexpr float kAmaxFloor = 1e-4f;

// Copies the 16-byte vectors [begin, end) of `src` with the whole warp, kCopyUnroll loads in flight per
// lane, handing each to `store(index, value, pred)` (every lane calls it; `pred`: this lane has a value).
// `kReadOnly`: the source is not written while the kernel runs (the non-coherent path is then allowed);
// rows written by peers use ordinary loads.
template <bool kReadOnly, class Store>
MOE_EP_DEVICE void copy_vectors(const int4* src, int begin, int end, int lane, const Store& store) {
    for (int base = begin; base < end; base += 32 * kCopyUnroll) {
        int4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
            const int i = base + u * 32 + lane;
            if (i < end) v[u] = kReadOnly ? __ldg(src + i) : src[i];
        }
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) store(base + u * 32 + lane, v[u], base + u * 32 + lane < end);
    }
}

// Copies a row of `n` 16-byte vectors written by a peer to `dst`.
MOE_EP_DEVICE void copy_row(int4* dst, const int4* src, int n, int lane) {
    copy_vectors<false>(src, 0, n, lane, [dst](int i, const int4& v, bool pred) {
        if (pred) dst[i] = v;
    });
}

// The rows a send writes a token's row to: one address per destination rank, held by the lanes of
// `lanes`, so that a row loaded (and cast) once is stored to each. Every lane calls `store` (it
// shuffles the addresses); `pred` says whether this lane has a value to store.
struct RowFanOut {
    uint8_t* row;  // this lane's destination when its bit is set in `lanes`
    uint32_t lanes;
    template <class T>
    MOE_EP_DEVICE void store(int64_t offset, T v, bool pred) const {
        for (uint32_t rest = lanes; rest != 0; rest &= rest - 1) {
            uint8_t* to = reinterpret_cast<uint8_t*>(
                __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), __ffs(rest) - 1));
            if (pred) *reinterpret_cast<T*>(to + offset) = v;
        }
    }
};

// Sends the 16-byte vectors [begin, end) of a token's (read-only) row to `to`.
MOE_EP_DEVICE void send_row(const RowFanOut& to, const int4* src, int begin, int end, int lane) {
    copy_vectors<true>(src, begin, end, lane, [&to](int i, const int4& v, bool pred) {
        to.store(static_cast<int64_t>(i) * 16, v, pred);
    });
}

// 2^ceil(log2(s)) for a positive normal float, exactly (fp8.py's round_scale for every BF16 input:
// amax / 448 of a BF16 amax is a power of two or at least 0.4 % away from one).
MOE_EP_DEVICE float pow2_ceil(float s) {
    const uint32_t bits = __float_as_uint(s);
    const uint32_t exponent = (bits >> 23) + ((bits & 0x7fffffu) != 0 ? 1u : 0u);
    return __uint_as_float(exponent << 23);
}

MOE_EP_DEVICE float clamp_fp8(float v) { return fminf(fmaxf(v, -kFp8MaxFloat), kFp8MaxFloat); }

// Casts one BF16 row to e4m3 followed by its scales, bit for bit like fp8.per_token_cast_to_fp8:
// amax floored at 1e-4, scale = amax / 448 (rounded to a power of two with round_scale), q =
// saturate(x * (1 / scale)) to nearest even. Every float operation is explicitly rounded so that the
// compiler cannot fuse it. A lane casts 16 channels per step; the 8 lanes of a 128-channel group
// share their amax through shuffles, and a warp step covers 4 groups, i.e. exactly one UE8M0 word.
// The warp casts the 16-channel chunks [first_chunk, end_chunk) of the row, whole warp steps (see
// warp_share), so that several warps can cast one row.
template <bool kUe8m0>
MOE_EP_DEVICE void cast_row_fp8(const int4* x_row, const RowFanOut& to, int hidden, int first_chunk, int end_chunk,
                                bool round_scale, int lane) {
    for (int base = first_chunk; base < end_chunk; base += 32 * kCastUnroll) {
        int4 raw[kCastUnroll][2];
#pragma unroll
        for (int u = 0; u < kCastUnroll; ++u) {
            const int c = base + u * 32 + lane;
            raw[u][0] = raw[u][1] = make_int4(0, 0, 0, 0);
            if (c < end_chunk) {
                raw[u][0] = __ldg(x_row + 2 * c);
                raw[u][1] = __ldg(x_row + 2 * c + 1);
            }
        }
#pragma unroll
        for (int u = 0; u < kCastUnroll; ++u) {
            const int step = base + u * 32;  // warp-uniform; groups never straddle the row end (H % 128 == 0)
            if (step >= end_chunk) break;
            const int c = step + lane;
            const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(raw[u]);
            float v[16];
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float2 f = __bfloat1622float2(pairs[i]);
                v[2 * i] = f.x;
                v[2 * i + 1] = f.y;
                amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
            }
#pragma unroll
            for (int offset = 4; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
            float scale = __fdiv_rn(fmaxf(amax, kAmaxFloor), kFp8MaxFloat);
            if (round_scale) scale = pow2_ceil(scale);
            const float inv = __frcp_rn(scale);
            uint32_t packed[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 lo = make_float2(clamp_fp8(__fmul_rn(v[4 * i], inv)), clamp_fp8(__fmul_rn(v[4 * i + 1], inv)));
                const float2 hi =
                    make_float2(clamp_fp8(__fmul_rn(v[4 * i + 2], inv)), clamp_fp8(__fmul_rn(v[4 * i + 3], inv)));
                packed[i] = static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(lo, __NV_SATFINITE, __NV_E4M3)) |
                            (static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(hi, __NV_SATFINITE, __NV_E4M3)) << 16);
            }
            to.store(static_cast<int64_t>(c) * 16,
                     make_int4(static_cast<int>(packed[0]), static_cast<int>(packed[1]), static_cast<int>(packed[2]),
                               static_cast<int>(packed[3])),
                     c < end_chunk);
            if constexpr (kUe8m0) {
                // Groups past the row end contribute 0 bytes, as pack_ue8m0 pads the last word.
                const uint32_t exponent = c < end_chunk ? (__float_as_uint(scale) >> 23) & 0xffu : 0u;
                uint32_t word = 0;
#pragma unroll
                for (int b = 0; b < 4; ++b) word |= __shfl_sync(kFullMask, exponent, 8 * b) << (8 * b);
                to.store(hidden + static_cast<int64_t>(step / 32) * 4, word, lane == 0);
            } else {
                to.store(hidden + static_cast<int64_t>(c / 8) * 4, __float_as_uint(scale), lane % 8 == 0 && c < end_chunk);
            }
        }
    }
}

// Bytes of one dispatch message: the row, then (FP8) its scales.
MOE_EP_DEVICE int message_bytes(Mode mode, int hidden) {
    const int groups = hidden / kFp8Block;
    switch (mode) {
        case Mode::kBF16: return hidden * 2;
        case Mode::kFP8: return hidden + groups * 4;
        default: return hidden + (groups + 3) / 4 * 4;
    }
}

}  // namespace

}  // namespace moe_ep::kernels::ll
