"""PeerService.Stage on the producer's side (target-side staging, ``dataplane.target_staging``):
a peer on another node asks this sidecar to copy a chunk of a held request's GPU KV into a slot of
its pinned pool, to READ it from there. Checks the request and the worker here, then hands the
copy to the data plane's ``StagingServer``. Runs on the event loop thread."""

from __future__ import annotations

import asyncio

from kvsidecar.v1 import peer_pb2
from sidecar.core import validation
from sidecar.core.context import NodeContext
from sidecar.core.producer import ProducerSide
from sidecar.core.producer_request import held_for_pull
from sidecar.dataplane.plan.descriptors import block_byte_ranges
from sidecar.dataplane.target_staging import unpack_rows
from sidecar.errors import FailedPrecondition, InvalidArgument


class StageRoute:
    def __init__(self, ctx: NodeContext, producer: ProducerSide) -> None:
        self._ctx = ctx
        self._producer = producer

    async def handle(self, request: peer_pb2.StageRequest) -> peer_pb2.StageResponse:
        """Hand back the slots the caller has read, then copy a chunk of a held request's GPU KV
        into a slot for it to READ. The copy is a task of the engine, so a worker's removal waits
        for it before unmapping its memory."""
        ctx = self._ctx
        server = ctx.dataplane.staging_server
        if server is None:
            raise FailedPrecondition("this sidecar does not stage GPU memory (host_staging.mode = off)")
        server.give_back(list(request.done_slots))
        if not request.rows:
            return peer_pb2.StageResponse()
        validation.identifier(request.engine_id, "engine_id")
        validation.identifier(request.request_id, "request_id", required=False)
        validation.identifier(request.transfer_id, "transfer_id", required=False)
        pending = held_for_pull(
            self._producer.find(request.engine_id, request.request_id, request.transfer_id), request
        )
        worker = ctx.registry.by_agent(request.agent_name)
        if worker is None or worker.engine_id != pending.engine_id or worker.staging_pool is None:
            raise InvalidArgument(
                "agent_name", f"{request.agent_name!r} is no staged GPU worker of the request's engine"
            )
        rows = unpack_rows(request.rows)
        # Only the request's own blocks of this worker (a row may span adjacent ones).
        allowed = block_byte_ranges(worker.layout, pending.block_ids)
        staging = server.stage(worker.layout.device_id, allowed, rows, request.timeout_seconds)
        # Shielded: a caller that gives up (its call's deadline) must not cancel the copy half way;
        # the slot it fills is then lent until the lease ends, as for a consumer that vanished.
        staged = await asyncio.shield(ctx.tasks.spawn(staging, engines=[worker.engine_id]))
        return peer_pb2.StageResponse(slot=staged.slot, address=staged.address)
