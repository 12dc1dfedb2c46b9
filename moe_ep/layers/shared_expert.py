"""Shared (always-on) SwiGLU expert with an optional sigmoid output gate."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..kernels.grouped import swiglu


class SharedExpertMLP(nn.Module):
    """`down(silu(gate_proj(x)) * up_proj(x))`, times `sigmoid(x @ shared_expert_gate)` when gated.

    Names follow Hugging Face (DeepSeek `shared_experts.{gate,up,down}_proj`, Qwen2/3-MoE
    `shared_expert_gate`, a `[1, H]` linear without bias).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, gate: bool = False,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **factory)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, **factory) if gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(x)) * out
        return out
