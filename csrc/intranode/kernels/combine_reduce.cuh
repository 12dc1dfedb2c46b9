// The combine's arithmetic, apart from its ring protocol (combine.cu): one token's reduction over the
// contributions of every rank it was dispatched to, bias first, then ranks 0..R-1 in order, in float32
// (float64 for double), exactly like the torch backend.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/common.cuh"
#include "intranode/api.cuh"

namespace moe_ep::kernels {

// Conversions of a pair of 16-bit floats.
template <typename T>
struct Pair16;

template <>
struct Pair16<__nv_bfloat16> {
    using V = __nv_bfloat162;
    static MOE_EP_DEVICE float2 widen(V v) { return __bfloat1622float2(v); }
    static MOE_EP_DEVICE V narrow(float a, float b) { return __floats2bfloat162_rn(a, b); }
};

template <>
struct Pair16<__half> {
    using V = __half2;
    static MOE_EP_DEVICE float2 widen(V v) { return __half22float2(v); }
    static MOE_EP_DEVICE V narrow(float a, float b) { return __floats2half2_rn(a, b); }
};

// 16 bytes of T widened into accumulators.
template <typename T>
struct Pack {  // 16-bit floats: eight per 16 bytes, float accumulators
    using Acc = float;
    using P = Pair16<T>;
    static constexpr int kN = 8;
    static MOE_EP_DEVICE void add(Acc* acc, const int4& v) {
        const typename P::V* h = reinterpret_cast<const typename P::V*>(&v);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = P::widen(h[i]);
            acc[2 * i] += f.x;
            acc[2 * i + 1] += f.y;
        }
    }
    static MOE_EP_DEVICE int4 pack(const Acc* acc) {
        int4 v;
        typename P::V* h = reinterpret_cast<typename P::V*>(&v);
#pragma unroll
        for (int i = 0; i < 4; ++i) h[i] = P::narrow(acc[2 * i], acc[2 * i + 1]);
        return v;
    }
};

template <>
struct Pack<float> {
    using Acc = float;
    static constexpr int kN = 4;
    static MOE_EP_DEVICE void add(Acc* acc, const int4& v) {
        acc[0] += __int_as_float(v.x), acc[1] += __int_as_float(v.y);
        acc[2] += __int_as_float(v.z), acc[3] += __int_as_float(v.w);
    }
    static MOE_EP_DEVICE int4 pack(const Acc* acc) {
        return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]), __float_as_int(acc[3]));
    }
};

template <>
struct Pack<double> {
    using Acc = double;
    static constexpr int kN = 2;
    static MOE_EP_DEVICE void add(Acc* acc, const int4& v) {
        const double* d = reinterpret_cast<const double*>(&v);
        acc[0] += d[0], acc[1] += d[1];
    }
    static MOE_EP_DEVICE int4 pack(const Acc* acc) {
        int4 v;
        double* d = reinterpret_cast<double*>(&v);
        d[0] = acc[0], d[1] = acc[1];
        return v;
    }
};

// 16-byte unit `unit` of a row. Rows that peers wrote during this kernel (ring slots) are read through
// L2 only.
MOE_EP_DEVICE int4 load_row_unit(const uint8_t* row, int unit, bool written_by_peer) {
    const int4* p = reinterpret_cast<const int4*>(row) + unit;
    return written_by_peer ? __ldcg(p) : __ldg(p);
}

// One warp reduces token t: lane r's `row` is rank r's contribution for every bit r of `mask`, this
// rank's own (`me`) a row of `a.x`, a peer's a slot holding the row followed by its k top-k weights.
// kRanks bounds the world size: each lane keeps 4 16-byte units of every contribution in flight at 2
// ranks, 3 at up to 4 ranks, 2 beyond (about the most that fit in registers without spilling).
template <typename T, int kRanks>
MOE_EP_DEVICE void reduce_token(const CombineArgs& a, int t, uint32_t mask, const uint8_t* row, int me, int lane) {
    const uint8_t* rows[kRanks];
#pragma unroll
    for (int r = 0; r < kRanks; ++r)
        rows[r] = reinterpret_cast<const uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), r));
    using P = Pack<T>;
    using Acc = typename P::Acc;
    constexpr int kUnroll = kRanks <= 2 ? 4 : kRanks <= 4 ? 3 : 2;
    const int units = a.row_bytes / 16;
    const size_t out_row = static_cast<size_t>(t) * a.row_bytes;
    for (int u0 = lane; u0 < units; u0 += 32 * kUnroll) {
        Acc acc[kUnroll][P::kN];
#pragma unroll
        for (int i = 0; i < kUnroll; ++i) {
#pragma unroll
            for (int e = 0; e < P::kN; ++e) acc[i][e] = Acc(0);
        }
        for (const void* bias : {a.bias_0, a.bias_1}) {
            if (bias == nullptr) continue;
#pragma unroll
            for (int i = 0; i < kUnroll; ++i)
                if (u0 + 32 * i < units)
                    P::add(acc[i], load_row_unit(static_cast<const uint8_t*>(bias) + out_row, u0 + 32 * i, false));
        }
        // Every contribution's loads are issued before the first add: one memory latency per step.
        int4 v[kRanks][kUnroll];
#pragma unroll
        for (int r = 0; r < kRanks; ++r)
#pragma unroll
            for (int i = 0; i < kUnroll; ++i)
                if (((mask >> r) & 1) && u0 + 32 * i < units) v[r][i] = load_row_unit(rows[r], u0 + 32 * i, r != me);
#pragma unroll
        for (int r = 0; r < kRanks; ++r)
#pragma unroll
            for (int i = 0; i < kUnroll; ++i)
                if (((mask >> r) & 1) && u0 + 32 * i < units) P::add(acc[i], v[r][i]);
#pragma unroll
        for (int i = 0; i < kUnroll; ++i)
            if (u0 + 32 * i < units)
                reinterpret_cast<int4*>(static_cast<uint8_t*>(a.combined_x) + out_row)[u0 + 32 * i] =
                    P::pack(acc[i]);
    }
    if (a.combined_topk_weights != nullptr && lane < a.num_topk) {
        float w = 0.0f;
#pragma unroll
        for (int r = 0; r < kRanks; ++r) {
            if (!((mask >> r) & 1)) continue;
            if (r == me) {
                const int self_row = static_cast<int>((rows[r] - static_cast<const uint8_t*>(a.x)) / a.row_bytes);
                w += __ldg(a.topk_weights + static_cast<size_t>(self_row) * a.num_topk + lane);
            } else {
                w += __ldcg(reinterpret_cast<const float*>(rows[r] + a.row_bytes) + lane);
            }
        }
        a.combined_topk_weights[static_cast<size_t>(t) * a.num_topk + lane] = w;
    }}

}  // namespace moe_ep::kernels
