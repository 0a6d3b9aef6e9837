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
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

from kvsidecar.cuda_ipc import CUDA_IPC_HANDLE_BYTES
from sidecar.errors import FailedPrecondition, InvalidArgument
from sidecar.logs import get_logger

log = get_logger("kvsidecar.cuda_ipc")

_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_POINTER_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
_LIBRARY = "libcuda.so.1"


class _IpcHandle(ctypes.Structure):
    # CUipcMemHandle (= cudaIpcMemHandle_t) is a struct passed *by value*: a bare ctypes array
    # argument would pass a pointer to it instead. Bytes, not c_char: ctypes copies a bytes value
    # into a c_char array field only up to its first NUL, and handles are full of zeros.
    _fields_ = [("reserved", ctypes.c_ubyte * CUDA_IPC_HANDLE_BYTES)]


def handle_struct(handle: bytes) -> _IpcHandle:
    """The handle as the by-value struct the driver takes, every byte copied (pure)."""
    return _IpcHandle.from_buffer_copy(handle)


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


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def _get_driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


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
