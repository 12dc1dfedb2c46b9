"""The profile summary's per-channel placement (pure Python over the kernels' raw records)."""

import torch

from moe_ep.ops.backends.cuda_backend import channel_placement

FIELDS = ["start", "first", "end", "wait_stage", "wait_remote", "copy", "copy_wait", "publish", "items",
          "wait_events", "writers", "meta", "sm"]


def _record(start: int, end: int, sm: int, writers: int = 1) -> list[int]:
    row = [0] * len(FIELDS)
    row[FIELDS.index("start")], row[FIELDS.index("end")] = start, end
    row[FIELDS.index("sm")], row[FIELDS.index("writers")] = sm, writers
    return row


def test_channel_placement_reports_sm_and_latest_end_of_channels_that_ran() -> None:
    idle = [0] * len(FIELDS)
    records = torch.tensor([
        [_record(1_000, 51_000, 124), _record(1_500, 90_500, 124)],  # channel 0: roles end at 50 and 89.5 us
        [idle, idle],                                               # channel 1 did not run
        [_record(2_000, 40_000, 6), idle],                          # channel 2: one role ran
    ], dtype=torch.int64)
    assert channel_placement(records, FIELDS) == [
        {"channel": 0, "sm": 124, "end_us": 89.5},
        {"channel": 2, "sm": 6, "end_us": 39.0},
    ]


def test_channel_placement_of_a_kernel_that_did_not_run_is_empty() -> None:
    assert channel_placement(torch.zeros(3, 2, len(FIELDS), dtype=torch.int64), FIELDS) == []
