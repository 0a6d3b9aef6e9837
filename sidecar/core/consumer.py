"""The consumer side of a node: a local engine receiving KV from a producer.

- Pull: handshake the producer's sidecar (cached), READ the producer's blocks into the local
  blocks with one notification per transfer, then FINISHED_RECEIVING to every local worker, or
  LOAD_FAILED with the block ids. A full prefix hit reads nothing and only tells the producer.
- Push: handshake, then ``PushReg`` to the producer's sidecar; the producer's WRITEs arrive with
  notifications; once every local worker counted the notifications it expects, FINISHED_RECEIVING.
  A ``TransferFailed`` from the producer fails the request at once; a registration watchdog fails
  it if nothing arrives in time (after asking the producer to cancel, so no WRITE lands later).

While a request waits, this side heartbeats the producer's sidecar so its lease stays alive; a
producer that no longer knows the request, or a peer that stops answering, fails the request
instead of leaving it to time out. Runs on the event loop thread.

No block goes back to the engine while a transfer may still land in it:
- pull: a READ starts only after a heartbeat found the request at the producer, and must end by
  that heartbeat's send time + the extension the producer granted (the transport fails a READ
  seen DONE later), because the producer may reuse the blocks after that (see producer.py); or,
  with the producer engine's voucher (``kvsidecar.voucher``: these blocks of this request, held
  until a time), without a heartbeat, and it must end by the voucher's time less the clock skew
  allowance;
- push: the producer's WRITEs are one-sided. A release or watchdog first asks the producer to
  drop the request and waits (bounded) for its WRITEs to end. If the producer cannot answer (hung,
  stopped) or the bound passes, the blocks' pages are fenced (made read-only in this sidecar,
  ``dataplane.memory.WriteFences``) before LOAD_FAILED, so a WRITE that resumes later fails instead of landing;
  the fence is lifted once the producer answers that nothing is in flight, or is gone. GPU memory
  cannot be made read-only: there the LOAD_FAILED itself waits for those answers, bounded by the
  end of its WRITEs the producer promised (it posts none later than the registration's timeout
  after the PushReg reached it, and gives each its transfer timeout:
  ``PushRegResponse.writes_end_within_seconds``) unless it said a WRITE is still in flight; the
  engine keeps the blocks until then. (Not a bound for pages: a producer stopped in the middle of
  a posted WRITE finishes it when it resumes, whenever that is, and a fence costs the engine
  nothing while it stands.)

Why one module of ~850 lines: pull, push, the keep-alive heartbeats and the write fences share one
request table, one "does the producer still hold it" state (``_confirmed``, ``_first_unknown``,
``_lost``) and one failure path (``_fail``); split apart, each half would reach into the other's
state. The next cut, when it grows, is a ``core/keepalive.py`` owning ``kept``, the heartbeat loop
and that state, with the consumer asking it ``confirm_held`` and being told ``producer_lost``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvsidecar import voucher
from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar.config import split_host_port
from sidecar.core import validation
from sidecar.core.context import NodeContext
from sidecar.core.notices import NoticeTally
from sidecar.core.registry import CONSUMER_ROLES, Engine, Worker
from sidecar.core.timers import DeadlineTimer
from sidecar.core.trace import notice_handoff, since_rpc
from sidecar.dataplane.integrity import DigestSpan, check_span, digests, first_mismatch
from sidecar.dataplane.memory import FenceToken, WriteFences
from sidecar.dataplane.plan.blocks import check_block_ids
from sidecar.dataplane.plan.convert import check_exchange, single_group
from sidecar.dataplane.plan.descriptors import block_byte_ranges
from sidecar.dataplane.plan.layout import BlockIds, PlanError
from sidecar.dataplane.plane import EngineView, LocalWorker, TransferJob
from sidecar.errors import (
    DeadlineExceeded,
    Draining,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    SidecarError,
    Unavailable,
)
from sidecar.logs import get_logger
from sidecar.peers.addresses import normalize_address
from sidecar.tls import covers

log = get_logger("kvsidecar.consumer")


class ProducerLost(FailedPrecondition):
    """The producer no longer holds a request's blocks."""


class ForeignBlocks(FailedPrecondition):
    """A pull names producer blocks that were not submitted for the request it names."""


RequestKey = tuple[str, str]  # (engine_id, request_id)
# A READ is posted only with at least this long left before the producer may reuse the blocks.
_MIN_READ_WINDOW = 0.05


@dataclass
class ConsumerRequest:
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
    held: bool = False  # push given up on GPU memory: its LOAD_FAILED waits (see ``_Fence``)
    bytes_moved: int = 0
    digests: peer_pb2.KvDigests | None = None  # integrity: the producer's digests (push)
    missed_heartbeats: int = 0  # consecutive periodic heartbeats for it that its producer did not answer
    # push: set once the PushReg call returned (or failed); a release waits for it first.
    registration_done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def key(self) -> RequestKey:
        return (self.engine_id, self.request_id)

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

    def heartbeat_key(self) -> peer_pb2.RequestKey:
        return peer_pb2.RequestKey(
            request_id=self.remote.request_id, transfer_id=self.transfer_id, consumer_request_id=self.request_id
        )


@dataclass
class KeptAlive:
    """A request that waits in the local engine's queue; its producer's lease is kept alive."""

    engine_id: str
    request_id: str
    transfer_id: str
    remote: engine_pb2.RemoteBlocks
    missed_heartbeats: int = 0
    reads_remote = True  # its Pull (if it becomes one) reads remote.block_ids

    def heartbeat_key(self) -> peer_pb2.RequestKey:
        return peer_pb2.RequestKey(
            request_id=self.remote.request_id, transfer_id=self.transfer_id, consumer_request_id=self.request_id
        )


@dataclass
class _Fence:
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


class ConsumerSide:
    def __init__(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        self.fences = WriteFences()
        self._fenced: list[_Fence] = []
        self.requests: dict[RequestKey, ConsumerRequest] = {}
        self.watchdogs: DeadlineTimer[RequestKey] = DeadlineTimer(self._on_watchdog)
        self.kept: dict[RequestKey, KeptAlive] = {}
        self._kept_deadlines: DeadlineTimer[RequestKey] = DeadlineTimer(self._on_keep_alive_expired)
        # Requests whose producer said it no longer holds them; a later Pull fails at once instead
        # of reading blocks that may already hold another request's KV.
        self._lost: dict[RequestKey, str] = {}
        # Until when (monotonic) a producer is known to hold a request: a heartbeat answered
        # "known" and extended its lease. A READ only starts while this holds.
        self._confirmed: dict[RequestKey, float] = {}
        # Until when (monotonic) a READ of a request may run: the send time of the heartbeat that
        # found it + the extension the producer granted; the producer may reuse the blocks after.
        self._readable: dict[RequestKey, float] = {}
        # When a producer first answered "unknown" for a request it never confirmed.
        self._first_unknown: dict[RequestKey, float] = {}
        # The producer block ids a producer accepted as its request's (a pull reads only those;
        # sent with heartbeats until accepted once), and why it refused them.
        self._verified: dict[RequestKey, BlockIds] = {}
        self._foreign: dict[RequestKey, str] = {}
        # Heartbeat period per producer (address, engine), a third of the extension it grants, so
        # a producer with a shorter lease than ours is still heartbeated in time.
        self._pace: dict[tuple[str, str], float] = {}
        self._pace_changed = asyncio.Event()
        self._heartbeat_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._heartbeat_task = asyncio.ensure_future(self._heartbeat_loop())

    async def stop(self) -> None:
        self.watchdogs.close()
        self._kept_deadlines.close()
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            try:
                await self._heartbeat_task
            except asyncio.CancelledError:
                pass

    # --- EngineService ------------------------------------------------------------------------

    async def keep_alive(self, request: engine_pb2.KeepAliveRequest) -> engine_pb2.KeepAliveResponse:
        ctx = self._ctx
        validation.identifier(request.engine_id, "engine_id")
        validation.identifier(request.request_id, "request_id")
        validation.identifier(request.transfer_id, "transfer_id", required=False)
        validation.remote_blocks(request.remote, "remote", ctx.settings.max_blocks_per_request, False)
        if not (request.remote.request_id or request.transfer_id):
            raise InvalidArgument("remote.request_id", "remote.request_id or transfer_id is required")
        timeout = validation.duration(
            request.timeout_seconds, "timeout_seconds", ctx.settings.push_registration_timeout_seconds
        )
        ctx.registry.require_engine(request.engine_id, "engine_id", CONSUMER_ROLES)
        key = (request.engine_id, request.request_id)
        if key in self._lost:
            return engine_pb2.KeepAliveResponse(producer_holds=False)
        if key in self.requests:
            return engine_pb2.KeepAliveResponse(producer_holds=True)  # its Pull/ExpectPush came first
        if key not in self.kept:
            ctx.tasks.check_capacity(len(self.kept))
        kept = KeptAlive(request.engine_id, request.request_id, request.transfer_id, request.remote)
        self.kept[key] = kept
        self._kept_deadlines.set(key, time.monotonic() + timeout)
        address, engine_id = kept.remote.address, kept.remote.engine_id
        if self._pace_key(address, engine_id) not in self._pace:
            # We do not know how long this producer's leases are: heartbeat now rather than at our
            # own pace, which may be too slow for it.
            ctx.tasks.spawn(self._heartbeat(address, engine_id, [kept]), engines=[])
        return engine_pb2.KeepAliveResponse(producer_holds=True)

    def _on_keep_alive_expired(self, keys: list[RequestKey]) -> None:
        for key in keys:
            self.kept.pop(key, None)
            self._lost.pop(key, None)
            self._forget_checks(key)

    def _forget_checks(self, key: RequestKey) -> None:
        self._confirmed.pop(key, None)
        self._readable.pop(key, None)
        self._first_unknown.pop(key, None)
        self._verified.pop(key, None)
        self._foreign.pop(key, None)

    def _end_keep_alive(self, key: RequestKey) -> str | None:
        """Stop keeping ``key`` alive; returns why it is lost, if the producer dropped it."""
        self.kept.pop(key, None)
        self._kept_deadlines.cancel(key)
        return self._lost.pop(key, None)

    async def pull(self, request: engine_pb2.PullRequest) -> engine_pb2.PullResponse:
        ctx = self._ctx
        local = self._validate_fields(
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
        engine = self._require_engine(request.engine_id, request.request_id, local, "local_block_ids")
        pending = self._admit(request, common_pb2.TRANSFER_MODE_PULL, local)
        if pending is None:
            return engine_pb2.PullResponse(accepted=True)
        ctx.tasks.spawn(self._run_pull(pending, engine, remote_blocks, timeout), engines=self._engines_of(pending))
        return engine_pb2.PullResponse(accepted=True)

    async def expect_push(self, request: engine_pb2.ExpectPushRequest) -> engine_pb2.ExpectPushResponse:
        ctx = self._ctx
        local = self._validate_fields(
            request.engine_id, request.request_id, request.transfer_id, request.block_ids, "block_ids"
        )
        validation.remote_blocks(request.remote, "remote", ctx.settings.max_blocks_per_request, False)
        timeout = validation.duration(
            request.timeout_seconds, "timeout_seconds", ctx.settings.push_registration_timeout_seconds
        )
        engine = self._require_engine(request.engine_id, request.request_id, local, "block_ids")
        pending = self._admit(request, common_pb2.TRANSFER_MODE_PUSH, local)
        if pending is None:
            return engine_pb2.ExpectPushResponse(registered=False, matched=False)
        pending.push_deadline = time.monotonic() + timeout
        self.watchdogs.set(pending.key, pending.push_deadline)
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
                pending.writes_quiet_at = pending.push_deadline + self._ctx.settings.transfer_timeout_seconds
                self._fail_fenced(pending, f"push registration failed: {exc}", "push_registration")
            else:
                self._fail(pending, f"push registration failed: {exc}", reason_label="push_registration")
            if isinstance(exc, PlanError):
                # The producer learns why too (its log names both sides' values) and frees its blocks.
                ctx.tasks.spawn(self._tell_producer(pending, consumed=False, reason=str(exc)), engines=[])
            return engine_pb2.ExpectPushResponse(registered=False, matched=False)
        finally:
            pending.registration_done.set()
        if not any(local):
            # A full prefix hit: nothing will be written. The registration still lets the producer
            # free its blocks as soon as it submits them.
            self._finish(pending, engine_pb2.Event(kind=engine_pb2.FINISHED_RECEIVING))
        return engine_pb2.ExpectPushResponse(registered=True, matched=matched)

    def release(self, engine_id: str, request_id: str, reason: str) -> ConsumerRequest | None:
        """The local engine aborts a request that waits for KV."""
        key = (engine_id, request_id)
        self._end_keep_alive(key)
        pending = self.requests.get(key)
        if pending is None:
            self._forget_checks(key)  # a keep-alive's heartbeats may have filled them
            return None
        if pending.is_push and any(pending.local_blocks):
            # The producer's WRITEs may be in flight: the terminal event waits until they cannot land.
            if not pending.cancelling:
                pending.cancelling = True
                self._ctx.tasks.spawn(self._cancel_push(pending, f"released: {reason}", "released"), engines=[])
            return pending
        if pending.transferring:
            # The producer must keep its blocks while our READ runs: it learns of the release, and
            # the engine of its end, once the READ is over.
            pending.cancel_reason = f"released: {reason}"
            return pending
        self._ctx.tasks.spawn(self._tell_producer(pending, consumed=False, reason=reason), engines=[])
        self._fail(pending, f"released: {reason}", reason_label="released")
        return pending

    # --- PeerService --------------------------------------------------------------------------

    async def handle_transfer_failed(
        self, request: peer_pb2.TransferFailedRequest, identity: str = ""
    ) -> peer_pb2.TransferFailedResponse:
        """``identity``: the caller's certificate names with mTLS, "" without (``sidecar.tls``)."""
        validation.identifier(request.engine_id, "engine_id")
        validation.identifier(request.request_id, "request_id")
        pending = self.requests.get((request.engine_id, request.request_id))
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
        self._fail(pending, f"producer reported: {request.reason}", reason_label="producer_failed")
        return peer_pb2.TransferFailedResponse(sidecar_id=self._ctx.identity.sidecar_id, found=True)

    # --- notifications ------------------------------------------------------------------------

    def on_notice(self, worker: Worker, notice: peer_pb2.TransferNotice, seen_at: float = 0.0) -> bool:
        """A producer's WRITE into ``worker`` completed. False if the request is unknown here.
        ``seen_at``: when the NIXL owner thread saw the notification (time.monotonic())."""
        pending = self.requests.get((notice.engine_id, notice.request_id))
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
            self._ctx.metrics.request_duration.labels(mode="push", side="consumer").observe(
                time.monotonic() - pending.created
            )
            if self._checks_integrity(pending):
                self._ctx.tasks.spawn(self._finish_checked(pending, pending.digests), engines=[pending.engine_id])
            else:
                self._finish(pending, engine_pb2.Event(kind=engine_pb2.FINISHED_RECEIVING))
        return True

    # --- pull ---------------------------------------------------------------------------------

    # --- integrity ----------------------------------------------------------------------------

    def _checks_integrity(self, pending: ConsumerRequest) -> bool:
        """Digests cover one KV cache group; hybrid models' requests move unchecked."""
        return self._ctx.settings.integrity == "digest" and len(pending.local_blocks) == 1

    async def _finish_checked(self, pending: ConsumerRequest, expected: peer_pb2.KvDigests | None) -> None:
        """FINISHED_RECEIVING if the local blocks match the producer's digests, else LOAD_FAILED
        naming the first block that differs. Runs in a task of the local engine."""
        problem = await self._check_digests(pending, expected)
        if self.requests.get(pending.key) is not pending:
            return  # failed meanwhile (watchdog, release)
        if problem:
            self._fail(pending, problem, reason_label="integrity")
        else:
            self._finish(pending, engine_pb2.Event(kind=engine_pb2.FINISHED_RECEIVING))

    async def _check_digests(self, pending: ConsumerRequest, expected: peer_pb2.KvDigests | None) -> str | None:
        if expected is None or not expected.values:
            return "integrity check failed: the producer sent no digests (is its sidecar too old?)"
        engine = self._ctx.registry.engines.get(pending.engine_id)
        if engine is None:  # its worker went meanwhile (drop_engine failed the request)
            return f"integrity check could not run: engine {pending.engine_id!r} is gone"
        span = DigestSpan.from_proto(expected)
        layouts = [worker.layout for worker in engine.ordered_workers()]
        try:
            blocks = single_group(pending.local_blocks, "the request")
            problem = check_span(span, span.first + len(blocks) * layouts[0].block_size)
            if problem:
                return f"integrity check failed: the producer's digests cover {problem}"
            mine = await asyncio.to_thread(digests, layouts, blocks, span.first, span)
        except (PlanError, IndexError, ValueError) as exc:
            return f"integrity check could not run: {exc}"
        bad = first_mismatch(mine, list(expected.values))
        if bad is None:
            return None
        token = span.first + bad * span.granule
        block = blocks[(token - span.first) // layouts[0].block_size]
        last = min(token + span.granule, span.end) - 1
        return (
            f"integrity check failed: block {block} (tokens {token}..{last}) does not match the producer's "
            f"digest ({len(mine)} digests of {span.granule} tokens compared)"
        )

    # --- pull ---------------------------------------------------------------------------------

    async def _run_pull(
        self, pending: ConsumerRequest, engine: Engine, remote_blocks: BlockIds, timeout: float
    ) -> None:
        ctx = self._ctx
        address = pending.remote.address
        if not any(pending.local_blocks):
            # Full prefix hit: nothing to read, but the producer must learn it may free its blocks.
            await self._tell_producer(pending, consumed=True, reason="full prefix-cache hit on the consumer")
            self._finish(pending, engine_pb2.Event(kind=engine_pb2.FINISHED_RECEIVING))
            return
        give_up = time.monotonic() + timeout
        try:
            cached = ctx.peers.cached_view(address, pending.remote.engine_id)
            vouched_until = self._vouched_until(pending, cached, remote_blocks) if cached is not None else 0.0
            confirmed = self._confirmed.get(pending.key, 0.0) > time.monotonic()
            if not vouched_until and (not confirmed or self._verified.get(pending.key) != remote_blocks):
                # The producer frees its blocks when its lease ends; reading after that would copy
                # whatever request now owns them. Confirm (and extend) the lease first, and that the
                # blocks we name are the request's own. This call also reveals a restarted producer
                # sidecar before its stale handshake is used. A keep-alive usually did it already.
                await ctx.trace.timed(
                    "consumer",
                    pending.engine_id,
                    pending.request_id,
                    "confirmed",
                    "the producer holds the blocks (lease extended)",
                    self._confirm_held(pending),
                )
                if self.requests.get(pending.key) is not pending:
                    return  # a heartbeat round failed it meanwhile: its blocks are the engine's again
            expected = None
            for attempt in (1, 2):
                # asyncio.timeout, not wait_for: wait_for runs the (usually cached, instant) lookup
                # in a task of its own, a loop iteration later.
                async with asyncio.timeout(ctx.settings.peer_call_timeout_seconds):
                    view = await ctx.trace.timed(
                        "consumer",
                        pending.engine_id,
                        pending.request_id,
                        "handshake",
                        f"{address} {pending.remote.engine_id}",
                        ctx.peers.engine(address, pending.remote.engine_id, engine.compatibility_hash),
                    )
                problem = view.block_ids_problem(remote_blocks)
                if problem:
                    raise InvalidArgument("remote.block_ids", f"{problem} (engine {view.engine_id} of {address})")
                local = engine.local_workers()
                ctx.dataplane.check(
                    local, engine.tp_size, view, (f"on consumer {engine.engine_id}", f"on producer {view.engine_id}")
                )
                if self._checks_integrity(pending):
                    if pending.key not in self._confirmed:
                        # A vouched pull may come before the producer's sidecar has the request
                        # (SubmitBlocks is asynchronous): the confirming heartbeat waits for it.
                        await self._confirm_held(pending)
                        if self.requests.get(pending.key) is not pending:
                            return
                    # Before the READ: its notification lets the producer free the blocks.
                    expected = await self._producer_digests(pending, local, engine.tp_size, view, remote_blocks)
                if view is not cached:  # a fresh handshake: the voucher is checked against its key
                    vouched_until = self._vouched_until(pending, view, remote_blocks)
                if vouched_until:
                    what = "the producer engine's voucher holds the blocks: reading without asking"
                    ctx.trace.event("consumer", pending.engine_id, pending.request_id, "vouched", what)
                elif self._readable.get(pending.key, 0.0) - time.monotonic() < _MIN_READ_WINDOW:
                    # Not confirmed yet (a voucher that does not verify against this view), or the
                    # handshake took most of the window.
                    await self._confirm_held(pending)
                if self.requests.get(pending.key) is not pending:
                    # Released, or failed by a heartbeat round, during the handshake or a check:
                    # the engine has its blocks back and the producer was told; no READ may start.
                    return
                ctx.metrics.pull_reads.labels(checked_by="voucher" if vouched_until else "producer").inc()
                # The READ must end while the producer still holds the blocks for certain.
                now = time.monotonic()
                # Either bound holds the blocks for us (the voucher's, or the last heartbeat's).
                window = min(give_up, max(vouched_until, self._readable.get(pending.key, 0.0))) - now
                pending.transferring = True
                outcome = await ctx.dataplane.run(
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
                if outcome.ok or attempt == 2 or pending.cancel_reason or ctx.peers.is_self(address):
                    break
                # The producer's engine may have re-registered (new agents) since we cached its
                # handshake: NIXL reports that as a disconnect (an endpoint to the old agent), and
                # a heartbeat that saw the new generation dropped the view meanwhile. Handshake
                # afresh and read once more.
                stale = ctx.peers.cached_view(address, pending.remote.engine_id) is not view
                if not (outcome.peer_gone or stale):
                    break
                log.info("pull_retry_after_stale_handshake", peer=address, engine_id=pending.remote.engine_id,
                         error=outcome.error)  # fmt: skip
                await ctx.peers.forget_engine(address, pending.remote.engine_id, "transfer from it failed")
        except TimeoutError:
            self._fail(pending, f"handshake with {address or 'this sidecar'} timed out", reason_label="handshake")
            return
        except ProducerLost as exc:
            self._fail(pending, str(exc), reason_label="producer_lost")
            return
        except ForeignBlocks as exc:
            # The producer's request is left alone: these were not its blocks to give.
            self._fail(pending, str(exc), reason_label="foreign_blocks")
            self._foreign.pop(pending.key, None)
            return
        except (SidecarError, PlanError) as exc:
            label = "incompatible" if isinstance(exc, (FailedPrecondition, PlanError)) else "handshake"
            self._fail(pending, str(exc), reason_label=label)
            await self._tell_producer(pending, consumed=False, reason=str(exc))
            return
        finally:
            pending.transferring = False
        pending.bytes_moved = outcome.bytes
        if pending.cancel_reason:
            self._fail(pending, pending.cancel_reason, reason_label="released")
            await self._tell_producer(pending, consumed=False, reason=pending.cancel_reason)
            return
        if outcome.ok:
            pending.received = True
            ctx.metrics.request_duration.labels(mode="pull", side="consumer").observe(
                time.monotonic() - pending.created
            )
            if expected is not None:
                await self._finish_checked(pending, expected)
            else:
                self._finish(pending, engine_pb2.Event(kind=engine_pb2.FINISHED_RECEIVING))
            return
        if outcome.peer_gone:
            await ctx.peers.forget(address, "transfer from it failed")
        self._fail(pending, f"READ failed: {outcome.error}", reason_label="transfer")
        await self._tell_producer(pending, consumed=False, reason=outcome.error)

    def _vouched_until(self, pending: ConsumerRequest, view: EngineView, remote_blocks: BlockIds) -> float:
        """Until when (monotonic) the pull's voucher lets it READ without asking the producer, or 0
        if it has none that verifies against ``view`` with time to spare (kvsidecar.voucher)."""
        remote, settings = pending.remote, self._ctx.settings
        if settings.voucher_seconds <= 0 or not remote.voucher or not view.voucher_key:
            return 0.0
        if not voucher.verify(
            view.voucher_key, remote.voucher, view.engine_id, remote.request_id, remote_blocks, remote.vouched_until_ms
        ):
            # Forged, altered (other blocks), or signed under an earlier registration of the engine.
            log.info("pull_voucher_refused", engine_id=pending.engine_id, request_id=pending.request_id,
                     producer=view.engine_id, generation=view.generation)  # fmt: skip
            return 0.0
        remaining = remote.vouched_until_ms / 1000.0 - time.time() - settings.voucher_clock_skew_seconds
        return time.monotonic() + remaining if remaining >= _MIN_READ_WINDOW else 0.0

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

    # --- push ---------------------------------------------------------------------------------

    async def _register_push(self, pending: ConsumerRequest, engine: Engine, timeout: float) -> bool:
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
                block_ids=_grouped(pending.local_blocks),
                decode_tp_size=engine.tp_size,
                compatibility_hash=engine.compatibility_hash,
                timeout_seconds=timeout,
                decode_generation=engine.generation,
                want_digests=self._checks_integrity(pending),
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

    def _on_watchdog(self, keys: list[RequestKey]) -> None:
        for key in keys:
            pending = self.requests.get(key)
            if pending is None:
                continue
            if pending.cancelling:
                why = pending.cancel_reason or "push did not finish after cancellation"
                self._ctx.tasks.spawn(self._still_writing(pending, why), engines=[])
                continue
            pending.cancelling = True
            self._ctx.tasks.spawn(
                self._cancel_push(pending, "push did not arrive before the registration watchdog expired", "timeout"),
                engines=[],
            )

    async def _cancel_push(self, pending: ConsumerRequest, why: str, label: str) -> None:
        """Released, or the watchdog fired: make sure no WRITE can land before the blocks go back
        to the engine. Ask the producer to drop the request; if WRITEs are in flight, wait for
        them (notifications or TransferFailed end it), bounded; if it cannot answer, fence."""
        settings = self._ctx.settings
        try:
            # A PushReg still on its way would otherwise arrive after our Release.
            async with asyncio.timeout(2 * settings.peer_call_timeout_seconds):
                await pending.registration_done.wait()
        except TimeoutError:
            pass
        if pending.key not in self.requests:
            return
        in_flight = await self._ask_producer(pending, consumed=False, reason=why)
        if pending.key not in self.requests:
            return
        if in_flight is None:
            self._fail_fenced(pending, f"{why}; the producer did not answer", label)
        elif in_flight:
            pending.cancel_reason = why
            grace = settings.transfer_timeout_seconds + settings.peer_call_timeout_seconds
            self.watchdogs.set(pending.key, time.monotonic() + grace)
        else:
            self._fail(pending, why, reason_label=label)

    async def _still_writing(self, pending: ConsumerRequest, why: str) -> None:
        """The grace after a cancellation passed: ask the producer once more. A producer that is
        alive and still has a WRITE in flight (a device copy into our GPU memory held until the
        GPU completes it, ``device_copy.LateCopies``) keeps our blocks for another grace; one
        that does not answer, or whose WRITEs are over, ends the request as before."""
        in_flight = await self._ask_producer(pending, consumed=False, reason=why)
        if self.requests.get(pending.key) is not pending:
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
            self.watchdogs.set(
                pending.key, time.monotonic() + settings.transfer_timeout_seconds + settings.peer_call_timeout_seconds
            )
        else:
            self._fail_fenced(pending, f"{why}; the producer's WRITEs did not end in time", "timeout")

    def _fail_fenced(self, pending: ConsumerRequest, reason: str, label: str) -> None:
        """LOAD_FAILED for a push whose producer may still write: fence the blocks' pages first; on
        GPU memory, hold the LOAD_FAILED until no WRITE can land (see ``_Fence``)."""
        if pending.held:
            return  # already waiting for its producer to go quiet
        engine = self._ctx.registry.engines.get(pending.engine_id)
        token: FenceToken = []
        if engine is not None and pending.key in self.requests:
            try:
                for worker in engine.ordered_workers():
                    token += self.fences.revoke(worker.memories, block_byte_ranges(worker.layout, pending.local_blocks))
            except OSError as exc:
                log.error(
                    "push_fence_failed", engine_id=pending.engine_id, request_id=pending.request_id, error=str(exc)
                )
        if token:
            self._fenced.append(_Fence(pending, token))
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
            if quiet_at is not None and now < quiet_at and pending.key in self.requests:
                pending.held = True
                self._fenced.append(_Fence(pending, [], held=(reason, label), held_until=quiet_at))
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
        self._fail(pending, reason, reason_label=label)

    async def _check_fence(self, fence: _Fence) -> None:
        """End a fence once the producer says nothing of the request is in flight, or its sidecar
        is not running (refused connection: a dead process writes nothing)."""
        fence.checking = True
        try:
            in_flight = await self._ask_producer(
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

    def _end_fences(self) -> None:
        """Called each heartbeat round: end the holds whose producer's WRITEs are surely over,
        check the other fences with their producer."""
        now = time.monotonic()
        for fence in list(self._fenced):
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

    def _end_fence(self, fence: _Fence, why: str) -> None:
        if fence not in self._fenced:
            return
        self._fenced.remove(fence)
        pending = fence.request
        if fence.token:
            self.fences.lift(fence.token)
            log.info("push_fence_lifted", engine_id=pending.engine_id, request_id=pending.request_id, why=why)
        if fence.held is not None and self.requests.get(pending.key) is pending:
            reason, label = fence.held
            self._fail(pending, f"{reason} (GPU memory: blocks held until {why})", reason_label=label)

    # --- heartbeats ---------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            period = min([self._ctx.settings.heartbeat_interval, *self._pace.values()])
            try:
                # A newly learned, faster producer pace cuts the current wait short. (Not
                # ``wait_for``: on Python 3.11 it returns the result when the awaited event is set in
                # the step a cancellation arrives, swallowing the cancellation, and this loop then
                # never ends: a node's stop hung so in a test. The package uses ``asyncio.timeout``.)
                async with asyncio.timeout(period):
                    await self._pace_changed.wait()
                self._pace_changed.clear()
            except TimeoutError:
                pass
            try:
                self._end_fences()
                await self.heartbeat_once()
            except Exception as exc:
                log.exception("heartbeat_round_failed", error=str(exc))

    def _pace_key(self, address: str, engine_id: str) -> tuple[str, str]:
        return ("" if self._ctx.peers.is_self(address) else normalize_address(address), engine_id)

    async def _confirm_held(self, pending: ConsumerRequest) -> None:
        """Heartbeat one request until its producer confirms it holds it; raises ProducerLost if
        the producer dropped it, or never knew it within the grace period."""
        delay = 0.002
        while True:
            if self.requests.get(pending.key) is not pending:
                # Ended meanwhile (a heartbeat round judged it lost, or a Release): its engine was
                # told and may have reused the blocks. Never read into them now.
                raise ProducerLost("the request ended while its producer was being asked")
            unknown = await self._heartbeat(
                pending.remote.address, pending.remote.engine_id, [pending], raise_errors=True, judge=False
            )
            foreign = self._foreign.get(pending.key)
            if foreign is not None:
                raise ForeignBlocks(foreign)
            if not unknown:
                return
            if self._is_lost(pending.key, time.monotonic()):
                raise ProducerLost(
                    "the producer no longer holds the request (expired, released or restarted); not reading its blocks"
                )
            await asyncio.sleep(delay)  # its SubmitBlocks may still be on the way: ask again shortly
            delay = min(delay * 2, 0.1)

    def _is_lost(self, key: RequestKey, now: float) -> bool:
        """Whether a producer's "unknown" means the request is gone.

        A producer engine offers its blocks to the router before its SubmitBlocks reaches its
        sidecar (the call is asynchronous, and vLLM keeps the blocks meanwhile), so a consumer can
        ask about a request its producer's sidecar has not seen yet. Unknown means lost once the
        producer knew it, or after ``producer_unknown_grace_seconds``.

        Not at once for a push it knew: its producer forgets the request as soon as its WRITEs are
        done, which may be before the notification that they were reached us (it waits on the NIXL
        owner thread); the notification, or the grace, decides."""
        pending = self.requests.get(key)
        if key in self._confirmed and not (pending is not None and pending.is_push):
            return True
        first = self._first_unknown.setdefault(key, now)
        return now - first > self._ctx.settings.producer_unknown_grace_seconds

    async def heartbeat_once(self) -> None:
        """One heartbeat per producer engine for every request that still needs its blocks."""
        groups: dict[tuple[str, str], list[ConsumerRequest | KeptAlive]] = {}
        for pending in self.requests.values():
            if pending.is_push and not pending.registered:
                continue  # the producer learns of it with the PushReg
            if pending.received:
                continue  # its digest check may still run, but the producer's part is done
            groups.setdefault((pending.remote.address, pending.remote.engine_id), []).append(pending)
        for kept in self.kept.values():
            groups.setdefault((kept.remote.address, kept.remote.engine_id), []).append(kept)
        if groups:
            await asyncio.gather(
                *(self._heartbeat(address, engine, group) for (address, engine), group in groups.items())
            )

    async def _heartbeat(
        self,
        address: str,
        engine_id: str,
        group: list[ConsumerRequest | KeptAlive],
        raise_errors: bool = False,
        judge: bool = True,
    ) -> list[ConsumerRequest | KeptAlive]:
        """Heartbeat ``group``; returns the items the producer did not know. With ``judge``, those
        that count as lost (see ``_is_lost``) fail here."""
        ctx = self._ctx
        keys, checking = [], {}
        for item in group:
            key = item.heartbeat_key()
            named = _named_blocks(item)
            if named and self._verified.get((item.engine_id, item.request_id)) != named:
                key.block_ids.CopyFrom(item.remote.block_ids)
                checking[(item.engine_id, item.request_id)] = named
            keys.append(key)
        request = peer_pb2.HeartbeatRequest(
            caller_sidecar_id=ctx.identity.sidecar_id, engine_id=engine_id, requests=keys
        )
        sent = time.monotonic()
        try:
            # A periodic heartbeat does not wait for a connection: a dead peer (refused) counts as a
            # failure at once. A confirmation before a READ waits (the peer may be restarting).
            response = await ctx.peers.heartbeat(address, request, wait_for_ready=raise_errors)
        except SidecarError as exc:
            if raise_errors:
                raise
            log.warning("heartbeat_failed", peer=address, failures=ctx.peers.failures(address), error=str(exc))
            # Each request counts the heartbeats it missed itself: failures from before it came (the
            # peer was down, then restarted) say nothing about the peer it asks now.
            for item in group:
                item.missed_heartbeats += 1
            lost = [item for item in group if item.missed_heartbeats >= ctx.settings.heartbeat_failures_allowed]
            self._producer_lost(lost, f"producer sidecar {address} stopped answering: {exc}", "peer_unreachable")
            return list(group)
        now = time.monotonic()
        for item in group:
            item.missed_heartbeats = 0
        cached = ctx.peers.cached_generation(address, engine_id)
        if response.engine_generation and cached is not None and cached != response.engine_generation:
            # The producer's engine re-registered (restarted) since we handshook it: its NIXL agents
            # are new. Transfer setup through the stale view would fail; the next use handshakes again.
            await ctx.peers.forget_engine(address, engine_id, "engine re-registered")
        if response.lease_seconds > 0:
            pace_key, pace = self._pace_key(address, engine_id), max(0.05, response.lease_seconds / 3.0)
            if pace < self._pace.get(pace_key, float("inf")):
                self._pace_changed.set()
            self._pace[pace_key] = pace
        unknown_keys = {(key.request_id, key.transfer_id, key.consumer_request_id) for key in response.unknown}
        foreign_keys = {(key.request_id, key.transfer_id, key.consumer_request_id) for key in response.foreign_blocks}
        unknown = []
        foreign: list[ConsumerRequest | KeptAlive] = []
        for item in group:
            key = item.heartbeat_key()
            item_key = (item.engine_id, item.request_id)
            if item_key not in self.requests and item_key not in self.kept:
                # Ended while the heartbeat was out (released, failed): its checks are forgotten,
                # and writing them back would re-arm a READ into blocks its engine has back.
                continue
            if (key.request_id, key.transfer_id, key.consumer_request_id) in unknown_keys:
                unknown.append(item)
                continue
            # Known, and its lease extended to now + lease_seconds: half of that is a safe margin.
            self._confirmed[item_key] = now + response.lease_seconds / 2.0
            self._readable[item_key] = sent + response.lease_seconds
            if item_key not in checking:
                continue
            if (key.request_id, key.transfer_id, key.consumer_request_id) in foreign_keys:
                self._foreign[item_key] = (
                    f"producer {engine_id} at {address} did not submit the blocks named in remote.block_ids "
                    f"for request {item.remote.request_id!r}; not reading them"
                )
                foreign.append(item)
            else:
                self._verified[item_key] = checking[item_key]
                self._foreign.pop(item_key, None)
        if judge:
            # A keep-alive's blocks are only a hint; its Pull checks them again and fails then.
            for item in foreign:
                if isinstance(item, ConsumerRequest) and item.judged_by_heartbeats and item.key in self.requests:
                    self._fail(item, self._foreign[item.key], reason_label="foreign_blocks")
            lost = [item for item in unknown if self._is_lost((item.engine_id, item.request_id), now)]
            self._producer_lost(
                lost, "the producer no longer holds the request (expired, released or restarted)", "producer_lost"
            )
        return unknown

    def _producer_lost(self, items: list[ConsumerRequest | KeptAlive], reason: str, label: str) -> None:
        for item in items:
            key = (item.engine_id, item.request_id)
            if isinstance(item, KeptAlive):
                if self.kept.pop(key, None) is not None:
                    self._lost[key] = reason
                    log.warning(
                        "producer_lost_before_pull", engine_id=item.engine_id, request_id=item.request_id, reason=reason
                    )
            elif item.judged_by_heartbeats and key in self.requests:
                if item.is_push and item.registered and label == "peer_unreachable":
                    self._fail_fenced(item, reason, label)  # it may be hung, not dead, and write later
                else:
                    self._fail(item, reason, reason_label=label)

    # --- common -------------------------------------------------------------------------------

    def _validate_fields(
        self, engine_id: str, request_id: str, transfer_id: str, blocks_message: common_pb2.GroupedBlockIds, field: str
    ) -> BlockIds:
        """Checks that need no state: malformed input is INVALID_ARGUMENT whatever else is wrong."""
        validation.identifier(engine_id, "engine_id")
        validation.identifier(request_id, "request_id")
        validation.identifier(transfer_id, "transfer_id", required=False)
        return validation.block_ids(blocks_message, field, self._ctx.settings.max_blocks_per_request)

    def _require_engine(self, engine_id: str, request_id: str, blocks: BlockIds, field: str) -> Engine:
        ctx = self._ctx
        engine = ctx.registry.require_engine(engine_id, "engine_id", CONSUMER_ROLES)
        problem = check_block_ids(blocks, engine.num_groups, engine.num_blocks, engine.physical_per_logical)
        if problem:
            raise InvalidArgument(field, problem)
        if (engine_id, request_id) in self.requests:
            raise FailedPrecondition(f"request {request_id!r} of engine {engine_id!r} is already waiting for KV")
        # Held GPU pushes (see ``_Fence``) wait on a producer that went quiet; they do not keep
        # requests to other producers out.
        held = sum(1 for fence in self._fenced if fence.held is not None)
        ctx.tasks.check_capacity(len(self.requests) - held)
        return engine

    def _engines_of(self, pending: ConsumerRequest) -> list[str]:
        engines = [pending.engine_id]
        if self._ctx.peers.is_self(pending.remote.address):
            engines.append(pending.remote.engine_id)
        return engines

    def _admit(
        self, request: engine_pb2.PullRequest | engine_pb2.ExpectPushRequest, mode: int, local: BlockIds
    ) -> ConsumerRequest | None:
        """Start tracking a validated request. None if its producer already dropped it while it
        waited in the engine's queue: it has failed (LOAD_FAILED with the reason)."""
        pending = ConsumerRequest(
            engine_id=request.engine_id,
            request_id=request.request_id,
            transfer_id=request.transfer_id,
            mode=mode,
            local_blocks=local,
            remote=request.remote,
        )
        self.requests[pending.key] = pending
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
            self._ctx.transport.expect_notifications(1)
        self._ctx.metrics.pending_receives.set(len(self.requests))
        lost = self._end_keep_alive(pending.key)
        if lost is not None:
            self._fail(pending, lost, reason_label="producer_lost")
            return None
        return pending

    async def _tell_producer(self, pending: ConsumerRequest | KeptAlive, consumed: bool, reason: str) -> bool:
        """Tell the producer's sidecar it may free (or drop the registration). Returns True if
        transfers are still in flight there. Best effort: its lease frees the blocks otherwise."""
        return bool(await self._ask_producer(pending, consumed, reason))

    async def _ask_producer(
        self, pending: ConsumerRequest | KeptAlive, consumed: bool, reason: str, wait_for_ready: bool = True
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

    def _fail(self, pending: ConsumerRequest, reason: str, reason_label: str) -> None:
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
        self._finish(pending, engine_pb2.Event(kind=engine_pb2.LOAD_FAILED, failed_block_ids=failed, reason=reason))

    def _finish(self, pending: ConsumerRequest, event: engine_pb2.Event) -> None:
        if self.requests.pop(pending.key, None) is None:
            return
        if pending.held:  # ended another way meanwhile (its WRITEs' end, TransferFailed, ...)
            self._fenced = [fence for fence in self._fenced if fence.request is not pending]
        self._forget_checks(pending.key)
        self.watchdogs.cancel(pending.key)
        if pending.is_push:
            self._ctx.transport.expect_notifications(-1)
        self._ctx.metrics.pending_receives.set(len(self.requests))
        event.request_id = pending.request_id
        event.transfer_id = pending.transfer_id
        event.bytes = pending.bytes_moved
        event.duration_ms = (time.monotonic() - pending.created) * 1000.0
        # The engine's event first: recording the end also derives the request's stages.
        self._ctx.events.emit(pending.engine_id, event)
        self._ctx.trace.ended("consumer", pending.engine_id, pending.request_id, event.kind, event.reason, event.bytes)

    def drop_engine(self, engine_id: str, reason: str) -> None:
        for pending in [p for p in self.requests.values() if p.engine_id == engine_id]:
            self._ctx.tasks.spawn(self._tell_producer(pending, consumed=False, reason=reason), engines=[])
            if not pending.transferring:
                self._fail(pending, reason, reason_label="engine_gone")
        # Requests that waited in the engine's queue: no Pull will come, so stop keeping their
        # producers' leases alive (heartbeats would hold its blocks until the keep-alive's
        # timeout, minutes) and let the producers free them now.
        for kept in [k for k in self.kept.values() if k.engine_id == engine_id]:
            key = (kept.engine_id, kept.request_id)
            self._end_keep_alive(key)
            self._forget_checks(key)
            self._ctx.tasks.spawn(self._tell_producer(kept, consumed=False, reason=reason), engines=[])
        for key in [key for key in self._lost if key[0] == engine_id]:
            del self._lost[key]

    def fail_all(self, reason: str) -> None:
        for pending in list(self.requests.values()):
            self._fail(pending, reason, reason_label="shutdown")

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


def _grouped(blocks: BlockIds) -> common_pb2.GroupedBlockIds:
    return common_pb2.GroupedBlockIds(groups=[common_pb2.BlockIdList(ids=list(group)) for group in blocks])


def _named_blocks(item: ConsumerRequest | KeptAlive) -> BlockIds:
    """The producer blocks a pull would read (empty for a push: the producer picks its own)."""
    if not item.reads_remote:
        return ()
    named = tuple(tuple(group.ids) for group in item.remote.block_ids.groups)
    return named if any(named) else ()
