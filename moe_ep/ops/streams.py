"""Running communication on a side stream with DeepEP's event semantics."""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional, Sequence

import torch

from .event import EventOverlap


class CommStreams:
    """One communication stream per CUDA device, created on first use."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def get(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]


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
            self.comm = streams.get(device)
            if waits:
                self.comm.wait_event(previous_event.event)
            else:
                self.comm.wait_stream(self.compute)

    def run(self) -> ContextManager[object]:
        """The context the call's work runs in: the comm stream, or where the caller is."""
        return torch.cuda.stream(self.comm) if self.on_comm_stream else contextlib.nullcontext()

    def finish(self, inputs: Sequence[object], outputs: Sequence[object]) -> EventOverlap:
        if not self.on_comm_stream:
            return EventOverlap()
        event = torch.cuda.Event()
        event.record(self.comm)
        if not self.async_finish:
            # Nothing queued on the current stream from now on runs before the comm stream's work, so
            # the inputs need no record; the outputs, allocated on the comm stream, are used here.
            for tensor in _tensors(outputs):
                tensor.record_stream(self.compute)
            self.compute.wait_event(event)
            return EventOverlap()
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
