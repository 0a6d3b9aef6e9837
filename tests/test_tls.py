"""mTLS between sidecars: transfers work with certificates from one CA; a peer without a client
certificate, or with one from another CA, is refused."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvsidecar.v1 import peer_pb2, peer_pb2_grpc
from tests.test_pull import kv, pull_and_wait


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_pki(directory: Path, name: str, dns_names: list[str] | None = None) -> tuple[Path, Path, Path]:
    """A CA and one certificate for 127.0.0.1 (and ``dns_names``), usable as server and client;
    returns (cert, key, ca)."""
    names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    names += [x509.DNSName(dns) for dns in dns_names or []]
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = _key(), _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvsidecar")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    paths = (directory / f"{name}.crt", directory / f"{name}.key", directory / f"{name}-ca.crt")
    paths[0].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(_pem(key))
    paths[2].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return paths


def tls_args(cert: Path, key: Path, ca: Path) -> list[str]:
    return ["--set", f"peer_tls_cert={cert}", "--set", f"peer_tls_key={key}", "--set", f"peer_tls_ca={ca}"]


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
