"""Push staging, the producer's side: a push into a GPU consumer on another node WRITEs each chunk
into a slot of the consumer sidecar's pinned pool, never into the consumer engine's imported GPU
memory (which no NIC can register and which UCX only emulates over TCP); the consumer's sidecar
copies the slot into its engine (``core.push_staging``, ``target_staging.StagingServer.land``).

Per chunk (``staged_push``), up to ``host_staging.slots`` chunks in flight:
1. a slot of the consumer's pool (``PushStager.slot``: lent by a Stage call with ``lend``, or
   spare from an earlier chunk's landing call, which asks for the next one while it is there);
2. the source: the local engine's host blocks themselves (DRAM), or, for a GPU engine, a slot of
   our own pool filled from the engine with one ``batch_copy`` (host staging's pool);
3. one NIXL WRITE source -> the consumer's slot, without a notification;
4. a Stage call naming the slot and the chunk's rows of the consumer's GPU memory; it answers once
   the consumer's copy slot -> engine is complete.
Only when every chunk's landing has been answered does the request's notification go out (notify
only), so the consumer's FINISHED_RECEIVING always follows the last copy into its engine. A
failure stops posting new chunks; chunks in flight end by the deadline; slots lent to us and not
landed go back with a last Stage call (or at the consumer's lease end if that call fails). A GPU
copy into our own slot late past the deadline only read the engine's blocks into a slot whose
WRITE is never posted: the transfer fails at once and the slot waits for a marker behind it.

Threads: the event loop (NIXL posts return at once; waiting for a GPU copy runs in a worker thread).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from sidecar.dataplane import cuda_ipc
from sidecar.dataplane.contract import RemoteAgent, RunsSpec, TransferResult, Transport
from sidecar.dataplane.plan.stage_chunks import StageChunks
from sidecar.errors import DeadlineExceeded
from sidecar.logs import get_logger

log = get_logger("kvsidecar.staged_push")


async def post_windowed(
    count: int, depth: int, post: Callable[[int], Awaitable[TransferResult]]
) -> list[TransferResult]:
    """``post(0)`` .. ``post(count - 1)`` with at most ``depth`` in flight, in order; after the first
    failure no more are posted (those in flight end by their deadline). The results of every chunk
    posted (shared by the staged READs and WRITEs: ``host_staging``, ``staged_push``)."""
    results: list[TransferResult] = []
    window: list[asyncio.Future[TransferResult]] = []
    for chunk in range(count):
        window.append(asyncio.ensure_future(post(chunk)))
        if len(window) >= depth:
            results.append(await window.pop(0))
            if not results[-1].ok:
                break
    return results + list(await asyncio.gather(*window))


class LentSlot(NamedTuple):
    """A slot of the peer's pool lent for one WRITE: its number and address (the peer's)."""

    slot: int
    address: int


# (rows landed or None, the slot they are in, lend a slot?, remaining seconds, slots handed back)
# -> the slot lent (None when none was asked for); raises on failure (the error says why).
InboundCall = Callable[[np.ndarray | None, int, bool, float, list[int]], Awaitable[LentSlot | None]]


@dataclass
class PushStager:
    """The producer's handle on one staged push into a peer's GPU worker."""

    call: InboundCall
    chunk_bytes: int
    _spare: list[LentSlot] = field(default_factory=list)

    async def slot(self, deadline: float) -> LentSlot:
        """A slot of the peer's pool to WRITE the next chunk into."""
        if self._spare:
            return self._spare.pop()
        lent = await self.call(None, 0, True, deadline - time.monotonic(), [])
        assert lent is not None
        return lent

    async def land(self, slot: LentSlot, rows: np.ndarray, deadline: float, lend_next: bool) -> None:
        """The WRITE into ``slot`` ended: have the peer copy ``rows`` (its GPU address, length,
        offset in the slot) into its engine; returns once that copy is complete. ``lend_next``:
        ask for a slot for a later chunk in the same call."""
        lent = await self.call(rows, slot.slot, lend_next, deadline - time.monotonic(), [])
        if lent is not None:
            self._spare.append(lent)

    async def finish(self, unlanded: list[int], deadline: float) -> None:
        """Hand back slots lent to us and not landed (best effort: the peer's lease returns them)."""
        back = unlanded + [spare.slot for spare in self._spare]
        self._spare = []
        if not back:
            return
        try:
            await self.call(None, 0, False, max(0.0, deadline - time.monotonic()), back)
        except Exception as exc:
            log.info("push_staging_give_back_failed", slots=len(back), error=str(exc))

    @property
    def spare(self) -> int:
        return len(self._spare)


class Pool(Protocol):
    """Our pinned pool (``host_staging.PinnedPool``), as the push uses it."""

    def address(self, slot: int) -> int: ...

    async def lend(self, want: int, deadline: float) -> list[int]: ...

    def give_back(self, slots: list[int]) -> None: ...

    def hold(self, slot: int, marker: Any) -> None: ...


class PushMove(Protocol):
    """One staged push (``host_staging.StagedMove`` with a ``PushStager``)."""

    @property
    def op(self) -> str: ...

    @property
    def agent_name(self) -> str: ...

    @property
    def device_id(self) -> int: ...

    @property
    def remote(self) -> RemoteAgent: ...

    @property
    def notification(self) -> bytes: ...

    @property
    def deadline(self) -> float: ...

    @property
    def not_after(self) -> float | None: ...


class _ChunkFailed(Exception):
    """A chunk's own GPU copy could not run in time (the message says why)."""


async def staged_push(
    transport: Transport, pool: Pool | None, move: PushMove, stager: PushStager, chunks: StageChunks, depth: int
) -> TransferResult:
    """Run one staged push (see the module docstring). ``pool``: our pinned pool (a GPU engine's
    chunks are copied through it; None for a host-memory engine). Never raises."""
    started = time.monotonic()
    unlanded: list[int] = []
    begun = 0  # chunks that have taken a slot of the peer's

    async def source(chunk: int) -> tuple[np.ndarray, int | None]:
        """The rows to WRITE from (and our slot holding them, to give back)."""
        rows = chunks.rows(chunk)
        device = chunks.device[rows]
        if pool is None:
            return device, None
        try:
            (mine,) = await pool.lend(1, move.deadline)
        except TimeoutError:
            raise _ChunkFailed(f"{move.op} did not complete within its deadline (no host staging slot free)") from None
        staged = np.uint64(pool.address(mine)) + chunks.offsets[rows]
        copies = np.column_stack((staged, device[:, 0], device[:, 1])).astype(np.uint64, copy=False)
        try:
            pending = cuda_ipc.batch_copy(move.device_id, copies)
        except Exception as exc:
            pool.give_back([mine])
            raise _ChunkFailed(f"host staging: GPU copy of chunk {chunk} failed to launch: {exc}") from exc
        try:
            if not cuda_ipc.copy_done(pending):
                remaining = move.deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded("no time left")
                await asyncio.to_thread(cuda_ipc.wait_copy, pending, remaining)
        except DeadlineExceeded as exc:
            # It only reads the engine's blocks into our slot, whose WRITE is never posted.
            try:
                marker = cuda_ipc.batch_copy(move.device_id, [])
            except Exception:
                marker = None
            pool.hold(mine, marker)
            raise _ChunkFailed(
                f"{move.op} did not complete within its deadline (host staging: the GPU copy of chunk {chunk} "
                f"of {chunks.count} did not complete: {exc})"
            ) from exc
        except Exception as exc:
            pool.give_back([mine])
            raise _ChunkFailed(f"host staging: the GPU copy of chunk {chunk} failed: {exc}") from exc
        local = device.copy()
        local[:, 0] = staged
        local[:, 2] = 0
        return local, mine

    async def push(chunk: int) -> TransferResult:
        nonlocal begun
        begun += 1
        rows = chunks.rows(chunk)
        remote, offsets = chunks.remote[rows], chunks.offsets[rows]
        try:
            target = await stager.slot(move.deadline)
        except Exception as exc:
            return TransferResult(False, f"host staging: the peer lent no slot for chunk {chunk}: {exc}")
        unlanded.append(target.slot)
        mine: int | None = None
        try:
            local, mine = await source(chunk)
            into = remote.copy()
            into[:, 0] = np.uint64(target.address) + offsets
            into[:, 2] = 0
            spec = RunsSpec(
                move.agent_name, "WRITE", move.remote, local, "DRAM", into, "DRAM", b"", move.deadline,
                move.not_after, observed=False,
            )  # fmt: skip
            written = await transport.transfer_runs(spec)
        except _ChunkFailed as exc:
            return TransferResult(False, str(exc))
        finally:
            if mine is not None and pool is not None:
                pool.give_back([mine])  # the WRITE from it has ended (or was never posted)
        if not written.ok:
            unlanded.remove(target.slot)  # a WRITE that may still run: the slot waits for its lease
            return written
        unlanded.remove(target.slot)
        try:
            await stager.land(
                target,
                np.column_stack((remote[:, 0], remote[:, 1], offsets)),
                move.deadline,
                begun + stager.spare < chunks.count,  # a chunk not begun has no slot yet
            )
        except Exception as exc:
            return TransferResult(False, f"host staging: the peer did not copy chunk {chunk} into its engine: {exc}")
        return written

    try:
        results = await post_windowed(chunks.count, depth, push)
    finally:
        await stager.finish(unlanded, move.deadline)
    failure = next((result for result in results if not result.ok), None)
    if failure is not None:
        return failure
    try:
        await transport.notify(move.agent_name, move.remote, move.notification)
    except Exception as exc:
        return TransferResult(False, f"notification failed: {exc}")
    elapsed = time.monotonic() - started
    return TransferResult(
        True, bytes=chunks.total, descriptors=sum(r.descriptors for r in results), duration_s=elapsed,
        handoff={"copy_transfer": elapsed},
    )  # fmt: skip
