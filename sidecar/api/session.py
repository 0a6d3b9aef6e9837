"""The engine session stream (``EngineService.Session``): one engine client's unary calls and
their answers on one long-lived stream, several per message when several are ready.

Each call runs through the *same* handler its unary RPC runs: the servicer's method wrapped by
``CallInterceptor`` (logging context, metrics, undecodable request -> INVALID_ARGUMENT, domain
errors -> their status and message), with the caller the stream's session token named
(``TokenInterceptor`` set ``CALLER`` when the stream opened; every call task inherits it, so the
servicer's ``_may_act`` checks each call's engine as it does a unary call's). What a unary call
would have ended with (response, or status code and message) is the call's ``SessionAnswer``. A
call's ``timeout_seconds`` bounds it as a deadline bounds a unary call (DEADLINE_EXCEEDED).

A ``WatchEvents`` call (when the dispatcher is given ``watch``: the engine service's) subscribes
the stream to one worker's events (``core.events.Subscription``): they go out in
``SessionAnswers.events``, several per message, and its answer is the status its WatchEvents
stream would have ended with. Events stay in the worker's queue until a message takes them (so a
slow client hits ``max_queued_events`` as a WatchEvents reader does); an event for a request whose
call is in flight on this stream waits for that call's answer (``_Watch.parked``). A
``SessionCall.cancel`` ends a call in flight (CANCELLED).

One task per stream sends: it waits on the stream's ``wake`` (set by each answer and by each event
queued for a watched worker) and sends what is ready in one message.

The stream ends when the client half-closes it (after the calls in flight are answered; its watches
end), when the client goes (calls in flight are cancelled and watches detached, as a unary call or
a WatchEvents stream whose client went), or when the sidecar drains for shutdown
(``SessionDispatcher`` notices within ``_DRAIN_POLL_S``; a stream that watches a worker stays
until the node closes the worker's events at its stop, as a WatchEvents stream does).

The dispatcher does not depend on gRPC's transport: ``serve`` takes any async iterator of
``SessionCalls`` and a context whose ``abort`` raises (gRPC's ServicerContext for the Session RPC;
``api.session_socket``'s for the same session on the plain Unix socket next to the engine socket).

Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection
from typing import Any, NoReturn, Protocol

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from kvsidecar.v1 import engine_pb2
from sidecar.api.interceptor import CallInterceptor
from sidecar.core.events import Subscription
from sidecar.core.trace import RPC_STARTED
from sidecar.logs import get_logger

log = get_logger("kvsidecar.server")

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"]
# How often an open session looks whether the sidecar drains (one timer per sidecar, not per call).
_DRAIN_POLL_S = 0.25
# Answers ready together go in one message up to about this size (the rest in the next one).
_BATCH_BYTES = 4 * 1024 * 1024
# Events of one watch per message (the rest in the next one).
_BATCH_EVENTS = 1024
# Events held for calls in flight, per watch; past it they go out (only their order is lost).
_MAX_PARKED = 4096
_WATCH = "WatchEvents"
WatchStarter = Callable[[engine_pb2.WatchEventsRequest, Any], Awaitable[Subscription]]


class SessionContext(Protocol):
    """What ``serve`` needs of its transport: ``abort`` ends the session with a status (raises)."""

    async def abort(self, code: grpc.StatusCode, details: str = ..., trailing_metadata: Any = ...) -> NoReturn: ...


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

    def __init__(self, stream: SessionContext) -> None:
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
        watch: WatchStarter | None = None,
    ) -> None:
        """``service``'s unary ``methods`` (all by default), each as ``servicer`` answers it (the
        peer stream, ``api.peer``, serves PeerService's this way); ``watch``: how a WatchEvents
        call subscribes (checks included), or None (UNIMPLEMENTED)."""
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
        if watch is not None:  # run as a unary handler: the same logging, metrics, statuses
            plain = grpc.unary_unary_rpc_method_handler(
                watch, request_deserializer=engine_pb2.WatchEventsRequest.FromString
            )
            self._handlers[_WATCH] = interceptor.wrap(plain, f"/{service.full_name}/{_WATCH}")
        self._open: set[_Stream] = set()
        self._drain_watch: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return self._draining()

    async def serve(
        self, calls: AsyncIterator[Any], context: SessionContext
    ) -> AsyncGenerator[engine_pb2.SessionAnswers, None]:
        """The session's messages, the first empty (it is open); ``calls`` yields ``SessionCalls``,
        or an object with an ``error`` (an undecodable message: the session ends
        INVALID_ARGUMENT). How it ends other than by returning: ``context.abort``."""
        if self._draining():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the sidecar is draining for shutdown")
        stream = _Stream(_CallContext(context))
        reader = asyncio.ensure_future(self._read(calls, stream))
        self._open.add(stream)
        self._watch_drain()
        try:
            yield engine_pb2.SessionAnswers()  # the stream is open (and its token was accepted)
            while True:
                await stream.wake.wait()
                stream.wake.clear()
                message = stream.take()
                if message is not None:
                    yield message
                if stream.error:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, stream.error)
                if stream.ending and not stream.answers and (stream.read_done or stream.answered >= stream.started):
                    return
        finally:
            self._open.discard(stream)
            reader.cancel()
            for task in list(stream.running):
                task.cancel()
            for watch in stream.watches.values():
                watch.subscription.close()  # as a WatchEvents stream whose client went
            stream.watches.clear()

    async def _read(self, calls: AsyncIterator[Any], stream: _Stream) -> None:
        """Start each call as it arrives; once the client half-closed, wait for those in flight."""
        loop = asyncio.get_running_loop()
        try:
            async for batch in calls:
                if not isinstance(batch, engine_pb2.SessionCalls):  # undecodable (CallInterceptor's, or a frame)
                    stream.error = getattr(batch, "reason", "") or (
                        f"SessionCalls: not a valid protobuf message: {getattr(batch, 'error', '')}"
                    )
                    log.info("session_refused", error=stream.error)
                    return
                for call in batch.calls:
                    if call.cancel:
                        stream.cancel(call.call_id)
                        continue
                    stream.started += 1
                    task = loop.create_task(self._answer(call, stream))
                    stream.running.add(task)
                    stream.by_id[call.call_id] = task
                    task.add_done_callback(stream.running.discard)
            if stream.running:
                await asyncio.wait(list(stream.running))
            for call_id in list(stream.watches):  # the client is going: so are its watches
                stream.end_watch(call_id, grpc.StatusCode.CANCELLED, "the client half-closed the session stream")
            stream.read_done = True
        except grpc.RpcError as exc:  # the client went; serve is cancelled too
            log.info("session_read_failed", error=str(exc))
        finally:
            stream.stop()

    async def _answer(self, call: engine_pb2.SessionCall, stream: _Stream) -> None:
        RPC_STARTED.set(time.monotonic())
        answer = engine_pb2.SessionAnswer(call_id=call.call_id)
        handler = self._handlers.get(call.method)
        if handler is None:
            answer.code = grpc.StatusCode.UNIMPLEMENTED.value[0]
            answer.message = f"{call.method[:100]!r} is not a unary {self._service} method of this stream"
            log.info("session_call_unknown", method=call.method[:100])
            stream.put(answer)
            return
        request = handler.request_deserializer(call.request)
        subject = _subject(request)
        if subject:
            stream.in_flight[subject] += 1
        try:
            if call.method == _WATCH:
                subscription = await handler.unary_unary(request, stream.context)
                stream.watch(call.call_id, request.engine_id, subscription)
                return
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
        except asyncio.CancelledError:
            if call.call_id not in stream.cancelled:
                raise  # the stream is over
            answer.code = grpc.StatusCode.CANCELLED.value[0]
            answer.message = "cancelled by the client"
        finally:
            stream.by_id.pop(call.call_id, None)
            stream.cancelled.discard(call.call_id)
            if subject:
                stream.done(subject)
        stream.put(answer)

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
                    stream.stop()
                self._open.clear()
                return
            await asyncio.sleep(_DRAIN_POLL_S)


def _subject(request: Any) -> tuple[str, str] | None:
    """The (engine, request) a call acts on, if it names one: that request's events wait for the
    call's answer."""
    request_id = getattr(request, "request_id", "")
    return (getattr(request, "engine_id", ""), request_id) if isinstance(request_id, str) and request_id else None


class _Watch:
    """A WatchEvents call on the stream: its subscription, and its events held for calls in flight."""

    __slots__ = ("engine_id", "parked", "subscription")

    def __init__(self, engine_id: str, subscription: Subscription) -> None:
        self.engine_id = engine_id
        self.subscription = subscription
        self.parked: list[engine_pb2.Event] = []

    def take(self, in_flight: collections.Counter[tuple[str, str]]) -> tuple[list[engine_pb2.Event], Any]:
        """What may go out now, in order, and the watch's end if it came."""
        out: list[engine_pb2.Event] = []
        if self.parked:
            held = self.parked
            self.parked = [event for event in held if (self.engine_id, event.request_id) in in_flight]
            out = [event for event in held if (self.engine_id, event.request_id) not in in_flight]
        events, closed = self.subscription.take(_BATCH_EVENTS)
        for event in events:
            if event.request_id and (self.engine_id, event.request_id) in in_flight:
                self.parked.append(event)
            else:
                out.append(event)
        if closed is not None or len(self.parked) > _MAX_PARKED:
            out.extend(self.parked)
            self.parked = []
        return out, closed


class _Stream:
    """One open session: its answers waiting to be sent, its calls in flight and watches, how it
    ends."""

    def __init__(self, context: _CallContext) -> None:
        self.context = context
        self.answers: collections.deque[engine_pb2.SessionAnswer] = collections.deque()
        self.wake = asyncio.Event()  # something to send, or the stream ends
        self.running: set[asyncio.Task[None]] = set()
        self.by_id: dict[int, asyncio.Task[None]] = {}
        self.cancelled: set[int] = set()
        self.watches: dict[int, _Watch] = {}
        # (engine, request) of the calls in flight: their events wait for the answer.
        self.in_flight: collections.Counter[tuple[str, str]] = collections.Counter()
        self.started = 0
        self.answered = 0
        self.ending = False  # the client half-closed or the sidecar drains: end once answered
        self.read_done = False
        self.error = ""

    def put(self, answer: engine_pb2.SessionAnswer) -> None:
        self.answers.append(answer)
        self.wake.set()

    def stop(self) -> None:
        self.ending = True
        self.wake.set()

    def done(self, subject: tuple[str, str]) -> None:
        """A call naming ``subject`` ended (its answer is queued next)."""
        self.in_flight[subject] -= 1
        if self.in_flight[subject] <= 0:
            del self.in_flight[subject]

    def watch(self, call_id: int, engine_id: str, subscription: Subscription) -> None:
        self.watches[call_id] = _Watch(engine_id, subscription)
        subscription.listen(self.wake.set)

    def end_watch(self, call_id: int, code: grpc.StatusCode, message: str) -> None:
        watch = self.watches.pop(call_id, None)
        if watch is not None:
            watch.subscription.close()
            self.put(engine_pb2.SessionAnswer(call_id=call_id, code=code.value[0], message=message))

    def cancel(self, call_id: int) -> None:
        """The client cancelled the call: it ends CANCELLED (a watch detaches)."""
        if call_id in self.watches:
            self.end_watch(call_id, grpc.StatusCode.CANCELLED, "cancelled by the client")
            return
        task = self.by_id.get(call_id)
        if task is not None:
            self.cancelled.add(call_id)
            task.cancel()

    def take(self) -> engine_pb2.SessionAnswers | None:
        """What is ready to send, in one message (answers first, then events, then the answers
        ending watches), or None."""
        answers: list[engine_pb2.SessionAnswer] = []
        size = 0
        while self.answers and size < _BATCH_BYTES:
            answers.append(self.answers.popleft())
            size += _size(answers[-1])
        if self.answers:
            self.wake.set()  # the rest in the next message
        groups: list[engine_pb2.SessionEvents] = []
        for call_id, watch in list(self.watches.items()):
            events, closed = watch.take(self.in_flight)
            if events:
                groups.append(engine_pb2.SessionEvents(call_id=call_id, events=events))
            if closed is not None:
                self.watches.pop(call_id)
                watch.subscription.close()
                code = grpc.StatusCode.RESOURCE_EXHAUSTED if closed.exhausted else grpc.StatusCode.OK
                if closed.exhausted:
                    log.info("rpc_rejected", rpc="EngineService/WatchEvents", code=code.name, error=closed.reason)
                answers.append(engine_pb2.SessionAnswer(call_id=call_id, code=code.value[0], message=closed.reason))
        if not answers and not groups:
            return None
        self.answered += len(answers)
        return engine_pb2.SessionAnswers(answers=answers, events=groups)
