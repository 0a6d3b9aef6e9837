"""A worker's events on its engine session stream (``SessionAnswers.events``): the same events a
WatchEvents stream carries, on the one stream the worker's calls ride, several per message when
several are ready, an answer before the events its call caused; a stream that breaks ends the
watch with the reason and a new registration watches again, with no event lost silently or
duplicated; a sidecar without the feature (the commit before it, or one from before the session
stream) gets the WatchEvents RPC. The client's tests run on both transports (``session_transport``).
Real sidecar daemons, real gRPC, real sockets, real NIXL."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from engine_shim.client import EventWatcher, SidecarClient, engine_channel, grouped, remote
from engine_shim.events import SESSION, STREAM
from engine_shim.memory import KvLayout, SharedBuffer, kv_registration
from kvsidecar.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from sidecar.tools.proto_compat import PINNED_COMMIT, CompatError
from tests.support.processes import SidecarProcess, stopped, wait_until
from tests.support.skew import OldCheckout

LAYOUT = KvLayout(num_layers=2, num_blocks=16, block_len=4096)
PRODUCER, CONSUMER = common_pb2.ENGINE_ROLE_PRODUCER, common_pb2.ENGINE_ROLE_CONSUMER
# The commit before events rode the session stream (it has the stream, not the feature).
BEFORE_SESSION_EVENTS = "bd2c94d"


class Engine:
    """One in-process engine of one worker: its client (calls and events on one session), its KV
    buffer, its watcher; ``on_event`` sees each event on the session's reader thread."""

    def __init__(
        self, side: SidecarProcess, engine_id: str, role: int, on_event: Any = None, watch: bool = True
    ) -> None:
        self.engine_id = engine_id
        self.client = SidecarClient(side.socket, timeout=10)
        self.buffer = SharedBuffer(LAYOUT.total_bytes)
        self.buffer.array[:] = np.random.default_rng(7).integers(1, 255, LAYOUT.total_bytes, dtype=np.uint8)
        self.client.register_worker(kv_registration(engine_id, role, LAYOUT, [self.buffer.export()]))
        self.closed: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.watcher = self.watch(on_event) if watch else None

    def watch(self, on_event: Any = None) -> EventWatcher:
        watcher = EventWatcher(self.client, self.engine_id, on_event=on_event, on_closed=self.closed.put)
        watcher.wait_connected(10)
        return watcher

    def block(self, layer: int, block: int) -> np.ndarray:
        return self.buffer.array[LAYOUT.block_slice(layer, block)]

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
        self.client.close()
        self.buffer.close()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def test_a_workers_events_ride_its_session_stream(sidecars, engines, session_transport: str) -> None:
    p_side, d_side = sidecars("p"), sidecars("d")
    order: list[tuple[str, bool]] = []  # (request, was its ExpectPush answered when its event came)
    lock = threading.Lock()
    expects: dict[str, Any] = {}

    def d_event(event: engine_pb2.Event) -> None:  # the session's reader thread
        with lock:
            order.append((event.request_id, expects[event.request_id].done()))

    producer = Engine(p_side, "P", PRODUCER)
    consumer = Engine(d_side, "D", CONSUMER, on_event=d_event)
    engines += [producer, consumer]
    # One stream per worker: its events ride the session its calls ride.
    assert producer.watcher.transport == consumer.watcher.transport == SESSION
    assert producer.client.session.transport == consumer.client.session.transport == session_transport
    assert producer.watcher.sidecar_id == p_side.sidecar_id and consumer.watcher.sidecar_id == d_side.sidecar_id
    assert [w.watching for w in consumer.client.status().engines[0].workers] == [True]

    # Push, P first: D's FINISHED_RECEIVING may be emitted before P's answer to D's PushReg
    # reaches D, i.e. while D's ExpectPush is still in flight on the stream: it comes after.
    cases = {f"r{i}": ([[1 + i]], [[8 + i]]) for i in range(4)}
    for request, (p_blocks, d_blocks) in cases.items():
        producer.client.submit_blocks("P", request, p_blocks, lease_seconds=30, mode=common_pb2.TRANSFER_MODE_PUSH)
        with lock:
            expects[request] = consumer.client.expect_push_async(
                "D", request, d_blocks, remote(p_side.address, "P", request), timeout_seconds=20
            )
    sent = producer.watcher.wait_for(cases, 30)
    assert {event.kind for event in sent.values()} == {engine_pb2.FINISHED_SENDING} and sent.keys() == cases.keys()
    wait_until(lambda: len(order) == len(cases), 30, what="D's events")
    assert sorted(order) == sorted((request, True) for request in cases)
    for p_blocks, d_blocks in cases.values():
        for layer in range(LAYOUT.num_layers):
            assert np.array_equal(consumer.block(layer, d_blocks[0][0]), producer.block(layer, p_blocks[0][0]))


def test_an_event_waits_for_the_answer_of_its_requests_call_in_flight(
    sidecars, engines, session_transport: str
) -> None:
    p_side, d_side = sidecars("p"), sidecars("d", args=["--set", "peer_call_timeout_seconds=1.5"])
    arrived: list[tuple[str, bool]] = []
    lock = threading.Lock()
    expects: dict[str, Any] = {}

    def d_event(event: engine_pb2.Event) -> None:  # the session's reader thread
        with lock:
            arrived.append((engine_pb2.EventKind.Name(event.kind), expects["x"].done()))

    consumer = Engine(d_side, "D", CONSUMER, on_event=d_event)
    engines.append(consumer)
    assert consumer.client.session.transport == session_transport
    with stopped(p_side):  # D's ExpectPush waits for P's handshake (up to its 1.5 s bound)
        with lock:
            # (No blocks: a full prefix hit, whose Release fails it at once, fences aside.)
            expects["x"] = consumer.client.expect_push_async("D", "x", [[]], remote(p_side.address, "P", "x"))
        # The request ends (LOAD_FAILED) while its ExpectPush is still in flight on the stream.
        assert consumer.client.release("D", "x").found
        wait_until(lambda: arrived, 10, what="the LOAD_FAILED")
        assert expects["x"].done()
    assert arrived == [("LOAD_FAILED", True)]


def _raw_session(side: SidecarProcess) -> tuple[Any, queue.SimpleQueue[Any], grpc.Channel]:
    """A Session stream whose messages the test sends one by one."""
    outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def requests() -> Iterator[engine_pb2.SessionCalls]:
        while (message := outbox.get()) is not None:
            yield message

    channel = engine_channel(side.socket)
    return engine_pb2_grpc.EngineServiceStub(channel).Session(requests()), outbox, channel


def _calls(method: str, requests: dict[int, Any]) -> engine_pb2.SessionCalls:
    return engine_pb2.SessionCalls(
        calls=[
            engine_pb2.SessionCall(call_id=i, method=method, request=r.SerializeToString(), timeout_seconds=10)
            for i, r in requests.items()
        ]
    )


def test_events_ready_together_go_in_one_message_after_their_answers(sidecars, engines) -> None:
    p_side, d_side = sidecars("p"), sidecars("d")
    consumer = Engine(d_side, "D", CONSUMER, watch=False)  # watched by the raw stream below
    engines.append(consumer)
    stream, outbox, channel = _raw_session(d_side)
    with channel, stopped(p_side):  # P answers no handshake: D's pulls wait
        next(stream)  # open
        outbox.put(_calls("WatchEvents", {1: engine_pb2.WatchEventsRequest(engine_id="D")}))
        started = next(stream)
        assert [e.kind for group in started.events for e in group.events] == [engine_pb2.WATCH_STARTED]
        pulls = {
            10 + i: engine_pb2.PullRequest(
                engine_id="D", request_id=f"q{i}", local_block_ids=grouped([[i]]),
                remote=remote(p_side.address, "P", f"q{i}", [[i]]),
            )
            for i in range(8)
        }  # fmt: skip
        outbox.put(_calls("Pull", pulls))
        answered: set[int] = set()
        while len(answered) < len(pulls):
            answered |= {answer.call_id for answer in next(stream).answers if answer.code == 0}
        # Eight Releases in one message: each ends its pull (LOAD_FAILED) as it runs.
        releases = {20 + i: engine_pb2.ReleaseRequest(engine_id="D", request_id=f"q{i}") for i in range(8)}
        outbox.put(_calls("Release", releases))
        message = next(stream)
        assert {answer.call_id for answer in message.answers} == set(releases)
        assert [group.call_id for group in message.events] == [1]
        events = message.events[0].events
        assert [e.kind for e in events] == [engine_pb2.LOAD_FAILED] * 8
        assert sorted(e.request_id for e in events) == [f"q{i}" for i in range(8)]
        outbox.put(None)
        ends = [answer for reply in stream for answer in reply.answers]
    # Half-closed: the watch ends (CANCELLED), and so does the stream.
    assert [(a.call_id, a.code) for a in ends] == [(1, grpc.StatusCode.CANCELLED.value[0])]


def test_a_broken_stream_ends_the_watch_and_a_new_registration_watches_again(
    sidecars, engines, session_transport: str
) -> None:
    p_side, d_side = sidecars("p"), sidecars("d")
    seen: list[str] = []
    consumer = Engine(d_side, "D", CONSUMER, on_event=lambda event: seen.append(event.request_id))
    engines.append(consumer)
    producer = Engine(p_side, "P", PRODUCER)
    engines.append(producer)
    client = consumer.client
    assert client.session.transport == session_transport
    with stopped(p_side):  # D's pulls wait for P's handshake
        for i in range(4):
            assert client.pull("D", f"old{i}", [[i]], remote(p_side.address, "P", f"old{i}", [[i]])).accepted
        # Calls in flight whose events (LOAD_FAILED) the sidecar never gets to send: it breaks first.
        os.kill(d_side.process.pid, signal.SIGSTOP)
        try:
            in_flight = [client.release_async("D", f"old{i}") for i in range(4)]
            d_side.kill()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(d_side.process.pid, signal.SIGCONT)
    for call in in_flight:
        with pytest.raises(grpc.RpcError) as broken:
            call.result(10)
        assert broken.value.code() == grpc.StatusCode.UNAVAILABLE, broken.value.details()
    reason = consumer.closed.get(timeout=10)  # the watch ends with the stream, once
    assert "engine session stream broke" in reason and consumer.watcher.closed.is_set()
    assert consumer.closed.empty() and seen == []

    d_side.start()  # re-register and watch again, on the reopened stream
    wait_until(lambda: _registered(consumer), 20, what="D to register again")
    consumer.watcher = consumer.watch(on_event=lambda event: seen.append(event.request_id))
    assert consumer.watcher.transport == SESSION and consumer.watcher.sidecar_id == d_side.sidecar_id
    assert client.session.transport == session_transport
    producer.client.submit_blocks("P", "new", [[3]], lease_seconds=30)
    assert client.pull("D", "new", [[5]], remote(p_side.address, "P", "new", [[3]])).accepted
    wait_until(lambda: seen, 20, what="the new pull's event")
    assert producer.watcher.wait_for(["new"], 20)
    assert seen == ["new"]  # none of the old registration's requests, and once


def _registered(engine: Engine) -> bool:
    try:
        engine.client.register_worker(kv_registration("D", CONSUMER, LAYOUT, [engine.buffer.export()]))
    except grpc.RpcError:
        return False
    return True


@pytest.fixture(scope="module", params=[BEFORE_SESSION_EVENTS, PINNED_COMMIT])
def older(request: pytest.FixtureRequest) -> Iterator[OldCheckout]:
    root = Path(tempfile.mkdtemp(prefix="kvs-older-", dir="/tmp"))
    try:
        try:
            yield OldCheckout.create(request.param, root)
        except CompatError as exc:  # a clone without the commit: say so, never skip quietly
            pytest.fail(str(exc))
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skew
def test_a_sidecar_without_the_feature_gets_the_watch_events_rpc(older: OldCheckout, workdir: Path, engines) -> None:
    side = SidecarProcess(workdir, f"old-{older.commit}", wrapper=[str(older.python)])
    try:
        side.start(timeout=60.0)
        producer, consumer = Engine(side, "P", PRODUCER), Engine(side, "D", CONSUMER)
        engines += [producer, consumer]
        assert "session_events" not in consumer.client.status().sidecar.versions.features
        assert producer.watcher.transport == consumer.watcher.transport == STREAM
        assert consumer.client.open_session(5) == (older.commit == BEFORE_SESSION_EVENTS)
        producer.client.submit_blocks("P", "r", [[2, 3]], lease_seconds=30)
        assert consumer.client.pull("D", "r", [[6, 7]], remote(side.address, "P", "r", [[2, 3]])).accepted
        assert consumer.watcher.wait_for(["r"], 20)["r"].kind == engine_pb2.FINISHED_RECEIVING
        assert producer.watcher.wait_for(["r"], 20)["r"].kind == engine_pb2.FINISHED_SENDING
        for layer in range(LAYOUT.num_layers):
            assert np.array_equal(consumer.block(layer, 7), producer.block(layer, 3))
    finally:
        side.kill()
