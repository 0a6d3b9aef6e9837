"""Host staging: a local engine's GPU KV moved through the sidecar's own pinned host memory.

Why: the sidecar reaches an engine's GPU memory through CUDA IPC (``cuda_ipc``), and memory
imported so cannot be registered for RDMA (no dmabuf; UCX marks it unregistrable) nor exported
again over cuda_ipc: NIXL's UCX then emulates every READ/WRITE over TCP (0.1-0.4 GB/s on an H200).
Host memory the sidecar allocated itself can be registered with any NIC. So, for a local GPU
worker whose peer the plane does not copy to device to device (another node), the bytes go
GPU <-> a pinned pool <-> NIXL, pipelined (``HostStagingSettings`` in ``sidecar.config``).

The pool (``PinnedPool``): one ``cuda_ipc.host_alloc`` range (pinned, portable), allocated at the
first staged transfer in a worker thread and kept for the life of the process, cut into
``chunk_bytes`` slots, registered with each initiating agent once as DRAM
(``Transport.register_host``). A transfer borrows up to ``slots`` of them (at least one, waiting
while the pool is exhausted, bounded by its deadline).

The pipeline (``_Pipeline``), per (local worker, peer worker) pair, over ``plan.stage_chunks``:
- pull: NIXL READs chunk c from the peer into a slot while chunk c - 1 is copied slot -> the
  engine's blocks (one ``cuda_ipc.batch_copy`` per chunk);
- push: chunk c + 1 is copied the engine's blocks -> a slot while chunk c is WRITTEN to the peer.
Only the last READ/WRITE carries the peer's notification, posted once every other one is DONE
(as the transport does for its own chunks), so the peer's notification count is the same as on
the direct path and it never learns of data still in flight. A slot is lent again only once its
copy (pull) or WRITE (push) has ended; a copy not done by the deadline keeps its slot out of the
pool until the GPU reports it done (a late copy must not land in a slot another transfer holds).
A pull's late copy (slot -> the engine's blocks) may still write those blocks: the transfer's
failure waits until it completes (``device_copy.LateCopies``), so the engine never gets them back
under it. A push's late copy only reads the engine's blocks into a slot whose WRITE is never
posted: the failure goes out at once (what it reads cannot reach the peer).

Target-side staging (``target_staging``): a pull from a peer whose GPU worker advertises its
sidecar's pool READs each chunk from the slot that sidecar filled for it (``StagedMove.stager``).
A push into a peer whose GPU worker's sidecar lends its pool's slots WRITEs each chunk into one,
and that sidecar copies it into its engine (``staged_push``, ``core.push_staging``). A peer whose
KV is GPU memory and that does not stage (an older sidecar, staging off there) is still reached
through the memory its own sidecar registered (NIXL's emulation over TCP; an RDMA NIC cannot
register it); it is logged once per peer agent (``host_staging_peer_gpu_memory``).

Threads: the event loop thread plans, launches copies (a launch returns at once) and awaits NIXL;
waiting for a copy runs in ``asyncio.to_thread`` (``wait_copy`` blocks), bounded by the deadline.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from sidecar.config import HostStagingSettings
from sidecar.dataplane import cuda_ipc
from sidecar.dataplane.contract import RemoteAgent, RunsSpec, TransferResult, Transport
from sidecar.dataplane.device_copy import LateCopies
from sidecar.dataplane.plan.stage_chunks import StageChunks, cut
from sidecar.dataplane.staged_push import PushStager, post_windowed, staged_push
from sidecar.errors import DeadlineExceeded, FailedPrecondition
from sidecar.logs import get_logger

log = get_logger("kvsidecar.host_staging")

PATH = "host_staging"
# How often a transfer waiting for a slot checks slots held by late copies (they do not signal).
_HELD_RECHECK_S = 0.01


class PinnedPool:
    """Pinned host slots, lent to transfers (see the module docstring). Event loop thread."""

    def __init__(self, pool_bytes: int, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.count = max(1, pool_bytes // chunk_bytes)
        self.nbytes = self.count * chunk_bytes
        self.base = 0
        self._allocating: asyncio.Task[int] | None = None
        self._free: list[int] = []
        self._held: dict[int, Any] = {}  # slot -> the copy that may still write it
        self._freed = asyncio.Event()

    async def ready(self) -> int:
        """The pool's base address, allocating it on first use (in a worker thread: pinning
        hundreds of MiB takes a while)."""
        if self.base:
            return self.base
        if self._allocating is None:
            self._allocating = asyncio.ensure_future(asyncio.to_thread(cuda_ipc.host_alloc, self.nbytes))
        try:
            base = await asyncio.shield(self._allocating)
        except Exception:
            self._allocating = None  # the next transfer tries again
            raise
        if not self.base:
            self.base = base
            self._free = list(range(self.count))
            log.info("host_staging_pool_allocated", bytes=self.nbytes, slots=self.count)
        return self.base

    def address(self, slot: int) -> int:
        return self.base + slot * self.chunk_bytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    async def lend(self, want: int, deadline: float) -> list[int]:
        """Up to ``want`` free slots, at least one: waits (until ``deadline``, monotonic) while
        none is free. Raises TimeoutError."""
        while True:
            self._reclaim()
            if self._free:
                taken = self._free[-want:]
                del self._free[-len(taken) :]
                return taken
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self._freed.clear()
            wait = min(remaining, _HELD_RECHECK_S) if self._held else remaining
            try:
                await asyncio.wait_for(self._freed.wait(), wait)
            except TimeoutError:
                pass

    def give_back(self, slots: list[int]) -> None:
        self._free.extend(slots)
        self._freed.set()

    def hold(self, slot: int, marker: Any) -> None:
        """Keep ``slot`` out of the pool until ``marker`` is done: an empty ``batch_copy`` queued on
        the stream after a copy into or out of the slot that missed its deadline (a stream runs in
        order, so the marker ends only after that copy). None: held for good."""
        self._held[slot] = marker

    @property
    def held_slots(self) -> int:
        return len(self._held)

    def _reclaim(self) -> None:
        for slot, marker in list(self._held.items()):
            try:
                done = marker is not None and cuda_ipc.copy_done(marker)
            except FailedPrecondition:
                done = True  # a copy before the marker failed: the stream is past it
            except Exception:
                done = False
            if done:
                del self._held[slot]
                self._free.append(slot)
                log.info("host_staging_slot_reclaimed", slot=slot)


@dataclass(frozen=True)
class StagedMove:
    """One (local worker, peer worker) pair's staged transfer: ``device_rows`` (the local
    engine's GPU memory on ``device_id``) to or from ``remote_rows`` (the peer's ``remote_mem``),
    then ``notification`` to the peer; ``deadline``/``not_after`` as in ``RunsSpec``."""

    op: str  # "READ" | "WRITE"
    agent_name: str
    device_id: int
    remote: RemoteAgent
    remote_mem: str
    device_rows: np.ndarray
    remote_rows: np.ndarray
    notification: bytes
    deadline: float
    not_after: float | None = None
    # A pull whose peer stages its GPU memory into its own pool (target_staging): chunk c is
    # READ from the slot the peer filled for it, not from the peer's engine memory. A push into a
    # peer that lends its pool's slots (staged_push.PushStager): chunk c is WRITTEN into one.
    stager: Any = None  # target_staging.RemoteStager | staged_push.PushStager
    # "DRAM": the local engine's blocks are host memory (``device_rows`` then name them): a pull
    # from a staging peer READs each slot straight into them, through no pool of ours.
    local_mem: str = "VRAM"


class HostStaging:
    """Decides which transfers stage and runs them (the plane's hook). Event loop thread."""

    def __init__(self, transport: Transport, settings: HostStagingSettings) -> None:
        self._transport = transport
        self.settings = settings
        self.pool = PinnedPool(settings.pool_bytes, settings.chunk_bytes)
        self._noted_peers: set[str] = set()
        # Agents the pool is registered with. The node names agents with a serial (never reused),
        # so a name here stays right; cleared when large (registering again is a no-op there).
        self._registered: set[str] = set()
        # Pulls' copies past their deadline, whose failure waits for them (the plane shares its own).
        self.late_copies = LateCopies()

    @property
    def forced(self) -> bool:
        """``mode = "always"``: stage even where a device copy could run (the plane then never
        chooses a device copy: ``DataPlane.device_copy``)."""
        return self.settings.mode == "always"

    def applies(self, local_mem: str, peer_agent: str, peer_mem: str, peer_stages: bool = False) -> bool:
        """Whether a transfer of a local worker with ``local_mem`` stages through the pool (the
        plane asks only where it did not choose a device copy, unless ``forced``). Logs once per
        peer agent whose KV is GPU memory and whose sidecar does not stage it (target_staging)."""
        if self.settings.mode == "off":
            return False
        if local_mem == "DRAM" and peer_stages:
            return True  # READ the peer's slots straight into the engine's host memory
        if peer_mem == "VRAM" and not peer_stages and peer_agent not in self._noted_peers:
            if len(self._noted_peers) > 4096:  # peers come and go: logged again rather than kept forever
                self._noted_peers.clear()
            self._noted_peers.add(peer_agent)
            log.warning(
                "host_staging_peer_gpu_memory",
                peer_agent=peer_agent,
                reason=(
                    "the peer's KV is GPU memory its sidecar imported over CUDA IPC; it is reached through "
                    "that sidecar's NIXL registration (emulated over TCP; an RDMA NIC cannot register it): "
                    "that sidecar does not stage it (an older version, or host_staging.mode=off there)"
                ),
            )
        return local_mem == "VRAM"

    async def move(self, move: StagedMove) -> TransferResult:
        """Run one staged transfer; never raises for transfer or copy failures."""
        try:
            chunk_bytes = self.settings.chunk_bytes
            if move.stager is not None:  # a chunk must fit one slot of the peer's pool too
                chunk_bytes = min(chunk_bytes, move.stager.chunk_bytes)
            chunks = cut(move.device_rows, move.remote_rows, chunk_bytes)
        except ValueError as exc:  # PlanError: rows that do not pair
            return TransferResult(False, f"host staging: {exc}")
        if chunks.count == 0:
            return await self._notify(move)
        push = move.stager if isinstance(move.stager, PushStager) else None  # staged_push.py
        if move.local_mem == "DRAM":
            if push is not None:
                return await staged_push(self._transport, None, move, push, chunks, self.settings.slots)
            return await _direct_pull(self._transport, move, chunks, self.settings.slots)
        try:
            base = await self.pool.ready()
            if move.agent_name not in self._registered:
                await self._transport.register_host(move.agent_name, base, self.pool.nbytes)
                if len(self._registered) > 4096:
                    self._registered.clear()
                self._registered.add(move.agent_name)
        except Exception as exc:
            log.error("host_staging_unavailable", agent=move.agent_name, error=str(exc))
            return TransferResult(False, f"host staging pool unavailable: {exc}")
        if push is not None:
            return await staged_push(self._transport, self.pool, move, push, chunks, self.settings.slots)
        try:
            slots = await self.pool.lend(min(self.settings.slots, chunks.count), move.deadline)
        except TimeoutError:
            return TransferResult(False, f"{move.op} did not complete within its deadline (no host staging slot free)")
        pipeline = _Pipeline(self._transport, self.pool, move, chunks, slots, self.late_copies)
        try:
            return await pipeline.run()
        except Exception as exc:  # a bug must still reach the waiting side as a failed transfer
            log.exception("host_staging_failed", agent=move.agent_name, op=move.op)
            return TransferResult(False, f"host staging failed: {exc!r}")
        finally:
            pipeline.release()

    async def _notify(self, move: StagedMove) -> TransferResult:
        try:
            await self._transport.notify(move.agent_name, move.remote, move.notification)
        except Exception as exc:
            return TransferResult(False, f"notification failed: {exc}")
        return TransferResult(True)


def describe_staged(op: str, agent_name: str, result: TransferResult, peer_staged: bool = False) -> str:
    """A staged transfer's completion, for the request's trace (ends with its path token;
    ``peer_staged``: the peer staged its side too, target_staging)."""
    both = " staged_by_peer=yes" if peer_staged else ""
    if not result.ok:
        return f"{op} on {agent_name} failed: {result.error}{both} path={PATH}"
    return (
        f"{op} on {agent_name} done: {result.bytes} bytes, {result.descriptors} descriptors, "
        f"transfer {result.duration_s * 1000:.3f} ms{both} path={PATH}"
    )


async def _direct_pull(transport: Transport, move: StagedMove, chunks: StageChunks, depth: int) -> TransferResult:
    """A pull into host memory from a peer that stages (``move.stager``): chunk c is staged by the
    peer, then READ from its slot straight into the engine's blocks, up to ``depth`` chunks in
    flight; the last READ (it notifies) only once every other is done. Never raises."""
    started = time.monotonic()
    stager = move.stager

    async def read(chunk: int) -> TransferResult:
        rows = chunks.rows(chunk)
        remote, offsets = chunks.remote[rows], chunks.offsets[rows]
        try:
            staged = await stager.stage(np.column_stack((remote[:, 0], remote[:, 1], offsets)), move.deadline)
        except Exception as exc:
            return TransferResult(False, f"host staging: the peer did not stage chunk {chunk}: {exc}")
        in_slot = remote.copy()
        in_slot[:, 0] = np.uint64(staged.address) + offsets
        in_slot[:, 2] = 0
        last = chunk == chunks.count - 1
        spec = RunsSpec(
            move.agent_name, "READ", move.remote, chunks.device[rows], "DRAM", in_slot, "DRAM",
            move.notification if last else b"", move.deadline, move.not_after, observed=False,
        )  # fmt: skip
        try:
            return await transport.transfer_runs(spec)
        finally:
            stager.done(staged.slot)

    results: list[TransferResult] = []
    failure: TransferResult | None = None
    try:
        # The last chunk carries the notification: posted once every other chunk has arrived.
        results = await post_windowed(chunks.count - 1, depth, read)
        failure = next((result for result in results if not result.ok), None)
        if failure is None:
            last = await read(chunks.count - 1)
            results.append(last)
            failure = None if last.ok else last
    finally:
        await stager.finish(move.deadline)
    if failure is not None:
        return failure
    elapsed = time.monotonic() - started
    return TransferResult(
        True, bytes=chunks.total, descriptors=sum(r.descriptors for r in results), duration_s=elapsed,
        handoff={"copy_transfer": elapsed},
    )  # fmt: skip


class _CopyFailed(Exception):
    """A GPU copy could not be launched or did not complete in time (the message says which)."""


class _Pipeline:
    """One staged transfer's chunks in flight (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        pool: PinnedPool,
        move: StagedMove,
        chunks: StageChunks,
        slots: list[int],
        late_copies: LateCopies,
    ) -> None:
        self._transport = transport
        self._pool = pool
        self._move = move
        self._chunks = chunks
        self._slots = slots
        self._nixl: dict[int, asyncio.Future[TransferResult]] = {}
        self._copies: dict[int, Any] = {}  # chunk -> its copy, until waited for
        self._results: list[TransferResult] = []
        self._failure: TransferResult | None = None
        self._late: set[int] = set()  # slots a copy may still write or read (missed its deadline)
        self._late_copies = late_copies
        self._late_pending: list[cuda_ipc.PendingCopy] = []  # those copies, still followed

    def _slot(self, chunk: int) -> int:
        return self._slots[chunk % len(self._slots)]

    async def run(self) -> TransferResult:
        started = time.monotonic()
        try:
            if self._move.op == "READ":
                await self._pull()
            else:
                await self._push()
        except _CopyFailed as exc:
            self._fail(TransferResult(False, str(exc)))
        finally:
            await self._drain()
            if self._move.stager is not None:
                await self._move.stager.finish(self._move.deadline)
        if self._late_pending:
            await self._settle_late()
        if self._failure is not None:
            return self._failure
        elapsed = time.monotonic() - started
        return TransferResult(
            True,
            bytes=self._chunks.total,
            descriptors=sum(result.descriptors for result in self._results),
            duration_s=elapsed,
            handoff={"copy_transfer": elapsed},
        )

    async def _pull(self) -> None:
        count, depth = self._chunks.count, len(self._slots)
        next_read = 0
        for chunk in range(count):
            # READs whose slots are free, up to depth ahead; the last (it notifies) only once every
            # other READ is DONE, i.e. when its turn comes here.
            while next_read < count and next_read < chunk + depth:
                if next_read == count - 1 and next_read > chunk:
                    break
                if next_read >= depth:
                    await self._wait_copy(next_read - depth)  # that chunk's copy used the slot
                self._nixl[next_read] = self._post(next_read)
                next_read += 1
            if not await self._nixl_done(chunk):
                return
            self._copies[chunk] = self._launch_copy(chunk)
        for chunk in sorted(self._copies):
            await self._wait_copy(chunk)

    async def _push(self) -> None:
        count, depth = self._chunks.count, len(self._slots)
        self._copies[0] = self._launch_copy(0)
        for chunk in range(count):
            await self._wait_copy(chunk)
            if chunk == count - 1:
                for earlier in sorted(self._nixl):
                    if not await self._nixl_done(earlier):
                        return
            self._nixl[chunk] = self._post(chunk)
            if chunk + 1 < count:
                if chunk + 1 >= depth and not await self._nixl_done(chunk + 1 - depth):
                    return  # that WRITE used the slot the next copy fills
                self._copies[chunk + 1] = self._launch_copy(chunk + 1)
        await self._nixl_done(count - 1)

    def _post(self, chunk: int) -> asyncio.Future[TransferResult]:
        if self._move.stager is not None:
            return asyncio.ensure_future(self._staged_read(chunk))
        return asyncio.ensure_future(
            self._transport.transfer_runs(
                self._spec(chunk, self._chunks.remote[self._chunks.rows(chunk)], self._move.remote_mem)
            )
        )

    async def _staged_read(self, chunk: int) -> TransferResult:
        """Target-side staging: the peer copies the chunk into a slot of its pool, then it is READ
        from there; the slot is handed back once the READ has ended (whatever its result)."""
        move, rows = self._move, self._chunks.rows(chunk)
        remote, offsets = self._chunks.remote[rows], self._chunks.offsets[rows]
        try:
            staged = await move.stager.stage(np.column_stack((remote[:, 0], remote[:, 1], offsets)), move.deadline)
        except Exception as exc:
            return TransferResult(False, f"host staging: the peer did not stage chunk {chunk}: {exc}")
        in_slot = remote.copy()
        in_slot[:, 0] = np.uint64(staged.address) + offsets
        in_slot[:, 2] = 0
        try:
            return await self._transport.transfer_runs(self._spec(chunk, in_slot, "DRAM"))
        finally:
            move.stager.done(staged.slot)

    def _spec(self, chunk: int, remote: np.ndarray, remote_mem: str) -> RunsSpec:
        move, rows = self._move, self._chunks.rows(chunk)
        local = np.empty_like(remote)
        local[:, 0] = np.uint64(self._pool.address(self._slot(chunk))) + self._chunks.offsets[rows]
        local[:, 1] = remote[:, 1]
        local[:, 2] = 0
        last = chunk == self._chunks.count - 1
        return RunsSpec(
            move.agent_name, move.op, move.remote, local, "DRAM", remote, remote_mem,
            move.notification if last else b"", move.deadline, move.not_after, observed=False,
        )  # fmt: skip

    async def _nixl_done(self, chunk: int) -> bool:
        future = self._nixl.pop(chunk, None)
        if future is None:
            return self._failure is None
        result = await future
        if result.ok:
            self._results.append(result)
        else:
            self._fail(result)
        return self._failure is None

    def _launch_copy(self, chunk: int) -> Any:
        rows = self._chunks.rows(chunk)
        device = self._chunks.device[rows]
        staged = np.uint64(self._pool.address(self._slot(chunk))) + self._chunks.offsets[rows]
        # (dst, src, nbytes): slot -> the engine's blocks (pull), or the other way (push)
        dst, src = (device[:, 0], staged) if self._move.op == "READ" else (staged, device[:, 0])
        copies = np.column_stack((dst, src, device[:, 1])).astype(np.uint64, copy=False)  # no per-row Python
        try:
            return cuda_ipc.batch_copy(self._move.device_id, copies)
        except Exception as exc:
            raise _CopyFailed(f"host staging: GPU copy of chunk {chunk} failed to launch: {exc}") from exc

    async def _wait_copy(self, chunk: int) -> None:
        """Wait for a chunk's copy (at once if it is done; else in a worker thread, bounded by
        the deadline). Raises _CopyFailed; a late copy's slot is then kept (``_late``)."""
        pending = self._copies.get(chunk)
        if pending is None:
            return
        try:
            if not cuda_ipc.copy_done(pending):
                remaining = self._move.deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded("no time left")
                await asyncio.to_thread(cuda_ipc.wait_copy, pending, remaining, abandon=False)
        except DeadlineExceeded as exc:
            self._late.add(self._slot(chunk))
            self._late_pending.append(pending)
            raise _CopyFailed(
                f"{self._move.op} did not complete within its deadline (host staging: the GPU copy of chunk "
                f"{chunk} of {self._chunks.count} did not complete: {exc})"
            ) from exc
        except Exception as exc:  # the copy failed (e.g. an engine's memory gone): it is over
            raise _CopyFailed(f"host staging: the GPU copy of chunk {chunk} failed: {exc}") from exc
        finally:
            self._copies.pop(chunk, None)

    async def _settle_late(self) -> None:
        """Copies that missed the deadline: a pull's may still write the engine's blocks, so the
        failure waits for them (``LateCopies.hold``; their slots are then free again). A push's
        only read the engine's blocks: no longer followed (their slots wait for a marker)."""
        late, self._late_pending = tuple(self._late_pending), []
        if self._move.op != "READ":
            for copy in late:
                cuda_ipc.abandon_copy(copy)
            return
        held_s = await self._late_copies.hold(late)
        self._late.clear()  # the copies are over: their slots may be lent again
        if self._failure is not None:
            self._failure = replace(
                self._failure,
                error=f"{self._failure.error}; the late GPU copy completed {held_s:.3f} s after the deadline, "
                "and the engine's blocks were held until then",
            )

    def _fail(self, result: TransferResult) -> None:
        if self._failure is None:
            self._failure = result

    async def _drain(self) -> None:
        """After a failure: NIXL transfers end by their deadline (the transport's bound); copies
        still running keep their slots (``PinnedPool.hold``)."""
        for chunk in sorted(self._nixl):
            await self._nixl_done(chunk)
        for chunk in sorted(self._copies):
            try:
                await self._wait_copy(chunk)
            except _CopyFailed as exc:
                self._fail(TransferResult(False, str(exc)))

    def release(self) -> None:
        """Slots back to the pool; those of late copies only once a marker behind them is done."""
        if self._late:
            try:
                marker = cuda_ipc.batch_copy(self._move.device_id, [])
            except Exception:
                marker = None
            for slot in self._late:
                self._pool.hold(slot, marker)
            log.error("host_staging_copy_late", agent=self._move.agent_name, held_slots=len(self._late))
        self._pool.give_back([slot for slot in self._slots if slot not in self._late])
