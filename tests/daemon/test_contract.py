"""The public contract: generated stubs are fresh, every field is documented, and a real grpcurl
sees the services, the RPCs of DESIGN section 4 and the health service over TCP and the socket."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest

from engine_shim.client import engine_channel
from kvsidecar.engine_auth import TOKEN_KEY, auth_socket_for, request_token
from tests.support.processes import REPO

PROTO_DIR = REPO / "proto"
GRPCURL = str(Path(sys.executable).parent / "grpcurl")

ENGINE_RPCS = [
    "RegisterWorker",
    "UnregisterWorker",
    "SubmitBlocks",
    "ExpectPush",
    "KeepAlive",
    "Pull",
    "HoldBlocks",
    "QueryCache",
    "Release",
    "WatchEvents",
    "GetStatus",
    "Trace",
]
PEER_RPCS = ["Handshake", "PushReg", "Heartbeat", "QueryCache", "TransferFailed", "Release", "Trace"]


def grpcurl(*args: str, timeout: float = 15.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GRPCURL, *args], capture_output=True, text=True, timeout=timeout)


def test_generated_code_is_fresh() -> None:
    with tempfile.TemporaryDirectory() as out:
        protos = sorted(str(path) for path in (PROTO_DIR / "kvsidecar" / "v1").glob("*.proto"))
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                "-I",
                str(PROTO_DIR),
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                *protos,
            ],
            check=True,
        )
        for generated in sorted((Path(out) / "kvsidecar" / "v1").iterdir()):
            committed = REPO / "kvsidecar" / "v1" / generated.name
            assert committed.exists(), f"{committed} is missing: run `make proto`"
            assert committed.read_text() == generated.read_text(), f"{committed} is stale: run `make proto`"


def test_every_field_rpc_and_enum_value_is_documented() -> None:
    declaration = re.compile(
        r"^\s*(?:(?:repeated|optional)\s+)?(?:map<[^>]+>|[\w.]+)\s+\w+\s*=\s*\d+;|^\s*rpc\s+\w+|^\s*[A-Z][A-Z0-9_]*\s*=\s*\d+;"
    )
    undocumented = []
    for path in sorted((PROTO_DIR / "kvsidecar" / "v1").glob("*.proto")):
        previous = ""
        for number, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            if declaration.match(line) and not previous.startswith("//"):
                undocumented.append(f"{path.name}:{number}: {stripped}")
            if stripped:
                previous = stripped
    assert not undocumented, "undocumented declarations:\n" + "\n".join(undocumented)


def test_grpcurl_lists_describes_and_checks_health(sidecars) -> None:
    sidecar = sidecars()
    over_socket = grpcurl("-plaintext", "-unix", str(sidecar.socket), "list")
    assert over_socket.returncode == 0, over_socket.stderr
    for service in ("kvsidecar.v1.EngineService", "kvsidecar.v1.PeerService", "grpc.health.v1.Health"):
        assert service in over_socket.stdout.split()
    over_tcp = grpcurl("-plaintext", sidecar.address, "list")
    assert over_tcp.returncode == 0, over_tcp.stderr
    assert "kvsidecar.v1.PeerService" in over_tcp.stdout.split()
    assert "grpc.health.v1.Health" in over_tcp.stdout.split()
    assert "kvsidecar.v1.EngineService" not in over_tcp.stdout.split(), "the engine API must stay local"

    engine = grpcurl("-plaintext", "-unix", str(sidecar.socket), "describe", "kvsidecar.v1.EngineService")
    assert engine.returncode == 0, engine.stderr
    for rpc in ENGINE_RPCS:
        assert re.search(rf"rpc {rpc} \(", engine.stdout), f"EngineService.{rpc} missing:\n{engine.stdout}"
    peer = grpcurl("-plaintext", sidecar.address, "describe", "kvsidecar.v1.PeerService")
    assert peer.returncode == 0, peer.stderr
    for rpc in PEER_RPCS:
        assert re.search(rf"rpc {rpc} \(", peer.stdout), f"PeerService.{rpc} missing:\n{peer.stdout}"
    message = grpcurl("-plaintext", "-unix", str(sidecar.socket), "describe", "kvsidecar.v1.RegisterWorkerRequest")
    assert "compat_factors" in message.stdout

    for target in (["-unix", str(sidecar.socket)], [sidecar.address]):
        health = grpcurl("-plaintext", "-d", '{"service": ""}', *target, "grpc.health.v1.Health/Check")
        assert health.returncode == 0, health.stderr
        assert '"status": "SERVING"' in health.stdout


ENGINE_EMPTY = {
    "RegisterWorker": "engine_id",
    "UnregisterWorker": "engine_id",
    "SubmitBlocks": "engine_id",
    "ExpectPush": "engine_id",
    "Pull": "engine_id",
    "HoldBlocks": "engine_id",
    "QueryCache": "engine_id",
    "Release": "engine_id",
    "WatchEvents": "engine_id",
    "KeepAlive": "engine_id",
    "Trace": "request_id",
}
PEER_EMPTY = {
    "Handshake": "engine_id",
    "PushReg": "prefill_engine_id",
    "Heartbeat": "engine_id",
    "QueryCache": "conversation_id",
    "TransferFailed": "engine_id",
    "Release": "engine_id",
    "Trace": "request_id",
}

MALFORMED = [
    (
        "EngineService/RegisterWorker",
        '{"engine_id": "e", "role": "ENGINE_ROLE_PRODUCER", "tp_size": 1, "tp_rank": 3}',
        "tp_rank",
    ),
    (
        "EngineService/RegisterWorker",
        '{"engine_id": "e", "role": "ENGINE_ROLE_PRODUCER", "tp_size": 1,'
        ' "geometry": {"block_size": 16, "num_blocks": 8},'
        ' "exports": [{"kind": "MEMORY_KIND_DRAM", "shm_path": "/etc/passwd", "length": 4096}],'
        ' "regions": [{"name": "l0", "block_len": 1024}]}',
        "regions[0]",
    ),
    (
        "EngineService/RegisterWorker",
        '{"engine_id": "has space", "role": "ENGINE_ROLE_PRODUCER", "tp_size": 1}',
        "engine_id",
    ),
    (
        "EngineService/SubmitBlocks",
        '{"engine_id": "e", "request_id": "r", "lease_seconds": -1, "block_ids": {"groups": [{"ids": [1]}]}}',
        "lease_seconds",
    ),
    (
        "EngineService/Pull",
        '{"engine_id": "e", "request_id": "r", "local_block_ids": {"groups": [{"ids": [1]}]},'
        ' "remote": {"engine_id": "p", "address": "nohostport"}}',
        "remote.address",
    ),
    (
        "PeerService/PushReg",
        '{"prefill_engine_id": "p", "decode_engine_id": "d", "request_id": "r",'
        ' "block_ids": {"groups": [{"ids": [1]}]}}',
        "caller.address",
    ),
    ("PeerService/Heartbeat", '{"engine_id": "p", "requests": [{}]}', "requests[0]"),
]


def test_empty_and_malformed_requests_are_invalid_argument_and_the_daemon_keeps_serving(sidecars) -> None:
    sidecar = sidecars()
    # A session token from the credential socket, as README says to call by hand.
    token = request_token(auth_socket_for(sidecar.socket))
    target = ["-plaintext", "-H", f"{TOKEN_KEY}: {token}", "-unix", str(sidecar.socket)]
    cases = [(f"EngineService/{rpc}", "{}", field) for rpc, field in ENGINE_EMPTY.items()]
    cases += [(f"PeerService/{rpc}", "{}", field) for rpc, field in PEER_EMPTY.items()]
    cases += MALFORMED
    for method, body, field in cases:
        result = grpcurl("-d", body, *target, f"kvsidecar.v1.{method}")
        assert result.returncode != 0, f"{method} accepted {body}"
        assert "Code: InvalidArgument" in result.stderr, f"{method} {body}: {result.stderr}"
        assert field in result.stderr, f"{method}: message does not name {field}: {result.stderr}"
    # Bytes that are not a protobuf message at all.
    with engine_channel(sidecar.socket) as channel:
        raw = channel.unary_unary("/kvsidecar.v1.EngineService/SubmitBlocks")
        with pytest.raises(grpc.RpcError) as error:
            raw(b"\xff\xff\xff\x07", timeout=5)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Stray bytes on the peer port (a port scanner, a confused client) do not hurt it.
    import socket

    host, port = sidecar.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as stray:
        stray.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)))
    health = grpcurl("-plaintext", "-d", "{}", *target, "grpc.health.v1.Health/Check")
    assert '"status": "SERVING"' in health.stdout
    status = grpcurl("-d", "{}", *target, "kvsidecar.v1.EngineService/GetStatus")
    assert status.returncode == 0, status.stderr
    assert sidecar.process is not None and sidecar.process.poll() is None


def test_push_reg_for_an_unknown_engine_is_not_found_and_duplicates_are_idempotent(sidecars, engines) -> None:
    from kvsidecar.v1 import common_pb2, peer_pb2, peer_pb2_grpc

    sidecar = sidecars()
    engines(sidecar, "P", "producer")
    request = peer_pb2.PushRegRequest(
        caller=common_pb2.SidecarInfo(sidecar_id="someone", address="127.0.0.1:9"),
        prefill_engine_id="nope",
        decode_engine_id="D",
        request_id="r-1",
        transfer_id="t-1",
        block_ids=common_pb2.GroupedBlockIds(groups=[common_pb2.BlockIdList(ids=[1, 2])]),
    )
    with grpc.insecure_channel(sidecar.address) as channel:
        stub = peer_pb2_grpc.PeerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.PushReg(request, timeout=5)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in error.value.details()
        request.prefill_engine_id = "P"
        first = stub.PushReg(request, timeout=5)
        second = stub.PushReg(request, timeout=5)
        assert not first.matched and not second.matched
        assert first.sidecar_id == second.sidecar_id == sidecar.sidecar_id
    from engine_shim.client import SidecarClient

    with SidecarClient(sidecar.socket) as client:
        assert client.status().pending_push_registrations == 1
