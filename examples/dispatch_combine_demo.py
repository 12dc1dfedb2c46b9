"""Dispatch tokens to their top-k experts across ranks and combine them back, checking the result.

    python examples/dispatch_combine_demo.py --world 2

Spawns gloo ranks on the CPU (NCCL and the CUDA kernels when enough GPUs are present) and prints, per
rank, what was sent and received and how long each step took.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import moe_ep
from moe_ep.launch import launch


def run(rank: int, world: int, device: torch.device, args: argparse.Namespace) -> None:
    torch.manual_seed(rank)
    num_experts = args.experts_per_rank * world
    x = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16, device=device)
    scores = torch.randn(args.tokens, num_experts, device=device)
    topk_weights, topk_idx = scores.softmax(-1).topk(args.topk, dim=-1)
    buffer = moe_ep.Buffer(dist.group.WORLD)

    start = time.perf_counter()
    num_per_rank, _, num_per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, per_expert, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=num_per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=num_per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    dispatched = time.perf_counter()
    # A stand-in for the experts: scale each received token by the routing weight of its local experts.
    expert_out = (recv_x.float() * recv_w.sum(1, keepdim=True)).to(torch.bfloat16)
    combined, _, _ = buffer.combine(expert_out, handle)
    combined_at = time.perf_counter()

    expected = x.float() * topk_weights.sum(1, keepdim=True)
    error = ((combined.float() - expected).norm() / expected.norm()).item()
    backend = buffer.backend_name_for(x)
    line = (f"rank {rank}: backend={backend} sent={int(num_per_rank.sum())} rows to {world} ranks, "
            f"received {recv_x.size(0)} rows, per local expert {per_expert}, dispatch "
            f"{(dispatched - start) * 1e3:.1f} ms, combine {(combined_at - dispatched) * 1e3:.1f} ms, "
            f"relative error {error:.1e}")
    lines = [None] * world
    dist.all_gather_object(lines, line)
    if rank == 0:
        print("\n".join(lines))
        print("OK" if error < 1e-2 else "MISMATCH")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    args = parser.parse_args()
    launch(run, args.world, args)


if __name__ == "__main__":
    main()
