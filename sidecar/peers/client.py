"""The typed client of peer sidecars, and the handshake cache.

One method per PeerService RPC (``handshake``, ``push_reg``, ``heartbeat``, ``query_cache``,
``transfer_failed``, ``release``). Each goes to this sidecar's own handlers through the routing
table (``peers.routes``) when the address is our own (the same-node path never leaves the
process), otherwise over a pooled gRPC channel (``peers.channels``) with a deadline. Every
response names the peer's instance id; a new id means the peer restarted, so everything cached
about it is dropped (and its NIXL agents unloaded through ``on_peer_restart``) before the next use
re-handshakes.

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

from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2, peer_pb2_grpc
from sidecar.config import Settings
from sidecar.dataplane.plane import EngineView, view_from_descriptor
from sidecar.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    PeerInvalidArgument,
    ResourceExhausted,
    SidecarError,
    Unavailable,
)
from sidecar.logs import get_logger
from sidecar.metrics import SidecarMetrics
from sidecar.peers.addresses import SelfAddresses, address_key
from sidecar.peers.channels import PeerChannels
from sidecar.peers.routes import LOCAL, PeerRoutes

log = get_logger("kvsidecar.peers")


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
            self._callers[key] = self._callers.pop(key, info.address)
            while len(self._callers) > self._settings.max_peers:
                del self._callers[next(iter(self._callers))]
            state = self._peers.get(key)
            if state is not None and state.sidecar_id and state.sidecar_id != info.sidecar_id:
                log.warning(
                    "peer_restarted", peer=info.address, old_sidecar_id=state.sidecar_id, new_sidecar_id=info.sidecar_id
                )
                state.sidecar_id = info.sidecar_id
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

    # --- calls ------------------------------------------------------------------------------

    async def handshake(
        self, address: str, request: peer_pb2.HandshakeRequest, wait_for_ready: bool = True
    ) -> peer_pb2.HandshakeResponse:
        response = await self._call(address, request, lambda r: r.handshake, lambda s: s.Handshake, wait_for_ready)
        return cast(peer_pb2.HandshakeResponse, response)

    async def push_reg(
        self, address: str, request: peer_pb2.PushRegRequest, wait_for_ready: bool = True
    ) -> peer_pb2.PushRegResponse:
        response = await self._call(
            address, request, lambda r: lambda q: r.push_reg(q, LOCAL), lambda s: s.PushReg, wait_for_ready
        )
        return cast(peer_pb2.PushRegResponse, response)

    async def heartbeat(
        self, address: str, request: peer_pb2.HeartbeatRequest, wait_for_ready: bool = True
    ) -> peer_pb2.HeartbeatResponse:
        response = await self._call(
            address, request, lambda r: lambda q: r.heartbeat(q, LOCAL), lambda s: s.Heartbeat, wait_for_ready
        )
        return cast(peer_pb2.HeartbeatResponse, response)

    async def query_cache(
        self, address: str, request: peer_pb2.PeerQueryCacheRequest, wait_for_ready: bool = True
    ) -> peer_pb2.PeerQueryCacheResponse:
        response = await self._call(address, request, lambda r: r.query_cache, lambda s: s.QueryCache, wait_for_ready)
        return cast(peer_pb2.PeerQueryCacheResponse, response)

    async def transfer_failed(
        self, address: str, request: peer_pb2.TransferFailedRequest, wait_for_ready: bool = True
    ) -> peer_pb2.TransferFailedResponse:
        response = await self._call(
            address,
            request,
            lambda r: lambda q: r.transfer_failed(q, LOCAL),
            lambda s: s.TransferFailed,
            wait_for_ready,
        )
        return cast(peer_pb2.TransferFailedResponse, response)

    async def release(
        self, address: str, request: peer_pb2.PeerReleaseRequest, wait_for_ready: bool = True
    ) -> peer_pb2.PeerReleaseResponse:
        response = await self._call(
            address, request, lambda r: lambda q: r.release(q, LOCAL), lambda s: s.Release, wait_for_ready
        )
        return cast(peer_pb2.PeerReleaseResponse, response)

    async def get_digests(
        self, address: str, request: peer_pb2.GetDigestsRequest, wait_for_ready: bool = True
    ) -> peer_pb2.GetDigestsResponse:
        response = await self._call(address, request, lambda r: r.get_digests, lambda s: s.GetDigests, wait_for_ready)
        return cast(peer_pb2.GetDigestsResponse, response)

    async def stage(self, address: str, request: peer_pb2.StageRequest) -> peer_pb2.StageResponse:
        """Target-side staging: the peer copies a chunk into a slot of its pool (Stage)."""
        response = await self._call(address, request, lambda r: r.stage, lambda s: s.Stage)
        return cast(peer_pb2.StageResponse, response)

    async def trace(self, address: str, request: common_pb2.TraceRequest) -> common_pb2.TraceResponse:
        response = await self._call(address, request, lambda r: r.trace, lambda s: s.Trace)
        return cast(common_pb2.TraceResponse, response)

    def clock_offset_ms(self, address: str) -> float:
        """The peer's clock minus ours as estimated at its handshake (0 when never handshaken)."""
        state = self._peers.get(self._key(address))
        return state.clock_offset_ms if state is not None else 0.0

    async def _call(
        self,
        address: str,
        request: Message,
        local: Callable[[PeerRoutes], Callable[[Any], Awaitable[Message]]],
        remote: Callable[[peer_pb2_grpc.PeerServiceStub], Callable[..., Awaitable[Message]]],
        wait_for_ready: bool = True,
    ) -> Message:
        """One PeerService call on ``address`` (or on ourselves) with a deadline.

        ``wait_for_ready=False`` fails at once (UNAVAILABLE) when nothing listens at ``address``,
        instead of waiting out the deadline for a peer that may be restarting: what a heartbeat
        wants, so a dead peer is detected in heartbeat periods, not periods + call timeouts."""
        if self.is_self(address):
            return await local(self._routes())(request)
        key = self._key(address)
        stub = await self._channels.stub(address, self._may_close)
        self._in_flight[address] = self._in_flight.get(address, 0) + 1
        failed = False
        try:
            # wait_for_ready: a peer that is restarting (connection refused, channel backing off)
            # gets until the deadline to come back instead of failing the call at once.
            response = await remote(stub)(
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
                    await self._channels.close_one(address)
        await self._observe(address, _responder_id(response))
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
                )
            )
        return rows

    def failures(self, address: str) -> int:
        return self._failures.get(self._key(address), 0)

    async def close(self) -> None:
        await self._channels.close()


def _responder_id(response: Message) -> str:
    if isinstance(response, peer_pb2.HandshakeResponse):
        return str(response.sidecar.sidecar_id)
    return str(getattr(response, "sidecar_id", ""))
