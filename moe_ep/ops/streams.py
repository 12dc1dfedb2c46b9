"""Where a Buffer call's work runs, with DeepEP's event semantics.

A synchronous call (no `previous_event`, no `async_finish`) runs on the caller's current stream: its
outputs are ready in that stream's order with no event, no stream switch and no `record_stream`. A
call with `previous_event` or `async_finish` runs on the Buffer's comm stream after `previous_event`
(or the current stream); with `async_finish` it returns an event, else the current stream waits for
it. Either way, one Buffer's operations must not overlap (they share its buffers), so every call first
orders its stream after the stream the Buffer's latest operation ran on; when that is the same stream
(the usual case: all calls synchronous on one stream, or all asynchronous), stream order already does
it and nothing is recorded.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

import torch

from .event import EventOverlap

Result = TypeVar("Result")


class DeviceOrder:
    """One device's comm stream, and the stream the Buffer's latest operation on it ran on."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.comm = torch.cuda.Stream(device=index)
        self._comm_key = _key(self.comm)
        # Recorded again by every use (a wait takes the record made before it): creating events per call
        # costs more than the launches.
        self.enter = torch.cuda.Event()  # the current stream, for a call on the comm stream to wait for
        self.leave = torch.cuda.Event()  # the comm stream, for the current one to wait for (no async_finish)
        self._handoff = torch.cuda.Event()  # the latest operation's stream, at a change of stream
        self._last: Optional[torch.cuda.Stream] = None
        self._last_key: Optional[tuple[int, int, int]] = None

    def take_current(self) -> None:
        """A synchronous call: order the current stream after the latest operation."""
        # The stream's identity without building a Stream object, which costs more than the rest of the
        # check; the object is built only when the stream changes.
        key = torch._C._cuda_getCurrentStream(self.index)
        if key != self._last_key:
            self._switch(key, torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2]), None)

    def take_comm(self, ordered_after: Optional[torch.cuda.Stream]) -> None:
        """An asynchronous call: order the comm stream after the latest operation, unless that ran on
        `ordered_after`, a stream the comm stream already waits for."""
        if self._last_key != self._comm_key:
            self._switch(self._comm_key, self.comm, ordered_after)

    def caught_up(self, stream: torch.cuda.Stream) -> None:
        """`stream` has just been made to wait for the latest operation: later calls on it need no hand-off."""
        self._last, self._last_key = stream, _key(stream)

    def _switch(self, key: tuple[int, int, int], stream: torch.cuda.Stream,
                ordered_after: Optional[torch.cuda.Stream]) -> None:
        """`stream` waits for all work queued so far on the latest operation's stream and becomes the latest.
        While the current stream is captured into a CUDA graph nothing waits for work recorded outside
        the capture (CUDA forbids it; whoever replays the graph orders its replays)."""
        last, self._last, self._last_key = self._last, stream, key
        if last is None or last == ordered_after or torch.cuda.is_current_stream_capturing():
            return
        self._handoff.record(last)
        stream.wait_event(self._handoff)


def _key(stream: torch.cuda.Stream) -> tuple[int, int, int]:
    return (stream.stream_id, stream.device_index, stream.device_type)


class CommStreams:
    """The per-device `DeviceOrder` of one Buffer, created on first use."""

    def __init__(self) -> None:
        self._devices: dict[int, DeviceOrder] = {}

    def of(self, device: torch.device) -> DeviceOrder:
        index = device.index if device.index is not None else torch.cuda.current_device()
        order = self._devices.get(index)
        if order is None:
            order = self._devices[index] = DeviceOrder(index)
        return order

    def get(self, device: torch.device) -> torch.cuda.Stream:
        return self.of(device).comm


class CallScope:
    """Where one call's work runs. This one, a synchronous call's: where the caller is, its outputs ready
    in that stream's order."""

    def call(self, work: Callable[..., Result], *args: object) -> Result:
        """`work(*args)`, run where the call's work runs."""
        return work(*args)

    def finish(self, inputs: Sequence[object], outputs: Sequence[object]) -> EventOverlap:
        return EventOverlap()


SYNCHRONOUS = CallScope()


class OnCommStream(CallScope):
    """A call on the comm stream, after `previous_event` or the current stream.

    `finish(inputs, outputs)` keeps the outputs alive for the current stream (unless they belong to the
    comm stream); with `async_finish` it returns the call's event and keeps the inputs alive for the comm
    stream, else the current stream waits for the call."""

    def __init__(self, order: DeviceOrder, device: torch.device, previous_event: Optional[EventOverlap],
                 async_finish: bool, allocate_on_comm_stream: bool) -> None:
        self.async_finish = async_finish
        self.allocate_on_comm_stream = allocate_on_comm_stream
        self.compute = torch.cuda.current_stream(device)
        self.order, self.comm = order, order.comm
        if previous_event is not None and previous_event.event is not None:
            self.comm.wait_event(previous_event.event)
            order.take_comm(None)
        else:
            order.enter.record(self.compute)
            self.comm.wait_event(order.enter)
            order.take_comm(self.compute)

    def call(self, work: Callable[..., Result], *args: object) -> Result:
        # What `torch.cuda.stream` does, with fewer runtime calls: the stream to go back to is known.
        torch.cuda.set_stream(self.comm)
        try:
            return work(*args)
        finally:
            torch.cuda.set_stream(self.compute)

    def finish(self, inputs: Sequence[object], outputs: Sequence[object]) -> EventOverlap:
        if not self.async_finish:
            self.order.leave.record(self.comm)
            # Nothing queued on the current stream from now on runs before the comm stream's work, so
            # the inputs need no record; the outputs, allocated on the comm stream, are used here.
            for tensor in _tensors(outputs):
                tensor.record_stream(self.compute)
            self.compute.wait_event(self.order.leave)
            self.order.caught_up(self.compute)
            return EventOverlap()
        event = torch.cuda.Event()  # the caller holds it: one of its own
        event.record(self.comm)
        for tensor in _tensors(inputs):
            tensor.record_stream(self.comm)
        if not self.allocate_on_comm_stream:
            for tensor in _tensors(outputs):
                tensor.record_stream(self.compute)
        return EventOverlap(event, tuple(_tensors(inputs)) + tuple(_tensors(outputs)))


def open_scope(streams: CommStreams, tensor: torch.Tensor, previous_event: Optional[EventOverlap],
               async_finish: bool, allocate_on_comm_stream: bool) -> CallScope:
    """Where one Buffer call's work on `tensor`'s device runs (see the module docstring): `call(work, *args)`
    runs the work there, `finish(inputs, outputs)` returns the call's event."""
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError("allocate_on_comm_stream: requires previous_event and async_finish=True")
    if not tensor.is_cuda:  # (a fifth of `device.type`'s cost)
        return SYNCHRONOUS
    device = tensor.device
    order = streams.of(device)
    if async_finish or (previous_event is not None and previous_event.event is not None):
        return OnCommStream(order, device, previous_event, async_finish, allocate_on_comm_stream)
    order.take_current()
    return SYNCHRONOUS


def _tensors(items: Sequence[object]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, torch.Tensor):
            if item.is_cuda:
                found.append(item)
        elif isinstance(item, (tuple, list)):
            found.extend(_tensors(item))
    return found
