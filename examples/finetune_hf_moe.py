"""Fine-tune a Hugging Face Qwen3-MoE model with expert-parallel MoE layers, under accelerate.

    torchrun --nproc-per-node 2 examples/finetune_hf_moe.py --short           # CPU ranks over gloo
    accelerate launch --multi_gpu --num_processes 2 examples/finetune_hf_moe.py  # GPUs (NCCL); CPU too
    accelerate launch --multi_gpu --num_processes 8 examples/finetune_hf_moe.py --model /path/to/qwen3-moe

Without `--model` it builds a tiny random Qwen3-MoE over byte tokens (nothing is downloaded); with a
local checkpoint folder it loads that and its tokenizer. The sparse MoE blocks are swapped for
`MoELayer`s (`replace_moe_blocks`), experts sharded over all ranks; accelerate wraps the model in
DDP with the expert weights excluded, so only replicated parameters are all-reduced. Trains on the
shipped text with HF's router aux loss (`output_router_logits`), reports the evaluation loss, and
writes the result as an ordinary transformers checkpoint (experts gathered), which is reloaded
without the swap to check that it computes the same evaluation loss.

Note: `accelerate launch --cpu --num_processes N` starts a single process (accelerate only spreads
CPU jobs over mpirun); use torchrun or `--multi_gpu` as above, which works on CPUs as well.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

from moe_ep.integrations import ddp_ignored_names, scale_expert_gradients
from moe_ep.integrations.transformers import hf_state_dict, replace_moe_blocks

DATA = Path(__file__).parent / "data" / "corpus.txt"


def tiny_qwen3_moe(short: bool) -> Qwen3MoeForCausalLM:
    """A small random Qwen3-MoE over byte tokens (vocabulary 256)."""
    size = 48 if short else 96
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=size, intermediate_size=2 * size, moe_intermediate_size=size,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=size // 4,
                            num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, max_position_embeddings=512,
                            tie_word_embeddings=False, router_aux_loss_coef=0.01)
    return Qwen3MoeForCausalLM(config)


def load_model(path: str | None, short: bool, device: torch.device) -> tuple[PreTrainedModel, Callable[[str], list[int]]]:
    """The model to tune, on `device` (BF16 on GPUs, float32 on CPUs), and its text encoder (bytes for
    the tiny model)."""
    torch.manual_seed(0)  # the same initial weights on every rank
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if path is None:
        return tiny_qwen3_moe(short).to(device, dtype), lambda text: list(text.encode("utf-8"))
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).to(device)
    return model, lambda text: tokenizer(text)["input_ids"]


def window_datasets(ids: list[int], seq_len: int) -> tuple[TensorDataset, TensorDataset]:
    """Non-overlapping windows of the token ids: the last tenth for evaluation, the rest for training."""
    tokens = torch.tensor(ids[: len(ids) // seq_len * seq_len]).view(-1, seq_len)
    split = tokens.size(0) - max(1, tokens.size(0) // 10)
    return TensorDataset(tokens[:split]), TensorDataset(tokens[split:])


def init_single_process() -> None:
    """A one-rank process group when not launched distributed (the MoE layers need a group)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@torch.no_grad()
def window_losses(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of each window `[B, S]`."""
    logits = model(input_ids=windows).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none").mean(1)


def evaluate(model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> float:
    """Mean next-token loss over the evaluation set (padding duplicates dropped)."""
    model.eval()
    losses = torch.cat([accelerator.gather_for_metrics(window_losses(model, batch)) for (batch,) in loader])
    model.train()
    return losses.mean().item()


def reload_and_evaluate(state: dict[str, torch.Tensor], model: PreTrainedModel, out_dir: Path,
                        windows: torch.Tensor) -> float:
    """Save `state` as a plain transformers checkpoint, load it back (unswapped, on the CPU) and
    return its mean loss over `windows`."""
    plain = type(model)(model.config)
    plain.load_state_dict(state)
    plain.save_pretrained(out_dir)
    return window_losses(type(model).from_pretrained(out_dir).eval(), windows).mean().item()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local transformers checkpoint folder (default: a tiny random Qwen3-MoE)")
    parser.add_argument("--data", default=str(DATA), help="UTF-8 text file")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--out-dir", default="runs/finetune_hf_moe")
    parser.add_argument("--short", action="store_true", help="tiny sizes and few steps; fail unless the loss falls")
    args = parser.parse_args()
    if args.short:
        args.seq_len, args.epochs, args.lr = 64, 1.0, 5e-3
    return args


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_loader: DataLoader, eval_loader: DataLoader,
          accelerator: Accelerator, steps: int, args: argparse.Namespace) -> list[tuple[int, float]]:
    """`steps` optimizer steps (10 warm-up, then linear decay to a tenth); returns the evaluation
    losses by step."""
    world = accelerator.num_processes
    history = [(0, evaluate(model, eval_loader, accelerator))]
    bar = tqdm(total=steps, desc="fine-tune", disable=not accelerator.is_local_main_process, dynamic_ncols=True)
    step = 0
    while step < steps:
        for (batch,) in train_loader:
            for group in optimizer.param_groups:
                group["lr"] = args.lr * min(1.0, (step + 1) / 10) * (1 - 0.9 * step / steps)
            out = model(input_ids=batch, labels=batch, output_router_logits=True)
            accelerator.backward(out.loss)
            scale_expert_gradients(model, world)  # DDP averaged the rest
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.update()
            bar.set_postfix(loss=f"{out.loss.item():.3f}", aux=f"{out.aux_loss.item():.3f}")
            if step % args.eval_every == 0 or step == steps:
                history.append((step, evaluate(model, eval_loader, accelerator)))
                if accelerator.is_main_process:
                    bar.write(f"step {step}: evaluation loss {history[-1][1]:.3f}")
            if step == steps:
                break
    bar.close()
    return history


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    init_single_process()
    world = accelerator.num_processes
    model, encode = load_model(args.model, args.short, accelerator.device)
    # A group of its own for the expert all-to-alls, apart from DDP's gradient all-reduces.
    replaced = replace_moe_blocks(model, group=dist.new_group(list(range(world))))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ddp_ignored_names(model))

    train_set, eval_set = window_datasets(encode(Path(args.data).read_text(encoding="utf-8")), args.seq_len)
    train_loader = DataLoader(train_set, batch_size=args.batch, shuffle=True, drop_last=True,
                              generator=torch.Generator().manual_seed(0))
    eval_loader = DataLoader(eval_set, batch_size=args.batch)
    steps = max(1, math.ceil(args.epochs * len(train_loader) / world))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    accelerator.print(f"{replaced} MoE blocks on {world} ranks ({accelerator.device}, "
                      f"{dist.get_backend()}); {steps} steps of {world} x {args.batch} x {args.seq_len} tokens")
    history = train(model, optimizer, train_loader, eval_loader, accelerator, steps, args)

    state = hf_state_dict(accelerator.unwrap_model(model))  # collective: gathers the experts
    if accelerator.is_main_process:
        first, last = history[0][1], history[-1][1]
        reloaded = reload_and_evaluate(state, accelerator.unwrap_model(model), Path(args.out_dir),
                                       eval_set.tensors[0])
        print(f"evaluation loss {first:.3f} -> {last:.3f}; plain transformers model reloaded from "
              f"{args.out_dir}: {reloaded:.3f}")
        if args.short and not (last < 0.9 * first and abs(reloaded - last) < 1e-3 * last):
            raise SystemExit("--short: the loss did not fall, or the saved model computes a different loss")
    accelerator.wait_for_everyone()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
