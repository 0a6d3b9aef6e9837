"""mTLS between sidecars: transfers work with certificates from one CA; a peer without a client
certificate, or with one from another CA, is refused."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from kvsidecar.v1 import peer_pb2, peer_pb2_grpc
from tests.support.moves import kv, pull_and_wait
from tests.support.pki import make_pki, tls_args


def test_pull_over_mtls_and_strangers_are_refused(workdir: Path, sidecars, engines) -> None:
    cert, key, ca = make_pki(workdir, "cluster")
    p_side = sidecars("p", args=tls_args(cert, key, ca))
    d_side = sidecars("d", args=tls_args(cert, key, ca))
    producer = engines(p_side, "P", "producer")
    consumer = engines(d_side, "D", "consumer")
    assert producer.command("fill", blocks=[1, 2, 3], seed=6)["ok"]
    events = pull_and_wait(producer, consumer, "tls", [1, 2, 3], [4, 5, 6])
    assert events[0]["event"] == "FINISHED_RECEIVING", events
    assert np.array_equal(
        kv(producer.buffers[0], 2, 64, 4096)[:, [1, 2, 3]], kv(consumer.buffers[0], 2, 64, 4096)[:, [4, 5, 6]]
    )

    request = peer_pb2.HandshakeRequest(engine_id="P")
    with grpc.insecure_channel(p_side.address) as plaintext, pytest.raises(grpc.RpcError):
        peer_pb2_grpc.PeerServiceStub(plaintext).Handshake(request, timeout=3)
    other_cert, other_key, _ = make_pki(workdir, "stranger")
    credentials = grpc.ssl_channel_credentials(ca.read_bytes(), other_key.read_bytes(), other_cert.read_bytes())
    with grpc.secure_channel(p_side.address, credentials) as stranger, pytest.raises(grpc.RpcError) as refused:
        peer_pb2_grpc.PeerServiceStub(stranger).Handshake(request, timeout=3)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    own = grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes(), cert.read_bytes())
    with grpc.secure_channel(p_side.address, own) as member:
        response = peer_pb2_grpc.PeerServiceStub(member).Handshake(request, timeout=5)
    assert response.engine.engine_id == "P"
