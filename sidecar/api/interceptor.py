"""The one interceptor both gRPC servers run: per call it binds the logging context (``rpc=``),
counts and times the call, answers undecodable requests INVALID_ARGUMENT, and maps the core's
domain errors (``sidecar.errors.SidecarError``) to their gRPC status. Servicers therefore stay
one line per method.

The wrapped handler of each method is built once and reused (the servicer's handler object is
the same for every call of a method): building it per call cost each RPC a metric lookup and four
closures. Each call also records when it reached the interceptor (``trace.RPC_STARTED``), so a
request's trace can say how long the servicer took to admit it.

Runs on the event loop thread, around every servicer call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from sidecar.core.trace import RPC_STARTED
from sidecar.errors import InvalidArgument, SidecarError
from sidecar.logs import get_logger
from sidecar.metrics import SidecarMetrics

log = get_logger("kvsidecar.server")


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Per call: bind logging context, count and time it, and map domain errors to statuses.

    A ``SidecarError`` becomes its status with its message; anything else is a bug, logged with
    its traceback and answered INTERNAL, and the daemon keeps serving.
    """

    def __init__(self, metrics: SidecarMetrics) -> None:
        self._metrics = metrics
        # Method -> (the servicer's handler, our wrapper of it).
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        RPC_STARTED.set(time.monotonic())
        handler = await continuation(details)
        if handler is None:
            return handler
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self.wrap(handler, details.method)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    def wrap(self, handler: grpc.RpcMethodHandler, full_method: str) -> grpc.RpcMethodHandler:
        """``handler`` as every call of ``full_method`` runs it (also each call on the engine
        session stream, ``api.session``, which runs the unary handlers this returns)."""
        service, _, method = full_method.lstrip("/").rpartition("/")
        deserializer = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, service, method),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, service, method),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_bidi(handler.stream_stream, service, method),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _wrap_unary(self, behavior: Callable[..., Any], service: str, method: str) -> Callable[..., Any]:
        short = service.rsplit(".", 1)[-1]
        duration = self._metrics.rpc_duration.labels(service=short, method=method)
        rpc = f"{short}/{method}"

        # What ``_handled`` does, inline: every engine and peer call (and each call on the session
        # streams) runs this, and an async context manager plus structlog's ``bound_contextvars``
        # (which copies the whole context to save what it rebinds) cost more than the call's own
        # bookkeeping. A call runs in a task of its own, so resetting its token restores the rest.
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            tokens = structlog.contextvars.bind_contextvars(rpc=rpc)
            code = grpc.StatusCode.OK
            try:
                _reject_undecodable(request)
                return await behavior(request, context)
            except BaseException as exc:
                code = _status_of(exc)
                await _abort(exc, code, context)
                raise
            finally:
                structlog.contextvars.reset_contextvars(**tokens)
                self._count(short, method, code)
                duration.observe(time.perf_counter() - started)

        return wrapped

    def _wrap_stream(self, behavior: Callable[..., Any], service: str, method: str) -> Callable[..., Any]:
        short = service.rsplit(".", 1)[-1]

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with self._handled(short, method, context):
                _reject_undecodable(request)
                async for item in behavior(request, context):
                    yield item

        return wrapped

    def _wrap_bidi(self, behavior: Callable[..., Any], service: str, method: str) -> Callable[..., Any]:
        short = service.rsplit(".", 1)[-1]

        async def wrapped(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with self._handled(short, method, context):
                async for item in behavior(requests, context):
                    yield item

        return wrapped

    @contextlib.asynccontextmanager
    async def _handled(self, service: str, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Bind the call's logging context, count it, and turn exceptions into statuses."""
        code = grpc.StatusCode.OK
        with structlog.contextvars.bound_contextvars(rpc=f"{service}/{method}"):
            try:
                yield
            except BaseException as exc:
                code = _status_of(exc)
                await _abort(exc, code, context)
                raise
            finally:
                self._count(service, method, code)

    def _count(self, service: str, method: str, code: grpc.StatusCode) -> None:
        self._metrics.child(self._metrics.rpc_requests, service, method, code.name).inc()


def _status_of(exc: BaseException) -> grpc.StatusCode:
    """The status a call that raised ``exc`` is counted with: a ``SidecarError``'s own, CANCELLED,
    INTERNAL for a bug, OK for an abort the handler made itself (as counted before)."""
    if isinstance(exc, SidecarError):
        return exc.code
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    if isinstance(exc, Exception) and not isinstance(exc, grpc.aio.AbortError):
        return grpc.StatusCode.INTERNAL
    return grpc.StatusCode.OK


async def _abort(exc: BaseException, code: grpc.StatusCode, context: grpc.aio.ServicerContext) -> None:
    """End the call with ``exc``'s status where it is ours to say (``context.abort`` raises): a
    ``SidecarError`` with its message, a bug INTERNAL with its traceback logged. Anything else
    (a cancellation, an abort) the caller re-raises."""
    if isinstance(exc, SidecarError):
        log.info("rpc_rejected", code=code.name, error=str(exc))
        await context.abort(code, str(exc))
    elif code == grpc.StatusCode.INTERNAL:
        log.exception("rpc_failed", error=repr(exc))
        await context.abort(code, f"internal error: {type(exc).__name__}: {exc}")


class _Undecodable:
    """Stands in for a request whose bytes are not a valid message, so the call can be answered
    INVALID_ARGUMENT instead of grpc's UNKNOWN."""

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return _Undecodable(str(exc))

    return deserialize


def _reject_undecodable(request: Any) -> None:
    if isinstance(request, _Undecodable):
        raise InvalidArgument("request", f"is not a valid protobuf message: {request.error}")
