"""One worker's events, as the shim consumes them: ``EventWatcher``.

The events ride the client's engine session stream (``engine_shim.session``: a WatchEvents call on
it, events batched per message) when the sidecar has that feature ("session_events"), so a worker
holds one stream to its sidecar; otherwise (a sidecar without the session stream, or whose stream
answers the watch UNIMPLEMENTED) the watcher opens the WatchEvents RPC of before. Same events,
same order (WATCH_STARTED first), same end: the worker stays registered while the watch lasts, and
``closed`` is set and ``on_closed`` runs with the reason when it ends (the sidecar dropped the
worker or stopped, the stream broke, ``cancel``).

Threads: a short-lived starter thread opens the watch (bounded by the client's timeout) and, on the
fallback, stays to read the WatchEvents stream; over the session the session's reader thread runs
the callbacks. Events never block the owner: ``drain()`` returns what arrived, ``wait()`` waits
with a bound, or ``on_event`` gets each one (on the reader thread).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import grpc

from engine_shim.session import EngineSession, WatchHandle
from kvsidecar.v1 import engine_pb2

SESSION = "session"  # EventWatcher.transport: the events ride the engine session stream
STREAM = "watch_events"  # or the WatchEvents RPC


class Client(Protocol):
    """What a watcher uses of ``engine_shim.client.SidecarClient`` (which imports this module)."""

    timeout: float
    session: EngineSession
    stub: Any


class EventWatcher:
    """Drains one worker's events into a queue (see the module doc).

    ``connected`` turns true at WATCH_STARTED; ``transport`` then says which stream carries them.
    ``session=False`` uses the WatchEvents RPC whatever the sidecar has.
    """

    def __init__(
        self,
        client: Client,
        engine_id: str,
        tp_rank: int = 0,
        pp_rank: int = 0,
        on_closed: Callable[[str], None] | None = None,
        on_event: Callable[[engine_pb2.Event], None] | None = None,
        session: bool = True,
    ) -> None:
        self.engine_id = engine_id
        self.sidecar_id = ""
        self.transport = ""
        self.connected = threading.Event()
        self.closed = threading.Event()
        self.close_reason = ""
        self._client = client
        self._request = engine_pb2.WatchEventsRequest(engine_id=engine_id, tp_rank=tp_rank, pp_rank=pp_rank)
        self._events: queue.SimpleQueue[engine_pb2.Event] = queue.SimpleQueue()
        self._on_closed = on_closed
        self._on_event = on_event
        self._lock = threading.Lock()
        self._cancelled = False
        self._ended = False
        self._call: Any = None  # the WatchEvents call (the fallback)
        self._handle: WatchHandle | None = None  # the watch on the session stream
        self._answered = threading.Event()  # the session watch started, or ended first
        self._fallback = not session
        self._thread = threading.Thread(
            target=self._start, name=f"kvsidecar-events-{engine_id}-tp{tp_rank}", daemon=True
        )
        self._thread.start()

    # --- starting (the starter thread) ----------------------------------------------------------

    def _start(self) -> None:
        if not self._fallback and self._client.session.wait_open(self._client.timeout):
            with self._lock:
                if self._cancelled:
                    self._handle = None
                else:
                    self._handle = self._client.session.watch(self._request, self._arrived, self._session_ended)
                handle = self._handle
            if handle is not None:
                if not self._answered.wait(self._client.timeout):
                    self._client.session.cancel_watch(handle)  # ends it: on_closed says so
                    return
                if not self._fallback:
                    return  # the session's reader thread carries it from here
        self._stream()

    def _stream(self) -> None:
        """The WatchEvents RPC (a sidecar without events on its session stream)."""
        reason = "the stream ended"
        try:
            with self._lock:
                if self._cancelled:
                    raise _Cancelled
                self._call = self._client.stub.WatchEvents(self._request)
            for event in self._call:
                self._arrived((event,), STREAM)
        except grpc.RpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except _Cancelled:
            reason = "CANCELLED: cancelled by the client"
        self._end(reason)

    # --- events (the session's reader thread, or the starter thread) ----------------------------

    def _arrived(self, events: Sequence[engine_pb2.Event], transport: str = SESSION) -> None:
        for event in events:
            if event.kind == engine_pb2.WATCH_STARTED:
                self.sidecar_id = event.sidecar_id
                self.transport = transport
                self.connected.set()
                self._answered.set()
            elif self._on_event is not None:
                self._on_event(event)
            else:
                self._events.put(event)

    def _session_ended(self, code: grpc.StatusCode, details: str) -> None:
        if code == grpc.StatusCode.UNIMPLEMENTED and not self.connected.is_set():
            self._fallback = True  # a sidecar from before events on the session stream
            self._answered.set()
            return
        self._answered.set()
        self._end(f"{code.name}: {details}")

    def _end(self, reason: str) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self.close_reason = reason
        self.closed.set()
        if self._on_closed is not None:
            self._on_closed(reason)

    # --- the owner's side -------------------------------------------------------------------------

    def wait_connected(self, timeout: float) -> None:
        if not self.connected.wait(timeout):
            raise TimeoutError(f"WatchEvents did not start within {timeout}s ({self.close_reason or 'no answer'})")

    def drain(self) -> list[engine_pb2.Event]:
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def wait(self, timeout: float) -> engine_pb2.Event | None:
        """The next event, or None after ``timeout`` seconds."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def wait_for(
        self, request_ids: Iterable[str], timeout: float, kinds: Iterable[int] | None = None
    ) -> dict[str, engine_pb2.Event]:
        """Wait until a terminal event arrived for every request id (bounded). Other events are kept."""
        wanted = set(request_ids)
        allowed = set(kinds) if kinds is not None else None
        found: dict[str, engine_pb2.Event] = {}
        kept: list[engine_pb2.Event] = []
        deadline = time.monotonic() + timeout
        while wanted - found.keys():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            event = self.wait(remaining)
            if event is None:
                break
            if event.request_id in wanted and (allowed is None or event.kind in allowed):
                found[event.request_id] = event
            else:
                kept.append(event)
        for event in kept:
            self._events.put(event)
        return found

    def cancel(self) -> None:
        """End the watch (the sidecar detaches it) and wait, bounded, for its thread."""
        with self._lock:
            self._cancelled = True
            call, handle = self._call, self._handle
        if handle is not None:
            self._client.session.cancel_watch(handle)
        if call is not None:
            call.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


class _Cancelled(Exception):
    pass
