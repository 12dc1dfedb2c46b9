"""Top-k router: fp32 gate, group-limited selection, aux-loss-free bias, auxiliary losses, dropping."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..ops.validation import check_tensor
from .config import MoEConfig

# Keeps top-k normalisation finite when every selected sigmoid score underflows.
_NORM_EPS = 1e-20


class AuxLossInjector(torch.autograd.Function):
    """Returns `output` unchanged; in backward, also sends `scale` as the gradient of `aux_loss`.

    This adds `d(aux_loss)/d(params)` to the gradients without the caller adding the loss to its
    own, whatever path `output` takes afterwards (as long as it reaches the loss).
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


def load_balancing_loss(probs: torch.Tensor, selected: torch.Tensor, topk: int) -> torch.Tensor:
    """`mean_g sum_e f_ge * P_ge` over groups g of tokens: `probs`, `selected` are `[G, S, E]`.

    `f_ge = E / (k S) * (tokens of g selecting e)` (1 when balanced) and `P_ge` the mean over g's
    tokens of `probs` (scores normalised over all experts). One group is the micro-batch loss of
    Switch/GShard; one group per sequence is DeepSeek-V3's sequence-wise loss.
    """
    num_tokens, num_experts = probs.shape[-2:]
    if probs.numel() == 0:  # no tokens (a rank with an empty batch): nothing to balance, and no 0 / 0
        return probs.sum()  # zero, with a zero gradient
    fraction = selected.float().sum(-2) * (num_experts / (topk * num_tokens))
    return (fraction * probs.mean(-2)).sum(-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of `logsumexp(logits)^2` (zero without tokens)."""
    if logits.size(0) == 0:
        return logits.sum()  # zero, with a zero gradient, where the mean of nothing would be NaN
    return torch.logsumexp(logits, dim=-1).square().mean()


class TopKRouter(nn.Module):
    """Chooses `num_experts_per_tok` experts per token and their weights.

    `forward(hidden [T, H]) -> (topk_idx [T, k] int64, topk_weights [T, k] float32)`; dropped slots
    (capacity factor) are `-1` with weight 0. After each forward, `last_aux_losses` (detached, by
    name, training only) and `last_metrics` (`tokens_per_expert`, `max_load`, `mean_load`,
    `max_over_mean_load`, `num_dropped`, after dropping) describe that call. Auxiliary losses reach
    the gradients through `AuxLossInjector` on the returned weights, scaled by `aux_loss_scale`
    (set it to, e.g., 1 / gradient-accumulation steps).
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        # Selections since the last `update_expert_bias` (not saved in checkpoints).
        self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.float32),
                             persistent=False)
        self.aux_loss_scale = 1.0
        self.last_aux_losses: dict[str, torch.Tensor] = {}
        self.last_metrics: dict[str, torch.Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.expert_bias.zero_()
        self.local_tokens_per_expert.zero_()

    def forward(self, hidden: torch.Tensor, seq_len: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Route `hidden [T, H]`; `seq_len` splits the tokens into sequences for the sequence-wise
        aux loss (contiguous, `T / seq_len` of them; default: one sequence)."""
        cfg = self.config
        check_tensor("hidden", hidden, shape=(None, cfg.hidden_size))
        if seq_len is not None and (seq_len <= 0 or hidden.size(0) % seq_len != 0):
            raise ValueError(f"seq_len: expected a positive divisor of the token count {hidden.size(0)}, got {seq_len}")
        x = hidden.float()
        if self.training and cfg.input_jitter_eps > 0:
            x = x * torch.empty_like(x).uniform_(1 - cfg.input_jitter_eps, 1 + cfg.input_jitter_eps)
        with torch.autocast(device_type=x.device.type, enabled=False):  # the gate stays in fp32
            logits = F.linear(x, self.weight.float())

        scores = self._scores(logits)
        topk_idx = self._select(scores.detach())
        topk_weights = self._weights(scores, topk_idx)

        selected = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, topk_idx, True)
        # Grad-enabled only, so activation recomputation does not count a batch twice.
        if self.training and cfg.enable_expert_bias and torch.is_grad_enabled():
            self.local_tokens_per_expert += selected.sum(0)
        losses = self._aux_losses(logits, selected, seq_len) if self.training else {}
        self.last_aux_losses = {name: loss.detach() for name, loss in losses.items()}
        if losses and torch.is_grad_enabled():
            topk_weights = AuxLossInjector.apply(topk_weights, sum(losses.values()), self.aux_loss_scale)
        if cfg.capacity_factor is not None:
            topk_idx, topk_weights = self._drop_over_capacity(topk_idx, topk_weights, selected)
        self._record_metrics(topk_idx)
        return topk_idx, topk_weights

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        """What selection ranks and weights are gathered from: probabilities, or logits when the
        softmax runs after top-k."""
        if self.config.score_func == "sigmoid":
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1) if self.config.softmax_before_topk else logits

    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        choice = scores + self.expert_bias.float() if cfg.enable_expert_bias else scores
        if cfg.n_group > 1:
            grouped = rearrange(choice, "t (g e) -> t g e", g=cfg.n_group)
            group_scores = grouped.topk(cfg.group_score_topk, dim=-1).values.sum(-1)
            kept_groups = group_scores.topk(cfg.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
            # -inf, not 0: choice scores may be negative (biases), and 0 would beat them.
            choice = rearrange(grouped.masked_fill(~keep[..., None], float("-inf")), "t g e -> t (g e)")
        return choice.topk(cfg.num_experts_per_tok, dim=-1).indices

    def _weights(self, scores: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        weights = scores.gather(1, topk_idx)
        if cfg.score_func == "softmax" and not cfg.softmax_before_topk:
            weights = torch.softmax(weights, dim=-1)
        elif cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + _NORM_EPS)
        return weights * cfg.routed_scaling_factor

    def _aux_losses(
        self, logits: torch.Tensor, selected: torch.Tensor, seq_len: Optional[int]
    ) -> dict[str, torch.Tensor]:
        cfg = self.config
        losses: dict[str, torch.Tensor] = {}
        if cfg.aux_loss_coeff > 0 or cfg.seq_aux_loss_coeff > 0:
            probs = self._aux_probs(logits)
            if cfg.aux_loss_coeff > 0:
                losses["aux_loss"] = cfg.aux_loss_coeff * load_balancing_loss(
                    probs[None], selected[None], cfg.num_experts_per_tok)
            if cfg.seq_aux_loss_coeff > 0:
                split = seq_len or max(logits.size(0), 1)  # one sequence; none without tokens
                losses["seq_aux_loss"] = cfg.seq_aux_loss_coeff * load_balancing_loss(
                    rearrange(probs, "(b s) e -> b s e", s=split),
                    rearrange(selected, "(b s) e -> b s e", s=split), cfg.num_experts_per_tok)
        if cfg.z_loss_coeff > 0:
            losses["z_loss"] = cfg.z_loss_coeff * z_loss(logits)
        return losses

    def _aux_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Scores over all experts summing to 1 per token, as the balance losses expect."""
        if self.config.score_func == "softmax":
            return torch.softmax(logits, dim=-1)
        scores = torch.sigmoid(logits)
        return scores / (scores.sum(-1, keepdim=True) + _NORM_EPS)

    def _drop_over_capacity(
        self, topk_idx: torch.Tensor, topk_weights: torch.Tensor, selected: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep at most `ceil(T * k / E * capacity_factor)` slots per expert: the highest weights
        ("probs") or the earliest tokens ("position"); the rest become `-1` with weight 0."""
        cfg = self.config
        num_tokens = topk_idx.size(0)
        capacity = math.ceil(num_tokens * cfg.num_experts_per_tok / cfg.num_experts * cfg.capacity_factor)
        if cfg.drop_policy == "position":
            keep = selected & (selected.cumsum(0) <= capacity)
        else:
            ranking = torch.full_like(selected, float("-inf"), dtype=torch.float32)
            ranking.scatter_(1, topk_idx, topk_weights.detach())
            kept_tokens = ranking.topk(min(capacity, num_tokens), dim=0).indices
            keep = selected & torch.zeros_like(selected).scatter_(0, kept_tokens, True)
        keep_slot = keep.gather(1, topk_idx)
        return (torch.where(keep_slot, topk_idx, -1),
                torch.where(keep_slot, topk_weights, torch.zeros_like(topk_weights)))

    @torch.no_grad()
    def _record_metrics(self, topk_idx: torch.Tensor) -> None:
        valid = topk_idx >= 0
        load = torch.bincount(topk_idx[valid], minlength=self.config.num_experts)
        mean_load = load.float().mean()
        max_load = load.max().float()
        self.last_metrics = {
            "tokens_per_expert": load,
            "max_load": max_load,
            "mean_load": mean_load,
            "max_over_mean_load": max_load / mean_load.clamp(min=1e-9),
            "num_dropped": (~valid).sum(),
        }

    @torch.no_grad()
    def update_expert_bias(
        self, tokens_per_expert: Optional[torch.Tensor] = None, group: Optional[dist.ProcessGroup] = None
    ) -> None:
        """One aux-loss-free balancing step (call once per optimizer step): `b += rate * sign(mean(c) - c)`.

        `c` is `tokens_per_expert` (default: the selections accumulated by `forward` since the last
        call, which are then cleared), summed over `group` (default: the whole world when
        torch.distributed is initialized). With `center_expert_bias`, `b` is then shifted to mean 0.
        Does nothing in eval mode or when the bias is disabled.
        """
        cfg = self.config
        if not (self.training and cfg.enable_expert_bias):
            return
        counts = self.local_tokens_per_expert if tokens_per_expert is None else tokens_per_expert
        counts = check_tensor("tokens_per_expert", counts, shape=(cfg.num_experts,)).float().clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        self.expert_bias += cfg.expert_bias_update_rate * torch.sign(counts.mean() - counts)
        if cfg.center_expert_bias:
            self.expert_bias -= self.expert_bias.mean()
        if tokens_per_expert is None:
            self.local_tokens_per_expert.zero_()
