"""Holds a sidecar's device copies on a real GPU, for the chaos matrix's GPU fault cells
(``tests/chaos/gpu_cells.py``); a sidecar gets it by having this folder first on ``PYTHONPATH``.
Never imported by the daemon otherwise.

Once the file named by ``KVSIDECAR_TEST_GPU_ARM`` exists, the next ``KVSIDECAR_TEST_GPU_HOLD_BATCHES``
(default 1) device copies this sidecar enqueues wait *on the device* behind a
``cuStreamWaitValue32`` on a pinned host word that nothing writes: the copy is really enqueued on
the sidecar's own stream and really does not run (the device waits, as it would behind a hung
kernel or a stuck copy engine). The word is written, and the copies run, when the file named by
``KVSIDECAR_TEST_GPU_RELEASE`` appears, or ``KVSIDECAR_TEST_GPU_HOLD_SECONDS`` after the hold
(a slow copy); never otherwise (a copy that never completes). Where the driver refuses stream
memory operations (or, ``on_device=False``, where there is no device: ``tests/unit/test_gpu_hold.py`` on
``FakeCudaDriver``), the hold falls back to hiding the copy's completion (its event reads "not
ready" until released) and says so on stderr: the sidecar's bound is exercised either way, the
device is not.

It wraps the real driver of ``sidecar.dataplane.cuda_ipc`` with ``set_driver_for_tests`` (the same
seam ``FakeCudaDriver`` uses), delegating every call; only the copy calls gain the wait.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from typing import Any

_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ
_HOST_DEVICEMAP = 0x02 | 0x01  # CU_MEMHOSTALLOC_DEVICEMAP | PORTABLE


def _say(message: str) -> None:
    print(f"gpu_hold: {message}", file=sys.stderr, flush=True)


class HoldingDriver:
    """The real CUDA driver, with held copies (see the module docstring)."""

    def __init__(
        self, make_real: Any, arm: str, release: str, batches: int, seconds: float, on_device: bool = True
    ) -> None:
        self._make_real = make_real
        self._on_device = on_device  # False: only the fallback (a fake driver has no device to wait)
        self._real: Any = None
        self._arm, self._release = arm, release
        self._left = batches
        self._seconds = seconds
        self._lock = threading.Lock()
        self._words: list[int] = []  # pinned host words the held streams wait on (0: holding)
        self._hidden: set[int] = set()  # fallback: events whose completion is hidden while held
        self._hide_next: set[int] = set()  # streams whose next recorded event is hidden
        self._released = threading.Event()
        self._lib: Any = None

    def _driver(self) -> Any:
        if self._real is None:
            self._real = self._make_real()
            try:
                self._lib = ctypes.CDLL("libcuda.so.1") if self._on_device else None
            except OSError:  # no driver library: only the fallback can hold
                self._lib = None
        return self._real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver(), name)

    @property
    def has_batch(self) -> bool:
        return bool(self._driver().has_batch)

    def _take_hold(self) -> bool:
        with self._lock:
            if self._left <= 0 or not os.path.exists(self._arm):
                return False
            self._left -= 1
        threading.Thread(target=self._releaser, daemon=True).start()
        return True

    def _releaser(self) -> None:
        deadline = time.monotonic() + self._seconds if self._seconds > 0 else float("inf")
        while time.monotonic() < deadline and not (self._release and os.path.exists(self._release)):
            time.sleep(0.01)
        with self._lock:
            for word in self._words:
                ctypes.c_uint32.from_address(word).value = 1
            self._hidden.clear()
            self._released.set()
        _say("released")

    def _hold(self, stream: int) -> None:
        """Enqueue a wait on a fresh pinned word before the copies (the context is current)."""
        lib = self._lib
        if lib is None:
            with self._lock:
                self._hide_next.add(stream)
            _say("no device to wait on: hiding the copy's completion instead")
            return
        word = ctypes.c_void_p()
        device_word = ctypes.c_uint64()
        alloc = lib.cuMemHostAlloc
        alloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        status = alloc(ctypes.byref(word), 4, _HOST_DEVICEMAP)
        if status == 0:
            ctypes.c_uint32.from_address(word.value or 0).value = 0
            get = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or lib.cuMemHostGetDevicePointer
            get.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
            status = get(ctypes.byref(device_word), word, 0)
        if status == 0:
            wait = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
            wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            status = wait(ctypes.c_void_p(stream), device_word.value, 1, _WAIT_GEQ)
        with self._lock:
            if status == 0:
                self._words.append(word.value or 0)
                _say(f"device copy held on the device (stream wait), CUDA status {status}")
                return
            self._hide_next.add(stream)
        _say(f"stream memory operations refused (CUDA error {status}): hiding the copy's completion instead")

    def memcpy_batch(self, args: Any, stream: int) -> None:
        if self._take_hold():
            self._hold(stream)
        self._driver().memcpy_batch(args, stream)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        # One hold per batch_copy: the first run's call takes it, the rest queue behind it anyway.
        if self._take_hold():
            self._hold(stream)
        self._driver().memcpy_async(dst, src, nbytes, stream)

    def record_event(self, stream: int) -> int:
        event = int(self._driver().record_event(stream))
        with self._lock:
            if stream in self._hide_next:
                self._hide_next.discard(stream)
                if not self._released.is_set():
                    self._hidden.add(event)
        return event

    def event_done(self, event: int) -> bool:
        with self._lock:
            if event in self._hidden:
                return False
        return bool(self._driver().event_done(event))


def _install() -> None:
    arm = os.environ.get("KVSIDECAR_TEST_GPU_ARM", "")
    if not arm:
        return
    try:
        from sidecar.dataplane import cuda_ipc

        driver = HoldingDriver(
            cuda_ipc._Driver,
            arm,
            os.environ.get("KVSIDECAR_TEST_GPU_RELEASE", ""),
            int(os.environ.get("KVSIDECAR_TEST_GPU_HOLD_BATCHES", "1")),
            float(os.environ.get("KVSIDECAR_TEST_GPU_HOLD_SECONDS", "0")),
        )
        cuda_ipc.set_driver_for_tests(driver)  # type: ignore[arg-type]
        _say(f"installed (armed by {arm})")
    except Exception as exc:  # the cell sees "not installed" in the log and says so
        _say(f"not installed: {exc!r}")


_install()
