"""Who may call the engine socket: the credential handshake between an engine-side client and its
sidecar, which both sides import (docs/design.md section 8: the contract imports neither side).

grpcio gives a server no peer credentials of a Unix-socket caller and cannot serve a connection
the daemon accepted itself, so the kernel's ``SO_PEERCRED`` is read on a second, plain Unix
socket next to the engine socket (``auth_socket_for``: the engine socket's path + ``.auth``,
same directory and mode). The protocol:

1. The client connects to the auth socket and sends nothing.
2. The daemon reads the caller's uid, gid and pid from the accepted connection (``SO_PEERCRED``)
   and answers one line of JSON, then closes: ``{"token": T, "sidecar_id": S}`` if the uid or gid
   is allowed, else ``{"error": WHY}``.
3. The client sends ``T`` as gRPC metadata ``TOKEN_KEY`` on every call on the engine socket (and
   on the optional loopback TCP listener). The token is per connection of step 1 and valid for
   the daemon instance that issued it; a call without a valid one (none, forged, or one from a
   previous instance of the daemon) is refused ``PERMISSION_DENIED`` with ``NO_TOKEN`` in its
   message, so a client that sees that asks for a new token (its sidecar restarted) and retries.

Health and reflection need no token (probes, ``grpcurl list``); for other calls by hand:
``grpcurl -H "kvsidecar-token: $(kvsidecar token)" -unix ...``.

Standard library only; ``request_token`` blocks (bounded by ``timeout``) and may be called from
any thread.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

AUTH_SUFFIX = ".auth"
TOKEN_KEY = "kvsidecar-token"  # gRPC metadata key (lower case, as gRPC requires)
NO_TOKEN = "no valid session token"  # in the message of every refusal for a missing/stale token
_MAX_REPLY = 4096


def auth_socket_for(engine_socket: str | os.PathLike[str]) -> Path:
    """The credential socket that serves tokens for ``engine_socket``."""
    return Path(f"{os.fspath(engine_socket)}{AUTH_SUFFIX}")


def encode_reply(token: str = "", sidecar_id: str = "", error: str = "") -> bytes:
    """The daemon's one-line answer: a token, or why there is none."""
    body = {"error": error} if error else {"token": token, "sidecar_id": sidecar_id}
    return (json.dumps(body) + "\n").encode()


def request_token(auth_socket: str | os.PathLike[str], timeout: float = 5.0) -> str:
    """A session token from the daemon behind ``auth_socket``.

    Raises ``PermissionError`` with the daemon's reason when it refuses this process's user, and
    ``OSError`` when no daemon answers (not running, or the kernel refused the connection)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(os.fspath(auth_socket))
        data = b""
        while not data.endswith(b"\n") and len(data) < _MAX_REPLY:
            chunk = conn.recv(_MAX_REPLY)
            if not chunk:
                break
            data += chunk
    try:
        reply = json.loads(data)
    except ValueError:
        raise OSError(f"{auth_socket} answered no token: {data[:200]!r}") from None
    if not isinstance(reply, dict):
        raise OSError(f"{auth_socket} answered no token: {data[:200]!r}")
    if reply.get("error"):
        raise PermissionError(f"{auth_socket}: {reply['error']}")
    token = reply.get("token")
    if not isinstance(token, str) or not token:
        raise OSError(f"{auth_socket} answered no token: {data[:200]!r}")
    return token
