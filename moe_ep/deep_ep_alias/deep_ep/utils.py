"""What `import deep_ep.utils` gives where moe_ep stands in for DeepEP."""

from ...ops.event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
