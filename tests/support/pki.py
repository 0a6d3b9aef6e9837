"""Test certificates: a CA and certificates it issues for loopback names (never anything else)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Ca:
    name: x509.Name
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate
    path: Path


def _validity() -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)


def make_ca(directory: Path, label: str) -> Ca:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{label} test CA")])
    start, end = _validity()
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    path = directory / f"{label}-ca.crt"
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return Ca(name, key, certificate, path)


def issue(ca: Ca, directory: Path, label: str, dns: list[str], ips: list[str] | None = None) -> tuple[Path, Path]:
    """A server+client certificate with these names (IPs must be loopback); returns (cert, key)."""
    ips = ["127.0.0.1"] if ips is None else ips
    assert all(ipaddress.ip_address(ip).is_loopback for ip in ips)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    start, end = _validity()
    certificate = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, label)]))
        .issuer_name(ca.name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(ca.key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = directory / f"{label}.crt", directory / f"{label}.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def make_pki(directory: Path, name: str, dns_names: list[str] | None = None) -> tuple[Path, Path, Path]:
    """A CA and one certificate for 127.0.0.1 (and ``dns_names``), usable as server and client;
    returns (cert, key, ca)."""
    ca = make_ca(directory, name)
    cert, key = issue(ca, directory, name, dns=list(dns_names or []))
    return cert, key, ca.path


def tls_args(cert: Path, key: Path, ca: Path) -> list[str]:
    return ["--set", f"peer_tls_cert={cert}", "--set", f"peer_tls_key={key}", "--set", f"peer_tls_ca={ca}"]
