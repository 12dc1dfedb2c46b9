"""Communication backends behind `moe_ep.Buffer`: `torch` (always available) and `cuda` (`moe_ep._C`)."""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.distributed as dist

from .base import CommBackend


@functools.cache
def cuda_extension_available() -> bool:
    """Whether the CUDA extension `moe_ep._C` is built and a GPU is visible."""
    return torch.cuda.is_available() and importlib.util.find_spec("moe_ep._C") is not None


def create_backend(name: str, group: dist.ProcessGroup, rank: int, num_ranks: int, **options: object) -> CommBackend:
    """Instantiate the backend called `name` ("torch", "cuda", or "cuda_internode": normal mode across nodes)
    for `group`."""
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend(group, rank, num_ranks)
    if name == "cuda":
        if not cuda_extension_available():
            raise RuntimeError("backend='cuda': moe_ep._C is not built or no GPU is visible "
                               "(build with `pip install --no-build-isolation -e .` on a CUDA machine)")
        from .cuda_backend import CudaBackend

        return CudaBackend(group, rank, num_ranks, **options)
    if name == "cuda_internode":
        if not torch.cuda.is_available():
            raise RuntimeError("backend='cuda': no GPU is visible")
        from .cuda_internode import CudaInternodeBackend

        return CudaInternodeBackend(group, rank, num_ranks, **options)
    raise ValueError(f"backend: unknown backend {name!r}")
