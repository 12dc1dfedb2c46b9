"""`moe_ep.Buffer`: a drop-in for DeepEP V1's `deep_ep.Buffer` over interchangeable backends."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from . import validation as check
from .backends import create_backend, cuda_extension_available
from .backends.base import CommBackend
from .config import Config, default_combine_config, default_dispatch_config, low_latency_buffer_bytes
from .event import EventOverlap, capture_event
from .handles import DispatchHandle, LowLatencyHandle
from .routing import NUM_MAX_NVL_PEERS
from .streams import CommStreams, StreamScope

topk_idx_t = torch.int64
"""dtype of top-k expert indices everywhere in the API."""

Tokens = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
Bias = Union[None, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]

_NORMAL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(
    (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int32))}


class Buffer:
    """Expert-parallel communication buffer: normal mode (throughput) and low-latency mode (decode).

    Same constructor, methods, arguments and return tuples as DeepEP V1's `deep_ep.Buffer`, plus
    `backend`: `"torch"` (torch.distributed collectives; gloo on CPU, NCCL on GPU), `"cuda"` (the
    `moe_ep._C` kernels) or `"auto"` (CUDA kernels for GPU tensors when the extension is built,
    the torch backend otherwise, e.g. beyond one node of 8 ranks or without buffer bytes). Any world
    size works; see docs/semantics.md for exact outputs.
    """

    num_sms: int = 20

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        backend: str = "auto",
        *,
        use_fabric: bool = False,
        enable_shrink: bool = False,
        comm: Optional[object] = None,
    ) -> None:
        if backend not in ("auto", "torch", "cuda"):
            raise ValueError(f"backend: expected 'auto', 'torch' or 'cuda', got {backend!r}")
        # DeepEP's later V1 arguments, passed by name by its clients: fabric memory handles change
        # nothing here (as allow_mnnvl); rank masking and MPI communicators are not implemented.
        if enable_shrink:
            raise ValueError("enable_shrink: DeepEP's shrink mode (masking failed ranks) is not supported; "
                             "pass enable_shrink=False")
        if comm is not None:
            raise ValueError("comm: mpi4py communicators are not supported; pass a torch.distributed group")
        if not dist.is_initialized():
            raise RuntimeError("group: torch.distributed is not initialized; call init_process_group first")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            check.check_positive_int(name, value, minimum=0)
        check.check_positive_int("num_qps_per_rank", num_qps_per_rank)
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.use_fabric = use_fabric
        self.explicitly_destroy = explicitly_destroy
        self.backend = backend
        self._streams = CommStreams()
        self._torch = create_backend("torch", self.group, self.rank, self.group_size)
        self._cuda: Optional[CommBackend] = None
        if backend == "cuda" or (backend == "auto" and self._cuda_fits()):
            self._cuda = create_backend("cuda", self.group, self.rank, self.group_size, num_nvl_bytes=num_nvl_bytes,
                                        num_rdma_bytes=num_rdma_bytes, low_latency_mode=low_latency_mode,
                                        explicitly_destroy=explicitly_destroy)
        self._destroyed = False

    def _cuda_fits(self) -> bool:
        """`auto` picks the CUDA kernels for one NVLink node of NCCL ranks with buffers to work in."""
        has_buffer = self.num_rdma_bytes > 0 if self.low_latency_mode else self.num_nvl_bytes > 0
        return (cuda_extension_available() and _is_nccl(self.group) and self.group_size <= NUM_MAX_NVL_PEERS
                and has_buffer)

    # ------------------------------------------------------------------ static helpers

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the CUDA extension was built with Hopper (sm_90) kernels."""
        if not cuda_extension_available():
            return False
        from .backends.cuda_backend import is_sm90_compiled

        return is_sm90_compiled()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs used by normal-mode kernels (must be even: one channel is two SMs)."""
        if not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2 != 0:
            raise ValueError(f"new_num_sms: expected a positive even integer, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current CUDA stream (empty on CPU)."""
        return capture_event()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of symmetric buffer low-latency mode needs for these sizes."""
        return low_latency_buffer_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Recommended dispatch `Config` for a world size (any size is accepted)."""
        check.check_positive_int("num_ranks", num_ranks)
        return default_dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Recommended combine `Config` for a world size (any size is accepted)."""
        check.check_positive_int("num_ranks", num_ranks)
        return default_combine_config(num_ranks, Buffer.num_sms)

    def get_comm_stream(self) -> Optional[torch.cuda.Stream]:
        """The communication stream of the current CUDA device (None without CUDA)."""
        if not torch.cuda.is_available():
            return None
        return self._streams.get(torch.device("cuda", torch.cuda.current_device()))

    def destroy(self) -> None:
        """Release the backends' resources; requires `explicitly_destroy=True` as in DeepEP."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy: the Buffer was created with explicitly_destroy=False")
        for backend in (self._cuda, self._torch):
            if backend is not None:
                backend.destroy()
        self._cuda = None
        self._destroyed = True

    def check_errors(self) -> None:
        """Wait for this rank's queued CUDA work, then raise what the CUDA backend's kernels reported and
        no call raised yet: the `ValueError` of a dispatch whose `num_worst_tokens` was too small (found
        without a host wait, see docs/semantics.md) or the `RuntimeError` of a failed kernel, normal or
        low-latency. The torch backend raises in the call itself."""
        from .backends.cuda_backend import CudaBackend

        if isinstance(self._cuda, CudaBackend):
            self._cuda.check_errors()

    def backend_name_for(self, tensor: torch.Tensor) -> str:
        """Which backend ("torch" or "cuda") serves operations on tensors like `tensor`."""
        return self._backend_for(tensor).name

    # ------------------------------------------------------------------ internals

    def _backend_for(self, tensor: torch.Tensor) -> CommBackend:
        if self._destroyed:
            raise RuntimeError("Buffer: used after destroy()")
        if self.backend == "torch" or (self.backend == "auto" and (self._cuda is None or not tensor.is_cuda)):
            return self._torch
        if not tensor.is_cuda:
            raise ValueError(f"x: backend='cuda' needs CUDA tensors, got a tensor on {tensor.device}")
        assert self._cuda is not None
        return self._cuda

    def _validated(self, backend: CommBackend, op: str, device: torch.device,
                   checks: Callable[[], dict[str, int]]) -> None:
        """Run local checks, then let every rank fail together if any rank's checks failed."""
        try:
            fields, error = checks(), None
        except (TypeError, ValueError) as exc:
            fields, error = {}, exc
        backend.agree(op, fields, error, device)

    def _scope(self, device: torch.device, previous_event: Optional[EventOverlap], async_finish: bool,
               allocate_on_comm_stream: bool) -> StreamScope:
        return StreamScope(self._streams, device, previous_event, async_finish, allocate_on_comm_stream)

    def _require_low_latency(self, op: str) -> None:
        if not self.low_latency_mode:
            raise ValueError(f"{op}: the Buffer was created with low_latency_mode=False")

    # ------------------------------------------------------------------ normal mode

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """Counts per rank, per node (None in one node) and per expert, and `is_token_in_rank [T, R]`."""
        check.check_topk_idx("topk_idx", topk_idx, None, getattr(topk_idx, "device", None))
        check.check_num_experts(num_experts, self.group_size)
        check.check_topk_values("topk_idx", topk_idx, num_experts)
        backend = self._backend_for(topk_idx)
        scope = self._scope(topk_idx.device, previous_event, async_finish, allocate_on_comm_stream)
        with scope.run():
            layout = backend.get_dispatch_layout(topk_idx, num_experts)
        event = scope.finish([topk_idx], list(layout))
        return (*layout, event)

    def dispatch(
        self,
        x: Tokens,
        handle: Optional[DispatchHandle] = None,
        num_tokens_per_rank: Optional[torch.Tensor] = None,
        num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
        is_token_in_rank: Optional[torch.Tensor] = None,
        num_tokens_per_expert: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Tokens, Optional[torch.Tensor], Optional[torch.Tensor], Optional[list[int]], Optional[DispatchHandle],
               EventOverlap]:
        """Send each token to every rank holding one of its experts (see DeepEP's `dispatch`).

        Returns `(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event)`; with a cached `handle`, only `recv_x` and `event` are set.
        """
        data, scales = x if isinstance(x, tuple) else (x, None)
        config = config if config is not None else self.get_dispatch_config(self.group_size)
        data_device = data.device if isinstance(data, torch.Tensor) else torch.device("cpu")
        backend = self._backend_for(data if isinstance(data, torch.Tensor) else torch.empty(0))
        cached = handle is not None

        def checks() -> dict[str, int]:
            check.check_positive_int("expert_alignment", expert_alignment)
            check.check_positive_int("num_worst_tokens", num_worst_tokens, minimum=0)
            num_tokens, hidden = self._check_tokens(data, scales, data_device)
            if cached:
                if any(t is not None for t in (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                               topk_idx, topk_weights)):
                    raise ValueError("handle: a cached dispatch takes no layout, topk_idx or topk_weights")
                _check_handle(handle, num_tokens, self.group_size, data_device)
                num_experts = num_topk = 0
            else:
                num_experts = self._check_layout(num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                                 num_tokens, data_device)
                num_topk = 0
                if topk_idx is not None:
                    check.check_topk_idx("topk_idx", topk_idx, num_tokens, data_device)
                    check.check_topk_values("topk_idx", topk_idx, num_experts)
                    num_topk = topk_idx.size(1)
                    if topk_weights is not None:
                        check.check_topk_weights("topk_weights", topk_weights, topk_idx)
                elif topk_weights is not None:
                    raise ValueError("topk_weights: given without topk_idx")
            return {"cached": int(cached), "hidden (x.shape[1])": hidden, "x.dtype": _DTYPE_CODES[data.dtype],
                    "x scales": -1 if scales is None else scales.size(1), "topk_idx.shape[1]": num_topk,
                    "topk_weights given": int(topk_weights is not None), "num_experts": num_experts,
                    "config.num_sms": config.num_sms}

        self._validated(backend, "cached_dispatch" if cached else "dispatch", data_device, checks)
        scope = self._scope(data_device, previous_event, async_finish, allocate_on_comm_stream)
        inputs = [data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, handle]
        if cached:
            assert handle is not None
            with scope.run():
                recv_x, recv_scales = backend.cached_dispatch(data, scales, handle, config)
            recv = (recv_x, recv_scales) if scales is not None else recv_x
            return recv, None, None, None, None, scope.finish(inputs, [recv_x, recv_scales])
        with scope.run():
            result = backend.dispatch(data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                      num_tokens_per_expert, expert_alignment, num_worst_tokens, config)
        event = scope.finish(inputs, [result.recv_x, result.recv_x_scales, result.recv_topk_idx,
                                      result.recv_topk_weights, result.handle])
        recv = (result.recv_x, result.recv_x_scales) if scales is not None else result.recv_x
        return (recv, result.recv_topk_idx, result.recv_topk_weights, result.num_recv_tokens_per_expert_list,
                result.handle, event)

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: Optional[torch.Tensor] = None,
        bias: Bias = None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Sum every dispatched row back onto its source token (no weights applied), plus `bias`.

        Returns `(combined_x [T, H], combined_topk_weights [T, k] or None, event)`.
        """
        config = config if config is not None else self.get_combine_config(self.group_size)
        device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
        backend = self._backend_for(x if isinstance(x, torch.Tensor) else torch.empty(0))
        bias_0, bias_1 = _unpack_bias(bias)

        def checks() -> dict[str, int]:
            check.check_tensor("x", x, dtype=_NORMAL_DTYPES, shape=(None, None), device=device, contiguous=True)
            check.check_hidden_bytes("x", x)
            num_tokens = _check_handle(handle, None, self.group_size, device)
            if x.size(0) != handle.recv_src_idx.numel():
                raise ValueError(f"x: expected {handle.recv_src_idx.numel()} rows (as dispatched), got {x.size(0)}")
            if topk_weights is not None:
                check.check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(x.size(0), None),
                                   device=device, contiguous=True)
            for name, b in (("bias[0]", bias_0), ("bias[1]", bias_1)):
                if b is not None:
                    check.check_tensor(name, b, dtype=x.dtype, shape=(num_tokens, x.size(1)), device=device,
                                       contiguous=True)
            return {"hidden (x.shape[1])": x.size(1), "x.dtype": _DTYPE_CODES[x.dtype],
                    "topk_weights.shape[1]": -1 if topk_weights is None else topk_weights.size(1)}

        self._validated(backend, "combine", device, checks)
        scope = self._scope(device, previous_event, async_finish, allocate_on_comm_stream)
        with scope.run():
            combined_x, combined_weights = backend.combine(x, handle, topk_weights, bias_0, bias_1, config)
        event = scope.finish([x, topk_weights, bias_0, bias_1, handle], [combined_x, combined_weights])
        return combined_x, combined_weights, event

    def _check_tokens(self, data: object, scales: Optional[object], device: torch.device) -> tuple[int, int]:
        if scales is None:
            check.check_tensor("x", data, dtype=_NORMAL_DTYPES, shape=(None, None), device=device, contiguous=True)
            check.check_hidden_bytes("x", data)
            return data.size(0), data.size(1)
        check.check_tensor("x[0]", data, dtype=torch.float8_e4m3fn, shape=(None, None), device=device,
                           contiguous=True)
        check.check_fp8_hidden("x[0]", data.size(1))
        check.check_tensor("x[1]", scales, dtype=(torch.float32, torch.int32),
                           shape=(data.size(0), None), device=device)
        if scales.size(1) < 1 or scales.stride(1) != 1 and scales.size(1) > 1:
            raise ValueError(f"x[1]: expected scales with contiguous rows, got strides {scales.stride()}")
        return data.size(0), data.size(1)

    def _check_layout(self, num_tokens_per_rank: Optional[torch.Tensor], is_token_in_rank: Optional[torch.Tensor],
                      num_tokens_per_expert: Optional[torch.Tensor], num_tokens: int, device: torch.device) -> int:
        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError("num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: required without a "
                             "handle (from get_dispatch_layout)")
        check.check_tensor("num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32,
                           shape=(self.group_size,), device=device)
        check.check_tensor("is_token_in_rank", is_token_in_rank, dtype=torch.bool,
                           shape=(num_tokens, self.group_size), device=device, contiguous=True)
        check.check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32, shape=(None,),
                           device=device)
        num_experts = check.check_num_experts(num_tokens_per_expert.numel(), self.group_size)
        if check.value_checks_enabled() and not torch.equal(is_token_in_rank.sum(0, dtype=torch.int32),
                                                            num_tokens_per_rank):
            raise ValueError("num_tokens_per_rank: does not match the column sums of is_token_in_rank")
        return num_experts

    # ------------------------------------------------------------------ low-latency mode

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency buffers (needed after normal-mode use of the same memory)."""
        self._require_low_latency("clean_low_latency_buffer")
        check.check_positive_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        check.check_positive_int("hidden", hidden)
        check.check_num_experts(num_experts, self.group_size)
        for backend in (self._cuda, self._torch):
            if backend is not None:
                backend.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
        dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Tokens, torch.Tensor, LowLatencyHandle, EventOverlap, Optional[Callable[[], None]]]:
        """Send one message per (token, expert) into the packed `[E_local, R*max, H]` layout.

        Returns `(recv_x or (recv_x, scales), recv_count, handle, event, hook)`; with
        `return_recv_hook`, data is only guaranteed after calling `hook()`.
        """
        device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
        backend = self._backend_for(x if isinstance(x, torch.Tensor) else torch.empty(0))
        num_local = num_experts // self.group_size if isinstance(num_experts, int) else 0

        def checks() -> dict[str, int]:
            self._require_low_latency("low_latency_dispatch")
            if use_ue8m0 and not (use_fp8 and round_scale):
                raise ValueError("use_ue8m0: requires use_fp8=True and round_scale=True")
            if async_finish and return_recv_hook:
                raise ValueError("return_recv_hook: cannot be combined with async_finish")
            check.check_positive_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
            check.check_num_experts(num_experts, self.group_size)
            check.check_tensor("x", x, dtype=torch.bfloat16, shape=(None, None), device=device, contiguous=True)
            check.check_hidden_bytes("x", x)
            if use_fp8:
                check.check_fp8_hidden("x", x.size(1))
            if x.size(0) > num_max_dispatch_tokens_per_rank:
                raise ValueError(f"x: {x.size(0)} tokens exceed num_max_dispatch_tokens_per_rank="
                                 f"{num_max_dispatch_tokens_per_rank}")
            check.check_topk_idx("topk_idx", topk_idx, x.size(0), device)
            check.check_topk_values("topk_idx", topk_idx, num_experts)
            if cumulative_local_expert_recv_stats is not None:
                check.check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                                   dtype=torch.int32, shape=(num_local,), device=device)
            if dispatch_wait_recv_cost_stats is not None:
                check.check_tensor("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats,
                                   dtype=torch.int64, shape=(self.group_size,), device=device)
            return {"hidden (x.shape[1])": x.size(1), "num_experts": num_experts,
                    "num_max_dispatch_tokens_per_rank": num_max_dispatch_tokens_per_rank, "use_fp8": int(use_fp8),
                    "round_scale": int(round_scale), "use_ue8m0": int(use_ue8m0)}

        self._validated(backend, "low_latency_dispatch", device, checks)
        scope = self._scope(device, None, async_finish, False)
        with scope.run():
            result, hook = backend.low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, return_recv_hook)
        event = scope.finish([x, topk_idx, cumulative_local_expert_recv_stats],
                             [result.recv_x, result.recv_x_scales, result.recv_count, result.handle])
        recv = (result.recv_x, result.recv_x_scales) if use_fp8 else result.recv_x
        return recv, result.recv_count, result.handle, event, hook

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Optional[torch.Tensor] = None,
        combine_wait_recv_cost_stats: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, EventOverlap, Optional[Callable[[], None]]]:
        """Return the expert outputs to their tokens, reduced with `topk_weights` per expert rank first.

        For token `t` and each rank `r` hosting at least one of its valid (non `-1`) slots, the partial sum
        `P[r, t] = bf16(sum over those slots j in slot order of float32(w[t, j]) * float32(y_j))` is taken in
        float32 with the multiply and the add rounded separately (`y_j`: the row expert `topk_idx[t, j]`
        returned for `t`); then `combined_x[t] = bf16(sum over r in ascending order of float32(P[r, t]))`,
        also in float32. Tokens with no valid slot get zeros. The rank holding the experts reduces before
        sending, so one row per (token, rank) crosses the link instead of one per (token, expert); the
        result differs from DeepEP's (one float32 sum over all slots) by at most the BF16 rounding of the
        per-rank partial sums. `topk_idx` must route every token as the dispatch behind `handle` did.
        Both backends compute exactly this (docs/semantics.md).

        Returns `(combined_x [T, H] bf16, event, hook)`.
        """
        device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
        backend = self._backend_for(x if isinstance(x, torch.Tensor) else torch.empty(0))

        def checks() -> dict[str, int]:
            self._require_low_latency("low_latency_combine")
            if use_logfmt:
                raise ValueError("use_logfmt: the LogFMT wire format is not supported; pass use_logfmt=False")
            if async_finish and return_recv_hook:
                raise ValueError("return_recv_hook: cannot be combined with async_finish")
            hdl = _check_low_latency_handle(handle, self.group_size)
            slots = self.group_size * hdl.num_max_dispatch_tokens_per_rank
            check.check_tensor("x", x, dtype=torch.bfloat16,
                               shape=(hdl.num_experts // self.group_size, slots, hdl.hidden), device=device,
                               contiguous=True)
            check.check_topk_idx("topk_idx", topk_idx, None, device)
            if topk_idx.size(0) > hdl.num_max_dispatch_tokens_per_rank:
                raise ValueError(f"topk_idx: {topk_idx.size(0)} tokens exceed num_max_dispatch_tokens_per_rank="
                                 f"{hdl.num_max_dispatch_tokens_per_rank}")
            check.check_topk_values("topk_idx", topk_idx, hdl.num_experts)
            check.check_topk_weights("topk_weights", topk_weights, topk_idx)
            if out is not None:
                check.check_tensor("out", out, dtype=torch.bfloat16, shape=(topk_idx.size(0), hdl.hidden),
                                   device=device, contiguous=True)
            if combine_wait_recv_cost_stats is not None:
                check.check_tensor("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, dtype=torch.int64,
                                   shape=(self.group_size,), device=device)
            return {"hidden": hdl.hidden, "num_experts": hdl.num_experts,
                    "num_max_dispatch_tokens_per_rank": hdl.num_max_dispatch_tokens_per_rank}

        self._validated(backend, "low_latency_combine", device, checks)
        scope = self._scope(device, None, async_finish, False)
        with scope.run():
            combined, hook = backend.low_latency_combine(x, topk_idx, topk_weights, handle, zero_copy,
                                                         return_recv_hook, out, combine_wait_recv_cost_stats)
        event = scope.finish([x, topk_idx, topk_weights, handle], [combined])
        return combined, event, hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The `[E_local, R*max, H]` bf16 buffer a `zero_copy` combine reads: write expert outputs into it."""
        self._require_low_latency("get_next_low_latency_combine_buffer")
        hdl = _check_low_latency_handle(handle, self.group_size)
        return self._backend_for(hdl.layout_range).get_next_low_latency_combine_buffer(hdl)


def _is_nccl(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) == "nccl"


def _unpack_bias(bias: Bias) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    if bias is None or isinstance(bias, torch.Tensor):
        return bias, None
    if isinstance(bias, tuple) and len(bias) == 2:
        return bias
    raise ValueError(f"bias: expected None, a tensor or a tuple of two tensors, got {type(bias).__name__}")


def _check_handle(handle: object, num_tokens: Optional[int], num_ranks: int, device: torch.device) -> int:
    """Check a normal-mode handle; returns the number of source tokens it describes."""
    if not isinstance(handle, tuple) or len(handle) != len(DispatchHandle._fields):
        raise ValueError("handle: expected the handle returned by dispatch")
    hdl = DispatchHandle(*handle)
    check.check_tensor("handle.rank_prefix_matrix", hdl.rank_prefix_matrix, dtype=torch.int32,
                       shape=(num_ranks, num_ranks), device=device)
    check.check_tensor("handle.is_token_in_rank", hdl.is_token_in_rank, dtype=torch.bool,
                       shape=(num_tokens, num_ranks), device=device)
    check.check_tensor("handle.recv_src_idx", hdl.recv_src_idx, dtype=torch.int32, shape=(None,), device=device)
    return hdl.is_token_in_rank.size(0)


def _check_low_latency_handle(handle: object, num_ranks: int) -> LowLatencyHandle:
    if not isinstance(handle, tuple) or len(handle) != len(LowLatencyHandle._fields):
        raise ValueError("handle: expected the handle returned by low_latency_dispatch")
    hdl = LowLatencyHandle(*handle)
    check.check_tensor("handle.layout_range", hdl.layout_range, dtype=torch.int64,
                       shape=(hdl.num_experts // num_ranks, num_ranks))
    return hdl
