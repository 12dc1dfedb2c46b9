"""The torch backend's row movers: gathers and scatters of byte rows, and the combine's rank-ordered sum,
against plain indexing on random data."""

from __future__ import annotations

import pytest
import torch

from moe_ep.ops import routing
from moe_ep.ops.backends.torch_backend import _put_rows, _sum_in_rank_order, _take_rows


def _random_bytes(rows: int, width: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("width", [1, 2, 3, 4, 6, 8, 12, 24, 2048 + 16])
@pytest.mark.parametrize("column_offset", [0, 1, 4])
def test_row_gathers_and_scatters_move_the_same_bytes_as_indexing(width: int, column_offset: int) -> None:
    """Rows of every width, also inside a wider matrix at an odd byte offset (the widest word that tiles
    them changes with both)."""
    wide = _random_bytes(37, width + column_offset + 5, seed=width)
    rows = wide[:, column_offset:column_offset + width]
    index = torch.randint(0, 37, (53,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_take_rows(rows, index), rows[index])

    target = wide.clone()
    into = target[:, column_offset:column_offset + width]
    unique = torch.randperm(37, generator=torch.Generator().manual_seed(2))[:20]
    values = _random_bytes(20, width, seed=3)
    _put_rows(into, unique, values)
    expected = wide.clone()
    expected[:, column_offset:column_offset + width][unique] = values
    assert torch.equal(target, expected)  # the bytes around the rows are untouched too


@pytest.mark.parametrize("num_ranks", [1, 3, 8])
def test_rank_ordered_sum_adds_each_ranks_rows_in_rank_order(num_ranks: int) -> None:
    """Each token's rows are added rank by rank in float32 (the order fixes the rounding); ranks that
    receive nothing and tokens sent nowhere are covered."""
    gen = torch.Generator().manual_seed(num_ranks)
    is_token_in_rank = torch.rand(50, num_ranks, generator=gen) < 0.5
    if num_ranks > 1:
        is_token_in_rank[:, 1] = False  # an empty rank
    dest, token = routing.send_order(is_token_in_rank)
    rows = (torch.randn(dest.numel(), 16, generator=gen) * 1e3).to(torch.bfloat16)
    got = _sum_in_rank_order(torch.zeros(50, 16), rows, dest, token, num_ranks)
    expected = torch.zeros(50, 16)
    for rank in range(num_ranks):
        for row in (dest == rank).nonzero().flatten().tolist():
            expected[token[row]] += rows[row].float()
    assert torch.equal(got, expected)
