"""Who may call the engine socket: the credential socket that hands out session tokens after
checking the caller's ``SO_PEERCRED``, and the interceptor that refuses engine-socket calls
without a valid token (the protocol is ``kvsidecar.engine_auth``).

- ``SessionTokens``: tokens are ``uid.gid.pid.nonce.mac``, the MAC an HMAC-SHA256 under a key
  drawn at start, so a token names who asked for it, needs no table, and dies with the daemon
  instance (a restarted daemon has a new key).
- ``CredentialSocket``: an asyncio Unix server on ``<engine_socket>.auth``; per connection it
  reads ``SO_PEERCRED`` (uid, gid, pid at connect time, from the kernel), answers a token or the
  reason for refusing, and closes. A refusal is logged (``engine_peer_refused`` with uid, gid, pid).
- The engine session's plain socket (``api.session_socket``) checks its callers the same way
  (``peer_caller``, ``CallerPolicy.refusal``), once per connection, instead of by token.
- ``TokenInterceptor``: on the engine server (Unix socket and loopback TCP), every call except
  health and reflection needs a valid token in metadata ``kvsidecar-token``; others are refused
  ``PERMISSION_DENIED`` (through ``CallInterceptor``, which logs and counts them) with an
  ``engine_call_refused`` log line naming the method and, when the token says, uid and pid.

Who is allowed: the daemon's own uid and root always (either can read the daemon's memory and
its socket anyway), plus ``engine_allowed_uids`` and any caller whose gid is in
``engine_allowed_gids``.

Whose engine: an allowed caller acts only on its own engines. The uid whose call registered an
engine's first worker owns it (``Engine.owner_uid``), and a worker's shared-memory files must be
that uid's own; a call of another uid naming the engine is PERMISSION_DENIED (``engine_owner_refused``
log line). Without this, the root daemon would be a confused deputy: any allowed user could have it
map another user's files, or pull into, release or unregister another user's engine. Root and the
daemon's uid act on every engine (``acting_uid``). PeerService, served on the engine socket for
debugging, is theirs alone: anyone else calling it there would act as a peer with no identity.

Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import hmac
import os
import secrets
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvsidecar.engine_auth import NO_TOKEN, TOKEN_KEY, auth_socket_for, encode_reply
from kvsidecar.v1 import peer_pb2
from sidecar.config import Settings
from sidecar.errors import PermissionDenied
from sidecar.logs import get_logger

log = get_logger("kvsidecar.server")

# Services reachable on the engine socket without a token: probes and `grpcurl list/describe`.
OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")
PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["PeerService"].full_name
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Caller:
    uid: int
    gid: int
    pid: int


# Who makes the engine-socket call being served: set by ``TokenInterceptor`` once the call's token
# checks out. None where no token is involved (the peer server, the core driven in-process).
CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("kvsidecar_caller", default=None)


def privileged(uid: int) -> bool:
    """Root and the daemon's own uid: they can read the daemon's memory and every engine's anyway."""
    return uid in (0, os.getuid())


def acting_uid() -> int | None:
    """The uid whose engines the current call may act on, or None if it may act on any (a
    privileged caller, or an in-process one)."""
    caller = CALLER.get()
    if caller is None or privileged(caller.uid):
        return None
    return caller.uid


class SessionTokens:
    """Issues and checks tokens for one daemon instance."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def _mac(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()[:32]

    def issue(self, caller: Caller) -> str:
        body = f"{caller.uid}.{caller.gid}.{caller.pid}.{secrets.token_hex(8)}"
        return f"{body}.{self._mac(body)}"

    def verify(self, token: str) -> Caller | None:
        """The caller a token was issued to, or None if this instance did not issue it."""
        body, _, mac = token.rpartition(".")
        if not body or not hmac.compare_digest(mac.encode(), self._mac(body).encode()):
            return None
        try:
            uid, gid, pid, _nonce = body.split(".")
            return Caller(int(uid), int(gid), int(pid))
        except ValueError:
            return None

    @staticmethod
    def claimed(token: str) -> dict[str, str]:
        """What an unverified token claims (uid, pid), for the log line of its refusal."""
        parts = token.split(".")
        if len(parts) == 5 and parts[0].isdigit() and parts[2].isdigit():
            return {"claimed_uid": parts[0], "claimed_pid": parts[2]}
        return {}


class CallerPolicy:
    def __init__(self, settings: Settings) -> None:
        self.uids = {os.getuid(), 0, *settings.engine_allowed_uids}
        self.gids = set(settings.engine_allowed_gids)

    def allows(self, caller: Caller) -> bool:
        return caller.uid in self.uids or caller.gid in self.gids

    def describe(self) -> str:
        gids = f", gids {sorted(self.gids)}" if self.gids else ""
        return f"uids {sorted(self.uids)}{gids}"

    def refusal(self, caller: Caller, **log_fields: Any) -> str:
        """Why ``caller`` may not use this sidecar ("" if it may); a refusal is logged
        (``engine_peer_refused``)."""
        if self.allows(caller):
            return ""
        log.warning("engine_peer_refused", uid=caller.uid, gid=caller.gid, pid=caller.pid, **log_fields,
                    hint="list the uid or gid in engine_allowed_uids / engine_allowed_gids")  # fmt: skip
        return f"uid {caller.uid} (gid {caller.gid}) may not use this sidecar; allowed: {self.describe()}"


def peer_caller(sock: socket.socket) -> Caller:
    """Who is at the other end of an accepted Unix-socket connection (``SO_PEERCRED``: the
    kernel's uid, gid and pid at connect time)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return Caller(uid, gid, pid)


async def serve_unix(path: Path, handler: Callable[..., Awaitable[None]], mode: int) -> asyncio.AbstractServer:
    """An asyncio Unix server on ``path`` with ``mode`` (never wider while it is being created).
    The engine socket's path was checked first (no live daemon serves it), so a socket found
    here is a crashed daemon's leftover and is replaced."""
    if path.is_socket():
        path.unlink()
    previous_umask = os.umask(0o177)
    try:
        server = await asyncio.start_unix_server(handler, path=str(path))
    finally:
        os.umask(previous_umask)
    os.chmod(path, stat.S_IMODE(mode))
    return server


class CredentialSocket:
    """The plain Unix socket next to the engine socket that answers tokens (see module doc)."""

    def __init__(self, settings: Settings, tokens: SessionTokens, sidecar_id: str) -> None:
        self.path = auth_socket_for(settings.engine_socket)
        self._mode = settings.engine_socket_mode
        self._policy = CallerPolicy(settings)
        self._tokens = tokens
        self._sidecar_id = sidecar_id
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await serve_unix(self.path, self._answer, self._mode)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            caller = peer_caller(writer.get_extra_info("socket"))
            why = self._policy.refusal(caller)
            if not why:
                writer.write(encode_reply(token=self._tokens.issue(caller), sidecar_id=self._sidecar_id))
            else:
                writer.write(encode_reply(error=why))
            async with asyncio.timeout(5.0):
                await writer.drain()
        except (OSError, TimeoutError) as exc:
            log.info("credential_socket_error", error=str(exc))
        finally:
            writer.close()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses engine-server calls without a valid session token (see module doc). Runs inside
    ``CallInterceptor``, which turns the refusal into PERMISSION_DENIED, logs and counts it."""

    def __init__(self, tokens: SessionTokens, auth_socket: Path) -> None:
        self._tokens = tokens
        self._auth_socket = auth_socket

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method.lstrip("/")
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        token = next((str(value) for key, value in details.invocation_metadata or () if key == TOKEN_KEY), "")
        caller = self._tokens.verify(token) if token else None
        if caller is not None and method.startswith(PEER_SERVICE) and not privileged(caller.uid):
            # PeerService is here for debugging by the daemon's user. Anyone else calling it here
            # would act as a peer with no identity to check (mTLS is on the peer port).
            log.warning("engine_call_refused", method=method, uid=caller.uid, pid=caller.pid,
                        reason="PeerService on the engine socket")  # fmt: skip
            return _refusing(
                handler,
                PermissionDenied(
                    f"{method}: PeerService on the engine socket is for the daemon's uid and root (debugging); "
                    f"uid {caller.uid} may call only EngineService here"
                ),
            )
        if caller is not None:
            CALLER.set(caller)
            return handler
        why = "none sent" if not token else "not issued by this instance of the sidecar (restarted?) or forged"
        log.warning("engine_call_refused", method=method, token=why, **SessionTokens.claimed(token))
        error = PermissionDenied(
            f"{method}: {NO_TOKEN} ({why}); a client gets one from {self._auth_socket}, which checks its "
            f"uid/gid (SO_PEERCRED), and sends it as metadata {TOKEN_KEY!r}; by hand: "
            f'grpcurl -H "{TOKEN_KEY}: $(kvsidecar token --socket ...)"'
        )
        return _refusing(handler, error)


def _refusing(handler: grpc.RpcMethodHandler, error: PermissionDenied) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that raises ``error`` without running it."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise error

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise error
        yield  # a generator, as a streaming behavior is

    async def bidi(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        raise error
        yield  # a generator, as a streaming behavior is

    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(
            bidi, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
