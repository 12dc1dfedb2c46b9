"""Argument checks that run before any communication: each error names the argument and what was expected.

The `*_request` functions check a whole `Buffer` call and return its request (`moe_ep.ops.requests`).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch

from . import logfmt, routing
from .config import Config
from .constants import FP8_BLOCK, NUM_MAX_TOPK, ROW_ALIGNMENT_BYTES
from .handles import DispatchedRouting, DispatchHandle, InternodeDispatchHandle, LowLatencyHandle
from .requests import CombineRequest, DispatchRequest, LowLatencyCombineRequest, LowLatencyDispatchRequest
from .settings import settings


NORMAL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
"""Token dtypes of a normal-mode dispatch or combine (besides FP8 with scales)."""

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
    # Plain comparisons, each property read once: this runs several times in every call (an indexed loop
    # over the sizes costs half of a `zip` over a torch.Size).
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if dtype is not None:
        got = tensor.dtype
        if got is not dtype and (isinstance(dtype, torch.dtype) or got not in dtype):
            allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
            raise TypeError(f"{name}: expected dtype {_fmt_dtypes(allowed)}, got {got}")
    if shape is not None:
        sizes = tensor.shape
        fits = len(sizes) == len(shape)
        if fits:
            i = 0
            for want in shape:
                if want is not None and want != sizes[i]:
                    fits = False
                    break
                i += 1
        if not fits:
            wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {wanted}, got {list(sizes)}")
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
    hidden = tensor.shape[-1]
    if hidden * tensor.element_size() % ROW_ALIGNMENT_BYTES != 0:
        raise ValueError(
            f"{name}: a row must be a multiple of {ROW_ALIGNMENT_BYTES} bytes, got hidden {hidden} x "
            f"{tensor.element_size()} bytes"
        )


def check_fp8_hidden(name: str, hidden: int) -> None:
    if hidden % FP8_BLOCK != 0:
        raise ValueError(f"{name}: FP8 needs a hidden size that is a multiple of {FP8_BLOCK}, got {hidden}")


def check_topk_idx(name: str, topk_idx: object, num_tokens: Optional[int], device: torch.device) -> torch.Tensor:
    """Shape, dtype and device of a `[num_tokens, k]` int64 top-k tensor with 1 <= k <= 32 (any token
    count when `num_tokens` is None)."""
    check_tensor(name, topk_idx, dtype=torch.int64, shape=(num_tokens, None), device=device, contiguous=True)
    num_slots = topk_idx.shape[1]
    if not 1 <= num_slots <= NUM_MAX_TOPK:
        raise ValueError(f"{name}: expected between 1 and {NUM_MAX_TOPK} top-k slots, got {num_slots}")
    return topk_idx


def _topk_defects(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out_of_range [T, k], repeated [T, k-1])` on the device: ids outside `[-1, num_experts)`, and
    ids equal to the previous one in a token's sorted slots."""
    out_of_range = (topk_idx < -1) | (topk_idx >= num_experts)
    ordered = topk_idx.sort(dim=1).values
    return out_of_range, (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)


def _raise_topk_defect(name: str, topk_idx: torch.Tensor, num_experts: int, out_of_range: torch.Tensor,
                       repeated: torch.Tensor, any_out_of_range: bool, any_repeated: bool) -> None:
    """Raise for the first defect found by `_topk_defects` (looking up its details on the device)."""
    if any_out_of_range:
        bad = int(topk_idx[out_of_range][0])
        raise ValueError(f"{name}: expert ids must be -1 (masked) or in [0, {num_experts}), found {bad}")
    if any_repeated:
        token = int(repeated.any(1).nonzero()[0])
        raise ValueError(f"{name}: token {token} selects the same expert more than once: {topk_idx[token].tolist()}")


def check_topk_values(name: str, topk_idx: torch.Tensor, num_experts: int) -> None:
    """Expert ids in `[-1, num_experts)` and no expert selected twice by one token."""
    if topk_idx.numel() == 0 or not value_checks_enabled():
        return
    out_of_range, repeated = _topk_defects(topk_idx, num_experts)
    # One host synchronization for both checks; the details are looked up only on failure.
    flags = torch.stack([out_of_range.any(), repeated.any()]).tolist()
    _raise_topk_defect(name, topk_idx, num_experts, out_of_range, repeated, *flags)


def check_layout_values(topk_idx: Optional[torch.Tensor], num_tokens_per_rank: torch.Tensor,
                        is_token_in_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor, num_ranks: int) -> None:
    """A dispatch's layout describes its `topk_idx`: `is_token_in_rank` and `num_tokens_per_expert` are
    what `get_dispatch_layout(topk_idx)` computes, `num_tokens_per_rank` the column sums of
    `is_token_in_rank`; and `topk_idx` passes `check_topk_values`. One host synchronization for all
    of it; skipped with the value checks (a layout of another top-k then sends tokens where it says)."""
    if not value_checks_enabled():
        return
    num_experts = num_tokens_per_expert.numel()
    flags = [torch.ne(is_token_in_rank.sum(0, dtype=torch.int32), num_tokens_per_rank).any()]
    if topk_idx is not None:
        out_of_range, repeated = _topk_defects(topk_idx, num_experts)
        valid = topk_idx.masked_fill(out_of_range, -1)  # the layout's math needs ids in range
        in_rank = routing.token_rank_mask(valid, num_experts, num_ranks)
        per_expert = routing.tokens_per_expert(valid, num_experts)
        flags += [out_of_range.any(), repeated.any(), torch.ne(is_token_in_rank, in_rank).any(),
                  torch.ne(num_tokens_per_expert, per_expert).any()]
    rank_sums_differ, *topk_flags = torch.stack(flags).tolist()
    if topk_idx is not None:
        any_out_of_range, any_repeated, in_rank_differs, per_expert_differs = topk_flags
        _raise_topk_defect("topk_idx", topk_idx, num_experts, out_of_range, repeated, any_out_of_range, any_repeated)
        if in_rank_differs:
            token, rank = (torch.ne(is_token_in_rank, in_rank)).nonzero()[0].tolist()
            raise ValueError(f"is_token_in_rank: does not match topk_idx (token {token}, rank {rank}: "
                             f"{bool(is_token_in_rank[token, rank])}, topk_idx says {bool(in_rank[token, rank])}); "
                             f"pass get_dispatch_layout's outputs for this topk_idx")
        if per_expert_differs:
            expert = int(torch.ne(num_tokens_per_expert, per_expert).nonzero()[0])
            raise ValueError(f"num_tokens_per_expert: does not match topk_idx (expert {expert}: "
                             f"{int(num_tokens_per_expert[expert])}, topk_idx selects it {int(per_expert[expert])} "
                             f"times); pass get_dispatch_layout's outputs for this topk_idx")
    if rank_sums_differ:
        raise ValueError("num_tokens_per_rank: does not match the column sums of is_token_in_rank")


def check_dispatched_routing(name: str, topk_idx: torch.Tensor, routing_of_dispatch: DispatchedRouting) -> None:
    """A low-latency combine's `topk_idx` is its dispatch's: same shape (always checked) and values (when
    the handle kept them and value checks are on)."""
    if topk_idx.shape != routing_of_dispatch.shape:
        raise ValueError(f"{name}: expected the dispatch's top-k of shape {list(routing_of_dispatch.shape)} (the "
                         f"dispatch behind handle), got {list(topk_idx.shape)}")
    kept = routing_of_dispatch.topk_idx
    if kept is None or topk_idx.numel() == 0 or not value_checks_enabled():
        return
    differs = torch.ne(topk_idx, kept).any(1)
    if bool(differs.any()):
        token = int(differs.nonzero()[0])
        raise ValueError(f"{name}: routes token {token} to experts {topk_idx[token].tolist()}, but the dispatch behind "
                         f"handle sent it to {kept[token].tolist()}; pass the dispatch's topk_idx")


def check_topk_weights(name: str, topk_weights: object, topk_idx: torch.Tensor) -> torch.Tensor:
    return check_tensor(name, topk_weights, dtype=torch.float32, shape=topk_idx.shape, device=topk_idx.device,
                        contiguous=True)


# ------------------------------------------------------------------ requests of the Buffer's operations


_HANDLE_TYPES = {len(DispatchHandle._fields): DispatchHandle,
                 len(InternodeDispatchHandle._fields): InternodeDispatchHandle}


def check_dispatch_handle(handle: object, num_tokens: Optional[int], num_ranks: int,
                          device: torch.device) -> DispatchHandle:
    """A normal-mode handle, one-node or internode (`num_tokens`: the source tokens it must describe, None
    for any). An internode handle stays one: its first fields are a `DispatchHandle`'s. A handle whose
    `origin` has this group size and device needs no tensor checks (`HandleOrigin`)."""
    if isinstance(handle, DispatchHandle):
        origin = handle.origin
        if (origin is not None and origin.num_ranks == num_ranks and origin.device == device
                and (num_tokens is None or origin.num_tokens == num_tokens)):
            return handle
        hdl = handle
    elif isinstance(handle, InternodeDispatchHandle):
        hdl = handle
    elif isinstance(handle, tuple) and len(handle) in _HANDLE_TYPES:
        hdl = _HANDLE_TYPES[len(handle)](*handle)  # a plain tuple, as DeepEP's handles are
    else:
        raise ValueError("handle: expected the handle returned by dispatch")
    check_tensor("handle.rank_prefix_matrix", hdl.rank_prefix_matrix, dtype=torch.int32,
                 shape=(num_ranks, num_ranks), device=device)
    check_tensor("handle.is_token_in_rank", hdl.is_token_in_rank, dtype=torch.bool,
                 shape=(num_tokens, num_ranks), device=device)
    check_tensor("handle.recv_src_idx", hdl.recv_src_idx, dtype=torch.int32, shape=(None,), device=device)
    return hdl


def check_low_latency_handle(handle: object, num_ranks: int) -> LowLatencyHandle:
    """A low-latency handle; one whose dispatch routed over this group size needs no tensor check
    (`DispatchedRouting`)."""
    if isinstance(handle, LowLatencyHandle):
        if handle.routing is not None and handle.routing.num_ranks == num_ranks:
            return handle
        hdl = handle  # keeps its routing
    elif isinstance(handle, tuple) and len(handle) == len(LowLatencyHandle._fields):
        hdl = LowLatencyHandle(*handle)
    else:
        raise ValueError("handle: expected the handle returned by low_latency_dispatch")
    check_tensor("handle.layout_range", hdl.layout_range, dtype=torch.int64,
                 shape=(hdl.num_experts // num_ranks, num_ranks))
    return hdl


def _device_of(x: object) -> torch.device:
    """Where the other tensors of a call must be: `x`'s device (the CPU when `x` is no tensor, which
    its own check then rejects)."""
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


def _check_tokens(x: object, device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A dispatch's `x`: rows, or FP8 rows with their scales, the scales on `device` (where the rows are);
    returns `(data, scales or None)`."""
    if not isinstance(x, tuple):
        check_tensor("x", x, dtype=NORMAL_DTYPES, shape=(None, None), contiguous=True)
        check_hidden_bytes("x", x)
        return x, None
    if len(x) != 2:
        raise ValueError(f"x: expected a tensor or a (data, scales) pair, got a tuple of {len(x)}")
    data, scales = x
    check_tensor("x[0]", data, dtype=torch.float8_e4m3fn, shape=(None, None), contiguous=True)
    check_fp8_hidden("x[0]", data.size(1))
    check_tensor("x[1]", scales, dtype=(torch.float32, torch.int32), shape=(data.size(0), None), device=device)
    if scales.size(1) < 1 or scales.stride(1) != 1 and scales.size(1) > 1:
        raise ValueError(f"x[1]: expected scales with contiguous rows, got strides {scales.stride()}")
    return data, scales


def _check_layout(num_tokens_per_rank: object, is_token_in_rank: object, num_tokens_per_expert: object,
                  num_tokens: int, num_ranks: int, device: torch.device) -> None:
    if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
        raise ValueError("num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: required without a "
                         "handle (from get_dispatch_layout)")
    check_tensor("num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(num_ranks,), device=device)
    check_tensor("is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(num_tokens, num_ranks),
                 device=device, contiguous=True)
    check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32, shape=(None,), device=device)
    check_num_experts(num_tokens_per_expert.numel(), num_ranks)


def dispatch_request(x: object, handle: object, num_tokens_per_rank: object, is_token_in_rank: object,
                     num_tokens_per_expert: object, topk_idx: object, topk_weights: object, expert_alignment: object,
                     num_worst_tokens: object, config: Config, num_ranks: int) -> DispatchRequest:
    """The checked request of a `Buffer.dispatch` call (a cached dispatch with `handle`)."""
    check_positive_int("expert_alignment", expert_alignment)
    check_positive_int("num_worst_tokens", num_worst_tokens, minimum=0)
    device = _device_of(x[0] if isinstance(x, tuple) and x else x)
    data, scales = _check_tokens(x, device)
    if handle is not None:
        if (num_tokens_per_rank is not None or is_token_in_rank is not None or num_tokens_per_expert is not None
                or topk_idx is not None or topk_weights is not None):
            raise ValueError("handle: a cached dispatch takes no layout, topk_idx or topk_weights")
        hdl = check_dispatch_handle(handle, data.shape[0], num_ranks, device)
        return DispatchRequest(data, scales, None, None, None, None, None, expert_alignment, num_worst_tokens, config,
                               hdl)
    _check_layout(num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, data.size(0), num_ranks, device)
    if topk_idx is not None:
        check_topk_idx("topk_idx", topk_idx, data.size(0), device)
        if topk_weights is not None:
            check_topk_weights("topk_weights", topk_weights, topk_idx)
    elif topk_weights is not None:
        raise ValueError("topk_weights: given without topk_idx")
    check_layout_values(topk_idx, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, num_ranks)
    return DispatchRequest(data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                           num_tokens_per_expert, expert_alignment, num_worst_tokens, config)


def _split_bias(bias: object) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    if bias is None or isinstance(bias, torch.Tensor):
        return bias, None
    if isinstance(bias, tuple) and len(bias) == 2:
        return bias
    raise ValueError(f"bias: expected None, a tensor or a tuple of two tensors, got {type(bias).__name__}")


def combine_request(x: object, handle: object, topk_weights: object, bias: object, config: Config,
                    num_ranks: int) -> CombineRequest:
    """The checked request of a `Buffer.combine` call."""
    device = _device_of(x)
    bias_0, bias_1 = _split_bias(bias)
    check_tensor("x", x, dtype=NORMAL_DTYPES, shape=(None, None), contiguous=True)
    check_hidden_bytes("x", x)
    hdl = check_dispatch_handle(handle, None, num_ranks, device)
    rows = x.shape[0]
    if rows != hdl.recv_src_idx.numel():
        raise ValueError(f"x: expected {hdl.recv_src_idx.numel()} rows (as dispatched), got {rows}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(rows, None), device=device,
                     contiguous=True)
    for name, b in (("bias[0]", bias_0), ("bias[1]", bias_1)):
        if b is not None:
            check_tensor(name, b, dtype=x.dtype, shape=(hdl.is_token_in_rank.size(0), x.size(1)), device=device,
                         contiguous=True)
    return CombineRequest(x, hdl, topk_weights, bias_0, bias_1, config)


def _check_hook_without_async(async_finish: bool, return_recv_hook: bool) -> None:
    if async_finish and return_recv_hook:
        raise ValueError("return_recv_hook: cannot be combined with async_finish")


def low_latency_dispatch_request(x: object, topk_idx: object, num_max_dispatch_tokens_per_rank: object,
                                 num_experts: object, cumulative_local_expert_recv_stats: object,
                                 dispatch_wait_recv_cost_stats: object, use_fp8: bool, round_scale: bool,
                                 use_ue8m0: bool, async_finish: bool, return_recv_hook: bool,
                                 num_ranks: int) -> LowLatencyDispatchRequest:
    """The checked request of a `Buffer.low_latency_dispatch` call."""
    device = _device_of(x)
    if use_ue8m0 and not (use_fp8 and round_scale):
        raise ValueError("use_ue8m0: requires use_fp8=True and round_scale=True")
    _check_hook_without_async(async_finish, return_recv_hook)
    check_positive_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
    check_num_experts(num_experts, num_ranks)
    check_tensor("x", x, dtype=torch.bfloat16, shape=(None, None), contiguous=True)
    check_hidden_bytes("x", x)
    num_tokens, hidden = x.shape
    if use_fp8:
        check_fp8_hidden("x", hidden)
    if num_tokens > num_max_dispatch_tokens_per_rank:
        raise ValueError(f"x: {num_tokens} tokens exceed num_max_dispatch_tokens_per_rank="
                         f"{num_max_dispatch_tokens_per_rank}")
    check_topk_idx("topk_idx", topk_idx, num_tokens, device)
    check_topk_values("topk_idx", topk_idx, num_experts)
    if cumulative_local_expert_recv_stats is not None:
        check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, dtype=torch.int32,
                     shape=(num_experts // num_ranks,), device=device)
    if dispatch_wait_recv_cost_stats is not None:
        check_tensor("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, dtype=torch.int64,
                     shape=(num_ranks,), device=device)
    return LowLatencyDispatchRequest(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                     cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                     round_scale, use_ue8m0, return_recv_hook)


def low_latency_combine_request(x: object, topk_idx: object, topk_weights: object, handle: object, use_logfmt: bool,
                                zero_copy: bool, async_finish: bool, return_recv_hook: bool, out: object,
                                combine_wait_recv_cost_stats: object, num_ranks: int) -> LowLatencyCombineRequest:
    """The checked request of a `Buffer.low_latency_combine` call."""
    device = _device_of(x)
    if use_logfmt and zero_copy:
        raise ValueError("use_logfmt: cannot be combined with zero_copy (as in DeepEP); pass one of them")
    _check_hook_without_async(async_finish, return_recv_hook)
    hdl = check_low_latency_handle(handle, num_ranks)
    if use_logfmt:
        logfmt.check_hidden("use_logfmt", hdl.hidden)
    max_tokens = hdl.num_max_dispatch_tokens_per_rank
    check_tensor("x", x, dtype=torch.bfloat16, shape=(hdl.num_experts // num_ranks, num_ranks * max_tokens, hdl.hidden),
                 contiguous=True)
    check_topk_idx("topk_idx", topk_idx, None, device)
    num_tokens = topk_idx.shape[0]
    if num_tokens > max_tokens:
        raise ValueError(f"topk_idx: {num_tokens} tokens exceed num_max_dispatch_tokens_per_rank={max_tokens}")
    if hdl.routing is not None:
        check_dispatched_routing("topk_idx", topk_idx, hdl.routing)
    if hdl.routing is None or hdl.routing.topk_idx is None:  # else equal to ids the dispatch checked
        check_topk_values("topk_idx", topk_idx, hdl.num_experts)
    check_topk_weights("topk_weights", topk_weights, topk_idx)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(num_tokens, hdl.hidden), device=device,
                     contiguous=True)
    if combine_wait_recv_cost_stats is not None:
        check_tensor("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, dtype=torch.int64,
                     shape=(num_ranks,), device=device)
    return LowLatencyCombineRequest(x, topk_idx, topk_weights, hdl, zero_copy, return_recv_hook, out,
                                    combine_wait_recv_cost_stats, bool(use_logfmt))
