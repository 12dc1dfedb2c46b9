"""Test inputs and an independent dense reference of every Buffer operation.

The reference sees all ranks' inputs in one process and uses plain loops over ranks and tokens (no
code from `moe_ep.ops.routing`), so it checks the backends' vectorized math rather than repeating it.
Inputs are generated from a seed, so every rank can rebuild every other rank's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class RankInputs:
    x: torch.Tensor  # [T, H]; column 0 holds the source rank, columns 1-2 the token index (exact in bf16)
    topk_idx: torch.Tensor  # [T, k] int64 with -1 masked slots
    topk_weights: torch.Tensor  # [T, k] float32

    def to(self, device: torch.device | str) -> "RankInputs":
        return RankInputs(self.x.to(device), self.topk_idx.to(device), self.topk_weights.to(device))


def to_cpu(value: object) -> object:
    """Tensors (also inside tuples, NamedTuples, lists and dicts) moved to the CPU for comparison with
    the reference (and so that no CUDA tensor crosses a process boundary)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    if isinstance(value, tuple):
        items = [to_cpu(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def assert_same_bits(a: object, b: object, what: str) -> None:
    """`a` and `b` (tensors, also nested in tuples and lists, or plain values) are equal bit for bit:
    same shapes and dtypes, same bytes (so NaNs and the sign of zero count too)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{what}: {type(a)} vs {type(b)}"
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        if a.numel():
            assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), f"{what} differs"
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), f"{what}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_bits(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} vs {b!r}"


def tokens_for(tokens: tuple[int, ...], world: int) -> list[int]:
    """Tokens per rank for any world size: the case's list, repeated as needed."""
    return [tokens[rank % len(tokens)] for rank in range(world)]


def make_inputs(seed: int, world: int, num_tokens: list[int], hidden: int, num_experts: int, num_topk: int,
                dtype: torch.dtype = torch.bfloat16, routing: str = "random", mask_prob: float = 0.2) -> list[RankInputs]:
    """Random tokens and routing for every rank. `routing`: "random" (uniform experts, masked slots),
    "skewed" (every token only picks experts of rank 0), or "one_rank_empty" (nobody routes to the last rank)."""
    gen = torch.Generator().manual_seed(seed)
    per_rank = num_experts // world
    inputs = []
    for rank in range(world):
        tokens = num_tokens[rank]
        x = torch.randn(tokens, hidden, generator=gen)
        x[:, 0] = rank
        x[:, 1] = torch.arange(tokens) // 64
        x[:, 2] = torch.arange(tokens) % 64
        if routing == "skewed":
            pool = per_rank
        elif routing == "one_rank_empty":
            pool = num_experts - per_rank if world > 1 else num_experts
        else:
            pool = num_experts
        k = min(num_topk, pool)
        scores = torch.rand(tokens, pool, generator=gen)
        topk_idx = torch.full((tokens, num_topk), -1, dtype=torch.int64)
        topk_idx[:, :k] = scores.topk(k, dim=1).indices
        if mask_prob > 0:
            masked = torch.rand(tokens, num_topk, generator=gen) < mask_prob
            topk_idx[masked] = -1
        # Shuffle slot order so masked slots sit anywhere.
        perm = torch.rand(tokens, num_topk, generator=gen).argsort(dim=1)
        topk_idx = topk_idx.gather(1, perm)
        topk_weights = torch.rand(tokens, num_topk, generator=gen)
        inputs.append(RankInputs(x.to(dtype), topk_idx, topk_weights))
    return inputs


def owner(expert: int, per_rank: int) -> int:
    return expert // per_rank


@dataclass
class DispatchRef:
    rows: list[tuple[int, int]]  # (source rank, token) in receive order
    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    per_expert: list[int]
    num_tokens_per_rank: list[int]
    num_tokens_per_expert: list[int]
    is_token_in_rank: torch.Tensor
    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: torch.Tensor
    recv_channel_prefix_matrix: torch.Tensor
    send_head: torch.Tensor


def _channel_of(token: int, num_tokens: int, num_channels: int) -> int:
    per_channel = -(-num_tokens // num_channels)
    return token // per_channel


def dispatch_reference(inputs: list[RankInputs], me: int, num_experts: int, alignment: int,
                       num_channels: int) -> DispatchRef:
    world = len(inputs)
    per_rank = num_experts // world
    sends = [[[t for t in range(inp.x.size(0)) if any(e >= 0 and owner(e, per_rank) == d for e in inp.topk_idx[t].tolist())]
              for d in range(world)] for inp in inputs]  # sends[src][dst] -> tokens
    rows = [(src, t) for src in range(world) for t in sends[src][me]]
    k = inputs[0].topk_idx.size(1)
    recv_x = torch.stack([inputs[s].x[t] for s, t in rows]) if rows else inputs[me].x.new_zeros(0, inputs[me].x.size(1))
    recv_idx = torch.full((len(rows), k), -1, dtype=torch.int64)
    recv_w = torch.zeros(len(rows), k)
    counts = [0] * per_rank
    for i, (s, t) in enumerate(rows):
        for j, e in enumerate(inputs[s].topk_idx[t].tolist()):
            if e >= 0 and owner(e, per_rank) == me:
                recv_idx[i, j] = e - me * per_rank
                recv_w[i, j] = inputs[s].topk_weights[t, j]
                counts[e - me * per_rank] += 1
    per_expert = [-(-c // alignment) * alignment for c in counts]

    mine = inputs[me]
    num_tokens = mine.x.size(0)
    is_token_in_rank = torch.zeros(num_tokens, world, dtype=torch.bool)
    send_head = torch.full((num_tokens, world), -1, dtype=torch.int32)
    for d in range(world):
        for position, t in enumerate(sends[me][d]):
            is_token_in_rank[t, d] = True
            send_head[t, d] = position
    per_expert_sent = [0] * num_experts
    for e in mine.topk_idx.flatten().tolist():
        if e >= 0:
            per_expert_sent[e] += 1
    rank_prefix = torch.zeros(world, world, dtype=torch.int32)
    for s in range(world):
        for d in range(world):
            rank_prefix[s, d] = sum(len(sends[p][d]) for p in range(s + 1))
    channel_prefix = torch.zeros(world, num_channels, dtype=torch.int32)
    for d in range(world):
        for c in range(num_channels):
            channel_prefix[d, c] = sum(1 for t in sends[me][d] if _channel_of(t, num_tokens, num_channels) <= c)
    recv_channel_prefix = torch.zeros(world, num_channels, dtype=torch.int32)
    for s in range(world):
        start = sum(len(sends[p][me]) for p in range(s))
        for c in range(num_channels):
            before = sum(1 for t in sends[s][me] if _channel_of(t, inputs[s].x.size(0), num_channels) < c)
            recv_channel_prefix[s, c] = start + before
    return DispatchRef(rows, recv_x, recv_idx, recv_w, per_expert, [len(sends[me][d]) for d in range(world)],
                       per_expert_sent, is_token_in_rank, rank_prefix, channel_prefix, recv_channel_prefix, send_head)


def expert_output(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """What the tests' fake experts on `rank` return for received rows (deterministic per rank)."""
    return (rows.float() * (rank + 1) + 0.5).to(rows.dtype)


def combine_reference(inputs: list[RankInputs], me: int, num_experts: int,
                      bias: Optional[list[torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over receiving ranks (rank order, float32) of `expert_output`, plus biases; and weights summed back."""
    world = len(inputs)
    per_rank = num_experts // world
    mine = inputs[me]
    acc_dtype = torch.float64 if mine.x.dtype == torch.float64 else torch.float32
    out = torch.zeros(mine.x.shape, dtype=acc_dtype)
    weights = torch.zeros(mine.topk_weights.shape)
    for t in range(mine.x.size(0)):
        acc = torch.zeros(mine.x.size(1), dtype=acc_dtype)
        for b in bias or []:
            acc = acc + b[t].to(acc_dtype)
        experts = mine.topk_idx[t].tolist()
        for r in range(world):
            if any(e >= 0 and owner(e, per_rank) == r for e in experts):
                acc = acc + expert_output(mine.x[t:t + 1], r)[0].to(acc_dtype)
                for j, e in enumerate(experts):
                    if e >= 0 and owner(e, per_rank) == r:
                        weights[t, j] += mine.topk_weights[t, j]
        out[t] = acc
    return out.to(mine.x.dtype), weights


@dataclass
class LowLatencyRef:
    rows: list[list[tuple[int, int]]]  # per local expert: (source rank, token) in packed order
    layout: torch.Tensor  # [E_local, R, 2]: count, begin
    recv_count: list[int]


def low_latency_reference(inputs: list[RankInputs], me: int, num_experts: int) -> LowLatencyRef:
    world = len(inputs)
    per_rank = num_experts // world
    rows, layout = [], torch.zeros(per_rank, world, 2, dtype=torch.int64)
    for e in range(per_rank):
        expert_rows = []
        for s in range(world):
            picked = [t for t in range(inputs[s].x.size(0)) if me * per_rank + e in inputs[s].topk_idx[t].tolist()]
            layout[e, s] = torch.tensor([len(picked), len(expert_rows)])
            expert_rows += [(s, t) for t in picked]
        rows.append(expert_rows)
    return LowLatencyRef(rows, layout, [len(r) for r in rows])


def low_latency_expert_output(rows: torch.Tensor, global_expert: int) -> torch.Tensor:
    """The tests' fake expert `global_expert` applied to bf16 rows."""
    return (rows.float() * (1 + global_expert / 16) - 0.25).to(torch.bfloat16)


def low_latency_combine_reference(inputs: list[RankInputs], me: int, num_experts: int,
                                  expert_rows: Callable[[int, int, int], torch.Tensor],
                                  transport: Callable[[torch.Tensor], torch.Tensor] = lambda partial: partial
                                  ) -> torch.Tensor:
    """Low-latency combine of rank `me`'s tokens, written out: for every rank `r` hosting some of token
    `t`'s slots, `P = bf16(sum over those slots j in slot order of w[t, j] * y_j)` in float32; then
    `bf16(sum over r ascending of float(transport(P)))`. `expert_rows(t, j, e)` is `y_j`, the bf16 row
    expert `e` returned for slot `j` of token `t`; `transport` is what the receiver gets of a partial
    row (itself, or its LogFMT round trip)."""
    world = len(inputs)
    per_rank = num_experts // world
    mine = inputs[me]
    out = torch.zeros(mine.x.shape, dtype=torch.float32)
    for t in range(mine.x.size(0)):
        experts = mine.topk_idx[t].tolist()
        acc = torch.zeros(mine.x.size(1))
        for r in range(world):
            slots = [(j, e) for j, e in enumerate(experts) if e >= 0 and owner(e, per_rank) == r]
            if not slots:
                continue
            partial = torch.zeros(mine.x.size(1))
            for j, e in slots:
                partial = partial + mine.topk_weights[t, j] * expert_rows(t, j, e).float()
            acc = acc + transport(partial.to(torch.bfloat16)).float()
        out[t] = acc
    return out.to(torch.bfloat16)
