"""With mTLS, a peer acts only on transfers it is a party to, identified by its certificate:
another cluster member (a certificate from the same CA) is refused with PERMISSION_DENIED naming
why, and a `peer_refused` log line, when it releases, heartbeats or re-registers someone else's
request, or fails a push it is not the producer of. Certificates reload without a restart. The
engine socket's mode refuses other users (the token check: test_engine_auth.py). Real sidecars,
real NIXL, simulated engines that check bytes."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest

from engine_shim.client import engine_channel
from kvsidecar.v1 import engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc
from tests.chaos.cells import status
from tests.support.moves import kv
from tests.support.pki import issue, make_ca, tls_args
from tests.support.processes import wait_until

BLOCKS, D_BLOCKS = [3, 4, 5], [20, 21, 22]


@pytest.fixture
def cluster(workdir: Path, sidecars, engines):
    ca = make_ca(workdir, "cluster")
    p_cert, p_key = issue(ca, workdir, "p", dns=["p.kvsidecar.test"])
    d_cert, d_key = issue(ca, workdir, "d", dns=["d.kvsidecar.test"])
    # Another member of the cluster: same CA, its own name, no certificate for 127.0.0.1.
    m_cert, m_key = issue(ca, workdir, "mallory", dns=["mallory.kvsidecar.test"], ips=[])
    p_side = sidecars("p", args=tls_args(p_cert, p_key, ca.path))
    d_side = sidecars("d", args=tls_args(d_cert, d_key, ca.path))
    producer = engines(p_side, "P", "producer")
    consumer = engines(d_side, "D", "consumer")
    mallory = grpc.ssl_channel_credentials(ca.path.read_bytes(), m_key.read_bytes(), m_cert.read_bytes())
    return p_side, d_side, producer, consumer, mallory


def _refused(target: str, credentials, method: str, request) -> grpc.RpcError:
    with grpc.secure_channel(target, credentials) as channel:
        stub = peer_pb2_grpc.PeerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            getattr(stub, method)(request, timeout=10)
    return refused.value


def _logged_refusal(sidecar, action: str) -> dict:
    def found():
        return next(
            (e for e in sidecar.log_events() if e.get("event") == "peer_refused" and e["action"] == action), None
        )

    return wait_until(found, 5, what=f"peer_refused {action} log line")


def _intact(producer, consumer) -> bool:
    return bool(np.array_equal(kv(producer.buffers[0], 2, 64, 4096)[:, BLOCKS],
                               kv(consumer.buffers[0], 2, 64, 4096)[:, D_BLOCKS]))  # fmt: skip


def test_a_push_registration_belongs_to_its_consumer(cluster) -> None:
    p_side, _d_side, producer, consumer, mallory = cluster
    remote = {"address": p_side.address, "engine_id": "P"}
    reply = consumer.command("expect_push", request_id="r-d", blocks=[D_BLOCKS], remote=remote, transfer_id="t1")
    assert reply["ok"] and reply["registered"], reply

    release = peer_pb2.PeerReleaseRequest(engine_id="P", transfer_id="t1", consumer_request_id="r-d", reason="x")
    error = _refused(p_side.address, mallory, "Release", release)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error
    assert "push registration D/r-d belongs to the peer with certificate" in error.details()
    assert "mallory.kvsidecar.test" in error.details() and "d.kvsidecar.test" in error.details()
    line = _logged_refusal(p_side, "Release")
    assert "mallory.kvsidecar.test" in line["peer_identity"] and "d.kvsidecar.test" in line["party"]

    hijack = peer_pb2.PushRegRequest(
        caller=peer_pb2.HandshakeResponse().sidecar, prefill_engine_id="P", transfer_id="t1", decode_engine_id="D",
        request_id="r-d", block_ids={"groups": [{"ids": [40, 41, 42]}]},
    )  # fmt: skip
    hijack.caller.address = "127.0.0.1:1"
    error = _refused(p_side.address, mallory, "PushReg", hijack)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error
    _logged_refusal(p_side, "PushReg")

    # The real transfer is untouched: P's blocks land in D's registered blocks, intact.
    assert producer.command("fill", blocks=BLOCKS, seed=8)["ok"]
    assert producer.command("submit", request_id="r", blocks=[BLOCKS], transfer_id="t1", mode=2)["ok"]
    assert consumer.wait_event("r-d", 20)[0]["event"] == "FINISHED_RECEIVING"
    assert _intact(producer, consumer)


def test_only_the_producer_may_fail_a_push(cluster) -> None:
    p_side, d_side, producer, consumer, mallory = cluster
    remote = {"address": p_side.address, "engine_id": "P"}
    assert consumer.command("expect_push", request_id="f-d", blocks=[D_BLOCKS], remote=remote, transfer_id="t2")["ok"]
    failed = peer_pb2.TransferFailedRequest(engine_id="D", request_id="f-d", transfer_id="t2", reason="forged")
    error = _refused(d_side.address, mallory, "TransferFailed", failed)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error
    assert f"is a push from {p_side.address}" in error.details() and "not valid for 127.0.0.1" in error.details()
    _logged_refusal(d_side, "TransferFailed")
    assert consumer.events_for("f-d") == []  # D was not told its push failed
    assert producer.command("fill", blocks=BLOCKS, seed=9)["ok"]
    assert producer.command("submit", request_id="f", blocks=[BLOCKS], transfer_id="t2", mode=2)["ok"]
    assert consumer.wait_event("f-d", 20)[0]["event"] == "FINISHED_RECEIVING"
    assert _intact(producer, consumer)


def test_a_pull_belongs_to_the_consumer_that_claimed_it(cluster) -> None:
    p_side, d_side, producer, consumer, mallory = cluster
    assert producer.command("fill", blocks=BLOCKS, seed=10)["ok"]
    assert producer.command("submit", request_id="k", blocks=[BLOCKS], lease_seconds=5)["ok"]
    # D keeps P's request alive before pulling: its heartbeat claims the request for D's certificate.
    with engine_channel(d_side.socket) as channel:
        engine_pb2_grpc.EngineServiceStub(channel).KeepAlive(
            engine_pb2.KeepAliveRequest(engine_id="D", request_id="k-d", remote=engine_pb2.RemoteBlocks(
                address=p_side.address, engine_id="P", request_id="k")), timeout=10)  # fmt: skip
    heartbeat = peer_pb2.HeartbeatRequest(engine_id="P", requests=[peer_pb2.RequestKey(request_id="k")])

    # D's first heartbeat (sent at once) extends P's 5 s lease to the 20 s extension: then it is D's.
    def extended() -> bool:
        rows = [r for r in status(p_side).requests if r.request_id == "k"]
        return bool(rows) and rows[0].deadline_in_seconds > 6

    wait_until(extended, 5, what="D's heartbeat reached P")
    error = _refused(p_side.address, mallory, "Heartbeat", heartbeat)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error
    assert "request P/k belongs to the peer with certificate" in error.details()
    _logged_refusal(p_side, "Heartbeat")
    release = peer_pb2.PeerReleaseRequest(engine_id="P", request_id="k", reason="forged")
    assert _refused(p_side.address, mallory, "Release", release).code() == grpc.StatusCode.PERMISSION_DENIED
    assert producer.events_for("k") == []  # P still holds its blocks
    remote = {"address": p_side.address, "engine_id": "P", "request_id": "k", "blocks": [BLOCKS]}
    assert consumer.command("pull", request_id="k-d", blocks=[D_BLOCKS], remote=remote)["ok"]
    assert consumer.wait_event("k-d", 20)[0]["event"] == "FINISHED_RECEIVING"
    assert _intact(producer, consumer)


def test_certificates_reload_without_a_restart(workdir: Path, sidecars) -> None:
    old_ca, new_ca = make_ca(workdir, "old"), make_ca(workdir, "new")
    cert, key = issue(old_ca, workdir, "p", dns=["p.kvsidecar.test"])
    bundle = workdir / "bundle.crt"
    shutil.copy(old_ca.path, bundle)
    side = sidecars("p", args=tls_args(cert, key, bundle))
    n_cert, n_key = issue(new_ca, workdir, "newcomer", dns=["n.kvsidecar.test"])
    newcomer = grpc.ssl_channel_credentials(
        old_ca.path.read_bytes() + new_ca.path.read_bytes(), n_key.read_bytes(), n_cert.read_bytes()
    )
    request = peer_pb2.PeerQueryCacheRequest(request_id="nothing")
    assert _refused(side.address, newcomer, "QueryCache", request).code() == grpc.StatusCode.UNAVAILABLE
    # Rotation: the CA bundle now trusts the new CA too (written aside, then renamed: atomic).
    staged = workdir / "bundle.new"
    staged.write_bytes(old_ca.path.read_bytes() + new_ca.path.read_bytes())
    os.replace(staged, bundle)
    with grpc.secure_channel(side.address, newcomer) as channel:
        reply = peer_pb2_grpc.PeerServiceStub(channel).QueryCache(request, timeout=10)
    assert list(reply.entries) == []
    assert any(e.get("event") == "peer_tls_reloaded" for e in side.log_events())
    assert side.process is not None and side.process.poll() is None  # no restart


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_the_engine_socket_refuses_other_users(sidecars) -> None:
    side = sidecars("s")
    assert side.socket.stat().st_mode & 0o777 == 0o600
    # With the default mode the kernel refuses other users before the daemon sees anything (no
    # log line); with the socket opened, the SO_PEERCRED check refuses them (test_engine_auth.py).
    probe = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        f"    s.connect({str(side.socket)!r}); print('ACCEPTED')\n"
        "except PermissionError as e:\n"
        "    print('REFUSED', e.errno)\n"
    )
    os.chmod(side.socket.parent, 0o711)  # let the other user reach the socket file itself
    result = subprocess.run(["/usr/bin/python3", "-c", probe], user=65534, group=65534, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.stdout.strip() == "REFUSED 13", (result.stdout, result.stderr)
    with engine_channel(side.socket) as channel:  # its own user still gets in
        engine_pb2_grpc.EngineServiceStub(channel).GetStatus(engine_pb2.GetStatusRequest(), timeout=5)
