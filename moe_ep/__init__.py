"""moe_ep: expert-parallel Mixture-of-Experts communication and layers for PyTorch.

`import moe_ep as deep_ep` runs programs written for DeepEP V1's `deep_ep.Buffer` unchanged;
`moe_ep.install_as_deep_ep()` lets programs that `import deep_ep` themselves find moe_ep.
"""

from .ops.backends.agreement import PeerTimeoutError
from .ops.buffer import Buffer, topk_idx_t
from .ops.config import Config
from .ops.event import EventHandle, EventOverlap
from .ops.validation import PeerInputError
from .deep_ep_alias import install_as_deep_ep

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "PeerInputError", "PeerTimeoutError",
           "install_as_deep_ep", "topk_idx_t"]
__version__ = "0.1.0"
