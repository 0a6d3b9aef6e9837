"""Peer addresses: one spelling per address, and which addresses are this sidecar's own (calls to
those never leave the process). Pure functions and one small set; no I/O but a host-name lookup
when a wildcard address is bound."""

from __future__ import annotations

import functools
import socket

from sidecar.config import split_host_port
from sidecar.errors import InvalidArgument


@functools.lru_cache(maxsize=4096)
def normalize_address(address: str) -> str:
    """One spelling per peer; raises InvalidArgument for an address that is not HOST:PORT (callers
    validate addresses at the API boundary, so this is a last line, not the check). Cached: every
    request looks its peer up two or three times (an error is not cached, and raises each time)."""
    try:
        host, port = split_host_port(address, "address")
    except ValueError as exc:
        raise InvalidArgument("address", str(exc)) from None
    host = host.lower()
    if host in ("localhost", "::1", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


def address_key(address: str) -> str:
    """The key peers are cached under ("" for our own, unnamed address)."""
    return normalize_address(address) if address else ""


class SelfAddresses:
    """This sidecar's own PeerService addresses (advertised and bound), in every spelling."""

    def __init__(self) -> None:
        self._spelled: set[str] = set()

    def set(self, addresses: list[str]) -> None:
        spelled: set[str] = set()
        for address in addresses:
            host, port = split_host_port(address, "address")
            spelled.add(normalize_address(address))
            if host in ("0.0.0.0", "::", ""):
                try:
                    for ip in socket.gethostbyname_ex(socket.gethostname())[2]:
                        spelled.add(f"{ip}:{port}")
                except OSError:
                    pass
        self._spelled = spelled

    def __contains__(self, address: str) -> bool:
        return not address or normalize_address(address) in self._spelled
