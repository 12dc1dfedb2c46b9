"""Train a small DeepSeek-V3-style MoE language model on the shipped text, experts spread over N ranks.

    python examples/train_deepseek_v3.py                 # 2 CPU ranks over gloo (NCCL + CUDA on GPUs)
    python examples/train_deepseek_v3.py --world 4 --steps 600
    python examples/train_deepseek_v3.py --world 4 --ranks-per-node 2   # 2 virtual nodes: internode mode
    torchrun --nproc-per-node 2 examples/train_deepseek_v3.py
    python examples/train_deepseek_v3.py --stop-at 100   # save and stop early (as if preempted), then
    python examples/train_deepseek_v3.py --resume        # continue from the last checkpoint
    python examples/convert_checkpoint.py runs/deepseek_v3/checkpoint runs/deepseek_v3/full.pt
    python examples/train_deepseek_v3.py --world 1 --init-from runs/deepseek_v3/full.pt --steps 0  # evaluate
    python examples/train_deepseek_v3.py --short         # CI: tiny model, a few steps, asserts learning

The model: byte tokens, RMSNorm, rotary multi-head attention, a dense SwiGLU first layer and
`MoELayer`s after it (sigmoid routing over expert groups, top-k renormalised and scaled, one shared
expert, the aux-loss-free bias updated every step, a small sequence-wise balance loss). Experts are
sharded over all ranks (expert parallelism); every other parameter is replicated and its gradient
averaged (data parallelism). Writes into `--out-dir`: `loss.png`, `metrics.json` and `checkpoint/`
(replicated parameters plus one expert shard per rank; `convert_checkpoint.py` merges them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from tqdm import tqdm

from convert_checkpoint import REPLICATED, shard_path
from moe_ep.integrations import expert_parameters, sync_gradients
from moe_ep.launch import launch
from moe_ep.layers import MoEConfig, MoELayer, SharedExpertMLP

DATA = Path(__file__).parent / "data" / "corpus.txt"


@dataclass
class ModelArgs:
    """Sizes of the model (a DeepSeek-V3 layout at toy scale)."""

    vocab_size: int = 256
    seq_len: int = 128
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    dense_intermediate: int = 384
    n_experts: int = 16
    top_k: int = 3
    n_group: int = 4
    topk_group: int = 2
    moe_intermediate: int = 96
    routed_scaling_factor: float = 2.5
    bias_update_rate: float = 1e-2  # DeepSeek-V3 uses 1e-3 over far longer runs
    seq_aux_loss_coeff: float = 1e-4

    def moe_config(self) -> MoEConfig:
        return MoEConfig(hidden_size=self.dim, moe_intermediate_size=self.moe_intermediate,
                         num_experts=self.n_experts, num_experts_per_tok=self.top_k, score_func="sigmoid",
                         norm_topk_prob=True, n_group=self.n_group, topk_group=self.topk_group,
                         routed_scaling_factor=self.routed_scaling_factor, enable_expert_bias=True,
                         expert_bias_update_rate=self.bias_update_rate, seq_aux_loss_coeff=self.seq_aux_loss_coeff,
                         n_shared_experts=1)


SHORT_MODEL = ModelArgs(seq_len=64, dim=64, n_layers=3, n_heads=4, dense_intermediate=128, n_experts=8, top_k=3,
                        n_group=2, topk_group=1, moe_intermediate=32)


# ---------------------------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary_tables(seq_len: int, head_dim: int, device: torch.device, base: float = 10000.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos, sin` of the rotation angles, `[seq_len, head_dim / 2]`."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head of `x [B, heads, S, head_dim]` by the position's angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head attention with rotary positions."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b s (three h d) -> three b h s d", three=3, h=self.n_heads)
        y = F.scaled_dot_product_attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, is_causal=True)
        return self.out(rearrange(y, "b h s d -> b s (h d)"))


class SequenceMoE(nn.Module):
    """`MoELayer` over `[B, S, H]` (its router sees sequences of `S` tokens for the sequence-wise
    balance loss), run in `compute_dtype`."""

    def __init__(self, moe: MoELayer, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.moe = moe
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x.to(self.compute_dtype))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, mlp: nn.Module) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(args.dim), RMSNorm(args.dim)
        self.attn = Attention(args.dim, args.n_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Decoder-only LM: the first layer dense, the others MoE (experts sharded over `group`)."""

    def __init__(self, args: ModelArgs, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__()
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        mlps = [SharedExpertMLP(args.dim, args.dense_intermediate)]  # a plain SwiGLU MLP
        mlps += [SequenceMoE(MoELayer(args.moe_config(), group, device=device), compute_dtype)
                 for _ in range(args.n_layers - 1)]
        self.layers = nn.ModuleList(Block(args, mlp) for mlp in mlps)
        self.norm = RMSNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.head_dim = args.dim // args.n_heads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Float32 logits; on GPUs the blocks run under BF16 autocast (training and evaluation alike)."""
        cos, sin = rotary_tables(tokens.size(1), self.head_dim, tokens.device)
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=tokens.is_cuda):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.head(self.norm(x)).float()

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]


def build_model(args: ModelArgs, group: dist.ProcessGroup, device: torch.device, seed: int) -> Transformer:
    """Replicated parameters equal on every rank (same seed); each rank's experts drawn apart."""
    torch.manual_seed(seed)
    model = Transformer(args, group, device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1 + dist.get_rank(group))
        for moe in model.moe_layers():
            moe.experts.reset_parameters()
    return model.to(device)


# ----------------------------------------------------------------------------------------------- data


def load_corpus(path: Path, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of the text as int64 tokens, split into train and validation parts."""
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    split = int(len(data) * (1 - val_fraction))
    return data[:split], data[split:]


def windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets of the windows beginning at `starts`."""
    rows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def train_batch(data: torch.Tensor, batch: int, seq_len: int, seed: int, step: int, rank: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows, a function of (seed, step, rank) only, so a resumed run sees the same data."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return windows(data, torch.randint(0, len(data) - seq_len - 1, (batch,), generator=generator), seq_len)


# ------------------------------------------------------------------------------------------- training


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def evaluate(model: Transformer, val: torch.Tensor, seq_len: int, num_windows: int, device: torch.device) -> float:
    """Mean next-byte loss over `num_windows` fixed validation windows, dealt out to the ranks (the
    same windows whatever the world size; each rank runs one batch, as the MoE layers are collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    starts = torch.linspace(0, len(val) - seq_len - 1, max(num_windows, world)).long()
    x, y = windows(val, starts[rank::world], seq_len)
    model.eval()
    logits = model(x.to(device))
    model.train()
    totals = torch.tensor([F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), reduction="sum").item(),
                           y.numel()], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def save_checkpoint(folder: Path, model: Transformer, optimizers: dict[str, torch.optim.Optimizer],
                    state: dict) -> None:
    """Rank 0 writes the replicated part, every rank its expert shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    folder.mkdir(parents=True, exist_ok=True)
    expert_keys = {name for name, _ in expert_parameters(model)}
    weights = model.state_dict()
    shard = {"model": {k: v for k, v in weights.items() if k in expert_keys},
             "optimizer": optimizers["experts"].state_dict() if "experts" in optimizers else None}
    torch.save(shard, shard_path(folder, rank, world))
    if rank == 0:
        replicated = {k: v for k, v in weights.items() if k not in expert_keys}
        torch.save({**state, "world": world, "model": replicated,
                    "optimizer": optimizers["replicated"].state_dict()}, folder / REPLICATED)
    dist.barrier()


def load_checkpoint(folder: Path, model: Transformer, optimizers: dict[str, torch.optim.Optimizer],
                    device: torch.device) -> dict:
    """Restore what `save_checkpoint` wrote (same world size); returns the saved training state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    replicated = torch.load(folder / REPLICATED, map_location=device, weights_only=True)
    if replicated["world"] != world:
        raise SystemExit(f"--resume: the checkpoint has {replicated['world']} ranks, this run {world}; "
                         f"merge it with convert_checkpoint.py and use --init-from")
    shard = torch.load(shard_path(folder, rank, world), map_location=device, weights_only=True)
    model.load_state_dict({**replicated["model"], **shard["model"]})
    optimizers["replicated"].load_state_dict(replicated["optimizer"])
    if "experts" in optimizers:
        optimizers["experts"].load_state_dict(shard["optimizer"])
    return {key: replicated[key] for key in ("step", "history")}


def make_optimizers(model: Transformer, lr: float) -> dict[str, torch.optim.Optimizer]:
    """AdamW for the replicated parameters and, apart (saved per rank), for the expert shards."""
    expert_ids = {id(p) for _, p in expert_parameters(model)}
    groups = {"replicated": [p for p in model.parameters() if id(p) not in expert_ids],
              "experts": [p for p in model.parameters() if id(p) in expert_ids]}
    return {name: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
            for name, params in groups.items() if params}


def train_step(model: Transformer, optimizers: dict[str, torch.optim.Optimizer], x: torch.Tensor, y: torch.Tensor,
               lr: float) -> tuple[float, float]:
    """One optimizer step on every rank's batch; returns the mean loss over ranks and the balance
    (max / mean tokens per expert over all ranks, averaged over the MoE layers)."""
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    sync_gradients(model)
    for optimizer in optimizers.values():
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for moe in model.moe_layers():
        moe.router.update_expert_bias(group=moe.group)
    counts = torch.stack([moe.router.last_metrics["tokens_per_expert"].float() for moe in model.moe_layers()])
    stats = torch.cat([loss.detach().float().reshape(1), counts.flatten().to(x.device)])
    dist.all_reduce(stats)
    counts = stats[1:].view_as(counts)
    return stats[0].item() / dist.get_world_size(), (counts.max(-1).values / counts.mean(-1)).mean().item()


def plot(history: dict[str, list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps, losses = zip(*history["train"])
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="train (per step)")
    window = max(1, len(losses) // 25)
    smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
              for i in range(len(losses))]
    ax.plot(steps, smooth, lw=1.5, label=f"train (mean of {window})")
    if history["val"]:
        ax.plot(*zip(*history["val"]), "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats / byte)", title="DeepSeek-V3-style MoE, byte-level LM")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(out: Path, history: dict[str, list], world: int, short: bool) -> None:
    """Write `metrics.json`; with `short`, fail unless the validation loss fell clearly."""
    (first_step, first), (last_step, last) = history["val"][0], history["val"][-1]
    metrics = {"world": world, "step": last_step, "initial_val_loss": first, "final_val_loss": last}
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"validation loss {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step}); wrote {out}/")
    if short and last_step > first_step and not last < 0.85 * first:
        raise SystemExit(f"--short: the validation loss did not fall enough ({first:.3f} -> {last:.3f})")


def run(rank: int, world: int, device: torch.device, opts: argparse.Namespace) -> None:
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    margs = ModelArgs(**opts.model_args)
    out = Path(opts.out_dir)
    model = build_model(margs, dist.group.WORLD, device, opts.seed)
    if opts.init_from:
        model.load_state_dict(torch.load(opts.init_from, map_location=device, weights_only=True)["model"])
    optimizers = make_optimizers(model, opts.lr)
    train, val = load_corpus(Path(opts.data))
    state = {"step": 0, "history": {"train": [], "val": []}}
    if opts.resume and (out / "checkpoint" / REPLICATED).exists():
        state = load_checkpoint(out / "checkpoint", model, optimizers, device)
    history = state["history"]
    if not history["val"]:
        history["val"].append((state["step"], evaluate(model, val, margs.seq_len, opts.eval_windows, device)))
    last = min(opts.steps, opts.stop_at or opts.steps)
    buffer = model.moe_layers()[0].dispatcher.buffer
    nodes = buffer.node_topology()  # collective the first time: every rank asks
    if rank == 0:
        probe = torch.empty(0, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        print(f"{world} ranks on {device.type} ({dist.get_backend()}), MoE communication backend: "
              f"{buffer.backend_name_for(probe)}, {nodes.num_nodes} node(s) of {nodes.num_ranks_per_node} ranks")
    bar = tqdm(range(state["step"], last), initial=state["step"], total=opts.steps, disable=rank != 0,
               dynamic_ncols=True, desc=f"train ({world} ranks, {device.type})")
    for step in bar:
        start = time.perf_counter()
        x, y = train_batch(train, opts.batch, margs.seq_len, opts.seed, step, rank)
        loss, balance = train_step(model, optimizers, x.to(device), y.to(device),
                                   lr_at(step, opts.steps, opts.lr, opts.warmup))
        history["train"].append((step + 1, loss))
        tokens_per_s = world * x.numel() / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", balance=f"{balance:.2f}")
        if step + 1 == last or (step + 1) % opts.eval_every == 0:
            history["val"].append((step + 1, evaluate(model, val, margs.seq_len, opts.eval_windows, device)))
            if rank == 0:
                bar.write(f"step {step + 1}: validation loss {history['val'][-1][1]:.3f}")
        if step + 1 == last or (step + 1) % opts.save_every == 0:
            save_checkpoint(out / "checkpoint", model, optimizers,
                            {"step": step + 1, "history": history, "model_args": asdict(margs)})
            if rank == 0:
                plot(history, out / "loss.png")
    bar.close()
    if rank == 0:
        report(out, history, world, opts.short)


def default_world(num_experts: int) -> int:
    """One rank per GPU when the GPUs can share the experts evenly, else 2 CPU ranks."""
    gpus = torch.cuda.device_count()
    return gpus if gpus and num_experts % gpus == 0 else 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=None,
                        help="ranks to spawn (default: one per GPU when there are GPUs, else 2; ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 250, --short 40)")
    parser.add_argument("--stop-at", type=int, default=None, help="save and stop at this step (as if preempted)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-windows", type=int, default=32, help="validation windows per evaluation")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--data", default=str(DATA), help="UTF-8 text file")
    parser.add_argument("--out-dir", default="runs/deepseek_v3")
    parser.add_argument("--resume", action="store_true", help="continue from OUT_DIR/checkpoint if present")
    parser.add_argument("--init-from", help="full checkpoint (convert_checkpoint.py) to start from, any world size")
    parser.add_argument("--short", action="store_true", help="tiny model and few steps; fail unless the loss falls")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="split the ranks into virtual nodes of this many ranks (1-8): MoE communication "
                             "takes the internode (hierarchical) path as across real nodes")
    opts = parser.parse_args()
    if opts.ranks_per_node is not None:  # the Buffers of every rank (spawned or under torchrun) read it
        os.environ["MOE_EP_NUM_RANKS_PER_NODE"] = str(opts.ranks_per_node)
    opts.model_args = asdict(SHORT_MODEL if opts.short else ModelArgs())
    if opts.init_from:
        opts.model_args = torch.load(opts.init_from, weights_only=True)["model_args"]
    opts.steps = opts.steps if opts.steps is not None else (40 if opts.short else 250)
    opts.world = opts.world or default_world(ModelArgs(**opts.model_args).n_experts)
    return opts


if __name__ == "__main__":
    arguments = parse_args()
    launch(run, arguments.world, arguments)
