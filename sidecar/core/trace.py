"""Per-request traces: what happened to each recent request on this sidecar, and the ``Trace``
query that joins the parts of the peer sidecars it touched.

``TraceRecorder`` keeps one ``Timeline`` per (side, engine, request) for the last
``trace_requests`` requests (a ring: a new request evicts the oldest; 0 turns tracing off), each
with at most ``MAX_EVENTS`` events (the terminal one always kept). Recording is a dict lookup and
an append; the producer, consumer and data plane call ``event`` / ``ended`` / ``hook`` / ``timed``
in one line each. A timeline remembers every id the request is known by (the peer engine's request
id, the consumer's request id, the transfer id) and the peer sidecars it involved, so a query by
any of them finds it and knows whom to ask.

``Tracing.query`` (``collect``) answers EngineService.Trace and PeerService.Trace: this sidecar's
timelines, then the peers' parts, asked concurrently with ``local_only`` (one hop) and every known
id. A peer that cannot answer becomes a part with the reason, never a failed query. The recorder
travels in the ``NodeContext`` (``ctx.trace``); the node owns the ``Tracing`` part.

Runs on the event loop thread (every hook is called there); nothing here does I/O except
``collect``'s peer calls.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from kvsidecar.v1 import common_pb2, engine_pb2
from sidecar.core.matching import base_request_id
from sidecar.errors import InvalidArgument, NotFound, SidecarError
from sidecar.peers.client import PeerClient

MAX_EVENTS = 64
_MAX_LEARNED_ADDRESSES = 4096
T = TypeVar("T")


@dataclass
class _Event:
    kind: str
    unix_s: float
    monotonic: float
    detail: str


@dataclass
class Timeline:
    side: str
    engine_id: str
    request_id: str
    transfer_id: str = ""
    ids: set[str] = field(default_factory=set)
    peers: set[str] = field(default_factory=set)
    peer_sidecars: set[str] = field(default_factory=set)
    events: list[_Event] = field(default_factory=list)
    dropped: int = 0
    done: bool = False

    def matches(self, wanted: set[str]) -> bool:
        names = {self.request_id, base_request_id(self.request_id), self.transfer_id, *self.ids}
        return bool(names & wanted)


class TraceRecorder:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._timelines: OrderedDict[tuple[str, str, str], Timeline] = OrderedDict()
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
    ) -> None:
        """Record ``kind`` for the request. ``ids``: other ids it is known by; ``peer`` /
        ``peer_sidecar``: a peer sidecar involved (by address / by id); ``once``: skip if the same
        kind and detail is already recorded; ``done``: a terminal event."""
        if self.capacity <= 0:
            return
        key = (side, engine_id, request_id)
        timeline = self._timelines.get(key)
        if timeline is None:
            timeline = self._timelines[key] = Timeline(side, engine_id, request_id)
            while len(self._timelines) > self.capacity:
                self._timelines.popitem(last=False)
        if transfer_id:
            timeline.transfer_id = transfer_id
        timeline.ids.update(name for name in ids if name)
        if peer:
            timeline.peers.add(peer)
        if peer_sidecar:
            timeline.peer_sidecars.add(peer_sidecar)
        if once and any(e.kind == kind and e.detail == detail for e in timeline.events):
            return
        if len(timeline.events) >= MAX_EVENTS and not done:
            timeline.dropped += 1
            return
        timeline.events.append(_Event(kind, time.time(), time.monotonic(), detail))
        timeline.done = timeline.done or done

    def ended(self, side: str, engine_id: str, request_id: str, kind: int, reason: str = "", moved: int = 0) -> None:
        """The terminal event the engine gets (FINISHED_* is "finished", anything else "failed")."""
        name = engine_pb2.EventKind.Name(kind)
        finished = name.startswith("FINISHED")
        detail = f"{name}, {moved} bytes moved" + (f": {reason}" if reason else "")
        self.event(side, engine_id, request_id, "finished" if finished else "failed", detail, done=True)

    def hook(self, side: str, engine_id: str, request_id: str) -> Callable[[str, str], None]:
        """A ``(kind, detail)`` recorder for code that does not know the request (the data plane)."""
        return lambda kind, detail: self.event(side, engine_id, request_id, kind, detail)

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
        wanted = wanted | {base_request_id(name) for name in wanted}
        return [timeline for timeline in self._timelines.values() if timeline.matches(wanted)]

    def peers_of(self, timelines: list[Timeline]) -> set[str]:
        peers = {peer for timeline in timelines for peer in timeline.peers}
        for timeline in timelines:
            peers.update(self._addresses[s] for s in timeline.peer_sidecars if s in self._addresses)
        return peers


def to_proto(timeline: Timeline) -> common_pb2.RequestTimeline:
    start = timeline.events[0].monotonic if timeline.events else 0.0
    return common_pb2.RequestTimeline(
        engine_id=timeline.engine_id,
        request_id=timeline.request_id,
        transfer_id=timeline.transfer_id,
        side=timeline.side,
        done=timeline.done,
        events=[
            common_pb2.TraceEvent(kind=e.kind, unix_s=e.unix_s, offset_s=e.monotonic - start, detail=e.detail)
            for e in timeline.events
        ],
        dropped_events=timeline.dropped,
        peers=sorted(timeline.peers),
        other_ids=sorted(timeline.ids - {timeline.request_id}),
    )


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
