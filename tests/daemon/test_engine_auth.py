"""The engine socket accepts only the configured users (kvsidecar.engine_auth): a caller's uid and
gid are read by the kernel (SO_PEERCRED) on the credential socket next to the engine socket, which
hands allowed callers a session token; every engine-socket call without a valid token (none, or
one from a previous instance of the daemon) is PERMISSION_DENIED with a log line. Real sidecars,
real clients in processes of other uids."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_shim.client import SidecarClient, engine_channel
from engine_shim.memory import KvLayout, SharedBuffer, kv_registration
from kvsidecar.engine_auth import NO_TOKEN, TOKEN_KEY, auth_socket_for, request_token
from kvsidecar.v1 import common_pb2, engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc
from tests.support.processes import REPO, wait_until


def _status(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> engine_pb2.GetStatusResponse:
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    response: engine_pb2.GetStatusResponse = stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=10,
                                                            metadata=metadata)  # fmt: skip
    return response


def _logged(sidecar, event: str, **fields: object) -> dict:
    def found():
        return next(
            (e for e in sidecar.log_events()
             if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())), None,
        )  # fmt: skip

    return wait_until(found, 5, what=f"{event} {fields} log line")


def test_a_call_without_a_token_is_refused_and_health_needs_none(sidecars) -> None:
    side = sidecars("s")
    assert auth_socket_for(side.socket).stat().st_mode & 0o777 == 0o600  # the engine socket's mode
    # The credential socket is up before the engine socket: a client that finds one finds both
    # (the launcher's readiness call was not refused).
    assert not [e for e in side.log_events() if e.get("event") == "engine_call_refused"]
    with grpc.insecure_channel(f"unix:{side.socket}") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _status(channel)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert NO_TOKEN in refused.value.details() and "none sent" in refused.value.details()
        assert str(auth_socket_for(side.socket)) in refused.value.details()  # says where to get one
        # Probes and `grpcurl list` need no token.
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    _logged(side, "engine_call_refused", method="kvsidecar.v1.EngineService/GetStatus", token="none sent")
    with engine_channel(side.socket) as channel:
        assert _status(channel).sidecar.sidecar_id == side.sidecar_id


def test_a_token_from_a_previous_instance_is_refused_and_clients_get_a_new_one(sidecars) -> None:
    side = sidecars("s")
    old = request_token(auth_socket_for(side.socket))
    with grpc.insecure_channel(f"unix:{side.socket}") as channel:
        assert _status(channel, ((TOKEN_KEY, old),)).sidecar.sidecar_id == side.sidecar_id
    with SidecarClient(side.socket, timeout=10) as client:
        assert client.status().sidecar.sidecar_id == side.sidecar_id
        side.restart()
        with grpc.insecure_channel(f"unix:{side.socket}") as channel, pytest.raises(grpc.RpcError) as refused:
            _status(channel, ((TOKEN_KEY, old),))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert NO_TOKEN in refused.value.details() and "not issued by this instance" in refused.value.details()
        _logged(side, "engine_call_refused", claimed_uid=str(os.getuid()))
        # A client that lived through the restart asks for a new token and carries on.
        client.wait_ready(10)
        assert client.status().sidecar.sidecar_id == side.sidecar_id


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
# The credential handshake from a process of another user (the system Python: the venv's
# interpreter lives where other users cannot read it; the handshake needs only the standard library).
PROBE = """
import json, sys
from kvsidecar.engine_auth import auth_socket_for, request_token
try:
    print(json.dumps({"token": request_token(auth_socket_for(sys.argv[1]))}))
except OSError as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""


def _as_user(socket: Path, uid: int, gid: int) -> tuple[dict[str, str], int]:
    # The handshake module, copied where any user can read it: the checkout itself may sit under a
    # directory other users cannot enter (a CI clone under /root).
    probe_path = socket.parent / "probe"
    if not (probe_path / "kvsidecar" / "engine_auth.py").exists():
        (probe_path / "kvsidecar").mkdir(parents=True)
        (probe_path / "kvsidecar" / "__init__.py").write_text("")
        shutil.copy(REPO / "kvsidecar" / "engine_auth.py", probe_path / "kvsidecar" / "engine_auth.py")
        for path in (probe_path, probe_path / "kvsidecar", *probe_path.rglob("*")):
            path.chmod(0o755)
    process = subprocess.Popen([SYSTEM_PYTHON, "-c", PROBE, str(socket)], user=uid, group=gid, extra_groups=[],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={"PYTHONPATH": str(probe_path)}, cwd="/")  # fmt: skip
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    return json.loads(out), process.pid


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as other users")
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 that other users can run")
def test_only_the_configured_users_get_in(sidecars, workdir: Path) -> None:
    os.chmod(workdir, 0o711)  # the sockets' directory: others may reach the files
    side = sidecars("s", args=["--set", "engine_socket_mode=0666", "--set", "engine_allowed_uids=65533",
                               "--set", "engine_allowed_gids=65532"])  # fmt: skip
    assert side.socket.stat().st_mode & 0o777 == 0o666  # the kernel lets everyone connect: the check decides
    assert auth_socket_for(side.socket).stat().st_mode & 0o777 == 0o666

    with grpc.insecure_channel(f"unix:{side.socket}") as channel:
        # Allowed by uid, and by gid: their tokens open the engine socket.
        for uid, gid in ((65533, 65533), (65531, 65532)):
            reply, _ = _as_user(side.socket, uid, gid)
            assert "token" in reply, (uid, gid, reply)
            assert _status(channel, ((TOKEN_KEY, reply["token"]),)).sidecar.sidecar_id == side.sidecar_id
        # Anyone else gets no token, the reason, and a log line naming them; without a token every
        # call of theirs is PERMISSION_DENIED.
        refused, pid = _as_user(side.socket, 65534, 65534)
        assert refused["error"].startswith("PermissionError"), refused
        assert "uid 65534 (gid 65534) may not use this sidecar" in refused["error"]
        line = _logged(side, "engine_peer_refused", uid=65534)
        assert line["gid"] == 65534 and line["pid"] == pid
        with pytest.raises(grpc.RpcError) as denied:
            _status(channel)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # The daemon's own user (root here) is always allowed.
    with engine_channel(side.socket) as channel:
        assert _status(channel).sidecar.sidecar_id == side.sidecar_id


def _refused(call, *args, **kwargs) -> str:
    with pytest.raises(grpc.RpcError) as refused:
        call(*args, **kwargs)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
    return refused.value.details()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as other users")
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 that other users can run")
def test_a_user_acts_only_on_its_own_engines_and_files(sidecars, workdir: Path) -> None:
    """The daemon (root here) opens files and acts on engines its callers may not: an allowed user
    registers only shared memory it owns, and no other user may act on the engine it registered."""
    os.chmod(workdir, 0o711)
    owner, other = 65533, 65531
    side = sidecars("s", args=["--set", "engine_socket_mode=0666", "--set", f"engine_allowed_uids={owner},{other}"])
    tokens = {uid: _as_user(side.socket, uid, uid)[0]["token"] for uid in (owner, other)}

    def as_user(uid: int) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_KEY, tokens[uid]),)

    layout = KvLayout(num_layers=2, num_blocks=8, block_len=4096)
    with SharedBuffer(layout.total_bytes) as buffer, grpc.insecure_channel(f"unix:{side.socket}") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        request = kv_registration("eng-a", common_pb2.ENGINE_ROLE_PRODUCER, layout, [buffer.export()])
        # The file is root's (this process made it): the daemon could open it, the caller could not.
        why = _refused(stub.RegisterWorker, request, timeout=10, metadata=as_user(owner))
        assert f"{buffer.path} belongs to uid 0, not to the caller (uid {owner})" in why
        assert not _status(channel, as_user(owner)).engines

        os.chown(buffer.path, owner, owner)
        assert stub.RegisterWorker(request, timeout=10, metadata=as_user(owner)).engine_complete
        # Another allowed user may not add a worker to it, release its requests, or unregister it.
        os.chown(buffer.path, other, other)  # even with a file of its own
        for method, message in (
            (stub.RegisterWorker, request),
            (stub.Release, engine_pb2.ReleaseRequest(engine_id="eng-a", request_id="r1", reason="hostile")),
            (stub.UnregisterWorker, engine_pb2.UnregisterWorkerRequest(engine_id="eng-a")),
            (stub.SubmitBlocks, engine_pb2.SubmitBlocksRequest(engine_id="eng-a", request_id="r2")),
        ):
            why = _refused(method, message, timeout=10, metadata=as_user(other))
            assert f"engine 'eng-a' belongs to uid {owner}; uid {other} may act only on its own engines" in why
        line = _logged(side, "engine_owner_refused", method="UnregisterWorker", uid=other)
        assert line["owner_uid"] == owner and line["engine_id"] == "eng-a"
        status = _status(channel, as_user(owner))
        assert [engine.engine_id for engine in status.engines] == ["eng-a"]  # still registered, untouched
        # Nor may it act as a peer here (PeerService on the engine socket is for debugging by root).
        peer = peer_pb2_grpc.PeerServiceStub(channel)
        release_as_peer = peer_pb2.PeerReleaseRequest(engine_id="eng-a", request_id="r1", reason="hostile")
        why = _refused(peer.Release, release_as_peer, timeout=10, metadata=as_user(other))
        assert f"PeerService on the engine socket is for the daemon's uid and root (debugging); uid {other}" in why
        with engine_channel(side.socket) as root:
            assert peer_pb2_grpc.PeerServiceStub(root).Release(release_as_peer, timeout=10)  # not found, not refused

        # Its owner acts on it; so does root (the daemon's uid), which can read every engine anyway.
        release = engine_pb2.ReleaseRequest(engine_id="eng-a", request_id="r1", reason="test")
        stub.Release(release, timeout=10, metadata=as_user(owner))
        with SidecarClient(side.socket, timeout=10) as client:
            client.stub.Release(release, timeout=10)
        stub.UnregisterWorker(
            engine_pb2.UnregisterWorkerRequest(engine_id="eng-a"), timeout=10, metadata=as_user(owner)
        )
        assert not _status(channel, as_user(owner)).engines
        # Once gone, the engine id is free: the other user may register it with its own file.
        assert stub.RegisterWorker(request, timeout=10, metadata=as_user(other)).engine_complete
        stub.UnregisterWorker(
            engine_pb2.UnregisterWorkerRequest(engine_id="eng-a"), timeout=10, metadata=as_user(other)
        )
