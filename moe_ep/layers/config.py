"""`MoEConfig`: every setting of the MoE layers, checked once when the config is built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from ..kernels.grouped import GROUPED_MM_ROW_ALIGNMENT
from ..ops.constants import FP8_BLOCK, NUM_MAX_TOPK

ScoreFunc = Literal["softmax", "sigmoid"]
DropPolicy = Literal["probs", "position"]
DispatchMode = Literal["normal", "low_latency"]

FP8_EXPERT_ALIGNMENT = 16
BF16_EXPERT_ALIGNMENT = GROUPED_MM_ROW_ALIGNMENT


def _require(ok: bool, field: str, expected: str, got: object) -> None:
    if not ok:
        raise ValueError(f"MoEConfig.{field}: expected {expected}, got {got!r}")


@dataclass
class MoEConfig:
    """Settings of one MoE layer (router, experts, shared experts, dispatch precision).

    Names follow Hugging Face configs where one exists (`num_experts_per_tok`, `norm_topk_prob`,
    `n_group`, `topk_group`, `routed_scaling_factor`). Fields left as `None` are resolved in
    `__post_init__`: `group_score_topk` to 2 for sigmoid (DeepSeek-V3) and 1 for softmax (the group
    maximum, DeepSeek-V2), `shared_expert_intermediate_size` to `n_shared_experts *
    moe_intermediate_size`, `expert_alignment` to 16 when any FP8 path is on, else 8 (what the CUDA grouped
    GEMMs need).
    """

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int

    # Router scores and selection.
    score_func: ScoreFunc = "softmax"
    softmax_before_topk: bool = True
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score_topk: Optional[int] = None
    routed_scaling_factor: float = 1.0

    # Aux-loss-free balancing: a selection-only bias nudged by `expert_bias_update_rate` per step.
    enable_expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3
    center_expert_bias: bool = False

    # Auxiliary losses (0 disables each one).
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0

    # Multiplicative uniform noise `U(1 - eps, 1 + eps)` on the router input while training.
    input_jitter_eps: float = 0.0

    # Token dropping: `None` keeps every token.
    capacity_factor: Optional[float] = None
    drop_policy: DropPolicy = "probs"

    # Shared experts.
    n_shared_experts: int = 0
    shared_expert_intermediate_size: Optional[int] = None
    shared_expert_gate: bool = False

    # Expert computation and dispatch precision.
    expert_alignment: Optional[int] = None
    use_fp8_dispatch: bool = False
    use_fp8_experts: bool = False
    # The experts' weight gradients as FP8 GEMMs too (`GroupedMLP(fp8_weight_grads=True)`).
    use_fp8_weight_grads: bool = False

    # Token dispatch: "normal" (training, prefill) or "low_latency" (the packed layout, at most
    # `low_latency_max_tokens` tokens per rank). `num_worst_tokens > 0` makes normal-mode shapes static
    # (no host sync): at most that many rows may arrive on a rank. `low_latency_max_tokens` also bounds
    # each micro-batch of `MoELayer.decode`.
    dispatch_mode: DispatchMode = "normal"
    num_worst_tokens: int = 0
    low_latency_max_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "n_group"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, name, "a positive int", value)
        _require(self.score_func in ("softmax", "sigmoid"), "score_func", "'softmax' or 'sigmoid'", self.score_func)
        self._check_routing()
        self._check_balancing()
        self._check_shared_experts()
        self._check_precision()
        self._check_dispatch()

    def _check_routing(self) -> None:
        _require(self.num_experts_per_tok <= min(self.num_experts, NUM_MAX_TOPK), "num_experts_per_tok",
                 f"at most min(num_experts, {NUM_MAX_TOPK}) = {min(self.num_experts, NUM_MAX_TOPK)}",
                 self.num_experts_per_tok)
        _require(self.num_experts % self.n_group == 0, "n_group",
                 f"a divisor of num_experts ({self.num_experts})", self.n_group)
        _require(isinstance(self.topk_group, int) and 1 <= self.topk_group <= self.n_group, "topk_group",
                 f"an int in [1, n_group={self.n_group}]", self.topk_group)
        per_group = self.num_experts // self.n_group
        _require(self.num_experts_per_tok <= self.topk_group * per_group, "num_experts_per_tok",
                 f"at most topk_group * experts per group = {self.topk_group * per_group}", self.num_experts_per_tok)
        if self.group_score_topk is None:
            self.group_score_topk = min(2 if self.score_func == "sigmoid" else 1, per_group)
        _require(isinstance(self.group_score_topk, int) and 1 <= self.group_score_topk <= per_group,
                 "group_score_topk", f"an int in [1, experts per group={per_group}]", self.group_score_topk)
        _require(self.routed_scaling_factor > 0, "routed_scaling_factor", "a positive number",
                 self.routed_scaling_factor)

    def _check_balancing(self) -> None:
        for name in ("expert_bias_update_rate", "aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value >= 0, name, "a finite number >= 0", value)
        _require(0 <= self.input_jitter_eps < 1, "input_jitter_eps", "a number in [0, 1)", self.input_jitter_eps)
        _require(self.capacity_factor is None or self.capacity_factor > 0, "capacity_factor",
                 "None or a positive number", self.capacity_factor)
        _require(self.drop_policy in ("probs", "position"), "drop_policy", "'probs' or 'position'", self.drop_policy)

    def _check_shared_experts(self) -> None:
        _require(isinstance(self.n_shared_experts, int) and self.n_shared_experts >= 0, "n_shared_experts",
                 "an int >= 0", self.n_shared_experts)
        if self.shared_expert_intermediate_size is None:
            self.shared_expert_intermediate_size = self.n_shared_experts * self.moe_intermediate_size
        _require(self.n_shared_experts == 0 or self.shared_expert_intermediate_size > 0,
                 "shared_expert_intermediate_size", "a positive int when n_shared_experts > 0",
                 self.shared_expert_intermediate_size)
        _require(not self.shared_expert_gate or self.n_shared_experts > 0, "shared_expert_gate",
                 "False when n_shared_experts is 0", self.shared_expert_gate)

    def _check_precision(self) -> None:
        if self.expert_alignment is None:
            self.expert_alignment = FP8_EXPERT_ALIGNMENT if self.use_fp8 else BF16_EXPERT_ALIGNMENT
        _require(isinstance(self.expert_alignment, int) and self.expert_alignment >= 1, "expert_alignment",
                 "an int >= 1", self.expert_alignment)
        if self.use_fp8:
            _require(self.hidden_size % FP8_BLOCK == 0, "hidden_size",
                     f"a multiple of {FP8_BLOCK} with FP8 dispatch or experts", self.hidden_size)
        _require(not self.use_fp8_weight_grads or self.use_fp8_experts, "use_fp8_weight_grads",
                 "False unless use_fp8_experts", self.use_fp8_weight_grads)
        if self.use_fp8_experts:
            _require(self.moe_intermediate_size % FP8_BLOCK == 0, "moe_intermediate_size",
                     f"a multiple of {FP8_BLOCK} with FP8 experts", self.moe_intermediate_size)

    def _check_dispatch(self) -> None:
        _require(self.dispatch_mode in ("normal", "low_latency"), "dispatch_mode", "'normal' or 'low_latency'",
                 self.dispatch_mode)
        _require(isinstance(self.num_worst_tokens, int) and self.num_worst_tokens >= 0, "num_worst_tokens",
                 "an int >= 0", self.num_worst_tokens)
        _require(self.low_latency_max_tokens is None
                 or (isinstance(self.low_latency_max_tokens, int) and self.low_latency_max_tokens > 0),
                 "low_latency_max_tokens", "None or a positive int", self.low_latency_max_tokens)
        _require(self.dispatch_mode == "normal" or self.low_latency_max_tokens is not None, "low_latency_max_tokens",
                 "a positive int with dispatch_mode='low_latency'", self.low_latency_max_tokens)

    @property
    def use_fp8(self) -> bool:
        """Whether tokens or expert GEMMs use FP8 anywhere in the layer."""
        return self.use_fp8_dispatch or self.use_fp8_experts

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_group
