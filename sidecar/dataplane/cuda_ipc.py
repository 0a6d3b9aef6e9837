"""Opening an engine worker's exported GPU memory (a CUDA IPC handle) in the sidecar's process.

The sidecar talks to the CUDA *driver* (``libcuda.so.1``, through ctypes), not to the runtime: the
driver library is on every GPU node with the kernel module, while ``libcudart`` ships with a
toolkit or inside a framework's wheel (PyTorch's) that a sidecar image does not carry. An engine
exports with either API (``cudaIpcGetMemHandle`` and ``cuIpcGetMemHandle`` make the same 64-byte
handle); the sidecar opens it in the device's *primary* context, the one the runtime (and so
NIXL's UCX CUDA transports) uses too.

A handle names a whole allocation (``cudaMalloc`` block, or a caching allocator's segment), so an
export carries the offset of its KV range inside it; the range is checked against the allocation's
real size before anything is registered. The export's ``device_id`` is checked against the device
that holds the memory (an engine started with ``CUDA_VISIBLE_DEVICES`` numbers its GPUs from 0):
the memory is opened and registered on the device that holds it.

Called from the thread that maps memory at registration (``asyncio.to_thread``), from the event
loop thread at release, and from the NIXL owner thread before it registers GPU memory
(``make_current``). The primary context is made current on the calling thread before each call
(a context is per thread) and retained once per device for the life of the process.

Device copies (``batch_copy``, ``copy_done``, ``wait_copy``): the data plane moves node-local GPU
memory itself instead of through NIXL (UCX cannot re-export memory this process imported, and
falls back to software emulation over TCP). A request's (dst, src, nbytes) triples, unified
addresses (device to device, device to host, host to device alike), are coalesced into contiguous
runs and enqueued on the sidecar's own non-blocking stream of the device: ONE
``cuMemcpyBatchAsync`` launch (driver of CUDA >= 12.8) where the driver has it, else one
``cuMemcpyAsync`` per run; an event recorded after them says when they are done, queried without
blocking and waited for with a bound. ``host_alloc``/``host_free``: pinned, portable host memory
(``cuMemHostAlloc``) for host staging. Called from the data plane's copy threads (any thread: the
device's primary context is made current first); ``set_driver_for_tests`` installs a fake driver
(``tests/support/fake_cuda.py``) where no GPU is.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvsidecar.cuda_ipc import CUDA_IPC_HANDLE_BYTES
from sidecar.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from sidecar.logs import get_logger

log = get_logger("kvsidecar.cuda_ipc")

_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_POINTER_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
_LIBRARY = "libcuda.so.1"
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: never waits on the legacy default stream
_EVENT_DISABLE_TIMING = 2  # CU_EVENT_DISABLE_TIMING: the cheapest event to record and query
_ERROR_NOT_READY = 600  # CUDA_ERROR_NOT_READY (cuEventQuery: the work before it still runs)
_MEMHOSTALLOC_PORTABLE = 1  # CU_MEMHOSTALLOC_PORTABLE: pinned for every context, not just one
_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources read in stream order
_BATCH_API_VERSION = 12080  # cuMemcpyBatchAsync as CUDA 12.8 defined it (with failIdx)


class _IpcHandle(ctypes.Structure):
    # CUipcMemHandle (= cudaIpcMemHandle_t) is a struct passed *by value*: a bare ctypes array
    # argument would pass a pointer to it instead. Bytes, not c_char: ctypes copies a bytes value
    # into a c_char array field only up to its first NUL, and handles are full of zeros.
    _fields_ = [("reserved", ctypes.c_ubyte * CUDA_IPC_HANDLE_BYTES)]


def handle_struct(handle: bytes) -> _IpcHandle:
    """The handle as the by-value struct the driver takes, every byte copied (pure)."""
    return _IpcHandle.from_buffer_copy(handle)


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]  # CUmemLocation


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes: how the copies of a batch read their sources (CUDA >= 12.8)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


Copy = tuple[int, int, int]  # (dst, src, nbytes), unified virtual addresses


def coalesce(copies: Sequence[Copy] | np.ndarray) -> np.ndarray:
    """The copies as contiguous runs, an Nx3 uint64 (dst, src, nbytes) array (pure, vectorized:
    a request's thousands of blocks cost no Python loop): sorted by destination, empty ones
    dropped, a copy that continues the previous one on both sides merged into it. Copies of one
    batch are unordered anyway (their destinations never overlap), so sorting changes nothing."""
    table = np.asarray(copies, dtype=np.uint64).reshape(-1, 3)
    table = table[table[:, 2] > 0]
    table = table[np.lexsort((table[:, 1], table[:, 0]))]
    if len(table) <= 1:
        return table
    ends = table[:-1, :2] + table[:-1, 2:3]
    continues = (ends == table[1:, :2]).all(axis=1)
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    runs = table[starts].copy()
    runs[:, 2] = np.add.reduceat(table[:, 2], starts)
    return runs


@dataclass(frozen=True)
class BatchArgs:
    """``cuMemcpyBatchAsync``'s arrays for some runs (pure): dsts, srcs and sizes as contiguous
    uint64 arrays, and ONE attributes entry (index 0) that applies to every copy: sources read in
    stream order, no location hints (they matter for managed memory only)."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray
    attrs: MemcpyAttributes
    attrs_idxs: np.ndarray

    @property
    def count(self) -> int:
        return int(self.sizes.size)


def pack_batch(runs: Sequence[Copy] | np.ndarray) -> BatchArgs:
    table = np.asarray(runs, dtype=np.uint64).reshape(-1, 3)
    return BatchArgs(
        dsts=np.ascontiguousarray(table[:, 0]),
        srcs=np.ascontiguousarray(table[:, 1]),
        sizes=np.ascontiguousarray(table[:, 2]),
        attrs=MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM),
        attrs_idxs=np.zeros(1, dtype=np.uint64),
    )


@dataclass(frozen=True)
class OpenedHandle:
    """An IPC handle opened here: ``pointer`` is where its allocation starts in this process, on
    ``device_id`` as this process numbers GPUs (where the memory is, whatever the export said)."""

    pointer: int
    allocation_bytes: int
    device_id: int


class _Driver:
    """The few driver calls the sidecar needs, with their argument types declared."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL(_LIBRARY)
        except OSError:
            raise FailedPrecondition(
                f"VRAM exports need a CUDA GPU and its driver ({_LIBRARY}) on the sidecar's node; the driver "
                "library was not found here (in a container: run it with the NVIDIA container runtime). "
                "Use a DRAM export (host staging buffer) on this node."
            ) from None
        self._lib = lib
        self._lock = threading.Lock()
        self._contexts: dict[int, ctypes.c_void_p] = {}
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuDeviceGetCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        # The headers map these names to their _v2 entry points (64-bit device pointers).
        self._open = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        self._open.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        self._close = lib.cuIpcCloseMemHandle
        self._close.argtypes = [ctypes.c_uint64]
        self._range = getattr(lib, "cuMemGetAddressRange_v2", None) or lib.cuMemGetAddressRange
        self._range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        try:
            self._check(lib.cuInit(0), "cuInit")
        except FailedPrecondition as exc:  # e.g. a driver library without a device (CUDA error 100)
            raise FailedPrecondition(
                f"VRAM exports need a CUDA GPU on the sidecar's node; {exc}. Use a DRAM export (host staging "
                "buffer) on this node."
            ) from None
        self._declare_copy_calls()

    def _check(self, status: int, call: str) -> None:
        if status == 0:
            return
        text = ctypes.c_char_p()
        self._lib.cuGetErrorString(status, ctypes.byref(text))
        detail = text.value.decode(errors="replace") if text.value else "unknown error"
        raise FailedPrecondition(f"{call} failed: CUDA error {status} ({detail})")

    def device_count(self) -> int:
        count = ctypes.c_int(0)
        self._check(self._lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        return count.value

    def use_device(self, device_id: int) -> None:
        """Make ``device_id``'s primary context current on the calling thread."""
        with self._lock:
            context = self._contexts.get(device_id)
            if context is None:
                device = ctypes.c_int(0)
                self._check(self._lib.cuDeviceGet(ctypes.byref(device), device_id), f"cuDeviceGet({device_id})")
                context = ctypes.c_void_p()
                self._check(
                    self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device.value),
                    f"cuDevicePrimaryCtxRetain({device_id})",
                )
                self._contexts[device_id] = context
        self._check(self._lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")

    def open(self, handle: bytes, device_id: int) -> OpenedHandle:
        opened = self._open_on(handle, device_id)
        ordinal = ctypes.c_int(-1)
        status = self._lib.cuPointerGetAttribute(ctypes.byref(ordinal), _POINTER_DEVICE_ORDINAL, opened.pointer)
        if status != 0:
            # Keep the export's numbering (right unless the engine renumbered its GPUs).
            log.warning("vram_device_unknown", device_id=device_id, cuda_error=status)
            return opened
        if ordinal.value == device_id:
            return opened
        # The engine numbered its GPUs differently (CUDA_VISIBLE_DEVICES renumbers them inside the
        # engine): open the memory in the context of the device that holds it, and register it there.
        log.info("vram_export_on_another_device", device_id=device_id, holding_device=ordinal.value)
        self.close(opened)
        return self._open_on(handle, ordinal.value)

    def _open_on(self, handle: bytes, device_id: int) -> OpenedHandle:
        self.use_device(device_id)
        pointer = ctypes.c_uint64(0)
        self._check(
            self._open(ctypes.byref(pointer), handle_struct(handle), _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle"
        )
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        try:
            self._check(self._range(ctypes.byref(base), ctypes.byref(size), pointer.value), "cuMemGetAddressRange")
        except FailedPrecondition:
            self._close(pointer.value)
            raise
        return OpenedHandle(pointer.value, int(size.value), device_id)

    def close(self, opened: OpenedHandle) -> None:
        self.use_device(opened.device_id)
        self._check(self._close(opened.pointer), "cuIpcCloseMemHandle")

    # --- device copies (see the module docstring) ---

    def _declare_copy_calls(self) -> None:
        lib = self._lib
        lib.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cuEventCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cuEventQuery.argtypes = [ctypes.c_void_p]
        self._event_destroy = getattr(lib, "cuEventDestroy_v2", None) or lib.cuEventDestroy
        self._event_destroy.argtypes = [ctypes.c_void_p]
        self._memcpy = lib.cuMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._host_alloc = lib.cuMemHostAlloc
        self._host_alloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemFreeHost.argtypes = [ctypes.c_void_p]
        self._uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
        self._uuid.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self._batch = self._batch_entry_point()

    def _batch_entry_point(self) -> Callable[..., int] | None:
        """cuMemcpyBatchAsync in its CUDA 12.8 form (the 9-argument one, with failIdx), asked of
        the driver by version: a CUDA 13 driver exports the 8-argument ``_v2`` under the same
        name in its headers, and ``cuGetProcAddress`` hands each caller the ABI it asks for.
        None where the driver is older than 12.8."""
        proto = ctypes.CFUNCTYPE(
            ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
            ctypes.POINTER(MemcpyAttributes), ctypes.c_void_p, ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
        )  # fmt: skip
        pointer = ctypes.c_void_p()
        lookup = getattr(self._lib, "cuGetProcAddress_v2", None)
        if lookup is not None:
            lookup.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                               ctypes.c_void_p]  # fmt: skip
            status = lookup(b"cuMemcpyBatchAsync", ctypes.byref(pointer), _BATCH_API_VERSION, 0, None)
        else:
            lookup = getattr(self._lib, "cuGetProcAddress", None)
            if lookup is None:
                return None
            lookup.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64]
            status = lookup(b"cuMemcpyBatchAsync", ctypes.byref(pointer), _BATCH_API_VERSION, 0)
        if status != 0 or not pointer.value:
            log.info("cuda_batch_copy_unavailable", cuda_error=status)
            return None
        return proto(pointer.value)

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def create_stream(self) -> int:
        """A new non-blocking stream in the current context."""
        stream = ctypes.c_void_p()
        self._check(self._lib.cuStreamCreate(ctypes.byref(stream), _STREAM_NON_BLOCKING), "cuStreamCreate")
        return int(stream.value or 0)

    def memcpy_batch(self, args: BatchArgs, stream: int) -> None:
        """Enqueue every run of ``args`` with one call (``has_batch`` must be true)."""
        assert self._batch is not None
        fail_index = ctypes.c_size_t(0)
        status = self._batch(
            args.dsts.ctypes.data, args.srcs.ctypes.data, args.sizes.ctypes.data, args.count,
            ctypes.byref(args.attrs), args.attrs_idxs.ctypes.data, 1, ctypes.byref(fail_index), stream,
        )  # fmt: skip
        self._check(status, f"cuMemcpyBatchAsync (copy {fail_index.value} of {args.count})")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self._memcpy(dst, src, nbytes, stream), "cuMemcpyAsync")

    def record_event(self, stream: int) -> int:
        """A new event recorded on ``stream``: it completes once the work enqueued before it has."""
        event = ctypes.c_void_p()
        self._check(self._lib.cuEventCreate(ctypes.byref(event), _EVENT_DISABLE_TIMING), "cuEventCreate")
        status = self._lib.cuEventRecord(event, stream)
        if status != 0:
            self._event_destroy(event)
            self._check(status, "cuEventRecord")
        return int(event.value or 0)

    def event_done(self, event: int) -> bool:
        """Whether the work before ``event`` completed; raises if it failed."""
        status = self._lib.cuEventQuery(event)
        if status == _ERROR_NOT_READY:
            return False
        self._check(status, "cuEventQuery (a device copy failed)")
        return True

    def destroy_event(self, event: int) -> None:
        # Safe on an event still pending: the driver frees it once the device reaches it.
        self._event_destroy(event)

    def host_alloc(self, nbytes: int) -> int:
        pointer = ctypes.c_void_p()
        self._check(self._host_alloc(ctypes.byref(pointer), nbytes, _MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc")
        return int(pointer.value or 0)

    def host_free(self, pointer: int) -> None:
        self._check(self._lib.cuMemFreeHost(pointer), "cuMemFreeHost")

    def device_uuid(self, device_id: int) -> str:
        """The GPU's UUID as nvidia-smi prints it ("GPU-xxxxxxxx-xxxx-..."): the same GPU has the
        same UUID in every process, whatever each numbers it."""
        device = ctypes.c_int(0)
        self._check(self._lib.cuDeviceGet(ctypes.byref(device), device_id), f"cuDeviceGet({device_id})")
        raw = ctypes.create_string_buffer(16)
        self._check(self._uuid(raw, device.value), "cuDeviceGetUuid")
        return format_uuid(raw.raw)


def format_uuid(raw: bytes) -> str:
    """A CUuuid's 16 bytes as "GPU-8-4-4-4-12" hex (pure; nvidia-smi's spelling)."""
    text = raw.hex()
    return f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:32]}"


class CudaDriver(Protocol):
    """The driver calls this module makes: ``_Driver`` over libcuda, or a test's fake."""

    @property
    def has_batch(self) -> bool: ...
    def device_count(self) -> int: ...
    def use_device(self, device_id: int) -> None: ...
    def open(self, handle: bytes, device_id: int) -> OpenedHandle: ...
    def close(self, opened: OpenedHandle) -> None: ...
    def device_uuid(self, device_id: int) -> str: ...
    def create_stream(self) -> int: ...
    def memcpy_batch(self, args: BatchArgs, stream: int) -> None: ...
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    def record_event(self, stream: int) -> int: ...
    def event_done(self, event: int) -> bool: ...
    def destroy_event(self, event: int) -> None: ...
    def host_alloc(self, nbytes: int) -> int: ...
    def host_free(self, pointer: int) -> None: ...


_driver: CudaDriver | None = None
_driver_lock = threading.Lock()
_streams: dict[int, int] = {}  # device id -> this sidecar's copy stream on it (lives with the process)
_batch_refused = False  # the driver refused a batch once: per-run copies from then on


def _get_driver() -> CudaDriver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def set_driver_for_tests(driver: CudaDriver | None) -> None:
    """Install a fake driver (``tests/support/fake_cuda.FakeCudaDriver``); None goes back to the
    real one (opened again on first use)."""
    global _driver, _batch_refused
    with _driver_lock:
        _driver = driver
        _streams.clear()
        _batch_refused = False


def open_handle(handle: bytes, device_id: int, offset: int, length: int, field_name: str) -> OpenedHandle:
    """Open an exported handle and check that [offset, offset + length) lies inside its allocation.
    Raises InvalidArgument for a malformed export, FailedPrecondition where this node cannot open it."""
    if len(handle) != CUDA_IPC_HANDLE_BYTES:
        raise InvalidArgument(
            f"{field_name}.cuda_ipc_handle", f"must be {CUDA_IPC_HANDLE_BYTES} bytes, got {len(handle)}"
        )
    if length <= 0:
        raise InvalidArgument(f"{field_name}.length", "must be > 0")
    driver = _get_driver()
    count = driver.device_count()
    if count == 0:
        raise FailedPrecondition("VRAM exports need a CUDA GPU on the sidecar's node; none is visible here")
    if not 0 <= device_id < count:
        raise InvalidArgument(f"{field_name}.device_id", f"device {device_id} does not exist ({count} GPUs)")
    opened = driver.open(handle, device_id)
    if offset + length > opened.allocation_bytes:
        try:
            driver.close(opened)
        except FailedPrecondition:
            pass  # the range error is the one to report
        raise InvalidArgument(
            f"{field_name}.length",
            f"offset {offset} + length {length} exceeds the exported allocation ({opened.allocation_bytes} bytes)",
        )
    return opened


def make_current(device_id: int) -> None:
    """Make ``device_id``'s primary context current on the calling thread (the NIXL owner thread,
    before it registers GPU memory)."""
    _get_driver().use_device(device_id)


def close_handle(opened: OpenedHandle) -> None:
    """Close a handle opened by ``open_handle`` (the exporter's memory stays the exporter's)."""
    _get_driver().close(opened)


def device_uuid(device_id: int) -> str:
    """The UUID of the GPU this process numbers ``device_id`` (same in every process)."""
    return _get_driver().device_uuid(device_id)


def device_for_uuid(uuid: str) -> int | None:
    """This process's number for the GPU with ``uuid``, or None where it is not visible here."""
    driver = _get_driver()
    for device_id in range(driver.device_count()):
        if driver.device_uuid(device_id) == uuid:
            return device_id
    return None


# --- device copies ------------------------------------------------------------------------------


@dataclass(eq=False)
class PendingCopy:
    """A ``batch_copy`` in flight: the event recorded after its copies on the device's stream."""

    device_id: int
    event: int
    launches: int  # driver calls that enqueued the copies (1 with cuMemcpyBatchAsync)
    runs: int
    nbytes: int
    posted_at: float = field(default_factory=time.monotonic)
    _finished: bool = False
    _abandoned: bool = False  # waited for past its bound: never reported done

    def _finish(self, driver: CudaDriver) -> None:
        if not self._finished:
            self._finished = True
            driver.destroy_event(self.event)


def _stream(driver: CudaDriver, device_id: int) -> int:
    with _driver_lock:
        stream = _streams.get(device_id)
        if stream is None:
            stream = _streams[device_id] = driver.create_stream()
        return stream


def batch_copy(device_id: int, copies: Sequence[Copy] | np.ndarray) -> PendingCopy:
    """Enqueue ``copies`` (dst, src, nbytes) on this sidecar's stream of ``device_id``: ONE launch
    where the driver has ``cuMemcpyBatchAsync``, else one ``cuMemcpyAsync`` per coalesced run.
    Returns at once (pageable host memory aside, which the driver copies before returning);
    ``copy_done``/``wait_copy`` say when the bytes are there. Raises FailedPrecondition if the
    driver refuses to enqueue them."""
    global _batch_refused
    driver = _get_driver()
    runs = coalesce(copies)
    driver.use_device(device_id)
    stream = _stream(driver, device_id)
    launches = 0
    if len(runs) and driver.has_batch and not _batch_refused:
        try:
            driver.memcpy_batch(pack_batch(runs), stream)
            launches = 1
        except FailedPrecondition as exc:
            # E.g. a driver that takes the call but not these pointers. Whatever it enqueued
            # copies the same bytes again below (sources are not written meanwhile).
            log.warning("cuda_batch_copy_refused", error=str(exc), runs=len(runs))
            _batch_refused = True
    if len(runs) and not launches:
        for dst, src, nbytes in runs.tolist():
            driver.memcpy_async(dst, src, nbytes, stream)
        launches = len(runs)
    event = driver.record_event(stream)
    return PendingCopy(device_id, event, launches, len(runs), int(runs[:, 2].sum()))


def copy_done(pending: PendingCopy) -> bool:
    """Whether the copies are complete (non-blocking); raises FailedPrecondition if they failed."""
    if pending._abandoned:
        raise DeadlineExceeded(f"device copy on GPU {pending.device_id} was given up after its deadline")
    if pending._finished:
        return True
    driver = _get_driver()
    driver.use_device(pending.device_id)
    try:
        done = driver.event_done(pending.event)
    except FailedPrecondition:
        pending._finish(driver)
        raise
    if done:
        pending._finish(driver)
    return done


# Polling backoff of wait_copy: short first (a small copy ends in microseconds), never longer than
# this between queries (a 1 GiB device copy takes a few milliseconds).
_POLL_FIRST_S, _POLL_MAX_S = 20e-6, 250e-6


def wait_copy(pending: PendingCopy, timeout_s: float, *, abandon: bool = True) -> None:
    """Block the calling thread (never the event loop's) until the copies are complete, at most
    ``timeout_s``: raises DeadlineExceeded after it (the copy may still run), FailedPrecondition if
    they failed. Past the bound the event is dropped (the driver frees it once the device gets
    there) unless ``abandon`` is False: then the caller keeps it, polls ``copy_done`` until the
    copy is over (``device_copy.hold_late``: blocks a late copy writes are not handed back before)
    and calls ``abandon_copy`` if it stops polling first."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    pause = _POLL_FIRST_S
    while not copy_done(pending):
        now = time.monotonic()
        if now >= deadline:
            if abandon:
                abandon_copy(pending)
            raise DeadlineExceeded(
                f"device copy of {pending.nbytes} bytes ({pending.runs} runs) on GPU {pending.device_id} "
                f"not complete after {now - pending.posted_at:.3f} s"
            )
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, _POLL_MAX_S)


def abandon_copy(pending: PendingCopy) -> None:
    """Stop following a copy that is not done: its event is dropped (the driver frees it once the
    device gets there) and ``copy_done`` raises DeadlineExceeded from now on."""
    if not pending._finished:
        pending._abandoned = True
        pending._finish(_get_driver())


def host_alloc(nbytes: int) -> int:
    """Pinned host memory that every context may copy to and from (``cuMemHostAlloc``, portable;
    the call needs a current context, device 0's: portable memory serves every device's)."""
    driver = _get_driver()
    driver.use_device(0)
    return driver.host_alloc(nbytes)


def host_free(pointer: int) -> None:
    driver = _get_driver()
    driver.use_device(0)
    driver.host_free(pointer)
