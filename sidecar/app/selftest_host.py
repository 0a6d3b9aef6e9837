"""The far side of ``kvsidecar selftest``: this sidecar hosts one test engine for an operator's
self-test run from another node (SelfTestService, proto/kvsidecar/v1/selftest.proto).

The test engine is a simulated engine process (``sidecar.tools.test_engine``: started, not
imported, so the daemon imports nothing of the shim) registered on this sidecar's own engine
socket like any engine, with its KV in shared memory. Bounds: one engine at a time, at most
``MAX_BYTES`` of KV, removed after its TTL (at most ``MAX_TTL_SECONDS``) or at shutdown, and every
command waits at most ``COMMAND_TIMEOUT_SECONDS``. Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import Any

import grpc

from kvsidecar.v1 import selftest_pb2, selftest_pb2_grpc
from sidecar.config import Settings
from sidecar.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from sidecar.logs import get_logger
from sidecar.tools.test_engine import COMMAND_TIMEOUT_SECONDS, TestEngineFailed, TestEngineProcess

log = get_logger("kvsidecar.selftest")

MAX_BYTES = 256 << 20
MAX_TTL_SECONDS = 600.0
# What a remote operator may ask the test engine to do (no hold, query or anything else).
ALLOWED_OPS = frozenset({"fill_tokens", "verify_tokens", "submit", "pull", "expect_push", "release"})
UCX_VARIABLES = ("UCX_TLS", "UCX_NET_DEVICES")


class TestEngineHost:
    """At most one hosted test engine; see the module docstring."""

    def __init__(self, settings: Settings, sidecar_info: Any) -> None:
        self._settings = settings
        self._sidecar_info = sidecar_info
        self._engine: TestEngineProcess | None = None
        self._lock = asyncio.Lock()

    async def open(self, request: selftest_pb2.OpenTestEngineRequest) -> selftest_pb2.OpenTestEngineResponse:
        layers, blocks, block_len = request.layers or 2, request.blocks or 64, request.block_len or 65536
        block_size = request.block_size or 16
        if layers * blocks * block_len > MAX_BYTES:
            raise InvalidArgument("layers", f"{layers} x {blocks} x {block_len} bytes is over {MAX_BYTES >> 20} MiB")
        if block_len % block_size:
            raise InvalidArgument("block_len", f"{block_len} does not divide into {block_size} tokens")
        ttl = request.ttl_seconds or 120.0
        if not 0 < ttl <= MAX_TTL_SECONDS:
            raise InvalidArgument("ttl_seconds", f"must be in (0, {MAX_TTL_SECONDS:g}]")
        async with self._lock:
            if self._engine is not None and self._engine.process.returncode is None:
                raise ResourceExhausted("a self-test engine is already running on this sidecar; try again later")
            engine_id = f"selftest-{uuid.uuid4().hex[:8]}"
            try:
                engine, ready = await TestEngineProcess.start(
                    self._settings.engine_socket, engine_id, layers, blocks, block_len, block_size
                )
            except TestEngineFailed as exc:
                log.warning("selftest_engine_failed", engine_id=engine_id, reason=str(exc))
                raise FailedPrecondition(f"the test engine could not start on this sidecar: {exc}") from None
            self._engine = engine
            engine.expiry = asyncio.get_running_loop().call_later(ttl, lambda: asyncio.ensure_future(engine.stop()))
        log.info("selftest_engine_started", engine_id=engine_id, ttl_seconds=ttl, bytes=layers * blocks * block_len)
        ucx = {name: os.environ[name] for name in UCX_VARIABLES if name in os.environ}
        return selftest_pb2.OpenTestEngineResponse(
            session_id=engine.session_id,
            engine_id=engine_id,
            peer_address=ready.get("peer_address", ""),
            sidecar=self._sidecar_info(),
            ucx_env=ucx,
        )

    def _session(self, session_id: str) -> TestEngineProcess:
        engine = self._engine
        if engine is None or engine.session_id != session_id or engine.process.returncode is not None:
            raise NotFound(f"session_id: no running self-test engine {session_id!r} (closed, or its TTL ended)")
        return engine

    async def drive(self, request: selftest_pb2.DriveTestEngineRequest) -> selftest_pb2.DriveTestEngineResponse:
        engine = self._session(request.session_id)
        try:
            command = json.loads(request.command_json)
        except ValueError:
            raise InvalidArgument("command_json", "is not JSON") from None
        if not isinstance(command, dict):
            raise InvalidArgument("command_json", "is not a JSON object")
        op = command.get("op")
        if op == "wait_event":
            try:
                timeout = min(max(float(command.get("timeout_seconds", 30.0)), 0.0), COMMAND_TIMEOUT_SECONDS)
            except (TypeError, ValueError):
                raise InvalidArgument("command_json", "timeout_seconds is not a number") from None
            reply = await engine.wait_event(str(command.get("request_id", "")), timeout)
        elif op in ALLOWED_OPS:
            reply = await engine.command(command)
        else:
            allowed = ", ".join([*sorted(ALLOWED_OPS), "wait_event"])
            raise InvalidArgument("command_json", f"op {op!r} is not one of {allowed}")
        return selftest_pb2.DriveTestEngineResponse(reply_json=json.dumps(reply))

    async def close(self, session_id: str = "") -> None:
        engine = self._engine
        if engine is not None and (not session_id or engine.session_id == session_id):
            self._engine = None
            await engine.stop()
            log.info("selftest_engine_stopped", engine_id=engine.engine_id)


class SelfTestServicer(selftest_pb2_grpc.SelfTestServiceServicer):
    def __init__(self, host: TestEngineHost) -> None:
        self._host = host

    async def OpenTestEngine(
        self, request: selftest_pb2.OpenTestEngineRequest, context: grpc.aio.ServicerContext
    ) -> selftest_pb2.OpenTestEngineResponse:
        return await self._host.open(request)

    async def DriveTestEngine(
        self, request: selftest_pb2.DriveTestEngineRequest, context: grpc.aio.ServicerContext
    ) -> selftest_pb2.DriveTestEngineResponse:
        return await self._host.drive(request)

    async def CloseTestEngine(
        self, request: selftest_pb2.CloseTestEngineRequest, context: grpc.aio.ServicerContext
    ) -> selftest_pb2.CloseTestEngineResponse:
        await self._host.close(request.session_id)
        return selftest_pb2.CloseTestEngineResponse()
