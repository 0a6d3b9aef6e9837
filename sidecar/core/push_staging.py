"""Push staging on the consumer's side: a producer on another node pushes into this sidecar's GPU
engine through the sidecar's own pinned pool instead of WRITing into the engine's imported GPU
memory (which no NIC can register and which UCX only emulates over TCP).

The consumer's VRAM worker advertises the pool in its handshake (``WorkerDescriptor.
staging_pool``, registered with its agent at registration, as for target-side pulls). The
producer's sidecar then, per chunk (``dataplane.staged_push``): asks for a slot (``PeerService.
Stage`` with ``inbound``, ``lend``), WRITEs the chunk into it (no notification), and names the
slot and the chunk's rows in the next ``inbound`` Stage call; this sidecar copies slot -> the
engine's blocks with one ``batch_copy`` and answers once the copy is complete (``StagingServer.
land``; the slot is back in the pool). Only after the last chunk's answer does the producer send
the request's notification, so FINISHED_RECEIVING (``ConsumerSide.on_notice``, unchanged) always
follows the last copy into the engine.

Checked here: the request is a push this sidecar expects (ExpectPush, not yet received), the
agent is a staged GPU worker of its engine, every row lies inside the request's own destination
blocks of that worker and inside the slot, the landed slot is lent to this request. A slot lent
to a producer that crashed or went silent returns at its lease's end (the producer's transfer
deadline plus a margin). A late WRITE can only land in a slot of the pool, never in the engine.

A copy into the engine that is still running, or late past its deadline, holds the request's
blocks: the consumer's failure of the request (TransferFailed, watchdog, release) waits until the
copy completes (``holds``, the hook in ``ConsumerSide._fail``; ``device_copy.LateCopies``), as a
pull's late copy does.

Runs on the event loop thread (waiting for a copy runs in a worker thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Protocol

from kvsidecar.v1 import peer_pb2
from sidecar.core import validation
from sidecar.core.context import NodeContext
from sidecar.dataplane import cuda_ipc
from sidecar.dataplane.plan.descriptors import block_byte_ranges
from sidecar.dataplane.plan.layout import BlockIds
from sidecar.dataplane.target_staging import unpack_rows
from sidecar.errors import FailedPrecondition, InvalidArgument, NotFound
from sidecar.logs import get_logger

log = get_logger("kvsidecar.push_staging")

RequestKey = tuple[str, str]


class PushTarget(Protocol):
    """What push staging needs of a consumer request (``consumer.ConsumerRequest``)."""

    engine_id: str
    local_blocks: BlockIds
    received: bool

    @property
    def is_push(self) -> bool: ...


class PushStaging:
    """The consumer's side of a staged push (see the module docstring). Event loop thread."""

    def __init__(self, ctx: NodeContext, requests: Mapping[RequestKey, PushTarget]) -> None:
        self._ctx = ctx
        self._requests = requests
        # Copies slot -> engine per request that may still write its blocks (running or late).
        self._copies: dict[RequestKey, set[cuda_ipc.PendingCopy]] = {}
        self._holding: set[RequestKey] = set()  # requests whose failure waits for such copies

    async def handle(self, request: peer_pb2.StageRequest) -> peer_pb2.StageResponse:
        """``PeerService.Stage`` with ``inbound``: land a chunk (copy it into the engine, answer
        once complete), lend a slot for the next one, or both."""
        ctx = self._ctx
        server = ctx.dataplane.staging_server
        if server is None:
            raise FailedPrecondition("this sidecar does not stage GPU memory (host_staging.mode = off)")
        validation.identifier(request.engine_id, "engine_id")
        validation.identifier(request.request_id, "request_id")
        key = (request.engine_id, request.request_id)
        server.give_back(list(request.done_slots), key)
        if not request.rows and not request.lend:
            return peer_pb2.StageResponse()
        pending = self._requests.get(key)
        if pending is None or not pending.is_push or pending.received:
            raise NotFound(f"no push into request {request.engine_id}/{request.request_id} is expected here")
        worker = ctx.registry.by_agent(request.agent_name)
        if worker is None or worker.engine_id != pending.engine_id or worker.staging_pool is None:
            raise InvalidArgument(
                "agent_name", f"{request.agent_name!r} is no staged GPU worker of the request's engine"
            )
        if request.rows:
            rows = unpack_rows(request.rows)
            # Only the request's own destination blocks of this worker (a row may span adjacent ones).
            allowed = block_byte_ranges(worker.layout, pending.local_blocks)
            running = self._copies.setdefault(key, set())
            landing = server.land(
                key, worker.layout.device_id, request.landed_slot, allowed, rows, request.timeout_seconds, running
            )
            try:
                # A task of the engine: a worker's removal waits for it before unmapping the memory.
                # Shielded: a caller that gives up must not cancel the wait for the copy half way.
                await asyncio.shield(ctx.tasks.spawn(landing, engines=[worker.engine_id]))
            finally:
                if not running and self._copies.get(key) is running:
                    del self._copies[key]
        if not request.lend:
            return peer_pb2.StageResponse()
        staged = await server.lend(key, request.timeout_seconds)
        return peer_pb2.StageResponse(slot=staged.slot, address=staged.address)

    def holds(self, engine_id: str, key: RequestKey, fail: Callable[[], None]) -> bool:
        """The consumer is failing request ``key``: if a copy into its blocks may still write them,
        call ``fail`` only once every such copy has completed and return True (the hook in
        ``ConsumerSide._fail``); False: nothing holds it, fail now."""
        if key in self._holding:
            return True  # failed again while held (e.g. the watchdog): the held failure follows
        copies = self._copies.pop(key, None)
        if not copies:
            return False
        late = tuple(copies)
        self._holding.add(key)

        async def wait_then_fail() -> None:
            try:
                await self._ctx.dataplane.late_copies.hold(late)
            finally:
                self._holding.discard(key)
            fail()

        log.warning("push_staging_blocks_held", engine_id=key[0], request_id=key[1], copies=len(late))
        self._ctx.tasks.spawn(wait_then_fail(), engines=[engine_id])
        return True
