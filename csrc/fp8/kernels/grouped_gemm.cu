// Grouped FP8 GEMM with DeepSeek-V3 blockwise scaling on Hopper tensor cores (TMA + wgmma, sm_90a).
//
// Grouped by rows, for every expert e owning the contiguous rows [ends[e-1], ends[e]) of `a`:
//     out[rows of e] = (a * a_scales) @ (b[e] * b_scales[e])^T, accumulated in FP32, rounded to BF16,
// with `a [N, K]` e4m3 and one float scale per row per 128 columns, `b [E, N_OUT, K]` e4m3 and one
// float scale per 128x128 block. Rows from ends[E-1] on are written as zeros.
// Grouped by depth (weight gradients), every expert e contracts its own K range of one `a` and one `b`:
//     out[e] = (a[:, K_e] * a_scales) @ (b[:, K_e] * b_scales)^T, K_e = [ends[e-1], ends[e]).
// Both are the same tiles and K loop; only where a tile's rows, K range and output come from differs.
//
// The kernel is persistent: one block per SM walks the output tiles (128 x 128 or 128 x 256) blockIdx.x,
// blockIdx.x + gridDim.x, ... One producer warp streams every tile's 128-deep K blocks of `a` and `b`
// through a ring of shared-memory stages with TMA, in the 128-byte swizzled layout wgmma reads, together
// with the K block's scales (asynchronous 4-byte copies completing on the same barrier): the ring runs on
// across tiles, so the next tile's first K blocks land while the math warps still store the last one, and
// the math warps read scales from shared memory instead of waiting on global loads between tensor-core
// instructions. Two math warpgroups multiply 64 rows each: every K block goes into a scratch accumulator,
// which is then added to the FP32 sums times the block's two scales. The scales change from one K block to
// the next, so one tensor-core accumulation over all of K is not possible; the warpgroups wait for their
// own products only, so one's scaling overlaps the other's tensor-core work. Each math warpgroup writes
// its rows of the BF16 sums into shared memory (stmatrix, in the swizzled layout TMA reads) and one of its
// threads hands them to TMA stores, which drain while the warpgroup multiplies the next tile; register
// stores left the tensor cores idle for much of each tile, most of all grouped by depth (a few K blocks
// and 64 KB of output per tile). A segment's partial last tile (grouped by rows) leaves through 16-byte
// register stores after the four lanes sharing a row swap their column pairs.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <algorithm>

#include "fp8/api.cuh"
#include "common/common.cuh"
#include "common/launch_cache.cuh"

namespace moe_ep::kernels {

namespace {

// Rows of a block's tile, the K depth of one stage (one scale block), a column block.
constexpr int kTile = kFp8Block;
constexpr int kMathWarpgroups = 2;
constexpr int kThreads = 128 * (kMathWarpgroups + 1);
// Shared memory of the stages and the output staging together (within the 227 KB a block may have): 3
// stages of 128 + 256 rows of 128 bytes beside the 64 KB staging of a 128 x 256 BF16 tile, 5 stages of
// 128 + 128 rows beside the 32 KB of a 128 x 128 tile.
constexpr int kSmemBudget = 208 * 1024;
constexpr int kSwizzleBytes = 1024;      // 128-byte swizzle repeats every 8 rows of 128 bytes
constexpr int kStoreBoxColumns = 64;     // BF16 columns of one TMA store box: one 128-byte swizzled row
constexpr int kWarpgroupRows = kTile / kMathWarpgroups;

// A block's output tile is 128 x kBlockN: 128 or 256 columns (the wider tile reads a third less
// from L2 per FLOP; the output width must be a multiple of it). The BF16 tile's staging for the TMA
// stores follows the struct: per math warpgroup kBlockN / 64 boxes of 64 x 64.
template <int kBlockN>
struct alignas(kSwizzleBytes) GemmSmem {
    static constexpr int kStoreBoxes = kBlockN / kStoreBoxColumns;
    static constexpr int kStoreBoxBytes = kWarpgroupRows * kStoreBoxColumns * sizeof(__nv_bfloat16);
    static constexpr int kStagingBytes = kMathWarpgroups * kStoreBoxes * kStoreBoxBytes;
    static constexpr int kStages = (kSmemBudget - kStagingBytes) / ((kTile + kBlockN) * kTile);
    uint8_t a[kStages][kTile * kTile];
    uint8_t b[kStages][kBlockN * kTile];
    float a_scales[kStages][kTile];             // the stage's K block: one per row of the tile
    float b_scales[kStages][kBlockN / kTile];   // one per 128 columns
    uint64_t full[kStages];   // TMA bytes and the producer warp's scale copies landed
    uint64_t empty[kStages];  // every math warp done reading
};
// The struct's size is a multiple of kSwizzleBytes, so the staging after it is aligned too; one more
// kSwizzleBytes leaves room to align the base.
template <int kBlockN>
constexpr size_t kSmemBytes = sizeof(GemmSmem<kBlockN>) + GemmSmem<kBlockN>::kStagingBytes + kSwizzleBytes;

// The device code needs sm_90a (wgmma); other targets compile an empty kernel, which
// fp8_grouped_gemm_supported() reports.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Registers per thread after the warpgroups rebalance them (setmaxnreg): the producer needs few, the
// math warpgroups hold 64 x 256 FP32 sums and a 64 x 128 product each. A math warpgroup's increase
// waits until the registers are free, so 40 x 128 + 232 x 256 must leave room in the SM's 64 Ki beside
// the launch's own allocation (a producer at 48 uses up every register: the increase would wait forever).
constexpr int kProducerRegisters = 40;
constexpr int kMathRegisters = 232;
constexpr int kPart = kTile / 2;  // f32 registers per thread of an m64n128 product

// One output tile: its expert (num_experts for rows past the last segment, written as zeros), rows,
// K range in 128-deep blocks and column tile.
struct Tile {
    int expert;
    int row_begin;
    int row_end;
    int k_block_begin;
    int k_block_end;
    int col_tile;
};

// Grouped by rows, row slot `row_slot`: segments tiled one after another, then the zero tail. One warp;
// every lane gets the answer.
MOE_EP_DEVICE void locate_row_tile(const int* ends, int num_experts, int num_rows, int row_slot, int lane,
                                   Tile& tile) {
    int tiles_before = 0;
    for (int base = 0; base < num_experts; base += 32) {
        const int e = base + lane;
        const bool valid = e < num_experts;
        const int seg_begin = valid && e > 0 ? min(max(ends[e - 1], 0), num_rows) : 0;
        const int seg_end = valid ? max(min(ends[e], num_rows), seg_begin) : 0;
        const int tiles = ceil_div(seg_end - seg_begin, kTile);
        int through = tiles;  // inclusive prefix over the lanes
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int v = __shfl_up_sync(kFullMask, through, offset);
            if (lane >= offset) through += v;
        }
        through += tiles_before;
        const unsigned hit = __ballot_sync(kFullMask, valid && through > row_slot);
        if (hit) {
            const int src = __ffs(hit) - 1;
            const int tiles_before_expert = __shfl_sync(kFullMask, through - tiles, src);
            tile.expert = base + src;
            tile.row_begin = __shfl_sync(kFullMask, seg_begin, src) + (row_slot - tiles_before_expert) * kTile;
            tile.row_end = min(__shfl_sync(kFullMask, seg_end, src), tile.row_begin + kTile);
            return;
        }
        tiles_before = __shfl_sync(kFullMask, through, 31);
    }
    tile.expert = num_experts;
    tile.row_begin = min(max(ends[num_experts - 1], 0), num_rows) + (row_slot - tiles_before) * kTile;
    tile.row_end = min(tile.row_begin + kTile, num_rows);
}

// Tile `index` of the launch; column tiles vary fastest, so the tiles in flight together share rows of
// `a` and one expert's weight. Grouped by depth, row slot s is row tile s % row_tiles of expert
// s / row_tiles, whose K blocks are [ends[e-1], ends[e]) / 128 (clamped to the depth). One warp.
MOE_EP_DEVICE Tile locate_tile(const Fp8GroupedGemmArgs& args, int num_col_tiles, int index, int lane) {
    Tile tile;
    tile.col_tile = index % num_col_tiles;
    const int row_slot = index / num_col_tiles;
    if (args.group_depth) {
        const int row_tiles = args.num_rows / kTile;
        tile.expert = row_slot / row_tiles;
        tile.row_begin = (row_slot % row_tiles) * kTile;
        tile.row_end = tile.row_begin + kTile;
        const int k_begin = tile.expert > 0 ? args.ends[tile.expert - 1] : 0;
        tile.k_block_begin = min(max(k_begin, 0), args.depth) / kTile;
        tile.k_block_end = max(min(args.ends[tile.expert], args.depth) / kTile, tile.k_block_begin);
    } else {
        locate_row_tile(args.ends, args.num_experts, args.num_rows, row_slot, lane, tile);
        tile.k_block_begin = 0;
        tile.k_block_end = args.depth / kTile;
    }
    return tile;
}

MOE_EP_DEVICE void mbar_spin(uint64_t* bar, uint32_t parity) {
    while (!mbar_test(bar, parity)) {
    }
}

MOE_EP_DEVICE void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
            smem_addr(dst)),
        "l"(map), "r"(smem_addr(bar)), "r"(x), "r"(y)
        : "memory");
}

MOE_EP_DEVICE void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y, int z) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
        "[%2];" ::"r"(smem_addr(dst)),
        "l"(map), "r"(smem_addr(bar)), "r"(x), "r"(y), "r"(z)
        : "memory");
}

// A 4-byte asynchronous copy into shared memory, and an arrival on `bar` once every such copy of this
// thread has landed (`noinc`: the barrier's count includes these arrivals).
MOE_EP_DEVICE void cp_async_4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
MOE_EP_DEVICE void cp_async_arrive_noinc(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}
MOE_EP_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// wgmma shared-memory descriptor of a K-major operand tile in the 128-byte swizzled layout: start
// address, 8-row groups 1024 bytes apart, swizzle mode 1 (128 B). The leading offset is unused there.
MOE_EP_DEVICE uint64_t smem_descriptor(const void* tile) {
    const uint64_t address = smem_addr(tile);
    return ((address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{kSwizzleBytes >> 4} << 32) |
           (uint64_t{1} << 62);
}

MOE_EP_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
MOE_EP_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
MOE_EP_DEVICE void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// d (+)= a[64 x 32] * b[128 x 32]^T, e4m3 operands from shared memory, f32 accumulator.
MOE_EP_DEVICE void wgmma_m64n128k32(float (&d)[kPart], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// The accumulator registers are written by the tensor cores until wgmma_wait_all: keep the compiler
// from reading them (or moving reads) before that.
MOE_EP_DEVICE void fence_accumulator(float (&d)[kPart]) {
#pragma unroll
    for (int i = 0; i < kPart; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Zeros over rows [row_begin, row_end) of a column tile, by the math warpgroups' threads.
template <int kBlockN>
MOE_EP_DEVICE void zero_rows(__nv_bfloat16* out, int64_t out_row_stride, int row_begin, int row_end) {
    constexpr int kVectorsPerRow = kBlockN * sizeof(__nv_bfloat16) / sizeof(int4);
    for (int i = threadIdx.x; i < (row_end - row_begin) * kVectorsPerRow; i += kMathWarpgroups * 128) {
        int4* row = reinterpret_cast<int4*>(out + (row_begin + i / kVectorsPerRow) * out_row_stride);
        row[i % kVectorsPerRow] = make_int4(0, 0, 0, 0);
    }
}

MOE_EP_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// One row of a thread's sums as BF16 (`half` 0: the registers 4j, 4j+1; 1: 4j+2, 4j+3). Lane q of the
// four sharing the row holds columns 8j + 2q, +1; for every 32 columns the four swap pairs so that lane q
// holds columns 8q .. 8q+7 of them and writes them in one 16-byte store. Every lane takes part in the
// swaps; only `valid` rows are written.
template <int kAccum>
MOE_EP_DEVICE void store_row(const float (&acc)[kAccum], int half, __nv_bfloat16* row, bool valid, int q) {
#pragma unroll
    for (int g = 0; g < kAccum / 16; ++g) {
        uint32_t mine[4], gathered[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) mine[i] = pack_bf16x2(acc[16 * g + 4 * i + 2 * half], acc[16 * g + 4 * i + 2 * half + 1]);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            // Send lane q^r the pair it gathers from this lane; receive this lane's pair from lane q^r.
            const int peer = q ^ r;
            const uint32_t send = peer == 0 ? mine[0] : peer == 1 ? mine[1] : peer == 2 ? mine[2] : mine[3];
            const uint32_t got = __shfl_xor_sync(kFullMask, send, r);
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                if (p == peer) gathered[p] = got;
            }
        }
        if (valid) {
            *reinterpret_cast<uint4*>(row + 32 * g + 8 * q) = make_uint4(gathered[0], gathered[1], gathered[2], gathered[3]);
        }
    }
}

// Four 8 x 8 BF16 matrices into shared memory: register i of every lane holds its fragment of matrix i
// (row lane / 4, columns 2 (lane % 4) and +1, the accumulator's layout); lanes 8i .. 8i+7 give the
// addresses of matrix i's rows.
MOE_EP_DEVICE void stmatrix_x4(uint32_t address, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

// A warpgroup's rows of the tile as BF16 into its staging boxes (64 rows x 64 columns each, 128-byte rows
// with the 128-byte swizzle: the 16-byte chunk c of row r sits at chunk c ^ (r % 8)). Warp w holds rows
// 16w .. 16w+15; one stmatrix writes the 16 rows of 16 columns: lane l addresses row l % 8 (+8 for
// l / 8 odd) of the column chunk j + l / 16.
template <int kAccum>
MOE_EP_DEVICE void stage_rows(const float (&acc)[kAccum], uint8_t* boxes, int box_bytes, int warp_in_group,
                              int lane) {
    const int row = 16 * warp_in_group + lane % 8 + 8 * (lane / 8 % 2);
    const uint32_t row_base = smem_addr(boxes) + row * kStoreBoxColumns * sizeof(__nv_bfloat16);
    constexpr int kChunksPerBox = kStoreBoxColumns * sizeof(__nv_bfloat16) / 16;
#pragma unroll
    for (int j = 0; j < kAccum / 4; j += 2) {
        // Registers 4j .. 4j+3 hold the columns 8j .. 8j+7 of the tile's row and of the row 8 below.
        const int chunk = j + lane / 16;
        const uint32_t address =
            row_base + chunk / kChunksPerBox * box_bytes + ((chunk % kChunksPerBox) ^ (row % 8)) * 16;
        stmatrix_x4(address, pack_bf16x2(acc[4 * j], acc[4 * j + 1]), pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]),
                    pack_bf16x2(acc[4 * j + 4], acc[4 * j + 5]), pack_bf16x2(acc[4 * j + 6], acc[4 * j + 7]));
    }
}

// The L2 policy of the output's TMA stores: evict first for an output that streams through L2 once (the
// weight gradients: without it they push out the operands that the next tiles read again), else normal
// (a forward's or data gradient's output is read again by the next step).
MOE_EP_DEVICE uint64_t l2_store_policy(bool evict_first) {
    uint64_t policy;
    if (evict_first) {
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    } else {
        asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
    }
    return policy;
}

MOE_EP_DEVICE void tma_store_3d(const CUtensorMap* map, const void* src, int x, int y, int z, uint64_t policy) {
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3, %4}], [%1], %5;" ::"l"(
            map),
        "r"(smem_addr(src)), "r"(x), "r"(y), "r"(z), "l"(policy)
        : "memory");
}

// Synchronizes the 128 threads of math warpgroup `warpgroup` (named barriers 1 and 2; 0 is __syncthreads).
MOE_EP_DEVICE void warpgroup_barrier(int warpgroup) {
    asm volatile("bar.sync %0, 128;" ::"r"(1 + warpgroup) : "memory");
}
#endif

// Whole tiles' sums leave through shared memory and TMA stores of `out_map`; a segment's partial last
// tile (grouped by rows) through registers, since a TMA box would write the next segment's rows.
template <int kBlockN>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_grouped_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                            const __grid_constant__ CUtensorMap out_map, const Fp8GroupedGemmArgs args,
                            int num_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Smem = GemmSmem<kBlockN>;
    constexpr int kStages = Smem::kStages;
    constexpr int kColumnBlocks = kBlockN / kTile;
    constexpr int kAccum = kColumnBlocks * kPart;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t misalignment = smem_addr(smem_raw) % kSwizzleBytes;
    Smem& smem = *reinterpret_cast<Smem*>(smem_raw + (kSwizzleBytes - misalignment) % kSwizzleBytes);
    uint8_t* const staging = reinterpret_cast<uint8_t*>(&smem) + sizeof(Smem);
    const int num_col_tiles = args.n_out / kBlockN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(&smem.full[s], 1 + 32);  // the TMA bytes' arrival and the producer lanes' scale copies
            mbar_init(&smem.empty[s], kMathWarpgroups * 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // Producer and math warps walk the same tiles and count the same K blocks (`it`, over all tiles of
    // the block): stage it % kStages, phase parity (it / kStages) & 1.
    if (warpgroup == kMathWarpgroups) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegisters));
        if (warp % 4 != 0) return;
        int it = 0;
        for (int index = blockIdx.x; index < num_tiles; index += gridDim.x) {
            const Tile tile = locate_tile(args, num_col_tiles, index, lane);
            if (tile.row_begin >= tile.row_end || tile.expert == args.num_experts) continue;
            // Grouped by depth, every expert reads the one `b`.
            const int b_expert = args.group_depth ? 0 : tile.expert;
            const float* b_scale = args.b_scales + b_expert * args.b_scale_expert_stride +
                                   (tile.col_tile * kColumnBlocks + lane) * args.b_scale_row_stride;
            for (int kb = tile.k_block_begin; kb < tile.k_block_end; ++kb, ++it) {
                const int stage = it % kStages;
                if (it >= kStages) mbar_spin(&smem.empty[stage], (it / kStages - 1) & 1);
                if (lane == 0) {
                    mbar_arrive_expect_tx(&smem.full[stage], (kTile + kBlockN) * kTile);
                    tma_load_2d(smem.a[stage], &a_map, &smem.full[stage], kb * kTile, tile.row_begin);
                    tma_load_3d(smem.b[stage], &b_map, &smem.full[stage], kb * kTile, tile.col_tile * kBlockN,
                                b_expert);
                }
                // Rows past the end still go through the tensor cores (TMA fills them with zeros); their
                // scale rows are clamped.
#pragma unroll
                for (int r = lane; r < kTile; r += 32) {
                    const int row = min(tile.row_begin + r, args.num_rows - 1);
                    cp_async_4(&smem.a_scales[stage][r],
                               args.a_scales + row * args.a_scale_row_stride + kb * args.a_scale_k_stride);
                }
                if (lane < kColumnBlocks) {
                    cp_async_4(&smem.b_scales[stage][lane], b_scale + kb * args.b_scale_k_stride);
                }
                cp_async_arrive_noinc(&smem.full[stage]);
            }
        }
        cp_async_wait_all();
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kMathRegisters));
        // Accumulator layout of m64nN: warp w of the warpgroup holds rows 16w + lane/4 and 8 below; the
        // register pair 4j, 4j+1 holds columns 8j + 2(lane%4) + {0, 1} of the first, 4j+2, 4j+3 of the
        // second. acc holds the column blocks one after another.
        const int tile_row_0 = warpgroup * 64 + (warp % 4) * 16 + lane / 4;
        const int tile_row_1 = tile_row_0 + 8;
        int it = 0;
        for (int index = blockIdx.x; index < num_tiles; index += gridDim.x) {
            const Tile tile = locate_tile(args, num_col_tiles, index, lane);
            if (tile.row_begin >= tile.row_end) continue;
            __nv_bfloat16* out = args.out + (args.group_depth ? tile.expert * args.out_expert_stride : 0) +
                                 tile.col_tile * kBlockN;
            if (tile.expert == args.num_experts) {  // grouped by rows: the zero tail
                zero_rows<kBlockN>(out, args.out_row_stride, tile.row_begin, tile.row_end);
                continue;
            }
            float acc[kAccum], part[kPart];
#pragma unroll
            for (int i = 0; i < kAccum; ++i) acc[i] = 0.0f;
            for (int kb = tile.k_block_begin; kb < tile.k_block_end; ++kb, ++it) {
                const int stage = it % kStages;
                mbar_spin(&smem.full[stage], (it / kStages) & 1);
                const float a_0 = smem.a_scales[stage][tile_row_0], a_1 = smem.a_scales[stage][tile_row_1];
                float b[kColumnBlocks];
#pragma unroll
                for (int c = 0; c < kColumnBlocks; ++c) b[c] = smem.b_scales[stage][c];
                const uint64_t desc_a = smem_descriptor(smem.a[stage] + warpgroup * 64 * kTile);
#pragma unroll
                for (int c = 0; c < kColumnBlocks; ++c) {
                    const uint64_t desc_b = smem_descriptor(smem.b[stage] + c * kTile * kTile);
                    wgmma_fence();
#pragma unroll
                    for (int k = 0; k < kTile / 32; ++k) {
                        // 32 bytes further along K inside the swizzled rows: +2 in the 16-byte address field.
                        wgmma_m64n128k32(part, desc_a + 2 * k, desc_b + 2 * k, k > 0);
                    }
                    wgmma_commit();
                    wgmma_wait_all();
                    fence_accumulator(part);
                    if (c == kColumnBlocks - 1 && lane == 0) mbar_arrive(&smem.empty[stage]);
                    const float scale_0 = a_0 * b[c], scale_1 = a_1 * b[c];
#pragma unroll
                    for (int i = 0; i < kPart; ++i) acc[c * kPart + i] += part[i] * (i & 2 ? scale_1 : scale_0);
                }
            }
            // Grouped by depth every tile is whole (num_rows is a multiple of 128).
            if (args.group_depth || tile.row_end - tile.row_begin == kTile) {
                uint8_t* const boxes = staging + warpgroup * Smem::kStoreBoxes * Smem::kStoreBoxBytes;
                const bool leader = threadIdx.x % 128 == 0;
                if (leader) bulk_wait_read<0>();  // the last tile's stores are done reading the staging
                warpgroup_barrier(warpgroup);
                stage_rows(acc, boxes, Smem::kStoreBoxBytes, warp % 4, lane);
                fence_proxy_async_shared();  // the writes become visible to the TMA unit
                warpgroup_barrier(warpgroup);
                if (leader) {
                    const uint64_t policy = l2_store_policy(args.group_depth);
                    for (int box = 0; box < Smem::kStoreBoxes; ++box) {
                        tma_store_3d(&out_map, boxes + box * Smem::kStoreBoxBytes,
                                     tile.col_tile * kBlockN + box * kStoreBoxColumns,
                                     tile.row_begin + warpgroup * kWarpgroupRows,
                                     args.group_depth ? tile.expert : 0, policy);
                    }
                    bulk_commit();
                }
            } else {
                const int row_0 = tile.row_begin + tile_row_0, row_1 = tile.row_begin + tile_row_1;
                store_row(acc, 0, out + row_0 * args.out_row_stride, row_0 < tile.row_end, lane % 4);
                store_row(acc, 1, out + row_1 * args.out_row_stride, row_1 < tile.row_end, lane % 4);
            }
        }
        // The staging must outlive the stores reading it, and the kernel's writes must be done when it ends.
        if (threadIdx.x % 128 == 0) bulk_wait<0>();
    }
#endif
}

__global__ void sm90a_probe(int* compiled) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    *compiled = 1;
#else
    *compiled = 0;
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult status;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) !=
                cudaSuccess ||
            status != cudaDriverEntryPointSuccess) {
            fn = nullptr;
        }
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    return encode;
}

// A TMA map of e4m3 rows (innermost dimension K, contiguous) read in boxes of `box_rows` x 128 bytes
// with the 128-byte swizzle; rows outside the tensor read as zeros.
bool encode_operand_map(CUtensorMap* map, const void* base, int rank, const cuuint64_t* dims,
                        const cuuint64_t* byte_strides, int box_rows) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (encode == nullptr) return false;
    const cuuint32_t box[3] = {kTile, static_cast<cuuint32_t>(box_rows), 1};
    const cuuint32_t element_strides[3] = {1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, rank, const_cast<void*>(base), dims, byte_strides, box,
                  element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A TMA map of the BF16 output, `[num_experts, num_rows, n_out]` grouped by depth, `[num_rows, n_out]`
// (one matrix) grouped by rows, written in boxes of 64 rows x 64 columns (128 bytes) from the 128-byte
// swizzled staging.
bool encode_output_map(CUtensorMap* map, const Fp8GroupedGemmArgs& args) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (encode == nullptr) return false;
    const int64_t matrix_stride = args.group_depth ? args.out_expert_stride : args.num_rows * args.out_row_stride;
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(args.n_out), static_cast<cuuint64_t>(args.num_rows),
                                static_cast<cuuint64_t>(args.group_depth ? args.num_experts : 1)};
    const cuuint64_t byte_strides[2] = {static_cast<cuuint64_t>(args.out_row_stride) * sizeof(__nv_bfloat16),
                                        static_cast<cuuint64_t>(matrix_stride) * sizeof(__nv_bfloat16)};
    const cuuint32_t box[3] = {kStoreBoxColumns, kWarpgroupRows, 1};
    const cuuint32_t element_strides[3] = {1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, args.out, dims, byte_strides, box, element_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int kBlockN>
cudaError_t launch_tiles(const Fp8GroupedGemmArgs& args, cudaStream_t stream) {
    CUtensorMap a_map, b_map, out_map{};
    const cuuint64_t a_dims[2] = {static_cast<cuuint64_t>(args.depth), static_cast<cuuint64_t>(args.num_rows)};
    const cuuint64_t a_strides[1] = {static_cast<cuuint64_t>(args.a_row_stride)};
    const cuuint64_t b_dims[3] = {static_cast<cuuint64_t>(args.depth), static_cast<cuuint64_t>(args.n_out),
                                  static_cast<cuuint64_t>(args.group_depth ? 1 : args.num_experts)};
    const cuuint64_t b_strides[2] = {static_cast<cuuint64_t>(args.b_row_stride),
                                     static_cast<cuuint64_t>(args.b_expert_stride)};
    if (!encode_operand_map(&a_map, args.a, 2, a_dims, a_strides, kTile) ||
        !encode_operand_map(&b_map, args.b, 3, b_dims, b_strides, kBlockN) ||
        !encode_output_map(&out_map, args)) {
        return cudaErrorInvalidValue;
    }
    // Raised once per (kernel, device): the limit belongs to the device's context.
    const auto kernel = fp8_grouped_gemm_kernel<kBlockN>;
    const cudaError_t attribute = allow_dynamic_shared_memory(kernel, kSmemBytes<kBlockN>);
    if (attribute != cudaSuccess) return attribute;
    // Grouped by rows, every segment wastes at most one partial tile, and the zero tail takes at most
    // one more. Grouped by depth, the experts are slowest, so the tiles in flight together read one
    // expert's K range, which stays in L2.
    const int row_slots = args.group_depth ? args.num_experts * (args.num_rows / kTile)
                                           : (args.num_rows + kTile - 1) / kTile + args.num_experts + 1;
    const int num_tiles = row_slots * (args.n_out / kBlockN);
    const int blocks = std::min(num_tiles, std::max(device_attribute(cudaDevAttrMultiProcessorCount), 1));
    kernel<<<blocks, kThreads, kSmemBytes<kBlockN>, stream>>>(a_map, b_map, out_map, args, num_tiles);
    return cudaGetLastError();
}

}  // namespace

int fp8_grouped_gemm_tile() { return kTile; }

bool fp8_grouped_gemm_supported() {
    static const bool supported = [] {
        int* flag = nullptr;
        int compiled = 0;
        if (tensor_map_encoder() == nullptr || cudaMalloc(&flag, sizeof(int)) != cudaSuccess) return false;
        sm90a_probe<<<1, 1>>>(flag);
        const bool ok = cudaMemcpy(&compiled, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
        cudaFree(flag);
        return ok && compiled == 1;
    }();
    return supported;
}

cudaError_t launch_fp8_grouped_gemm(const Fp8GroupedGemmArgs& args, cudaStream_t stream) {
    return args.n_out % 256 == 0 ? launch_tiles<256>(args, stream) : launch_tiles<128>(args, stream);
}

}  // namespace moe_ep::kernels
