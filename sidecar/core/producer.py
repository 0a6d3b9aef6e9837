"""The producer side of a node: blocks a local engine offers to others.

A submitted request is held under a lease until its consumers are done with it:
- pull: each consumer READ carries a NIXL notification; once every local worker counted the
  notifications it expects, FINISHED_SENDING reaches the workers;
- push: a consumer's ``PushReg`` is matched with the submission (either may come first) and this
  sidecar WRITEs into the consumer's blocks, then FINISHED_SENDING; a failed WRITE sends the
  consumer an explicit ``TransferFailed``;
- the lease ends it otherwise (LEASE_EXPIRED); consumers' heartbeats extend it. A lease that ends
  while WRITEs are in flight frees the blocks only once they are all terminal.

A pull READ is one-sided: this side cannot see it, let alone cancel it. What bounds it is the
heartbeat: a consumer reads only after a heartbeat found the request here, and only until that
heartbeat's send time + ``lease_extension_seconds`` (its transport fails a READ seen DONE later).
So each heartbeat that finds a request moves its ``readable_until`` to receipt + extension, and
a request released by its engine (or whose hold TTL ends) while a consumer may still read it is
not handed back before then: it is ``closing`` (heartbeats answer "unknown", so no new READ
starts) until its consumers' notifications arrive or ``readable_until`` passes. The lease itself
always ends after ``readable_until``. This costs nothing on the hot path (no extra call per READ);
only a release that races a READ waits, for at most one lease extension. A submission the engine
vouched for (``kvsidecar.voucher``: consumers may READ without a heartbeat until the voucher's
time) moves ``readable_until`` and the lease to that time + the clock skew allowance at once.

Blocks held with HoldBlocks (multi-turn) are producer requests too, with a fixed TTL.

The push writer (matching registrations with submissions, the WRITEs, releases either side made
before the other came) is ``core.push``; the request record and who may act on it,
``core.producer_request``.
Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import time

from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar.core import validation
from sidecar.core.arrivals import await_engine
from sidecar.core.context import NodeContext
from sidecar.core.early_notices import EarlyNotice, EarlyNotices, ReadNotice, ReleaseNotice
from sidecar.core.holds import Holds
from sidecar.core.matching import base_request_id
from sidecar.core.producer_request import ProducerRequest, RequestKey, authorize, count_blocks, held_for_pull
from sidecar.core.push import PushWriter
from sidecar.core.registry import PRODUCER_ROLES, Engine, Worker
from sidecar.core.timers import DeadlineTimer
from sidecar.core.trace import notice_handoff, since_rpc
from sidecar.dataplane.integrity import DigestSpan, check_span, digests
from sidecar.dataplane.plan.blocks import check_block_ids, foreign_block_ids
from sidecar.dataplane.plan.convert import single_group
from sidecar.dataplane.plan.layout import BlockIds
from sidecar.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
)
from sidecar.logs import get_logger

log = get_logger("kvsidecar.producer")
_MODE_NAMES = {number: name for name, number in common_pb2.TransferMode.items()}  # not values() per call


class ProducerSide:
    def __init__(self, ctx: NodeContext, holds: Holds) -> None:
        self._ctx = ctx
        self._holds = holds
        self.requests: dict[RequestKey, ProducerRequest] = {}
        self._by_transfer: dict[tuple[str, str], RequestKey] = {}
        self.leases: DeadlineTimer[RequestKey] = DeadlineTimer(self._on_leases_expired)
        # READ notifications and releases that came before their request's SubmitBlocks (a vouched pull).
        self._early: EarlyNotices[RequestKey] = EarlyNotices(ctx.settings.producer_unknown_grace_seconds)
        self.push = PushWriter(ctx, self)

    # --- EngineService ------------------------------------------------------------------------

    async def submit(self, request: engine_pb2.SubmitBlocksRequest) -> engine_pb2.SubmitBlocksResponse:
        ctx = self._ctx
        validation.identifier(request.engine_id, "engine_id")
        validation.identifier(request.request_id, "request_id")
        validation.identifier(request.transfer_id, "transfer_id", required=False)
        blocks = validation.block_ids(request.block_ids, "block_ids", ctx.settings.max_blocks_per_request)
        lease = validation.duration(request.lease_seconds, "lease_seconds", ctx.settings.lease_seconds)
        if request.vouched_until_ms / 1000.0 - time.time() > 86400:  # a past one is simply over
            raise InvalidArgument("vouched_until_ms", "must be a Unix time in milliseconds within the next 24 hours")
        if request.mode not in _MODE_NAMES:
            raise InvalidArgument("mode", f"unknown transfer mode {request.mode}")
        engine = ctx.registry.require_engine(request.engine_id, "engine_id", PRODUCER_ROLES)
        self._check_blocks(engine, blocks, "block_ids")
        existing = self.requests.get((request.engine_id, request.request_id))
        if existing is not None:
            if existing.block_ids != blocks:
                raise FailedPrecondition(f"request {request.request_id!r} was already submitted with other blocks")
            self.leases.extend(existing.key, time.monotonic() + lease)
            self._hold_vouched(existing, request.vouched_until_ms)
            return self._submitted(engine, lease, existing.writing)
        # Not by queueing delay: the consumer registered the push already, so a refusal here costs
        # both sides more than it saves (measured, bench/README.md "Overload"); its WRITEs count.
        ctx.tasks.check_capacity(len(self.requests))
        pending = ProducerRequest(
            engine_id=request.engine_id,
            request_id=request.request_id,
            transfer_id=request.transfer_id,
            block_ids=blocks,
            num_tokens=request.num_tokens,
            mode=request.mode,
            lease_seconds=lease,
        )
        self._add(pending)
        self._hold_vouched(pending, request.vouched_until_ms)
        ctx.trace.event(
            "producer",
            pending.engine_id,
            pending.request_id,
            "admitted",
            f"SubmitBlocks: {count_blocks(blocks)} blocks, {_MODE_NAMES[request.mode]}, lease {lease:g}s",
            transfer_id=pending.transfer_id,
            measured=since_rpc(),
            mode="pull" if request.mode == common_pb2.TRANSFER_MODE_PULL else "",
        )
        matched = self.push.submitted(pending) if pending.accepts_push else False
        self.push.update_gauges()
        log.debug("blocks_submitted", engine_id=pending.engine_id, request_id=pending.request_id, matched=matched)
        if pending.accepts_pull:
            self._apply_early(pending)
        return self._submitted(engine, lease, matched)

    def _apply_early(self, pending: ProducerRequest) -> None:
        """Apply, in their order, what the consumer said before this request came (a vouched pull
        reaches this sidecar without waiting for the engine's SubmitBlocks)."""
        for early in self._early.take(pending.key, time.monotonic()):
            if pending.key not in self.requests:
                return
            if isinstance(early, ReadNotice):
                # Not a loop wake-up's delay: the notification waited for this request.
                self._count_notice(pending, early._replace(seen_at=0.0))
            else:
                self.apply_early_release(pending, early)

    def apply_early_release(self, pending: ProducerRequest, early: ReleaseNotice) -> None:
        """A consumer released ``pending`` before it came here: free it now, if that consumer may."""
        try:
            authorize(pending, early.identity, "Release", f"request {pending.engine_id}/{pending.request_id}")
        except PermissionDenied:
            return  # logged; the engine's SubmitBlocks must not fail for a stranger's call
        self._release_by_consumer(pending, early.consumed, f"{early.reason} (before its SubmitBlocks came)")

    def _submitted(self, engine: Engine, lease: float, matched: bool) -> engine_pb2.SubmitBlocksResponse:
        seconds = self._ctx.settings.voucher_seconds
        return engine_pb2.SubmitBlocksResponse(
            lease_seconds=lease,
            push_matched=matched,
            voucher_key=engine.voucher_key if seconds > 0 else b"",
            voucher_seconds=seconds,
            voucher_clock_skew_seconds=self._ctx.settings.voucher_clock_skew_seconds,
        )

    def _hold_vouched(self, pending: ProducerRequest, until_ms: int) -> None:
        """The engine vouched for the blocks until ``until_ms`` (Unix ms): a consumer may READ them
        until then without asking, so neither a release nor the lease frees them earlier unless a
        READ notified (kvsidecar.voucher). Its validity is the engine's own choice about its own
        blocks (``submit`` bounds it). 0 (not vouched) or a time long past holds nothing."""
        remaining = until_ms / 1000.0 - time.time()
        if until_ms <= 0 or remaining <= -self._ctx.settings.voucher_clock_skew_seconds:
            return
        until = time.monotonic() + remaining + self._ctx.settings.voucher_clock_skew_seconds
        pending.readable_until = max(pending.readable_until, until)
        self.leases.extend(pending.key, until)

    async def hold(self, request: engine_pb2.HoldBlocksRequest) -> engine_pb2.HoldBlocksResponse:
        """Hold a finished request's blocks for a TTL so a peer can pull them (multi-turn).

        The engine's holds may occupy at most ``hold_max_share`` of its blocks: past that the
        oldest holds nobody may be reading are released first (LEASE_EXPIRED gives the engine its
        blocks back); a hold larger than the whole share is refused (RESOURCE_EXHAUSTED). A new
        hold of a conversation supersedes the engine's earlier holds of it."""
        ctx = self._ctx
        validation.identifier(request.engine_id, "engine_id")
        validation.identifier(request.request_id, "request_id")
        validation.identifier(request.conversation_id, "conversation_id", required=False)
        blocks = validation.block_ids(request.block_ids, "block_ids", ctx.settings.max_blocks_per_request)
        hashes = validation.block_hashes(request.block_hashes, "block_hashes", len(blocks[0]) if blocks else 0)
        ttl = validation.duration(request.ttl_seconds, "ttl_seconds", ctx.settings.hold_ttl_seconds)
        engine = ctx.registry.require_engine(request.engine_id, "engine_id")
        self._check_blocks(engine, blocks, "block_ids")
        key = (request.engine_id, request.request_id)
        if key in self.requests:
            raise FailedPrecondition(f"request {request.request_id!r} already has blocks held or submitted")
        ctx.tasks.check_capacity(len(self.requests))
        if request.conversation_id:
            self._release_superseded(request.engine_id, request.conversation_id)
        released = self._make_room(engine, sum(len(group) for group in blocks))
        pending = ProducerRequest(
            engine_id=request.engine_id,
            request_id=request.request_id,
            transfer_id="",
            block_ids=blocks,
            num_tokens=request.num_tokens,
            mode=common_pb2.TRANSFER_MODE_PULL,
            lease_seconds=ttl,
            held=True,
        )
        self._add(pending)
        self._holds.hold(
            pending.engine_id,
            pending.request_id,
            request.conversation_id,
            pending.block_ids,
            pending.num_tokens,
            hashes,
        )
        return engine_pb2.HoldBlocksResponse(ttl_seconds=ttl, released_holds=released)

    def _releasable(self, key: tuple[str, str], now: float) -> ProducerRequest | None:
        """A held request that may be handed back now: not closing, and no consumer may read it."""
        pending = self.requests.get(key)
        if pending is None or pending.closing is not None or pending.readable_until > now:
            return None
        return pending

    def _release_superseded(self, engine_id: str, conversation_id: str) -> None:
        """A conversation's new turn supersedes the engine's earlier holds for it (a later turn's
        KV extends the earlier one's); those nobody reads are released now, not at their TTL."""
        now = time.monotonic()
        for match in self._holds.index.query(conversation_id=conversation_id, engine_id=engine_id):
            pending = self._releasable((engine_id, match.entry.request_id), now)
            if pending is not None:
                reason = "superseded by the conversation's next turn"
                self.finish(pending, engine_pb2.FINISHED_SENDING, reason=reason, hold_end="superseded")

    def _make_room(self, engine: Engine, wanted: int) -> int:
        """Release the engine's oldest holds until ``wanted`` more blocks fit in its share;
        returns how many were released. Holds a consumer may be reading are skipped."""
        ctx = self._ctx
        share = ctx.settings.hold_max_share
        cap = int(share * engine.num_blocks // max(1, engine.physical_per_logical))
        if wanted > cap:
            ctx.metrics.hold_releases.labels(reason="refused_over_cap").inc()
            raise ResourceExhausted(
                f"block_ids: {wanted} blocks exceed the hold cap of engine {engine.engine_id!r} "
                f"({share:g} of its blocks = {cap}); the engine keeps them"
            )
        index = self._holds.index
        released = 0
        now = time.monotonic()
        for held in index.oldest_of_engine(engine.engine_id):
            if index.blocks_of_engine(engine.engine_id) + wanted <= cap:
                break
            pending = self._releasable((held.engine_id, held.request_id), now)
            if pending is None:
                continue
            log.info("hold_released_for_room", engine_id=engine.engine_id, request_id=pending.request_id, cap=cap)
            reason = f"hold cap ({share:g} of the engine's blocks): released for a newer hold"
            self.finish(pending, engine_pb2.LEASE_EXPIRED, reason=reason, hold_end="cap")
            released += 1
        if index.blocks_of_engine(engine.engine_id) + wanted > cap:
            raise ResourceExhausted(
                f"block_ids: the hold cap of engine {engine.engine_id!r} ({cap} blocks) is taken by holds being read"
            )
        return released

    def release(self, engine_id: str, request_id: str, transfer_id: str, reason: str) -> bool:
        """The local engine aborts or frees a request. Returns False if nothing was known of it."""
        pending = self._find(engine_id, request_id, transfer_id)
        if pending is None:
            # A consumer may already wait for this request's push (both legs dispatched at once, and
            # the prefill failed): it learns now, not at its watchdog.
            return self.push.engine_released_unknown(engine_id, request_id, transfer_id, reason)
        if pending.writing:
            pending.end_after_writes(engine_pb2.FINISHED_SENDING, f"released: {reason}")
            return True
        if pending.accepts_push:
            self.push.keep_released(engine_id, pending.transfer_id, pending.request_id, reason)
        self._finish_when_unread(pending, engine_pb2.FINISHED_SENDING, f"released: {reason}")
        return True

    # --- PeerService --------------------------------------------------------------------------

    # ``identity`` (the PeerService handlers below): the caller's certificate names with mTLS, ""
    # without (a plaintext port, the local Unix socket, or this sidecar calling itself).

    async def handle_get_digests(self, request: peer_pb2.GetDigestsRequest) -> peer_pb2.GetDigestsResponse:
        """Integrity, pull: digests of a held request's span, hashed from the engine's memory in a
        worker thread (a task of the engine, so the worker's memory outlives it)."""
        ctx = self._ctx
        validation.identifier(request.engine_id, "engine_id")
        validation.identifier(request.request_id, "request_id", required=False)
        validation.identifier(request.transfer_id, "transfer_id", required=False)
        pending = held_for_pull(self.find(request.engine_id, request.request_id, request.transfer_id), request)
        engine = ctx.registry.require_engine(pending.engine_id, "engine_id")
        span = DigestSpan.from_proto(request.span)
        layout = engine.ordered_workers()[0].layout
        problem = check_span(span, len(single_group(pending.block_ids, "the request")) * layout.block_size)
        if problem:
            raise InvalidArgument("span", problem)
        values = await self.digest(pending, engine, span)
        return peer_pb2.GetDigestsResponse(sidecar_id=ctx.identity.sidecar_id, digests=span.to_proto(values))

    async def digest(self, pending: ProducerRequest, engine: Engine, span: DigestSpan) -> list[bytes]:
        """Integrity: the digests of ``span`` of the request's blocks, hashed in a worker thread."""
        if any(worker.mem_type != "DRAM" for worker in engine.ordered_workers()):
            # Hashing reads the KV from the CPU: a device pointer read here would crash this sidecar.
            raise FailedPrecondition(
                f"integrity digests read KV from the CPU, and engine {engine.engine_id!r}'s KV is in GPU memory; "
                "run the consumer's sidecar with integrity=off for GPU engines"
            )
        layouts = [worker.layout for worker in engine.ordered_workers()]
        blocks = single_group(pending.block_ids, "the request")
        work = asyncio.to_thread(digests, layouts, blocks, 0, span)
        return await self._ctx.tasks.spawn(work, engines=[pending.engine_id])

    async def handle_heartbeat(
        self, request: peer_pb2.HeartbeatRequest, identity: str = ""
    ) -> peer_pb2.HeartbeatResponse:
        ctx = self._ctx
        validation.identifier(request.engine_id, "engine_id")
        await await_engine(ctx, request.engine_id)  # the consumer may be earlier than our engine
        unknown = []
        foreign = []
        extension = ctx.settings.lease_extension_seconds
        now = time.monotonic()
        for index, key in enumerate(request.requests):
            if not (key.request_id or key.transfer_id or key.consumer_request_id):
                raise InvalidArgument(f"requests[{index}]", "names no request")
            named = validation.block_ids(
                key.block_ids, f"requests[{index}].block_ids", ctx.settings.max_blocks_per_request, required=False
            )
            pending = self._find(request.engine_id, key.request_id, key.transfer_id)
            if pending is not None and pending.closing is None:
                authorize(pending, identity, "Heartbeat", f"request {request.engine_id}/{pending.request_id}")
                ctx.trace.event(
                    "producer",
                    pending.engine_id,
                    pending.request_id,
                    "heartbeat",
                    f"first heartbeat from consumer sidecar {request.caller_sidecar_id}",
                    ids=(key.consumer_request_id,),
                    peer_sidecar=request.caller_sidecar_id,
                    once=True,
                )
                if not pending.held:
                    self.leases.extend(pending.key, now + extension)
                pending.readable_until = max(pending.readable_until, now + extension)
                problem = foreign_block_ids(named, pending.block_ids)
                if problem:
                    # A consumer about to read blocks this request does not own (another request's KV).
                    log.warning(
                        "pull_names_foreign_blocks",
                        engine_id=pending.engine_id,
                        request_id=pending.request_id,
                        consumer_request_id=key.consumer_request_id,
                        problem=problem,
                    )
                    foreign.append(key)
                continue
            if pending is not None:
                unknown.append(key)  # released: no new READ may start
                continue
            if self.push.waits_for(request.engine_id, key.transfer_id, key.consumer_request_id):
                continue  # a push registration still waiting for its blocks, or being written
            unknown.append(key)
        engine = ctx.registry.engines.get(request.engine_id)
        return peer_pb2.HeartbeatResponse(
            sidecar_id=ctx.identity.sidecar_id,
            unknown=unknown,
            lease_seconds=extension,
            foreign_blocks=foreign,
            engine_generation=engine.generation if engine is not None else "",
        )

    async def handle_release(
        self, request: peer_pb2.PeerReleaseRequest, identity: str = ""
    ) -> peer_pb2.PeerReleaseResponse:
        """A consumer is done with a request (consumed it, or gave up on it)."""
        ctx = self._ctx
        validation.identifier(request.engine_id, "engine_id")
        if not request.consumed:
            # The consumer gave up (e.g. it found the engines incompatible): say why here too.
            log.warning(
                "consumer_released",
                engine_id=request.engine_id,
                request_id=request.request_id,
                consumer_request_id=request.consumer_request_id,
                peer=request.caller_sidecar_id,
                reason=request.reason,
            )
        if self.push.consumer_withdrew(request, identity):  # a push registration still waiting for its blocks
            return peer_pb2.PeerReleaseResponse(sidecar_id=ctx.identity.sidecar_id, found=True)
        pending = self._find(request.engine_id, request.request_id, request.transfer_id)
        if pending is None:
            writing = self.push.writing_for(request.consumer_request_id)
            pending = self.requests.get(writing) if writing is not None else None
        if pending is None:
            if request.request_id:  # a vouched pull that failed early: its SubmitBlocks may be on the way
                notice = ReleaseNotice(request.consumed, request.reason, identity)
                self._keep_early((request.engine_id, request.request_id), notice)
            return peer_pb2.PeerReleaseResponse(sidecar_id=ctx.identity.sidecar_id, found=False)
        authorize(pending, identity, "Release", f"request {pending.engine_id}/{pending.request_id}")
        in_flight = self._release_by_consumer(pending, request.consumed, request.reason)
        return peer_pb2.PeerReleaseResponse(sidecar_id=ctx.identity.sidecar_id, found=True, in_flight=in_flight)

    def _release_by_consumer(self, pending: ProducerRequest, consumed: bool, reason: str) -> bool:
        """The consumer is done with ``pending``: free it, or after its WRITEs (True)."""
        if pending.writing:
            pending.end_after_writes(engine_pb2.FINISHED_SENDING, f"released by consumer: {reason}")
            return True
        verb = "consumed" if consumed else "released"
        self.finish(pending, engine_pb2.FINISHED_SENDING, reason=f"{verb} by consumer: {reason}")
        return False

    # --- notifications ------------------------------------------------------------------------

    def on_notice(self, worker: Worker, notice: peer_pb2.TransferNotice, seen_at: float = 0.0) -> bool:
        """A consumer finished reading from ``worker``. Returns False if no request of ours can
        take it. ``seen_at``: when the NIXL owner thread saw the notification (time.monotonic())."""
        key = (notice.engine_id, notice.request_id)
        pending = self.requests.get(key)
        read = ReadNotice(worker.agent_name, notice.expected, notice.sender_sidecar_id, seen_at)
        if pending is not None:
            if not pending.accepts_pull:
                return False
            self._count_notice(pending, read)
            return True
        # Its SubmitBlocks may still be on the way (a vouched READ does not wait for it).
        return self._keep_early(key, read)

    def _keep_early(self, key: RequestKey, notice: EarlyNotice) -> bool:
        """Keep ``notice`` until its request's SubmitBlocks comes (``_apply_early``). False if
        ``key`` names no producer engine of ours: nothing can come for it."""
        engine = self._ctx.registry.engines.get(key[0])
        if engine is None or engine.role not in PRODUCER_ROLES:
            return False
        for engine_id, request_id in self._early.keep(key, notice, time.monotonic()):
            log.warning("notice_for_unknown_request", engine_id=engine_id, request_id=request_id,
                        hint="a consumer's READ notification or release came, but no SubmitBlocks for it; "
                        "it may have expired or been released")  # fmt: skip
        return True

    def _count_notice(self, pending: ProducerRequest, notice: ReadNotice) -> None:
        pending.notices.record(notice.agent_name, notice.expected)
        self._ctx.trace.event(
            "producer",
            pending.engine_id,
            pending.request_id,
            "notification",
            f"a consumer's READ from {notice.agent_name} completed",
            peer_sidecar=notice.sender_sidecar_id,
            measured=notice_handoff(notice.seen_at),
        )
        if pending.notices.complete(self._ctx.registry.agent_names(pending.engine_id)):
            kind, reason = pending.closing or (engine_pb2.FINISHED_SENDING, "")
            self.finish(pending, kind, reason=reason, hold_end="read")

    # --- leases and cleanup ---------------------------------------------------------------------

    def _on_leases_expired(self, keys: list[RequestKey]) -> None:
        for key in keys:
            pending = self.requests.get(key)
            if pending is None:
                continue
            what = "hold TTL" if pending.held else "lease"
            if pending.writing:
                pending.end_after_writes(engine_pb2.LEASE_EXPIRED, f"{what} of {pending.lease_seconds:g}s expired")
                continue
            if pending.closing is not None:
                self.finish(pending, *pending.closing)
                continue
            if pending.held and pending.readable_until > time.monotonic():
                self._finish_when_unread(pending, engine_pb2.LEASE_EXPIRED, f"{what} expired")
                continue
            self._ctx.metrics.leases_expired.inc()
            log.warning(
                "lease_expired",
                engine_id=pending.engine_id,
                request_id=pending.request_id,
                notifications=pending.notices.total,
                what=what,
            )
            reason = f"{what} of {pending.lease_seconds:g}s expired"
            self.finish(pending, engine_pb2.LEASE_EXPIRED, reason=reason, hold_end="ttl")

    def drop_engine(self, engine_id: str, reason: str) -> None:
        for pending in [p for p in self.requests.values() if p.engine_id == engine_id]:
            if not pending.writing:
                # Its memory is revoked only after this (a consumer's READ then fails): free now,
                # unless a consumer may still READ (on a voucher, or after a heartbeat), because an
                # engine that lives on must not get the blocks back before that READ's bound.
                self._finish_when_unread(pending, engine_pb2.FINISHED_SENDING, reason, hold_end="engine_gone")
            else:
                pending.end_after_writes(engine_pb2.FINISHED_SENDING, reason)
        self.push.drop_engine(engine_id, reason)

    def finish_all(self, reason: str) -> None:
        for pending in list(self.requests.values()):
            self.finish(pending, engine_pb2.FINISHED_SENDING, reason=reason)

    def _finish_when_unread(self, pending: ProducerRequest, kind: int, reason: str, hold_end: str = "released") -> None:
        """Free now (``hold_end`` as in ``finish``), or, if a consumer may still READ the blocks,
        once it notified or its READ bound (``readable_until``) passed. See the module docstring."""
        if pending.accepts_pull and pending.readable_until > time.monotonic():
            pending.closing = (kind, reason)
            self.leases.set(pending.key, pending.readable_until)
            log.info(
                "release_waits_for_reader",
                engine_id=pending.engine_id,
                request_id=pending.request_id,
                seconds=round(pending.readable_until - time.monotonic(), 3),
            )
            return
        self.finish(pending, kind, reason=reason, hold_end=hold_end)

    def awaiting_consumers(self) -> int:
        """Requests whose blocks a consumer has yet to take, what a stopping sidecar waits for:
        every submission, and a multi-turn hold only while a consumer may be reading it (its
        heartbeat found the hold: ``readable_until``). Idle holds, which live for minutes, are
        not waited for: they end at the stop and a later query finds none (P recomputes)."""
        now = time.monotonic()
        return sum(1 for pending in self.requests.values() if not pending.held or pending.readable_until > now)

    def _add(self, pending: ProducerRequest) -> None:
        self.requests[pending.key] = pending
        if pending.transfer_id:
            self._by_transfer[(pending.engine_id, pending.transfer_id)] = pending.key
        self.leases.set(pending.key, time.monotonic() + pending.lease_seconds)
        if pending.accepts_pull:
            self._ctx.dataplane.expect_notifications(1)
        self._ctx.metrics.leases.set(len(self.leases))

    def finish(self, pending: ProducerRequest, kind: int, reason: str = "", hold_end: str = "released") -> None:
        """End a request: its engine gets FINISHED_SENDING / LEASE_EXPIRED. ``hold_end`` labels why
        a held request ended (metrics: read, ttl, cap, superseded, released, engine_gone)."""
        if self.requests.pop(pending.key, None) is None:
            return
        if pending.transfer_id:
            self._by_transfer.pop((pending.engine_id, pending.transfer_id), None)
        self.leases.cancel(pending.key)
        self.push.forget(pending)
        if pending.accepts_pull:
            self._ctx.dataplane.expect_notifications(-1)
        if pending.held:
            self._holds.release(pending.key, hold_end)
        self._ctx.metrics.leases.set(len(self.leases))
        self.push.update_gauges()
        # The engine's event first: recording the end also derives the request's stages.
        self._ctx.events.emit(
            pending.engine_id,
            engine_pb2.Event(
                kind=kind,  # type: ignore[arg-type]
                request_id=pending.request_id,
                transfer_id=pending.transfer_id,
                reason=reason,
                bytes=pending.bytes_moved,
                duration_ms=(time.monotonic() - pending.created) * 1000.0,
            ),
        )
        self._ctx.trace.ended("producer", pending.engine_id, pending.request_id, kind, reason, pending.bytes_moved)

    def _find(self, engine_id: str, request_id: str, transfer_id: str) -> ProducerRequest | None:
        if request_id:
            found = self.requests.get((engine_id, request_id))
            if found is not None:
                return found
        if transfer_id:
            key = self._by_transfer.get((engine_id, transfer_id))
            if key is not None:
                return self.requests.get(key)
        if request_id:
            base = base_request_id(request_id)
            for pending in self.requests.values():
                if pending.engine_id == engine_id and base_request_id(pending.request_id) == base:
                    return pending
        return None

    find = _find  # the Stage route (core/staging.py) looks requests up too

    @staticmethod
    def _check_blocks(engine: Engine, blocks: BlockIds, field_name: str) -> None:
        problem = check_block_ids(blocks, engine.num_groups, engine.num_blocks, engine.physical_per_logical)
        if problem:
            raise InvalidArgument(field_name, problem)

    def status_rows(self) -> list[engine_pb2.RequestStatus]:
        rows = []
        for pending in self.requests.values():
            remaining = self.leases.remaining(pending.key)
            state = "writing" if pending.writing else ("held" if pending.held else "leased")
            rows.append(
                engine_pb2.RequestStatus(
                    engine_id=pending.engine_id,
                    request_id=pending.request_id,
                    transfer_id=pending.transfer_id,
                    side="producer",
                    mode=common_pb2.TRANSFER_MODE_PUSH if pending.writing else common_pb2.TRANSFER_MODE_PULL,
                    state=state,
                    deadline_in_seconds=remaining if remaining is not None else -1.0,
                    num_blocks=sum(len(group) for group in pending.block_ids),
                )
            )
        return rows
