"""Summaries of the normal-mode kernels' per-phase profile records (`moe_ep._C` built with `MOE_EP_PROFILE=1`).

The extension hands back, per kernel, int64 records `[channels, roles, fields]`: for each channel
(one block) and role (a warp or warp group, the roles of `prof` in csrc/intranode/api.cuh) the
start, first item, end (ns on the global timer), the time spent in each phase, counts, the number
of warps that wrote the record and the SM the block ran on. Pure Python: tested on the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch

DURATIONS = ("wait_stage", "wait_remote", "copy", "copy_wait", "publish", "meta")
"""Phases whose time the records sum over a role's warps."""


def _ran_and_start(rec: torch.Tensor, col: dict[str, int]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Of float64 profile records [C, roles, fields]: which (channel, role) ran, and the earliest start
    among them (None if none ran)."""
    ran = rec[..., col["writers"]] > 0
    return ran, rec[..., col["start"]][ran].min() if bool(ran.any()) else None


def channel_placement(records: torch.Tensor, fields: list[str]) -> list[dict]:
    """Per channel of one kernel's profile records ([C, roles, fields]): the SM its block ran on and
    when its last role ended (us after the kernel's first role started); channels that did not run
    are left out. Channels that end late on the same few SMs point at block placement, not protocol."""
    col = {name: i for i, name in enumerate(fields)}
    rec = records.to(torch.float64)
    ran, t0 = _ran_and_start(rec, col)
    if t0 is None:
        return []
    out = []
    for c in range(rec.shape[0]):
        if not bool(ran[c].any()):
            continue
        roles = rec[c][ran[c]]
        out.append({"channel": c, "sm": int(roles[0, col["sm"]]),
                    "end_us": float((roles[:, col["end"]].max() - t0) / 1e3)})
    return out


def summarize_profile(data: dict) -> dict:
    """The per-phase timing of one dispatch and one combine from the extension's `last_profile`.

    For each kernel: `kernel_us` (first role start to last role end, all channels) and per role the
    mean and max over channels of: start/first/end (us after the kernel's first role started), span
    (end - start), the time spent waiting inside the block (wait_stage), on peers (wait_remote),
    issuing copies (copy), waiting for bulk copies (copy_wait), publishing tails/heads (publish),
    loading routing metadata (meta), the rest (other), and the counts items / wait_events. Durations
    of a warp group (the combine reducer) are per warp. `channels`: each channel's SM and end
    (`channel_placement`). `raw` keeps the records ([C, roles, fields] int64).
    """
    fields = list(data["fields"])
    out: dict = {"rank": data["rank"], "host_notify_wait_us": data["host_notify_wait_us"], "fields": fields}
    for kernel in ("dispatch", "combine"):
        out[kernel] = _kernel_summary(data[kernel], fields)
    return out


def _kernel_summary(info: dict, fields: list[str]) -> dict:
    col = {name: i for i, name in enumerate(fields)}
    rec = info["records"].to(torch.float64)  # [C, roles, fields]
    summary: dict = {"num_channels": info["num_channels"], "roles": {}, "raw": info["records"].tolist()}
    ran, t0 = _ran_and_start(rec, col)
    if info["num_channels"] == 0 or t0 is None:
        return summary
    summary["kernel_us"] = float((rec[..., col["end"]][ran].max() - t0) / 1e3)
    summary["channels"] = channel_placement(info["records"], fields)
    for r, role in enumerate(info["roles"]):
        mask = ran[:, r]
        if bool(mask.any()):
            summary["roles"][role] = _role_summary(rec[mask, r], col, t0)
    return summary


def _role_summary(v: torch.Tensor, col: dict[str, int], t0: torch.Tensor) -> dict:
    """Mean and max over the channels that ran one role (`v`: their records, [channels, fields])."""
    writers = v[:, col["writers"]]
    row: dict = {"channels": v.size(0), "warps": int(writers.max())}
    per_channel = {
        "start_us": (v[:, col["start"]] - t0) / 1e3,
        "first_us": torch.where(v[:, col["first"]] > 0, (v[:, col["first"]] - t0) / 1e3,
                                torch.full_like(writers, float("nan"))),
        "end_us": (v[:, col["end"]] - t0) / 1e3,
        "span_us": (v[:, col["end"]] - v[:, col["start"]]) / 1e3,
    }
    busy = torch.zeros_like(writers)
    for name in DURATIONS:
        per_warp = v[:, col[name]] / writers / 1e3
        per_channel[f"{name}_us"] = per_warp
        busy += per_warp
    per_channel["other_us"] = per_channel["span_us"] - busy
    per_channel["items"] = v[:, col["items"]]
    per_channel["wait_events"] = v[:, col["wait_events"]]
    for name, values in per_channel.items():
        finite = values[~values.isnan()]
        row[name] = {"mean": float(finite.mean()) if finite.numel() else None,
                     "max": float(finite.max()) if finite.numel() else None}
    return row
