"""What `import deep_ep` gives where moe_ep stands in for DeepEP: DeepEP V1's public names.

The clients listed in docs/clients.md import `Buffer`, `Config`, `EventOverlap` and `topk_idx_t`
from `deep_ep`, and `EventHandle` and `EventOverlap` from `deep_ep.utils`.
"""

from ...ops.buffer import Buffer, topk_idx_t
from ...ops.config import Config
from ...ops.event import EventHandle, EventOverlap
from . import utils

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "utils"]

# Names of other DeepEP releases and branches. Clients probe for them (`hasattr`, guarded imports)
# and take their DeepEP V1 path when they are missing, so they must stay missing.
_NOT_PROVIDED = {
    "ElasticBuffer": "DeepEP V2's ElasticBuffer",
    "EPHandle": "DeepEP V2's EPHandle",
    "HybridEPBuffer": "the hybrid-ep branch's HybridEPBuffer",
}


def __getattr__(name: str) -> object:
    if name in _NOT_PROVIDED:
        raise AttributeError(f"deep_ep.{name}: {_NOT_PROVIDED[name]} is not provided by moe_ep, which stands in for "
                             "DeepEP V1's API (Buffer, Config, EventOverlap, EventHandle); use the client's DeepEP V1 "
                             "path")
    raise AttributeError(f"module 'deep_ep' (moe_ep's stand-in for DeepEP V1) has no attribute {name!r}")
