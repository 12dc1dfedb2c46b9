"""The constants of `moe_ep.ops.constants` against the `constexpr`s of the CUDA sources they mirror."""

from __future__ import annotations

import pathlib
import re

import pytest

from moe_ep.ops import constants

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"
HEADER = CSRC / "common" / "constants.h"
MIRRORED = {"NUM_MAX_TOPK": "kNumMaxTopk", "FP8_BLOCK": "kFp8Block", "BUFFER_ALIGNMENT": "kBufferAlignment",
            "CHANNELS_PER_SM_PAIR": "kChannelsPerSmPair"}
_CONSTEXPR = r"constexpr\s+[\w:]+\s+{name}\s*=\s*(\d+)[uUlL]*\s*;"


def _definitions(name: str, text: str) -> list[int]:
    return [int(value) for value in re.findall(_CONSTEXPR.format(name=name), text)]


@pytest.mark.parametrize("python_name", sorted(MIRRORED))
def test_header_constant_matches(python_name: str) -> None:
    if not HEADER.exists():
        pytest.skip(f"{HEADER.relative_to(CSRC.parent)} is not in this tree yet (the csrc reorganisation adds it)")
    cxx_name = MIRRORED[python_name]
    assert _definitions(cxx_name, HEADER.read_text()) == [getattr(constants, python_name)], cxx_name


def test_intranode_rank_limit_matches() -> None:
    found = [value for path in sorted(CSRC.rglob("*")) if path.suffix in (".h", ".cuh", ".hpp")
             for value in _definitions("kMaxRanks", path.read_text())]
    assert found and set(found) == {constants.NUM_MAX_NVL_PEERS}, found
