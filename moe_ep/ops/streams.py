"""Running communication on a side stream with DeepEP's event semantics."""

from __future__ import annotations

import contextlib
from typing import ContextManager, NamedTuple, Optional, Sequence

import torch

from .event import EventOverlap


class DeviceStreams(NamedTuple):
    """A device's communication stream and the two events that order it against the caller's stream in a
    synchronous call. The events are recorded again by every call: a stream's wait takes the record made
    before it, so reusing them saves creating two events per call (which costs more than the launches)."""

    comm: torch.cuda.Stream
    enter: torch.cuda.Event  # the caller's stream, up to the call: the comm stream waits for it
    leave: torch.cuda.Event  # the comm stream, up to the call's end: the caller's stream waits for it


class CommStreams:
    """One communication stream per CUDA device, created on first use."""

    def __init__(self) -> None:
        self._streams: dict[int, DeviceStreams] = {}

    def of(self, device: torch.device) -> DeviceStreams:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = DeviceStreams(torch.cuda.Stream(device=index), torch.cuda.Event(),
                                                 torch.cuda.Event())
        return self._streams[index]

    def get(self, device: torch.device) -> torch.cuda.Stream:
        return self.of(device).comm


class _OnStream:
    """Makes `stream` the current one inside (what `torch.cuda.stream` does, with fewer runtime calls:
    the caller already knows the stream to go back to)."""

    def __init__(self, stream: torch.cuda.Stream, back_to: torch.cuda.Stream) -> None:
        self.stream, self.back_to = stream, back_to

    def __enter__(self) -> None:
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self.back_to)


class StreamScope:
    """Where one Buffer call's work runs, with DeepEP's event semantics.

    Work inside `run` goes to the comm stream after `previous_event` (or the current stream), every
    call's: the one comm stream keeps the Buffer's operations in order, whatever events a caller passes
    (running a synchronous call on the current stream instead would let a later call that waits only
    for an older event overlap it, two kernels in the same buffer).

    `finish(inputs, outputs)` records the completion event, keeps inputs and outputs alive for the
    stream that uses them, and makes the current stream wait unless `async_finish`.
    """

    def __init__(
        self,
        streams: CommStreams,
        device: torch.device,
        previous_event: Optional[EventOverlap],
        async_finish: bool,
        allocate_on_comm_stream: bool,
    ) -> None:
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError("allocate_on_comm_stream: requires previous_event and async_finish=True")
        self.async_finish = async_finish
        self.allocate_on_comm_stream = allocate_on_comm_stream
        waits = previous_event is not None and previous_event.event is not None
        self.on_comm_stream = device.type == "cuda"
        if self.on_comm_stream:
            self.compute = torch.cuda.current_stream(device)
            own = streams.of(device)
            self.comm, self._leave = own.comm, own.leave
            if waits:
                self.comm.wait_event(previous_event.event)
            else:
                own.enter.record(self.compute)
                self.comm.wait_event(own.enter)

    def run(self) -> ContextManager[object]:
        """The context the call's work runs in: the comm stream, or where the caller is."""
        return _OnStream(self.comm, self.compute) if self.on_comm_stream else contextlib.nullcontext()

    def finish(self, inputs: Sequence[object], outputs: Sequence[object]) -> EventOverlap:
        if not self.on_comm_stream:
            return EventOverlap()
        if not self.async_finish:
            self._leave.record(self.comm)
            # Nothing queued on the current stream from now on runs before the comm stream's work, so
            # the inputs need no record; the outputs, allocated on the comm stream, are used here.
            for tensor in _tensors(outputs):
                tensor.record_stream(self.compute)
            self.compute.wait_event(self._leave)
            return EventOverlap()
        event = torch.cuda.Event()  # the caller holds it: one of its own
        event.record(self.comm)
        for tensor in _tensors(inputs):
            tensor.record_stream(self.comm)
        if not self.allocate_on_comm_stream:
            for tensor in _tensors(outputs):
                tensor.record_stream(self.compute)
        return EventOverlap(event, tuple(_tensors(inputs)) + tuple(_tensors(outputs)))


def _tensors(items: Sequence[object]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, torch.Tensor):
            if item.is_cuda:
                found.append(item)
        elif isinstance(item, (tuple, list)):
            found.extend(_tensors(item))
    return found
