"""Merge a sharded checkpoint of `train_deepseek_v3.py` into one full checkpoint.

    python examples/convert_checkpoint.py runs/deepseek_v3/checkpoint runs/deepseek_v3/full.pt

A sharded checkpoint is a folder with `replicated.pt` (step, model arguments, history, the
parameters every rank holds, their optimizer state) and one `experts-rank{r}-of-{world}.pt` per rank
(its expert weights and their optimizer state). The full checkpoint holds `step`, `model_args` and a
`model` state dict with every expert (`[num_experts, ...]`), loadable at any world size
(`train_deepseek_v3.py --init-from`), or by `MoELayer.load_state_dict` directly.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

REPLICATED = "replicated.pt"


def shard_path(folder: Path, rank: int, world: int) -> Path:
    """Where rank `rank` of `world` keeps its expert shard."""
    return folder / f"experts-rank{rank:03d}-of-{world:03d}.pt"


def merge_checkpoint(folder: Path) -> dict[str, Any]:
    """The full checkpoint of the sharded one in `folder` (optimizer state dropped)."""
    replicated = torch.load(folder / REPLICATED, weights_only=True)
    world = replicated["world"]
    shards = [torch.load(shard_path(folder, rank, world), weights_only=True)["model"] for rank in range(world)]
    model = dict(replicated["model"])
    for key in shards[0]:
        model[key] = torch.cat([shard[key] for shard in shards])  # contiguous: rank r holds block r
    return {"step": replicated["step"], "model_args": replicated["model_args"], "model": model}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="sharded checkpoint folder")
    parser.add_argument("output", type=Path, help="full checkpoint file to write")
    args = parser.parse_args()
    full = merge_checkpoint(args.checkpoint)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(full, args.output)
    num_params = sum(t.numel() for t in full["model"].values())
    print(f"wrote {args.output}: step {full['step']}, {len(full['model'])} tensors, {num_params:,} values")


if __name__ == "__main__":
    main()
