"""A session stream's watch is bounded as a WatchEvents stream is: events wait in the worker's
queue (``max_queued_events``) until the stream's sender takes them for a message, so a client that
stops reading (the sender blocked in gRPC's flow control) gets RESOURCE_EXHAUSTED and the worker is
dropped, instead of the sidecar buffering without bound. In-process node (``test_node_parts``'s
harness: FakeFabric for NIXL), the session's own stream state."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from kvsidecar.v1 import engine_pb2
from sidecar.api.session import _Stream
from tests.node.test_node_parts import D, harness, run


def test_a_watch_whose_client_stops_reading_is_cut_off_at_the_bound(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with harness(tmp_path, max_queued_events=16) as h:
            events = h.node.context.events
            stream = _Stream(context=None)  # type: ignore[arg-type]
            stream.watch(7, D, events.subscribe(engine_pb2.WatchEventsRequest(engine_id=D)))
            worker = h.node.registry.worker(D, 0, 0)
            assert worker is not None and worker.watchers == 1 and stream.wake.is_set()
            for index in range(40):  # the sender takes nothing meanwhile
                events.emit(D, engine_pb2.Event(kind=engine_pb2.FINISHED_RECEIVING, request_id=f"r{index}"))
            assert worker.events.qsize() == 17  # the bound, then the end: nothing more is kept
            message = stream.take()
            assert message is not None
            [group] = message.events
            assert group.call_id == 7 and group.events[0].kind == engine_pb2.WATCH_STARTED
            assert [e.request_id for e in group.events[1:]] == [f"r{index}" for index in range(16)]
            [end] = message.answers
            assert (end.call_id, end.code) == (7, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
            assert "more than 16 events were not consumed" in end.message
            assert not stream.watches and worker.watchers == 0
            for _ in range(100):  # detached: the node drops the worker (its engine is gone)
                if h.node.registry.worker(D, 0, 0) is None:
                    break
                await asyncio.sleep(0.02)
            assert h.node.registry.worker(D, 0, 0) is None

    run(scenario)
