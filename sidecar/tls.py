"""mTLS on the peer port: credentials that follow the certificate files without a restart, and
who a caller is.

Reload: the files' modification times are compared (no polling thread, no signal). The peer
server uses gRPC's dynamic server credentials, whose fetcher gRPC calls at every new TLS
handshake (on a gRPC core thread): it returns a new configuration once any of the three files
changed, so new connections present and accept the new certificates; connections already open
keep theirs until they close. Outgoing calls: ``PeerDirectory`` asks ``client_generation()``
before using a cached channel and opens a new one when the files changed.

Identity: a peer is the set of names its verified certificate carries (subject alternative names,
DNS and IP; else its common name), from ``context.peer_identities()``. grpcio exposes nothing
about Unix-socket callers (no SO_PEERCRED): the engine socket is protected by its mode (0600,
directory 0700) instead; see README "Security".
"""

from __future__ import annotations

import ipaddress
import threading
import time
from pathlib import Path

import grpc

from sidecar.logs import get_logger

log = get_logger("kvsidecar.tls")


class TlsFiles:
    """The three PEM files of the peer port (certificate, key, CA bundle)."""

    def __init__(self, cert: Path, key: Path, ca: Path) -> None:
        self._paths = (cert, key, ca)
        self._lock = threading.Lock()  # the fetcher runs on gRPC's threads, the rest on the loop
        self._served = self._stamp()
        self._client_stamp = self._served
        self._client_generation = 0
        self._client_checked = 0.0

    def _stamp(self) -> tuple[int, ...]:
        stamps = []
        for path in self._paths:
            try:
                stamps.append(path.stat().st_mtime_ns)
            except OSError:
                stamps.append(-1)  # missing mid-rotation: keep what we have until it is back
        return tuple(stamps)

    def _read(self) -> tuple[bytes, bytes, bytes]:
        cert, key, ca = (path.read_bytes() for path in self._paths)
        return cert, key, ca

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = self._read()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(), self._fetch, require_client_authentication=True
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's question at each new handshake: None keeps the current configuration."""
        with self._lock:
            stamp = self._stamp()
            if stamp == self._served or -1 in stamp:
                return None
            try:
                configuration = self._configuration()
            except OSError as exc:
                log.warning("peer_tls_reload_failed", error=str(exc))
                return None
            self._served = stamp
        log.info("peer_tls_reloaded", side="server", files=[str(p) for p in self._paths])
        return configuration

    def client_generation(self) -> int:
        """Changes when the files changed since outgoing channels were last built (looked at
        once a second at most: it is asked before every peer call)."""
        with self._lock:
            now = time.monotonic()
            if now - self._client_checked < 1.0:
                return self._client_generation
            self._client_checked = now
            stamp = self._stamp()
            if stamp != self._client_stamp and -1 not in stamp:
                self._client_stamp = stamp
                self._client_generation += 1
                log.info("peer_tls_reloaded", side="client", files=[str(p) for p in self._paths])
            return self._client_generation

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def peer_identity(context: grpc.aio.ServicerContext) -> str:
    """The caller's verified certificate names, sorted and comma-joined; "" without TLS (the
    Unix socket, or a plaintext peer port)."""
    names = context.peer_identities()
    if not names:
        return ""
    return ",".join(sorted(name.decode(errors="replace") for name in names))


def covers(identity: str, host: str) -> bool:
    """Whether a certificate identity names ``host`` (an IP literal or a DNS name)."""
    names = set(identity.split(","))
    try:
        return str(ipaddress.ip_address(host.strip("[]"))) in names
    except ValueError:
        return host.lower() in {name.lower() for name in names}
