"""The consumer side of a node: a local engine receiving KV from a producer.

- Pull (``pull.py``): handshake the producer's sidecar (cached), check the pairing, ask the
  keep-alive whether and until when the READ may run, READ the producer's blocks into the local
  ones with one notification per transfer, then FINISHED_RECEIVING to every local worker, or
  LOAD_FAILED with the block ids. A full prefix hit reads nothing and only tells the producer.
- Push (``push.py``): handshake, then ``PushReg`` to the producer's sidecar; the producer's WRITEs
  arrive with notifications; once every local worker counted the notifications it expects,
  FINISHED_RECEIVING. A ``TransferFailed`` fails the request at once; a registration watchdog fails
  it if nothing arrives in time (after asking the producer to cancel, so no WRITE lands later).
- Keep-alive (``keepalive.py``): while a request waits, heartbeats keep its producer's lease alive;
  a producer that no longer knows the request, or a peer that stops answering, fails it instead of
  leaving it to time out. "May a pull READ now, and until when?" is answered there, in one place.
- Fences (``fences.py``): a push given up while its producer may still write has its pages fenced
  (GPU memory: its LOAD_FAILED held) until no WRITE can land.
- The request table (``table.py``): the requests, admission, and the one way a wait ends.

No block goes back to the engine while a transfer may still land in it (see ``keepalive`` for the
READ's bounds, ``fences`` for the WRITEs'). ``ConsumerSide`` is the facade the node, the servicers
and tests use; it builds the parts and routes the calls that span them (release, an engine gone).
Runs on the event loop thread.
"""

from __future__ import annotations

from kvsidecar.v1 import engine_pb2, peer_pb2
from sidecar.core.consumer.fences import Fence, PushFences
from sidecar.core.consumer.integrity import DigestCheck
from sidecar.core.consumer.keepalive import KeepAlive
from sidecar.core.consumer.pull import PullReader
from sidecar.core.consumer.push import PushReceiver
from sidecar.core.consumer.table import (
    ConsumerRequest,
    ConsumerTable,
    ForeignBlocks,
    KeptAlive,
    ProducerLost,
    RequestKey,
)
from sidecar.core.context import NodeContext
from sidecar.core.push_staging import PushStaging
from sidecar.core.registry import Worker

__all__ = ["ConsumerRequest", "ConsumerSide", "Fence", "ForeignBlocks", "KeptAlive", "ProducerLost"]


class ConsumerSide:
    def __init__(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        self.table = ConsumerTable(ctx, on_watchdog=lambda keys: self.push.on_watchdog(keys))
        self.fences = PushFences(ctx, self.table)
        self.keepalive = KeepAlive(ctx, self.table, self.fences)
        integrity = DigestCheck(ctx, self.table)
        self.pull_reader = PullReader(ctx, self.table, self.keepalive, integrity)
        self.push = PushReceiver(ctx, self.table, self.keepalive, self.fences, integrity)
        # Staged pushes into our GPU engines (Stage with inbound): their copies hold a failure.
        self.push_staging = PushStaging(ctx, self.table.requests)
        self.table.failure_held = self.push_staging.holds

    @property
    def requests(self) -> dict[RequestKey, ConsumerRequest]:
        return self.table.requests

    @property
    def kept(self) -> dict[RequestKey, KeptAlive]:
        return self.keepalive.kept

    def start(self) -> None:
        self.keepalive.start()

    async def stop(self) -> None:
        self.table.watchdogs.close()
        await self.keepalive.stop()

    # --- EngineService ------------------------------------------------------------------------

    async def keep_alive(self, request: engine_pb2.KeepAliveRequest) -> engine_pb2.KeepAliveResponse:
        return await self.keepalive.keep_alive(request)

    async def pull(self, request: engine_pb2.PullRequest) -> engine_pb2.PullResponse:
        return await self.pull_reader.pull(request)

    async def expect_push(self, request: engine_pb2.ExpectPushRequest) -> engine_pb2.ExpectPushResponse:
        return await self.push.expect_push(request)

    def release(self, engine_id: str, request_id: str, reason: str) -> ConsumerRequest | None:
        """The local engine aborts a request that waits for KV."""
        key = (engine_id, request_id)
        self.keepalive.end(key)
        pending = self.table.requests.get(key)
        if pending is None:
            self.keepalive.forget_checks(key)  # a keep-alive's heartbeats may have filled them
            return None
        if pending.is_push and any(pending.local_blocks):
            self.push.release(pending, reason)
            return pending
        if pending.transferring:
            # The producer must keep its blocks while our READ runs: it learns of the release, and
            # the engine of its end, once the READ is over.
            pending.cancel_reason = f"released: {reason}"
            return pending
        self._ctx.tasks.spawn(self.table.tell_producer(pending, consumed=False, reason=reason), engines=[])
        self.table.fail(pending, f"released: {reason}", reason_label="released")
        return pending

    # --- PeerService and notifications --------------------------------------------------------

    async def handle_transfer_failed(
        self, request: peer_pb2.TransferFailedRequest, identity: str = ""
    ) -> peer_pb2.TransferFailedResponse:
        return await self.push.handle_transfer_failed(request, identity)

    def on_notice(self, worker: Worker, notice: peer_pb2.TransferNotice, seen_at: float = 0.0) -> bool:
        return self.push.on_notice(worker, notice, seen_at)

    async def heartbeat_once(self) -> None:
        await self.keepalive.heartbeat_once()

    # --- the node's lifecycle -----------------------------------------------------------------

    def drop_engine(self, engine_id: str, reason: str) -> None:
        table, keep = self.table, self.keepalive
        for pending in [p for p in table.requests.values() if p.engine_id == engine_id]:
            self._ctx.tasks.spawn(table.tell_producer(pending, consumed=False, reason=reason), engines=[])
            if not pending.transferring:
                table.fail(pending, reason, reason_label="engine_gone")
        # Requests that waited in the engine's queue: no Pull will come, so stop keeping their
        # producers' leases alive (heartbeats would hold its blocks until the keep-alive's
        # timeout, minutes) and let the producers free them now.
        for kept in [k for k in keep.kept.values() if k.engine_id == engine_id]:
            keep.end(kept.key)
            keep.forget_checks(kept.key)
            self._ctx.tasks.spawn(table.tell_producer(kept, consumed=False, reason=reason), engines=[])
        for key in [key for key in keep.lost if key[0] == engine_id]:
            del keep.lost[key]

    def fail_all(self, reason: str) -> None:
        for pending in list(self.table.requests.values()):
            self.table.fail(pending, reason, reason_label="shutdown")

    def status_rows(self) -> list[engine_pb2.RequestStatus]:
        return self.table.status_rows()
