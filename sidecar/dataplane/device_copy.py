"""Node-local GPU transfers by device copy: one request's KV moved with the CUDA driver's batched
copy instead of NIXL, where both sides' memory is, or can be, mapped in this process and one of
them is VRAM.

Why: the sidecar's VRAM is memory it imported (``cuIpcOpenMemHandle``); UCX cannot re-export it,
so NIXL between two of our agents falls back to software emulation over TCP (0.1-0.4 GB/s on an
H200, ``docs/gpu.md``). A sidecar that has both engines' memory mapped copies it itself.

What this module owns:
- ``node_id``: which node this is (the kernel's boot id), so a peer sidecar can tell it shares ours;
- ``PeerMappings``: peer engines' VRAM opened here from the handles their sidecars advertise
  (``NodeExport``), per peer agent: an agent name names one registration of one sidecar
  instance, so a restarted peer or a re-registered engine is opened afresh and never through a
  stale handle; closed when the peer client drops the peer's agents (restart, engine gone) or
  the table is full, never while a copy uses them;
- ``copy_rows``: the (dst, src, nbytes) rows of one transfer from the plan's descriptor arrays;
- ``run_copies``: ONE ``cuda_ipc.batch_copy`` per device for a request, launched and waited for
  (bounded by the transfer's deadline) on the copy threads, never on the event loop.

Threads: the event loop calls everything here; driver calls run on the ``kvsidecar-cuda`` threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

import numpy as np

from sidecar.dataplane import cuda_ipc
from sidecar.dataplane.contract import NOT_POSTED_LATE, NodeExport
from sidecar.dataplane.plan.layout import PlanError, Slice, WorkerLayout
from sidecar.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from sidecar.logs import get_logger

log = get_logger("kvsidecar.device_copy")

PATH = "device_copy"  # the path token of its trace events and transfer metrics
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# Peer workers whose memory stays opened here at once (a few engines per node, TP ranks each).
PEER_WORKERS_OPEN = 64
# Copy threads: each holds one request's launch and wait; a hung copy holds one until its deadline.
_COPY_THREADS = 8
_executor: concurrent.futures.ThreadPoolExecutor | None = None


@cache
def node_id() -> str:
    """This node's identity for same-node checks: the kernel's boot id (the same in every
    container of the node, new at every boot). "" where it cannot be read (then no peer is
    taken for same-node)."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def _copy_executor() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="kvsidecar-cuda")
    return _executor


async def _in_copy_thread(function, *args):  # type: ignore[no-untyped-def]
    return await asyncio.get_running_loop().run_in_executor(_copy_executor(), function, *args)


# --- the copies of one transfer -----------------------------------------------------------------


def selected_descriptors(layout: WorkerLayout, view: Slice, indices: np.ndarray) -> np.ndarray:
    """Rows ``indices`` of ``plan.descriptors.view_descriptors(layout, view)`` (Nx3 address,
    length, device), computed for those rows only: the whole view has a row per block of every
    region, and a request selects a few of them (pure)."""
    indices = np.asarray(indices, dtype=np.int64)
    regions, blocks = np.divmod(indices, max(layout.num_blocks, 1))
    bases = np.array([region.base for region in layout.regions], dtype=np.uint64)
    strides = np.array([region.block_stride for region in layout.regions], dtype=np.uint64)
    parts = np.array([region.block_len // view.count for region in layout.regions], dtype=np.uint64)
    rows = np.empty((len(indices), 3), dtype=np.uint64)
    rows[:, 0] = bases[regions] + blocks.astype(np.uint64) * strides[regions] + np.uint64(view.index) * parts[regions]
    rows[:, 1] = parts[regions]
    rows[:, 2] = layout.device_id
    return rows


def copy_rows(op: str, local: np.ndarray, remote: np.ndarray) -> np.ndarray:
    """Nx3 uint64 (dst, src, nbytes) rows from the plan's Nx3 (address, length, device) arrays of
    both sides, row i of ``local`` moving to or from row i of ``remote`` (pure). READ: remote ->
    local; WRITE: local -> remote."""
    if local.shape != remote.shape:
        raise PlanError(f"{len(local)} local vs {len(remote)} remote descriptors")
    if not np.array_equal(local[:, 1], remote[:, 1]):
        raise PlanError("descriptor lengths differ")
    dst, src = (local, remote) if op == "READ" else (remote, local)
    rows = np.empty((len(local), 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2] = dst[:, 0], src[:, 0], local[:, 1]
    return rows


@dataclass
class CopyOutcome:
    """What a request's device copies did: ``post_s`` launching them, ``duration_s`` from the
    first launch to completion seen (the transfer's own post -> done). ``late``: copies launched
    but not complete at the deadline (they may still write); ``held_s``: how long the outcome
    then waited for them (``LateCopies.hold``)."""

    ok: bool
    error: str = ""
    bytes: int = 0
    copies: int = 0
    runs: int = 0
    launches: int = 0
    post_s: float = 0.0
    duration_s: float = 0.0
    late: tuple[cuda_ipc.PendingCopy, ...] = ()
    held_s: float = 0.0


def _launch_and_wait(batches: dict[int, np.ndarray], deadline: float, not_after: float | None) -> CopyOutcome:
    """On a copy thread: one batch_copy per device, then wait for all until ``deadline``. A copy
    not complete by then is returned in ``late`` (its event kept: the caller holds the outcome
    until it completes)."""
    if not_after is not None and time.monotonic() > not_after:
        return CopyOutcome(False, NOT_POSTED_LATE)
    started = time.monotonic()
    pending: list[cuda_ipc.PendingCopy] = []
    copies = sum(len(rows) for rows in batches.values())
    try:
        for device_id, rows in sorted(batches.items()):
            pending.append(cuda_ipc.batch_copy(device_id, rows))
    except FailedPrecondition as exc:  # refused to enqueue: those launched before may still run
        return CopyOutcome(False, f"device copy failed: {exc}", copies=copies, late=tuple(pending))
    posted = time.monotonic()
    for index, copy in enumerate(pending):
        try:
            cuda_ipc.wait_copy(copy, deadline - time.monotonic(), abandon=False)
        except DeadlineExceeded as exc:
            return CopyOutcome(False, f"device copy failed: {exc}", copies=copies, late=tuple(pending[index:]))
        except FailedPrecondition as exc:  # this copy is over (failed); the others may still run
            return CopyOutcome(False, f"device copy failed: {exc}", copies=copies, late=tuple(pending[index + 1 :]))
    done = time.monotonic()
    return CopyOutcome(
        True,
        bytes=sum(copy.nbytes for copy in pending),
        copies=copies,
        runs=sum(copy.runs for copy in pending),
        launches=sum(copy.launches for copy in pending),
        post_s=posted - started,
        duration_s=done - started,
    )


async def run_copies(
    batches: dict[int, np.ndarray], deadline: float, not_after: float | None, held: LateCopies | None = None
) -> CopyOutcome:
    """Launch ``batches`` (device -> Nx3 rows, addresses of this process) and wait for them, on a
    copy thread; never raises for a copy's failure or its deadline (the outcome says why).

    A copy cannot be cancelled: one that missed the deadline may still write its destination
    blocks. The failed outcome is therefore returned only once every such copy has completed
    (``held``, see ``LateCopies``): the caller hands the blocks back to the engine (LOAD_FAILED,
    TransferFailed) only after. A caller cancelled meanwhile (its engine is going, the node
    stopping) still waits for the copy thread, which ends by ``deadline``; then it stops
    following the late copies."""
    future = asyncio.get_running_loop().run_in_executor(
        _copy_executor(), _launch_and_wait, batches, deadline, not_after
    )
    try:
        outcome = await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        for copy in future.result().late:
            cuda_ipc.abandon_copy(copy)
        raise
    if outcome.late:
        outcome.held_s = await (held if held is not None else LateCopies()).hold(outcome.late)
        outcome.error += (
            f"; the copy completed {outcome.held_s:.3f} s after its deadline, "
            "and its blocks were held from the engine until then"
        )
    return outcome


# --- copies past their deadline -----------------------------------------------------------------

# How often a held copy is checked (backing off to the max), how long one check may take (a
# driver call that does not return counts as "not done yet"), how often the warning repeats.
HOLD_CHECK_FIRST_S, HOLD_CHECK_MAX_S, HOLD_CHECK_BOUND_S, HOLD_WARN_EVERY_S = 0.01, 1.0, 5.0, 60.0


def _over(copies: tuple[cuda_ipc.PendingCopy, ...]) -> bool:
    """On a copy thread: whether every copy has ended (complete, or failed: it writes no more)."""
    for copy in copies:
        try:
            if not cuda_ipc.copy_done(copy):
                return False
        except (FailedPrecondition, DeadlineExceeded):
            continue  # failed, or no longer followed (abandoned): nothing to wait for
    return True


@dataclass
class LateCopies:
    """Device copies past their deadline that may still write an engine's blocks, and the wait
    for them (event loop thread). GPU memory cannot be fenced and a DMA cannot be called back, so
    the transfer's failure (which hands the blocks back to the engine: LOAD_FAILED, then vLLM
    recomputes into them) waits until the copy's completion event fires, checked every
    ``HOLD_CHECK_*`` off the loop, each check bounded. A copy that never completes (a hung GPU)
    keeps its blocks held for good: a leak the operator sees (``copies``/``bytes``: the metrics
    ``kvsidecar_device_copies_held``/``_held_bytes``, the warning ``device_copy_held``, the
    request still "reading"/"writing" in status), never a late write into reused blocks."""

    copies: int = 0
    bytes: int = 0
    ended: int = 0  # holds that ended (the copy completed late)

    async def hold(self, late: tuple[cuda_ipc.PendingCopy, ...]) -> float:
        """Wait until every copy of ``late`` has ended; returns the seconds waited. Cancelled:
        stops following them (the caller's engine or node is going)."""
        nbytes = sum(copy.nbytes for copy in late)
        self.copies += len(late)
        self.bytes += nbytes
        started = warned = time.monotonic()
        log.warning(
            "device_copy_held",
            copies=len(late),
            bytes=nbytes,
            gpus=sorted({copy.device_id for copy in late}),
            detail="a device copy missed its deadline and cannot be cancelled: the blocks it writes go back "
            "to the engine only once it completes",
        )
        loop = asyncio.get_running_loop()
        check: asyncio.Future[bool] | None = None
        pause = HOLD_CHECK_FIRST_S
        try:
            while True:
                if check is None:
                    check = loop.run_in_executor(_copy_executor(), _over, late)
                done, _ = await asyncio.wait({check}, timeout=HOLD_CHECK_BOUND_S)
                if done:
                    over, check = check.result(), None
                    if over:
                        break
                now = time.monotonic()
                if now - warned >= HOLD_WARN_EVERY_S:
                    warned = now
                    log.warning(
                        "device_copy_still_held", copies=len(late), bytes=nbytes, held_s=round(now - started, 1)
                    )
                await asyncio.sleep(pause)
                pause = min(pause * 2, HOLD_CHECK_MAX_S)
        except asyncio.CancelledError:
            for copy in late:
                cuda_ipc.abandon_copy(copy)
            log.warning("device_copy_hold_abandoned", copies=len(late), held_s=round(time.monotonic() - started, 3))
            raise
        finally:
            self.copies -= len(late)
            self.bytes -= nbytes
        held_s = time.monotonic() - started
        self.ended += 1
        log.warning("device_copy_hold_ended", copies=len(late), bytes=nbytes, held_s=round(held_s, 3))
        return held_s


# --- peer engines' memory, opened here ----------------------------------------------------------


@dataclass(frozen=True)
class PeerWorkerMap:
    """Where a peer worker's memory is in this process: (peer address, length, address here) per
    export, and the device that holds it as this process numbers GPUs."""

    device_id: int
    spans: tuple[tuple[int, int, int], ...]

    def translate(self, layout: WorkerLayout) -> WorkerLayout:
        """``layout`` (addresses in the peer sidecar's mapping) with addresses of this process;
        PlanError if a region does not lie wholly inside one export."""
        regions = []
        for region in layout.regions:
            extent = (layout.num_blocks - 1) * region.block_stride + region.block_len
            for start, length, here in self.spans:
                if start <= region.base and region.base + extent <= start + length:
                    regions.append(replace(region, base=here + region.base - start))
                    break
            else:
                raise PlanError(f"region {region.name!r} lies outside the peer's advertised exports")
        return replace(layout, regions=tuple(regions), device_id=self.device_id)


@dataclass
class _Entry:
    handles: list[bytes]
    mapping: PeerWorkerMap | None
    refusal: str = ""
    users: int = 0
    dropped: bool = False


@dataclass
class _Open:
    opened: cuda_ipc.OpenedHandle
    refs: int = 0


@dataclass
class PeerMappings:
    """Peer workers' VRAM opened here (see the module docstring). Event loop thread only; the
    driver calls run on the copy threads."""

    capacity: int = PEER_WORKERS_OPEN
    _entries: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)
    _opening: dict[str, asyncio.Future[_Entry]] = field(default_factory=dict)
    # One opening per handle in this process, however many workers' exports name it.
    _handles: dict[bytes, _Open] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # _handles, from the copy threads

    @property
    def open_handles(self) -> int:
        return len(self._handles)

    async def map_worker(self, agent_name: str, exports: tuple[NodeExport, ...]) -> PeerWorkerMap | None:
        """The peer worker ``agent_name``'s memory here, opening it on first use; None where it
        cannot be (another node, a GPU not visible here, the driver refused: logged once)."""
        entry = self._entries.get(agent_name)
        if entry is None:
            opening = self._opening.get(agent_name)
            if opening is None:
                opening = asyncio.ensure_future(self._open(agent_name, exports))
                self._opening[agent_name] = opening
                opening.add_done_callback(lambda _: self._opening.pop(agent_name, None))
            entry = await asyncio.shield(opening)
        else:
            self._entries.move_to_end(agent_name)
        return entry.mapping

    def hold(self, agent_names: Iterable[str]) -> None:
        """A copy uses these workers' memory: none of it is closed until ``release``."""
        for name in agent_names:
            entry = self._entries.get(name)
            if entry is not None:
                entry.users += 1

    async def release(self, agent_names: Iterable[str]) -> None:
        for name in agent_names:
            entry = self._entries.get(name)
            if entry is not None:
                entry.users -= 1
        await self._close_dropped()

    async def forget(self, agent_names: Iterable[str]) -> None:
        """The peer client dropped these agents (the peer restarted, its engine re-registered or
        went): their memory is closed here once no copy uses it."""
        for name in agent_names:
            entry = self._entries.get(name)
            if entry is not None:
                entry.dropped = True
        await self._close_dropped()

    async def close_all(self) -> None:
        for entry in self._entries.values():
            entry.dropped = True
        await self._close_dropped()

    async def _open(self, agent_name: str, exports: tuple[NodeExport, ...]) -> _Entry:
        entry = await _in_copy_thread(self._open_exports, exports)
        if entry.refusal:
            log.warning("peer_vram_not_opened", agent=agent_name, reason=entry.refusal, hint="NIXL moves it instead")
        self._entries[agent_name] = entry
        while len(self._entries) > self.capacity:
            oldest = next((name for name, e in self._entries.items() if not e.dropped and e.users == 0), None)
            if oldest is None or oldest == agent_name:
                break
            self._entries[oldest].dropped = True
            await self._close_dropped()
        return entry

    def _open_exports(self, exports: tuple[NodeExport, ...]) -> _Entry:
        """On a copy thread: open every export's handle (once per handle), or say why not."""
        with self._lock:
            return self._open_exports_locked(exports)

    def _open_exports_locked(self, exports: tuple[NodeExport, ...]) -> _Entry:
        mine = node_id()
        if not exports:
            return _Entry([], None, "the peer advertised no VRAM exports")
        if not mine or any(export.node_id != mine for export in exports):
            return _Entry([], None, "another node")
        spans: list[tuple[int, int, int]] = []
        devices: set[int] = set()
        opened_now: list[bytes] = []
        try:
            for export in exports:
                device = cuda_ipc.device_for_uuid(export.gpu_uuid)
                if device is None:
                    raise FailedPrecondition(f"GPU {export.gpu_uuid or '(unnamed)'} is not visible here")
                held = self._handles.get(export.handle)
                if held is None:
                    opened = cuda_ipc.open_handle(
                        export.handle, device, export.offset, export.length, "node_local_exports"
                    )
                    held = self._handles[export.handle] = _Open(opened)
                elif export.offset + export.length > held.opened.allocation_bytes:
                    raise InvalidArgument("node_local_exports.length", "exceeds the exported allocation")
                held.refs += 1
                opened_now.append(export.handle)
                devices.add(held.opened.device_id)
                spans.append((export.address, export.length, held.opened.pointer + export.offset))
        except (FailedPrecondition, InvalidArgument) as exc:
            self._unref_locked(opened_now)
            return _Entry([], None, str(exc))
        if len(devices) != 1:
            self._unref_locked(opened_now)
            return _Entry([], None, "a worker's exports span several GPUs")
        return _Entry(opened_now, PeerWorkerMap(devices.pop(), tuple(spans)))

    async def _close_dropped(self) -> None:
        done = [name for name, entry in self._entries.items() if entry.dropped and entry.users <= 0]
        handles = [handle for name in done for handle in self._entries.pop(name).handles]
        if handles:
            await _in_copy_thread(self._unref, handles)

    def _unref(self, handles: list[bytes]) -> None:
        """On a copy thread: drop one reference per entry; close handles nobody names any more."""
        with self._lock:
            self._unref_locked(handles)

    def _unref_locked(self, handles: list[bytes]) -> None:
        for handle in handles:
            held = self._handles.get(handle)
            if held is None:
                continue
            held.refs -= 1
            if held.refs <= 0:
                del self._handles[handle]
                try:
                    cuda_ipc.close_handle(held.opened)
                except FailedPrecondition as exc:
                    log.warning("peer_vram_close_failed", error=str(exc))
