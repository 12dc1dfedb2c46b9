"""`Config`: DeepEP's five positional fields, then the keyword-only settings of the CUDA kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe_ep
from moe_ep.ops.config import STAGED_COMBINE_WORLDS


def test_positional_fields_follow_deepep() -> None:
    config = moe_ep.Config(24, 8, 512, 4, 64)
    assert (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
            config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens) == (24, 8, 512, 4, 64)
    assert (config.pipeline_lag, config.combine_path) == (0, "auto")
    with pytest.raises(TypeError):
        moe_ep.Config(24, 8, 512, 4, 64, 3)  # the kernels' settings are keywords only


def test_kernel_settings_are_checked() -> None:
    assert moe_ep.Config(pipeline_lag=5, combine_path="rings").pipeline_lag == 5
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="pipeline_lag: expected an integer >= 0"):
            moe_ep.Config(pipeline_lag=bad)
    with pytest.raises(ValueError, match="combine_path: expected one of auto, staged, rings, got 'ring'"):
        moe_ep.Config(combine_path="ring")


@pytest.mark.parametrize("world", range(1, 9))
def test_combine_path_picks_staged_or_rings(world: int) -> None:
    base = moe_ep.Buffer.get_combine_config(world)
    assert base.combines_staged(world) == (world in STAGED_COMBINE_WORLDS)
    assert dataclasses.replace(base, combine_path="staged").combines_staged(world)
    assert not dataclasses.replace(base, combine_path="rings").combines_staged(world)


@pytest.mark.parametrize("hidden,dtype,use_fp8,topk", [(7168, torch.bfloat16, True, 8), (7168, torch.bfloat16, False, 8),
                                                       (4096, torch.float32, False, 32), (2048, torch.bfloat16, True, 1)])
@pytest.mark.parametrize("num_ranks,ranks_per_node", [(16, 8), (64, 8), (8, 2), (32, 1)])
def test_rdma_hint_holds_the_internode_rows(hidden: int, dtype: torch.dtype, use_fp8: bool, topk: int, num_ranks: int,
                                            ranks_per_node: int) -> None:
    """`get_rdma_buffer_size_hint(hidden * max(element size, 2), ...)` fits both legs' rings for the rows the
    internode path moves: a dispatch row (tokens, scales, top-k ids and weights, token index, the node's rank
    flags) and a combine row (partial sums and weights), padded to 16 bytes as the CUDA legs move them."""
    from moe_ep.ops.backends.torch_backend import _RowCodec
    from moe_ep.ops.config import internode_rdma_bytes

    tokens = 3
    x = torch.zeros(tokens, hidden, dtype=torch.float8_e4m3fn if use_fp8 else dtype)
    payload = [x] + ([torch.zeros(tokens, hidden // 128)] if use_fp8 else [])
    payload += [torch.zeros(tokens, topk, dtype=torch.int64), torch.zeros(tokens, topk),
                torch.zeros(tokens, dtype=torch.int32)]
    dispatch_row = _RowCodec.like(payload, extra_bytes=ranks_per_node, align=16).row_bytes
    combine_dtype = torch.bfloat16 if use_fp8 else dtype
    combine_row = _RowCodec.like([torch.zeros(tokens, hidden, dtype=combine_dtype), torch.zeros(tokens, topk)],
                                 align=16).row_bytes
    num_nodes = num_ranks // ranks_per_node
    for config in (moe_ep.Buffer.get_dispatch_config(num_ranks), moe_ep.Buffer.get_combine_config(num_ranks)):
        hint = config.get_rdma_buffer_size_hint(hidden * max(torch.empty((), dtype=dtype).element_size(), 2),
                                                num_ranks, ranks_per_node)
        needed = max(internode_rdma_bytes(config, team, row) for team in (num_nodes, ranks_per_node)
                     for row in (dispatch_row, combine_row))
        assert 0 < needed <= hint, (needed, hint)
