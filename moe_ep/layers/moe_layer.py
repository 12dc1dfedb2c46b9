"""`MoELayer`: router, token dispatcher, grouped experts and combine, plus optional shared experts.

Experts are sharded contiguously over the expert-parallel group: rank `r` holds experts
`[r * E_local, (r + 1) * E_local)` with `E_local = num_experts / world`. Every rank of the group
must call `forward` (and backward) or `decode` together, as with any collective.
"""

from __future__ import annotations

from typing import Any, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..ops import Buffer
from ..ops.topology import expected_ranks_per_node
from ..ops.validation import check_tensor
from .config import MoEConfig
from .dispatcher import ExpertInput, MoETokenDispatcher
from .experts import GroupedMLP
from .router import TopKRouter
from .shared_expert import SharedExpertMLP

_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


_BUFFERS: dict[tuple, Buffer] = {}


def shared_buffer(group: dist.ProcessGroup, config: MoEConfig, dtype: torch.dtype, *, low_latency: bool = False,
                  backend: str = "auto") -> Buffer:
    """The process's `Buffer` for this group and mode, big enough for `config` (tokens of `dtype`).

    Layers share one buffer per group and mode, as DeepEP recommends (its memory is large); it is
    replaced by a bigger one when a layer needs more bytes. Creating one is collective: every rank
    of `group` must ask for the same sizes in the same order.
    """
    world = dist.get_world_size(group)
    if low_latency:
        if config.low_latency_max_tokens is None:
            raise ValueError("config.low_latency_max_tokens: required for low-latency dispatch")
        nvl_bytes, rdma_bytes = 0, Buffer.get_low_latency_rdma_size_hint(
            config.low_latency_max_tokens, config.hidden_size, world, config.num_experts)
    else:
        hidden_bytes = config.hidden_size * max(dtype.itemsize, 2)
        configs = (Buffer.get_dispatch_config(world), Buffer.get_combine_config(world))
        nvl_bytes = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, world) for cfg in configs)
        # Across nodes the symmetric buffer selects the CUDA internode kernels (zero within one node).
        ranks_per_node = expected_ranks_per_node(world)
        rdma_bytes = max(cfg.get_rdma_buffer_size_hint(hidden_bytes, world, ranks_per_node) for cfg in configs)
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    key = (group, low_latency, backend, device)
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.num_nvl_bytes < nvl_bytes or buffer.num_rdma_bytes < rdma_bytes:
        buffer = Buffer(group, nvl_bytes, rdma_bytes, low_latency_mode=low_latency, backend=backend)
        _BUFFERS[key] = buffer
    return buffer


class MoELayer(nn.Module):
    """Routed SwiGLU experts over an expert-parallel group, plus optional (gated) shared experts.

    `forward(hidden [..., H])` is differentiable: router -> `MoETokenDispatcher` (normal or
    low-latency, per `config.dispatch_mode`) -> `GroupedMLP` -> combine. On CUDA the shared
    experts run on a side stream while the dispatch is in flight; CUDA events order the streams in
    forward, and in backward autograd runs each op on its forward's stream and synchronizes the
    streams wherever a gradient crosses them (PyTorch's stream semantics of backward passes). `decode(hidden)` is the
    inference path for small batches (see its docstring).

    `buffer` defaults to the process's shared buffer for `group` (`shared_buffer`). Set
    `overlap_shared_experts = False` to run the shared experts on the current stream instead.
    `load_state_dict` accepts either this rank's shard of the expert weights or the full set
    (`[num_experts, ...]`), from which it takes the local shard; `gather_full_expert_weights()`
    returns the full set.
    """

    def __init__(self, config: MoEConfig, group: Optional[dist.ProcessGroup] = None, buffer: Optional[Buffer] = None,
                 *, backend: str = "auto", device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if config.num_experts % self.world:
            raise ValueError(f"config.num_experts: {config.num_experts} experts cannot be split over "
                             f"{self.world} ranks")
        self.config = config
        self.num_local_experts = config.num_experts // self.world
        self.backend = backend
        factory = {"device": device, "dtype": dtype}
        self.router = TopKRouter(config).to(device)
        self.experts = GroupedMLP(self.num_local_experts, config.hidden_size, config.moe_intermediate_size,
                                  use_fp8=config.use_fp8_experts, fp8_weight_grads=config.use_fp8_weight_grads,
                                  segment_alignment=config.expert_alignment,
                                  **factory)
        self.shared_experts = None
        if config.n_shared_experts > 0:
            self.shared_experts = SharedExpertMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                                  gate=config.shared_expert_gate, **factory)
        self._token_dtype = dtype or torch.get_default_dtype()
        if buffer is None:
            buffer = shared_buffer(self.group, config, self._token_dtype,
                                   low_latency=config.dispatch_mode == "low_latency", backend=backend)
        self.dispatcher = MoETokenDispatcher(config, buffer)
        self._decode_buffer = buffer if buffer.low_latency_mode else None
        self.overlap_shared_experts = True
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.experts.register_load_state_dict_pre_hook(self._take_local_shard)

    @property
    def local_expert_range(self) -> tuple[int, int]:
        """Global ids `[begin, end)` of the experts on this rank."""
        return self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts

    def forward(self, hidden: torch.Tensor, seq_len: Optional[int] = None) -> torch.Tensor:
        """MoE output of `hidden [..., H]`, same shape and dtype. Tokens form sequences of `seq_len`
        for the sequence-wise aux loss: by default the second-to-last dimension of a `[B, S, H]` input,
        one sequence for `[T, H]`."""
        with self._input_check("MoELayer.forward"):
            self._check_hidden(hidden)
            if seq_len is None and hidden.dim() == 3:
                seq_len = hidden.size(1)
            x = hidden.reshape(-1, self.config.hidden_size)
            topk_idx, topk_weights = self.router(x, seq_len=seq_len)
        shared = self._start_shared(x)
        routed = self.dispatcher.dispatch(x, topk_idx, topk_weights)
        out = self.dispatcher.combine(self._run_experts(routed)).to(x.dtype)
        return self._add_shared(out, shared).view(hidden.shape)

    @torch.no_grad()
    def decode(self, hidden: torch.Tensor) -> torch.Tensor:
        """Inference forward (no autograd) over low-latency dispatch, in two overlapped micro-batches.

        The tokens are split in two halves of at most `config.low_latency_max_tokens` each. Both
        halves' dispatches are issued first; while the second is in flight the experts run on the
        first, and while the first half's combine is in flight they run on the second. The halves
        use `Buffer.low_latency_dispatch/combine` directly (with `return_recv_hook`), not the
        autograd ops. The layer's buffer serves if it is in low-latency mode, else the shared one does;
        at most two low-latency results are in flight at a time, as DeepEP's double buffering allows.
        """
        cfg = self.config
        with self._input_check("MoELayer.decode", low_latency=True):
            self._check_hidden(hidden)
            if cfg.low_latency_max_tokens is None:
                raise ValueError("decode: set config.low_latency_max_tokens")
            x = hidden.reshape(-1, cfg.hidden_size)
            topk_idx, topk_weights = self.router(x)
        if self._decode_buffer is None:
            self._decode_buffer = shared_buffer(self.group, cfg, self._token_dtype, low_latency=True,
                                                backend=self.backend)
        buffer = self._decode_buffer
        shared = self._start_shared(x)
        half = (x.size(0) + 1) // 2
        parts = [(x[s], topk_idx[s], topk_weights[s]) for s in (slice(0, half), slice(half, None))]
        sent = [buffer.low_latency_dispatch(part_x, idx, cfg.low_latency_max_tokens, cfg.num_experts,
                                            use_fp8=cfg.use_fp8_dispatch, return_recv_hook=True)
                for part_x, idx, _ in parts]
        combined, pending = [], []
        for (_, idx, weights), (recv, recv_count, handle, _, recv_hook) in zip(parts, sent):
            recv_hook()
            expert_out = self._run_experts(ExpertInput(recv, recv_count, None, None))
            out, _, combine_hook = buffer.low_latency_combine(expert_out, idx, weights, handle, return_recv_hook=True)
            combined.append(out)
            pending.append(combine_hook)
        for combine_hook in pending:
            combine_hook()
        out = torch.cat(combined).to(x.dtype)
        return self._add_shared(out, shared).view(hidden.shape)

    def _input_check(self, op: str, low_latency: bool = False) -> ContextManager[None]:
        """This rank's input checks for `op`, whose failure every rank of the group learns (`Buffer.input_check`)."""
        return self.dispatcher.buffer.input_check(op, self.router.weight.device, low_latency)

    def _check_hidden(self, hidden: object) -> None:
        """`hidden [..., H]`: checked before any reshape, which would regroup another hidden size silently."""
        check_tensor("hidden", hidden)
        if hidden.dim() < 1 or hidden.size(-1) != self.config.hidden_size:
            raise ValueError(f"hidden: expected shape [..., {self.config.hidden_size}] (the last dimension is "
                             f"config.hidden_size), got {list(hidden.shape)}")

    def _run_experts(self, routed: ExpertInput) -> torch.Tensor:
        return self.experts(routed.tokens, routed.tokens_per_expert, carrier=routed.carrier,
                            tokens_per_expert_list=routed.tokens_per_expert_list)

    # ------------------------------------------------------------------ shared experts on a side stream

    def _start_shared(self, x: torch.Tensor) -> Optional[tuple[torch.Tensor, Optional[torch.cuda.Event]]]:
        """Launch the shared experts; on CUDA on a side stream, so they overlap the dispatch."""
        if self.shared_experts is None:
            return None
        if not (x.is_cuda and self.overlap_shared_experts):
            return self.shared_experts(x), None
        if x.device not in self._side_streams:
            self._side_streams[x.device] = torch.cuda.Stream(device=x.device)
        side = self._side_streams[x.device]
        side.wait_stream(torch.cuda.current_stream(x.device))
        # `x` may be freed by whichever graph node releases it last, possibly while the side stream reads it.
        x.record_stream(side)
        with torch.cuda.stream(side):
            out = self.shared_experts(x)
            done = torch.cuda.Event()
            done.record(side)
        return out, done

    def _add_shared(self, out: torch.Tensor, shared: Optional[tuple[torch.Tensor, Optional[torch.cuda.Event]]]
                    ) -> torch.Tensor:
        if shared is None:
            return out
        shared_out, done = shared
        if done is not None:
            current = torch.cuda.current_stream(out.device)
            current.wait_event(done)
            # Allocated on the side stream, used here: keep its memory until this stream is done too.
            shared_out.record_stream(current)
        return out + shared_out

    # ------------------------------------------------------------------ full (unsharded) expert weights

    def _take_local_shard(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """`load_state_dict` pre-hook: replace full `[num_experts, ...]` expert weights by this rank's rows."""
        if self.num_local_experts == self.config.num_experts:
            return
        begin, end = self.local_expert_range
        for name in _EXPERT_WEIGHTS:
            weight = state_dict.get(prefix + name)
            if weight is not None and weight.size(0) == self.config.num_experts:
                state_dict[prefix + name] = weight[begin:end]

    @torch.no_grad()
    def gather_full_expert_weights(self) -> dict[str, torch.Tensor]:
        """All ranks' expert weights concatenated in expert order, keyed as in `state_dict()`
        (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`). Collective over the group."""
        full = {}
        for name in _EXPERT_WEIGHTS:
            shard = getattr(self.experts, name).detach().contiguous()
            parts = [torch.empty_like(shard) for _ in range(self.world)]
            dist.all_gather(parts, shard, group=self.group)
            full[f"experts.{name}"] = torch.cat(parts)
        return full
