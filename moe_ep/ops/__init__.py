"""Communication core: the Buffer, its backends, autograd ops and FP8 helpers."""

from . import fp8, routing
from .autograd import (DispatchOutput, LowLatencyDispatchOutput, combine, dispatch, low_latency_combine,
                       low_latency_dispatch)
from .buffer import Buffer, topk_idx_t
from .config import Config
from .event import EventOverlap
from .handles import DispatchHandle, LowLatencyHandle

__all__ = [
    "Buffer", "Config", "DispatchHandle", "DispatchOutput", "EventOverlap", "LowLatencyDispatchOutput",
    "LowLatencyHandle", "combine", "dispatch", "fp8", "low_latency_combine", "low_latency_dispatch", "routing",
    "topk_idx_t",
]
