"""The stream ordering of Buffer calls (moe_ep/ops/streams.py), with stand-in CUDA streams and events:
which records and waits a sequence of calls makes. The real streams run in tests/gpu/test_cuda_backend.py
(calls hopping between streams behind GPU sleeps)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from moe_ep.ops import streams
from moe_ep.ops.event import EventOverlap

LOG: list[tuple[str, str]] = []  # (what, on which stream)


class FakeStream:
    count = 0

    def __init__(self, device: Optional[int] = None, stream_id: Optional[int] = None,
                 device_index: Optional[int] = None, device_type: Optional[int] = None) -> None:
        if stream_id is None:
            FakeStream.count += 1
            stream_id = 100 + FakeStream.count
        self.stream_id, self.device_index, self.device_type = stream_id, 0, 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.stream_id == self.stream_id

    def wait_event(self, event: "FakeEvent") -> None:
        LOG.append(("wait", f"{self.stream_id}<-{event.recorded_on}"))


class FakeEvent:
    def __init__(self) -> None:
        self.recorded_on: Optional[int] = None

    def record(self, stream: FakeStream) -> None:
        self.recorded_on = stream.stream_id
        LOG.append(("record", str(stream.stream_id)))


class FakeCudaTensor:
    """What `open_scope` reads of the call's tensor."""

    is_cuda = True
    device = torch.device("cuda", 0)


class World:
    """The current stream and whether it is being captured."""

    def __init__(self) -> None:
        self.current = FakeStream(stream_id=1)
        self.capturing = False


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    w = World()
    LOG.clear()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: w.current)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: w.capturing)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: (w.current.stream_id, 0, 1), raising=False)
    return w


def _call(order_of: streams.CommStreams, previous: Optional[EventOverlap] = None, async_finish: bool = False
          ) -> EventOverlap:
    scope = streams.open_scope(order_of, FakeCudaTensor(), previous, async_finish, False)
    scope.call(lambda: None)
    return scope.finish([], [])


def test_synchronous_calls_on_one_stream_record_nothing(world: World) -> None:
    buffer_streams = streams.CommStreams()
    for _ in range(3):
        assert _call(buffer_streams).event is None
    assert LOG == []


def test_a_change_of_stream_waits_for_the_previous_stream(world: World) -> None:
    buffer_streams = streams.CommStreams()
    _call(buffer_streams)
    world.current = FakeStream(stream_id=2)
    _call(buffer_streams)
    assert LOG == [("record", "1"), ("wait", "2<-1")]
    LOG.clear()
    _call(buffer_streams)  # same stream again: nothing
    assert LOG == []


def test_asynchronous_call_then_synchronous_call(world: World) -> None:
    buffer_streams = streams.CommStreams()
    comm = buffer_streams.get(torch.device("cuda", 0)).stream_id
    event = _call(buffer_streams, async_finish=True)
    assert event.event is not None
    # The comm stream waited for the current stream (the entry event); no second hand-off for it.
    assert LOG[:2] == [("record", "1"), ("wait", f"{comm}<-1")]
    assert ("record", str(comm)) in LOG  # the call's own event
    LOG.clear()
    _call(buffer_streams)  # synchronous, on the current stream: it must wait for the comm stream's call
    assert LOG == [("record", str(comm)), ("wait", f"1<-{comm}")]


def test_synchronous_call_after_previous_event_leaves_the_current_stream_caught_up(world: World) -> None:
    buffer_streams = streams.CommStreams()
    comm = buffer_streams.get(torch.device("cuda", 0)).stream_id
    previous = FakeEvent()
    previous.record(world.current)
    LOG.clear()
    result = _call(buffer_streams, previous=EventOverlap(previous))
    assert result.event is None  # synchronous: the current stream already waited
    assert LOG == [("wait", f"{comm}<-1"), ("record", str(comm)), ("wait", f"1<-{comm}")]
    LOG.clear()
    _call(buffer_streams)  # the current stream waited for the call already: no hand-off
    assert LOG == []


def test_no_hand_off_into_a_graph_capture(world: World) -> None:
    buffer_streams = streams.CommStreams()
    _call(buffer_streams)
    world.current, world.capturing = FakeStream(stream_id=3), True
    _call(buffer_streams)
    assert LOG == []
    world.capturing = False
    world.current = FakeStream(stream_id=1)
    _call(buffer_streams)  # back after the capture: waits for the capture stream's queued work
    assert LOG == [("record", "3"), ("wait", "1<-3")]


def test_allocate_on_comm_stream_needs_previous_event_and_async_finish(world: World) -> None:
    with pytest.raises(ValueError, match="allocate_on_comm_stream"):
        streams.open_scope(streams.CommStreams(), FakeCudaTensor(), None, True, True)
