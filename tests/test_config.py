"""`Config`: DeepEP's five positional fields, then the keyword-only settings of the CUDA kernels."""

from __future__ import annotations

import dataclasses

import pytest

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
