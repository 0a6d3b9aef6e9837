"""`kvsidecar selftest --peer`: an operator proves two nodes from one (here two sidecars on one
host; across network namespaces in tests/multihost/test_selftest_multihost.py). Every case moves
KV both ways, verified token by token; each way it can fail names the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import psutil
import pytest

from engine_shim.client import SidecarClient
from kvsidecar.v1 import selftest_pb2, selftest_pb2_grpc
from tests.support.pki import make_pki, tls_args
from tests.support.processes import SidecarProcess, python_env, wait_until

CASES = [("pull", "B->A"), ("pull", "A->B"), ("push", "B->A"), ("push", "A->B")]


def selftest(
    a: SidecarProcess, peer: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar.app.cli", "selftest", "--peer", peer, "--socket", str(a.socket),
         "--requests", "2", "--blocks", "4", "--block-kib", "64", *extra],
        capture_output=True, text=True, timeout=240, env=python_env(env),
    )  # fmt: skip


def _engines(side: SidecarProcess) -> list[str]:
    with SidecarClient(side.socket, timeout=10.0) as client:
        return [engine.engine_id for engine in client.status().engines]


def _orphaned_shm_files() -> set[str]:
    """Shared-memory files whose creator is dead (another run's live processes have theirs)."""
    return {
        name for name in os.listdir("/dev/shm")
        if name.startswith("kvsidecar-") and not psutil.pid_exists(int(name.split("-")[1]))
    }  # fmt: skip


def test_selftest_moves_verified_kv_both_ways_and_removes_its_engines(sidecars) -> None:
    a, b = sidecars("a"), sidecars("b")
    before = _orphaned_shm_files()
    result = selftest(a, b.address)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for mode, direction in CASES:
        [line] = [row for row in out.splitlines() if row.split()[:2] == [mode, direction]]
        cells = line.split()
        assert cells[2] == "2" and float(cells[3]) > 0 and "every token verified" in line, line
    assert "peer: kvsidecar 0.1.0" in out and "transport: NIXL backend UCX" in out
    # Both test engines are gone, with their memory.
    assert _engines(a) == [] and _engines(b) == []
    assert _orphaned_shm_files() <= before
    events = [json.loads(line) for line in b.log_path.read_text().splitlines() if line.startswith("{")]
    assert {"selftest_engine_started", "selftest_engine_stopped"} <= {e.get("event") for e in events}


def test_an_unreachable_peer_is_named(sidecars) -> None:
    a = sidecars("a")
    result = selftest(a, "127.0.0.1:1")
    assert result.returncode == 1
    assert "FAILED: 127.0.0.1:1 unreachable" in result.stdout and "Connection refused" in result.stdout


def test_an_older_peer_without_the_self_test_is_named(sidecars) -> None:
    a = sidecars("a")
    server = grpc.server(futures.ThreadPoolExecutor(2))  # serves nothing: every RPC UNIMPLEMENTED
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        result = selftest(a, f"127.0.0.1:{port}")
    finally:
        server.stop(None)
    assert result.returncode == 1
    assert "has no self-test service: it is older than this kvsidecar" in result.stdout


def test_tls_refused_is_named(sidecars, workdir: Path) -> None:
    cert, key, ca = make_pki(workdir, "cluster")
    b = sidecars("b", args=tls_args(cert, key, ca))
    a = sidecars("a", args=tls_args(cert, key, ca))
    result = selftest(a, b.address)  # the command without this node's certificate: B refuses it
    assert result.returncode == 1 and "FAILED:" in result.stdout
    assert "closed the connection: it may require mTLS" in result.stdout, result.stdout
    # With this node's certificate (from its settings) the same peer passes.
    result = selftest(a, b.address, env={"KVSIDECAR_PEER_TLS_CERT": str(cert), "KVSIDECAR_PEER_TLS_KEY": str(key),
                                         "KVSIDECAR_PEER_TLS_CA": str(ca)})  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_memory_the_peer_cannot_register_is_named(sidecars) -> None:
    a = sidecars("a")
    b = sidecars("b", args=["--set", "shm_dirs=/tmp"])  # B maps shared memory only from /tmp
    result = selftest(a, b.address)
    assert result.returncode == 1
    assert "the test engine could not start on this sidecar" in result.stdout and "/dev/shm" in result.stdout
    assert _engines(b) == []


def test_the_host_is_bounded(sidecars) -> None:
    b = sidecars("b")
    with grpc.insecure_channel(b.address) as channel:
        stub = selftest_pb2_grpc.SelfTestServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.OpenTestEngine(
                selftest_pb2.OpenTestEngineRequest(layers=64, blocks=4096, block_len=1 << 20), timeout=10
            )
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "MiB" in (error.value.details() or "")
        opened = stub.OpenTestEngine(selftest_pb2.OpenTestEngineRequest(blocks=8, block_len=4096), timeout=60)
        try:
            with pytest.raises(grpc.RpcError) as error:
                stub.OpenTestEngine(selftest_pb2.OpenTestEngineRequest(blocks=8, block_len=4096), timeout=60)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for command in ('{"op": "hold", "request_id": "x", "blocks": [[1]]}', "not json"):
                with pytest.raises(grpc.RpcError) as error:
                    stub.DriveTestEngine(
                        selftest_pb2.DriveTestEngineRequest(session_id=opened.session_id, command_json=command),
                        timeout=10,
                    )
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            waited = stub.DriveTestEngine(
                selftest_pb2.DriveTestEngineRequest(
                    session_id=opened.session_id,
                    command_json='{"op": "wait_event", "request_id": "none", "timeout_seconds": 0.2}',
                ),
                timeout=10,
            )
            assert json.loads(waited.reply_json) == {"ok": False, "error": "no event for none within 0.2s"}
            assert opened.engine_id in _engines(b)
        finally:
            stub.CloseTestEngine(selftest_pb2.CloseTestEngineRequest(session_id=opened.session_id), timeout=30)
        with pytest.raises(grpc.RpcError) as error:
            stub.DriveTestEngine(
                selftest_pb2.DriveTestEngineRequest(session_id=opened.session_id, command_json='{"op": "release"}'),
                timeout=10,
            )
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
    wait_until(lambda: _engines(b) == [], 10, what="the closed test engine unregistered")
