"""The engine session on a plain Unix socket, ``<engine_socket>.session`` (the framing is
``kvsidecar.session_socket``'s): the same session the ``EngineService.Session`` RPC carries, served
by the same ``api.session.SessionDispatcher``, without gRPC's threads between the socket and the
event loop (a gRPC message wakes gRPC's event engine thread, grpc.aio's poller, then the loop).

Per connection: the caller's ``SO_PEERCRED`` is checked as the credential socket checks it
(``CallerPolicy``: a refused caller gets an end frame PERMISSION_DENIED and an
``engine_peer_refused`` log line), then set as ``CALLER``, as ``TokenInterceptor`` sets it for a
gRPC call, so each call's engine-ownership check (``EngineServicer._may_act``) works as on gRPC.
Then frames until the session ends; its last frame says how (``SessionAnswers.end``): OK after
the client half-closed, UNAVAILABLE when the sidecar drains, INVALID_ARGUMENT (and a
``session_refused`` log line) for an undecodable frame or one over ``max_message_bytes``. The
client closing the connection without half-closing (it died) is seen at once by a probe (an empty
frame, which fails): its calls in flight are cancelled and its watches detached, as for a gRPC
Session whose client went.

Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc

from kvsidecar.session_socket import HEADER, frame, session_socket_for
from kvsidecar.v1 import engine_pb2
from sidecar.api.engine_auth import CALLER, Caller, CallerPolicy, peer_caller, serve_unix
from sidecar.api.session import SessionDispatcher
from sidecar.config import Settings
from sidecar.logs import get_logger

log = get_logger("kvsidecar.server")

# Writing a session's last frame to a client that does not read is given up after this.
_END_WRITE_S = 5.0


class _Ended(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _SocketContext:
    """The session's context for ``SessionDispatcher.serve``: ``abort`` ends the session."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn:
        raise _Ended(code, details)

    def peer(self) -> str:
        return f"unix-session:pid={self.caller.pid},uid={self.caller.uid}"

    def invocation_metadata(self) -> tuple[()]:
        return ()


class _BadFrame:
    """Stands in for a frame that is no valid ``SessionCalls``: the dispatcher ends the session."""

    def __init__(self, error: str = "", reason: str = "") -> None:
        self.error = error  # decoding's error (the message says: not a valid protobuf message)
        self.reason = reason  # the whole message, for what is not a decoding error


class SessionSocket:
    """The plain Unix socket's server (see the module doc)."""

    def __init__(self, settings: Settings, dispatcher: SessionDispatcher) -> None:
        self.path = session_socket_for(settings.engine_socket)
        self._mode = settings.engine_socket_mode
        self._max_frame = settings.max_message_bytes
        self._policy = CallerPolicy(settings)
        self._dispatcher = dispatcher
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self._server = await serve_unix(self.path, self._serve, self._mode)

    async def stop(self, grace: float) -> None:
        """Stop accepting, give open sessions up to ``grace`` to end (they end when the node
        drains and stops), then cut them; remove the socket file."""
        if self._server is None:
            return
        self._server.close()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=grace)
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=1.0)
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = asyncio.current_task()
        assert connection is not None
        self._connections.add(connection)
        try:
            caller = peer_caller(writer.get_extra_info("socket"))
            why = self._policy.refusal(caller, socket="session")
            if why:
                code, message = grpc.StatusCode.PERMISSION_DENIED, why
            else:
                CALLER.set(caller)  # this connection's task and the call tasks it starts
                code, message = await self._session(reader, writer, caller, connection)
            end = engine_pb2.SessionEnd(code=code.value[0], message=message)
            writer.write(frame(engine_pb2.SessionAnswers(end=end)))
            async with asyncio.timeout(_END_WRITE_S):
                await writer.drain()
        except (OSError, TimeoutError) as exc:  # the client went
            log.info("session_socket_closed", error=str(exc) or type(exc).__name__)
        except asyncio.CancelledError:  # the client went (``_frames``), or the sidecar stops
            # Ends normally: asyncio's server reads this task's exception and logs a cancelled one.
            connection.uncancel()
            log.info("session_socket_closed", error="cut: the client went or the sidecar stops")
        finally:
            self._connections.discard(connection)
            writer.close()

    async def _session(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, caller: Caller, connection: asyncio.Task[Any]
    ) -> tuple[grpc.StatusCode, str]:
        calls = self._frames(reader, writer, connection)
        try:
            async with contextlib.aclosing(self._dispatcher.serve(calls, _SocketContext(caller))) as answers:
                async for message in answers:
                    writer.write(frame(message))
                    await writer.drain()
        except _Ended as ended:
            return ended.code, ended.message
        except OSError:
            raise  # the client went: nobody to tell
        except Exception as exc:  # a bug: the client is told, the daemon serves on
            log.exception("session_failed", error=repr(exc))
            return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
        if self._dispatcher.draining:
            return grpc.StatusCode.UNAVAILABLE, "the sidecar is draining for shutdown"
        return grpc.StatusCode.OK, ""

    async def _frames(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: asyncio.Task[Any]
    ) -> AsyncIterator[Any]:
        """The client's messages; ends when it half-closes. A client gone (the connection closed
        or cut) cancels the connection's task."""
        while True:
            try:
                (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            except asyncio.IncompleteReadError as exc:
                # Half-closed, or gone: a gone client's socket refuses the probe at once.
                writer.write(HEADER.pack(0))
                if exc.partial or writer.transport.is_closing():
                    connection.cancel()
                return
            except ConnectionError:
                connection.cancel()
                return
            if size > self._max_frame:
                yield _BadFrame(reason=f"SessionCalls: a frame of {size} bytes, over max_message_bytes "
                                       f"({self._max_frame})")  # fmt: skip
                return
            try:
                data = await reader.readexactly(size)
            except (asyncio.IncompleteReadError, ConnectionError):
                connection.cancel()
                return
            try:
                calls = engine_pb2.SessionCalls.FromString(data)
            except Exception as exc:  # protobuf's DecodeError, or worse: the session ends with it
                yield _BadFrame(error=str(exc))
                return
            yield calls
