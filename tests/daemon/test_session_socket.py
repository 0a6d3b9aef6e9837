"""The engine session on the plain Unix socket next to the engine socket (``<socket>.session``,
``sidecar.api.session_socket``): the same session the gRPC Session stream carries (same answers,
same checks), its callers checked by ``SO_PEERCRED`` (a refused one told why, with a log line; an
allowed one acting only on its own engines), a bad frame ending it INVALID_ARGUMENT while the
sidecar serves on, how it ended reaching the client (``SessionAnswers.end``), and a client on a
sidecar without the socket taking the gRPC stream. Real sidecar daemons, real sockets, real
processes of other users."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine_shim.client import SidecarClient, engine_channel, remote
from engine_shim.memory import KvLayout, SharedBuffer, kv_registration
from kvsidecar.engine_auth import TOKEN_KEY
from kvsidecar.session_socket import HEADER, frame, session_socket_for
from kvsidecar.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.daemon.test_engine_auth import SYSTEM_PYTHON, _as_user, _logged
from tests.support.processes import SidecarProcess, stopped, wait_until

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _frames(sock: socket.socket) -> list[engine_pb2.SessionAnswers]:
    """Every frame the sidecar sends up to its last (``end`` set), bounded by the timeout. (Not
    past it: a socket closed with the client's frames unread reports a reset after its data.)"""
    data, messages = b"", []
    while not (messages and messages[-1].HasField("end")):
        if len(data) >= HEADER.size and len(data) >= HEADER.size + HEADER.unpack_from(data)[0]:
            size = HEADER.unpack_from(data)[0]
            messages.append(engine_pb2.SessionAnswers.FromString(data[HEADER.size : HEADER.size + size]))
            data = data[HEADER.size + size :]
            continue
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return messages


def _session(side: SidecarProcess, *payloads: bytes) -> list[engine_pb2.SessionAnswers]:
    """Send ``payloads`` (whole frames) on a new connection, half-close, read to the end."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(str(session_socket_for(side.socket)))
        for payload in payloads:
            sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        return _frames(sock)


def _end(messages: list[engine_pb2.SessionAnswers]) -> tuple[grpc.StatusCode, str]:
    assert messages and messages[-1].HasField("end"), messages
    assert not any(message.HasField("end") for message in messages[:-1])
    return _CODES[messages[-1].end.code], messages[-1].end.message


def _answers(messages: list[engine_pb2.SessionAnswers]) -> dict[int, engine_pb2.SessionAnswer]:
    return {answer.call_id: answer for message in messages for answer in message.answers}


CALLS = [
    engine_pb2.SessionCall(call_id=1, method="GetStatus", request=b"", timeout_seconds=5),
    engine_pb2.SessionCall(call_id=2, method="GetStatus", request=b"\xff\xff\xff", timeout_seconds=5),
    engine_pb2.SessionCall(call_id=3, method="Session", request=b"", timeout_seconds=5),
    engine_pb2.SessionCall(call_id=4, method="NoSuchMethod", request=b"", timeout_seconds=5),
    engine_pb2.SessionCall(call_id=5, method="WatchEvents", request=b"", timeout_seconds=5),
    engine_pb2.SessionCall(
        call_id=6, method="Release", request=engine_pb2.ReleaseRequest(engine_id="E").SerializeToString()
    ),
]


def test_the_socket_carries_the_session_the_grpc_stream_carries(sidecars) -> None:
    side = sidecars("s")
    path = session_socket_for(side.socket)
    assert path.is_socket() and path.stat().st_mode & 0o777 == 0o600  # the engine socket's mode
    with engine_channel(side.socket) as channel:
        stream = engine_pb2_grpc.EngineServiceStub(channel).Session(iter([engine_pb2.SessionCalls(calls=CALLS)]))
        on_grpc = _answers(list(stream))
    messages = _session(
        side, frame(engine_pb2.SessionCalls(calls=CALLS[:3])), frame(engine_pb2.SessionCalls(calls=CALLS[3:]))
    )
    assert messages[0] == engine_pb2.SessionAnswers()  # open
    assert _end(messages) == (grpc.StatusCode.OK, "")  # the client half-closed: answered, then ended
    on_socket = _answers(messages)
    assert sorted(on_socket) == sorted(on_grpc) == [1, 2, 3, 4, 5, 6]
    for call_id in (2, 3, 4, 5, 6):  # the same refusals, with the same messages
        assert (on_socket[call_id].code, on_socket[call_id].message) == (
            on_grpc[call_id].code,
            on_grpc[call_id].message,
        )
        assert on_socket[call_id].code != 0
    status = engine_pb2.GetStatusResponse.FromString(on_socket[1].response)
    assert status.sidecar.sidecar_id == side.sidecar_id
    assert "session_socket" in status.sidecar.versions.features


def test_a_bad_frame_ends_the_session_invalid_argument_and_the_sidecar_serves_on(sidecars) -> None:
    side = sidecars("s", args=["--set", "max_message_bytes=2097152"])
    call = frame(engine_pb2.SessionCalls(calls=CALLS[:1]))
    # Undecodable: the calls before it are answered, then the session ends.
    messages = _session(side, call, HEADER.pack(3) + b"\xff\xff\xff", call)
    code, message = _end(messages)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "SessionCalls: not a valid protobuf message" in message
    assert list(_answers(messages)) == [1]
    line = _logged(side, "session_refused")
    assert "not a valid protobuf message" in line["error"]
    # Over the engine server's max message size (as configured): refused before reading it.
    code, message = _end(_session(side, call, HEADER.pack(2097152 + 1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message == "SessionCalls: a frame of 2097153 bytes, over max_message_bytes (2097152)"
    assert _logged(side, "session_refused", error=message)
    # A frame of exactly the largest size is read.
    big = engine_pb2.SessionCalls(calls=[engine_pb2.SessionCall(call_id=9, method="GetStatus", request=b"")])
    padded = big.calls.add(call_id=10, method="NoSuchMethod")
    padding = 2097152 - big.ByteSize()
    for _ in range(3):  # the field's length prefix grows with it
        padded.request = b"x" * padding
        padding += 2097152 - big.ByteSize()
    assert big.ByteSize() == 2097152
    messages = _session(side, frame(big))
    assert _end(messages)[0] == grpc.StatusCode.OK and sorted(_answers(messages)) == [9, 10]
    # The sidecar serves on: sessions and clients alike.
    with SidecarClient(side.socket, timeout=10) as client:
        assert client.open_session(10) and client.session.transport == "socket"
        assert client.status().sidecar.sidecar_id == side.sidecar_id


def test_a_draining_sidecar_ends_the_session_unavailable_and_removes_the_socket(sidecars) -> None:
    side = sidecars("s", args=["--set", "shutdown_grace_seconds=30"])
    path = session_socket_for(side.socket)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(str(path))
        sock.sendall(frame(engine_pb2.SessionCalls(calls=CALLS[:1])))
        data = b""
        while len(data) < 2 * HEADER.size or len(data) < 2 * HEADER.size + HEADER.unpack_from(data, 4)[0]:
            data += sock.recv(1 << 16)  # the open frame (empty), then the answer
        assert side.terminate(timeout=20) == 0  # well before the grace: the session did not hold it
        tail = _frames(sock)
    messages = [engine_pb2.SessionAnswers(), engine_pb2.SessionAnswers.FromString(data[8:]), *tail]
    assert list(_answers(messages)) == [1]
    assert _end(messages) == (grpc.StatusCode.UNAVAILABLE, "the sidecar is draining for shutdown")
    assert not path.exists() and not side.socket.exists()


def test_a_client_takes_the_grpc_stream_when_the_sidecar_has_no_socket(sidecars) -> None:
    side = sidecars("s")
    session_socket_for(side.socket).unlink()  # as a sidecar from before the socket
    with SidecarClient(side.socket, timeout=10) as client:
        assert client.open_session(10)
        assert client.session.transport == "grpc"
        assert client.status_async().result(10).sidecar.sidecar_id == side.sidecar_id


# A session from a process of another user: the system Python, standard library only. argv: the
# session socket, the frames to send (hex); prints every frame it got back (hex) as JSON.
SESSION_CLIENT = """
import json, socket, struct, sys
frames, data = [], b""
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
    sock.settimeout(20)
    sock.connect(sys.argv[1])
    try:  # a refused caller's connection is closed at once: what it sends goes nowhere
        for payload in sys.argv[2:]:
            sock.sendall(bytes.fromhex(payload))
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    # Up to the last frame: its SessionAnswers has only field 3 (end), so it starts with tag 0x1a.
    while not (frames and frames[-1].startswith("1a")):
        if len(data) >= 4 and len(data) >= 4 + struct.unpack_from(">I", data)[0]:
            (size,) = struct.unpack_from(">I", data)
            frames.append(data[4 : 4 + size].hex())
            data = data[4 + size :]
            continue
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
print(json.dumps(frames))
"""


def _session_as(side: SidecarProcess, uid: int, calls: list[tuple[str, Any]]) -> list[engine_pb2.SessionAnswers]:
    message = engine_pb2.SessionCalls()
    for index, (method, request) in enumerate(calls):
        message.calls.add(call_id=index, method=method, request=request.SerializeToString(), timeout_seconds=10)
    process = subprocess.run([SYSTEM_PYTHON, "-c", SESSION_CLIENT, str(session_socket_for(side.socket)),
                              frame(message).hex()], user=uid, group=uid, extra_groups=[], capture_output=True,
                             text=True, timeout=60, cwd="/", env={})  # fmt: skip
    assert process.returncode == 0, process.stderr
    return [engine_pb2.SessionAnswers.FromString(bytes.fromhex(item)) for item in json.loads(process.stdout)]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as other users")
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 that other users can run")
def test_the_socket_lets_in_only_the_configured_users_each_acting_on_its_own_engines(sidecars, workdir: Path) -> None:
    os.chmod(workdir, 0o711)
    owner, other, stranger = 65533, 65531, 65534
    side = sidecars("s", args=["--set", "engine_socket_mode=0666", "--set", f"engine_allowed_uids={owner},{other}"])
    assert session_socket_for(side.socket).stat().st_mode & 0o777 == 0o666  # the kernel lets all in: the check decides
    layout = KvLayout(num_layers=2, num_blocks=8, block_len=4096)
    hostile = [
        ("Release", engine_pb2.ReleaseRequest(engine_id="eng-a", request_id="r1", reason="hostile")),
        ("SubmitBlocks", engine_pb2.SubmitBlocksRequest(engine_id="eng-a", request_id="r2")),
        ("UnregisterWorker", engine_pb2.UnregisterWorkerRequest(engine_id="eng-a")),
    ]
    with SharedBuffer(layout.total_bytes) as buffer, grpc.insecure_channel(f"unix:{side.socket}") as channel:
        os.chown(buffer.path, owner, owner)
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        tokens = {uid: _as_user(side.socket, uid, uid)[0]["token"] for uid in (owner, other)}
        request = kv_registration("eng-a", common_pb2.ENGINE_ROLE_PRODUCER, layout, [buffer.export()])
        assert stub.RegisterWorker(request, timeout=10, metadata=((TOKEN_KEY, tokens[owner]),)).engine_complete

        # Not allowed: the session is refused before it opens, with the reason and a log line.
        refused = _session_as(side, stranger, [("GetStatus", engine_pb2.GetStatusRequest())])
        assert len(refused) == 1 and not refused[0].answers
        code, message = _end(refused)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert message.startswith(f"uid {stranger} (gid {stranger}) may not use this sidecar")
        assert _logged(side, "engine_peer_refused", uid=stranger, socket="session")["gid"] == stranger

        # Allowed, not the owner: refused on the engine as its unary calls are, same messages.
        unary = []
        for method, call in hostile:
            with pytest.raises(grpc.RpcError) as denied:
                getattr(stub, method)(call, timeout=10, metadata=((TOKEN_KEY, tokens[other]),))
            unary.append((denied.value.code(), denied.value.details()))
        assert {code for code, _ in unary} == {grpc.StatusCode.PERMISSION_DENIED}
        messages = _session_as(side, other, hostile)
        answers = _answers(messages)
        assert [(_CODES[answers[i].code], answers[i].message) for i in range(len(hostile))] == unary
        assert _end(messages)[0] == grpc.StatusCode.OK
        # The owner's session acts on it.
        answers = _answers(_session_as(side, owner, [hostile[0], hostile[2]]))
        assert answers[0].code == answers[1].code == 0
        assert not stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=10,
                                  metadata=((TOKEN_KEY, tokens[owner]),)).engines  # fmt: skip
    shutil.rmtree(workdir / "probe", ignore_errors=True)


def test_a_client_gone_from_the_socket_has_its_calls_cancelled_and_its_worker_dropped(sidecars) -> None:
    p_side, d_side = sidecars("p"), sidecars("d", args=["--set", "peer_call_timeout_seconds=60"])
    layout = KvLayout(num_layers=2, num_blocks=8, block_len=4096)
    with SharedBuffer(layout.total_bytes) as buffer, SidecarClient(d_side.socket, timeout=10) as client:
        client.register_worker(kv_registration("D", common_pb2.ENGINE_ROLE_CONSUMER, layout, [buffer.export()]))
        expect = client.expect_push_request("D", "q", [[1]], remote(p_side.address, "P", "q"), timeout_seconds=60)
        calls = [
            engine_pb2.SessionCall(call_id=1, method="WatchEvents",
                                   request=engine_pb2.WatchEventsRequest(engine_id="D").SerializeToString()),
            engine_pb2.SessionCall(call_id=2, method="ExpectPush", request=expect.SerializeToString(),
                                   timeout_seconds=60),
        ]  # fmt: skip
        with stopped(p_side):  # the ExpectPush waits for P's handshake (up to 60 s)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(20)
                sock.connect(str(session_socket_for(d_side.socket)))
                sock.sendall(frame(engine_pb2.SessionCalls(calls=calls)))
                assert sock.recv(HEADER.size) == HEADER.pack(0)  # open
                (size,) = HEADER.unpack(sock.recv(HEADER.size))
                [group] = engine_pb2.SessionAnswers.FromString(sock.recv(size, socket.MSG_WAITALL)).events
                assert group.call_id == 1 and group.events[0].kind == engine_pb2.WATCH_STARTED
                # All read (a socket closed with data unread is reset, which the sidecar sees anyway).
            # Gone without half-closing (as a process that died): unlike a half-close, which waits
            # for the calls in flight, its ExpectPush is cancelled and its watch detached at once,
            # so the sidecar drops its worker, as for a gRPC Session whose client went.
            wait_until(lambda: not client.status().engines, 10, what="the worker to be dropped")
    assert _logged(d_side, "worker_removed", reason="event stream closed")
    assert not [e for e in d_side.log_events() if e.get("level") == "error"]


def test_a_client_the_socket_refuses_takes_the_grpc_stream(sidecars) -> None:
    side = sidecars("s")
    path = session_socket_for(side.socket)
    # A stand-in on the socket's path that refuses every caller as a sidecar refuses a uid it does
    # not allow (the shim cannot run here as another uid: its venv is not theirs to read).
    path.unlink()
    refusal = frame(engine_pb2.SessionAnswers(end=engine_pb2.SessionEnd(code=7, message="uid 1 may not use this")))
    accepted: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen()

        def refuse() -> None:
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = listener.accept()
                    accepted.append(1)
                    with conn:
                        conn.sendall(refusal)

        threading.Thread(target=refuse, daemon=True).start()
        with SidecarClient(side.socket, timeout=10) as client:
            assert client.open_session(10)
            assert client.session.transport == "grpc"
            assert client.status_async().result(10).sidecar.sidecar_id == side.sidecar_id
        with SidecarClient(side.socket, timeout=10) as client:
            assert client.open_session(10) and client.session.transport == "grpc"
        listener.shutdown(socket.SHUT_RDWR)
    assert len(accepted) == 2  # each client asked once
