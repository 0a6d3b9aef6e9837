"""Per-request traces: what happened to each recent request on this sidecar, and the ``Trace``
query that joins the parts of the peer sidecars it touched.

``TraceRecorder`` keeps one ``Timeline`` per (side, engine, request) for the last
``trace_requests`` requests (a ring: a new request evicts the oldest; 0 turns tracing off), each
with at most ``MAX_EVENTS`` events (the terminal one always kept). Recording is a dict lookup and
an append; the producer, consumer and data plane call ``event`` / ``ended`` / ``hook`` / ``timed``
in one line each. A timeline remembers every id the request is known by (the peer engine's request
id, the consumer's request id, the transfer id) and the peer sidecars it involved, so a query by
any of them finds it and knows whom to ask. An index from each of those names to its timelines
makes a query cost what it finds, not the ring's size (a linear scan was 22 % of a loaded
sidecar's CPU while a benchmark queried each request).

``Tracing.query`` (``collect``) answers EngineService.Trace and PeerService.Trace: this sidecar's
timelines, then the peers' parts, asked concurrently with ``local_only`` (one hop) and every known
id. A peer that cannot answer becomes a part with the reason, never a failed query. The recorder
travels in the ``NodeContext`` (``ctx.trace``); the node owns the ``Tracing`` part.

Runs on the event loop thread (every hook is called there); nothing here does I/O except
``collect``'s peer calls.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from kvsidecar.v1 import common_pb2
from sidecar.core.events import kind_name
from sidecar.core.matching import base_request_id
from sidecar.dataplane.views import StepHook
from sidecar.errors import InvalidArgument, NotFound, SidecarError
from sidecar.peers.client import PeerClient

MAX_EVENTS = 64

# When the current gRPC call reached this sidecar's interceptor (time.monotonic(); 0: not in a
# call), set by sidecar.api.interceptor: the "admitted" events measure the servicer's part from it.
RPC_STARTED: contextvars.ContextVar[float] = contextvars.ContextVar("rpc_started", default=0.0)

_MAX_LEARNED_ADDRESSES = 4096
T = TypeVar("T")


@dataclass(slots=True)
class _Event:
    kind: str
    unix_s: float
    monotonic: float
    detail: str
    # Durations measured inside the step (NIXL's post and transfer times), by name, in seconds.
    measured: dict[str, float] = field(default_factory=dict)


@dataclass
class Timeline:
    side: str
    engine_id: str
    request_id: str
    transfer_id: str = ""
    mode: str = ""  # "pull" or "push" once known
    ids: set[str] = field(default_factory=set)
    peers: set[str] = field(default_factory=set)
    peer_sidecars: set[str] = field(default_factory=set)
    events: list[_Event] = field(default_factory=list)
    dropped: int = 0
    done: bool = False
    seq: int = 0  # creation order on its recorder (queries answer in that order)

    def names(self) -> set[str]:
        """Every name a query may find the timeline by."""
        return {self.request_id, base_request_id(self.request_id), self.transfer_id, *self.ids} - {""}

    def matches(self, wanted: set[str]) -> bool:
        return bool(self.names() & wanted)


class TraceRecorder:
    def __init__(self, capacity: int, on_done: Callable[[Timeline], None] | None = None) -> None:
        self.capacity = capacity
        # Told of each timeline once, when its terminal event is recorded (the stage histograms).
        self._on_done = on_done
        self._timelines: OrderedDict[tuple[str, str, str], Timeline] = OrderedDict()
        # Name (request id, its base, transfer id, other ids) -> keys of the timelines known by it;
        # and per key the names it was indexed under, so an eviction removes exactly those.
        self._by_name: dict[str, set[tuple[str, str, str]]] = {}
        self._indexed: dict[tuple[str, str, str], set[str]] = {}
        self._created = 0
        # Sidecar id -> address, learned from calls that name their caller (Handshake, PushReg),
        # so a producer can ask the consumer that pulled from it, which it knows only by id.
        self._addresses: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._timelines)

    # --- recording (hooks) ----------------------------------------------------------------------

    def event(
        self,
        side: str,
        engine_id: str,
        request_id: str,
        kind: str,
        detail: str = "",
        *,
        transfer_id: str = "",
        ids: Iterable[str] = (),
        peer: str = "",
        peer_sidecar: str = "",
        once: bool = False,
        done: bool = False,
        mode: str = "",
        measured: dict[str, float] | None = None,
    ) -> None:
        """Record ``kind`` for the request. ``ids``: other ids it is known by; ``peer`` /
        ``peer_sidecar``: a peer sidecar involved (by address / by id); ``once``: skip if the same
        kind and detail is already recorded; ``done``: a terminal event; ``mode``: the transfer
        mode once known; ``measured``: durations measured inside this step (seconds)."""
        if self.capacity <= 0:
            return
        key = (side, engine_id, request_id)
        timeline = self._timelines.get(key)
        if timeline is None:
            self._created += 1
            timeline = self._timelines[key] = Timeline(side, engine_id, request_id, seq=self._created)
            self._index(key, (request_id, base_request_id(request_id)))
            while len(self._timelines) > self.capacity:
                self._forget(*self._timelines.popitem(last=False))
        if transfer_id:
            timeline.transfer_id = transfer_id
            self._index(key, (transfer_id,))
        if mode:
            timeline.mode = mode
        if ids:
            new = [name for name in ids if name]
            timeline.ids.update(new)
            self._index(key, new)
        if peer:
            timeline.peers.add(peer)
        if peer_sidecar:
            timeline.peer_sidecars.add(peer_sidecar)
        if once and any(e.kind == kind and e.detail == detail for e in timeline.events):
            return
        if len(timeline.events) >= MAX_EVENTS and not done:
            timeline.dropped += 1
            return
        timeline.events.append(_Event(kind, time.time(), time.monotonic(), detail, dict(measured) if measured else {}))
        if done and not timeline.done:
            timeline.done = True
            if self._on_done is not None:
                self._on_done(timeline)

    def ended(self, side: str, engine_id: str, request_id: str, kind: int, reason: str = "", moved: int = 0) -> None:
        """The terminal event the engine gets (FINISHED_* is "finished", anything else "failed")."""
        name = kind_name(kind)
        finished = name.startswith("FINISHED")
        detail = f"{name}, {moved} bytes moved" + (f": {reason}" if reason else "")
        self.event(side, engine_id, request_id, "finished" if finished else "failed", detail, done=True)

    def hook(self, side: str, engine_id: str, request_id: str) -> StepHook:
        """A ``(kind, detail, measured)`` recorder for code that does not know the request (the
        data plane)."""

        def step(kind: str, detail: str, measured: dict[str, float] | None = None) -> None:
            self.event(side, engine_id, request_id, kind, detail, measured=measured)

        return step

    async def timed(self, side: str, engine_id: str, request_id: str, kind: str, what: str, work: Awaitable[T]) -> T:
        """Await ``work`` and record ``kind`` with how long it took, or why it failed."""
        started = time.monotonic()
        try:
            result = await work
        except BaseException as exc:
            elapsed = (time.monotonic() - started) * 1000.0
            self.event(side, engine_id, request_id, kind, f"{what}: failed after {elapsed:.2f} ms: {exc!r}")
            raise
        self.event(side, engine_id, request_id, kind, f"{what}: {(time.monotonic() - started) * 1000.0:.2f} ms")
        return result

    def learn(self, sidecar: common_pb2.SidecarInfo) -> None:
        """Remember a peer sidecar's address by its id."""
        if sidecar.sidecar_id and sidecar.address:
            self._addresses[sidecar.sidecar_id] = sidecar.address
            self._addresses.move_to_end(sidecar.sidecar_id)
            while len(self._addresses) > _MAX_LEARNED_ADDRESSES:
                self._addresses.popitem(last=False)

    # --- queries --------------------------------------------------------------------------------

    def find(self, wanted: set[str]) -> list[Timeline]:
        """The kept timelines known by any of ``wanted`` (or by its base request id), oldest first."""
        wanted = wanted | {base_request_id(name) for name in wanted}
        keys = set().union(*(self._by_name.get(name, ()) for name in wanted))
        found = [self._timelines[key] for key in keys]
        # The index may still name a timeline's earlier transfer id; matches() is the rule.
        return sorted((timeline for timeline in found if timeline.matches(wanted)), key=lambda t: t.seq)

    def _index(self, key: tuple[str, str, str], names: Iterable[str]) -> None:
        indexed = self._indexed.get(key)
        if indexed is None:
            indexed = self._indexed[key] = set()
        by_name = self._by_name
        for name in names:
            if name and name not in indexed:
                indexed.add(name)
                keys = by_name.get(name)
                if keys is None:
                    by_name[name] = {key}
                else:
                    keys.add(key)

    def _forget(self, key: tuple[str, str, str], timeline: Timeline) -> None:
        for name in self._indexed.pop(key, ()):
            keys = self._by_name.get(name)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_name[name]

    def peers_of(self, timelines: list[Timeline]) -> set[str]:
        peers = {peer for timeline in timelines for peer in timeline.peers}
        for timeline in timelines:
            peers.update(self._addresses[s] for s in timeline.peer_sidecars if s in self._addresses)
        return peers


def since_rpc() -> dict[str, float] | None:
    """An admission's ``measured``: the call reached the interceptor -> the request was admitted."""
    started = RPC_STARTED.get()
    return {"rpc_to_admit": max(0.0, time.monotonic() - started)} if started else None


def notice_handoff(seen_at: float) -> dict[str, float] | None:
    """A notification's ``measured``: the NIXL owner thread saw it -> the loop handled it."""
    return {"loop_wake": max(0.0, time.monotonic() - seen_at)} if seen_at else None


def to_proto(timeline: Timeline) -> common_pb2.RequestTimeline:
    start = timeline.events[0].monotonic if timeline.events else 0.0
    return common_pb2.RequestTimeline(
        engine_id=timeline.engine_id,
        request_id=timeline.request_id,
        transfer_id=timeline.transfer_id,
        side=timeline.side,
        done=timeline.done,
        events=[
            common_pb2.TraceEvent(
                kind=e.kind, unix_s=e.unix_s, offset_s=e.monotonic - start, detail=e.detail, measured_s=e.measured
            )
            for e in timeline.events
        ],
        dropped_events=timeline.dropped,
        peers=sorted(timeline.peers),
        other_ids=sorted(timeline.ids - {timeline.request_id}),
    )


def from_proto(line: common_pb2.RequestTimeline) -> Timeline:
    """A timeline as a Trace query returned it (offsets on one monotonic axis), e.g. to derive its
    stages elsewhere (sidecar.stages)."""
    timeline = Timeline(line.side, line.engine_id, line.request_id, line.transfer_id, done=line.done)
    timeline.events = [_Event(e.kind, e.unix_s, e.offset_s, e.detail, dict(e.measured_s)) for e in line.events]
    return timeline


PeerCall = Callable[[str, common_pb2.TraceRequest], Awaitable[common_pb2.TraceResponse]]


async def collect(
    recorder: TraceRecorder,
    request: common_pb2.TraceRequest,
    self_info: common_pb2.SidecarInfo,
    call_peer: PeerCall,
    is_self: Callable[[str], bool],
    clock_offset_ms: Callable[[str], float],
) -> common_pb2.TraceResponse:
    """This sidecar's timelines of the request, then (unless ``local_only``) each peer's part."""
    wanted = {request.request_id, request.transfer_id, *request.also_ids} - {""}
    if not wanted:
        raise InvalidArgument("request_id", "request_id or transfer_id is required")
    timelines = recorder.find(wanted)
    if not timelines:
        kept = f"it keeps the last {recorder.capacity} requests" if recorder.capacity > 0 else "tracing is off"
        raise NotFound(f"request_id: no trace of {', '.join(sorted(wanted))} on this sidecar ({kept})")
    response = common_pb2.TraceResponse(
        sidecars=[common_pb2.SidecarTrace(sidecar=self_info, requests=[to_proto(t) for t in timelines])]
    )
    if request.local_only:
        return response
    known = set(wanted)
    for timeline in timelines:
        known |= {timeline.request_id, timeline.transfer_id, *timeline.ids}
    ask = common_pb2.TraceRequest(local_only=True, also_ids=sorted(known - {""}))

    async def part(address: str) -> list[common_pb2.SidecarTrace]:
        try:
            answer = await call_peer(address, ask)
        except SidecarError as exc:
            return [common_pb2.SidecarTrace(sidecar=common_pb2.SidecarInfo(address=address), error=str(exc))]
        for each in answer.sidecars:
            each.clock_offset_ms = clock_offset_ms(address)
        return list(answer.sidecars)

    peers = sorted(peer for peer in recorder.peers_of(timelines) if not is_self(peer))
    for parts in await asyncio.gather(*(part(peer) for peer in peers)):
        response.sidecars.extend(parts)
    return response


class Tracing:
    """The Trace RPC of both services: this sidecar's part of a request and its peers' parts."""

    def __init__(
        self, recorder: TraceRecorder, self_info: Callable[[], common_pb2.SidecarInfo], peers: PeerClient
    ) -> None:
        self._recorder = recorder
        self._self_info = self_info
        self._peers = peers

    async def query(self, request: common_pb2.TraceRequest) -> common_pb2.TraceResponse:
        return await collect(
            self._recorder,
            request,
            self._self_info(),
            self._peers.trace,
            self._peers.is_self,
            self._peers.clock_offset_ms,
        )
