"""A program written the way DeepEP V1 programs are, against the `deep_ep` API only (moe_ep standing in).

    python examples/deepep_style.py --world 2                   # CPU ranks (torch backend), or one GPU per rank
    python examples/deepep_style.py --world 2 --backend cuda    # the CUDA kernels, ranks sharing the GPUs

Per rank, with random tokens routed to top-k experts (fake experts: expert e scales a token by
1 + e / E, so each rank can compute its own tokens' exact result):
  1. normal mode: buffer sizes from the configs' hints, `get_dispatch_layout` and `dispatch` with
     `previous_event` / `async_finish` / `allocate_on_comm_stream`, the experts weighting their rows,
     `combine`, and a cached dispatch of the same tokens in FP8 through the handle;
  2. low-latency mode with elastic mode on (`enable_shrink=True`): two micro-batches dispatched in FP8
     with receive hooks and combined (the second in LogFMT, with a hook), then the last rank masked on
     every rank: the others' results leave out its experts' terms and it receives nothing; unmasked,
     the results are whole again.
Each step checks its results (FP8 and LogFMT within their tolerances) and prints a line per rank; the
run ends with OK. `--backend` is the one moe_ep keyword used (DeepEP has no backends): `cuda` picks the
kernels even where ranks share a GPU over gloo, as on a one-GPU machine.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import moe_ep as deep_ep
from moe_ep.launch import launch

FP8_TOLERANCE = 4e-2  # relative error of FP8 (1x128 scales) tokens; LogFMT adds far less


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 tokens as DeepEP programs make them: e4m3 values with a float32 scale per 128 channels."""
    rows = x.float().view(x.size(0), -1, 128)
    amax = rows.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    return (rows * (448 / amax)).to(torch.float8_e4m3fn).view(x.shape), (amax / 448).squeeze(-1)


def per_token_cast_back(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (q.float().view(q.size(0), -1, 128) * scales[..., None]).view(q.shape)


def expert_scale(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The fake experts: expert e multiplies its tokens by 1 + e / E."""
    return 1 + experts.float() / num_experts


def expected(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             keep: torch.Tensor) -> torch.Tensor:
    """The exact result for this rank's tokens: sum over the kept slots of weight * scale * x."""
    factor = torch.where(keep, topk_weights * expert_scale(topk_idx, num_experts), 0).sum(1, keepdim=True)
    return x.float() * factor


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm().clamp(min=1e-12))


def normal_mode(rank: int, world: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                num_experts: int, backend: str) -> str:
    group = dist.group.WORLD
    hidden_bytes = x.size(1) * max(x.element_size(), 2)
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, world), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, world), num_rdma_bytes)
    buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True, backend=backend)
    start = time.perf_counter()

    previous = deep_ep.Buffer.capture()
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event = \
        buffer.get_dispatch_layout(topk_idx, num_experts, previous_event=previous, async_finish=True,
                                   allocate_on_comm_stream=True)
    recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
        topk_weights=topk_weights, previous_event=event, async_finish=True, allocate_on_comm_stream=True)
    event.current_stream_wait()
    # The experts of this rank: each received row weighted by its local slots.
    first = rank * (num_experts // world)
    local = recv_topk_idx >= 0
    factor = torch.where(local, recv_topk_weights * expert_scale(recv_topk_idx + first, num_experts), 0)
    expert_out = (recv_x.float() * factor.sum(1, keepdim=True)).to(torch.bfloat16)
    combined, _, event = buffer.combine(expert_out, handle, async_finish=True)
    event.current_stream_wait()
    error = relative_error(combined, expected(x, topk_idx, topk_weights, num_experts, topk_idx >= 0))
    assert error < 1e-2, f"normal-mode combine: relative error {error:.2e}"

    # A cached dispatch: the same layout, now FP8 tokens with their scales.
    (recv_q, recv_scales), *_ = buffer.dispatch(per_token_cast_to_fp8(x), handle=handle)
    cached_error = relative_error(per_token_cast_back(recv_q, recv_scales), recv_x.float())
    assert cached_error < FP8_TOLERANCE, f"cached FP8 dispatch: relative error {cached_error:.2e}"
    elapsed = time.perf_counter() - start
    buffer.destroy()
    return (f"normal: {recv_x.size(0)} rows received ({sum(per_expert)} selections), combine error {error:.1e}, "
            f"cached FP8 error {cached_error:.1e}, {elapsed * 1e3:.0f} ms")


def low_latency_round(buffer: deep_ep.Buffer, batches: list, max_tokens: int, num_experts: int,
                      use_logfmt: list[bool]) -> list[torch.Tensor]:
    """Micro-batches as decoding overlaps them: every dispatch sent before any is received (hooks), the
    experts, then every combine sent before any is received."""
    rank = dist.get_rank()
    sent = [buffer.low_latency_dispatch(x, topk_idx, max_tokens, num_experts, use_fp8=True, return_recv_hook=True)
            for x, topk_idx, _ in batches]
    combines = []
    for (x, topk_idx, topk_weights), (recv, recv_count, handle, _, hook), logfmt in zip(batches, sent, use_logfmt):
        hook()
        data, scales = recv
        num_local, slots, hidden = data.shape
        rows = per_token_cast_back(data.view(-1, hidden), scales.reshape(num_local * slots, -1))
        experts = rank * num_local + torch.arange(num_local, device=data.device)
        expert_out = (rows.view(num_local, slots, hidden) * expert_scale(experts, num_experts)[:, None, None])
        combines.append(buffer.low_latency_combine(expert_out.to(torch.bfloat16), topk_idx, topk_weights, handle,
                                                   use_logfmt=logfmt, return_recv_hook=True))
    results = []
    for combined, _, hook in combines:
        hook()
        results.append(combined)
    return results


def low_latency_mode(rank: int, world: int, batches: list, num_experts: int, backend: str) -> str:
    max_tokens, hidden = max(b[0].size(0) for b in batches), batches[0][0].size(1)
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_experts // world, explicitly_destroy=True, enable_shrink=True,
                            backend=backend)
    buffer.clean_low_latency_buffer(max_tokens, hidden, num_experts)
    per_rank = num_experts // world
    start = time.perf_counter()

    def check(results: list[torch.Tensor], masked: set[int], what: str) -> list[float]:
        errors = []
        for (x, topk_idx, topk_weights), combined in zip(batches, results):
            keep = (topk_idx >= 0) & torch.tensor([r not in masked for r in range(world)],
                                                  device=topk_idx.device)[topk_idx.clamp(min=0) // per_rank]
            if rank in masked:
                keep = torch.zeros_like(keep)
            want = expected(x, topk_idx, topk_weights, num_experts, keep)
            if rank in masked:
                assert not combined.any(), f"{what}: a masked rank's result must be zero"
                errors.append(0.0)
                continue
            errors.append(relative_error(combined, want))
            assert errors[-1] < FP8_TOLERANCE, f"{what}: relative error {errors[-1]:.2e}"
        return errors

    whole = check(low_latency_round(buffer, batches, max_tokens, num_experts, [False, True]), set(), "low latency")
    line = f"low latency: errors of the BF16 combine {whole[0]:.1e}, of the LogFMT one {whole[1]:.1e}"
    if world > 1:
        masked = world - 1
        buffer.low_latency_update_mask_buffer(masked, True)
        status = torch.zeros(world, dtype=torch.int32, device=batches[0][0].device)
        buffer.low_latency_query_mask_buffer(status)
        assert status.tolist() == [int(r == masked) for r in range(world)]
        shrunk = check(low_latency_round(buffer, batches, max_tokens, num_experts, [False, True]), {masked},
                       "rank masked")
        buffer.low_latency_clean_mask_buffer()
        check(low_latency_round(buffer, batches, max_tokens, num_experts, [True, False]), set(), "unmasked")
        line += f"; rank {masked} masked: errors {shrunk[0]:.1e}, {shrunk[1]:.1e}; unmasked again"
    elapsed = time.perf_counter() - start
    buffer.destroy()
    return f"{line}; {elapsed * 1e3:.0f} ms"


def run(rank: int, world: int, device: torch.device, args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(1000 + rank)
    num_experts = args.experts_per_rank * world

    def tokens(count: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = (torch.randn(count, args.hidden, generator=gen) * scale).to(torch.bfloat16)
        scores = torch.rand(count, num_experts, generator=gen)
        topk_weights, topk_idx = scores.softmax(-1).topk(args.topk, dim=-1)
        return x.to(device), topk_idx.to(device), topk_weights.to(device)

    lines = [normal_mode(rank, world, *tokens(args.tokens, 1.0), num_experts, args.backend)]
    # Decode-sized micro-batches of activations' magnitudes (LogFMT encodes blocks below 1).
    batches = [tokens(args.decode_tokens, 0.05), tokens(args.decode_tokens - 3, 0.05)]
    lines.append(low_latency_mode(rank, world, batches, num_experts, args.backend))
    gathered = [None] * world
    dist.all_gather_object(gathered, f"rank {rank}: " + " | ".join(lines))
    if rank == 0:
        print("\n".join(gathered))
        print("OK")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--backend", choices=("auto", "torch", "cuda"), default="auto")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    launch(run, args.world, args)


if __name__ == "__main__":
    main()
