"""Events that order the communication stream against the compute stream."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch


class EventOverlap:
    """A CUDA event (or nothing, on CPU) with the tensors that must live until it completes.

    Use as a context manager to overlap work with communication: on exit the current stream waits
    for the event.
    """

    def __init__(self, event: Union[torch.cuda.Event, EventHandle, None] = None,
                 extra_tensors: Optional[tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (a no-op without one)."""
        if isinstance(self.event, EventHandle):
            self.event.current_stream_wait()
        elif self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        self.current_stream_wait()


class EventHandle:
    """DeepEP's `EventHandle`: an event recorded on the current CUDA stream when it is created.

    Programs written for DeepEP build `EventOverlap(EventHandle())` to order a communication call
    after the compute queued so far; on a machine without CUDA it records nothing and waiting on it
    does nothing. It can stand where a `torch.cuda.Event` is expected by `Stream.wait_event`, which
    calls `wait(stream)`.
    """

    def __init__(self) -> None:
        self.event: Optional[torch.cuda.Event] = None
        if torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Make `stream` (the current stream by default) wait for the event."""
        if self.event is not None:
            self.event.wait(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (a no-op without CUDA)."""
        self.wait()


def capture_event() -> EventOverlap:
    """An event recorded on the current CUDA stream, or an empty one without CUDA."""
    if not torch.cuda.is_available():
        return EventOverlap()
    event = torch.cuda.Event()
    event.record()
    return EventOverlap(event)
