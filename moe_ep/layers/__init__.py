"""nn.Modules built on the communication ops."""

from .config import MoEConfig
from .dispatcher import MoETokenDispatcher
from .experts import GroupedMLP
from .moe_layer import MoELayer
from .router import TopKRouter
from .shared_expert import SharedExpertMLP

__all__ = [
    "GroupedMLP",
    "MoEConfig",
    "MoELayer",
    "MoETokenDispatcher",
    "SharedExpertMLP",
    "TopKRouter",
]
