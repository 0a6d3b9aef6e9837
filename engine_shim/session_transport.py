"""The two ways the engine session (``engine_shim.session``) reaches its sidecar; the session
picks one per stream it opens:

- ``SocketTransport``: the plain Unix socket next to the engine socket (``<socket>.session``,
  framing in ``kvsidecar.session_socket``), for a client on the engine socket whose sidecar has
  it. The calling thread writes its call's frame itself (``sendall`` under a lock); the session's
  reader thread blocks in ``recv``. No gRPC thread sits between the two processes' threads.
- ``GrpcTransport``: the ``EngineService.Session`` RPC (a loopback TCP engine, or a sidecar
  without the socket or refusing it): callers put calls on an outbox that gRPC's request thread
  sends, several per message when several are ready.

Both: ``open`` (on the session's reader thread) returns the iterator of the sidecar's messages
after its first one (the stream is open), bounded by ``timeout``; the iterator ends when the
sidecar ended the session cleanly and raises a ``grpc.RpcError`` with the status when it broke
or the sidecar ended it with one. ``send`` never raises (a failed send breaks the stream, which
fails the calls in flight with the reason). ``half_close`` ends the session after its calls in
flight are answered; ``cancel`` cuts it; ``end`` frees what is left once the stream is over.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import grpc

from kvsidecar.session_socket import HEADER, frame
from kvsidecar.v1 import engine_pb2

CODES = {code.value[0]: code for code in grpc.StatusCode}
# The largest frame the client accepts (as the gRPC channel's receive limit).
MAX_FRAME = 64 * 1024 * 1024
_RECV_BYTES = 256 * 1024


class SessionCallError(grpc.RpcError):
    """A call on the session stream failed: the status the unary call would have failed with, or
    the broken stream's."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class SessionEnded(SessionCallError):
    """The sidecar ended the session on the socket with this status (its end frame)."""


class Transport(Protocol):
    name: str

    def open(self, timeout: float) -> Iterator[engine_pb2.SessionAnswers]: ...

    def send(self, call: engine_pb2.SessionCall) -> None: ...

    def half_close(self) -> None: ...

    def cancel(self) -> None: ...

    def end(self) -> None: ...


class GrpcTransport:
    """The Session RPC (see the module doc)."""

    name = "grpc"

    def __init__(self, open_stream: Callable[[Iterator[engine_pb2.SessionCalls]], Any]) -> None:
        self._open_stream = open_stream
        self.outbox: queue.SimpleQueue[engine_pb2.SessionCall | None] = queue.SimpleQueue()
        self.call: Any = None

    def open(self, timeout: float) -> Iterator[engine_pb2.SessionAnswers]:
        self.call = self._open_stream(self.requests())
        # The sidecar's first message says the stream is open; bounded like a call.
        timer = threading.Timer(timeout, self.call.cancel)
        timer.daemon = True
        timer.start()
        try:
            next(self.call)
        finally:
            timer.cancel()
        return iter(self.call)

    def send(self, call: engine_pb2.SessionCall) -> None:
        self.outbox.put(call)

    def half_close(self) -> None:
        self.outbox.put(None)

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()

    def end(self) -> None:
        self.outbox.put(None)  # ends gRPC's request thread

    def requests(self) -> Iterator[engine_pb2.SessionCalls]:
        """What gRPC sends: every call ready at once in one message; None half-closes."""
        while True:
            first = self.outbox.get()
            if first is None:
                return
            calls = [first]
            while True:
                try:
                    item = self.outbox.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    yield engine_pb2.SessionCalls(calls=calls)
                    return
                calls.append(item)
            yield engine_pb2.SessionCalls(calls=calls)


class SocketTransport:
    """The plain Unix socket (see the module doc). ``open`` raises ``OSError`` when nothing
    answers there (no socket, nobody listening), and a ``SessionCallError`` when the sidecar
    refused the session before opening it (its end frame's status)."""

    name = "socket"

    def __init__(self, path: Path, send_timeout: float) -> None:
        self._path = path
        self._send_timeout = send_timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # one frame at a time; the socket's life
        self._closing = False
        self._buffer = bytearray()
        self._chunk = memoryview(bytearray(_RECV_BYTES))  # recv_into: no allocation per read

    def open(self, timeout: float) -> Iterator[engine_pb2.SessionAnswers]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with self._lock:
            self._sock = sock
        sock.settimeout(timeout)  # connecting and the first frame
        sock.connect(os.fspath(self._path))
        first = self._read(sock)
        if first.HasField("end"):
            raise _ended(first.end)
        sock.settimeout(None)
        # A sidecar that stops reading (wedged) blocks a sender only this long; then the stream
        # breaks (its calls fail with the reason) rather than blocking the engine's thread.
        seconds = int(self._send_timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", seconds, int((self._send_timeout - seconds) * 1e6)))  # fmt: skip
        with self._lock:
            if self._closing:
                sock.shutdown(socket.SHUT_WR)
        return self._answers(sock)

    def _answers(self, sock: socket.socket) -> Iterator[engine_pb2.SessionAnswers]:
        while True:
            message = self._read(sock)
            if message.HasField("end"):
                if message.end.code == 0:
                    return
                raise _ended(message.end)
            yield message

    def _read(self, sock: socket.socket) -> engine_pb2.SessionAnswers:
        buffer = self._buffer
        while True:
            if len(buffer) >= HEADER.size:
                (size,) = HEADER.unpack_from(buffer)
                if size > MAX_FRAME:
                    raise SessionCallError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, f"a frame of {size} bytes, over {MAX_FRAME}"
                    )
                if len(buffer) >= HEADER.size + size:
                    message = engine_pb2.SessionAnswers.FromString(bytes(buffer[HEADER.size : HEADER.size + size]))
                    del buffer[: HEADER.size + size]
                    return message
            try:
                got = sock.recv_into(self._chunk)
            except TimeoutError:
                raise SessionCallError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "the sidecar did not answer in time"
                ) from None
            except OSError as exc:
                raise SessionCallError(grpc.StatusCode.UNAVAILABLE, f"the session socket failed: {exc}") from None
            if not got:
                raise SessionCallError(grpc.StatusCode.UNAVAILABLE, "the sidecar closed the session socket")
            buffer += self._chunk[:got]

    def send(self, call: engine_pb2.SessionCall) -> None:
        data = frame(engine_pb2.SessionCalls(calls=[call]))
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.sendall(data)
            except OSError:  # a frame may be cut: the stream is over (the reader fails its calls)
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)

    def half_close(self) -> None:
        with self._lock:
            self._closing = True
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_WR)

    def cancel(self) -> None:
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's recv

    def end(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def _ended(end: engine_pb2.SessionEnd) -> SessionEnded:
    return SessionEnded(CODES.get(end.code, grpc.StatusCode.UNKNOWN), end.message)
