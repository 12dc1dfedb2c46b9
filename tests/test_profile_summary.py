"""The profile summary: per-channel placement and per-role phases (pure Python over the kernels' raw records)."""

import torch

from moe_ep.ops.backends.profile_summary import channel_placement, summarize_profile

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


def test_summary_of_roles_per_kernel() -> None:
    """Two channels run the one role (two warps each); the combine did not run."""
    first, second = _record(1000, 5000, 3, writers=2), _record(3000, 4000, 7, writers=2)
    first[FIELDS.index("copy")], second[FIELDS.index("copy")] = 2000, 1000  # ns over both warps
    first[FIELDS.index("first")], first[FIELDS.index("items")] = 1500, 6
    data = {"rank": 1, "host_notify_wait_us": 2.5, "fields": FIELDS,
            "dispatch": {"num_channels": 2, "roles": ["sender"], "records": torch.tensor([[first], [second]])},
            "combine": {"num_channels": 0, "roles": ["sender"], "records": torch.zeros(0, 1, len(FIELDS),
                                                                                       dtype=torch.int64)}}
    summary = summarize_profile(data)
    assert (summary["rank"], summary["host_notify_wait_us"], summary["fields"]) == (1, 2.5, FIELDS)
    assert summary["combine"] == {"num_channels": 0, "roles": {}, "raw": []}
    dispatch = summary["dispatch"]
    assert dispatch["kernel_us"] == 4.0 and dispatch["raw"] == [[first], [second]]
    assert dispatch["channels"] == [{"channel": 0, "sm": 3, "end_us": 4.0}, {"channel": 1, "sm": 7, "end_us": 3.0}]
    role = dispatch["roles"]["sender"]
    assert (role["channels"], role["warps"]) == (2, 2)
    assert role["span_us"] == {"mean": 2.5, "max": 4.0}
    assert role["copy_us"] == {"mean": 0.75, "max": 1.0}  # per warp
    assert role["other_us"] == {"mean": 1.75, "max": 3.0}
    assert role["first_us"] == {"mean": 0.5, "max": 0.5}  # the channel without a first item is left out
    assert role["items"] == {"mean": 3.0, "max": 6.0}
