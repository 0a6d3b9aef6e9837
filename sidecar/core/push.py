"""The producer's push writer: consumers' registrations (``PushReg``) matched with the blocks
their producer engine submitted, in either order (``core.matching``); the WRITEs into the
consumer's blocks; ``TransferFailed`` when they fail; and the releases either side made before the
other came (a consumer that withdrew its registration before the blocks came: they go back at
SubmitBlocks; a producer engine that released the request before any consumer registered: a
PushReg for it is refused at once).

``ProducerSide`` owns the request table and its leases; it tells the writer of each submission,
release and dropped engine, and the writer ends a request through it (``RequestTable``).
Runs on the event loop thread.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol

from kvsidecar.v1 import engine_pb2, peer_pb2
from sidecar.core import validation
from sidecar.core.arrivals import await_engine
from sidecar.core.context import NodeContext
from sidecar.core.early_notices import EarlyNotices, ReleaseNotice
from sidecar.core.handshake import check_compatibility
from sidecar.core.matching import PushMatcher, Registration, Submission
from sidecar.core.producer_request import ProducerRequest, RequestKey, authorize, count_blocks
from sidecar.core.registry import PRODUCER_ROLES, Engine
from sidecar.core.timers import DeadlineTimer
from sidecar.dataplane.integrity import DigestSpan
from sidecar.dataplane.plan.layout import BlockIds, PlanError
from sidecar.dataplane.views import TransferJob
from sidecar.errors import FailedPrecondition, InvalidArgument, NotFound, SidecarError
from sidecar.logs import get_logger

log = get_logger("kvsidecar.producer")


class PushOrder(NamedTuple):
    """What a consumer's registration carries to the push it starts: its PushReg, the validated
    destination blocks, and the time (monotonic) after which no WRITE of it may be posted, which
    the answer promised the consumer (``writes_end_within_seconds``; see ``_writes_until``)."""

    request: peer_pb2.PushRegRequest
    blocks: BlockIds
    writes_until: float


class RequestTable(Protocol):
    """What the writer needs of ``ProducerSide``: its requests, their leases, and their end."""

    requests: dict[RequestKey, ProducerRequest]
    leases: DeadlineTimer[RequestKey]

    def finish(self, pending: ProducerRequest, kind: int, reason: str = "", hold_end: str = "released") -> None: ...

    def apply_early_release(self, pending: ProducerRequest, early: ReleaseNotice) -> None: ...

    async def digest(self, pending: ProducerRequest, engine: Engine, span: DigestSpan) -> list[bytes]: ...


class PushWriter:
    def __init__(self, ctx: NodeContext, table: RequestTable) -> None:
        self._ctx = ctx
        self._table = table
        self.matcher: PushMatcher[PushOrder] = PushMatcher()
        # Push registrations waiting for blocks expire with the consumer's watchdog.
        self._registration_deadlines: DeadlineTimer[tuple[str, str]] = DeadlineTimer(self._on_registrations_expired)
        # Consumer (decode engine, request) -> producer request being written, for idempotent PushReg.
        self._pushing: dict[tuple[str, str], RequestKey] = {}
        # Push registrations their consumer released before the blocks came (an abort during the
        # prefill), by (producer engine, "tid:" transfer id or "rid:" producer request id): the
        # blocks go back at SubmitBlocks instead of at the lease's end. Kept as long as a
        # registration waits (the consumer's push timeout, by default).
        self._withdrawn: EarlyNotices[tuple[str, str]] = EarlyNotices(ctx.settings.push_registration_timeout_seconds)
        # The mirror: push requests the producer engine released before any consumer registered
        # (a failed prefill, both legs dispatched at once), by the same keys: a PushReg for one is
        # refused at once instead of waiting for blocks that will not come.
        self._released: EarlyNotices[tuple[str, str]] = EarlyNotices(ctx.settings.push_registration_timeout_seconds)

    # --- what ProducerSide tells it -------------------------------------------------------------

    def submitted(self, pending: ProducerRequest) -> bool:
        """A push-accepting request was submitted: start its push if a registration waits (True),
        or free it at once if its consumer already withdrew."""
        if len(self._released):
            # Submitted again (a router that retried the prefill leg): live again.
            for key in withdrawal_keys(pending.engine_id, pending.transfer_id, pending.request_id):
                self._released.take(key, time.monotonic())
        submission = Submission(pending.engine_id, pending.request_id, pending.transfer_id)
        registration = self.matcher.add_submission(submission)
        if registration is not None:
            self._start_push(pending, registration)
            return True
        self._apply_withdrawn(pending)
        return False

    def engine_released_unknown(self, engine_id: str, request_id: str, transfer_id: str, reason: str) -> bool:
        """The producer engine released a request this sidecar does not hold (its prefill failed):
        a consumer already waiting for its push learns it now (True), not at its watchdog; one
        that registers later is refused."""
        registration = self.matcher.registration_matching(Submission(engine_id, request_id, transfer_id))
        if registration is None:
            self.keep_released(engine_id, transfer_id, request_id, reason)
            return False
        self.matcher.remove_registration(registration.key)
        self._registration_deadlines.cancel(registration.key)
        self.update_gauges()
        request = registration.order.request
        self._ctx.tasks.spawn(
            self._send_transfer_failed(request.caller.address, request, f"the producer released it: {reason}"),
            engines=[],
        )
        return True

    def consumer_withdrew(self, request: peer_pb2.PeerReleaseRequest, identity: str) -> bool:
        """A consumer released a registration still waiting for its blocks (True), if it had one."""
        registration = self.matcher.find_registration_for(
            request.engine_id, request.transfer_id, request.consumer_request_id
        )
        if registration is None:
            return False
        authorize(registration, identity, "Release", f"push registration {'/'.join(registration.key)}")
        self.matcher.remove_registration(registration.key)
        self._registration_deadlines.cancel(registration.key)
        notice = ReleaseNotice(request.consumed, request.reason, identity)
        # A registration matched on base ids alone is not kept: a retried request shares them.
        keys = withdrawal_keys(registration.engine_id, registration.transfer_id, registration.prefill_request_id)
        for key in keys[:1]:
            for engine_id, token in self._withdrawn.keep(key, notice, time.monotonic()):
                log.debug("withdrawn_push_registration_forgotten", engine_id=engine_id, token=token)
        self.update_gauges()
        return True

    def writing_for(self, consumer_request_id: str) -> RequestKey | None:
        """The producer request being written for this consumer request, if any."""
        for consumer_key, producer_key in self._pushing.items():
            if consumer_key[1] == consumer_request_id:
                return producer_key
        return None

    def waits_for(self, engine_id: str, transfer_id: str, consumer_request_id: str) -> bool:
        """A consumer's registration for ``engine_id`` still waits for its blocks, or is being written."""
        if self.matcher.find_registration_for(engine_id, transfer_id, consumer_request_id):
            return True
        return self.writing_for(consumer_request_id) is not None

    def forget(self, pending: ProducerRequest) -> None:
        """``pending`` ended: it can match no registration any more (and its WRITEs are done)."""
        self.matcher.remove_submission(pending.engine_id, pending.request_id)
        if pending.queued is not None:  # ended some other way than its WRITEs' end (which ends it)
            self._ctx.tasks.transfers.ended(pending.queued, ok=False)

    def drop_engine(self, engine_id: str, reason: str) -> None:
        """The producer engine is gone: consumers waiting for its pushes learn it now (not at their
        next heartbeat's grace, or their watchdog)."""
        for registration in self.matcher.registrations():
            if registration.engine_id == engine_id:
                self.matcher.remove_registration(registration.key)
                self._registration_deadlines.cancel(registration.key)
                request = registration.order.request
                self._ctx.tasks.spawn(
                    self._send_transfer_failed(request.caller.address, request, f"producer engine gone: {reason}"),
                    engines=[],
                )
        self.update_gauges()

    def update_gauges(self) -> None:
        metrics = self._ctx.metrics
        metrics.pending_push_registrations.set(self.matcher.pending_registrations)
        metrics.unmatched_submissions.set(self.matcher.unmatched_submissions)

    def _apply_withdrawn(self, pending: ProducerRequest) -> None:
        """Free an unmatched push submission whose consumer released its registration before it came."""
        if not len(self._withdrawn):
            return
        now = time.monotonic()
        found = [
            notice
            for key in withdrawal_keys(pending.engine_id, pending.transfer_id, pending.request_id)
            for notice in self._withdrawn.take(key, now)
            if isinstance(notice, ReleaseNotice)
        ]
        if found:
            self._table.apply_early_release(pending, found[0])

    def keep_released(self, engine_id: str, transfer_id: str, request_id: str, reason: str) -> None:
        """The producer engine released a push request no consumer registered for yet: a PushReg
        for it that comes later is refused (``_refuse_if_released``)."""
        notice = ReleaseNotice(False, reason, "")
        for key in withdrawal_keys(engine_id, transfer_id, request_id):
            for engine, token in self._released.keep(key, notice, time.monotonic()):
                log.debug("released_push_request_forgotten", engine_id=engine, token=token)

    def _refuse_if_released(self, registration: Registration[PushOrder], now: float) -> None:
        """A consumer registers for a request its producer engine already released."""
        if not len(self._released):
            return
        ids = (registration.engine_id, registration.transfer_id, registration.prefill_request_id)
        for key in withdrawal_keys(*ids):
            released = [notice for notice in self._released.peek(key, now) if isinstance(notice, ReleaseNotice)]
            if released:
                kind, value = key[1].split(":", 1)
                named = "transfer id" if kind == "tid" else "request id"
                raise FailedPrecondition(
                    f"producer engine {registration.engine_id} released the request ({named} {value!r}) "
                    f"before this push registration came: {released[0].reason}"
                )

    # --- PeerService ---------------------------------------------------------------------------

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
            authorize(existing, identity, "PushReg", what)
        elif reg_key in self._pushing and self._pushing[reg_key] in self._table.requests:
            authorize(self._table.requests[self._pushing[reg_key]], identity, "PushReg", what)
        if reg_key in self._pushing or existing is not None:
            # A repeated registration: the first one is already matched or waiting, and its
            # deadline is the one the WRITEs keep.
            if existing is not None:
                first = existing.order.writes_until
            else:
                writing = self._table.requests.get(self._pushing[reg_key])
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
            for key in withdrawal_keys(*ids):
                self._withdrawn.take(key, arrival)
        submission = self.matcher.submission_matching(registration)
        if submission is None:
            self._refuse_if_released(registration, arrival)
            # It would wait: refused while draining for shutdown, or at capacity. One for blocks
            # we already hold is served even while draining, so the consumer need not recompute.
            ctx.tasks.check_capacity(self.matcher.pending_registrations)
            self.matcher.add_registration(registration)  # matches nothing: stored
        else:
            self.matcher.remove_submission(submission.engine_id, submission.request_id)
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
            self.update_gauges()
            return peer_pb2.PushRegResponse(
                sidecar_id=ctx.identity.sidecar_id,
                matched=False,
                writes_end_within_seconds=self._writes_end_within(writes_until, arrival),
            )
        pending = self._table.requests[submission.key]
        self._start_push(pending, registration)
        self.update_gauges()
        return peer_pb2.PushRegResponse(
            sidecar_id=ctx.identity.sidecar_id,
            matched=True,
            writes_end_within_seconds=self._writes_end_within(writes_until, arrival),
        )

    # --- the WRITEs ----------------------------------------------------------------------------

    def _start_push(self, pending: ProducerRequest, registration: Registration[PushOrder]) -> None:
        request, blocks, writes_until = registration.order
        self._registration_deadlines.cancel(registration.key)
        pending.peer_identity = registration.identity or pending.peer_identity
        pending.writing = True
        pending.writes_until = writes_until
        if pending.queued is None:
            pending.queued = self._ctx.tasks.transfers.started()
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
            f"{count_blocks(blocks)} blocks",
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
                self._table.finish(pending, engine_pb2.FINISHED_SENDING, reason="the consumer needed no blocks")
                return
            # Past the lease our engine may reuse the blocks; past the registration's deadline the
            # consumer may have handed its own back (see PushOrder).
            lease_end = self._table.leases.deadline(pending.key)
            not_after = pending.writes_until if lease_end is None else min(lease_end, pending.writes_until)
            signed = None
            if request.want_digests:
                span = ctx.dataplane.digest_span(
                    "WRITE", local, engine.tp_size, view, pending.block_ids, blocks, pending.num_tokens
                )
                signed = span.to_proto(await self._table.digest(pending, engine, span))
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
        except Exception as exc:
            # A bug, or a value nothing checked (a peer's descriptor, a digest's shape): the request
            # must still end on both sides, not stay "writing" (its lease would never free it).
            log.exception("push_crashed", engine_id=pending.engine_id, request_id=pending.request_id)
            error = f"internal error: {type(exc).__name__}: {exc}"
        self._pushing.pop(registration.key, None)
        pending.writing = False
        if pending.queued is not None:
            ctx.tasks.transfers.ended(pending.queued, ok=not error)
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
            ctx.metrics.child(ctx.metrics.request_duration, "push", "producer").observe(time.monotonic() - started)
        kind: int = engine_pb2.FINISHED_SENDING
        reason = error
        if pending.end is not None:
            # The lease ended, or the consumer or engine let go, while the WRITEs ran: say that,
            # with the WRITE's outcome, rather than call every early end an expiry.
            kind, why = pending.end
            reason = f"{why}; write failed: {error}" if error else why
        self._table.finish(pending, kind, reason=reason)

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

    def _on_registrations_expired(self, keys: list[tuple[str, str]]) -> None:
        for key in keys:
            if self.matcher.remove_registration(key) is not None:
                log.warning("push_registration_expired", consumer_engine_id=key[0], consumer_request_id=key[1])
        self.update_gauges()


def withdrawal_keys(engine_id: str, transfer_id: str, producer_request_id: str) -> list[tuple[str, str]]:
    """Where a withdrawn or released push request is kept, strongest match first (as ``core.matching``)."""
    keys = [(engine_id, "tid:" + transfer_id)] if transfer_id else []
    if producer_request_id:
        keys.append((engine_id, "rid:" + producer_request_id))
    return keys
