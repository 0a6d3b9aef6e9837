"""``kvsidecar selftest --peer HOST:PORT``: prove two deployed nodes, as ``ucx_perftest`` or
``nixlbench`` prove NIXL, but through both sidecars and real engines.

Run on node A against the sidecar of node B. The command starts a test engine on A's sidecar
(``sidecar.tools.test_engine``) and asks B's sidecar to host one (SelfTestService, served on B's
peer port with B's mTLS; ``sidecar.app.selftest_host``): the command can start processes only on
A, so B's test engine is B's sidecar's to start and remove. Then KV moves both ways in pull and in
push, each request's logical content checked token by token by the receiving engine
(``verify_tokens``), and it prints GB/s and latency per case, or the precise reason a step failed
(B unreachable, TLS refused, B's sidecar older than the self-test, the test engine's memory not
registrable, a transfer failing with the sidecar's reason). Both test engines are removed at the
end, also on failure or Ctrl-C (B's also by its TTL if this command dies).

Latency is measured here: from the call that starts a transfer (the consumer's Pull; the
producer's SubmitBlocks of a push registered before) to its FINISHED_RECEIVING as seen by this
command, which includes one control round trip to B when B's engine receives. Single asyncio loop.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc

from kvsidecar.v1 import selftest_pb2, selftest_pb2_grpc
from sidecar.config import Settings
from sidecar.tls import TlsFiles
from sidecar.tools.test_engine import TestEngineFailed, TestEngineProcess

PUSH_MODE = 2  # common_pb2.TRANSFER_MODE_PUSH
BLOCK_SIZE = 16
LAYERS = 2
EVENT_TIMEOUT_SECONDS = 30.0


class SelftestFailed(RuntimeError):
    """A step failed; the message is the precise reason printed to the operator."""


class Engine(Protocol):
    engine_id: str
    peer_address: str

    async def command(self, op: str, **fields: Any) -> dict[str, Any]: ...

    async def wait_event(self, request_id: str, timeout: float) -> dict[str, Any]: ...


@dataclass
class LocalEngine:
    process: TestEngineProcess
    engine_id: str
    peer_address: str

    async def command(self, op: str, **fields: Any) -> dict[str, Any]:
        return await self.process.command({"op": op, **fields})

    async def wait_event(self, request_id: str, timeout: float) -> dict[str, Any]:
        return await self.process.wait_event(request_id, timeout)


@dataclass
class RemoteEngine:
    stub: selftest_pb2_grpc.SelfTestServiceStub
    session_id: str
    engine_id: str
    peer_address: str
    timeout: float

    async def command(self, op: str, **fields: Any) -> dict[str, Any]:
        request = selftest_pb2.DriveTestEngineRequest(
            session_id=self.session_id, command_json=json.dumps({"op": op, **fields})
        )
        response = await self.stub.DriveTestEngine(request, timeout=self.timeout + 70.0)
        reply: dict[str, Any] = json.loads(response.reply_json)
        return reply

    async def wait_event(self, request_id: str, timeout: float) -> dict[str, Any]:
        return await self.command("wait_event", request_id=request_id, timeout_seconds=timeout)


@dataclass
class CaseResult:
    mode: str
    direction: str
    latencies: list[float] = field(default_factory=list)
    bytes: int = 0
    error: str = ""

    def row(self) -> list[str]:
        if self.error:
            return [self.mode, self.direction, str(len(self.latencies)), "-", "-", "-", f"FAILED: {self.error}"]
        seconds = sum(self.latencies)
        return [
            self.mode,
            self.direction,
            str(len(self.latencies)),
            f"{self.bytes / seconds / 1e9:.2f}" if seconds else "-",
            f"{statistics.median(self.latencies) * 1000:.1f}",
            f"{max(self.latencies) * 1000:.1f}",
            "every token verified",
        ]


def describe_rpc_error(peer: str, exc: grpc.aio.AioRpcError, tls: bool) -> str:
    """Why the call to the peer's sidecar failed, in an operator's words."""
    code, details = exc.code(), exc.details() or ""
    lowered = details.lower()
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return f"{peer}: {details}"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return f"the sidecar at {peer} has no self-test service: it is older than this kvsidecar; upgrade it"
    if code == grpc.StatusCode.UNAVAILABLE and any(w in lowered for w in ("ssl", "tls", "handshake", "certificate")):
        return f"TLS refused by or for {peer}: {details}"
    if code == grpc.StatusCode.UNAVAILABLE and tls is False and "socket closed" in lowered:
        return f"{peer} closed the connection: it may require mTLS (this node has no peer_tls_* set): {details}"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return f"{peer} unreachable: {details or code.name}"
    return f"{peer} answered {code.name}: {details}"


async def _transfer(mode: str, producer: Engine, consumer: Engine, request_id: str, blocks: int, seed: int) -> float:
    """Move one request producer -> consumer and verify it there; the seconds it took."""
    p_blocks, d_blocks = list(range(blocks)), list(range(blocks, 2 * blocks))
    tokens = blocks * BLOCK_SIZE
    filled = await producer.command("fill_tokens", blocks=p_blocks, num_tokens=tokens, seed=seed)
    _check(filled, "filling the producer's blocks")
    remote: dict[str, Any] = {
        "address": producer.peer_address,
        "engine_id": producer.engine_id,
        "request_id": request_id,
    }
    d_request = f"{request_id}-d"
    if mode == "pull":
        _check(await producer.command("submit", request_id=request_id, blocks=[p_blocks], num_tokens=tokens), "submit")
        started = time.monotonic()
        remote |= {"blocks": [p_blocks], "num_tokens": tokens}
        _check(await consumer.command("pull", request_id=d_request, blocks=[d_blocks], remote=remote), "pull")
    else:
        expected = await consumer.command("expect_push", request_id=d_request, blocks=[d_blocks], remote=remote)
        _check(expected, "expect_push")
        started = time.monotonic()
        submitted = await producer.command(
            "submit", request_id=request_id, blocks=[p_blocks], num_tokens=tokens, mode=PUSH_MODE
        )
        _check(submitted, "submit")
    event = await consumer.wait_event(d_request, EVENT_TIMEOUT_SECONDS)
    elapsed = time.monotonic() - started
    if event.get("event") != "FINISHED_RECEIVING":
        raise SelftestFailed(
            f"the transfer failed: {event.get('event') or ''} {event.get('reason') or event.get('error')}"
        )
    sent = await producer.wait_event(request_id, EVENT_TIMEOUT_SECONDS)
    if sent.get("event") != "FINISHED_SENDING":
        raise SelftestFailed(
            f"the producer did not finish: {sent.get('event') or ''} {sent.get('reason') or sent.get('error')}"
        )
    checked = await consumer.command("verify_tokens", blocks=d_blocks, first_token=0, num_tokens=tokens, seed=seed)
    _check(checked, "verify_tokens")
    if checked["bad_count"] or checked["tail_dirty"] or checked["checked_tokens"] == 0:
        raise SelftestFailed(f"the received KV differs from what was sent: {checked}")
    return elapsed


def _check(reply: dict[str, Any], what: str) -> None:
    if not reply.get("ok"):
        raise SelftestFailed(f"{what}: {reply.get('error', reply)}")


async def run_selftest(
    settings: Settings, peer: str, requests: int, blocks: int, block_kib: int, timeout: float
) -> tuple[list[CaseResult], dict[str, Any]]:
    """Every case; raises SelftestFailed when the test cannot run at all."""
    tls = settings.tls_enabled
    block_len = block_kib * 1024
    if tls:
        assert settings.peer_tls_cert and settings.peer_tls_key and settings.peer_tls_ca
        credentials = TlsFiles(
            settings.peer_tls_cert, settings.peer_tls_key, settings.peer_tls_ca
        ).channel_credentials()
        channel = grpc.aio.secure_channel(peer, credentials)
    else:
        channel = grpc.aio.insecure_channel(peer)
    stub = selftest_pb2_grpc.SelfTestServiceStub(channel)
    local: TestEngineProcess | None = None
    session = ""
    try:
        try:
            opened = await stub.OpenTestEngine(
                selftest_pb2.OpenTestEngineRequest(
                    layers=LAYERS, blocks=2 * blocks, block_len=block_len, block_size=BLOCK_SIZE, ttl_seconds=600
                ),
                timeout=timeout + 35.0,
                wait_for_ready=False,
            )
        except grpc.aio.AioRpcError as exc:
            raise SelftestFailed(describe_rpc_error(peer, exc, tls)) from None
        session = opened.session_id
        remote = RemoteEngine(stub, session, opened.engine_id, opened.peer_address, timeout)
        try:
            local, ready = await TestEngineProcess.start(
                settings.engine_socket, f"selftest-{uuid.uuid4().hex[:8]}", LAYERS, 2 * blocks, block_len, BLOCK_SIZE
            )
        except TestEngineFailed as exc:
            raise SelftestFailed(f"the test engine could not start on this node's sidecar: {exc}") from None
        mine = LocalEngine(local, local.engine_id, ready["peer_address"])
        info = {
            "local_address": mine.peer_address,
            "peer_version": opened.sidecar.versions.kvsidecar,
            "peer_host": opened.sidecar.hostname,
            "peer_nixl": opened.sidecar.versions.nixl,
            "peer_ucx_env": dict(opened.ucx_env),
        }
        results = []
        seed = 0
        for mode in ("pull", "push"):
            for direction, producer, consumer in (("B->A", remote, mine), ("A->B", mine, remote)):
                result = CaseResult(mode, direction)
                results.append(result)
                for index in range(requests):
                    seed += 1
                    try:
                        request = f"selftest-{mode}-{direction[0]}{direction[-1]}-{index}-{uuid.uuid4().hex[:6]}"
                        result.latencies.append(await _transfer(mode, producer, consumer, request, blocks, seed))
                        result.bytes += LAYERS * blocks * block_len
                    except SelftestFailed as exc:
                        result.error = str(exc)
                        break
                    except grpc.aio.AioRpcError as exc:
                        result.error = describe_rpc_error(peer, exc, tls)
                        break
        return results, info
    finally:
        if local is not None:
            await local.stop()
        if session:
            try:
                await stub.CloseTestEngine(selftest_pb2.CloseTestEngineRequest(session_id=session), timeout=10.0)
            except grpc.aio.AioRpcError:
                pass  # its TTL removes it
        await channel.close()


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)) for row in [header, *rows]
    ]
    return "\n".join(lines)


def main_selftest(
    peer: str, requests: int, blocks: int, block_kib: int, timeout: float, socket: Path | None, config: Path | None
) -> int:
    from sidecar.config import ConfigError, load_settings

    try:
        overrides: dict[str, Any] = {"engine_socket": socket} if socket is not None else {}
        settings = load_settings(overrides, config)
    except ConfigError as exc:
        print(f"kvsidecar selftest: {exc}")
        return 2
    print(f"kvsidecar selftest: this node's sidecar ({settings.engine_socket}) <-> {peer}")
    try:
        results, info = asyncio.run(run_selftest(settings, peer, requests, blocks, block_kib, timeout))
    except SelftestFailed as exc:
        print(f"FAILED: {exc}")
        return 1
    print(
        f"peer: kvsidecar {info['peer_version']} on {info['peer_host'] or '?'} ({info['peer_nixl'] or 'NIXL ?'}); "
        f"this node's test engine reached at {info['local_address']}"
    )
    mib = LAYERS * blocks * block_kib / 1024
    print(f"{requests} requests per case, {mib:g} MiB each (A = this node, B = {peer})")
    print(_table(["mode", "data", "requests", "GB/s", "p50 ms", "max ms", "result"], [r.row() for r in results]))
    ucx = info["peer_ucx_env"]
    chosen = ", ".join(f"{k}={v}" for k, v in sorted(ucx.items())) or "UCX_TLS unset (UCX picks among all it finds)"
    print(
        f"transport: NIXL backend UCX; B's sidecar runs with {chosen}. The transport UCX picked per transfer is not "
        "reported by NIXL; run both sidecars with UCX_PROTO_INFO=y to have UCX log it."
    )
    return 0 if all(not r.error for r in results) else 1
