"""moe_ep: expert-parallel Mixture-of-Experts communication and layers for PyTorch.

`import moe_ep as deep_ep` runs programs written for DeepEP V1's `deep_ep.Buffer` unchanged.
"""

from .ops.backends.agreement import PeerTimeoutError
from .ops.buffer import Buffer, topk_idx_t
from .ops.config import Config
from .ops.event import EventOverlap
from .ops.validation import PeerInputError

__all__ = ["Buffer", "Config", "EventOverlap", "PeerInputError", "PeerTimeoutError", "topk_idx_t"]
__version__ = "0.1.0"
