"""The engine session stream (``EngineService.Session``): one engine client's unary calls and
their answers on one long-lived stream, several per message when several are ready.

Each call runs through the *same* handler its unary RPC runs: the servicer's method wrapped by
``CallInterceptor`` (logging context, metrics, undecodable request -> INVALID_ARGUMENT, domain
errors -> their status and message), with the caller the stream's session token named
(``TokenInterceptor`` set ``CALLER`` when the stream opened; every call task inherits it, so the
servicer's ``_may_act`` checks each call's engine as it does a unary call's). What a unary call
would have ended with (response, or status code and message) is the call's ``SessionAnswer``. A
call's ``timeout_seconds`` bounds it as a deadline bounds a unary call (DEADLINE_EXCEEDED).

The stream ends when the client half-closes it (after the calls in flight are answered), when the
client goes (calls in flight are cancelled, as a unary call whose client went), or when the
sidecar drains for shutdown (``SessionDispatcher`` notices within ``_DRAIN_POLL_S``).

Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any, NoReturn

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from kvsidecar.v1 import engine_pb2
from sidecar.api.interceptor import CallInterceptor
from sidecar.core.trace import RPC_STARTED
from sidecar.logs import get_logger

log = get_logger("kvsidecar.server")

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"]
# How often an open session looks whether the sidecar drains (one timer per sidecar, not per call).
_DRAIN_POLL_S = 0.25
_STOP = object()  # ends a session's answer queue
# Answers ready together go in one message up to about this size (the rest in the next one).
_BATCH_BYTES = 4 * 1024 * 1024


def _size(item: Any) -> int:
    return len(item.response) + len(item.message) if isinstance(item, engine_pb2.SessionAnswer) else 0


class _Answered(Exception):
    """A call ended with a status (what ``context.abort`` does to a unary call)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _CallContext:
    """What the wrapped unary handler is given as its ServicerContext for a call on the stream:
    its ``abort`` ends the call with that status (the servicer's methods use nothing else)."""

    __slots__ = ("stream",)

    def __init__(self, stream: grpc.aio.ServicerContext) -> None:
        self.stream = stream

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn:
        raise _Answered(code, details)

    def __getattr__(self, name: str) -> Any:  # peer(), invocation_metadata(), ...: the stream's
        return getattr(self.stream, name)


class SessionDispatcher:
    """Maps each call of a Session stream to its unary handler and answers it (see module doc)."""

    def __init__(
        self,
        servicer: Any,
        interceptor: CallInterceptor,
        draining: Callable[[], bool] = lambda: False,
        service: ServiceDescriptor = SERVICE,
        methods: Collection[str] | None = None,
    ) -> None:
        """``service``'s unary ``methods`` (all by default), each as ``servicer`` answers it (the
        peer stream, ``api.peer``, serves PeerService's this way)."""
        self._draining = draining
        self._service = service.name
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        for method in service.methods:
            if method.client_streaming or method.server_streaming:
                continue
            if methods is not None and method.name not in methods:
                continue
            request_class = GetMessageClass(method.input_type)
            response_class = GetMessageClass(method.output_type)
            plain = grpc.unary_unary_rpc_method_handler(
                getattr(servicer, method.name),
                request_deserializer=request_class.FromString,
                response_serializer=response_class.SerializeToString,
            )
            self._handlers[method.name] = interceptor.wrap(plain, f"/{service.full_name}/{method.name}")
        self._open: set[_Stream] = set()
        self._drain_watch: asyncio.Task[None] | None = None

    async def serve(
        self, calls: AsyncIterator[engine_pb2.SessionCalls], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.SessionAnswers]:
        if self._draining():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the sidecar is draining for shutdown")
        stream = _Stream(_CallContext(context))
        reader = asyncio.ensure_future(self._read(calls, stream))
        self._open.add(stream)
        self._watch_drain()
        try:
            yield engine_pb2.SessionAnswers()  # the stream is open (and its token was accepted)
            while True:
                batch = [await stream.answers.get()]
                size = _size(batch[0])
                while size < _BATCH_BYTES and not stream.answers.empty():
                    batch.append(stream.answers.get_nowait())
                    size += _size(batch[-1])
                answers = [item for item in batch if item is not _STOP]
                if len(answers) < len(batch):
                    stream.ending = True
                if answers:
                    stream.answered += len(answers)
                    yield engine_pb2.SessionAnswers(answers=answers)
                if stream.error:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, stream.error)
                if stream.ending and (stream.read_done or stream.answered >= stream.started):
                    return
        finally:
            self._open.discard(stream)
            reader.cancel()
            for task in list(stream.running):
                task.cancel()

    async def _read(self, calls: AsyncIterator[engine_pb2.SessionCalls], stream: _Stream) -> None:
        """Start each call as it arrives; once the client half-closed, wait for those in flight."""
        try:
            async for batch in calls:
                if not isinstance(batch, engine_pb2.SessionCalls):  # CallInterceptor's undecodable
                    stream.error = f"SessionCalls: not a valid protobuf message: {getattr(batch, 'error', '')}"
                    log.info("session_refused", error=stream.error)
                    return
                for call in batch.calls:
                    stream.started += 1
                    task = asyncio.ensure_future(self._answer(call, stream))
                    stream.running.add(task)
                    task.add_done_callback(stream.running.discard)
            if stream.running:
                await asyncio.wait(list(stream.running))
            stream.read_done = True
        except grpc.RpcError as exc:  # the client went; serve is cancelled too
            log.info("session_read_failed", error=str(exc))
        finally:
            stream.answers.put_nowait(_STOP)

    async def _answer(self, call: engine_pb2.SessionCall, stream: _Stream) -> None:
        RPC_STARTED.set(time.monotonic())
        answer = engine_pb2.SessionAnswer(call_id=call.call_id)
        handler = self._handlers.get(call.method)
        if handler is None:
            answer.code = grpc.StatusCode.UNIMPLEMENTED.value[0]
            answer.message = f"{call.method[:100]!r} is not a unary {self._service} method of this stream"
            log.info("session_call_unknown", method=call.method[:100])
            stream.answers.put_nowait(answer)
            return
        request = handler.request_deserializer(call.request)
        try:
            timeout = call.timeout_seconds if call.timeout_seconds > 0 else None
            async with asyncio.timeout(timeout):
                response = await handler.unary_unary(request, stream.context)
            answer.response = handler.response_serializer(response)
        except _Answered as ended:
            answer.code = ended.code.value[0]
            answer.message = ended.message
        except TimeoutError:
            answer.code = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            answer.message = "Deadline Exceeded"
        stream.answers.put_nowait(answer)

    def _watch_drain(self) -> None:
        if self._drain_watch is None or self._drain_watch.done():
            self._drain_watch = asyncio.ensure_future(self._end_sessions_when_draining())

    async def _end_sessions_when_draining(self) -> None:
        """While sessions are open, end each once the sidecar drains and its calls in flight were
        answered: an open stream would hold the server's shutdown for its whole grace. Their
        clients go unary (and are told UNAVAILABLE while the sidecar drains)."""
        while self._open:
            if self._draining():
                for stream in list(self._open):
                    stream.answers.put_nowait(_STOP)
                self._open.clear()
                return
            await asyncio.sleep(_DRAIN_POLL_S)


class _Stream:
    """One open session: its answers waiting to be sent, its calls in flight, how it ends."""

    def __init__(self, context: _CallContext) -> None:
        self.context = context
        self.answers: asyncio.Queue[Any] = asyncio.Queue()
        self.running: set[asyncio.Task[None]] = set()
        self.started = 0
        self.answered = 0
        self.ending = False  # the client half-closed or the sidecar drains: end once answered
        self.read_done = False
        self.error = ""
