"""The typed client of peer sidecars, and the handshake cache.

One method per PeerService RPC (``handshake``, ``push_reg``, ``heartbeat``, ``query_cache``,
``transfer_failed``, ``release``, ``get_digests``, ``trace``), each a row of one table
(``peers.rpcs``) and every one a ``PeerClient.call``. Each goes to this sidecar's own handlers
through the routing table (``peers.routes``) when the address is our own (the same-node path never
leaves the process), otherwise over a pooled gRPC channel (``peers.channels``) with a deadline: the
rows marked ``stream`` (PushReg, Heartbeat, TransferFailed, Release) on the peer's open stream
(``peers.stream``) when there is one, ending exactly as their unary calls would. Every response
names the peer's instance id; a new id means the peer restarted, so everything cached about it is
dropped (and its NIXL agents unloaded through ``on_peer_restart``), its stream closed, before the
next use re-handshakes.

Handshakes are cached per (address, engine) and deduplicated per key: a slow peer delays only the
requests that need it. Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc
from google.protobuf.message import Message

from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar import peer_features
from sidecar.config import Settings
from sidecar.dataplane.views import EngineView, view_from_descriptor
from sidecar.errors import (
    DRAINING,
    DeadlineExceeded,
    Draining,
    FailedPrecondition,
    NotFound,
    PeerInvalidArgument,
    ResourceExhausted,
    SidecarError,
    Unavailable,
    Unimplemented,
)
from sidecar.logs import get_logger
from sidecar.metrics import SidecarMetrics
from sidecar.peers.addresses import SelfAddresses, address_key
from sidecar.peers.channels import PeerChannels
from sidecar.peers.routes import LOCAL, PeerRoutes
from sidecar.peers.rpcs import PeerRpc, Req, Resp, peer_rpc
from sidecar.peers.stream import NotSent, PeerStreams

log = get_logger("kvsidecar.peers")


_STATUS_ERRORS: dict[grpc.StatusCode, type[SidecarError]] = {
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: PeerInvalidArgument,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
}


@dataclass
class _PeerState:
    address: str
    sidecar_id: str = ""
    last_seen: float = 0.0
    handshake_ms: float = 0.0
    clock_offset_ms: float = 0.0
    consecutive_failures: int = 0
    # The peer's versions and features at its last handshake (GetStatus shows them).
    versions: common_pb2.VersionInfo | None = None


class PeerClient:
    def __init__(
        self,
        settings: Settings,
        self_info: Callable[[], common_pb2.SidecarInfo],
        on_peer_restart: Callable[[str, list[str]], Awaitable[None]],
        metrics: SidecarMetrics,
    ) -> None:
        self._settings = settings
        self._self_info = self_info
        self._on_peer_restart = on_peer_restart
        self._metrics = metrics
        self._channels = PeerChannels(settings)
        self._local: PeerRoutes | None = None
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
        self._self_addresses = SelfAddresses()
        self.streams = PeerStreams()

    def bind_local(self, routes: PeerRoutes) -> None:
        """This sidecar's own handlers, for calls to its own address (set once by the node)."""
        self._local = routes

    def set_self_addresses(self, addresses: list[str]) -> None:
        """Our own PeerService addresses (advertised and bound), in every spelling we can think of."""
        self._self_addresses.set(addresses)

    def is_self(self, address: str) -> bool:
        return address in self._self_addresses

    def _routes(self) -> PeerRoutes:
        assert self._local is not None, "bind_local() was not called"
        return self._local

    # --- handshakes -------------------------------------------------------------------------

    async def engine(self, address: str, engine_id: str, compatibility_hash: str) -> EngineView:
        """The engine ``engine_id`` behind ``address``, handshaking once and caching the result.

        Our own engines are read from the registry every time: always current, never cached."""
        if self.is_self(address):
            return self._routes().local_engine_view(engine_id, compatibility_hash)
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
            response = await self.handshake(address, request)
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
        state.versions = response.sidecar.versions
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
            peer_version=response.sidecar.versions.kvsidecar,
            peer_features=sorted(peer_features(list(response.sidecar.versions.features))),
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
            self._callers[key] = self._callers.pop(key, info.address)
            while len(self._callers) > self._settings.max_peers:
                del self._callers[next(iter(self._callers))]
            state = self._peers.get(key)
            if state is not None and state.sidecar_id and state.sidecar_id != info.sidecar_id:
                log.warning(
                    "peer_restarted", peer=info.address, old_sidecar_id=state.sidecar_id, new_sidecar_id=info.sidecar_id
                )
                state.sidecar_id = info.sidecar_id
                self.streams.forget(info.address, info.sidecar_id)
                await self.forget(info.address, "peer restarted")

    def cached_view(self, address: str, engine_id: str) -> EngineView | None:
        """The engine as its last handshake described it, if one is cached (never dials)."""
        if self.is_self(address):
            try:
                return self._routes().local_engine_view(engine_id, "")
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

    # --- calls: one row per PeerService RPC (``peer_rpc``) -------------------------------------
    # Each is ``await client.<name>(address, request, wait_for_ready=True)`` -> the response.

    handshake = peer_rpc("Handshake", peer_pb2.HandshakeRequest, peer_pb2.HandshakeResponse)
    push_reg = peer_rpc("PushReg", peer_pb2.PushRegRequest, peer_pb2.PushRegResponse, identity=True, stream=True)
    heartbeat = peer_rpc("Heartbeat", peer_pb2.HeartbeatRequest, peer_pb2.HeartbeatResponse, identity=True, stream=True)
    query_cache = peer_rpc("QueryCache", peer_pb2.PeerQueryCacheRequest, peer_pb2.PeerQueryCacheResponse)
    transfer_failed = peer_rpc(
        "TransferFailed", peer_pb2.TransferFailedRequest, peer_pb2.TransferFailedResponse, identity=True, stream=True
    )
    release = peer_rpc("Release", peer_pb2.PeerReleaseRequest, peer_pb2.PeerReleaseResponse, identity=True, stream=True)
    get_digests = peer_rpc("GetDigests", peer_pb2.GetDigestsRequest, peer_pb2.GetDigestsResponse)
    # Target-side staging: the peer copies a chunk of a held request into a slot of its pool.
    stage = peer_rpc("Stage", peer_pb2.StageRequest, peer_pb2.StageResponse)
    trace = peer_rpc("Trace", common_pb2.TraceRequest, common_pb2.TraceResponse)

    def clock_offset_ms(self, address: str) -> float:
        """The peer's clock minus ours as estimated at its handshake (0 when never handshaken)."""
        state = self._peers.get(self._key(address))
        return state.clock_offset_ms if state is not None else 0.0

    async def call(self, rpc: PeerRpc[Req, Resp], address: str, request: Req, wait_for_ready: bool = True) -> Resp:
        """One PeerService call on ``address`` (or on ourselves) with the row's deadline.

        ``wait_for_ready=False`` fails at once (UNAVAILABLE) when nothing listens at ``address``,
        instead of waiting out the deadline for a peer that may be restarting: what a heartbeat
        wants, so a dead peer is detected in heartbeat periods, not periods + call timeouts."""
        if self.is_self(address):
            handler = getattr(self._routes(), rpc.route)
            local = await (handler(request, LOCAL) if rpc.identity else handler(request))
            return cast(Resp, local)
        key = self._key(address)
        stub = await self._channels.stub(address, self._may_close)
        self._in_flight[address] = self._in_flight.get(address, 0) + 1
        failed = False
        timeout = rpc.timeout(self._settings)
        deadline = time.monotonic() + timeout
        try:
            response: Message | None = None
            if rpc.stream:
                response = await self._on_stream(address, stub, rpc, request, timeout)
            if response is None:
                # wait_for_ready: a peer that is restarting (connection refused, channel backing
                # off) gets until the deadline to come back instead of failing the call at once.
                # A call the stream gave back unsent keeps what is left of its deadline.
                response = await getattr(stub, rpc.method)(
                    request, timeout=max(0.0, deadline - time.monotonic()), wait_for_ready=wait_for_ready
                )
        except grpc.aio.AioRpcError as exc:
            # UNIMPLEMENTED is an answer (an older peer without the RPC), not a failing peer.
            failed = exc.code() != grpc.StatusCode.UNIMPLEMENTED
            if failed:
                self._count_failure(key)
            error_type = _STATUS_ERRORS.get(exc.code(), Unavailable)
            if exc.code() == grpc.StatusCode.UNAVAILABLE and (exc.details() or "").startswith(DRAINING):
                error_type = Draining  # refused before it took effect: the peer did nothing of it
            raise error_type(f"peer {address}: {exc.code().name}: {exc.details()}") from None
        finally:
            self._in_flight[address] -= 1
            if not self._in_flight[address]:
                del self._in_flight[address]
                if failed and key not in self._peers:
                    # Never handshaken and not answering: keep no channel (each holds memory and a
                    # socket); a later call dials again.
                    await self._channels.close_one(address)
        await self._observe(address, _responder_id(response))
        return cast(Resp, response)

    async def _on_stream(
        self, address: str, stub: Any, rpc: PeerRpc[Req, Resp], request: Req, timeout: float
    ) -> Resp | None:
        """The call on the peer's stream (``peers.stream``); None: send it unary."""
        stream = self.streams.get(address, stub, self._channels.connected(address))
        if stream is None:
            return None
        try:
            answer = await stream.call(rpc.method, request, timeout)
        except NotSent:
            return None
        self.streams.answered(stream)
        response = rpc.response.FromString(answer)
        stream.sidecar_id = _responder_id(response)
        return response

    def _may_close(self, address: str) -> bool:
        """A channel the pool may close to make room: no call uses it, no handshake needs it."""
        return address not in self._in_flight and self._key(address) not in self._peers

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
            self.streams.forget(address, sidecar_id)
            await self.forget(address, "peer restarted")
        state.sidecar_id = sidecar_id

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
        return address_key(address)

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
                    versions=state.versions,
                )
            )
        return rows

    def failures(self, address: str) -> int:
        return self._failures.get(self._key(address), 0)

    @property
    def closed(self) -> bool:
        """Closed (the node stopped): the peer streams we serve end too (``api.peer``)."""
        return self.streams.closed

    async def close(self) -> None:
        self.streams.close()
        await self._channels.close()


def _responder_id(response: Message) -> str:
    if isinstance(response, peer_pb2.HandshakeResponse):
        return str(response.sidecar.sidecar_id)
    return str(getattr(response, "sidecar_id", ""))
