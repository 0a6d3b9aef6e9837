"""The engine session stream (EngineService.Session): a SidecarClient's request calls ride one
stream and are answered as their unary RPCs are (same results, same status codes and messages,
refused without a session token); a stream that breaks fails its calls in flight with the reason
and the client carries on after reconnecting; a call's deadline holds on the stream; a sidecar
without the RPC gets unary calls. The client's tests run on both transports (``session_transport``:
the plain session socket, the gRPC stream). Real sidecar daemons, real gRPC, real sockets."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine_shim.client import ENGINE_RPCS, SidecarClient, engine_channel, remote
from engine_shim.memory import KvLayout, SharedBuffer, kv_registration
from kvsidecar.engine_auth import NO_TOKEN, TOKEN_KEY
from kvsidecar.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.daemon.test_engine_auth import SYSTEM_PYTHON, _as_user
from tests.support.processes import wait_until

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _unary_only(client: SidecarClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on a call that does not ride the session stream fails the test."""

    def refuse(rpc: Any, request: Any) -> Any:
        raise AssertionError(f"{rpc.method} went unary")

    monkeypatch.setattr(client, "_unary", refuse)


def _outcome(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_calls_on_the_session_answer_as_their_unary_rpcs(
    sidecars, session_transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    side = sidecars("s")
    bad_calls = [
        ("SubmitBlocks", engine_pb2.SubmitBlocksRequest(engine_id="", request_id="r")),  # no engine id
        ("SubmitBlocks", engine_pb2.SubmitBlocksRequest(engine_id="E", request_id="r")),  # no such engine
        ("Pull", engine_pb2.PullRequest(engine_id="E", request_id="r", remote=remote("x:1", "P", "r"))),
        ("Release", engine_pb2.ReleaseRequest(engine_id="E", request_id="r")),
        ("KeepAlive", engine_pb2.KeepAliveRequest(engine_id="bad id!", request_id="r")),
    ]
    with engine_channel(side.socket) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        unary = [_outcome(lambda m=m, r=r: getattr(stub, m)(r, timeout=10)) for m, r in bad_calls]
    assert all(code != grpc.StatusCode.OK for code, _ in unary), unary

    with SidecarClient(side.socket, timeout=10) as client:
        assert client.open_session(10)
        assert client.session.transport == session_transport
        _unary_only(client, monkeypatch)
        on_session = [_outcome(lambda m=m, r=r: client.call(ENGINE_RPCS[m], r)) for m, r in bad_calls]
        assert on_session == unary  # same codes, same messages
        # Same results: the status answered over the stream is the sidecar's.
        assert client.status().sidecar.sidecar_id == side.sidecar_id
        # Non-blocking calls ride it too, several in flight at once (batched when ready together).
        answers = [client.status_async() for _ in range(32)]
        assert {f.result(10).sidecar.sidecar_id for f in answers} == {side.sidecar_id}
        released = client.release_async("E", "r")
        with pytest.raises(grpc.RpcError) as refused:
            released.result(10)
        assert (refused.value.code(), refused.value.details()) == unary[3]


def test_the_session_needs_a_token_and_rejects_what_unary_rejects(sidecars) -> None:
    side = sidecars("s")
    call = engine_pb2.SessionCall(call_id=1, method="GetStatus", request=b"", timeout_seconds=5)
    with grpc.insecure_channel(f"unix:{side.socket}") as channel:  # no session token
        stream = engine_pb2_grpc.EngineServiceStub(channel).Session(iter([engine_pb2.SessionCalls(calls=[call])]))
        with pytest.raises(grpc.RpcError) as refused:
            list(stream)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED and NO_TOKEN in refused.value.details()

    calls = [
        call,
        engine_pb2.SessionCall(call_id=2, method="GetStatus", request=b"\xff\xff\xff", timeout_seconds=5),
        engine_pb2.SessionCall(call_id=3, method="Session", request=b"", timeout_seconds=5),
        engine_pb2.SessionCall(call_id=4, method="NoSuchMethod", request=b"", timeout_seconds=5),
        engine_pb2.SessionCall(call_id=5, method="WatchEvents", request=b"", timeout_seconds=5),
    ]
    with engine_channel(side.socket) as channel:
        stream = engine_pb2_grpc.EngineServiceStub(channel).Session(iter([engine_pb2.SessionCalls(calls=calls)]))
        answers = {answer.call_id: answer for message in stream for answer in message.answers}
        with pytest.raises(grpc.RpcError) as garbage:
            channel.unary_unary("/kvsidecar.v1.EngineService/GetStatus")(b"\xff\xff\xff", timeout=10)
        with pytest.raises(grpc.RpcError) as no_engine:
            list(engine_pb2_grpc.EngineServiceStub(channel).WatchEvents(engine_pb2.WatchEventsRequest(), timeout=10))
    assert answers[1].code == 0
    assert engine_pb2.GetStatusResponse.FromString(answers[1].response).sidecar.sidecar_id == side.sidecar_id
    # An undecodable request: INVALID_ARGUMENT with the same message a unary call gets.
    assert (answers[2].code, answers[2].message) == (garbage.value.code().value[0], garbage.value.details())
    assert answers[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # Unknown methods and streaming ones other than WatchEvents are not callable on the session.
    assert answers[3].code == answers[4].code == grpc.StatusCode.UNIMPLEMENTED.value[0]
    # WatchEvents is (tests/daemon/test_session_events.py), refused as the RPC refuses it.
    assert (answers[5].code, answers[5].message) == (no_engine.value.code().value[0], no_engine.value.details())


def test_a_broken_session_fails_its_calls_in_flight_and_the_next_calls_work(sidecars, session_transport: str) -> None:
    side = sidecars("s")
    with SidecarClient(side.socket, timeout=10) as client:
        assert client.open_session(10)
        assert client.session.transport == session_transport
        os.kill(side.process.pid, signal.SIGSTOP)  # the call below stays in flight
        try:
            in_flight = client.status_async()
            assert not in_flight.done()
            side.kill()  # the stream breaks under it
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(side.process.pid, signal.SIGCONT)
        with pytest.raises(grpc.RpcError) as broken:
            in_flight.result(10)
        assert broken.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine session stream broke" in broken.value.details()

        side.start()  # a new instance: the client's token is stale, its stream reopens with a new one
        client.wait_ready(10)
        assert client.status().sidecar.sidecar_id == side.sidecar_id  # unary while reconnecting, or not
        assert wait_until(lambda: client.open_session(1), 10, what="the session to reopen")
        assert client.session.transport == session_transport
        assert client.session.start("GetStatus", engine_pb2.GetStatusRequest(), engine_pb2.GetStatusResponse, 10)
        assert client.status().sidecar.sidecar_id == side.sidecar_id


def test_a_call_deadline_holds_on_the_session(sidecars, session_transport: str) -> None:
    side = sidecars("s")
    with SidecarClient(side.socket, timeout=1.0) as client:
        assert client.open_session(10)
        assert client.session.transport == session_transport
        os.kill(side.process.pid, signal.SIGSTOP)  # never answers
        try:
            with pytest.raises(grpc.RpcError) as late:
                client.status()
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            pending = client.status_async()
            with pytest.raises(grpc.RpcError) as late_async:
                pending.result(5)  # failed by the client's own deadline, not this bound
            assert late_async.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            os.kill(side.process.pid, signal.SIGCONT)
        assert client.status().sidecar.sidecar_id == side.sidecar_id  # the stream itself is fine
        assert client.session.transport == session_transport


class _OlderSidecar(engine_pb2_grpc.EngineServiceServicer):
    """The EngineService of a sidecar from before the session stream: its unary RPCs only (the
    generated base class answers Session UNIMPLEMENTED, as such a sidecar's server does)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def GetStatus(self, request: engine_pb2.GetStatusRequest, context: grpc.ServicerContext) -> Any:
        self.calls.append("GetStatus")
        return engine_pb2.GetStatusResponse(sidecar=common_pb2.SidecarInfo(sidecar_id="older"))

    def Session(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
        self.calls.append("Session")
        return super().Session(request_iterator, context)


@pytest.fixture
def older_sidecar(workdir: Path) -> Iterator[tuple[Path, _OlderSidecar]]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    servicer = _OlderSidecar()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
    socket_path = workdir / "older.sock"
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    yield socket_path, servicer
    server.stop(None).wait(5)


def test_an_older_sidecar_without_the_session_gets_unary_calls(older_sidecar) -> None:
    socket_path, servicer = older_sidecar
    with SidecarClient(socket_path, timeout=5) as client:
        assert not client.open_session(5)
        assert [client.status().sidecar.sidecar_id for _ in range(5)] == ["older"] * 5
        assert client.status_async().result(5).sidecar.sidecar_id == "older"
    # One attempt to open the stream, then unary calls only (not one attempt per call).
    assert servicer.calls.count("Session") == 1
    assert servicer.calls.count("GetStatus") == 6


def test_closing_a_client_from_a_session_answer_callback_does_not_hang(sidecars, session_transport: str) -> None:
    side = sidecars("s")
    client = SidecarClient(side.socket, timeout=5)
    assert client.open_session(10)
    assert client.session.transport == session_transport
    closed = threading.Event()

    def close(_: Any) -> None:
        client.close()  # on the session's reader thread, as a vLLM shim's done callback may
        closed.set()

    client.status_async().add_done_callback(close)
    assert closed.wait(10)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as other users")
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 that other users can run")
def test_a_session_acts_only_on_its_users_engines_as_unary_calls_do(sidecars, workdir: Path) -> None:
    os.chmod(workdir, 0o711)
    owner, other = 65533, 65531
    side = sidecars("s", args=["--set", "engine_socket_mode=0666", "--set", f"engine_allowed_uids={owner},{other}"])
    tokens = {uid: _as_user(side.socket, uid, uid)[0]["token"] for uid in (owner, other)}
    layout = KvLayout(num_layers=2, num_blocks=8, block_len=4096)
    hostile = [
        ("Release", engine_pb2.ReleaseRequest(engine_id="eng-a", request_id="r1", reason="hostile")),
        ("SubmitBlocks", engine_pb2.SubmitBlocksRequest(engine_id="eng-a", request_id="r2")),
        ("UnregisterWorker", engine_pb2.UnregisterWorkerRequest(engine_id="eng-a")),
    ]

    def session(uid: int, calls: list[tuple[str, Any]]) -> list[engine_pb2.SessionAnswer]:
        message = engine_pb2.SessionCalls()
        for index, (method, request) in enumerate(calls):
            message.calls.add(call_id=index, method=method, request=request.SerializeToString(), timeout_seconds=10)
        stream = engine_pb2_grpc.EngineServiceStub(channel).Session(
            iter([message]), metadata=((TOKEN_KEY, tokens[uid]),)
        )
        answers = {answer.call_id: answer for reply in stream for answer in reply.answers}
        return [answers[index] for index in range(len(calls))]

    with SharedBuffer(layout.total_bytes) as buffer, grpc.insecure_channel(f"unix:{side.socket}") as channel:
        os.chown(buffer.path, owner, owner)
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        request = kv_registration("eng-a", common_pb2.ENGINE_ROLE_PRODUCER, layout, [buffer.export()])
        assert stub.RegisterWorker(request, timeout=10, metadata=((TOKEN_KEY, tokens[owner]),)).engine_complete
        unary = [
            _outcome(lambda m=m, r=r: getattr(stub, m)(r, timeout=10, metadata=((TOKEN_KEY, tokens[other]),)))
            for m, r in hostile
        ]
        assert {code for code, _ in unary} == {grpc.StatusCode.PERMISSION_DENIED}
        on_session = [(_CODES[answer.code], answer.message) for answer in session(other, hostile)]
        assert on_session == unary  # refused, with the same messages
        # The owner's session acts on it.
        released, unregistered = session(owner, [hostile[0], hostile[2]])
        assert released.code == unregistered.code == 0
        assert not stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=10,
                                  metadata=((TOKEN_KEY, tokens[owner]),)).engines  # fmt: skip


def test_an_open_session_does_not_hold_the_sidecars_shutdown(sidecars, session_transport: str) -> None:
    side = sidecars("s", args=["--set", "shutdown_grace_seconds=60"])
    with SidecarClient(side.socket, timeout=10) as client:
        assert client.open_session(10)
        assert client.session.transport == session_transport
        assert client.status().sidecar.sidecar_id == side.sidecar_id
        # The server gives open calls the rest of the grace (60 s) to end: the sidecar ends the
        # session itself when it drains, so it stops well before that.
        assert side.terminate(timeout=30) == 0
        wait_until(lambda: not client.session.opened.is_set(), 5, what="the client to see its session end")
