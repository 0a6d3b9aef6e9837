"""CallInterceptor's unary wrapper (every engine and peer call, and each call on the session
streams): a call's logging context, its count by status code, and errors mapped to statuses."""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn

import grpc
import pytest
import structlog

from sidecar.api.interceptor import CallInterceptor
from sidecar.errors import FailedPrecondition
from sidecar.metrics import SidecarMetrics


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Context:
    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn:
        raise _Aborted(code, details)


def _count(metrics: SidecarMetrics, code: str) -> float:
    value = metrics.registry.get_sample_value(
        "kvsidecar_rpc_requests_total", {"service": "EngineService", "method": "Pull", "code": code}
    )
    return value or 0.0


def _wrapped(metrics: SidecarMetrics, behavior: Any) -> Any:
    plain = grpc.unary_unary_rpc_method_handler(behavior, request_deserializer=bytes)
    return CallInterceptor(metrics).wrap(plain, "/kvsidecar.v1.EngineService/Pull")


def test_a_call_is_counted_by_its_status_and_logged_with_its_method() -> None:
    metrics = SidecarMetrics()
    seen: list[Any] = []

    async def ok(request: Any, context: Any) -> str:
        seen.append(structlog.contextvars.get_contextvars().get("rpc"))
        return "done"

    async def refused(request: Any, context: Any) -> str:
        raise FailedPrecondition("not now")

    async def buggy(request: Any, context: Any) -> str:
        raise KeyError("oops")

    async def cancelled(request: Any, context: Any) -> str:
        raise asyncio.CancelledError

    async def scenario() -> None:
        structlog.contextvars.bind_contextvars(rpc="outer")
        assert await _wrapped(metrics, ok).unary_unary(b"", _Context()) == "done"
        assert seen == ["EngineService/Pull"]
        assert structlog.contextvars.get_contextvars().get("rpc") == "outer", "the call's context leaked"
        with pytest.raises(_Aborted) as refusal:
            await _wrapped(metrics, refused).unary_unary(b"", _Context())
        assert refusal.value.code == grpc.StatusCode.FAILED_PRECONDITION and refusal.value.details == "not now"
        with pytest.raises(_Aborted) as bug:
            await _wrapped(metrics, buggy).unary_unary(b"", _Context())
        assert bug.value.code == grpc.StatusCode.INTERNAL
        assert bug.value.details == "internal error: KeyError: 'oops'"
        with pytest.raises(asyncio.CancelledError):
            await _wrapped(metrics, cancelled).unary_unary(b"", _Context())
        assert structlog.contextvars.get_contextvars().get("rpc") == "outer"

    asyncio.run(scenario())
    assert [_count(metrics, code) for code in ("OK", "FAILED_PRECONDITION", "INTERNAL", "CANCELLED")] == [1, 1, 1, 1]
    duration = metrics.registry.get_sample_value(
        "kvsidecar_rpc_duration_seconds_count", {"service": "EngineService", "method": "Pull"}
    )
    assert duration == 4


def test_an_undecodable_request_is_answered_invalid_argument() -> None:
    metrics = SidecarMetrics()

    async def never(request: Any, context: Any) -> str:
        raise AssertionError("the handler ran on an undecodable request")

    def undecodable(data: bytes) -> Any:
        raise ValueError("truncated message")

    plain = grpc.unary_unary_rpc_method_handler(never, request_deserializer=undecodable)
    handler = CallInterceptor(metrics).wrap(plain, "/kvsidecar.v1.EngineService/Pull")

    async def scenario() -> None:
        with pytest.raises(_Aborted) as refusal:
            await handler.unary_unary(handler.request_deserializer(b"\xff"), _Context())
        assert refusal.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf message: truncated message" in refusal.value.details

    asyncio.run(scenario())
    assert _count(metrics, "INVALID_ARGUMENT") == 1
