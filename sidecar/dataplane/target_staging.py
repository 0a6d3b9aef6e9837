"""Target-side host staging: a peer on another node READs this sidecar's GPU worker's KV from the
sidecar's own pinned pool instead of from the engine's imported GPU memory (which no NIC can
register and which UCX only emulates over TCP).

The producer's side (``StagingServer``, serving ``PeerService.Stage``): a VRAM worker's agent has
the pinned pool (``host_staging.PinnedPool``, the same pool initiator-side staging uses)
registered with it at registration, and its handshake descriptor advertises it
(``WorkerDescriptor.staging_pool``). A Stage call names rows of the worker's GPU memory (a chunk
of a leased request, at most one slot's bytes): one slot is lent, one ``cuda_ipc.batch_copy``
fills it, and once the copy is complete the answer says which slot. The slot is lent until the
caller names it in a later call's ``done_slots`` (after its READ of it ended) or until the lease
the caller asked for runs out (a consumer that crashed gives nothing back: its slots return at
their deadline). A copy late past the deadline keeps its slot out of the pool until a marker
behind it completes (``PinnedPool.hold``); it only reads the engine's blocks, and the caller,
told DEADLINE_EXCEEDED, never reads that slot, so nothing of it reaches the consumer.

The consumer's side is ``host_staging._Pipeline`` with a ``RemoteStager`` (a pull whose target
worker advertises a pool): chunk c is staged by P, then READ from P's slot into the local slot,
then copied into the engine, while the next chunks are staged and read; the READ of the last
chunk carries today's notification, so the producer's accounting is unchanged.

Why a gRPC call per chunk rather than a NIXL notification per chunk: the call's answer is the
only thing the READ waits for, it carries its own deadline and error status to the waiting side,
and it needs no new notification kind in the node's notification path; the call overlaps with the
READs of the chunks before it (``slots`` in flight), so its round trip is hidden once the pipe is
full.

Threads: the event loop; waiting for a copy runs in a worker thread (``wait_copy`` blocks),
bounded by the caller's deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from sidecar.dataplane import cuda_ipc
from sidecar.dataplane.host_staging import PinnedPool
from sidecar.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from sidecar.logs import get_logger

log = get_logger("kvsidecar.target_staging")

# A slot's lease never outlives this (a caller asking for more gets this): a crashed consumer's
# slots come back within it at the latest.
MAX_LEASE_S = 600.0


def pack_rows(rows: np.ndarray) -> bytes:
    """Nx3 uint64 (address, length, offset) as the wire's packed little-endian triples (pure)."""
    return np.ascontiguousarray(rows, dtype="<u8").tobytes()


def unpack_rows(data: bytes) -> np.ndarray:
    """The inverse of ``pack_rows``; InvalidArgument if the bytes are not whole triples."""
    if len(data) % 24:
        raise InvalidArgument("rows", f"{len(data)} bytes are not whole (address, length, offset) triples")
    return np.frombuffer(data, dtype="<u8").reshape(-1, 3).astype(np.uint64)


@dataclass(frozen=True)
class StagedSlot:
    """A slot of a peer's pool holding one staged chunk: its number and address (the peer's)."""

    slot: int
    address: int


# (rows, remaining seconds, slots done) -> the staged slot; raises on failure (the error says why).
StageCall = Callable[[np.ndarray, float, list[int]], Awaitable[StagedSlot]]


@dataclass
class RemoteStager:
    """The consumer's handle on one staged pull from a peer worker: ``stage`` asks for a chunk,
    ``done`` marks a slot read (handed back with the next call, or by ``finish``)."""

    call: StageCall
    chunk_bytes: int
    _done: list[int] = field(default_factory=list)

    async def stage(self, rows: np.ndarray, deadline: float) -> StagedSlot:
        done, self._done = self._done, []
        return await self.call(rows, deadline - time.monotonic(), done)

    def done(self, slot: int) -> None:
        self._done.append(slot)

    async def finish(self, deadline: float) -> None:
        """Hand back the slots read since the last call (best effort: the peer's lease returns
        them at its deadline anyway)."""
        if not self._done:
            return
        done, self._done = self._done, []
        try:
            await self.call(np.zeros((0, 3), dtype=np.uint64), max(0.0, deadline - time.monotonic()), done)
        except Exception as exc:
            log.info("target_staging_give_back_failed", slots=len(done), error=str(exc))


@dataclass
class _Lent:
    timer: asyncio.TimerHandle


class StagingServer:
    """The producer's side (see the module docstring). Event loop thread."""

    def __init__(self, pool: PinnedPool) -> None:
        self.pool = pool
        self._lent: dict[int, _Lent] = {}

    @property
    def lent_slots(self) -> int:
        return len(self._lent)

    def give_back(self, slots: list[int]) -> None:
        """Slots a consumer has read (or whose lease ran out) return to the pool; unknown ones
        (already back, or never lent) are ignored."""
        back = []
        for slot in slots:
            lent = self._lent.pop(slot, None)
            if lent is not None:
                lent.timer.cancel()
                back.append(slot)
        if back:
            self.pool.give_back(back)

    async def stage(
        self, device_id: int, allowed: list[tuple[int, int]], rows: np.ndarray, timeout_s: float
    ) -> StagedSlot:
        """Copy ``rows`` (address, length, offset) of GPU memory on ``device_id`` into a free slot
        and lend it for ``timeout_s``. ``allowed``: (address, length) ranges the rows must lie in
        (the request's blocks in the worker). Raises InvalidArgument, DeadlineExceeded,
        FailedPrecondition."""
        _check_rows(rows, merged_ranges(allowed), self.pool.chunk_bytes)
        deadline = time.monotonic() + min(max(timeout_s, 0.0), MAX_LEASE_S)
        base = await self.pool.ready()
        try:
            (slot,) = await self.pool.lend(1, deadline)
        except TimeoutError:
            raise DeadlineExceeded("no staging slot free before the deadline") from None
        address = base + slot * self.pool.chunk_bytes
        copies = np.empty_like(rows)
        copies[:, 0] = np.uint64(address) + rows[:, 2]
        copies[:, 1] = rows[:, 0]
        copies[:, 2] = rows[:, 1]
        try:
            pending = cuda_ipc.batch_copy(device_id, copies)
        except Exception as exc:
            self.pool.give_back([slot])
            raise FailedPrecondition(f"staging copy failed to launch: {exc}") from exc
        try:
            if not cuda_ipc.copy_done(pending):
                await asyncio.to_thread(cuda_ipc.wait_copy, pending, deadline - time.monotonic())
        except (DeadlineExceeded, asyncio.CancelledError) as exc:
            # It may still read the engine's blocks into the slot: the slot waits for a marker
            # behind it; the caller never reads it (it is told the copy missed its deadline).
            self._hold(device_id, slot)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise DeadlineExceeded("the staging copy did not complete before the deadline") from None
        except Exception as exc:
            self.pool.give_back([slot])
            raise FailedPrecondition(f"staging copy failed: {exc}") from exc
        loop = asyncio.get_running_loop()
        self._lent[slot] = _Lent(loop.call_at(loop.time() + (deadline - time.monotonic()), self._expire, slot))
        return StagedSlot(slot, address)

    def _expire(self, slot: int) -> None:
        if slot in self._lent:
            log.warning("target_staging_slot_expired", slot=slot, detail="the consumer did not hand it back in time")
            self.give_back([slot])

    def _hold(self, device_id: int, slot: int) -> None:
        try:
            marker = cuda_ipc.batch_copy(device_id, [])
        except Exception:
            marker = None
        self.pool.hold(slot, marker)
        log.error("target_staging_copy_late", slot=slot)

    def close(self) -> None:
        for lent in self._lent.values():
            lent.timer.cancel()
        self._lent.clear()


def merged_ranges(ranges: list[tuple[int, int]]) -> np.ndarray:
    """(address, length) ranges as sorted, merged Nx2 uint64 (start, end) rows: adjacent ones
    joined, as the staged rows are (they coalesce contiguous blocks) (pure, vectorized)."""
    if not ranges:
        return np.zeros((0, 2), dtype=np.uint64)
    table = np.asarray(ranges, dtype=np.uint64).reshape(-1, 2)
    table = table[np.argsort(table[:, 0], kind="stable")]
    starts, ends = table[:, 0], table[:, 0] + table[:, 1]
    running = np.maximum.accumulate(ends)
    new = np.concatenate(([True], starts[1:] > running[:-1]))
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(table)) - 1
    return np.column_stack((starts[first], running[last]))


def _check_rows(rows: np.ndarray, allowed: np.ndarray, chunk_bytes: int) -> None:
    """Every row inside one ``allowed`` range (``merged_ranges``: the request's blocks) and inside
    the slot (pure, vectorized; InvalidArgument)."""
    if not len(rows):
        raise InvalidArgument("rows", "no rows to stage")
    starts, lengths, offsets = rows[:, 0], rows[:, 1], rows[:, 2]
    ends = starts + lengths
    if (offsets + lengths > np.uint64(chunk_bytes)).any() or (offsets + lengths < offsets).any():
        raise InvalidArgument("rows", f"a row lies outside the {chunk_bytes}-byte slot")
    at = np.searchsorted(allowed[:, 0], starts, side="right") - 1
    inside = (at >= 0) & (ends >= starts)
    inside[inside] &= ends[inside] <= allowed[at[inside], 1]
    if not inside.all():
        raise InvalidArgument("rows", "a row lies outside the request's blocks of the worker")
