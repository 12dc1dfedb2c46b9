"""The autograd ops on GPUs: gradients against the dense reference of the CPU tests (a GPU per rank over
NCCL where the machine has enough, else ranks sharing the GPUs over gloo)."""

from __future__ import annotations

import pytest
import torch

import test_autograd as cpu
from moe_ep.ops.backends import cuda_extension_available
from moe_ep.ops.backends.cuda_low_latency import low_latency_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")
# The CUDA kernels move BF16/FP8 tokens; float64 runs on the torch backend.
FP8_BACKENDS = ["torch", "cuda"] if cuda_extension_available() else ["torch"]


@pytest.mark.parametrize("world", [2, 3])
def test_float64_gradients_torch_backend_on_gpu(gpu_pool, world: int) -> None:
    cpu.check_float64_grads(gpu_pool(world).run(cpu._normal_grads, False, "cuda", "torch"), world)


@pytest.mark.parametrize("backend", FP8_BACKENDS)
def test_fp8_dispatch_gradients_on_gpu(gpu_pool, backend: str) -> None:
    cpu.check_fp8_grads(gpu_pool(2).run(cpu._normal_grads, True, "cuda", backend), 2)


@pytest.mark.parametrize("backend", FP8_BACKENDS)
def test_low_latency_gradients_on_gpu(gpu_pool, backend: str) -> None:
    if backend == "cuda" and not low_latency_available():
        pytest.skip("moe_ep._low_latency was not built (NVSHMEM missing or MOE_EP_BUILD_LOW_LATENCY=0)")
    cpu.check_low_latency_grads(gpu_pool(3).run(cpu._low_latency_grads, "cuda", backend), 3)
