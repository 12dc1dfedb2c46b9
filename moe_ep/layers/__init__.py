"""nn.Modules built on the communication ops."""

from .config import MoEConfig
from .experts import GroupedMLP
from .router import TopKRouter
from .shared_expert import SharedExpertMLP

__all__ = [
    "GroupedMLP",
    "MoEConfig",
    "SharedExpertMLP",
    "TopKRouter",
]
