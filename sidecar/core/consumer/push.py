"""Push: the producer WRITEs into the local blocks; this side registers and counts.

``ExpectPush`` handshakes, then sends ``PushReg`` to the producer's sidecar (``_register_push``);
the producer's WRITEs arrive with notifications (``on_notice``); once every local worker counted
the notifications it expects, FINISHED_RECEIVING. A ``TransferFailed`` from the producer fails
the request at once; a registration watchdog fails it if nothing arrives in time, after asking
the producer to cancel (``cancel``), so no WRITE lands later: WRITEs still in flight are waited
for (bounded), and a producer that cannot answer gets the blocks fenced (``fences``). Runs on the
event loop thread.
"""

from __future__ import annotations

import asyncio
import time

from kvsidecar.block_ids import grouped
from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar.config import split_host_port
from sidecar.core import validation
from sidecar.core.consumer.fences import PushFences
from sidecar.core.consumer.integrity import DigestCheck
from sidecar.core.consumer.keepalive import KeepAlive
from sidecar.core.consumer.table import ConsumerRequest, ConsumerTable, RequestKey, log
from sidecar.core.context import NodeContext
from sidecar.core.registry import Engine, Worker
from sidecar.core.trace import notice_handoff
from sidecar.dataplane.plan.convert import check_exchange
from sidecar.dataplane.plan.layout import PlanError
from sidecar.errors import DeadlineExceeded, Draining, FailedPrecondition, PermissionDenied, SidecarError, Unavailable
from sidecar.tls import covers


class PushReceiver:
    def __init__(
        self, ctx: NodeContext, table: ConsumerTable, keep: KeepAlive, fences: PushFences, integrity: DigestCheck
    ) -> None:
        self._ctx = ctx
        self._table = table
        self._keep = keep
        self._fences = fences
        self._integrity = integrity

    async def expect_push(self, request: engine_pb2.ExpectPushRequest) -> engine_pb2.ExpectPushResponse:
        ctx, table = self._ctx, self._table
        local = table.validate_fields(
            request.engine_id, request.request_id, request.transfer_id, request.block_ids, "block_ids"
        )
        validation.remote_blocks(request.remote, "remote", ctx.settings.max_blocks_per_request, False)
        timeout = validation.duration(
            request.timeout_seconds, "timeout_seconds", ctx.settings.push_registration_timeout_seconds
        )
        engine = table.require_engine(request.engine_id, request.request_id, local, "block_ids")
        pending = table.admit(request, common_pb2.TRANSFER_MODE_PUSH, local)
        if not self._keep.admitted(pending):
            return engine_pb2.ExpectPushResponse(registered=False, matched=False)
        pending.push_deadline = time.monotonic() + timeout
        table.watchdogs.set(pending.key, pending.push_deadline)
        # Registering needs a handshake and a peer call; both are bounded by peer_call_timeout.
        try:
            matched = await self._register_push(pending, engine, timeout)
        except (SidecarError, PlanError) as exc:
            unsure = isinstance(exc, (DeadlineExceeded, Unavailable)) and not isinstance(exc, Draining)
            if unsure and pending.push_reg_sent:
                # The PushReg may have reached a producer that is only slow (or stopped), or whose
                # answer was lost with the connection: it could still write, though (a producer of
                # this version) not past the write_by it carried, clocks within the allowance, + a
                # WRITE's bound (as ours, unknown without its answer). The fence's checks withdraw
                # the registration there. A draining producer's refusal registered nothing.
                pending.writes_quiet_at = pending.push_deadline + ctx.settings.transfer_timeout_seconds
                self._fences.fail_fenced(pending, f"push registration failed: {exc}", "push_registration")
            else:
                table.fail(pending, f"push registration failed: {exc}", reason_label="push_registration")
            if isinstance(exc, PlanError):
                # The producer learns why too (its log names both sides' values) and frees its blocks.
                ctx.tasks.spawn(table.tell_producer(pending, consumed=False, reason=str(exc)), engines=[])
            return engine_pb2.ExpectPushResponse(registered=False, matched=False)
        finally:
            pending.registration_done.set()
        if not any(local):
            # A full prefix hit: nothing will be written. The registration still lets the producer
            # free its blocks as soon as it submits them.
            table.finish(pending, engine_pb2.Event(kind=engine_pb2.FINISHED_RECEIVING))
        return engine_pb2.ExpectPushResponse(registered=True, matched=matched)

    async def _register_push(self, pending: ConsumerRequest, engine: Engine, timeout: float) -> bool:
        """The push registration: handshake, pairing check, PushReg. Returns whether the producer
        had the request's blocks already (it writes at once)."""
        ctx = self._ctx
        address = pending.remote.address
        view = await ctx.trace.timed(
            "consumer",
            pending.engine_id,
            pending.request_id,
            "handshake",
            f"{address} {pending.remote.engine_id}",
            ctx.peers.engine(address, pending.remote.engine_id, engine.compatibility_hash),
        )
        # The producer will initiate; check the pairing from its side.
        check_exchange(
            [w.layout for w in view.workers],
            view.tp_size,
            [w.layout for w in engine.ordered_workers()],
            engine.tp_size,
            (f"on producer {view.engine_id}", f"on consumer {engine.engine_id}"),
        )
        if pending.remote.tp_size and pending.remote.tp_size != view.tp_size:
            raise FailedPrecondition(
                f"remote.tp_size is {pending.remote.tp_size} but engine {view.engine_id} has TP {view.tp_size}"
            )
        pending.push_reg_sent = True
        response = await ctx.peers.push_reg(
            address,
            peer_pb2.PushRegRequest(
                caller=ctx.identity.info(),
                prefill_engine_id=pending.remote.engine_id,
                prefill_request_id=pending.remote.request_id,
                transfer_id=pending.transfer_id,
                decode_engine_id=pending.engine_id,
                request_id=pending.request_id,
                block_ids=grouped(pending.local_blocks),
                decode_tp_size=engine.tp_size,
                compatibility_hash=engine.compatibility_hash,
                timeout_seconds=timeout,
                decode_generation=engine.generation,
                want_digests=self._integrity.applies(pending),
                write_by_unix_ms=int((time.time() + pending.push_deadline - time.monotonic()) * 1000),
            ),
        )
        pending.registered = True
        if response.writes_end_within_seconds > 0:
            # Counted from our receipt of the answer, later than the producer's start of it.
            pending.writes_quiet_at = time.monotonic() + response.writes_end_within_seconds
        ctx.trace.event(
            "consumer",
            pending.engine_id,
            pending.request_id,
            "registered",
            f"PushReg accepted by {address}" + (": writing" if response.matched else ": waiting for its SubmitBlocks"),
        )
        return bool(response.matched)

    # --- the producer's WRITEs and failures ---------------------------------------------------

    def on_notice(self, worker: Worker, notice: peer_pb2.TransferNotice, seen_at: float = 0.0) -> bool:
        """A producer's WRITE into ``worker`` completed. False if the request is unknown here.
        ``seen_at``: when the NIXL owner thread saw the notification (time.monotonic())."""
        pending = self._table.requests.get((notice.engine_id, notice.request_id))
        if pending is None or not pending.is_push:
            return False
        pending.notices.record(worker.agent_name, notice.expected)
        if notice.HasField("digests") and pending.digests is None:
            pending.digests = notice.digests
        self._ctx.trace.event(
            "consumer",
            pending.engine_id,
            pending.request_id,
            "notification",
            f"the producer's WRITE into {worker.agent_name} completed",
            measured=notice_handoff(seen_at),
        )
        if pending.notices.complete(self._ctx.registry.agent_names(pending.engine_id)):
            pending.received = True
            self._ctx.metrics.child(self._ctx.metrics.request_duration, "push", "consumer").observe(
                time.monotonic() - pending.created
            )
            if self._integrity.applies(pending):
                self._ctx.tasks.spawn(
                    self._integrity.finish_checked(pending, pending.digests), engines=[pending.engine_id]
                )
            else:
                self._table.finish(pending, engine_pb2.Event(kind=engine_pb2.FINISHED_RECEIVING))
        return True

    async def handle_transfer_failed(
        self, request: peer_pb2.TransferFailedRequest, identity: str = ""
    ) -> peer_pb2.TransferFailedResponse:
        """``identity``: the caller's certificate names with mTLS, "" without (``sidecar.tls``)."""
        validation.identifier(request.engine_id, "engine_id")
        validation.identifier(request.request_id, "request_id")
        pending = self._table.requests.get((request.engine_id, request.request_id))
        if pending is None or not pending.is_push:
            return peer_pb2.TransferFailedResponse(sidecar_id=self._ctx.identity.sidecar_id, found=False)
        # With mTLS only the producer may fail its push: a certificate valid for the address the
        # consumer registered with.
        host = split_host_port(pending.remote.address, "address")[0] if pending.remote.address else ""
        if identity and host and not covers(identity, host):
            log.warning("peer_refused", action="TransferFailed", request=f"{request.engine_id}/{request.request_id}",
                        peer_identity=identity, producer=pending.remote.address)  # fmt: skip
            raise PermissionDenied(
                f"TransferFailed: request {request.engine_id}/{request.request_id} is a push from "
                f"{pending.remote.address}; certificate {identity!r} is not valid for {host}"
            )
        self._table.fail(pending, f"producer reported: {request.reason}", reason_label="producer_failed")
        return peer_pb2.TransferFailedResponse(sidecar_id=self._ctx.identity.sidecar_id, found=True)

    # --- giving up: release and watchdog ------------------------------------------------------

    def release(self, pending: ConsumerRequest, reason: str) -> None:
        """The engine released a push with blocks: the terminal event waits until the producer's
        WRITEs, which may be in flight, cannot land."""
        if not pending.cancelling:
            pending.cancelling = True
            self._ctx.tasks.spawn(self._cancel(pending, f"released: {reason}", "released"), engines=[])

    def on_watchdog(self, keys: list[RequestKey]) -> None:
        for key in keys:
            pending = self._table.requests.get(key)
            if pending is None:
                continue
            if pending.cancelling:
                why = pending.cancel_reason or "push did not finish after cancellation"
                self._ctx.tasks.spawn(self._still_writing(pending, why), engines=[])
                continue
            pending.cancelling = True
            self._ctx.tasks.spawn(
                self._cancel(pending, "push did not arrive before the registration watchdog expired", "timeout"),
                engines=[],
            )

    async def _cancel(self, pending: ConsumerRequest, why: str, label: str) -> None:
        """Released, or the watchdog fired: make sure no WRITE can land before the blocks go back
        to the engine. Ask the producer to drop the request; if WRITEs are in flight, wait for
        them (notifications or TransferFailed end it), bounded; if it cannot answer, fence."""
        table, settings = self._table, self._ctx.settings
        try:
            # A PushReg still on its way would otherwise arrive after our Release.
            async with asyncio.timeout(2 * settings.peer_call_timeout_seconds):
                await pending.registration_done.wait()
        except TimeoutError:
            pass
        if pending.key not in table.requests:
            return
        in_flight = await table.ask_producer(pending, consumed=False, reason=why)
        if pending.key not in table.requests:
            return
        if in_flight is None:
            self._fences.fail_fenced(pending, f"{why}; the producer did not answer", label)
        elif in_flight:
            pending.cancel_reason = why
            grace = settings.transfer_timeout_seconds + settings.peer_call_timeout_seconds
            table.watchdogs.set(pending.key, time.monotonic() + grace)
        else:
            table.fail(pending, why, reason_label=label)

    async def _still_writing(self, pending: ConsumerRequest, why: str) -> None:
        """The grace after a cancellation passed: ask the producer once more. A producer that is
        alive and still has a WRITE in flight (a device copy into our GPU memory held until the
        GPU completes it, ``device_copy.LateCopies``) keeps our blocks for another grace; one
        that does not answer, or whose WRITEs are over, ends the request as before."""
        in_flight = await self._table.ask_producer(pending, consumed=False, reason=why)
        if not self._table.is_open(pending):
            return
        if in_flight:
            settings = self._ctx.settings
            log.warning(
                "push_still_in_flight",
                engine_id=pending.engine_id,
                request_id=pending.request_id,
                peer=pending.remote.address,
                why="the producer says a WRITE of it is still in flight: the blocks stay held",
            )
            self._table.watchdogs.set(
                pending.key, time.monotonic() + settings.transfer_timeout_seconds + settings.peer_call_timeout_seconds
            )
        else:
            self._fences.fail_fenced(pending, f"{why}; the producer's WRITEs did not end in time", "timeout")
