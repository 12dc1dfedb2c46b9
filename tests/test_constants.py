"""The constants of `moe_ep.ops.constants` against the `constexpr`s of the CUDA sources they mirror."""

from __future__ import annotations

import pathlib
import re

import pytest

from moe_ep.ops import constants

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"
HEADER = CSRC / "common" / "constants.h"
MIRRORED = {"NUM_MAX_TOPK": "kNumMaxTopk", "FP8_BLOCK": "kFp8Block", "BUFFER_ALIGNMENT": "kBufferAlignment",
            "CHANNELS_PER_SM_PAIR": "kChannelsPerSmPair", "NUM_MAX_NVL_PEERS": "kNumMaxNvlPeers",
            "NUM_MAX_NODES": "kNumMaxNodes"}
_CONSTEXPR = r"constexpr\s+[\w:]+\s+{name}\s*=\s*(\d+)[uUlL]*\s*;"


def _definitions(name: str, text: str) -> list[int]:
    return [int(value) for value in re.findall(_CONSTEXPR.format(name=name), text)]


@pytest.mark.parametrize("python_name", sorted(MIRRORED))
def test_header_constant_matches(python_name: str) -> None:
    cxx_name = MIRRORED[python_name]
    assert _definitions(cxx_name, HEADER.read_text()) == [getattr(constants, python_name)], cxx_name


def test_each_constant_is_defined_once_in_csrc() -> None:
    """The header is the one home: no other CUDA source defines the same names again."""
    for cxx_name in MIRRORED.values():
        found = [path.relative_to(CSRC) for path in sorted(CSRC.rglob("*"))
                 if path.suffix in (".h", ".cuh", ".hpp", ".cu") and _definitions(cxx_name, path.read_text())]
        assert found == [HEADER.relative_to(CSRC)], (cxx_name, found)
