"""Keep-alive: does the producer still hold a request's blocks, and until when may we read them?

While a request waits (in the engine's queue: ``KeptAlive``; or being served: ``ConsumerRequest``),
this module heartbeats the producer's sidecar so its lease stays alive; a producer that no longer
knows the request, or a peer that stops answering, fails the request instead of leaving it to time
out. It owns the "does the producer still hold it" state (``confirmed``, ``readable``,
``first_unknown``, ``lost``, and the block ids the producer accepted, ``verified`` / ``foreign``)
and answers a pull's questions in one place:

- ``before_handshake``: ask the producer before trusting a cached handshake, unless a voucher or a
  recent heartbeat (within half a lease, the blocks verified) already holds the blocks;
- ``ensure_known``: the producer's sidecar has the request (GetDigests needs it);
- ``clear_read``: may the READ start now, and until when (``ReadClearance``).

No READ starts without one of two bounds, because the producer may reuse the blocks after it: a
heartbeat that found the request (the READ must end by that heartbeat's send time + the extension
the producer granted; the transport fails a READ seen DONE later), or the producer engine's
voucher (``kvsidecar.voucher``: these blocks of this request, held until a time), ending by the
voucher's time less the clock skew allowance. They raise ``ProducerLost`` / ``ForeignBlocks`` when
the producer dropped the request or does not own the blocks, ``RequestEnded`` when the request
ended meanwhile. Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from kvsidecar import voucher
from kvsidecar.v1 import engine_pb2, peer_pb2
from sidecar.core import validation
from sidecar.core.consumer.fences import PushFences
from sidecar.core.consumer.table import (
    ConsumerRequest,
    ConsumerTable,
    ForeignBlocks,
    KeptAlive,
    ProducerLost,
    RequestKey,
    Waiting,
    log,
    named_blocks,
)
from sidecar.core.context import NodeContext
from sidecar.core.registry import CONSUMER_ROLES
from sidecar.core.timers import DeadlineTimer
from sidecar.dataplane.plan.layout import BlockIds
from sidecar.dataplane.views import EngineView
from sidecar.errors import InvalidArgument, SidecarError
from sidecar.peers.addresses import normalize_address

# A READ is posted only with at least this long left before the producer may reuse the blocks.
MIN_READ_WINDOW = 0.05


@dataclass(frozen=True)
class ReadClearance:
    """A pull may READ now; the READ must end by ``until`` (monotonic). ``vouched``: the producer
    engine's voucher holds the blocks, not a heartbeat's answer."""

    until: float
    vouched: bool


class KeepAlive:
    def __init__(self, ctx: NodeContext, table: ConsumerTable, fences: PushFences) -> None:
        self._ctx = ctx
        self._table = table
        self._fences = fences
        self.kept: dict[RequestKey, KeptAlive] = {}
        self._kept_deadlines: DeadlineTimer[RequestKey] = DeadlineTimer(self._on_keep_alive_expired)
        # Requests whose producer said it no longer holds them; a later Pull fails at once instead
        # of reading blocks that may already hold another request's KV.
        self.lost: dict[RequestKey, str] = {}
        # Until when (monotonic) a producer is known to hold a request: a heartbeat answered
        # "known" and extended its lease. A READ only starts while this holds.
        self.confirmed: dict[RequestKey, float] = {}
        # Until when (monotonic) a READ of a request may run: the send time of the heartbeat that
        # found it + the extension the producer granted; the producer may reuse the blocks after.
        self.readable: dict[RequestKey, float] = {}
        # When a producer first answered "unknown" for a request it never confirmed.
        self.first_unknown: dict[RequestKey, float] = {}
        # The producer block ids a producer accepted as its request's (a pull reads only those;
        # sent with heartbeats until accepted once), and why it refused them.
        self.verified: dict[RequestKey, BlockIds] = {}
        self.foreign: dict[RequestKey, str] = {}
        # Heartbeat period per producer (address, engine), a third of the extension it grants, so
        # a producer with a shorter lease than ours is still heartbeated in time.
        self._pace: dict[tuple[str, str], float] = {}
        self._pace_changed = asyncio.Event()
        self._heartbeat_task: asyncio.Task[None] | None = None
        table.on_end.append(lambda pending: self.forget_checks(pending.key))

    def start(self) -> None:
        self._heartbeat_task = asyncio.ensure_future(self._heartbeat_loop())

    async def stop(self) -> None:
        self._kept_deadlines.close()
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            try:
                await self._heartbeat_task
            except asyncio.CancelledError:
                pass

    # --- KeepAlive (EngineService) ------------------------------------------------------------

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
        if key in self.lost:
            return engine_pb2.KeepAliveResponse(producer_holds=False)
        if key in self._table.requests:
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
            self.lost.pop(key, None)
            self.forget_checks(key)

    def forget_checks(self, key: RequestKey) -> None:
        self.confirmed.pop(key, None)
        self.readable.pop(key, None)
        self.first_unknown.pop(key, None)
        self.verified.pop(key, None)
        self.foreign.pop(key, None)

    def end(self, key: RequestKey) -> str | None:
        """Stop keeping ``key`` alive; returns why it is lost, if the producer dropped it."""
        self.kept.pop(key, None)
        self._kept_deadlines.cancel(key)
        return self.lost.pop(key, None)

    def admitted(self, pending: ConsumerRequest) -> bool:
        """Its Pull or ExpectPush came: the request's wait in the engine's queue is over. False if
        its producer dropped it meanwhile: it has failed (LOAD_FAILED with the reason)."""
        lost = self.end(pending.key)
        if lost is not None:
            self._table.fail(pending, lost, reason_label="producer_lost")
            return False
        return True

    # --- may a pull read, and until when? -----------------------------------------------------

    def vouched_until(self, pending: ConsumerRequest, view: EngineView | None, remote_blocks: BlockIds) -> float:
        """Until when (monotonic) the pull's voucher lets it READ without asking the producer, or 0
        if it has none that verifies against ``view`` with time to spare (kvsidecar.voucher).
        Checked once per handshake: a fresh one (another signing key, maybe) is checked again."""
        if view is None:
            return 0.0
        if pending.vouched is not None and pending.vouched[0] is view:
            return pending.vouched[1]
        until = self._check_voucher(pending, view, remote_blocks)
        pending.vouched = (view, until)
        return until

    def _check_voucher(self, pending: ConsumerRequest, view: EngineView, remote_blocks: BlockIds) -> float:
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
        return time.monotonic() + remaining if remaining >= MIN_READ_WINDOW else 0.0

    async def before_handshake(self, pending: ConsumerRequest, cached: EngineView | None, blocks: BlockIds) -> None:
        """Before the handshake: unless a voucher (checked against the cached handshake) or a recent
        heartbeat (within half a lease, these blocks verified) holds the blocks, ask the producer.
        It frees its blocks when its lease ends, and reading after that would copy whatever
        request now owns them: confirm (and extend) the lease, and that the blocks we name are the
        request's own. The heartbeat also reveals a restarted producer sidecar (or re-registered
        engine) before its stale handshake is used. A keep-alive usually did it already."""
        if self.vouched_until(pending, cached, blocks):
            return
        if self.confirmed.get(pending.key, 0.0) > time.monotonic() and self.verified.get(pending.key) == blocks:
            return
        await self._ctx.trace.timed(
            "consumer",
            pending.engine_id,
            pending.request_id,
            "confirmed",
            "the producer holds the blocks (lease extended)",
            self.confirm_held(pending),
        )
        self._table.require_open(pending)  # a heartbeat round failed it meanwhile

    async def ensure_known(self, pending: ConsumerRequest) -> None:
        """The producer's sidecar has (had) the request: a vouched pull may come before its
        SubmitBlocks (asynchronous) reached it, and a GetDigests needs it there. Differs from
        ``clear_read``'s check: known once is enough here; the window is checked after the call."""
        if pending.key not in self.confirmed:
            await self.confirm_held(pending)
            self._table.require_open(pending)

    async def clear_read(self, pending: ConsumerRequest, view: EngineView, blocks: BlockIds) -> ReadClearance:
        """May the READ start now, and until when? The voucher (checked against ``view``), or the
        last heartbeat's window when at least ``MIN_READ_WINDOW`` of it is left, else a heartbeat
        now (not confirmed yet: a voucher that does not verify against this view; or the handshake
        took most of the window). Raises RequestEnded if the request ended during the handshake or
        a check: the engine has its blocks back and the producer was told."""
        vouched = self.vouched_until(pending, view, blocks)
        if vouched:
            what = "the producer engine's voucher holds the blocks: reading without asking"
            self._ctx.trace.event("consumer", pending.engine_id, pending.request_id, "vouched", what)
        elif self.readable.get(pending.key, 0.0) - time.monotonic() < MIN_READ_WINDOW:
            await self.confirm_held(pending)
        self._table.require_open(pending)
        # Either bound holds the blocks for us (the voucher's, or the last heartbeat's).
        return ReadClearance(max(vouched, self.readable.get(pending.key, 0.0)), bool(vouched))

    async def confirm_held(self, pending: ConsumerRequest) -> None:
        """Heartbeat one request until its producer confirms it holds it; raises ProducerLost if
        the producer dropped it, or never knew it within the grace period."""
        delay = 0.002
        while True:
            if not self._table.is_open(pending):
                # Ended meanwhile (a heartbeat round judged it lost, or a Release): its engine was
                # told and may have reused the blocks. Never read into them now.
                raise ProducerLost("the request ended while its producer was being asked")
            unknown = await self._heartbeat(
                pending.remote.address, pending.remote.engine_id, [pending], raise_errors=True, judge=False
            )
            foreign = self.foreign.get(pending.key)
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
        pending = self._table.requests.get(key)
        if key in self.confirmed and not (pending is not None and pending.is_push):
            return True
        first = self.first_unknown.setdefault(key, now)
        return now - first > self._ctx.settings.producer_unknown_grace_seconds

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
                self._fences.end_fences()
                await self.heartbeat_once()
            except Exception as exc:
                log.exception("heartbeat_round_failed", error=str(exc))

    def _pace_key(self, address: str, engine_id: str) -> tuple[str, str]:
        return ("" if self._ctx.peers.is_self(address) else normalize_address(address), engine_id)

    async def heartbeat_once(self) -> None:
        """One heartbeat per producer engine for every request that still needs its blocks."""
        groups: dict[tuple[str, str], list[Waiting]] = {}
        for pending in self._table.requests.values():
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
        group: list[Waiting],
        raise_errors: bool = False,
        judge: bool = True,
    ) -> list[Waiting]:
        """Heartbeat ``group``; returns the items the producer did not know. With ``judge``, those
        that count as lost (see ``_is_lost``) fail here."""
        ctx = self._ctx
        keys, checking = [], {}
        for item in group:
            key = item.heartbeat_key()
            named = named_blocks(item)
            if named and self.verified.get(item.key) != named:
                key.block_ids.CopyFrom(item.remote.block_ids)
                checking[item.key] = named
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
        foreign: list[Waiting] = []
        for item in group:
            key = item.heartbeat_key()
            item_key = item.key
            if item_key not in self._table.requests and item_key not in self.kept:
                # Ended while the heartbeat was out (released, failed): its checks are forgotten,
                # and writing them back would re-arm a READ into blocks its engine has back.
                continue
            if (key.request_id, key.transfer_id, key.consumer_request_id) in unknown_keys:
                unknown.append(item)
                continue
            # Known, and its lease extended to now + lease_seconds: half of that is a safe margin.
            self.confirmed[item_key] = now + response.lease_seconds / 2.0
            self.readable[item_key] = sent + response.lease_seconds
            if item_key not in checking:
                continue
            if (key.request_id, key.transfer_id, key.consumer_request_id) in foreign_keys:
                self.foreign[item_key] = (
                    f"producer {engine_id} at {address} did not submit the blocks named in remote.block_ids "
                    f"for request {item.remote.request_id!r}; not reading them"
                )
                foreign.append(item)
            else:
                self.verified[item_key] = checking[item_key]
                self.foreign.pop(item_key, None)
        if judge:
            # A keep-alive's blocks are only a hint; its Pull checks them again and fails then.
            for item in foreign:
                if isinstance(item, ConsumerRequest) and item.judged_by_heartbeats and item.key in self._table.requests:
                    self._table.fail(item, self.foreign[item.key], reason_label="foreign_blocks")
            lost = [item for item in unknown if self._is_lost(item.key, now)]
            self._producer_lost(
                lost, "the producer no longer holds the request (expired, released or restarted)", "producer_lost"
            )
        return unknown

    def _producer_lost(self, items: list[Waiting], reason: str, label: str) -> None:
        for item in items:
            key = item.key
            if isinstance(item, KeptAlive):
                if self.kept.pop(key, None) is not None:
                    self.lost[key] = reason
                    log.warning(
                        "producer_lost_before_pull", engine_id=item.engine_id, request_id=item.request_id, reason=reason
                    )
                    self._tell_given_up(item, reason, label)
            elif item.judged_by_heartbeats and key in self._table.requests:
                if item.is_push and item.registered and label == "peer_unreachable":
                    self._fences.fail_fenced(item, reason, label)  # it may be hung, not dead, and write later
                else:
                    self._table.fail(item, reason, reason_label=label)
                    self._tell_given_up(item, reason, label)

    def _tell_given_up(self, item: Waiting, reason: str, label: str) -> None:
        """A pull (or its keep-alive) given up on the producer's "unknown" will not READ: say so.
        "Unknown" is also a producer whose engine released the request while we might still READ
        it; it holds the blocks until the READ's bound (``core.producer``, ``closing``) unless told."""
        if label == "producer_lost" and item.reads_remote:
            self._ctx.tasks.spawn(self._table.tell_producer(item, consumed=False, reason=reason), engines=[])
