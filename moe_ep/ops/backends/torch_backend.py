"""Pure-PyTorch backend over `torch.distributed` tensor collectives (gloo on CPU, NCCL on GPU).

It is the correctness oracle for the CUDA kernels and a real fallback for training: every operation
is vectorized and moves each payload with one `all_to_all_single` of packed byte rows, after one
exchange of counts, so calls synchronize with the host.

Nothing waits for a peer longer than `MOE_EP_TIMEOUT_S`, and no collective receives a size it did not
expect (gloo aborts the process then, beyond any `try`). An operation's exchange of counts goes
through the group's store (`agreement.py`) and carries its agreement with it: input errors, the
settings every rank must share, the ranks that did not arrive, and the counts the data exchange's
sizes come from: the senders' (dispatch) or both sides' (cached dispatch, combine, low-latency
combine, whose sizes come from a handle or a top-k that a rank may have mixed up), compared before
any data moves. So an operation costs one exchange of counts and its data collective, nothing more.

Elastic low-latency mode: the rank mask is honoured (masked ranks send and receive nothing, and every
rank must mask the same ranks, which the dispatch checks), but this backend cannot survive a dead
peer: its collectives need every rank of the group, so a rank that stops makes the others raise
`PeerTimeoutError` after `MOE_EP_TIMEOUT_S` instead of masking it (the CUDA backend masks it).
"""

from __future__ import annotations

import datetime
import math
import time
from typing import TYPE_CHECKING, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .. import fp8, logfmt, routing
from ..handles import DispatchHandle, LowLatencyHandle
from ..requests import (CombineRequest, DispatchRequest, LowLatencyCombineRequest, LowLatencyDispatchRequest,
                        Request)
from ..routing import DispatchLayout
from ..settings import settings
from ..validation import PeerInputError
from .agreement import Agreement, PeerTimeoutError, check_same_settings
from .base import CommBackend, DispatchResult, LowLatencyDispatchResult, RecvHook

if TYPE_CHECKING:
    from .hierarchical import InternodePath

# How much of a rank's own error message its peers' `PeerInputError` quotes.
_QUOTED_ERROR_CHARS = 400
_MIXED_HANDLES = "handle: every rank must pass the handle of the same dispatch"
_MIXED_TOPK = "topk_idx: must route every token as the dispatch behind handle did"


class Dispatched(NamedTuple):
    """A dispatch's row outputs, padded to the rows the receiver returns."""

    recv_x: torch.Tensor
    recv_x_scales: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    recv_src_idx: torch.Tensor


def dispatch_payload(request: DispatchRequest) -> list[torch.Tensor]:
    """The per-token fields a dispatch moves, in the order `unpack_dispatched` reads them back: the
    tokens, their scales, top-k ids and weights (those given) and the token index."""
    x = request.x
    payload = [x] + ([request.x_scales] if request.x_scales is not None else [])
    if request.topk_idx is not None:
        payload += [request.topk_idx] + ([request.topk_weights] if request.topk_weights is not None else [])
    payload.append(torch.arange(x.size(0), dtype=torch.int32, device=x.device))
    return payload


def unpack_dispatched(received: list[torch.Tensor], request: DispatchRequest, num_rows: int, rank: int,
                      num_local: int) -> Dispatched:
    """The outputs from the received fields of `dispatch_payload`, padded to `num_rows` rows
    (docs/semantics.md: padding rows are 0, ids -1, weights 0, source index -1)."""
    recv_topk_idx = recv_topk_weights = None
    if request.topk_idx is not None:
        field = 2 if request.x_scales is not None else 1
        local_idx, local_weights = routing.localize_topk(
            received[field], received[field + 1] if request.topk_weights is not None else None, rank, num_local)
        recv_topk_idx = _pad_rows(local_idx, num_rows, -1)
        recv_topk_weights = _pad_rows(local_weights, num_rows, 0) if local_weights is not None else None
    return Dispatched(_pad_rows(received[0], num_rows, 0),
                      _pad_rows(received[1], num_rows, 0) if request.x_scales is not None else None,
                      recv_topk_idx, recv_topk_weights, _pad_rows(received[-1], num_rows, -1))


def rank_handle(send_matrix: torch.Tensor, channel_prefix: torch.Tensor, sender_channel_prefix: torch.Tensor,
                recv_src_idx: torch.Tensor, is_token_in_rank: torch.Tensor, rank: int) -> DispatchHandle:
    """A dispatch's handle from every rank's send counts `[R, R]`, this rank's channel prefix `[R, C]`
    and its senders' channel prefixes towards it `[R, C]` (docs/semantics.md)."""
    device = is_token_in_rank.device
    rank_prefix = routing.rank_prefix_matrix(send_matrix).to(device)
    return DispatchHandle(
        rank_prefix_matrix=rank_prefix,
        channel_prefix_matrix=channel_prefix.to(device),
        recv_channel_prefix_matrix=routing.recv_channel_prefix_matrix(rank_prefix, sender_channel_prefix.to(device),
                                                                      rank),
        recv_src_idx=recv_src_idx,
        is_token_in_rank=is_token_in_rank,
        send_head=routing.send_head(is_token_in_rank),
    )


def recv_tokens_per_expert(expert_counts: torch.Tensor, request: DispatchRequest, rank: int,
                           num_local: int) -> list[int]:
    """`num_recv_tokens_per_expert_list` from every rank's per-expert counts `[R, E]` (empty with
    `num_worst_tokens`)."""
    if request.num_worst_tokens > 0:
        return []
    local_counts = expert_counts[:, rank * num_local:(rank + 1) * num_local]
    return routing.recv_tokens_per_expert(local_counts, request.expert_alignment).tolist()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Rows of `tensor` (any dtype) as a `[N, row_bytes]` uint8 view."""
    row_elements = math.prod(tensor.shape[1:])
    if tensor.numel() == 0:
        # Empty tensors count as contiguous whatever their strides, which can forbid the byte view.
        return torch.empty(tensor.size(0), row_elements * tensor.element_size(), dtype=torch.uint8,
                           device=tensor.device)
    return tensor.contiguous().view(tensor.size(0), row_elements).view(torch.uint8)


def _as_words(*matrices: torch.Tensor) -> list[torch.Tensor]:
    """uint8 `[N, W]` matrices (contiguous rows) viewed as the widest integers that tile a row of each: a
    gather or scatter of rows then moves the same bytes several times faster than byte by byte, on CPUs
    and GPUs."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if all(m.size(1) % size == 0 and m.stride(1) == 1 and m.stride(0) % size == 0
               and m.storage_offset() % size == 0 for m in matrices):
            return [m.view(dtype) for m in matrices]
    return list(matrices)


def _take_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`rows[index]` of a uint8 `[N, W]` matrix."""
    (words,) = _as_words(rows)
    return words.index_select(0, index).view(torch.uint8)


def _put_rows(rows: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """`rows[index] = values` for uint8 `[N, W]` matrices (`index` without repeats)."""
    words, value_words = _as_words(rows, values)
    words.index_copy_(0, index, value_words)


class _RowCodec:
    """Packs several per-row tensors into one uint8 matrix so one collective moves them all.

    `extra_bytes` leaves room after the packed tensors for bytes the caller supplies per packed row
    (`pack`'s `extra`), and rows are padded with zeros to a multiple of `align` bytes (kernels that
    move rows as 16-byte vectors need it); `unpack` ignores both."""

    def __init__(self, templates: Sequence[tuple[torch.dtype, tuple[int, ...]]], extra_bytes: int = 0,
                 align: int = 1) -> None:
        self.templates = list(templates)
        self.widths = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                       for dtype, shape in templates]
        self.data_bytes = sum(self.widths)
        self.extra_bytes = extra_bytes
        self.row_bytes = -(-(self.data_bytes + extra_bytes) // align) * align

    @classmethod
    def like(cls, tensors: Sequence[torch.Tensor], extra_bytes: int = 0, align: int = 1) -> "_RowCodec":
        return cls([(t.dtype, tuple(t.shape[1:])) for t in tensors], extra_bytes, align)

    def pack(self, tensors: Sequence[torch.Tensor], index: Optional[torch.Tensor] = None,
             extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows `index` (all rows if None) of every tensor, side by side as bytes (FP8 moves as bytes too),
        then `extra` (uint8 `[rows, extra_bytes]`, already one row per packed row) and the padding."""
        if index is not None and not self.extra_bytes:
            # Pack every row once, then gather whole packed rows: a dispatch sends a row to several ranks,
            # so this copies fewer bytes than gathering each tensor and packing the gathered rows.
            return _take_rows(self.pack(tensors), index)
        parts = [_as_bytes(t) if index is None else _take_rows(_as_bytes(t), index) for t in tensors]
        if self.extra_bytes:
            assert extra is not None and extra.shape == (parts[0].size(0), self.extra_bytes)
            parts.append(extra.to(torch.uint8))
        padding = self.row_bytes - self.data_bytes - self.extra_bytes
        if padding:
            parts.append(torch.zeros(parts[0].size(0), padding, dtype=torch.uint8, device=parts[0].device))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def extra(self, rows: torch.Tensor) -> torch.Tensor:
        """The caller's bytes of packed `rows`."""
        return rows[:, self.data_bytes:self.data_bytes + self.extra_bytes]

    def unpack(self, rows: torch.Tensor) -> list[torch.Tensor]:
        out, start = [], 0
        for (dtype, shape), width in zip(self.templates, self.widths):
            # A fresh copy: a slice of zero or one row counts as contiguous but keeps the packed row's
            # stride, which forbids reinterpreting its bytes as a wider dtype.
            piece = rows[:, start:start + width].clone(memory_format=torch.contiguous_format)
            out.append(piece.view(dtype).view(rows.size(0), *shape))
            start += width
        return out


class TorchBackend(CommBackend):
    """Every Buffer operation with `torch.distributed` collectives."""

    name = "torch"

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int) -> None:
        super().__init__(group, rank, num_ranks)
        self._combine_buffers: dict[tuple[int, int, int, torch.device], torch.Tensor] = {}
        # Normal mode across nodes (attached by the Buffer when its group spans more than one node).
        self.internode: Optional[InternodePath] = None
        self._agreement = Agreement(group, rank, num_ranks)
        # NCCL's own watchdog bounds its waits (the group's timeout); gloo's waits take ours.
        self._timed_waits = dist.get_backend(group) != "nccl"
        self._op = "agree"  # the operation in progress, for the errors of its exchanges
        self._fields: Mapping[str, int] = {}  # its settings, until its first exchange carries them
        self._rank_mask = torch.zeros(num_ranks, dtype=torch.int32)  # elastic mode: 1 = left out

    # ------------------------------------------------------------------ collectives

    def _gather_counts(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's integer `row [n]` as a CPU int64 `[R, n]`, exchanged with the operation's agreement."""
        records = self._agree({"row": row.tolist()})
        lengths = [len(r["row"]) for r in records]
        if len(set(lengths)) > 1:
            raise PeerInputError(f"{self._op}: the ranks exchange counts of different lengths {lengths} (rank order)")
        return torch.tensor([r["row"] for r in records], dtype=torch.int64).view(self.num_ranks, -1)

    def _all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """`_gather_counts` (int64) on `row`'s device."""
        return self._gather_counts(row).to(row.device)

    def _all_to_all(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int], async_op: bool = False
    ) -> tuple[torch.Tensor, Optional[dist.Work]]:
        recv = torch.empty(sum(recv_counts), send.size(1), dtype=send.dtype, device=send.device)
        work = dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.group, async_op=True)
        if async_op:
            return recv, work
        self._wait(work)
        return recv, None

    def _wait(self, work: dist.Work, op: Optional[str] = None) -> None:
        """Wait for a collective of `op` (default: the operation in progress), at most `MOE_EP_TIMEOUT_S`
        on gloo."""
        try:
            if self._timed_waits:
                work.wait(timeout=datetime.timedelta(seconds=settings().timeout_s))
            else:
                work.wait()
        except RuntimeError as exc:
            raise PeerTimeoutError(f"{op or self._op}: the data exchange failed after every rank had arrived (a peer "
                                   f"exited or stalled inside it, MOE_EP_TIMEOUT_S={settings().timeout_s:g} s): "
                                   f"{exc}") from exc

    def start(self, op: str, request: Request) -> None:
        # Checked in the operation's first exchange (`_agree`), which every path of an operation makes.
        self._op, self._fields = op, request.agreed()

    def agree(self, op: str, fields: Mapping[str, int], local_error: Optional[Exception], device: torch.device) -> None:
        self._op, self._fields = op, fields
        self._agree({}, local_error)

    def agree_started(self) -> None:
        """The started operation's agreement on its own, for a path with no counts to exchange."""
        self._agree({})

    def _agree(self, counts: Mapping[str, list[int]], local_error: Optional[Exception] = None) -> list[dict]:
        """The operation's exchange: every rank's record of `counts` (in rank order) once no rank rejected
        its input, every rank runs the same operation and agrees on the settings it started with."""
        op, fields, self._fields = self._op, self._fields, {}
        if local_error is None:
            record = {"fields": list(fields.values()), **counts}
        else:
            record = {"error": f"{type(local_error).__name__}: {local_error}"[:_QUOTED_ERROR_CHARS]}
        records = self._agreement.exchange(op, record)
        if local_error is not None:
            raise local_error
        failed = [rank for rank, r in enumerate(records) if "error" in r]
        if failed:
            detail = "; ".join(f"rank {rank} in {records[rank]['op']}: {records[rank]['error']}" for rank in failed)
            raise PeerInputError(f"{op}: rank(s) {failed} rejected their input: {detail}")
        if len({r["op"] for r in records}) > 1:
            names = {rank: r["op"] for rank, r in enumerate(records)}
            raise PeerInputError(f"ranks called different operations at the same time: {names}")
        check_same_settings(op, fields, [r["fields"] for r in records])
        return records

    def _agree_sizes(self, send_counts: list[int], recv_counts: list[int], cause: str) -> None:
        """Before an exchange whose sizes come from this rank's own state (a handle, a top-k): check, in
        the operation's agreement, that every rank expects the rows its peers will send, so that the
        collective never receives a size it did not expect. `cause` names the argument a mismatch comes
        from."""
        records = self._agree({"send": send_counts, "recv": recv_counts})
        wrong = [(src, dst, records[src]["send"][dst], records[dst]["recv"][src])
                 for src in range(self.num_ranks) for dst in range(self.num_ranks)
                 if records[src]["send"][dst] != records[dst]["recv"][src]]
        if wrong:
            detail = ", ".join(f"rank {src} sends {sent} rows to rank {dst}, which expects {expected}"
                               for src, dst, sent, expected in wrong[:4])
            raise PeerInputError(f"{self._op}: {cause}; the rows to exchange do not match ({detail})")

    # ------------------------------------------------------------------ normal mode

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        ranks_per_node = self.num_ranks if self.internode is None else self.internode.topology.num_ranks_per_node
        return routing.dispatch_layout(topk_idx, num_experts, self.num_ranks, ranks_per_node)

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        if self.internode is not None and self.internode.takes():
            return self.internode.dispatch(request)
        x, is_token_in_rank, num_worst_tokens = request.x, request.is_token_in_rank, request.num_worst_tokens
        num_ranks, rank, device = self.num_ranks, self.rank, x.device
        num_experts = request.num_experts
        num_local = num_experts // num_ranks
        num_channels = request.config.num_channels
        channel_prefix = routing.channel_prefix_matrix(is_token_in_rank, num_channels)

        # Notify: every rank learns all send counts, expert counts, channel prefixes and receive bounds
        # (on the host, one copy from the device). The send counts are those of the rows this rank packs
        # (`num_tokens_per_rank` equals them when value checks are on), so the exchange's sizes always
        # match its data.
        header = torch.cat([
            is_token_in_rank.sum(0, dtype=torch.int64).to(device),
            request.num_tokens_per_expert.to(device=device, dtype=torch.int64),
            channel_prefix.to(device=device, dtype=torch.int64).reshape(-1),
            torch.tensor([num_worst_tokens], dtype=torch.int64, device=device),
        ])
        table = self._gather_counts(header)
        send_matrix = table[:, :num_ranks]
        expert_counts = table[:, num_ranks:num_ranks + num_experts]
        sender_channel_prefix = table[:, num_ranks + num_experts:-1].view(num_ranks, num_ranks, num_channels)[:, rank]
        self._check_worst_tokens(send_matrix.sum(0).tolist(), table[:, -1].tolist())

        send_counts = send_matrix[rank].tolist()
        recv_counts = send_matrix[:, rank].tolist()
        dest, token = routing.send_order(is_token_in_rank)
        payload = dispatch_payload(request)
        codec = _RowCodec.like(payload)
        recv_rows, _ = self._all_to_all(codec.pack(payload, token), send_counts, recv_counts)
        num_rows = num_worst_tokens if num_worst_tokens > 0 else sum(recv_counts)
        out = unpack_dispatched(codec.unpack(recv_rows), request, num_rows, rank, num_local)

        handle = rank_handle(send_matrix, channel_prefix, sender_channel_prefix, out.recv_src_idx, is_token_in_rank,
                             rank)
        return DispatchResult(out.recv_x, out.recv_x_scales, out.recv_topk_idx, out.recv_topk_weights,
                              recv_tokens_per_expert(expert_counts, request, rank, num_local), handle)

    def _check_worst_tokens(self, recv_per_rank: list[int], worst_per_rank: list[int]) -> None:
        over = [(r, n, w) for r, (n, w) in enumerate(zip(recv_per_rank, worst_per_rank)) if 0 < w < n]
        if over:
            detail = ", ".join(f"rank {r} receives {n} > {w}" for r, n, w in over)
            raise ValueError(f"num_worst_tokens: too small, no data would fit ({detail})")

    def cached_dispatch(self, request: DispatchRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.internode is not None and self.internode.takes(request.handle):
            return self.internode.cached_dispatch(request)
        x, x_scales, handle = request.x, request.x_scales, request.handle
        send_counts, recv_counts = _handle_counts(handle, self.rank)
        self._agree_sizes(send_counts, recv_counts, _MIXED_HANDLES)
        _, token = routing.send_order(handle.is_token_in_rank)
        payload = [x] + ([x_scales] if x_scales is not None else [])
        codec = _RowCodec.like(payload)
        recv_rows, _ = self._all_to_all(codec.pack(payload, token), send_counts, recv_counts)
        received = codec.unpack(recv_rows)
        num_rows = handle.recv_src_idx.numel()
        recv_scales = _pad_rows(received[1], num_rows, 0) if x_scales is not None else None
        return _pad_rows(received[0], num_rows, 0), recv_scales

    def combine(self, request: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.internode is not None and self.internode.takes(request.handle):
            return self.internode.combine(request)
        x, handle, topk_weights = request.x, request.handle, request.topk_weights
        # Every row goes back to its source, which receives from each rank the rows it sent there.
        to_source, from_ranks = _handle_counts(handle, self.rank)
        self._agree_sizes(from_ranks, to_source, _MIXED_HANDLES)
        num_real = sum(from_ranks)
        payload = [x[:num_real]] + ([topk_weights[:num_real]] if topk_weights is not None else [])
        codec = _RowCodec.like(payload)
        back_rows, _ = self._all_to_all(codec.pack(payload), from_ranks, to_source)
        back = codec.unpack(back_rows)

        num_tokens = handle.is_token_in_rank.size(0)
        dest, token = routing.send_order(handle.is_token_in_rank)
        acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        combined = torch.zeros(num_tokens, x.size(1), dtype=acc_dtype, device=x.device)
        for bias in (request.bias_0, request.bias_1):
            if bias is not None:
                combined += bias.to(acc_dtype)
        combined = self._sum_returned(combined, back[0], dest, token, x.dtype)
        combined_weights = None
        if topk_weights is not None:
            zeros = torch.zeros(num_tokens, topk_weights.size(1), dtype=torch.float32, device=x.device)
            combined_weights = self._sum_returned(zeros, back[1], dest, token, torch.float32)
        return combined.to(x.dtype), combined_weights

    def _sum_returned(self, acc: torch.Tensor, rows: torch.Tensor, dest: torch.Tensor, token: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
        """Combine's sum of the returned rows: in rank order in one node; across nodes, per node first
        (the partial rounded to `dtype`), then over nodes (docs/semantics.md)."""
        if self.internode is not None:
            return self.internode.reduce_flat(acc, rows, dest, token, dtype)
        return _sum_in_rank_order(acc, rows, dest, token, self.num_ranks)

    # ------------------------------------------------------------------ low-latency mode

    def low_latency_dispatch(self, request: LowLatencyDispatchRequest
                             ) -> tuple[LowLatencyDispatchResult, Optional[RecvHook]]:
        x, num_experts, use_fp8, use_ue8m0 = request.x, request.num_experts, request.use_fp8, request.use_ue8m0
        num_ranks, rank, device = self.num_ranks, self.rank, x.device
        num_local = num_experts // num_ranks
        slots = num_ranks * request.num_max_dispatch_tokens_per_rank
        hidden = x.size(1)

        pairs = routing.expert_major_pairs(self._routed(request.topk_idx, num_experts), num_experts)
        # The counts carry each rank's mask along, so that every rank checks that all masks agree.
        mask = self._rank_mask.to(device=device, dtype=pairs.count_per_expert.dtype)
        table = self._all_gather_rows(torch.cat([pairs.count_per_expert, mask]))  # [R_src, E + R]
        self._check_same_masks(table[:, num_experts:])
        counts = table[:, rank * num_local:(rank + 1) * num_local]  # [R_src, E_local]
        send_counts = pairs.count_per_expert.view(num_ranks, num_local).sum(1).tolist()
        recv_counts = counts.sum(1).tolist()

        payload = list(fp8.per_token_cast_to_fp8(x, request.round_scale, use_ue8m0)) if use_fp8 else [x]
        payload.append(torch.arange(x.size(0), dtype=torch.int32, device=device))
        codec = _RowCodec.like(payload)
        recv_rows, work = self._all_to_all(codec.pack(payload, pairs.token), send_counts, recv_counts, async_op=True)
        op = self._op  # the hook may run after later operations started

        # Outputs exist before the data arrives; the receive phase fills them in place.
        recv_x = torch.zeros(num_local, slots, hidden, dtype=fp8.FP8_DTYPE if use_fp8 else x.dtype, device=device)
        recv_scales = None
        if use_fp8:
            num_groups = routing.ceil_div(hidden, fp8.BLOCK * fp8.UE8M0_PER_INT32) if use_ue8m0 else hidden // fp8.BLOCK
            scale_dtype = torch.int32 if use_ue8m0 else torch.float32
            recv_scales = torch.zeros(num_local, num_groups, slots, dtype=scale_dtype, device=device).transpose(1, 2)
        src_info = torch.full((num_local, slots), -1, dtype=torch.int32, device=device)
        rows, begin = routing.packed_row_index(counts, slots)
        layout_range = routing.pack_layout_range(counts.t(), begin)
        recv_count = counts.sum(0).to(torch.int32)
        if request.cumulative_local_expert_recv_stats is not None:
            request.cumulative_local_expert_recv_stats.add_(recv_count)

        def receive() -> None:
            started = time.perf_counter_ns()
            self._wait(work, op)
            if request.dispatch_wait_recv_cost_stats is not None:
                _add_wait_time(request.dispatch_wait_recv_cost_stats, recv_counts, time.perf_counter_ns() - started)
            received = codec.unpack(recv_rows)
            _put_rows(recv_x.view(torch.uint8).view(-1, received[0].element_size() * hidden), rows,
                      _as_bytes(received[0]))
            if recv_scales is not None:
                recv_scales[rows // slots, rows % slots] = received[1]
            src_info.view(-1)[rows] = received[-1]

        handle = LowLatencyHandle(src_info, layout_range, request.num_max_dispatch_tokens_per_rank, hidden, num_experts)
        result = LowLatencyDispatchResult(recv_x, recv_scales, recv_count, handle)
        if request.return_recv_hook:
            return result, receive
        receive()
        return result, None

    def low_latency_combine(self, request: LowLatencyCombineRequest) -> tuple[torch.Tensor, Optional[RecvHook]]:
        x, topk_idx, topk_weights, handle = request.x, request.topk_idx, request.topk_weights, request.handle
        if request.zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        slots = self.num_ranks * handle.num_max_dispatch_tokens_per_rank
        rows, back_counts = routing.gather_rows_by_layout(self._kept_layout(handle.layout_range), slots)
        pairs = routing.expert_major_pairs(self._routed(topk_idx, handle.num_experts), handle.num_experts)
        num_local = handle.num_experts // self.num_ranks
        send_counts = back_counts.tolist()
        recv_counts = pairs.count_per_expert.view(self.num_ranks, num_local).sum(1).tolist()
        self._agree_sizes(send_counts, recv_counts, _MIXED_TOPK)
        send = _take_rows(_as_bytes(x.reshape(-1, x.size(-1))), rows)
        expert_out, work = self._all_to_all(send, send_counts, recv_counts, async_op=True)
        op = self._op  # the hook may run after later operations started

        num_tokens, num_topk = topk_idx.shape
        combined = request.out if request.out is not None else torch.empty(num_tokens, x.size(-1), dtype=x.dtype,
                                                                           device=x.device)
        pair_of_slot = torch.full((num_tokens, num_topk), -1, dtype=torch.int64, device=x.device)
        pair_of_slot[pairs.token, pairs.slot] = torch.arange(pairs.token.numel(), device=x.device)
        rank_of_slot = topk_idx.div(num_local, rounding_mode="floor")
        tokens = torch.arange(num_tokens, device=x.device)

        def receive() -> None:
            started = time.perf_counter_ns()
            self._wait(work, op)
            if request.combine_wait_recv_cost_stats is not None:
                _add_wait_time(request.combine_wait_recv_cost_stats, recv_counts, time.perf_counter_ns() - started)
            y = expert_out.view(x.dtype).view(-1, x.size(-1)).float()
            # Partial sums per (expert rank, token) in slot order (float32, multiply and add rounded
            # separately), rounded to BF16 as the rank holding the experts sends them; then the sum of the
            # partials in rank order. A slot adds to one rank per token, so the indices never repeat.
            partial = torch.zeros(self.num_ranks, num_tokens, x.size(-1), dtype=torch.float32, device=x.device)
            for slot in range(num_topk):
                present = pair_of_slot[:, slot] >= 0
                at = (rank_of_slot[present, slot], tokens[present])
                partial[at] += topk_weights[present, slot, None] * y[pair_of_slot[present, slot]]
            partial = partial.to(torch.bfloat16)
            if request.use_logfmt:  # what the receiver decodes of the partial rows sent in LogFMT-10
                partial = logfmt.round_trip(partial.view(-1, x.size(-1))).view(partial.shape)
            acc = torch.zeros(num_tokens, x.size(-1), dtype=torch.float32, device=x.device)
            for rank in range(self.num_ranks):
                acc += partial[rank].float()
            combined.copy_(acc)

        if request.return_recv_hook:
            return combined, receive
        receive()
        return combined, None

    def rank_mask(self) -> torch.Tensor:
        return self._rank_mask

    def _left_out(self, device: torch.device) -> Optional[torch.Tensor]:
        """`[R]` bool, the ranks this rank's low-latency operations leave out (all of them when it is
        masked itself), or None when none is masked."""
        if not bool(self._rank_mask.any()):
            return None
        if bool(self._rank_mask[self.rank]):
            return torch.ones(self.num_ranks, dtype=torch.bool, device=device)
        return self._rank_mask.to(device=device, dtype=torch.bool)

    def _routed(self, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
        """`topk_idx` without the slots whose expert lives on a rank left out (-1 there)."""
        left_out = self._left_out(topk_idx.device)
        if left_out is None:
            return topk_idx
        owner = topk_idx.clamp(min=0) // (num_experts // self.num_ranks)
        return torch.where((topk_idx >= 0) & ~left_out[owner], topk_idx, -1)

    def _kept_layout(self, layout_range: torch.Tensor) -> torch.Tensor:
        """A dispatch's `layout_range` without the rows of sources left out now (a combine returns none)."""
        left_out = self._left_out(layout_range.device)
        if left_out is None:
            return layout_range
        count, begin = routing.unpack_layout_range(layout_range)
        return routing.pack_layout_range(torch.where(left_out[None, :], 0, count), begin)

    def _check_same_masks(self, masks: torch.Tensor) -> None:
        """Every rank's rank mask `[R, R]` (gathered with the dispatch counts) must be the same."""
        if bool((masks != masks[0]).any()):
            masked = {rank: [r for r, m in enumerate(row) if m] for rank, row in enumerate(masks.tolist())}
            raise PeerInputError(f"{self._op}: the ranks mask different ranks (elastic mode, masked ranks per rank: "
                                 f"{masked}); every rank must mask the same ranks")

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        num_local = handle.num_experts // self.num_ranks
        slots = self.num_ranks * handle.num_max_dispatch_tokens_per_rank
        device = handle.layout_range.device
        key = (num_local, slots, handle.hidden, device)
        if key not in self._combine_buffers:
            self._combine_buffers[key] = torch.zeros(num_local, slots, handle.hidden, dtype=torch.bfloat16,
                                                     device=device)
        return self._combine_buffers[key]

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        # Outputs are freshly allocated per call; only the zero-copy staging buffers persist.
        for buffer in self._combine_buffers.values():
            buffer.zero_()

    def destroy(self) -> None:
        self._combine_buffers.clear()
        if self.internode is not None:
            self.internode.destroy()


def _pad_rows(tensor: torch.Tensor, num_rows: int, fill: float) -> torch.Tensor:
    if tensor.size(0) == num_rows:
        return tensor
    padded = torch.full((num_rows, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.size(0)] = tensor
    return padded


def _handle_counts(handle: DispatchHandle, rank: int) -> tuple[list[int], list[int]]:
    """Tokens this rank sends to each rank, and receives from each rank, under a dispatch handle (one copy
    from the device)."""
    prefix = handle.rank_prefix_matrix.to("cpu", torch.int64)
    counts = prefix.clone()
    counts[1:] -= prefix[:-1]
    return counts[rank].tolist(), counts[:, rank].tolist()


def _sum_in_rank_order(
    acc: torch.Tensor, rows: torch.Tensor, dest: torch.Tensor, token: torch.Tensor, num_ranks: int
) -> torch.Tensor:
    """Add each rank's returned rows to their tokens, rank by rank (fixed float32 summation order). `dest`
    is ascending (`routing.send_order`), so each rank's rows are one slice, added without copying them (one
    read of the slice bounds, where masks would copy the rows and read the device once per rank)."""
    rows = rows.to(acc.dtype)
    ends = torch.searchsorted(dest, torch.arange(1, num_ranks + 1, dtype=dest.dtype, device=dest.device)).tolist()
    start = 0
    for end in ends:
        acc.index_add_(0, token[start:end], rows[start:end])
        start = end
    return acc


def _add_wait_time(stats: torch.Tensor, counts_per_rank: list[int], nanoseconds: int) -> None:
    """A collective delivers all sources at once: each source that sent data waited the same time."""
    sent = torch.tensor([n > 0 for n in counts_per_rank], dtype=stats.dtype, device=stats.device)
    stats += sent * nanoseconds
