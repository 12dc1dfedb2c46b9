"""Grouped FP8 GEMM with DeepSeek-V3 blockwise scaling: the CUDA kernel of `moe_ep._fp8`, or Triton.

Computes, for every expert `e` owning a contiguous segment of rows of an expert-major `[N, K]`
activation,

    out[rows of e] = (a * a_scales) @ (b[e] * b_scales[e]).T

with `a` e4m3 and one float32 scale per row per 128 columns (1x128), `b [E, N_OUT, K]` e4m3 with
one float32 scale per 128x128 block. Each 128-wide K block is multiplied on the tensor cores and
added to an FP32 accumulator with its two scales applied (as DeepGEMM does); the result is BF16.
Rows past the last segment are written as zeros.

Two implementations of the same arithmetic: the TMA + wgmma kernel of `moe_ep._fp8`
(`csrc/fp8/`, sm_90a: a producer warp feeding two math warpgroups) where the
extension is built, and the Triton kernel below everywhere else (and in Triton's interpreter on CPU).

Segments are given by their cumulative ends on the device (`ExpertSegments.offsets`), so nothing
syncs with the host: the launch grid is an upper bound on the row tiles (`cdiv(N, BLOCK_M) + E + 1`,
since every segment wastes at most one partial tile and the zero tail takes one more) and each
program finds its expert from a prefix sum of the experts' tile counts.

Hopper's FP8 tensor-core instructions read both operands K-major (the contracted dimension
contiguous in memory); other strides work in Triton but make it transpose tiles on chip, and the
CUDA kernel needs them. The input gradient `grad @ W[e]` is this same GEMM against `W` transposed
(K-major for it), which `fp8_casts.per_block_cast_to_fp8_with_transpose` writes next to `W`; its
scales are `W`'s transposed.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
import triton
import triton.language as tl

from ..ops.fp8 import BLOCK, FP8_DTYPE
from .fp8_backend import aligned_rows, cuda_kernels_run
from .loaders import fp8_extension, interpreted


@triton.jit
def _locate_row_tile(ends_ptr, num_experts, num_rows, row_slot, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """`(expert, first row, end row)` of row tile `row_slot`, segments tiled one after another, then
    the rows past the last segment (`expert == num_experts`). All experts at once (E_POW2 >= E
    lanes), no loop."""
    e = tl.arange(0, E_POW2)
    seg_end = tl.load(ends_ptr + e, mask=e < num_experts, other=0)
    seg_begin = tl.load(ends_ptr + e - 1, mask=(e > 0) & (e < num_experts), other=0)
    seg_tiles = tl.where(e < num_experts, (seg_end - seg_begin + BLOCK_M - 1) // BLOCK_M, 0)
    tiles_through = tl.cumsum(seg_tiles, 0)  # row tiles of experts 0..e
    expert = tl.sum((tiles_through <= row_slot).to(tl.int32), 0)
    mine = e == expert
    tile_begin = tl.sum(tl.where(mine, seg_begin + (row_slot - tiles_through + seg_tiles) * BLOCK_M, 0), 0)
    tile_end = tl.minimum(tl.sum(tl.where(mine, seg_end, 0), 0), tile_begin + BLOCK_M)
    tail_begin = tl.max(seg_end, 0) + (row_slot - tl.sum(seg_tiles, 0)) * BLOCK_M
    past_last = expert >= num_experts
    tile_begin = tl.where(past_last, tail_begin, tile_begin)
    return expert, tile_begin, tl.where(past_last, tl.minimum(tail_begin + BLOCK_M, num_rows), tile_end)


INTERPRETED = interpreted(_locate_row_tile)
"""Whether this module's kernels run in Triton's interpreter (one small tile, no CUDA kernel)."""


def _configs() -> list[triton.Config]:
    """Tiles for H200. The interpreter gets one small tile.

    BLOCK_K is the 128-wide scale block; one `tl.dot` covers BLOCK_N <= 128 columns, so that it sees
    one weight scale per K block, and a program covers SPLIT_N such column blocks with the same rows.
    FP8 tiles are bound by L2 bandwidth (a 128x128 tile reads 32 KB per 4 MFLOP of K step), so
    128 x (2 x 128) is the likely winner: a quarter less traffic per FLOP. Registers bound the tile:
    with 8 warps it holds 128 + 64 accumulator registers per thread (the two column blocks' sums and
    one block's partial product), the most that fits. 64-row tiles with 4 warps fit two programs
    per SM, which overlap one's promotion arithmetic with the other's tensor-core work. Shared
    memory per stage is (BLOCK_M + SPLIT_N * BLOCK_N) * 128 bytes of 227 KB.
    """
    if INTERPRETED:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "SPLIT_N": 1}, num_warps=4, num_stages=1)]
    tiles = [  # (BLOCK_M, BLOCK_N, SPLIT_N, num_warps, num_stages)
        (128, 128, 2, 8, 3), (128, 128, 2, 8, 4),
        (128, 128, 1, 8, 3), (128, 128, 1, 8, 4), (128, 128, 1, 8, 5),
        (64, 128, 1, 4, 3), (64, 128, 2, 4, 2),
    ]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_N": split}, num_warps=warps, num_stages=stages)
            for bm, bn, split, warps, stages in tiles]


CONFIGS = _configs()
"""The tiles the kernel autotunes over, per output width and depth; `fp8_grouped_mm(config=...)` pins one."""


def tile_width(config: triton.Config) -> int:
    """The output columns one program of `config` covers: BLOCK_N * SPLIT_N."""
    return config.kwargs["BLOCK_N"] * config.kwargs["SPLIT_N"]


def _tiles_fitting(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The tiles whose width divides the output width (the kernel has no column masks)."""
    return [c for c in configs if named_args["N_OUT"] % tile_width(c) == 0]


# Tuned per output width and depth only: the row count changes every step with the routing.
@triton.autotune(configs=CONFIGS, key=["N_OUT", "K"], prune_configs_by={"early_config_prune": _tiles_fitting})
@triton.jit
def _grouped_mm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, ends_ptr,
    num_experts, num_rows, N_OUT, K,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr, BLOCK_K: tl.constexpr,
    E_POW2: tl.constexpr,
):
    tl.static_assert(BLOCK_K % BLOCK_N == 0 and (SPLIT_N == 1 or SPLIT_N == 2))
    pid = tl.program_id(0)
    num_col_tiles = N_OUT // (BLOCK_N * SPLIT_N)
    # Column tiles vary fastest: the programs resident together share one expert's rows and
    # cover its whole weight, which then stays in L2.
    col_tile = pid % num_col_tiles
    row_slot = pid // num_col_tiles

    expert, tile_begin, tile_end = _locate_row_tile(ends_ptr, num_experts, num_rows, row_slot, BLOCK_M, E_POW2)
    rows = tile_begin + tl.arange(0, BLOCK_M)
    row_mask = rows < tile_end
    rows = rows.to(tl.int64)
    first_col = col_tile * BLOCK_N * SPLIT_N
    cols = (first_col + tl.arange(0, BLOCK_N)).to(tl.int64)  # of the first column block
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    if expert >= num_experts:  # rows past the last segment
        zeros = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.bfloat16)
        for half in tl.static_range(SPLIT_N):
            tl.store(out_ptrs + half * BLOCK_N * stride_on, zeros, mask=row_mask[:, None])
        return
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk
    a_scale_ptrs = a_scale_ptr + rows * stride_asm
    # BLOCK_N divides 128: each column block lies in one 128-row block of the weight.
    b_scale_ptrs = b_scale_ptr + expert * stride_bse + (first_col // BLOCK_K) * stride_bsn
    b_scale_ptrs_1 = b_scale_ptr + expert * stride_bse + ((first_col + BLOCK_N) // BLOCK_K) * stride_bsn

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    acc_1 = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)  # the second column block's, if any
    num_k_blocks = K // BLOCK_K
    a_scale = tl.load(a_scale_ptrs, mask=row_mask, other=0.0)
    b_scale = tl.load(b_scale_ptrs)
    b_scale_1 = tl.load(b_scale_ptrs_1) if SPLIT_N == 2 else b_scale
    for k in range(0, num_k_blocks):
        a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
        # The next K block's scales (the last one's again at the end), a whole step ahead: the
        # pipeliner leaves these small loads in place, and loaded where they are used their
        # latency would stall every step.
        next_k = tl.minimum(k + 1, num_k_blocks - 1)
        next_a_scale = tl.load(a_scale_ptrs + next_k * stride_ask, mask=row_mask, other=0.0)
        next_b_scale = tl.load(b_scale_ptrs + next_k * stride_bsk)
        # Scales are per K block, so they must be applied before blocks are summed; one column
        # block at a time, so that one partial product is live.
        acc += tl.dot(a, tl.load(b_ptrs), out_dtype=tl.float32) * (a_scale * b_scale)[:, None]
        if SPLIT_N == 2:
            next_b_scale_1 = tl.load(b_scale_ptrs_1 + next_k * stride_bsk)
            b_1 = tl.load(b_ptrs + BLOCK_N * stride_bn)
            acc_1 += tl.dot(a, b_1, out_dtype=tl.float32) * (a_scale * b_scale_1)[:, None]
            b_scale_1 = next_b_scale_1
        a_scale, b_scale = next_a_scale, next_b_scale
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    tl.store(out_ptrs, acc.to(tl.bfloat16), mask=row_mask[:, None])
    if SPLIT_N == 2:
        tl.store(out_ptrs + BLOCK_N * stride_on, acc_1.to(tl.bfloat16), mask=row_mask[:, None])


Backend = Literal["auto", "cuda", "triton"]


def cuda_kernel_runs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `fp8_grouped_mm` runs these operands on the CUDA kernel (backend "auto"): TMA reads
    them, so K contiguous, start and row strides in 16-byte multiples."""
    return cuda_kernels_run(a) and aligned_rows(a) and aligned_rows(b)


def fp8_grouped_mm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                   ends: torch.Tensor, *, config: Optional[triton.Config] = None,
                   backend: Backend = "auto") -> torch.Tensor:
    """`dequant(a)[rows of e] @ dequant(b[e]).T` for every expert: `[N, K] x [E, N_OUT, K] -> [N, N_OUT]` BF16.

    Args:
        a: `[N, K]` e4m3 rows, expert-major; `a_scales`: `[N, K/128]` float32 (1x128), any strides
            (rows adjacent is fastest).
        b: `[E, N_OUT, K]` e4m3, any strides (K contiguous is fastest, and the CUDA kernel needs
            it); `b_scales`: `[E, N_OUT/128, K/128]` float32 (128x128), any strides.
        ends: `[E]` int32 cumulative segment ends on the device (expert `e` owns rows
            `[ends[e-1], ends[e])`); rows from `ends[-1]` on are zeros.
        config: one of `CONFIGS` (or any tile whose width divides N_OUT) to run the Triton kernel
            with instead of the autotuned choice.
        backend: "cuda" (the `moe_ep._fp8` kernel; an error where it cannot run these operands),
            "triton", or "auto": the CUDA kernel where `cuda_kernel_runs`, else Triton.
    """
    num_rows, depth = a.shape
    num_experts, n_out, b_depth = b.shape
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise TypeError(f"a, b: expected {FP8_DTYPE}, got {a.dtype} and {b.dtype}")
    if b_depth != depth or depth % BLOCK or n_out % BLOCK:
        raise ValueError(f"a {tuple(a.shape)}, b {tuple(b.shape)}: K must match and K, N_OUT be multiples of {BLOCK}")
    if a_scales.shape != (num_rows, depth // BLOCK) or b_scales.shape != (num_experts, n_out // BLOCK, depth // BLOCK):
        raise ValueError(f"scales: got {tuple(a_scales.shape)} and {tuple(b_scales.shape)} for a "
                         f"{tuple(a.shape)} and b {tuple(b.shape)}")
    if ends.shape != (num_experts,) or ends.dtype != torch.int32:
        raise ValueError(f"ends: expected int32 [{num_experts}], got {ends.dtype} {tuple(ends.shape)}")
    if config is not None and not _tiles_fitting([config], {"N_OUT": n_out}):
        raise ValueError(f"config: its tile width {tile_width(config)} does not divide N_OUT {n_out}")
    if backend not in ("auto", "cuda", "triton"):
        raise ValueError(f"backend: expected 'auto', 'cuda' or 'triton', got {backend!r}")
    if backend == "cuda" and not cuda_kernel_runs(a, b):
        raise RuntimeError("backend='cuda': the moe_ep._fp8 FP8 GEMM cannot run here (it needs an sm_90a build on an "
                           "sm_90 GPU, and K-contiguous operands with 16-byte aligned starts and strides)")
    if backend == "cuda" or (backend == "auto" and config is None and cuda_kernel_runs(a, b)):
        return fp8_extension().fp8_grouped_mm(a, a_scales, b, b_scales, ends)
    out = torch.empty(num_rows, n_out, dtype=torch.bfloat16, device=a.device)

    def grid(meta: dict) -> tuple[int]:
        row_tiles = triton.cdiv(num_rows, meta["BLOCK_M"]) + num_experts + 1
        return (row_tiles * (n_out // (meta["BLOCK_N"] * meta["SPLIT_N"])),)

    kernel = _grouped_mm_kernel if config is None else _grouped_mm_kernel.fn
    tile = {} if config is None else config.all_kwargs()
    kernel[grid](
        a, a_scales, b, b_scales, out, ends,
        num_experts, num_rows, n_out, depth,
        *a.stride(), *a_scales.stride(), *b.stride(), *b_scales.stride(), *out.stride(),
        BLOCK_K=BLOCK, E_POW2=triton.next_power_of_2(num_experts), **tile,
    )
    return out


def fp8_depth_grouped_mm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                         ends: torch.Tensor) -> torch.Tensor:
    """The weight-gradient GEMM: `dequant(a)[:, K_e] @ dequant(b)[:, K_e].T` for every expert `e`,
    `K_e = [ends[e-1], ends[e])` (multiples of 128): `[M, C] x [N, C] -> [E, M, N]` BF16.

    `a` e4m3 with float32 scales `[M, C/128]` (1x128), `b` e4m3 with `[N/128, C/128]` (128x128), as
    `fp8_casts.per_column_segments_cast_to_fp8` writes them. The CUDA kernel of `moe_ep._fp8` only
    (no Triton version): where `fp8_backend.cuda_kernels_run(a)`.
    """
    if not cuda_kernels_run(a):
        raise RuntimeError("fp8_depth_grouped_mm: needs the moe_ep._fp8 kernel (an sm_90a build on an sm_90 GPU)")
    return fp8_extension().fp8_depth_grouped_mm(a, a_scales, b, b_scales, ends)
