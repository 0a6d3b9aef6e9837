"""The peer stream (``PeerService.Stream``): a sidecar's heartbeats, PushReg, TransferFailed and
Release to a peer ride one open stream and end as their unary calls do. Real gRPC throughout: the
real ``PeerClient`` against the real ``PeerServicer`` (its handlers given here, in-process), a peer
from before the stream (a servicer without it), and real daemons for results, errors and mTLS
identity on the stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2, peer_pb2_grpc
from sidecar.api.interceptor import CallInterceptor
from sidecar.api.peer import PeerServicer
from sidecar.config import Settings
from sidecar.errors import DeadlineExceeded, NotFound, PermissionDenied, SidecarError, Unavailable
from sidecar.metrics import SidecarMetrics
from sidecar.peers.client import PeerClient
from sidecar.peers.routes import PeerRoutes
from tests.daemon.test_peer_identity import cluster  # noqa: F401  (the mTLS fixture)

PEER_ID = "peer-sidecar-1"


def _settings(tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "engine_socket": tmp_path / "engine.sock",
        "peer_listen": "127.0.0.1:0",
        "metrics_listen": "off",
        "shm_dirs": [Path("/dev/shm")],
        "peer_call_timeout_seconds": 3.0,
    }
    return Settings(**(values | overrides))


class Handlers:
    """What the peer's routes answer: a heartbeat echoes, a release of "missing" is NOT_FOUND, a
    heartbeat for engine "hang" waits for ``proceed``; every call is counted with its identity."""

    def __init__(self) -> None:
        self.sidecar_id = PEER_ID  # the instance answering
        self.calls: list[tuple[str, str]] = []
        self.entered = asyncio.Event()
        self.proceed = asyncio.Event()

    async def heartbeat(self, request: peer_pb2.HeartbeatRequest, identity: str) -> peer_pb2.HeartbeatResponse:
        self.calls.append(("Heartbeat", identity))
        if request.engine_id == "hang":
            self.entered.set()
            await self.proceed.wait()
        return peer_pb2.HeartbeatResponse(
            sidecar_id=self.sidecar_id, lease_seconds=7.0, engine_generation=request.engine_id
        )

    async def handshake(self, request: peer_pb2.HandshakeRequest) -> peer_pb2.HandshakeResponse:
        self.calls.append(("Handshake", ""))
        return peer_pb2.HandshakeResponse(
            sidecar=common_pb2.SidecarInfo(sidecar_id=self.sidecar_id),
            engine=peer_pb2.EngineDescriptor(engine_id=request.engine_id),
        )

    async def release(self, request: peer_pb2.PeerReleaseRequest, identity: str) -> peer_pb2.PeerReleaseResponse:
        self.calls.append(("Release", identity))
        if request.request_id == "missing":
            raise NotFound(f"no request {request.engine_id}/{request.request_id}")
        if request.request_id == "mine":
            raise PermissionDenied(f"request {request.request_id} belongs to another peer")
        return peer_pb2.PeerReleaseResponse(sidecar_id=PEER_ID, in_flight=True)

    def routes(self) -> PeerRoutes:
        async def unused(*_: Any) -> Any:
            raise AssertionError("not called here")

        return PeerRoutes(
            handshake=self.handshake,
            push_reg=unused,
            heartbeat=self.heartbeat,
            query_cache=unused,
            transfer_failed=unused,
            release=self.release,
            get_digests=unused,
            stage=unused,
            trace=unused,
            local_engine_view=lambda *_: unused(),  # type: ignore[arg-type,return-value]
        )


async def _serve(handlers: Handlers, port: int = 0) -> tuple[grpc.aio.Server, int]:
    interceptor = CallInterceptor(SidecarMetrics())
    server = grpc.aio.server(interceptors=[interceptor])
    peer_pb2_grpc.add_PeerServiceServicer_to_server(PeerServicer(handlers.routes(), interceptor), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


@asynccontextmanager
async def _client(tmp_path: Path, **overrides: Any) -> AsyncIterator[PeerClient]:
    async def restarted(_address: str, _agents: list[str]) -> None:
        return None

    client = PeerClient(
        _settings(tmp_path, **overrides),
        lambda: common_pb2.SidecarInfo(sidecar_id="caller"),
        restarted,
        SidecarMetrics(),
    )
    client.set_self_addresses(["127.0.0.1:1"])
    try:
        yield client
    finally:
        await client.close()


def _heartbeat(engine_id: str = "P") -> peer_pb2.HeartbeatRequest:
    return peer_pb2.HeartbeatRequest(caller_sidecar_id="caller", engine_id=engine_id)


async def _until_streamed(client: PeerClient, address: str, call: Callable[[], Awaitable[Any]]) -> Any:
    """Call until a call rode a stream (the first call to a new channel goes unary: the stream is
    opened only on a connected channel)."""
    for _ in range(50):
        before = client.streams.answered_calls
        result = await call()
        if client.streams.answered_calls > before:
            return result
        await asyncio.sleep(0.05)
    raise AssertionError("no call rode the peer stream")


def test_calls_on_the_stream_end_as_unary_calls(tmp_path: Path) -> None:
    async def run() -> None:
        handlers = Handlers()
        server, port = await _serve(handlers)
        address = f"127.0.0.1:{port}"
        try:
            async with _client(tmp_path) as client:
                streamed = await _until_streamed(client, address, lambda: client.heartbeat(address, _heartbeat("E")))
                async with grpc.aio.insecure_channel(address) as channel:
                    unary = await peer_pb2_grpc.PeerServiceStub(channel).Heartbeat(_heartbeat("E"), timeout=5)
                assert streamed == unary
                assert streamed.engine_generation == "E" and streamed.sidecar_id == PEER_ID

                release = peer_pb2.PeerReleaseRequest(engine_id="P", request_id="r")
                assert (await client.release(address, release)).in_flight
                # A handler's error: the same error type and message as the unary call gives.
                missing = peer_pb2.PeerReleaseRequest(engine_id="P", request_id="missing")
                answered = client.streams.answered_calls
                with pytest.raises(NotFound) as on_stream:
                    await client.release(address, missing)
                assert client.streams.answered_calls == answered + 1  # it rode the stream
                async with grpc.aio.insecure_channel(address) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as on_unary:
                        await peer_pb2_grpc.PeerServiceStub(channel).Release(missing, timeout=5)
                assert on_unary.value.code() == grpc.StatusCode.NOT_FOUND
                assert str(on_stream.value) == f"peer {address}: NOT_FOUND: {on_unary.value.details()}"
                with pytest.raises(SidecarError) as refused:
                    await client.release(address, peer_pb2.PeerReleaseRequest(engine_id="P", request_id="mine"))
                assert refused.value.code == grpc.StatusCode.UNAVAILABLE  # PERMISSION_DENIED maps as unary
                assert "PERMISSION_DENIED: request mine belongs to another peer" in str(refused.value)

                # Calls ready together go in one message, each gets its own answer.
                writes = client.streams.messages_written
                many = await asyncio.gather(*(client.heartbeat(address, _heartbeat(f"e{i}")) for i in range(20)))
                assert [r.engine_generation for r in many] == [f"e{i}" for i in range(20)]
                assert client.streams.messages_written - writes <= 2
                assert client.streams.opened == 1
        finally:
            await server.stop(0)

    asyncio.run(run())


def test_a_call_keeps_its_deadline_on_the_stream(tmp_path: Path) -> None:
    async def run() -> None:
        handlers = Handlers()
        server, port = await _serve(handlers)
        address = f"127.0.0.1:{port}"
        try:
            async with _client(tmp_path, peer_call_timeout_seconds=0.5) as client:
                await _until_streamed(client, address, lambda: client.heartbeat(address, _heartbeat()))
                with pytest.raises(DeadlineExceeded, match="DEADLINE_EXCEEDED"):
                    await client.heartbeat(address, _heartbeat("hang"))
                assert (await client.heartbeat(address, _heartbeat())).lease_seconds == 7.0  # same stream
                assert client.streams.opened == 1
        finally:
            handlers.proceed.set()
            await server.stop(0)

    asyncio.run(run())


def test_a_broken_stream_fails_its_calls_and_the_next_call_reopens_it(tmp_path: Path) -> None:
    async def run() -> None:
        handlers = Handlers()
        server, port = await _serve(handlers)
        address = f"127.0.0.1:{port}"
        async with _client(tmp_path) as client:
            await _until_streamed(client, address, lambda: client.heartbeat(address, _heartbeat()))
            in_flight = asyncio.ensure_future(client.heartbeat(address, _heartbeat("hang")))
            await asyncio.wait_for(handlers.entered.wait(), 5)
            await server.stop(0)  # the peer goes away under the call
            # The same kind of error a unary call in flight gets (what the "peer lost" logic counts).
            with pytest.raises(Unavailable, match="UNAVAILABLE: the peer stream broke"):
                await asyncio.wait_for(in_flight, 5)
            assert client.failures(address) == 1

            handlers = Handlers()
            server, _ = await _serve(handlers, port)  # back on the same address
            try:
                answered = await _until_streamed(client, address, lambda: client.heartbeat(address, _heartbeat()))
                assert answered.lease_seconds == 7.0
                assert client.streams.opened == 2
                assert client.failures(address) == 0
            finally:
                await server.stop(0)

    asyncio.run(run())


def test_a_stream_is_not_reused_once_its_peer_restarted(tmp_path: Path) -> None:
    """The peer's restart is learned elsewhere (it called us with its new instance id) before the
    old stream's connection is seen to break: the stream the old instance answered on is closed
    (its call in flight fails) and the next call opens a new one."""

    async def run() -> None:
        handlers = Handlers()
        server, port = await _serve(handlers)
        address = f"127.0.0.1:{port}"
        try:
            async with _client(tmp_path) as client:
                await client.engine(address, "P", "")  # a handshaken peer (its instance id known)
                await _until_streamed(client, address, lambda: client.heartbeat(address, _heartbeat()))
                assert client.streams.opened == 1
                in_flight = asyncio.ensure_future(client.heartbeat(address, _heartbeat("hang")))
                await asyncio.wait_for(handlers.entered.wait(), 5)
                handlers.sidecar_id = "restarted"
                await client.note_caller(common_pb2.SidecarInfo(address=address, sidecar_id="restarted"))
                with pytest.raises(Unavailable, match="CANCELLED: the peer stream was closed"):
                    await asyncio.wait_for(in_flight, 5)
                assert client.cached_view(address, "P") is None  # forgotten, as before the stream
                answer = await client.heartbeat(address, _heartbeat())
                assert answer.sidecar_id == "restarted"
                assert client.streams.opened == 2
        finally:
            handlers.proceed.set()
            await server.stop(0)

    asyncio.run(run())


class _OlderPeer:
    """A peer from before the stream: its PeerService has no Stream method (gRPC answers
    UNIMPLEMENTED, as a sidecar built from the older peer.proto does)."""

    def __init__(self) -> None:
        self.heartbeats = 0

    async def heartbeat(self, request: Any, context: Any) -> peer_pb2.HeartbeatResponse:
        self.heartbeats += 1
        return peer_pb2.HeartbeatResponse(sidecar_id="old", lease_seconds=3.0)

    async def serve(self) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(
            self.heartbeat,
            request_deserializer=peer_pb2.HeartbeatRequest.FromString,
            response_serializer=peer_pb2.HeartbeatResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("kvsidecar.v1.PeerService", {"Heartbeat": handler})]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port


def test_an_older_peer_gets_unary_calls(tmp_path: Path) -> None:
    async def run() -> None:
        older = _OlderPeer()
        server, port = await older.serve()
        address = f"127.0.0.1:{port}"
        try:
            async with _client(tmp_path) as client:
                for _ in range(4):
                    assert (await client.heartbeat(address, _heartbeat())).lease_seconds == 3.0
                    await asyncio.sleep(0.05)
                assert older.heartbeats == 4  # each call answered once, unary
                assert client.streams.opened == 1  # asked once, not at every call
                assert client.streams.answered_calls == 0
        finally:
            await server.stop(0)

    asyncio.run(run())


def test_a_stream_call_is_answered_as_its_unary_call_by_a_real_sidecar(sidecars) -> None:
    side = sidecars("p")
    requests = [
        ("Release", peer_pb2.PeerReleaseRequest(engine_id="nope", request_id="r", reason="x")),
        ("Heartbeat", peer_pb2.HeartbeatRequest(caller_sidecar_id="c", engine_id="nope")),
        ("PushReg", peer_pb2.PushRegRequest(prefill_engine_id="nope")),
        ("TransferFailed", peer_pb2.TransferFailedRequest()),
    ]
    with grpc.insecure_channel(side.address) as channel:
        stub = peer_pb2_grpc.PeerServiceStub(channel)
        calls = [
            engine_pb2.SessionCall(call_id=i + 1, method=m, request=r.SerializeToString(), timeout_seconds=5)
            for i, (m, r) in enumerate(requests)
        ]
        answers = {}
        for message in stub.Stream(iter([engine_pb2.SessionCalls(calls=calls)]), timeout=10):
            answers.update({a.call_id: a for a in message.answers})
        assert sorted(answers) == [1, 2, 3, 4]
        for i, (method, request) in enumerate(requests):
            answer = answers[i + 1]
            try:
                unary = getattr(stub, method)(request, timeout=5)
            except grpc.RpcError as exc:
                assert (answer.code, answer.message) == (exc.code().value[0], exc.details()), method
            else:
                assert answer.code == 0, (method, answer.message)
                assert type(unary).FromString(answer.response) == unary, method


def test_the_stream_acts_with_its_callers_certificate(cluster) -> None:  # noqa: F811
    p_side, d_side, _producer, consumer, mallory = cluster
    remote = {"address": p_side.address, "engine_id": "P"}
    reply = consumer.command("expect_push", request_id="r-d", blocks=[[20, 21, 22]], remote=remote, transfer_id="t1")
    assert reply["ok"] and reply["registered"], reply
    release = peer_pb2.PeerReleaseRequest(engine_id="P", transfer_id="t1", consumer_request_id="r-d", reason="x")
    with grpc.secure_channel(p_side.address, mallory) as channel:
        stub = peer_pb2_grpc.PeerServiceStub(channel)
        call = engine_pb2.SessionCall(
            call_id=9, method="Release", request=release.SerializeToString(), timeout_seconds=5
        )
        answers = [a for m in stub.Stream(iter([engine_pb2.SessionCalls(calls=[call])]), timeout=10) for a in m.answers]
    assert len(answers) == 1 and answers[0].call_id == 9
    assert answers[0].code == grpc.StatusCode.PERMISSION_DENIED.value[0], answers[0]
    assert "push registration D/r-d belongs to the peer with certificate" in answers[0].message
    assert "mallory.kvsidecar.test" in answers[0].message and "d.kvsidecar.test" in answers[0].message
    # D's PushReg rode D's stream to P (opened after the handshake connected the channel), and P
    # recorded the registration under D's certificate, the stream's.
    opened = [e for e in d_side.log_events() if e.get("event") == "peer_stream_opened"]
    assert [e["peer"] for e in opened] == [p_side.address], opened
