"""The peer stream: this sidecar's calls to one peer (heartbeats, PushReg, TransferFailed,
Release; the table rows marked ``stream``) and their answers on one open ``PeerService.Stream``,
several per message when several are ready. Each direction has its own: the caller opens it.

A call on the stream ends as its unary call would: the answer carries the response or the status
code and message the peer's handler ended with (the peer runs the unary RPC's own handler, with
the stream's certificate identity), and a call past its deadline fails DEADLINE_EXCEEDED. Errors
are raised as ``grpc.aio.AioRpcError`` so ``PeerClient.call`` maps them exactly as a unary call's.

A stream that breaks fails its calls in flight with its status and reason (a peer that died:
UNAVAILABLE, as a unary call in flight would see); the next call after a bounded backoff (0.05 s
doubling to 2 s) opens a new one, and calls meanwhile go unary. Calls go unary as well while the
channel is not connected (the unary call knows how to wait for a peer that restarts, or to fail
at once when nothing listens), and for a peer that answers the stream UNIMPLEMENTED (an older
sidecar; asked again after ``_UNIMPLEMENTED_RETRY_S``): calls already written to such a stream,
never run there, are sent again unary. A stream is tied to its channel: a new channel (redial,
rotated certificates) or a peer that restarted (``forget``) means a new stream.

Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import grpc
from google.protobuf.message import Message

from kvsidecar.v1 import engine_pb2, peer_pb2_grpc
from sidecar.logs import get_logger
from sidecar.peers.addresses import address_key

log = get_logger("kvsidecar.peers")

_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 2.0
_UNIMPLEMENTED_RETRY_S = 60.0


class NotSent(Exception):
    """The call was never run by the peer (an older peer without the stream, or a stream the peer
    ended cleanly before reading it): send it unary."""


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class PeerStream:
    """One open ``PeerService.Stream`` to one peer: calls by id, their answers, how it ended."""

    def __init__(self, address: str, stub: peer_pb2_grpc.PeerServiceStub, owner: PeerStreams) -> None:
        self.address = address
        self.stub = stub
        self._owner = owner
        # No deadline on the stream itself (each call carries its own); never waits for a
        # connection: it is opened only on a connected channel.
        self._call = stub.Stream(wait_for_ready=False)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[engine_pb2.SessionAnswer]] = {}
        self._outbox: list[engine_pb2.SessionCall] = []
        self._writer: asyncio.Task[None] | None = None
        self.ended: tuple[grpc.StatusCode, str] | None = None
        self.closed = False  # by us (``close``), not broken
        self.sidecar_id = ""  # the peer instance that answered on it (set by the client)
        self._reader = asyncio.ensure_future(self._read())

    async def call(self, method: str, request: Message, timeout: float) -> bytes:
        """The call's serialized response; raises ``AioRpcError`` as its unary call would, or
        ``NotSent``."""
        if self.ended is not None:
            raise NotSent(self.ended[1])
        call_id = next(self._ids)
        answer: asyncio.Future[engine_pb2.SessionAnswer] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = answer
        self._outbox.append(
            engine_pb2.SessionCall(
                call_id=call_id, method=method, request=request.SerializeToString(), timeout_seconds=timeout
            )
        )
        if self._writer is None:
            self._writer = asyncio.ensure_future(self._write())
        try:
            async with asyncio.timeout(timeout):
                result = await answer
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            self._pending.pop(call_id, None)
        self._owner.answered_calls += 1
        if result.code:
            raise rpc_error(_code(result.code), result.message)
        return bytes(result.response)

    async def _write(self) -> None:
        """Write the calls waiting, all in one message; those that came meanwhile in the next."""
        try:
            while self._outbox and self.ended is None:
                batch, self._outbox = self._outbox, []
                await self._call.write(engine_pb2.SessionCalls(calls=batch))
                self._owner.messages_written += 1
        except Exception as exc:  # the stream ended under the write: the reader says why
            log.debug("peer_stream_write_failed", peer=self.address, error=repr(exc))
        finally:
            self._writer = None

    async def _read(self) -> None:
        code, details = grpc.StatusCode.OK, "the peer ended the stream"
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    break
                for answer in message.answers:
                    future = self._pending.get(answer.call_id)
                    if future is not None and not future.done():
                        future.set_result(answer)
            code = await self._call.code()
            details = await self._call.details() or details
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
        except asyncio.CancelledError:  # the call was cancelled: by ``close``, or its channel closed
            code, details = grpc.StatusCode.CANCELLED, "the channel was closed"
        except Exception as exc:  # a transport error grpc did not wrap: still fail the calls
            code, details = grpc.StatusCode.UNAVAILABLE, repr(exc)
        self._end(code, details)

    def _end(self, code: grpc.StatusCode, details: str) -> None:
        if self.ended is not None:
            return
        self.ended = (code, details)
        if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.OK):
            # Never run there (an older peer; or one that ended the stream once it had answered
            # every call it read): the calls go unary.
            error: Exception = NotSent(details)
        elif self.closed:
            error = rpc_error(code, details)
        else:
            error = rpc_error(code, f"the peer stream broke: {details}")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        self._owner.ended(self, code, details)

    def close(self) -> None:
        """Closed by us: the calls in flight fail CANCELLED (as unary calls on a closed channel)."""
        self.closed = True
        self._call.cancel()
        self._end(grpc.StatusCode.CANCELLED, "the peer stream was closed")

    async def retire(self) -> None:
        """Replaced (a new channel): no new calls; it ends once the peer answered those in flight."""
        if self.ended is None:
            with contextlib.suppress(Exception):
                await self._call.done_writing()


class PeerStreams:
    """The open stream of each peer, and when to open the next one."""

    def __init__(self) -> None:
        self._open: dict[str, PeerStream] = {}
        self._retry_at: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._closing: set[asyncio.Task[None]] = set()
        # Streams opened, messages of calls written, calls answered on streams, ever (for tests).
        self.opened = 0
        self.messages_written = 0
        self.answered_calls = 0
        self.closed = False

    def get(self, address: str, stub: peer_pb2_grpc.PeerServiceStub, connected: bool) -> PeerStream | None:
        """The open stream to ``address`` on ``stub``'s channel, opening one if it may: None means
        send the call unary."""
        stream = self._open.get(address)
        if stream is not None and stream.stub is not stub:
            del self._open[address]
            task = asyncio.ensure_future(stream.retire())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            stream = None
        if stream is None:
            if self.closed or not connected or time.monotonic() < self._retry_at.get(address, 0.0):
                return None
            self._retry_at.pop(address, None)  # only peers whose stream failed stay in the table
            stream = self._open[address] = PeerStream(address, stub, self)
            self.opened += 1
            log.info("peer_stream_opened", peer=address)
        return stream

    def answered(self, stream: PeerStream) -> None:
        """A call got its answer: the stream works, the next break starts the backoff afresh."""
        self._backoff.pop(stream.address, None)

    def ended(self, stream: PeerStream, code: grpc.StatusCode, details: str) -> None:
        if self._open.get(stream.address) is stream:
            del self._open[stream.address]
        address = stream.address
        if code == grpc.StatusCode.UNIMPLEMENTED:
            log.info("peer_stream_unsupported", peer=address, retry_s=_UNIMPLEMENTED_RETRY_S)
            self._retry_at[address] = time.monotonic() + _UNIMPLEMENTED_RETRY_S
            return
        if stream.closed:
            return  # we closed it: no backoff
        backoff = min(_BACKOFF_MAX_S, self._backoff.get(address, _BACKOFF_FIRST_S / 2) * 2)
        self._backoff[address] = backoff
        self._retry_at[address] = time.monotonic() + backoff
        log.info("peer_stream_ended", peer=address, code=code.name, reason=details, reopen_after_s=backoff)

    def forget(self, address: str, sidecar_id: str) -> None:
        """The peer restarted as ``sidecar_id``: a stream an older instance answered on is never
        used again (its calls in flight fail; one to the new instance is kept)."""
        key = address_key(address)
        for other, stream in list(self._open.items()):
            if address_key(other) == key and stream.sidecar_id and stream.sidecar_id != sidecar_id:
                stream.close()
                self._retry_at.pop(other, None)
                self._backoff.pop(other, None)

    def close(self) -> None:
        self.closed = True
        for stream in list(self._open.values()):
            stream.close()
        self._open.clear()


def _code(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN
