"""Events that order the communication stream against the compute stream."""

from __future__ import annotations

from typing import Any, Optional

import torch


class EventOverlap:
    """A CUDA event (or nothing, on CPU) with the tensors that must live until it completes.

    Use as a context manager to overlap work with communication: on exit the current stream waits
    for the event.
    """

    def __init__(self, event: Optional[torch.cuda.Event] = None, extra_tensors: Optional[tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (a no-op without one)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        self.current_stream_wait()


def capture_event() -> EventOverlap:
    """An event recorded on the current CUDA stream, or an empty one without CUDA."""
    if not torch.cuda.is_available():
        return EventOverlap()
    event = torch.cuda.Event()
    event.record()
    return EventOverlap(event)
