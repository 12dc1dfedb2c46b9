"""Argument checks that run before any communication: each error names the argument and what was expected."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch

from .config import NUM_MAX_TOPK
from .settings import settings

ROW_ALIGNMENT_BYTES = 16
FP8_BLOCK = 128

DTypes = Union[torch.dtype, Sequence[torch.dtype]]


class PeerInputError(ValueError):
    """Raised on every rank when another rank rejected its own input or disagreed on a setting."""


def value_checks_enabled() -> bool:
    """Whether to check tensor values (expert ids in range, no repeats): they read device data, so they
    are skipped while a CUDA graph is being captured and when `MOE_EP_CHECK_VALUES=0`."""
    if not settings().check_values:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d) for d in dtypes)


def check_tensor(
    name: str,
    tensor: object,
    *,
    dtype: Optional[DTypes] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check type, dtype, shape (None entries match any size), device and contiguity of one tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if tensor.dtype not in allowed:
            raise TypeError(f"{name}: expected dtype {_fmt_dtypes(allowed)}, got {tensor.dtype}")
    if shape is not None:
        if tensor.dim() != len(shape) or any(want is not None and want != got for want, got in zip(shape, tensor.shape)):
            wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {wanted}, got {list(tensor.shape)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {tensor.device}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (strides {tensor.stride()} for shape {list(tensor.shape)})")
    return tensor


def check_positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return value


def check_num_experts(num_experts: object, num_ranks: int) -> int:
    check_positive_int("num_experts", num_experts)
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts: expected a multiple of the group size {num_ranks}, got {num_experts}")
    return num_experts


def check_hidden_bytes(name: str, tensor: torch.Tensor) -> None:
    """Rows are moved as 16-byte vectors: the row size in bytes must be a multiple of 16."""
    row_bytes = tensor.size(-1) * tensor.element_size()
    if row_bytes % ROW_ALIGNMENT_BYTES != 0:
        raise ValueError(
            f"{name}: a row must be a multiple of {ROW_ALIGNMENT_BYTES} bytes, got hidden {tensor.size(-1)} x "
            f"{tensor.element_size()} bytes"
        )


def check_fp8_hidden(name: str, hidden: int) -> None:
    if hidden % FP8_BLOCK != 0:
        raise ValueError(f"{name}: FP8 needs a hidden size that is a multiple of {FP8_BLOCK}, got {hidden}")


def check_topk_idx(name: str, topk_idx: object, num_tokens: Optional[int], device: torch.device) -> torch.Tensor:
    """Shape, dtype and device of a `[num_tokens, k]` int64 top-k tensor with 1 <= k <= 32 (any token
    count when `num_tokens` is None)."""
    check_tensor(name, topk_idx, dtype=torch.int64, shape=(num_tokens, None), device=device, contiguous=True)
    if not 1 <= topk_idx.size(1) <= NUM_MAX_TOPK:
        raise ValueError(f"{name}: expected between 1 and {NUM_MAX_TOPK} top-k slots, got {topk_idx.size(1)}")
    return topk_idx


def check_topk_values(name: str, topk_idx: torch.Tensor, num_experts: int) -> None:
    """Expert ids in `[-1, num_experts)` and no expert selected twice by one token."""
    if topk_idx.numel() == 0 or not value_checks_enabled():
        return
    out_of_range = (topk_idx < -1) | (topk_idx >= num_experts)
    ordered = topk_idx.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    # One host synchronization for both checks; the details are looked up only on failure.
    any_out_of_range, any_repeated = torch.stack([out_of_range.any(), repeated.any()]).tolist()
    if any_out_of_range:
        bad = int(topk_idx[out_of_range][0])
        raise ValueError(f"{name}: expert ids must be -1 (masked) or in [0, {num_experts}), found {bad}")
    if any_repeated:
        token = int(repeated.any(1).nonzero()[0])
        raise ValueError(f"{name}: token {token} selects the same expert more than once: {topk_idx[token].tolist()}")


def check_topk_weights(name: str, topk_weights: object, topk_idx: torch.Tensor) -> torch.Tensor:
    return check_tensor(name, topk_weights, dtype=torch.float32, shape=tuple(topk_idx.shape), device=topk_idx.device,
                        contiguous=True)
