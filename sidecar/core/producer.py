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

Why ~1000 lines: one request table with one lease timer, matched, pushed, read, released and
expired, and the releases either side makes before the other came. The push writer (``handle_push_reg``,
``_start_push``, ``_push``, ``_send_transfer_failed``, the matcher and the withdrawn and released
push requests) is the next cut, into ``core/push.py``; it calls back into the request table
(``_finish``, ``_authorize``, the leases), so ``ProducerRequest`` moves to a module of its own
first (the import contracts forbid a cycle between the two).
Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar.core import validation
from sidecar.core.arrivals import await_engine
from sidecar.core.context import NodeContext
from sidecar.core.early_notices import EarlyNotice, EarlyNotices, ReadNotice, ReleaseNotice
from sidecar.core.handshake import check_compatibility
from sidecar.core.holds import Holds
from sidecar.core.matching import PushMatcher, Registration, Submission, base_request_id
from sidecar.core.notices import NoticeTally
from sidecar.core.registry import PRODUCER_ROLES, Engine, Worker
from sidecar.core.timers import DeadlineTimer
from sidecar.core.trace import notice_handoff, since_rpc
from sidecar.dataplane.integrity import DigestSpan, check_span, digests
from sidecar.dataplane.plan.blocks import check_block_ids, foreign_block_ids
from sidecar.dataplane.plan.convert import single_group
from sidecar.dataplane.plan.layout import BlockIds, PlanError
from sidecar.dataplane.plane import TransferJob
from sidecar.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SidecarError,
)
from sidecar.logs import get_logger

log = get_logger("kvsidecar.producer")

RequestKey = tuple[str, str]  # (engine_id, request_id)


class PushOrder(NamedTuple):
    """What a consumer's registration carries to the push it starts: its PushReg, the validated
    destination blocks, and the time (monotonic) after which no WRITE of it may be posted, which
    the answer promised the consumer (``writes_end_within_seconds``; see ``_writes_until``)."""

    request: peer_pb2.PushRegRequest
    blocks: BlockIds
    writes_until: float


@dataclass
class ProducerRequest:
    engine_id: str
    request_id: str
    transfer_id: str
    block_ids: BlockIds
    num_tokens: int
    mode: int
    lease_seconds: float
    created: float = field(default_factory=time.monotonic)
    notices: NoticeTally = field(default_factory=NoticeTally)
    writing: bool = False
    # While writing: the registration's deadline for posting a WRITE (``PushOrder.writes_until``).
    writes_until: float = 0.0
    held: bool = False
    bytes_moved: int = 0
    # Until when (monotonic) a consumer may still READ these blocks (see the module docstring).
    readable_until: float = 0.0
    # Released (or its hold TTL ended) but a consumer may still READ: the event to emit when freed.
    closing: tuple[int, str] | None = None
    # Why a push's blocks are freed once its WRITEs end: (event kind, reason).
    end: tuple[int, str] | None = None
    # The consumer's certificate identity (mTLS): from its push registration, or the first peer
    # that heartbeats or releases a pull. Other peers may not act on the request.
    peer_identity: str = ""

    @property
    def key(self) -> RequestKey:
        return (self.engine_id, self.request_id)

    @property
    def accepts_pull(self) -> bool:
        return self.mode != common_pb2.TRANSFER_MODE_PUSH

    @property
    def accepts_push(self) -> bool:
        return self.mode != common_pb2.TRANSFER_MODE_PULL and not self.held


class ProducerSide:
    def __init__(self, ctx: NodeContext, holds: Holds) -> None:
        self._ctx = ctx
        self._holds = holds
        self.requests: dict[RequestKey, ProducerRequest] = {}
        self._by_transfer: dict[tuple[str, str], RequestKey] = {}
        self.leases: DeadlineTimer[RequestKey] = DeadlineTimer(self._on_leases_expired)
        self.matcher: PushMatcher[PushOrder] = PushMatcher()
        # Push registrations waiting for blocks expire with the consumer's watchdog.
        self._registration_deadlines: DeadlineTimer[tuple[str, str]] = DeadlineTimer(self._on_registrations_expired)
        # Consumer (decode engine, request) -> producer request being written, for idempotent PushReg.
        self._pushing: dict[tuple[str, str], RequestKey] = {}
        # READ notifications and releases that came before their request's SubmitBlocks (a vouched pull).
        self._early: EarlyNotices[RequestKey] = EarlyNotices(ctx.settings.producer_unknown_grace_seconds)
        # Push registrations their consumer released before the blocks came (an abort during the
        # prefill), by (producer engine, "tid:" transfer id or "rid:" producer request id): the
        # blocks go back at SubmitBlocks instead of at the lease's end. Kept as long as a
        # registration waits (the consumer's push timeout, by default).
        self._withdrawn: EarlyNotices[tuple[str, str]] = EarlyNotices(ctx.settings.push_registration_timeout_seconds)
        # The mirror: push requests the producer engine released before any consumer registered
        # (a failed prefill, both legs dispatched at once), by the same keys: a PushReg for one is
        # refused at once instead of waiting for blocks that will not come.
        self._released: EarlyNotices[tuple[str, str]] = EarlyNotices(ctx.settings.push_registration_timeout_seconds)

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
        if request.mode not in common_pb2.TransferMode.values():
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
            f"SubmitBlocks: {_count(blocks)} blocks, {common_pb2.TransferMode.Name(request.mode)}, lease {lease:g}s",
            transfer_id=pending.transfer_id,
            measured=since_rpc(),
            mode="pull" if request.mode == common_pb2.TRANSFER_MODE_PULL else "",
        )
        matched = False
        if pending.accepts_push:
            if len(self._released):
                # Submitted again (a router that retried the prefill leg): live again.
                for key in _withdrawal_keys(pending.engine_id, pending.transfer_id, pending.request_id):
                    self._released.take(key, time.monotonic())
            registration = self.matcher.add_submission(
                Submission(pending.engine_id, pending.request_id, pending.transfer_id)
            )
            if registration is not None:
                self._start_push(pending, registration)
                matched = True
            else:
                self._apply_withdrawn(pending)
        self._update_gauges()
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
                self._apply_early_release(pending, early)

    def _apply_withdrawn(self, pending: ProducerRequest) -> None:
        """Free an unmatched push submission whose consumer released its registration before it came."""
        if not len(self._withdrawn):
            return
        now = time.monotonic()
        found = [
            notice
            for key in _withdrawal_keys(pending.engine_id, pending.transfer_id, pending.request_id)
            for notice in self._withdrawn.take(key, now)
            if isinstance(notice, ReleaseNotice)
        ]
        if found:
            self._apply_early_release(pending, found[0])

    def _apply_early_release(self, pending: ProducerRequest, early: ReleaseNotice) -> None:
        try:
            self._authorize(pending, early.identity, "Release", f"request {pending.engine_id}/{pending.request_id}")
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
                self._finish(pending, engine_pb2.FINISHED_SENDING, reason=reason, hold_end="superseded")

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
            self._finish(pending, engine_pb2.LEASE_EXPIRED, reason=reason, hold_end="cap")
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
            # the prefill failed): withdraw its registration and tell it now, not at its watchdog.
            registration = self.matcher.registration_matching(Submission(engine_id, request_id, transfer_id))
            if registration is None:
                self._keep_released(engine_id, transfer_id, request_id, reason)
                return False
            self.matcher.remove_registration(registration.key)
            self._registration_deadlines.cancel(registration.key)
            self._update_gauges()
            request = registration.order.request
            self._ctx.tasks.spawn(
                self._send_transfer_failed(request.caller.address, request, f"the producer released it: {reason}"),
                engines=[],
            )
            return True
        if pending.writing:
            self._end_after_writes(pending, engine_pb2.FINISHED_SENDING, f"released: {reason}")
            return True
        if pending.accepts_push:
            self._keep_released(engine_id, pending.transfer_id, pending.request_id, reason)
        self._finish_when_unread(pending, engine_pb2.FINISHED_SENDING, f"released: {reason}")
        return True

    def _keep_released(self, engine_id: str, transfer_id: str, request_id: str, reason: str) -> None:
        notice = ReleaseNotice(False, reason, "")
        for key in _withdrawal_keys(engine_id, transfer_id, request_id):
            for engine, token in self._released.keep(key, notice, time.monotonic()):
                log.debug("released_push_request_forgotten", engine_id=engine, token=token)

    def _refuse_if_released(self, registration: Registration[PushOrder], now: float) -> None:
        """A consumer registers for a request its producer engine already released."""
        if not len(self._released):
            return
        ids = (registration.engine_id, registration.transfer_id, registration.prefill_request_id)
        for key in _withdrawal_keys(*ids):
            released = [notice for notice in self._released.peek(key, now) if isinstance(notice, ReleaseNotice)]
            if released:
                kind, value = key[1].split(":", 1)
                named = "transfer id" if kind == "tid" else "request id"
                raise FailedPrecondition(
                    f"producer engine {registration.engine_id} released the request ({named} {value!r}) "
                    f"before this push registration came: {released[0].reason}"
                )

    # --- PeerService --------------------------------------------------------------------------

    def _authorize(
        self, holder: ProducerRequest | Registration[PushOrder], identity: str, action: str, what: str
    ) -> None:
        """With mTLS, only the peer that is a party to a transfer may act on it (``sidecar.tls``).
        The first authenticated peer to act on a pull claims it; a push is its registration's."""
        if not identity:
            return
        current = holder.peer_identity if isinstance(holder, ProducerRequest) else holder.identity
        if not current:
            if isinstance(holder, ProducerRequest):
                holder.peer_identity = identity
            return
        if current != identity:
            log.warning("peer_refused", action=action, request=what, peer_identity=identity, party=current)
            raise PermissionDenied(
                f"{action}: {what} belongs to the peer with certificate {current!r}, not {identity!r}"
            )

    # ``identity`` (the PeerService handlers below): the caller's certificate names with mTLS, ""
    # without (a plaintext port, the local Unix socket, or this sidecar calling itself).

    def _writes_until(self, request: peer_pb2.PushRegRequest, timeout: float, arrival: float) -> float:
        """When (monotonic) the WRITEs of a registration must be posted by (``PushOrder``): its
        timeout from the arrival, which the consumer measures from its receipt of our answer, which
        is later; and the consumer's own ``write_by`` less the clock allowance, which holds for a
        PushReg that waited (our process stopped) before we got to it. Refuses one already over."""
        writes_until = arrival + timeout
        if request.write_by_unix_ms:
            skew = self._ctx.settings.voucher_clock_skew_seconds
            remaining = request.write_by_unix_ms / 1000.0 - time.time() - skew
            if remaining <= 0:
                raise FailedPrecondition(
                    f"write_by_unix_ms: push registration {request.decode_engine_id}/{request.request_id} was "
                    f"handled {-remaining:.3f} s after its time less the clock allowance "
                    f"(voucher_clock_skew_seconds = {skew:g}) was over; the consumer has given up on it, its "
                    f"timeout ({timeout:g} s) is too short, or this node's clock is ahead of the consumer's"
                )
            writes_until = min(writes_until, arrival + remaining)
        return writes_until

    def _writes_end_within(self, writes_until: float, arrival: float) -> float:
        """The promise in a PushReg answer: the last WRITE is posted by ``writes_until`` and ends
        (or is failed) within ``transfer_timeout_seconds`` of its post."""
        return max(0.0, writes_until - arrival) + self._ctx.settings.transfer_timeout_seconds

    async def handle_push_reg(self, request: peer_pb2.PushRegRequest, identity: str = "") -> peer_pb2.PushRegResponse:
        ctx = self._ctx
        validation.identifier(request.prefill_engine_id, "prefill_engine_id")
        validation.identifier(request.decode_engine_id, "decode_engine_id")
        validation.identifier(request.request_id, "request_id")
        validation.identifier(request.transfer_id, "transfer_id", required=False)
        validation.identifier(request.prefill_request_id, "prefill_request_id", required=False)
        blocks = validation.block_ids(request.block_ids, "block_ids", ctx.settings.max_blocks_per_request)
        validation.address(request.caller.address, "caller.address")
        timeout = validation.duration(
            request.timeout_seconds, "timeout_seconds", ctx.settings.push_registration_timeout_seconds
        )
        arrival = time.monotonic()
        writes_until = self._writes_until(request, timeout, arrival)
        await await_engine(ctx, request.prefill_engine_id)  # the consumer may be earlier than our engine
        if time.monotonic() >= writes_until:
            raise FailedPrecondition(
                f"push registration {request.decode_engine_id}/{request.request_id}: its time to post WRITEs "
                "was over while it waited for the prefill engine to register"
            )
        engine = ctx.registry.engines.get(request.prefill_engine_id)
        if engine is None:
            raise NotFound(f"prefill_engine_id: engine {request.prefill_engine_id!r} is not served by this sidecar")
        # A restarted consumer sidecar or a re-registered consumer engine invalidates what we cached
        # about it: handshake again rather than write into agents that no longer exist.
        await ctx.peers.note_caller(request.caller)
        cached = ctx.peers.cached_generation(request.caller.address, request.decode_engine_id)
        if cached is not None and request.decode_generation and cached != request.decode_generation:
            await ctx.peers.forget_engine(request.caller.address, request.decode_engine_id, "engine re-registered")
        ctx.registry.require_engine(request.prefill_engine_id, "prefill_engine_id", PRODUCER_ROLES)
        check_compatibility(
            engine, request.compatibility_hash, f"decode engine {request.decode_engine_id}", ctx.metrics
        )
        # The consumer's geometry, if we already know it: ids past its blocks would be written into
        # whatever lies behind them. (Unknown yet: checked after the handshake, before any WRITE.)
        known = ctx.peers.cached_view(request.caller.address, request.decode_engine_id)
        problem = known.block_ids_problem(blocks) if known is not None else None
        if problem:
            raise InvalidArgument("block_ids", problem)
        reg_key = (request.decode_engine_id, request.request_id)
        what = f"push registration {request.decode_engine_id}/{request.request_id}"
        existing = self.matcher.find_registration(reg_key)
        if existing is not None:
            self._authorize(existing, identity, "PushReg", what)
        elif reg_key in self._pushing and self._pushing[reg_key] in self.requests:
            self._authorize(self.requests[self._pushing[reg_key]], identity, "PushReg", what)
        if reg_key in self._pushing or existing is not None:
            # A repeated registration: the first one is already matched or waiting, and its
            # deadline is the one the WRITEs keep.
            if existing is not None:
                first = existing.order.writes_until
            else:
                writing = self.requests.get(self._pushing[reg_key])
                first = writing.writes_until if writing is not None else writes_until
            return peer_pb2.PushRegResponse(
                sidecar_id=ctx.identity.sidecar_id,
                matched=reg_key in self._pushing,
                writes_end_within_seconds=self._writes_end_within(first, arrival),
            )
        registration = Registration(
            engine_id=request.prefill_engine_id,
            decode_engine_id=request.decode_engine_id,
            request_id=request.request_id,
            transfer_id=request.transfer_id,
            prefill_request_id=request.prefill_request_id,
            order=PushOrder(request, blocks, writes_until),
            identity=identity,
        )
        if len(self._withdrawn):
            # A consumer registers again (a router that retried the decode leg): live again.
            ids = (registration.engine_id, registration.transfer_id, registration.prefill_request_id)
            for key in _withdrawal_keys(*ids):
                self._withdrawn.take(key, arrival)
        if self.matcher.submission_matching(registration) is None:
            self._refuse_if_released(registration, arrival)
            # It would wait: refused while draining for shutdown, or at capacity. One for blocks
            # we already hold is served even while draining, so the consumer need not recompute.
            ctx.tasks.check_capacity(self.matcher.pending_registrations)
        submission = self.matcher.add_registration(registration)
        if submission is None:
            ctx.trace.event(
                "push_registration",
                request.prefill_engine_id,
                request.request_id,
                "registered",
                f"PushReg from {request.decode_engine_id}/{request.request_id} at {request.caller.address}: "
                "waiting for SubmitBlocks",
                transfer_id=request.transfer_id,
                ids=(request.prefill_request_id,),
                peer=request.caller.address,
            )
            self._registration_deadlines.set(reg_key, writes_until)
            self._update_gauges()
            return peer_pb2.PushRegResponse(
                sidecar_id=ctx.identity.sidecar_id,
                matched=False,
                writes_end_within_seconds=self._writes_end_within(writes_until, arrival),
            )
        pending = self.requests[submission.key]
        self._start_push(pending, registration)
        self._update_gauges()
        return peer_pb2.PushRegResponse(
            sidecar_id=ctx.identity.sidecar_id,
            matched=True,
            writes_end_within_seconds=self._writes_end_within(writes_until, arrival),
        )

    async def handle_get_digests(self, request: peer_pb2.GetDigestsRequest) -> peer_pb2.GetDigestsResponse:
        """Integrity, pull: digests of a held request's span, hashed from the engine's memory in a
        worker thread (a task of the engine, so the worker's memory outlives it)."""
        ctx = self._ctx
        validation.identifier(request.engine_id, "engine_id")
        validation.identifier(request.request_id, "request_id", required=False)
        validation.identifier(request.transfer_id, "transfer_id", required=False)
        pending = self._find(request.engine_id, request.request_id, request.transfer_id)
        if pending is None or not pending.accepts_pull or pending.closing is not None:
            raise NotFound(f"request {request.request_id!r} of engine {request.engine_id!r} is not held here")
        engine = ctx.registry.require_engine(pending.engine_id, "engine_id")
        span = DigestSpan.from_proto(request.span)
        layout = engine.ordered_workers()[0].layout
        problem = check_span(span, len(single_group(pending.block_ids, "the request")) * layout.block_size)
        if problem:
            raise InvalidArgument("span", problem)
        values = await self._digest(pending, engine, span)
        return peer_pb2.GetDigestsResponse(sidecar_id=ctx.identity.sidecar_id, digests=span.to_proto(values))

    async def _digest(self, pending: ProducerRequest, engine: Engine, span: DigestSpan) -> list[bytes]:
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
                self._authorize(pending, identity, "Heartbeat", f"request {request.engine_id}/{pending.request_id}")
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
            if self.matcher.find_registration_for(request.engine_id, key.transfer_id, key.consumer_request_id):
                continue  # a push registration still waiting for its blocks
            if any(active[1] == key.consumer_request_id for active in self._pushing):
                continue
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
        # A push registration still waiting for its blocks: drop it.
        registration = self.matcher.find_registration_for(
            request.engine_id, request.transfer_id, request.consumer_request_id
        )
        if registration is not None:
            self._authorize(registration, identity, "Release", f"push registration {'/'.join(registration.key)}")
            self.matcher.remove_registration(registration.key)
            self._registration_deadlines.cancel(registration.key)
            notice = ReleaseNotice(request.consumed, request.reason, identity)
            # A registration matched on base ids alone is not kept: a retried request shares them.
            keys = _withdrawal_keys(registration.engine_id, registration.transfer_id, registration.prefill_request_id)
            for key in keys[:1]:
                for engine_id, token in self._withdrawn.keep(key, notice, time.monotonic()):
                    log.debug("withdrawn_push_registration_forgotten", engine_id=engine_id, token=token)
            self._update_gauges()
            return peer_pb2.PeerReleaseResponse(sidecar_id=ctx.identity.sidecar_id, found=True)
        pending = self._find(request.engine_id, request.request_id, request.transfer_id)
        if pending is None:
            for consumer_key, producer_key in self._pushing.items():
                if consumer_key[1] == request.consumer_request_id:
                    pending = self.requests.get(producer_key)
        if pending is None:
            if request.request_id:  # a vouched pull that failed early: its SubmitBlocks may be on the way
                notice = ReleaseNotice(request.consumed, request.reason, identity)
                self._keep_early((request.engine_id, request.request_id), notice)
            return peer_pb2.PeerReleaseResponse(sidecar_id=ctx.identity.sidecar_id, found=False)
        self._authorize(pending, identity, "Release", f"request {pending.engine_id}/{pending.request_id}")
        in_flight = self._release_by_consumer(pending, request.consumed, request.reason)
        return peer_pb2.PeerReleaseResponse(sidecar_id=ctx.identity.sidecar_id, found=True, in_flight=in_flight)

    def _release_by_consumer(self, pending: ProducerRequest, consumed: bool, reason: str) -> bool:
        """The consumer is done with ``pending``: free it, or after its WRITEs (True)."""
        if pending.writing:
            self._end_after_writes(pending, engine_pb2.FINISHED_SENDING, f"released by consumer: {reason}")
            return True
        verb = "consumed" if consumed else "released"
        self._finish(pending, engine_pb2.FINISHED_SENDING, reason=f"{verb} by consumer: {reason}")
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
            self._finish(pending, kind, reason=reason, hold_end="read")

    # --- push ---------------------------------------------------------------------------------

    def _start_push(self, pending: ProducerRequest, registration: Registration[PushOrder]) -> None:
        request, blocks, writes_until = registration.order
        self._registration_deadlines.cancel(registration.key)
        pending.peer_identity = registration.identity or pending.peer_identity
        pending.writing = True
        pending.writes_until = writes_until
        trace = self._ctx.trace
        trace.event(
            "push_registration", pending.engine_id, request.request_id, "matched", pending.request_id, done=True
        )
        trace.event(
            "producer",
            pending.engine_id,
            pending.request_id,
            "matched",
            f"PushReg from {request.decode_engine_id}/{request.request_id} at {request.caller.address}: "
            f"{_count(blocks)} blocks",
            mode="push",
            ids=(request.request_id, request.transfer_id),
            peer=request.caller.address,
        )
        self._pushing[registration.key] = pending.key
        self._ctx.tasks.spawn(self._push(pending, registration, request, blocks), engines=[pending.engine_id])

    async def _push(
        self,
        pending: ProducerRequest,
        registration: Registration[PushOrder],
        request: peer_pb2.PushRegRequest,
        blocks: BlockIds,
    ) -> None:
        ctx = self._ctx
        started = time.monotonic()
        address = request.caller.address
        error = ""
        try:
            engine = ctx.registry.require_engine(pending.engine_id, "engine_id")
            view = await ctx.trace.timed(
                "producer",
                pending.engine_id,
                pending.request_id,
                "handshake",
                f"{address} {request.decode_engine_id}",
                ctx.peers.engine(address, request.decode_engine_id, engine.compatibility_hash),
            )
            local = engine.local_workers()
            ctx.dataplane.check(
                local, engine.tp_size, view, (f"on producer {engine.engine_id}", f"on consumer {view.engine_id}")
            )
            problem = view.block_ids_problem(blocks)
            if problem:
                raise InvalidArgument("block_ids", f"{problem} (engine {view.engine_id} of {address})")
            if not any(blocks):
                # The consumer had every block already (a full prefix hit): nothing to write.
                self._pushing.pop(registration.key, None)
                pending.writing = False
                self._finish(pending, engine_pb2.FINISHED_SENDING, reason="the consumer needed no blocks")
                return
            # Past the lease our engine may reuse the blocks; past the registration's deadline the
            # consumer may have handed its own back (see PushOrder).
            lease_end = self.leases.deadline(pending.key)
            not_after = pending.writes_until if lease_end is None else min(lease_end, pending.writes_until)
            signed = None
            if request.want_digests:
                span = ctx.dataplane.digest_span(
                    "WRITE", local, engine.tp_size, view, pending.block_ids, blocks, pending.num_tokens
                )
                signed = span.to_proto(await self._digest(pending, engine, span))
            outcome = await ctx.dataplane.run(
                TransferJob(
                    op="WRITE",
                    initiator=local,
                    initiator_tp=engine.tp_size,
                    target=view,
                    initiator_blocks=pending.block_ids,
                    target_blocks=blocks,
                    target_request_id=request.request_id,
                    transfer_id=request.transfer_id or pending.transfer_id,
                    timeout=ctx.settings.transfer_timeout_seconds,
                    not_after=not_after,
                    num_tokens=pending.num_tokens,
                    digests=signed,
                    on_step=ctx.trace.hook("producer", pending.engine_id, pending.request_id),
                )
            )
            pending.bytes_moved = outcome.bytes
            if not outcome.ok:
                error = outcome.error
                if outcome.peer_gone:
                    await ctx.peers.forget(address, "transfer to it failed")
        except (SidecarError, PlanError) as exc:
            error = str(exc)
        self._pushing.pop(registration.key, None)
        pending.writing = False
        if error:
            ctx.metrics.failures.labels(reason="push_write").inc()
            log.warning(
                "push_failed",
                engine_id=pending.engine_id,
                request_id=pending.request_id,
                consumer=request.decode_engine_id,
                consumer_request_id=request.request_id,
                error=error,
            )
            await self._send_transfer_failed(address, request, error)
        else:
            ctx.metrics.request_duration.labels(mode="push", side="producer").observe(time.monotonic() - started)
        kind: int = engine_pb2.FINISHED_SENDING
        reason = error
        if pending.end is not None:
            # The lease ended, or the consumer or engine let go, while the WRITEs ran: say that,
            # with the WRITE's outcome, rather than call every early end an expiry.
            kind, why = pending.end
            reason = f"{why}; write failed: {error}" if error else why
        self._finish(pending, kind, reason=reason)

    async def _send_transfer_failed(self, address: str, request: peer_pb2.PushRegRequest, reason: str) -> None:
        notice = peer_pb2.TransferFailedRequest(
            caller_sidecar_id=self._ctx.identity.sidecar_id,
            engine_id=request.decode_engine_id,
            request_id=request.request_id,
            transfer_id=request.transfer_id,
            reason=reason,
        )
        try:
            await self._ctx.peers.transfer_failed(address, notice)
        except SidecarError as exc:
            # The consumer's heartbeat or watchdog still ends its wait.
            log.warning("transfer_failed_notice_undelivered", peer=address, error=str(exc))

    # --- leases and cleanup ---------------------------------------------------------------------

    def _on_leases_expired(self, keys: list[RequestKey]) -> None:
        for key in keys:
            pending = self.requests.get(key)
            if pending is None:
                continue
            what = "hold TTL" if pending.held else "lease"
            if pending.writing:
                self._end_after_writes(
                    pending, engine_pb2.LEASE_EXPIRED, f"{what} of {pending.lease_seconds:g}s expired"
                )
                continue
            if pending.closing is not None:
                self._finish(pending, *pending.closing)
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
            self._finish(pending, engine_pb2.LEASE_EXPIRED, reason=reason, hold_end="ttl")

    def _on_registrations_expired(self, keys: list[tuple[str, str]]) -> None:
        for key in keys:
            if self.matcher.remove_registration(key) is not None:
                log.warning("push_registration_expired", consumer_engine_id=key[0], consumer_request_id=key[1])
        self._update_gauges()

    def drop_engine(self, engine_id: str, reason: str) -> None:
        for pending in [p for p in self.requests.values() if p.engine_id == engine_id]:
            if not pending.writing:
                # Its memory is revoked only after this (a consumer's READ then fails): free now,
                # unless a consumer may still READ (on a voucher, or after a heartbeat), because an
                # engine that lives on must not get the blocks back before that READ's bound.
                self._finish_when_unread(pending, engine_pb2.FINISHED_SENDING, reason, hold_end="engine_gone")
            else:
                self._end_after_writes(pending, engine_pb2.FINISHED_SENDING, reason)
        for registration in self.matcher.registrations():
            if registration.engine_id == engine_id:
                self.matcher.remove_registration(registration.key)
                self._registration_deadlines.cancel(registration.key)
        self._update_gauges()

    def finish_all(self, reason: str) -> None:
        for pending in list(self.requests.values()):
            self._finish(pending, engine_pb2.FINISHED_SENDING, reason=reason)

    def _end_after_writes(self, pending: ProducerRequest, kind: int, reason: str) -> None:
        """Free a request being pushed once its WRITEs are terminal, with this event; the first
        reason given wins."""
        if pending.end is None:
            pending.end = (kind, reason)

    def _finish_when_unread(self, pending: ProducerRequest, kind: int, reason: str, hold_end: str = "released") -> None:
        """Free now (``hold_end`` as in ``_finish``), or, if a consumer may still READ the blocks,
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
        self._finish(pending, kind, reason=reason, hold_end=hold_end)

    def awaiting_consumers(self) -> int:
        """Requests whose blocks a consumer has yet to take (multi-turn holds not counted)."""
        return sum(1 for pending in self.requests.values() if not pending.held)

    def _add(self, pending: ProducerRequest) -> None:
        self.requests[pending.key] = pending
        if pending.transfer_id:
            self._by_transfer[(pending.engine_id, pending.transfer_id)] = pending.key
        self.leases.set(pending.key, time.monotonic() + pending.lease_seconds)
        if pending.accepts_pull:
            self._ctx.transport.expect_notifications(1)
        self._ctx.metrics.leases.set(len(self.leases))

    def _finish(self, pending: ProducerRequest, kind: int, reason: str = "", hold_end: str = "released") -> None:
        """End a request: its engine gets FINISHED_SENDING / LEASE_EXPIRED. ``hold_end`` labels why
        a held request ended (metrics: read, ttl, cap, superseded, released, engine_gone)."""
        if self.requests.pop(pending.key, None) is None:
            return
        if pending.transfer_id:
            self._by_transfer.pop((pending.engine_id, pending.transfer_id), None)
        self.leases.cancel(pending.key)
        self.matcher.remove_submission(pending.engine_id, pending.request_id)
        if pending.accepts_pull:
            self._ctx.transport.expect_notifications(-1)
        if pending.held:
            self._holds.release(pending.key, hold_end)
        self._ctx.metrics.leases.set(len(self.leases))
        self._update_gauges()
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

    @staticmethod
    def _check_blocks(engine: Engine, blocks: BlockIds, field_name: str) -> None:
        problem = check_block_ids(blocks, engine.num_groups, engine.num_blocks, engine.physical_per_logical)
        if problem:
            raise InvalidArgument(field_name, problem)

    def _update_gauges(self) -> None:
        metrics = self._ctx.metrics
        metrics.pending_push_registrations.set(self.matcher.pending_registrations)
        metrics.unmatched_submissions.set(self.matcher.unmatched_submissions)

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


def _count(blocks: BlockIds) -> int:
    return sum(len(group) for group in blocks)


def _withdrawal_keys(engine_id: str, transfer_id: str, producer_request_id: str) -> list[tuple[str, str]]:
    """Where a withdrawn push registration is kept, strongest match first (as ``core.matching``)."""
    keys = [(engine_id, "tid:" + transfer_id)] if transfer_id else []
    if producer_request_id:
        keys.append((engine_id, "rid:" + producer_request_id))
    return keys
