"""``FakeCudaDriver``: a stand-in for the CUDA driver (``sidecar.dataplane.cuda_ipc.CudaDriver``),
for tests on machines without a GPU only.

"Device memory" is host memory: ``allocate`` gives a buffer (a memfd mapping) whose address plays
the engine's device pointer and a 64-byte handle naming it. ``open`` (cuIpcOpenMemHandle) maps the
same memory again at another address, as a second process would see it, so a sidecar that used
the exporter's addresses (or another sidecar's) instead of its own would be caught. Copies run
with ``memmove`` when they are enqueued; the events recorded after them complete at once. Every
copy whose address falls in an allocation or an opened alias this fake ever made must lie wholly
in a live one (an alias still open, of memory not freed), else its event fails with CUDA's
illegal-address error: a stale pointer after a peer's restart is caught, not written through.
Other addresses are host memory (the sidecar's shm mappings, pinned host buffers).

What it is not: CUDA. No device, no DMA, no asynchrony unless told. Tests control it:
- ``has_batch``: False stands for a driver older than CUDA 12.8 (one cuMemcpyAsync per run);
- ``hang``: True makes every copy enqueued from then on never run and its event never complete
  (a GPU that hangs), for deadline tests; ``release()`` lets the device get going again: the
  held copies run then, in stream order, and their events complete (a late copy landing);
- ``batch_launches``: the driver calls each ``batch_copy`` made (one entry per recorded event);
  ``opens``/``closes``: the handles opened and closed, in order; ``calls``: "close" and
  "event_done"/"event_abandoned" in the order they happened (what ran before what).
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from kvsidecar.cuda_ipc import CUDA_IPC_HANDLE_BYTES
from sidecar.dataplane import cuda_ipc
from sidecar.dataplane.cuda_ipc import BatchArgs, OpenedHandle
from sidecar.errors import FailedPrecondition

_MAGIC = b"FAKECUDA"
_ILLEGAL_ADDRESS = "CUDA error 700 (an illegal memory access was encountered)"


@dataclass(eq=False)
class FakeAllocation:
    """A fake device allocation: ``pointer`` is a host address (the engine's); ``handle`` its
    IPC handle; ``array`` the bytes as the engine sees them."""

    serial: int
    device_id: int
    array: np.ndarray
    fd: int
    live: bool = True

    @property
    def pointer(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.array.size)

    @property
    def handle(self) -> bytes:
        packed = _MAGIC + struct.pack("<QQQi", self.serial, self.pointer, self.nbytes, self.device_id)
        return packed.ljust(CUDA_IPC_HANDLE_BYTES, b"\0")

    def view(self, offset: int = 0, length: int | None = None) -> np.ndarray:
        end = self.nbytes if length is None else offset + length
        return self.array[offset:end]


@dataclass(eq=False)
class _Alias:
    """An opened handle: the allocation's memory mapped again (never unmapped: a stale use must
    fail the copy, not crash the test process)."""

    allocation: FakeAllocation
    array: np.ndarray
    open: bool = True

    @property
    def pointer(self) -> int:
        return int(self.array.ctypes.data)


@dataclass
class _Event:
    ready: bool
    error: str = ""


@dataclass
class FakeCudaDriver:
    """See the module docstring. Thread-safe enough for the data plane's copy threads: every
    call's state change is a single Python operation under the GIL."""

    devices: int = 1
    has_batch: bool = True
    hang: bool = False
    allocations: list[FakeAllocation] = field(default_factory=list)
    batch_launches: list[int] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    opens: list[int] = field(default_factory=list)
    closes: list[int] = field(default_factory=list)
    destroyed_events: int = 0
    calls: list[str] = field(default_factory=list)
    _host: dict[int, np.ndarray] = field(default_factory=dict)
    _streams: dict[int, bool] = field(default_factory=dict)  # stream -> hung
    _since_event: dict[int, int] = field(default_factory=dict)  # stream -> launches since its last event
    _errors: dict[int, str] = field(default_factory=dict)  # stream -> error of a copy since its last event
    _events: dict[int, _Event] = field(default_factory=dict)
    _event_ids: Iterator[int] = field(default_factory=lambda: itertools.count(0x7001))
    _aliases: list[_Alias] = field(default_factory=list)
    # stream -> what a hung stream holds, in order: ("copy", runs) or ("event", id)
    _held: dict[int, list[tuple[str, object]]] = field(default_factory=dict)

    # --- test controls ---

    def install(self) -> FakeCudaDriver:
        cuda_ipc.set_driver_for_tests(self)
        return self

    def __enter__(self) -> FakeCudaDriver:
        return self.install()

    def release(self) -> None:
        """The hung device gets going again: every held copy runs now (memmove, checked as when
        enqueued) and the events recorded after them complete."""
        self.hang = False
        for stream, held in self._held.items():
            self._streams[stream] = False
            error = ""
            for kind, item in held:
                if kind == "copy":
                    error = error or self._run(item)  # type: ignore[arg-type]
                elif item in self._events:
                    self._events[item] = _Event(ready=True, error=error)  # type: ignore[index]
        self._held.clear()

    @property
    def held_copies(self) -> int:
        """Copies enqueued on a hung stream that have not run."""
        return sum(kind == "copy" for held in self._held.values() for kind, _ in held)

    def __exit__(self, *exc: object) -> None:
        cuda_ipc.set_driver_for_tests(None)
        for allocation in self.allocations:
            os.close(allocation.fd)
        self.allocations.clear()

    def allocate(self, nbytes: int, device_id: int = 0) -> FakeAllocation:
        fd = os.memfd_create("fake-cuda", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        allocation = FakeAllocation(len(self.allocations) + 1, device_id, _map(fd, nbytes), fd)
        self.allocations.append(allocation)
        return allocation

    def free(self, allocation: FakeAllocation) -> None:
        """The engine freed it (or died): opening its handle fails, copies touching it fail."""
        allocation.live = False

    @property
    def open_pointers(self) -> set[int]:
        """Where the handles still open are mapped (the importers' addresses)."""
        return {alias.pointer for alias in self._aliases if alias.open}

    def opened_allocations(self) -> list[FakeAllocation]:
        """The allocations with a handle open now (one entry per open)."""
        return [alias.allocation for alias in self._aliases if alias.open]

    @property
    def launches(self) -> int:
        return sum(self.batch_launches)

    # --- the driver (cuda_ipc.CudaDriver) ---

    def device_count(self) -> int:
        return self.devices

    def use_device(self, device_id: int) -> None:
        if not 0 <= device_id < self.devices:
            raise FailedPrecondition(f"cuDeviceGet({device_id}) failed: CUDA error 101 (invalid device ordinal)")

    def device_uuid(self, device_id: int) -> str:
        self.use_device(device_id)
        return cuda_ipc.format_uuid(bytes([0xFA, 0xCE, device_id]).ljust(16, b"\0"))

    def open(self, handle: bytes, device_id: int) -> OpenedHandle:
        if not handle.startswith(_MAGIC):
            raise FailedPrecondition("cuIpcOpenMemHandle failed: CUDA error 1 (invalid argument)")
        serial, pointer, nbytes, holder = struct.unpack_from("<QQQi", handle, len(_MAGIC))
        allocation = next((a for a in self.allocations if a.serial == serial and a.pointer == pointer), None)
        if allocation is None or not allocation.live:
            raise FailedPrecondition("cuIpcOpenMemHandle failed: CUDA error 1 (invalid argument)")
        alias = _Alias(allocation, _map(allocation.fd, nbytes))
        self._aliases.append(alias)
        self.opens.append(alias.pointer)
        return OpenedHandle(alias.pointer, nbytes, holder)

    def close(self, opened: OpenedHandle) -> None:
        alias = next((a for a in self._aliases if a.pointer == opened.pointer and a.open), None)
        if alias is None:
            raise FailedPrecondition("cuIpcCloseMemHandle failed: CUDA error 1 (invalid argument)")
        alias.open = False
        self.closes.append(opened.pointer)
        self.calls.append("close")

    def create_stream(self) -> int:
        stream = 0x5000 + len(self._streams) + 1
        self._streams[stream] = False
        return stream

    def memcpy_batch(self, args: BatchArgs, stream: int) -> None:
        if not self.has_batch:
            raise FailedPrecondition("cuMemcpyBatchAsync is not in this driver")
        assert args.attrs.srcAccessOrder == 1 and int(args.attrs_idxs[0]) == 0  # STREAM order, one entry
        runs = zip(args.dsts.tolist(), args.srcs.tolist(), args.sizes.tolist(), strict=True)
        self._enqueue(stream, list(runs))

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._enqueue(stream, [(dst, src, nbytes)])

    def record_event(self, stream: int) -> int:
        event = next(self._event_ids)  # never the id of a live event (destroyed ones leave gaps)
        self._events[event] = _Event(ready=not self._streams[stream], error=self._errors.pop(stream, ""))
        if self._streams[stream]:
            self._held.setdefault(stream, []).append(("event", event))
        self.batch_launches.append(self._since_event.pop(stream, 0))
        return event

    def event_done(self, event: int) -> bool:
        state = self._events[event]
        if state.error:
            raise FailedPrecondition(f"cuEventQuery (a device copy failed) failed: {state.error}")
        return state.ready

    def destroy_event(self, event: int) -> None:
        state = self._events.pop(event)
        self.destroyed_events += 1
        self.calls.append("event_done" if state.ready else "event_abandoned")

    def host_alloc(self, nbytes: int) -> int:
        array = np.zeros(nbytes, dtype=np.uint8)
        self._host[int(array.ctypes.data)] = array
        return int(array.ctypes.data)

    def host_free(self, pointer: int) -> None:
        if self._host.pop(pointer, None) is None:
            raise FailedPrecondition("cuMemFreeHost failed: CUDA error 1 (invalid argument)")

    # --- inside ---

    def _enqueue(self, stream: int, runs: list[tuple[int, int, int]]) -> None:
        self._since_event[stream] = self._since_event.get(stream, 0) + 1
        if self.hang:
            self._streams[stream] = True  # this copy and everything after it on the stream never ends
        if self._streams[stream]:
            self._held.setdefault(stream, []).append(("copy", runs))
            return
        error = self._run(runs)
        if error:
            self._errors[stream] = error

    def _run(self, runs: list[tuple[int, int, int]]) -> str:
        for dst, src, nbytes in runs:
            if not (self._valid(dst, nbytes) and self._valid(src, nbytes)):
                return _ILLEGAL_ADDRESS
        for dst, src, nbytes in runs:
            ctypes.memmove(dst, src, nbytes)
            self.copies.append((dst, src, nbytes))
        return ""

    def _valid(self, address: int, nbytes: int) -> bool:
        """Host memory, or wholly inside one live allocation or open alias of one."""
        ranges = [(a.pointer, a.nbytes, a.live) for a in self.allocations]
        ranges += [(a.pointer, a.allocation.nbytes, a.open and a.allocation.live) for a in self._aliases]
        for start, size, live in ranges:
            end = start + size
            if start <= address < end or start < address + nbytes <= end:
                return live and start <= address and address + nbytes <= end
        return True


def _map(fd: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
