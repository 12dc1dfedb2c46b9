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


def ddp_ignored_names(model: nn.Module) -> list[str]:
    """What DDP must neither all-reduce nor broadcast: the sharded expert weights and every router's
    rank-local token counts. Pass them to
    `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model` before wrapping."""
    names = [name for name, _ in expert_parameters(model)]
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            names.append(f"{name}.router.local_tokens_per_expert" if name else "router.local_tokens_per_expert")
    return names


def scale_expert_gradients(model: nn.Module, world: int) -> None:
    """Divide the gradients of sharded expert weights by `world` (the data-parallel size), as the
    all-reduce mean does for replicated ones; for use beside DDP that ignores the experts."""
    for _, param in expert_parameters(model):
        if param.grad is not None:
            param.grad.div_(world)


def sync_gradients(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """Average gradients over `group` (default: the world) for a batch split over its ranks.

    Replicated parameters are all-reduced (one flat buffer per dtype); sharded expert weights are
    only scaled (`scale_expert_gradients`). Every expert-parallel group must span `group` itself.
    """
    world = dist.get_world_size(group)
    for module in model.modules():
        if isinstance(module, MoELayer) and module.world not in (1, world):
            raise ValueError(f"sync_gradients: an expert group of {module.world} ranks inside a data-parallel "
                             f"group of {world} ranks is not supported")
    scale_expert_gradients(model, world)
    sharded = {id(p) for _, p in expert_parameters(model)}
    replicated: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in model.parameters():
        if param.grad is not None and id(param) not in sharded:
            replicated.setdefault(param.grad.dtype, []).append(param.grad)
    for grads in replicated.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        for grad, synced in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(synced.view_as(grad))
