"""The consumer's request table: what a local engine waits for, and the one way a wait ends.

Owns ``ConsumerRequest`` (a Pull or ExpectPush being served), ``KeptAlive`` (a request still in
the engine's queue), the table of requests with its push watchdog timer, admission (capacity, the
engine's checks), the terminal event (``fail`` / ``finish``) and the Release call that tells the
producer's sidecar it may free. The other consumer modules (keep-alive, fences, pull, push) read
and end requests only through it. Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvsidecar.block_ids import block_ids_of
from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar.core import validation
from sidecar.core.admission import Ticket
from sidecar.core.context import NodeContext
from sidecar.core.notices import NoticeTally
from sidecar.core.registry import CONSUMER_ROLES, Engine
from sidecar.core.timers import DeadlineTimer
from sidecar.core.trace import since_rpc
from sidecar.dataplane.plan.blocks import check_block_ids
from sidecar.dataplane.plan.layout import BlockIds
from sidecar.dataplane.views import EngineView
from sidecar.errors import FailedPrecondition, InvalidArgument, SidecarError, Unavailable
from sidecar.logs import get_logger

log = get_logger("kvsidecar.consumer")

RequestKey = tuple[str, str]  # (engine_id, request_id)


class ProducerLost(FailedPrecondition):
    """The producer no longer holds a request's blocks."""


class ForeignBlocks(FailedPrecondition):
    """A pull names producer blocks that were not submitted for the request it names."""


class RequestEnded(Exception):
    """The request ended (released, or failed by a heartbeat round) while it was being served:
    its engine has the blocks back and the producer was told; nothing more may be done for it."""


class _Keyed:
    """What a heartbeat names a waiting request by (shared by ConsumerRequest and KeptAlive)."""

    engine_id: str
    request_id: str
    transfer_id: str
    remote: engine_pb2.RemoteBlocks

    @property
    def key(self) -> RequestKey:
        return (self.engine_id, self.request_id)

    def heartbeat_key(self) -> peer_pb2.RequestKey:
        return peer_pb2.RequestKey(
            request_id=self.remote.request_id, transfer_id=self.transfer_id, consumer_request_id=self.request_id
        )


@dataclass
class ConsumerRequest(_Keyed):
    engine_id: str
    request_id: str
    transfer_id: str
    mode: int
    local_blocks: BlockIds
    remote: engine_pb2.RemoteBlocks
    created: float = field(default_factory=time.monotonic)
    notices: NoticeTally = field(default_factory=NoticeTally)
    registered: bool = False  # push: the producer accepted the registration
    transferring: bool = False  # pull: READs in flight
    # Every byte arrived (the READ ended well, or every WRITE notification came); only the digest
    # check may remain. The producer may free its blocks now: it owes this request nothing more.
    received: bool = False
    cancelling: bool = False  # push released or watchdog fired; waiting for in-flight WRITEs to end
    cancel_reason: str = ""
    # push: when (monotonic) the registration's timeout ends (its PushReg's write_by).
    push_deadline: float = 0.0
    push_reg_sent: bool = False  # push: the PushReg left (the producer may know the registration)
    # push: when (monotonic) the producer's WRITEs into our blocks have ended, posted or failed (its
    # promise in the PushReg answer); None: it promised nothing.
    writes_quiet_at: float | None = None
    held: bool = False  # push given up on GPU memory: its LOAD_FAILED waits (see ``fences.Fence``)
    # A pull: its READs are this node's work, counted in ``ctx.tasks.transfers`` until it ends.
    queued: Ticket | None = field(default=None, repr=False, compare=False)
    bytes_moved: int = 0
    digests: peer_pb2.KvDigests | None = None  # integrity: the producer's digests (push)
    missed_heartbeats: int = 0  # consecutive periodic heartbeats for it that its producer did not answer
    # push: set once the PushReg call returned (or failed); a release waits for it first.
    registration_done: asyncio.Event = field(default_factory=asyncio.Event)
    # pull: the voucher's verdict against one handshake (view, until): checked once per view.
    vouched: tuple[EngineView, float] | None = field(default=None, repr=False, compare=False)

    @property
    def is_push(self) -> bool:
        return self.mode == common_pb2.TRANSFER_MODE_PUSH

    @property
    def reads_remote(self) -> bool:
        return not self.is_push

    @property
    def judged_by_heartbeats(self) -> bool:
        """A heartbeat's answer may fail it: not while its READ runs (the READ's end decides), nor
        once every byte arrived (the producer that freed it meanwhile did nothing wrong)."""
        return not (self.transferring or self.received)


@dataclass
class KeptAlive(_Keyed):
    """A request that waits in the local engine's queue; its producer's lease is kept alive."""

    engine_id: str
    request_id: str
    transfer_id: str
    remote: engine_pb2.RemoteBlocks
    missed_heartbeats: int = 0
    reads_remote = True  # its Pull (if it becomes one) reads remote.block_ids


Waiting = ConsumerRequest | KeptAlive


def named_blocks(item: Waiting) -> BlockIds:
    """The producer blocks a pull would read (empty for a push: the producer picks its own)."""
    if not item.reads_remote:
        return ()
    named = block_ids_of(item.remote.block_ids)
    return named if any(named) else ()


class ConsumerTable:
    """The requests a local engine waits for. ``on_watchdog``: the push registration watchdog's
    callback (``push.PushReceiver.on_watchdog``); ``on_end``: called with each request that ends,
    so the keep-alive forgets its checks and a held fence goes."""

    def __init__(self, ctx: NodeContext, on_watchdog: Callable[[list[RequestKey]], None]) -> None:
        self._ctx = ctx
        self.requests: dict[RequestKey, ConsumerRequest] = {}
        # Asked before a request fails: True if the failure must wait (a staged push's copy into
        # its blocks still running, ``core.push_staging``), which calls ``fail`` again when done.
        self.failure_held: Callable[[str, RequestKey, Callable[[], None]], bool] = lambda *_: False
        self.watchdogs: DeadlineTimer[RequestKey] = DeadlineTimer(on_watchdog)
        self.on_end: list[Callable[[ConsumerRequest], None]] = []

    def is_open(self, pending: ConsumerRequest) -> bool:
        """Still this request's wait (not ended, not replaced): its blocks are not the engine's."""
        return self.requests.get(pending.key) is pending

    def require_open(self, pending: ConsumerRequest) -> None:
        if not self.is_open(pending):
            raise RequestEnded(pending.request_id)

    # --- admission ----------------------------------------------------------------------------

    def validate_fields(
        self, engine_id: str, request_id: str, transfer_id: str, blocks_message: common_pb2.GroupedBlockIds, field: str
    ) -> BlockIds:
        """Checks that need no state: malformed input is INVALID_ARGUMENT whatever else is wrong."""
        validation.identifier(engine_id, "engine_id")
        validation.identifier(request_id, "request_id")
        validation.identifier(transfer_id, "transfer_id", required=False)
        return validation.block_ids(blocks_message, field, self._ctx.settings.max_blocks_per_request)

    def require_engine(
        self, engine_id: str, request_id: str, blocks: BlockIds, field: str, reads: bool = False
    ) -> Engine:
        """The engine, if it may take this request now. ``reads``: a pull, whose READs this node
        drives (admission by queueing delay too, ``core.admission``)."""
        ctx = self._ctx
        engine = ctx.registry.require_engine(engine_id, "engine_id", CONSUMER_ROLES)
        problem = check_block_ids(blocks, engine.num_groups, engine.num_blocks, engine.physical_per_logical)
        if problem:
            raise InvalidArgument(field, problem)
        if (engine_id, request_id) in self.requests:
            raise FailedPrecondition(f"request {request_id!r} of engine {engine_id!r} is already waiting for KV")
        # Held GPU pushes (see ``fences.Fence``) wait on a producer that went quiet; they do not keep
        # requests to other producers out.
        held = sum(1 for pending in self.requests.values() if pending.held)
        ctx.tasks.check_capacity(len(self.requests) - held, transfer=reads)
        return engine

    def engines_of(self, pending: ConsumerRequest) -> list[str]:
        engines = [pending.engine_id]
        if self._ctx.peers.is_self(pending.remote.address):
            engines.append(pending.remote.engine_id)
        return engines

    def admit(
        self, request: engine_pb2.PullRequest | engine_pb2.ExpectPushRequest, mode: int, local: BlockIds
    ) -> ConsumerRequest:
        """Start tracking a validated request (the keep-alive then says whether its producer
        already dropped it: ``keepalive.KeepAlive.admitted``)."""
        pending = ConsumerRequest(
            engine_id=request.engine_id,
            request_id=request.request_id,
            transfer_id=request.transfer_id,
            mode=mode,
            local_blocks=local,
            remote=request.remote,
        )
        self.requests[pending.key] = pending
        if not pending.is_push:
            pending.queued = self._ctx.tasks.transfers.started()
        self._ctx.trace.event(
            "consumer",
            pending.engine_id,
            pending.request_id,
            "admitted",
            f"{'ExpectPush' if pending.is_push else 'Pull'}: {sum(map(len, local))} blocks from "
            f"{request.remote.engine_id}/{request.remote.request_id or '?'} at {request.remote.address or 'here'}",
            transfer_id=pending.transfer_id,
            ids=(request.remote.request_id,),
            peer=request.remote.address,
            mode="push" if pending.is_push else "pull",
            measured=since_rpc(),
        )
        if pending.is_push:
            self._ctx.dataplane.expect_notifications(1)
        self._ctx.metrics.pending_receives.set(len(self.requests))
        return pending

    # --- the producer's side of the end -------------------------------------------------------

    async def tell_producer(self, pending: Waiting, consumed: bool, reason: str) -> bool:
        """Tell the producer's sidecar it may free (or drop the registration). Returns True if
        transfers are still in flight there. Best effort: its lease frees the blocks otherwise."""
        return bool(await self.ask_producer(pending, consumed, reason))

    async def ask_producer(
        self, pending: Waiting, consumed: bool, reason: str, wait_for_ready: bool = True
    ) -> bool | None:
        """Release at the producer: whether transfers are still in flight there, None if it did not
        answer. Without ``wait_for_ready``, a refused connection (no process listening) is False;
        any other failure (a link down, a server shutting down while its WRITEs drain) is None."""
        try:
            response = await self._ctx.peers.release(
                pending.remote.address,
                peer_pb2.PeerReleaseRequest(
                    caller_sidecar_id=self._ctx.identity.sidecar_id,
                    engine_id=pending.remote.engine_id,
                    request_id=pending.remote.request_id,
                    transfer_id=pending.transfer_id,
                    consumer_request_id=pending.request_id,
                    consumed=consumed,
                    reason=reason,
                ),
                wait_for_ready=wait_for_ready,
            )
        except Unavailable as exc:
            log.info("producer_release_undelivered", peer=pending.remote.address, error=str(exc))
            refused = "connection refused" in str(exc).lower()
            return False if refused and not wait_for_ready else None
        except SidecarError as exc:
            log.info("producer_release_undelivered", peer=pending.remote.address, error=str(exc))
            return None
        return bool(response.in_flight)

    # --- the end ------------------------------------------------------------------------------

    def fail(self, pending: ConsumerRequest, reason: str, reason_label: str) -> None:
        if self.failure_held(pending.engine_id, pending.key, lambda: self.fail(pending, reason, reason_label)):
            return
        self._ctx.metrics.failures.labels(reason=reason_label).inc()
        log.warning(
            "load_failed",
            engine_id=pending.engine_id,
            request_id=pending.request_id,
            producer=pending.remote.engine_id,
            peer=pending.remote.address,
            reason=reason,
        )
        failed = [block for group in pending.local_blocks for block in group]
        self.finish(pending, engine_pb2.Event(kind=engine_pb2.LOAD_FAILED, failed_block_ids=failed, reason=reason))

    def finish(self, pending: ConsumerRequest, event: engine_pb2.Event) -> None:
        if self.requests.pop(pending.key, None) is None:
            return
        for ended in self.on_end:
            ended(pending)
        if pending.queued is not None:
            self._ctx.tasks.transfers.ended(pending.queued, ok=event.kind == engine_pb2.FINISHED_RECEIVING)
        self.watchdogs.cancel(pending.key)
        if pending.is_push:
            self._ctx.dataplane.expect_notifications(-1)
        self._ctx.metrics.pending_receives.set(len(self.requests))
        event.request_id = pending.request_id
        event.transfer_id = pending.transfer_id
        event.bytes = pending.bytes_moved
        event.duration_ms = (time.monotonic() - pending.created) * 1000.0
        # The engine's event first: recording the end also derives the request's stages.
        self._ctx.events.emit(pending.engine_id, event)
        self._ctx.trace.ended("consumer", pending.engine_id, pending.request_id, event.kind, event.reason, event.bytes)

    def status_rows(self) -> list[engine_pb2.RequestStatus]:
        rows = []
        for pending in self.requests.values():
            if pending.is_push:
                state = "registered" if pending.registered else "registering"
                if pending.cancelling:
                    state = "held_for_late_writes" if pending.held else "cancelling"
            else:
                state = "reading" if pending.transferring else "handshaking"
            remaining = self.watchdogs.remaining(pending.key)
            rows.append(
                engine_pb2.RequestStatus(
                    engine_id=pending.engine_id,
                    request_id=pending.request_id,
                    transfer_id=pending.transfer_id,
                    side="consumer",
                    mode=pending.mode,  # type: ignore[arg-type]
                    state=state,
                    deadline_in_seconds=remaining if remaining is not None else -1.0,
                    num_blocks=sum(len(group) for group in pending.local_blocks),
                )
            )
        return rows
