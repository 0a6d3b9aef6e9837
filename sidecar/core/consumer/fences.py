"""Write fences: a push this side gave up on while its producer may still write.

The producer's WRITEs are one-sided. When a push is given up (released, watchdog, a producer that
stopped answering) and the producer cannot say that no WRITE is in flight, the blocks' pages are
fenced (made read-only in this sidecar, ``dataplane.memory.WriteFences``) before LOAD_FAILED, so a
WRITE that resumes later fails instead of landing; the fence is lifted once the producer answers
that nothing is in flight, or is gone. GPU memory cannot be made read-only: there the LOAD_FAILED
itself waits (a hold) for those answers, bounded by the end of its WRITEs the producer promised
(``PushRegResponse.writes_end_within_seconds``), moved on by each answer that a WRITE is still in
flight. Every heartbeat round calls ``end_fences``. Runs on the event loop thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sidecar.core.consumer.table import ConsumerRequest, ConsumerTable, log
from sidecar.core.context import NodeContext
from sidecar.dataplane.memory import FenceToken, WriteFences
from sidecar.dataplane.plan.descriptors import block_byte_ranges


@dataclass
class Fence:
    """A push this side gave up on while its producer may still write. Shared memory: its pages
    are fenced (``token``), the engine already has its LOAD_FAILED, and the fence ends when the
    producer answers that nothing is in flight or is gone. GPU memory, which cannot be fenced:
    ``held`` is the LOAD_FAILED (reason, metric label) still owed, the engine keeps the blocks,
    and it ends on the same answers or, at the latest, at ``held_until``: the producer's promise
    (``ConsumerRequest.writes_quiet_at``), moved to a WRITE's bound (the transfer timeout) past
    each answer of the producer that a WRITE is still in flight."""

    request: ConsumerRequest
    token: FenceToken
    held: tuple[str, str] | None = None
    held_until: float = 0.0
    checking: bool = False


class PushFences:
    def __init__(self, ctx: NodeContext, table: ConsumerTable) -> None:
        self._ctx = ctx
        self._table = table
        self.write_fences = WriteFences()
        self.fenced: list[Fence] = []
        table.on_end.append(self._ended)

    def _ended(self, pending: ConsumerRequest) -> None:
        if pending.held:  # ended another way meanwhile (its WRITEs' end, TransferFailed, ...)
            self.fenced = [fence for fence in self.fenced if fence.request is not pending]

    def fail_fenced(self, pending: ConsumerRequest, reason: str, label: str) -> None:
        """LOAD_FAILED for a push whose producer may still write: fence the blocks' pages first; on
        GPU memory, hold the LOAD_FAILED until no WRITE can land (see ``Fence``)."""
        if pending.held:
            return  # already waiting for its producer to go quiet
        engine = self._ctx.registry.engines.get(pending.engine_id)
        token: FenceToken = []
        if engine is not None and pending.key in self._table.requests:
            try:
                for worker in engine.ordered_workers():
                    token += self.write_fences.revoke(
                        worker.memories, block_byte_ranges(worker.layout, pending.local_blocks)
                    )
            except OSError as exc:
                log.error(
                    "push_fence_failed", engine_id=pending.engine_id, request_id=pending.request_id, error=str(exc)
                )
        if token:
            self.fenced.append(Fence(pending, token))
            log.warning(
                "push_fenced",
                engine_id=pending.engine_id,
                request_id=pending.request_id,
                peer=pending.remote.address,
                pages=len(token),
            )
            reason = f"{reason} (blocks fenced against late WRITEs)"
        elif engine is not None and any(w.mem_type == "VRAM" for w in engine.ordered_workers()):
            # mprotect cannot reach device memory: keep the blocks from the engine instead.
            now, quiet_at = time.monotonic(), pending.writes_quiet_at
            if quiet_at is not None and now < quiet_at and pending.key in self._table.requests:
                pending.held = True
                self.fenced.append(Fence(pending, [], held=(reason, label), held_until=quiet_at))
                log.warning(
                    "push_held",
                    engine_id=pending.engine_id,
                    request_id=pending.request_id,
                    peer=pending.remote.address,
                    why=reason,
                    at_most_seconds=round(quiet_at - now, 3),
                    detail="GPU memory cannot be made read-only: the LOAD_FAILED waits until the producer "
                    "answers that no WRITE is in flight, or the end of its WRITEs it promised has passed",
                )
                return
            if quiet_at is None:
                log.warning(
                    "push_gave_up_unfenced",
                    engine_id=pending.engine_id,
                    request_id=pending.request_id,
                    peer=pending.remote.address,
                    why="GPU memory cannot be made read-only, and the producer promised no end to its WRITEs",
                )
                reason = f"{reason} (GPU memory: not fenced against a late WRITE)"
        self._table.fail(pending, reason, reason_label=label)

    async def _check_fence(self, fence: Fence) -> None:
        """End a fence once the producer says nothing of the request is in flight, or its sidecar
        is not running (refused connection: a dead process writes nothing)."""
        fence.checking = True
        try:
            in_flight = await self._table.ask_producer(
                fence.request, consumed=False, reason="consumer gave up on the push", wait_for_ready=False
            )
        finally:
            fence.checking = False
        if in_flight is False:
            self._end_fence(fence, "the producer answered that no WRITE is in flight")
        elif in_flight and fence.held is not None:
            # Alive, and a WRITE of it not over: each WRITE ends within the transfer timeout (the
            # producer's bound as ours), so the hold waits that long from this answer, not for
            # ever if the producer then stops answering.
            fence.held_until = max(fence.held_until, time.monotonic() + self._ctx.settings.transfer_timeout_seconds)

    def end_fences(self) -> None:
        """Called each heartbeat round: end the holds whose producer's WRITEs are surely over,
        check the other fences with their producer."""
        now = time.monotonic()
        for fence in list(self.fenced):
            if fence.held is not None and now >= fence.held_until and not fence.checking:
                log.warning(
                    "push_hold_ended_unanswered",
                    engine_id=fence.request.engine_id,
                    request_id=fence.request.request_id,
                    peer=fence.request.remote.address,
                    why="the producer never answered; its WRITEs are over by its promise, but one it was "
                    "stopped in the middle of would finish when it resumes",
                )
                self._end_fence(fence, "the producer's WRITEs were over by its promise")
            elif not fence.checking:
                self._ctx.tasks.spawn(self._check_fence(fence), engines=[])

    def _end_fence(self, fence: Fence, why: str) -> None:
        if fence not in self.fenced:
            return
        self.fenced.remove(fence)
        pending = fence.request
        if fence.token:
            self.write_fences.lift(fence.token)
            log.info("push_fence_lifted", engine_id=pending.engine_id, request_id=pending.request_id, why=why)
        if fence.held is not None and self._table.is_open(pending):
            reason, label = fence.held
            self._table.fail(pending, f"{reason} (GPU memory: blocks held until {why})", reason_label=label)
