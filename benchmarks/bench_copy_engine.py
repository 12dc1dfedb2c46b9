"""Copy-engine all-to-all probe: how fast do peer copies (cudaMemcpyAsync, no SMs) move an
all-to-all's bytes between the GPUs of one node, all pairs at once?

One process drives every GPU. Each GPU copies `rows` BF16 rows of `hidden` to every other GPU, one
stream per (source, destination) pair, optionally split into `pieces` back-to-back copies (what a
pipelined combine would issue). Reported per GPU: the outgoing bytes over the wall time of the whole
exchange (median over iterations), next to a single pair alone; GPU time
(CUDA events) from a common gate, so the host's launch rate does not count. Also times a local gather-sum of the
received rows (the reduction a staged combine runs after the copies) with torch ops.

    python benchmarks/bench_copy_engine.py --out ce.json [--rows 3700] [--hidden 7168]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


_GATE_CYCLES = 4_000_000  # ~2 ms: every copy is queued before the first one starts


def _exchange(bufs_src, bufs_dst, streams, pieces: int) -> float:
    """Queue every pair's copies behind a sleeping kernel per source GPU; returns the GPU time from the
    end of the sleep to the last copy's end, maximum over source GPUs, in us."""
    gates = {}
    for i in sorted({i for i, _ in streams}):
        with torch.cuda.device(i):
            torch.cuda._sleep(_GATE_CYCLES)
            gates[i] = torch.cuda.Event(enable_timing=True)
            gates[i].record()
    ends = []
    for (i, j), stream in streams.items():
        src, dst = bufs_src[i][j], bufs_dst[j][i]
        with torch.cuda.device(i), torch.cuda.stream(stream):
            stream.wait_event(gates[i])
            for chunk_src, chunk_dst in zip(src.chunk(pieces), dst.chunk(pieces)):
                chunk_dst.copy_(chunk_src, non_blocking=True)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            ends.append((i, end))
    for i in gates:
        torch.cuda.synchronize(i)
    return max(gates[i].elapsed_time(end) for i, end in ends) * 1e3


def _sync_all(n: int) -> None:
    for d in range(n):
        torch.cuda.synchronize(d)


def _median_us(fn, n: int, iters: int) -> float:
    times = []
    for _ in range(iters + 2):
        _sync_all(n)
        times.append(fn())
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=3700, help="rows per (source, destination) pair")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n = torch.cuda.device_count()
    row_bytes = args.hidden * 2
    pair_bytes = args.rows * row_bytes
    src = {i: {j: torch.randn(args.rows, args.hidden, device=i).to(torch.bfloat16) for j in range(n) if j != i}
           for i in range(n)}
    dst = {j: {i: torch.empty(args.rows, args.hidden, device=j, dtype=torch.bfloat16) for i in range(n) if i != j}
           for j in range(n)}
    pair_streams = {(i, j): torch.cuda.Stream(device=i) for i in range(n) for j in range(n) if i != j}
    result: dict = {"gpus": n, "rows_per_pair": args.rows, "row_bytes": row_bytes,
                    "bytes_out_per_gpu": pair_bytes * (n - 1)}

    single = {(0, 1): pair_streams[(0, 1)]}
    us = _median_us(lambda: _exchange(src, dst, single, 1), n, args.iters)
    result["single_pair_us"] = us
    result["single_pair_gbps"] = pair_bytes / us / 1e3
    for pieces in (1, 4, 8, 16):
        us = _median_us(lambda: _exchange(src, dst, pair_streams, pieces), n, args.iters)
        result[f"all_pairs_pieces{pieces}_us"] = us
        result[f"all_pairs_pieces{pieces}_gbps_out_per_gpu"] = pair_bytes * (n - 1) / us / 1e3
    # One stream per source GPU: its copies run one after the other.
    per_source = {i: torch.cuda.Stream(device=i) for i in range(n)}
    serial = {(i, j): per_source[i] for i in range(n) for j in range(n) if i != j}
    us = _median_us(lambda: _exchange(src, dst, serial, 1), n, args.iters)
    result["serial_per_source_us"] = us
    result["serial_per_source_gbps_out_per_gpu"] = pair_bytes * (n - 1) / us / 1e3

    # Local reduction on GPU 0: sum the n-1 received blocks plus a local one, row-gathered.
    torch.cuda.set_device(0)
    blocks = [dst[0][i] for i in range(1, n)] + [src[0][1]]
    perm = [torch.randperm(args.rows, device=0) for _ in blocks]

    def reduce() -> torch.Tensor:
        acc = blocks[0][perm[0]].float()
        for b, p in zip(blocks[1:], perm[1:]):
            acc += b[p].float()
        return acc.to(torch.bfloat16)

    def timed_reduce() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        reduce()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    us = _median_us(timed_reduce, n, args.iters)
    result["torch_gather_reduce_us"] = us
    for key, value in result.items():
        print(f"{key:45s} {value:.1f}" if isinstance(value, float) else f"{key:45s} {value}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
