"""Data parallelism around expert-parallel `MoELayer`s: which parameters are sharded, and gradient sync.

With experts sharded over the same ranks that split the batch, an expert's gradient on its owner
already sums every rank's tokens (dispatch and combine carry them there and back), so it must not be
all-reduced again; it only needs the same `1 / world` as the replicated parameters get from the
all-reduce mean. Layers whose expert group has one rank hold every expert and are plain replicas.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..layers import MoELayer


def expert_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """`(name, parameter)` of every expert weight sharded over more than one rank."""
    for name, module in model.named_modules():
        if isinstance(module, MoELayer) and module.world > 1:
            prefix = f"{name}.experts." if name else "experts."
            yield from ((prefix + p_name, p) for p_name, p in module.experts.named_parameters())


def sync_gradients(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """Average gradients over `group` (default: the world) for a batch split over its ranks.

    Replicated parameters are all-reduced (one flat buffer per dtype); sharded expert weights are
    only scaled by `1 / world`. Every expert-parallel group must span `group` itself.
    """
    world = dist.get_world_size(group)
    for module in model.modules():
        if isinstance(module, MoELayer) and module.world not in (1, world):
            raise ValueError(f"sync_gradients: an expert group of {module.world} ranks inside a data-parallel "
                             f"group of {world} ranks is not supported")
    sharded = {id(p) for _, p in expert_parameters(model)}
    replicated: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in model.parameters():
        if param.grad is None:
            continue
        if id(param) in sharded:
            param.grad.div_(world)
        else:
            replicated.setdefault(param.grad.dtype, []).append(param.grad)
    for grads in replicated.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        for grad, synced in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(synced.view_as(grad))
