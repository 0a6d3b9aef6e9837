"""Pull: the consumer READs the producer's blocks into the local ones.

``Pull`` validates and admits the request, then ``_run_pull`` walks it: handshake the producer's
sidecar (cached), check the pairing, get the READ's window from the keep-alive ("may I read, and
until when?", ``keepalive.KeepAlive.clear_read``), READ with one notification per transfer, then
FINISHED_RECEIVING to every local worker, or LOAD_FAILED with the block ids. A full prefix hit
reads nothing and only tells the producer. Runs on the event loop thread (one task per pull).
"""

from __future__ import annotations

import asyncio
import time

from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar.core import validation
from sidecar.core.consumer.integrity import DigestCheck
from sidecar.core.consumer.keepalive import KeepAlive, ReadClearance
from sidecar.core.consumer.table import (
    ConsumerRequest,
    ConsumerTable,
    ForeignBlocks,
    ProducerLost,
    RequestEnded,
    log,
)
from sidecar.core.context import NodeContext
from sidecar.core.registry import Engine
from sidecar.dataplane.plan.layout import BlockIds, PlanError
from sidecar.dataplane.views import EngineView, LocalWorker, TransferJob, TransferOutcome
from sidecar.errors import FailedPrecondition, InvalidArgument, SidecarError


class PullReader:
    def __init__(self, ctx: NodeContext, table: ConsumerTable, keep: KeepAlive, integrity: DigestCheck) -> None:
        self._ctx = ctx
        self._table = table
        self._keep = keep
        self._integrity = integrity

    async def pull(self, request: engine_pb2.PullRequest) -> engine_pb2.PullResponse:
        ctx = self._ctx
        local = self._table.validate_fields(
            request.engine_id, request.request_id, request.transfer_id, request.local_block_ids, "local_block_ids"
        )
        remote_blocks = validation.remote_blocks(request.remote, "remote", ctx.settings.max_blocks_per_request, True)
        validation.identifier(request.remote.request_id, "remote.request_id")
        if len(remote_blocks) != len(local):
            raise InvalidArgument(
                "remote.block_ids", f"lists {len(remote_blocks)} groups, local_block_ids {len(local)}"
            )
        # Whether the local blocks fit the remote ones depends on both block sizes; the plan checks
        # it after the handshake (a mismatch is LOAD_FAILED with the reason).
        timeout = validation.duration(request.timeout_seconds, "timeout_seconds", ctx.settings.transfer_timeout_seconds)
        known = ctx.peers.cached_view(request.remote.address, request.remote.engine_id)
        problem = known.block_ids_problem(remote_blocks) if known is not None else None
        if problem:  # else checked against the handshake before reading
            raise InvalidArgument("remote.block_ids", problem)
        engine = self._table.require_engine(request.engine_id, request.request_id, local, "local_block_ids", reads=True)
        pending = self._table.admit(request, common_pb2.TRANSFER_MODE_PULL, local)
        if not self._keep.admitted(pending):
            return engine_pb2.PullResponse(accepted=True)
        ctx.tasks.spawn(
            self._run_pull(pending, engine, remote_blocks, timeout), engines=self._table.engines_of(pending)
        )
        return engine_pb2.PullResponse(accepted=True)

    async def _run_pull(
        self, pending: ConsumerRequest, engine: Engine, remote_blocks: BlockIds, timeout: float
    ) -> None:
        """handshake -> check -> window -> read (a second handshake and READ once, if the first
        READ met a producer engine that re-registered since the cached handshake)."""
        ctx, table, keep = self._ctx, self._table, self._keep
        address = pending.remote.address
        if not any(pending.local_blocks):
            # Full prefix hit: nothing to read, but the producer must learn it may free its blocks.
            await table.tell_producer(pending, consumed=True, reason="full prefix-cache hit on the consumer")
            table.finish(pending, engine_pb2.Event(kind=engine_pb2.FINISHED_RECEIVING))
            return
        give_up = time.monotonic() + timeout
        expected = None
        try:
            await keep.before_handshake(
                pending, ctx.peers.cached_view(address, pending.remote.engine_id), remote_blocks
            )
            for attempt in (1, 2):
                view = await self._handshake(pending, engine)
                local = self._check(engine, view, remote_blocks, address)
                if self._integrity.applies(pending):
                    await keep.ensure_known(pending)
                    # Before the READ: its notification lets the producer free the blocks.
                    expected = await self._producer_digests(pending, local, engine.tp_size, view, remote_blocks)
                clearance = await keep.clear_read(pending, view, remote_blocks)
                outcome = await self._read(pending, engine, local, view, remote_blocks, clearance, give_up)
                if not await self._read_again(pending, outcome, attempt, view):
                    break
        except RequestEnded:
            return  # released, or failed by a heartbeat round: no READ may start
        except TimeoutError:
            reason = f"handshake with {address or 'this sidecar'} timed out"
            table.fail(pending, reason, reason_label="handshake")
            # A slow producer, not a dead one, would hold the blocks until its lease ran out.
            await table.tell_producer(pending, consumed=False, reason=reason)
            return
        except ProducerLost as exc:
            if table.is_open(pending):  # else whoever ended it told the producer
                table.fail(pending, str(exc), reason_label="producer_lost")
                # Its "unknown" may be a release there that waits for this READ (its bound) unless told.
                await table.tell_producer(pending, consumed=False, reason=str(exc))
            return
        except ForeignBlocks as exc:
            # The producer's request is left alone: these were not its blocks to give.
            table.fail(pending, str(exc), reason_label="foreign_blocks")
            keep.foreign.pop(pending.key, None)
            return
        except (SidecarError, PlanError) as exc:
            label = "incompatible" if isinstance(exc, (FailedPrecondition, PlanError)) else "handshake"
            table.fail(pending, str(exc), reason_label=label)
            await table.tell_producer(pending, consumed=False, reason=str(exc))
            return
        finally:
            pending.transferring = False
        await self._end(pending, outcome, expected)

    async def _handshake(self, pending: ConsumerRequest, engine: Engine) -> EngineView:
        ctx = self._ctx
        # asyncio.timeout, not wait_for: wait_for runs the (usually cached, instant) lookup in a task
        # of its own, a loop iteration later.
        async with asyncio.timeout(ctx.settings.peer_call_timeout_seconds):
            return await ctx.trace.timed(
                "consumer",
                pending.engine_id,
                pending.request_id,
                "handshake",
                f"{pending.remote.address} {pending.remote.engine_id}",
                ctx.peers.engine(pending.remote.address, pending.remote.engine_id, engine.compatibility_hash),
            )

    def _check(self, engine: Engine, view: EngineView, remote_blocks: BlockIds, address: str) -> list[LocalWorker]:
        """The named blocks exist at the producer and the two engines pair (raises otherwise)."""
        problem = view.block_ids_problem(remote_blocks)
        if problem:
            raise InvalidArgument("remote.block_ids", f"{problem} (engine {view.engine_id} of {address})")
        local = engine.local_workers()
        self._ctx.dataplane.check(
            local, engine.tp_size, view, (f"on consumer {engine.engine_id}", f"on producer {view.engine_id}")
        )
        return local

    async def _read(
        self,
        pending: ConsumerRequest,
        engine: Engine,
        local: list[LocalWorker],
        view: EngineView,
        remote_blocks: BlockIds,
        clearance: ReadClearance,
        give_up: float,
    ) -> TransferOutcome:
        ctx = self._ctx
        ctx.metrics.child(ctx.metrics.pull_reads, "voucher" if clearance.vouched else "producer").inc()
        # The READ must end while the producer still holds the blocks for certain.
        window = min(give_up, clearance.until) - time.monotonic()
        pending.transferring = True
        return await ctx.dataplane.run(
            TransferJob(
                op="READ",
                initiator=local,
                initiator_tp=engine.tp_size,
                target=view,
                initiator_blocks=pending.local_blocks,
                target_blocks=remote_blocks,
                target_request_id=pending.remote.request_id,
                transfer_id=pending.transfer_id,
                timeout=window,
                num_tokens=pending.remote.num_tokens,
                on_step=ctx.trace.hook("consumer", pending.engine_id, pending.request_id),
            )
        )

    async def _read_again(
        self, pending: ConsumerRequest, outcome: TransferOutcome, attempt: int, view: EngineView
    ) -> bool:
        """Whether to handshake afresh and READ once more: the producer's engine may have
        re-registered (new agents) since we cached its handshake. NIXL reports that as a disconnect
        (an endpoint to the old agent), and a heartbeat that saw the new generation dropped the
        view meanwhile."""
        ctx, address = self._ctx, pending.remote.address
        if outcome.ok or attempt == 2 or pending.cancel_reason or ctx.peers.is_self(address):
            return False
        stale = ctx.peers.cached_view(address, pending.remote.engine_id) is not view
        if not (outcome.peer_gone or stale):
            return False
        log.info("pull_retry_after_stale_handshake", peer=address, engine_id=pending.remote.engine_id,
                 error=outcome.error)  # fmt: skip
        await ctx.peers.forget_engine(address, pending.remote.engine_id, "transfer from it failed")
        return True

    async def _end(
        self, pending: ConsumerRequest, outcome: TransferOutcome, expected: peer_pb2.KvDigests | None
    ) -> None:
        ctx, table = self._ctx, self._table
        pending.bytes_moved = outcome.bytes
        if pending.cancel_reason:
            table.fail(pending, pending.cancel_reason, reason_label="released")
            await table.tell_producer(pending, consumed=False, reason=pending.cancel_reason)
            return
        if outcome.ok:
            pending.received = True
            ctx.metrics.child(ctx.metrics.request_duration, "pull", "consumer").observe(
                time.monotonic() - pending.created
            )
            if expected is not None:
                await self._integrity.finish_checked(pending, expected)
            else:
                table.finish(pending, engine_pb2.Event(kind=engine_pb2.FINISHED_RECEIVING))
            return
        if outcome.peer_gone:
            await ctx.peers.forget(pending.remote.address, "transfer from it failed")
        table.fail(pending, f"READ failed: {outcome.error}", reason_label="transfer")
        await table.tell_producer(pending, consumed=False, reason=outcome.error)

    async def _producer_digests(
        self,
        pending: ConsumerRequest,
        local: list[LocalWorker],
        tp_size: int,
        view: EngineView,
        remote_blocks: BlockIds,
    ) -> peer_pb2.KvDigests:
        ctx = self._ctx
        span = ctx.dataplane.digest_span(
            "READ", local, tp_size, view, pending.local_blocks, remote_blocks, pending.remote.num_tokens
        )
        response = await ctx.peers.get_digests(
            pending.remote.address,
            peer_pb2.GetDigestsRequest(
                caller_sidecar_id=ctx.identity.sidecar_id,
                engine_id=pending.remote.engine_id,
                request_id=pending.remote.request_id,
                transfer_id=pending.transfer_id,
                span=span.to_proto(),
            ),
        )
        return response.digests
