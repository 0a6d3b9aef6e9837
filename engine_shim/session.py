"""The engine session stream, client side: one long-lived session per ``SidecarClient`` that
carries its unary calls and their answers (the sidecar runs each through the handler of its unary
RPC). It rides one of two transports (``engine_shim.session_transport``), picked each time a
stream opens: the plain Unix socket next to the engine socket (``<socket>.session``) when the
client talks to the engine socket and the socket is there, else the ``EngineService.Session`` RPC
(a loopback TCP client; a sidecar without the socket, or one that refused it: that is asked again
only after ``_UNSUPPORTED_RECHECK_S``). Everything below holds on both.

- ``EngineSession.start`` returns a Future of a call's response over the open stream, or None when
  no stream is open: the caller then makes the unary call, which is always correct. The first
  call opens the stream (in the background); a sidecar without the RPC (UNIMPLEMENTED, an older
  one) is asked again only after ``_UNSUPPORTED_RECHECK_S``.
- A call's answer completes its Future with the response or with a ``SessionCallError``, a
  ``grpc.RpcError`` carrying the same code and details the unary call would have raised. A call
  not answered by its deadline fails DEADLINE_EXCEEDED (the sweeper thread), as a unary one does.
- ``EngineSession.watch`` subscribes the open stream to one worker's events (a WatchEvents call on
  it): the sidecar sends them batched in ``SessionAnswers.events``, and the reader hands each
  message's events for that watch to ``on_events`` in one call. ``on_end`` gets the status the
  watch ended with: the sidecar's answer (UNIMPLEMENTED from a sidecar without the feature: use the
  WatchEvents RPC), or the broken stream's. A message's answers are applied before its events,
  and the answers that end watches after them.
- A stream that breaks fails its calls in flight with the reason (its status), ends its watches
  with it, and is reopened at the next call after a backoff (``_MIN_BACKOFF_S`` doubling to
  ``_MAX_BACKOFF_S``); calls go unary meanwhile. A refusal for a stale session token (the sidecar
  restarted) renews the token first.

Threads: callers (any thread) send their calls: on the socket each writes its frame itself; on
gRPC they put them on an outbox that gRPC's request thread sends in batches. The stream's reader
thread ``kvsidecar-session`` opens the stream, completes Futures with its answers and runs the
watches' callbacks with their events; the sweeper thread ``kvsidecar-session-deadlines`` fails
calls past their deadline. One lock guards the stream state and the calls in flight.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from engine_shim.session_transport import CODES as _CODES
from engine_shim.session_transport import GrpcTransport, SessionEnded, SocketTransport, Transport
from engine_shim.session_transport import SessionCallError as SessionCallError
from kvsidecar.engine_auth import NO_TOKEN
from kvsidecar.v1 import engine_pb2

log = logging.getLogger("kvsidecar.engine_shim")

_MIN_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0
_UNSUPPORTED_RECHECK_S = 60.0


class _Pending:
    __slots__ = ("future", "response_type")

    def __init__(self, future: concurrent.futures.Future[Any], response_type: type[Message]) -> None:
        self.future = future
        self.response_type = response_type


EventsCallback = Callable[[Sequence[engine_pb2.Event]], None]
EndCallback = Callable[[grpc.StatusCode, str], None]


class _Watch:
    __slots__ = ("on_end", "on_events")

    def __init__(self, on_events: EventsCallback, on_end: EndCallback) -> None:
        self.on_events = on_events
        self.on_end = on_end


class WatchHandle:
    """A watch on the session stream (``EngineSession.cancel_watch`` ends it)."""

    __slots__ = ("call_id", "stream")

    def __init__(self, stream: _Stream, call_id: int) -> None:
        self.stream = stream
        self.call_id = call_id


class _Stream:
    """One session: its transport, the calls waiting for their answers, its watches."""

    def __init__(self) -> None:
        self.pending: dict[int, _Pending] = {}
        self.watches: dict[int, _Watch] = {}
        self.transport: Transport | None = None  # set by the reader thread as it opens
        self.half_closed = False
        self.opened = False
        self.settled = threading.Event()  # it opened, or it ended
        self._lock = threading.Lock()

    def use(self, transport: Transport) -> None:
        with self._lock:
            self.transport = transport
            if self.half_closed:
                transport.half_close()

    def send(self, call: engine_pb2.SessionCall) -> None:
        transport = self.transport
        if transport is not None:
            transport.send(call)

    def half_close(self) -> None:
        with self._lock:
            self.half_closed = True
            if self.transport is not None:
                self.transport.half_close()

    def cancel(self) -> None:
        with self._lock:
            if self.transport is not None:
                self.transport.cancel()


class EngineSession:
    """The session stream of one client (see the module doc). Thread-safe."""

    def __init__(
        self,
        open_stream: Callable[[Iterator[engine_pb2.SessionCalls]], Any],
        renew_token: Callable[[], None],
        open_timeout: float,
        socket_path: Path | None = None,
    ) -> None:
        """``socket_path``: the sidecar's plain session socket, tried first when it exists."""
        self._open_stream = open_stream
        self._socket_path = socket_path
        self._socket_retry_at = 0.0  # the sidecar refused the socket: the gRPC stream until then
        self._renew_token = renew_token
        self._open_timeout = open_timeout
        self._lock = threading.Lock()
        self._deadline_changed = threading.Condition(self._lock)
        self._stream: _Stream | None = None  # the open stream
        self._opening: _Stream | None = None
        self._readers: list[threading.Thread] = []
        self._retry_at = 0.0
        self._backoff = _MIN_BACKOFF_S
        self._closed = False
        self._ids = itertools.count(1)
        self._deadlines: list[tuple[float, int, _Stream]] = []
        self._sweeper: threading.Thread | None = None
        self.opened = threading.Event()  # set while a stream is open
        self.transport = ""  # the open stream's transport: "socket", "grpc", or "" (none open)

    # --- calls ------------------------------------------------------------------------------------

    def start(
        self, method: str, request: Message, response_type: type[Message], timeout: float
    ) -> concurrent.futures.Future[Any] | None:
        """The call's Future over the open stream, or None (make the unary call) when none is open."""
        with self._lock:
            stream = self._stream
            if stream is None or self._closed:
                self._open_locked()
                return None
            call_id = next(self._ids)
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            future.set_running_or_notify_cancel()  # like a call already running: cancel() is refused
            stream.pending[call_id] = _Pending(future, response_type)
            deadline = time.monotonic() + timeout
            heapq.heappush(self._deadlines, (deadline, call_id, stream))
            if self._deadlines[0][1] == call_id:
                self._deadline_changed.notify()
        stream.send(
            engine_pb2.SessionCall(
                call_id=call_id, method=method, request=request.SerializeToString(), timeout_seconds=timeout
            )
        )
        return future

    def watch(
        self, request: engine_pb2.WatchEventsRequest, on_events: EventsCallback, on_end: EndCallback
    ) -> WatchHandle | None:
        """Subscribe the open stream to a worker's events (see the module doc); None when no stream
        is open. The callbacks run on the reader thread; ``on_end`` runs once, last."""
        with self._lock:
            stream = self._stream
            if stream is None or self._closed:
                return None
            call_id = next(self._ids)
            stream.watches[call_id] = _Watch(on_events, on_end)
        stream.send(engine_pb2.SessionCall(call_id=call_id, method="WatchEvents", request=request.SerializeToString()))
        return WatchHandle(stream, call_id)

    def cancel_watch(self, handle: WatchHandle) -> None:
        """End a watch (the sidecar detaches it, as from a cancelled WatchEvents stream); its
        ``on_end`` runs now with CANCELLED, unless it ended already."""
        with self._lock:
            watch = handle.stream.watches.pop(handle.call_id, None)
        if watch is None:
            return
        handle.stream.send(engine_pb2.SessionCall(call_id=handle.call_id, cancel=True))
        watch.on_end(grpc.StatusCode.CANCELLED, "cancelled by the client")

    def wait_open(self, timeout: float) -> bool:
        """Open the stream if none is, and wait (bounded) until it is open or the attempt failed
        (an older sidecar answers at once); False if it did not open."""
        with self._lock:
            if self._stream is None:
                self._retry_at = 0.0
                self._open_locked()
            if self._stream is not None:
                return True
            attempt = self._opening
        if attempt is not None:
            attempt.settled.wait(timeout)
        return self.opened.is_set()

    def close(self, timeout: float) -> None:
        """Half-close the stream (the sidecar answers the calls in flight, then ends it), wait for
        that up to ``timeout``, then cancel it; calls still in flight fail CANCELLED."""
        with self._lock:
            self._closed = True
            streams = [stream for stream in (self._stream, self._opening) if stream is not None]
            readers = list(self._readers)
            self._deadline_changed.notify_all()
        for stream in streams:
            stream.half_close()
        # A Future's done callback may close the client: never join the thread running it.
        readers = [reader for reader in readers if reader is not threading.current_thread()]
        deadline = time.monotonic() + timeout
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        for stream in streams:
            stream.cancel()
        for reader in readers:
            reader.join(1.0)
        if self._sweeper is not None and self._sweeper is not threading.current_thread():
            self._sweeper.join(1.0)

    # --- the stream's life -------------------------------------------------------------------------

    def _open_locked(self) -> None:
        if self._closed or self._opening is not None or time.monotonic() < self._retry_at:
            return
        stream = self._opening = _Stream()
        reader = threading.Thread(target=self._run, args=(stream,), name="kvsidecar-session", daemon=True)
        self._readers = [thread for thread in self._readers if thread.is_alive()] + [reader]
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep, name="kvsidecar-session-deadlines", daemon=True)
            self._sweeper.start()
        reader.start()

    def _run(self, stream: _Stream) -> None:
        """Open the stream, then complete calls with its answers until it ends."""
        code, details = grpc.StatusCode.UNAVAILABLE, "the sidecar ended the engine session stream"
        try:
            messages = self._connect(stream)
            with self._lock:
                self._opening = None
                if self._closed:
                    stream.half_close()
                else:
                    self._stream = stream
                    stream.opened = True
                    self._backoff = _MIN_BACKOFF_S
                    self.transport = stream.transport.name if stream.transport is not None else ""
                    self.opened.set()
            stream.settled.set()
            log.debug("engine session stream open (%s)", self.transport)
            for answers in messages:
                if answers.events or stream.watches:
                    self._delivered(stream, answers)
                else:
                    for answer in answers.answers:
                        self._answered(stream, answer)
        except StopIteration:
            details = "the sidecar ended the engine session stream before opening it"
        except SessionEnded as exc:  # the sidecar's end frame on the socket: its status
            code, details = exc.code(), f"the sidecar ended the engine session stream: {exc.details()}"
        except grpc.RpcError as exc:
            code, details = exc.code(), f"the engine session stream broke: {exc.details()}"
        except Exception as exc:  # a bug here must not leave calls waiting: they fail with it
            code, details = grpc.StatusCode.INTERNAL, f"the engine session stream failed: {exc!r}"
            log.exception("engine session stream failed")
        finally:
            self._ended(stream, code, details)

    def _connect(self, stream: _Stream) -> Iterator[engine_pb2.SessionAnswers]:
        """Open ``stream``: on the plain socket if the sidecar has it and did not refuse it, else
        on the Session RPC; the sidecar's messages after its first."""
        path = self._socket_path
        if path is not None and time.monotonic() >= self._socket_retry_at and path.exists():
            transport = SocketTransport(path, send_timeout=self._open_timeout)
            stream.use(transport)
            try:
                return transport.open(self._open_timeout)
            except SessionEnded as exc:  # the sidecar refused: not this client (or not now: draining)
                transport.end()
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    self._socket_retry_at = time.monotonic() + _UNSUPPORTED_RECHECK_S
                log.info("the sidecar refused the engine session socket (%s: %s): the gRPC stream",
                         exc.code().name, exc.details())  # fmt: skip
            except OSError as exc:  # nobody there (yet): the gRPC stream says why, if it fails too
                transport.end()
                log.debug("no engine session socket at %s (%s): the gRPC stream", path, exc)
        grpc_transport = GrpcTransport(self._open_stream)
        stream.use(grpc_transport)
        return grpc_transport.open(self._open_timeout)

    def _answered(self, stream: _Stream, answer: engine_pb2.SessionAnswer) -> None:
        with self._lock:
            pending = stream.pending.pop(answer.call_id, None)
        if pending is None:
            return  # past its deadline already
        if answer.code == 0:
            pending.future.set_result(pending.response_type.FromString(answer.response))
        else:
            pending.future.set_exception(
                SessionCallError(_CODES.get(answer.code, grpc.StatusCode.UNKNOWN), answer.message)
            )

    def _delivered(self, stream: _Stream, message: engine_pb2.SessionAnswers) -> None:
        """A message with events, or on a stream with watches: its answers, its events, then the
        answers that end watches (those come after their watch's last events)."""
        ends: list[engine_pb2.SessionAnswer] = []
        for answer in message.answers:
            if answer.call_id in stream.watches:
                ends.append(answer)
            else:
                self._answered(stream, answer)
        for group in message.events:
            watch = stream.watches.get(group.call_id)
            if watch is not None:
                watch.on_events(group.events)
        for answer in ends:
            with self._lock:
                ended = stream.watches.pop(answer.call_id, None)
            if ended is not None:
                ended.on_end(_CODES.get(answer.code, grpc.StatusCode.UNKNOWN), answer.message)

    def _ended(self, stream: _Stream, code: grpc.StatusCode, details: str) -> None:
        """The stream is over: fail its calls in flight with why, and decide when to reopen."""
        stale_token = code == grpc.StatusCode.PERMISSION_DENIED and NO_TOKEN in details
        with self._lock:
            if self._stream is stream:
                self._stream = None
                self.transport = ""
                self.opened.clear()
            if self._opening is stream:
                self._opening = None
            pending, stream.pending = stream.pending, {}
            watches, stream.watches = stream.watches, {}
            now = time.monotonic()
            if code == grpc.StatusCode.UNIMPLEMENTED and not stream.opened:
                self._retry_at = now + _UNSUPPORTED_RECHECK_S
            elif stale_token and not stream.opened:
                self._retry_at = now  # a new token, and at once (the backoff still bounds a loop)
                self._backoff = min(self._backoff * 2, _MAX_BACKOFF_S)
            else:
                self._retry_at = now + self._backoff
                self._backoff = min(self._backoff * 2, _MAX_BACKOFF_S)
            closed = self._closed
        stream.settled.set()
        if stream.transport is not None:
            stream.transport.end()  # ends gRPC's request thread, or closes the socket
        if code == grpc.StatusCode.UNIMPLEMENTED and not stream.opened:
            log.info("the sidecar has no engine session stream (an older one): unary calls")
        elif not closed:
            log.warning("engine session stream ended (%s: %s); %d calls in flight fail", code.name, details,
                        len(pending))  # fmt: skip
        if stale_token and not closed:
            self._renew_token()
        error = SessionCallError(grpc.StatusCode.CANCELLED, "the client closed") if closed else None
        for call in pending.values():
            call.future.set_exception(error or SessionCallError(code, details))
        for watch in watches.values():
            watch.on_end(*((error.code(), error.details()) if error else (code, details)))

    def _sweep(self) -> None:
        """Fail calls past their deadline (the sidecar bounds them too; this bounds a lost one)."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                expired: list[_Pending] = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, call_id, stream = heapq.heappop(self._deadlines)
                    pending = stream.pending.pop(call_id, None)
                    if pending is not None:
                        expired.append(pending)
                if expired:
                    self._lock.release()
                    try:
                        for pending in expired:
                            pending.future.set_exception(
                                SessionCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                            )
                    finally:
                        self._lock.acquire()
                    continue
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._deadline_changed.wait(wait)
