"""Calls to peer sidecars, and the handshake cache.

Every call goes through ``PeerDirectory.call``: to this sidecar's own peer handlers directly when
the address is our own (the same-node path never leaves the process), otherwise over a pooled
gRPC channel with a deadline. Every response names the peer's instance id; a new id means the
peer restarted, so everything cached about it is dropped (and its NIXL agents unloaded through
``on_peer_restart``) before the next use re-handshakes.

Handshakes are cached per (address, engine) and deduplicated per key: a slow peer delays only the
requests that need it. Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2, peer_pb2_grpc
from sidecar.config import Settings, split_host_port
from sidecar.dataplane import EngineView, view_from_descriptor
from sidecar.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PeerInvalidArgument,
    ResourceExhausted,
    SidecarError,
    Unavailable,
)
from sidecar.logs import get_logger
from sidecar.metrics import SidecarMetrics

log = get_logger("kvsidecar.peers")


class PeerHandler(Protocol):
    """The peer-facing side of a node (what PeerService serves)."""

    async def handle_handshake(self, request: peer_pb2.HandshakeRequest) -> peer_pb2.HandshakeResponse: ...
    async def handle_push_reg(self, request: peer_pb2.PushRegRequest) -> peer_pb2.PushRegResponse: ...
    async def handle_heartbeat(self, request: peer_pb2.HeartbeatRequest) -> peer_pb2.HeartbeatResponse: ...
    async def handle_query_cache(self, request: peer_pb2.PeerQueryCacheRequest) -> peer_pb2.PeerQueryCacheResponse: ...
    async def handle_transfer_failed(
        self, request: peer_pb2.TransferFailedRequest
    ) -> peer_pb2.TransferFailedResponse: ...
    async def handle_release(self, request: peer_pb2.PeerReleaseRequest) -> peer_pb2.PeerReleaseResponse: ...
    def local_engine_view(self, engine_id: str, compatibility_hash: str) -> EngineView: ...


_HANDLERS = {
    "Handshake": "handle_handshake",
    "PushReg": "handle_push_reg",
    "Heartbeat": "handle_heartbeat",
    "QueryCache": "handle_query_cache",
    "TransferFailed": "handle_transfer_failed",
    "Release": "handle_release",
}

_STATUS_ERRORS: dict[grpc.StatusCode, type[SidecarError]] = {
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: PeerInvalidArgument,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


@dataclass
class _PeerState:
    address: str
    sidecar_id: str = ""
    last_seen: float = 0.0
    handshake_ms: float = 0.0
    clock_offset_ms: float = 0.0
    consecutive_failures: int = 0


def normalize_address(address: str) -> str:
    """One spelling per peer; raises InvalidArgument for an address that is not HOST:PORT (callers
    validate addresses at the API boundary, so this is a last line, not the check)."""
    try:
        host, port = split_host_port(address, "address")
    except ValueError as exc:
        raise InvalidArgument("address", str(exc)) from None
    host = host.lower()
    if host in ("localhost", "::1", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


class PeerDirectory:
    def __init__(
        self,
        settings: Settings,
        local: PeerHandler,
        self_info: Callable[[], common_pb2.SidecarInfo],
        on_peer_restart: Callable[[str, list[str]], Awaitable[None]],
        metrics: SidecarMetrics,
    ) -> None:
        self._settings = settings
        self._local = local
        self._self_info = self_info
        self._on_peer_restart = on_peer_restart
        self._metrics = metrics
        self._channels: dict[str, tuple[grpc.aio.Channel, peer_pb2_grpc.PeerServiceStub]] = {}
        self._engines: dict[tuple[str, str], EngineView] = {}
        self._handshakes: dict[tuple[str, str], asyncio.Future[EngineView]] = {}
        # Peers that completed a handshake (what GetStatus lists), at most settings.max_peers.
        self._peers: dict[str, _PeerState] = {}
        # Consecutive failed calls per peer, handshaken or not (a keep-alive heartbeats a producer
        # before any handshake); cleared by an answer, bounded like the table.
        self._failures: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}
        # Peer sidecars that called us (normalized address -> address as given), LRU order, at most
        # settings.max_peers: with the handshaken peers, whom multi-turn cache queries ask.
        self._callers: dict[str, str] = {}
        self._self_addresses: set[str] = set()

    def set_self_addresses(self, addresses: list[str]) -> None:
        """Our own PeerService addresses (advertised and bound), in every spelling we can think of."""
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
        self._self_addresses = spelled

    def is_self(self, address: str) -> bool:
        return not address or normalize_address(address) in self._self_addresses

    # --- handshakes -------------------------------------------------------------------------

    async def engine(self, address: str, engine_id: str, compatibility_hash: str) -> EngineView:
        """The engine ``engine_id`` behind ``address``, handshaking once and caching the result.

        Our own engines are read from the registry every time: always current, never cached."""
        if self.is_self(address):
            return self._local.local_engine_view(engine_id, compatibility_hash)
        key = (self._key(address), engine_id)
        cached = self._engines.get(key)
        if cached is not None:
            return cached
        pending = self._handshakes.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._handshake(address, engine_id, compatibility_hash))
            self._handshakes[key] = pending
            pending.add_done_callback(lambda _: self._handshakes.pop(key, None))
        return await asyncio.shield(pending)

    async def _handshake(self, address: str, engine_id: str, compatibility_hash: str) -> EngineView:
        request = peer_pb2.HandshakeRequest(
            caller=self._self_info(), engine_id=engine_id, compatibility_hash=compatibility_hash
        )
        started = time.monotonic()
        sent_unix = time.time()
        try:
            response: peer_pb2.HandshakeResponse = await self.call(address, "Handshake", request)
        except SidecarError as exc:
            reason = type(exc).__name__
            self._metrics.handshake_failures.labels(reason=reason).inc()
            log.warning("handshake_failed", peer=address, engine_id=engine_id, error=str(exc))
            raise
        elapsed = time.monotonic() - started
        self._metrics.handshake_duration.observe(elapsed)
        state = self._remember(address)
        state.sidecar_id = response.sidecar.sidecar_id
        state.last_seen = time.monotonic()
        state.handshake_ms = elapsed * 1000.0
        if response.sidecar.clock_unix_s:
            midpoint = sent_unix + elapsed / 2.0
            state.clock_offset_ms = (response.sidecar.clock_unix_s - midpoint) * 1000.0
        view = view_from_descriptor(address, response.sidecar.sidecar_id, response.engine)
        self._engines[(self._key(address), engine_id)] = view
        self._metrics.peers.set(len({key[0] for key in self._engines}))
        log.info(
            "handshake_done",
            peer=address,
            engine_id=engine_id,
            peer_sidecar_id=response.sidecar.sidecar_id,
            workers=len(view.workers),
            ms=round(elapsed * 1000.0, 2),
        )
        return view

    async def forget(self, address: str, reason: str) -> None:
        """Drop everything cached about a peer; its agents are unloaded from ours."""
        key = self._key(address)
        dropped = [view for (peer, _), view in self._engines.items() if peer == key]
        for view in dropped:
            del self._engines[(key, view.engine_id)]
        self._metrics.peers.set(len({peer for peer, _ in self._engines}))
        names = [name for view in dropped for name in view.agent_names]
        if dropped:
            log.info("peer_forgotten", peer=address, reason=reason, engines=[view.engine_id for view in dropped])
        if names:
            await self._on_peer_restart(address, names)

    def known_addresses(self) -> list[str]:
        """Peer sidecars we handshook with or that called us, most recent callers last (multi-turn
        cache queries ask them all)."""
        known = {key: state.address for key, state in self._peers.items()}
        known.update(self._callers)
        return [address for key, address in known.items() if key and not self.is_self(key)]

    async def note_caller(self, info: common_pb2.SidecarInfo) -> None:
        """An incoming call names its sidecar: remember it as a known peer (bounded by max_peers,
        least recent dropped first), and drop our cache of it if it restarted since."""
        if info.address and info.sidecar_id and not self.is_self(info.address):
            key = self._key(info.address)
            new_caller = key not in self._callers and key not in self._peers
            self._callers[key] = self._callers.pop(key, info.address)
            while len(self._callers) > self._settings.max_peers:
                del self._callers[next(iter(self._callers))]
            if new_caller:
                # Connect now: the first call to it (a multi-turn cache query, bounded to a few
                # ms) should not pay for the connection. No room in the channel table: it dials later.
                with contextlib.suppress(ResourceExhausted):
                    channel, _ = await self._channel(info.address)
                    channel.get_state(try_to_connect=True)
            state = self._peers.get(key)
            if state is None:
                return
            if state.sidecar_id and state.sidecar_id != info.sidecar_id:
                log.warning(
                    "peer_restarted", peer=info.address, old_sidecar_id=state.sidecar_id, new_sidecar_id=info.sidecar_id
                )
                state.sidecar_id = info.sidecar_id
                await self.forget(info.address, "peer restarted")

    def cached_view(self, address: str, engine_id: str) -> EngineView | None:
        """The engine as its last handshake described it, if one is cached (never dials)."""
        if self.is_self(address):
            try:
                return self._local.local_engine_view(engine_id, "")
            except SidecarError:
                return None
        return self._engines.get((self._key(address), engine_id))

    def cached_generation(self, address: str, engine_id: str) -> str | None:
        view = self._engines.get((self._key(address), engine_id))
        return None if view is None else view.generation

    async def forget_engine(self, address: str, engine_id: str, reason: str) -> None:
        view = self._engines.pop((self._key(address), engine_id), None)
        if view is not None:
            log.info("peer_engine_forgotten", peer=address, engine_id=engine_id, reason=reason)
            await self._on_peer_restart(address, view.agent_names)

    # --- calls ------------------------------------------------------------------------------

    async def call(self, address: str, method: str, request: Any, wait_for_ready: bool = True) -> Any:
        """Call a PeerService method on ``address`` (or on ourselves) with a deadline.

        ``wait_for_ready=False`` fails at once (UNAVAILABLE) when nothing listens at ``address``,
        instead of waiting out the deadline for a peer that may be restarting: what a heartbeat
        wants, so a dead peer is detected in heartbeat periods, not periods + call timeouts."""
        if self.is_self(address):
            response = await getattr(self._local, _HANDLERS[method])(request)
            return response
        key = self._key(address)
        _, stub = await self._channel(address)
        self._in_flight[address] = self._in_flight.get(address, 0) + 1
        failed = False
        try:
            # wait_for_ready: a peer that is restarting (connection refused, channel backing off)
            # gets until the deadline to come back instead of failing the call at once.
            response = await getattr(stub, method)(
                request, timeout=self._settings.peer_call_timeout_seconds, wait_for_ready=wait_for_ready
            )
        except grpc.aio.AioRpcError as exc:
            failed = True
            self._count_failure(key)
            error_type = _STATUS_ERRORS.get(exc.code(), Unavailable)
            raise error_type(f"peer {address}: {exc.code().name}: {exc.details()}") from None
        finally:
            self._in_flight[address] -= 1
            if not self._in_flight[address]:
                del self._in_flight[address]
                if failed and key not in self._peers:
                    # Never handshaken and not answering: keep no channel (each holds memory and a
                    # socket); a later call dials again.
                    await self._close_channel(address)
        await self._observe(address, _responder_id(response))
        return response

    def _count_failure(self, key: str) -> None:
        self._failures[key] = self._failures.pop(key, 0) + 1  # re-inserted: the dict stays in LRU order
        state = self._peers.get(key)
        if state is not None:
            state.consecutive_failures = self._failures[key]
        while len(self._failures) > self._settings.max_peers:
            del self._failures[next(iter(self._failures))]

    async def _observe(self, address: str, sidecar_id: str) -> None:
        key = self._key(address)
        self._failures.pop(key, None)
        state = self._peers.get(key)
        if state is None:
            return  # not a handshaken peer: nothing cached about it that could be stale
        state.last_seen = time.monotonic()
        state.consecutive_failures = 0
        if not sidecar_id:
            return
        if state.sidecar_id and state.sidecar_id != sidecar_id:
            log.warning("peer_restarted", peer=address, old_sidecar_id=state.sidecar_id, new_sidecar_id=sidecar_id)
            state.sidecar_id = sidecar_id
            await self.forget(address, "peer restarted")
        state.sidecar_id = sidecar_id

    async def _close_channel(self, address: str) -> None:
        entry = self._channels.pop(address, None)
        if entry is not None:
            await entry[0].close(grace=None)

    async def _channel(self, address: str) -> tuple[grpc.aio.Channel, peer_pb2_grpc.PeerServiceStub]:
        entry = self._channels.get(address)
        if entry is None:
            if len(self._channels) >= self._settings.max_peers:
                # Make room: channels to peers we never handshook that no call is using.
                for idle in [a for a in self._channels if a not in self._in_flight]:
                    if self._key(idle) not in self._peers:
                        await self._close_channel(idle)
                if len(self._channels) >= self._settings.max_peers:
                    raise ResourceExhausted(
                        f"connections to {len(self._channels)} peer sidecars are open, the limit is "
                        f"max_peers={self._settings.max_peers}"
                    )
            options = [
                ("grpc.max_send_message_length", self._settings.max_message_bytes),
                ("grpc.max_receive_message_length", self._settings.max_message_bytes),
                ("grpc.keepalive_time_ms", 20_000),
                ("grpc.keepalive_timeout_ms", 10_000),
                # Reconnect quickly after a peer restarts instead of backing off for minutes.
                ("grpc.max_reconnect_backoff_ms", 2_000),
            ]
            if self._settings.tls_enabled:
                assert self._settings.peer_tls_ca and self._settings.peer_tls_key and self._settings.peer_tls_cert
                credentials = grpc.ssl_channel_credentials(
                    root_certificates=self._settings.peer_tls_ca.read_bytes(),
                    private_key=self._settings.peer_tls_key.read_bytes(),
                    certificate_chain=self._settings.peer_tls_cert.read_bytes(),
                )
                channel = grpc.aio.secure_channel(address, credentials, options=options)
            else:
                channel = grpc.aio.insecure_channel(address, options=options)
            entry = (channel, peer_pb2_grpc.PeerServiceStub(channel))
            self._channels[address] = entry
        return entry

    def _remember(self, address: str) -> _PeerState:
        """The table entry of a peer that just completed a handshake. A full table first drops
        peers with no cached engine (forgotten), least recently seen first."""
        key = self._key(address)
        state = self._peers.get(key)
        if state is not None:
            return state
        if len(self._peers) >= self._settings.max_peers:
            cached = {peer for peer, _ in self._engines}
            stale = sorted((s.last_seen, k) for k, s in self._peers.items() if k not in cached)
            for _, old in stale[: len(self._peers) - self._settings.max_peers + 1]:
                del self._peers[old]
            if len(self._peers) >= self._settings.max_peers:
                raise ResourceExhausted(
                    f"{len(self._peers)} peer sidecars are in use, the limit is max_peers={self._settings.max_peers}"
                )
        state = self._peers[key] = _PeerState(address=address)
        return state

    @staticmethod
    def _key(address: str) -> str:
        return normalize_address(address) if address else ""

    def status(self) -> list[engine_pb2.PeerStatus]:
        now = time.monotonic()
        rows = []
        for key, state in sorted(self._peers.items()):
            rows.append(
                engine_pb2.PeerStatus(
                    address=state.address,
                    sidecar_id=state.sidecar_id,
                    engine_ids=sorted(engine for peer, engine in self._engines if peer == key),
                    last_seen_seconds_ago=now - state.last_seen if state.last_seen else -1.0,
                    handshake_ms=state.handshake_ms,
                    clock_offset_ms=state.clock_offset_ms,
                    consecutive_failures=state.consecutive_failures,
                )
            )
        return rows

    def failures(self, address: str) -> int:
        return self._failures.get(self._key(address), 0)

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()


def _responder_id(response: Any) -> str:
    if isinstance(response, peer_pb2.HandshakeResponse):
        return str(response.sidecar.sidecar_id)
    return str(getattr(response, "sidecar_id", ""))
