"""Swap the sparse MoE blocks of Hugging Face transformers (v5) models for expert-parallel `MoELayer`s.

Supported blocks: Mixtral (`MixtralSparseMoeBlock`), Qwen2-MoE (`Qwen2MoeSparseMoeBlock`), Qwen3-MoE
(`Qwen3MoeSparseMoeBlock`) and DeepSeek-V3 (`DeepseekV3MoE`). Each keeps its router semantics:

| family | scores | top-k weights | groups | extras |
|---|---|---|---|---|
| Mixtral | softmax, then top-k | always renormalised | - | `router_jitter_noise` -> router input jitter |
| Qwen2/3-MoE | softmax, then top-k | renormalised if `norm_topk_prob` | - | Qwen2: gated shared expert |
| DeepSeek-V3 | sigmoid | `norm_topk_prob`, times `routed_scaling_factor` | `n_group`/`topk_group`, top-2 sum | `e_score_correction_bias`, shared experts |

`output_router_logits` keeps working: each swapped block holds a stand-in for the Hugging Face router
class (`gate`), which the model's output-recording hooks find; it returns the router logits
(recomputed from the same gate weight, so HF's load-balancing loss still trains the router).
`hf_state_dict(model)` gives the weights back under the original names with full expert tensors.

Known differences: the router runs in float32 (Mixtral and Qwen compute the logits, and Qwen rounds
the top-k weights, in the model dtype), so BF16 models match to BF16 rounding, float32 ones exactly;
Mixtral's `router_jitter_noise` jitters only the router input here (HF also scales the experts' input).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..layers import MoEConfig, MoELayer

# Per block class: Hugging Face key prefixes inside the block -> `MoELayer` key prefixes (first match wins).
_ROUTED = (("gate.weight", "router.weight"), ("experts.", "experts."))
_KEY_PREFIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "MixtralSparseMoeBlock": _ROUTED,
    "Qwen3MoeSparseMoeBlock": _ROUTED,
    "Qwen2MoeSparseMoeBlock": _ROUTED + (("shared_expert_gate.", "shared_experts.shared_expert_gate."),
                                         ("shared_expert.", "shared_experts.")),
    "DeepseekV3MoE": _ROUTED + (("gate.e_score_correction_bias", "router.expert_bias"),
                                ("shared_experts.", "shared_experts.")),
}
_SIGMOID_BLOCKS = ("DeepseekV3MoE",)


def _rename(key: str, prefixes: tuple[tuple[str, str], ...], to_moe: bool) -> str:
    for hf_prefix, moe_prefix in prefixes:
        src, dst = (hf_prefix, moe_prefix) if to_moe else (moe_prefix, hf_prefix)
        if key.startswith(src):
            return dst + key[len(src):]
    raise KeyError(f"no counterpart for MoE block key {key!r}")


class _RouterLogits(nn.Module):
    """Returns `(router_logits, None, None)` like a Hugging Face router; holds no parameters.

    Instances are made of a subclass that also derives from the replaced router's class, so the
    model's `output_router_logits` hooks (matched by class) record what it returns.
    """

    def __init__(self, fp32: bool) -> None:
        nn.Module.__init__(self)
        self.fp32 = fp32

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if self.fp32:
            return F.linear(hidden.float(), weight.float()), None, None
        return F.linear(hidden, weight.to(hidden.dtype)), None, None


_LOGITS_CLASSES: dict[type, type] = {}


def _router_logits_module(router_class: type, fp32: bool) -> _RouterLogits:
    if router_class not in _LOGITS_CLASSES:
        _LOGITS_CLASSES[router_class] = type(f"{router_class.__name__}Logits", (_RouterLogits, router_class), {})
    return _LOGITS_CLASSES[router_class](fp32)


class HFMoEBlock(nn.Module):
    """A Hugging Face sparse MoE block computed by an expert-parallel `MoELayer` (`moe`)."""

    def __init__(self, moe: MoELayer, gate: _RouterLogits, key_prefixes: tuple[tuple[str, str], ...]) -> None:
        super().__init__()
        self.moe = moe
        self.gate = gate
        self.key_prefixes = key_prefixes

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.gate._forward_hooks:  # output-recording hooks installed: hand them the logits
            self.gate(hidden_states.reshape(-1, hidden_states.size(-1)), self.moe.router.weight)
        return self.moe(hidden_states)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This block's weights under the Hugging Face names, experts unsharded (collective)."""
        skip = ("experts.",) if self.moe.config.enable_expert_bias else ("experts.", "router.expert_bias")
        state = {key: value for key, value in self.moe.state_dict().items() if not key.startswith(skip)}
        state.update(self.moe.gather_full_expert_weights())
        return {self.hf_key(key): value for key, value in state.items()}

    def hf_key(self, moe_key: str) -> str:
        """The Hugging Face name (inside the block) of `moe`'s state key `moe_key`."""
        return _rename(moe_key, self.key_prefixes, to_moe=False)


def moe_config_for(block: nn.Module, **opts: Any) -> MoEConfig:
    """The `MoEConfig` reproducing a supported Hugging Face block; `opts` override any field."""
    kind = type(block).__name__
    if kind not in _KEY_PREFIXES:
        raise TypeError(f"replace_moe_blocks: unsupported MoE block {kind}")
    gate, experts = block.gate, block.experts
    act = type(experts.act_fn).__name__
    if act not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"replace_moe_blocks: {kind} uses {act}; MoELayer experts are SwiGLU (SiLU) only")
    num_experts, double_inter, hidden = experts.gate_up_proj.shape
    fields: dict[str, Any] = dict(hidden_size=hidden, moe_intermediate_size=double_inter // 2,
                                  num_experts=num_experts, num_experts_per_tok=gate.top_k)
    if kind not in _SIGMOID_BLOCKS:
        fields.update(score_func="softmax", softmax_before_topk=True,
                      norm_topk_prob=getattr(gate, "norm_topk_prob", True),  # Mixtral always renormalises
                      input_jitter_eps=getattr(block, "jitter_noise", 0.0))
        if hasattr(block, "shared_expert"):
            fields.update(n_shared_experts=1, shared_expert_gate=True,
                          shared_expert_intermediate_size=block.shared_expert.intermediate_size)
    else:
        fields.update(score_func="sigmoid", norm_topk_prob=gate.norm_topk_prob, n_group=gate.num_group,
                      topk_group=gate.topk_group, group_score_topk=min(2, num_experts // gate.num_group),
                      routed_scaling_factor=gate.routed_scaling_factor, enable_expert_bias=True,
                      n_shared_experts=1, shared_expert_intermediate_size=block.shared_experts.intermediate_size)
    fields.update(opts)
    return MoEConfig(**fields)


def _swap(block: nn.Module, group: Optional[dist.ProcessGroup], opts: dict[str, Any]) -> HFMoEBlock:
    kind = type(block).__name__
    weight = block.experts.gate_up_proj
    moe = MoELayer(moe_config_for(block, **opts), group, device=weight.device, dtype=weight.dtype)
    state = moe.state_dict()  # keeps what the block lacks (a zero expert bias) as built
    state.update({_rename(key, _KEY_PREFIXES[kind], to_moe=True): value for key, value in block.state_dict().items()})
    moe.load_state_dict(state)
    logits = _router_logits_module(type(block.gate), fp32=kind in _SIGMOID_BLOCKS)
    return HFMoEBlock(moe, logits, _KEY_PREFIXES[kind]).train(block.training)


def replace_moe_blocks(model: nn.Module, group: Optional[dist.ProcessGroup] = None, **opts: Any) -> int:
    """Replace every supported sparse MoE block of `model` in place by an `HFMoEBlock`.

    Each rank keeps only its experts' weights (copied from the block, which holds all of them), so
    call this on every rank of `group` (default: the world) with the same model. `opts` are
    `MoEConfig` fields that override the derived ones (e.g. `use_fp8_dispatch=True`). Returns the
    number of blocks replaced.
    """
    targets = [(name, module) for name, module in model.named_modules()
               if type(module).__name__ in _KEY_PREFIXES]
    for name, block in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, _swap(block, group, opts))
    return len(targets)


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` under the original Hugging Face names with full expert weights, as
    `save_pretrained` of the unswapped model would store it. Collective: call it on every rank."""
    state: dict[str, torch.Tensor] = {}
    swapped = {name: module for name, module in model.named_modules() if isinstance(module, HFMoEBlock)}
    for key, value in model.state_dict().items():
        if not any(key.startswith(f"{name}.") for name in swapped):
            state[key] = value
    for name, block in swapped.items():
        state.update({f"{name}.{key}": value for key, value in block.hf_state_dict().items()})
    return state
