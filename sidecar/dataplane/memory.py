"""Mapping engine workers' exported KV memory into the sidecar's address space.

DRAM: a POSIX shared-memory file (``/dev/shm/...``) mapped read-write and shared. NIXL registers
the *sidecar's* mapping, and peers are told the sidecar's addresses.

Releasing a DRAM mapping does not unmap it: the range is replaced in place by an inaccessible
anonymous mapping (a tombstone). NIXL cannot revoke what a peer holding our old metadata may still
write (over CMA a peer writes straight into this process by address), so the address range must
never be handed to another mapping; a late write then fails with EFAULT instead of corrupting
whatever the kernel would have put there.

A worker's file whose export says ``owner_locked`` is removed after its worker is gone if its
creator no longer holds its lock (``kvsidecar.shm.remove_if_orphaned``): an engine killed
with SIGKILL cannot remove its own file.

Write fences (``WriteFences``): a consumer that gives up on a push while the producer's WRITEs
may still be in flight (the producer's sidecar hung, e.g. stopped) cannot cancel them: over CMA
the producer writes into this process by address whenever it resumes. So before the blocks go back
to the engine, the pages holding them are made read-only in *this* process's mapping
(``mprotect``); the engine keeps writing through its own mapping, while a late remote WRITE fails
(NIXL reports it as a disconnect). Pages are reference-counted (neighbouring blocks may share one)
and made writable again once the producer confirms nothing of it is in flight. A fenced page also
refuses our own READs and other producers' WRITEs (they fail and the engine recomputes), which is
the price of never letting a stale WRITE land. Over RDMA, pinned memory ignores page protection:
there the fence would have to deregister the memory (not built; no RDMA here).

VRAM: a CUDA IPC handle opened through the CUDA driver (``cuda_ipc``); NIXL registers the device
pointer it gives. Without a GPU it reports FAILED_PRECONDITION. The mapping keeps the engine's
handle, its offset and the GPU's UUID: a same-node peer sidecar is told them in the handshake and
opens the memory itself for a device copy (``device_copy``). The engine owns the memory: closing
our handle (release, or this process dying) frees none of it.

Called from the event loop thread; every call is short (mmap) or bounded (populate).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sidecar.dataplane import cuda_ipc
from sidecar.errors import FailedPrecondition, InvalidArgument, PermissionDenied

_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_MAP_POPULATE = 0x8000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def region_bytes(base: int, block_len: int, block_stride: int, num_blocks: int) -> np.ndarray:
    """A writable uint8 array over a DRAM region mapped here (no copy), from block 0 to the end of
    the last block. For the data plane's staging copies and integrity digests; the caller keeps
    the worker registered (a task spawned for its engine) while it uses the array."""
    length = (num_blocks - 1) * block_stride + block_len
    return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(base))


@dataclass(frozen=True)
class ExportSpec:
    """What a worker exported (validated request data)."""

    kind: str  # "DRAM" or "VRAM"
    shm_path: str
    cuda_ipc_handle: bytes
    offset: int
    length: int
    device_id: int
    owner_locked: bool = False  # see MemoryExport.owner_locked


@dataclass
class MappedMemory:
    """An export mapped here. ``address`` is where the exported range starts in this process."""

    kind: str
    address: int
    length: int
    device_id: int
    # The file to remove once the worker is gone, if its creator died without removing it.
    orphan_path: str = ""
    # VRAM: the engine's handle and the exported range's offset in its allocation, and the GPU's
    # UUID ("" if the driver could not say): what a same-node peer needs to open it too.
    ipc_handle: bytes = b""
    ipc_offset: int = 0
    gpu_uuid: str = ""
    _map_base: int = 0
    _map_length: int = 0
    _cuda: cuda_ipc.OpenedHandle | None = None
    _released: bool = field(default=False)

    def view(self) -> memoryview:
        """A writable view of the exported bytes (DRAM only; used by tests and the demo)."""
        if self.kind != "DRAM":
            raise ValueError("only DRAM mappings can be viewed from the CPU")
        buffer = (ctypes.c_uint8 * self.length).from_address(self.address)
        return memoryview(buffer).cast("B")


class MemoryImporter:
    """Maps exports; remembers tombstoned ranges for the life of the process."""

    def __init__(self, shm_dirs: list[Path], populate: bool = True) -> None:
        self._shm_dirs = [Path(os.path.realpath(directory)) for directory in shm_dirs]
        self._populate = populate
        self._lock = threading.Lock()
        self.tombstoned_bytes = 0

    def map(self, spec: ExportSpec, field_name: str, owner_uid: int | None = None) -> MappedMemory:
        """Map ``spec``; a DRAM file must belong to ``owner_uid`` unless it is None (the caller
        may map any: see ``api.engine_auth``, "Whose engine")."""
        if spec.kind == "DRAM":
            return self._map_shm(spec, field_name, owner_uid)
        if spec.kind == "VRAM":
            return _open_cuda_ipc(spec, field_name)
        raise InvalidArgument(f"{field_name}.kind", f"unsupported memory kind {spec.kind!r}")

    def release(self, memory: MappedMemory) -> None:
        if memory._released:
            return
        memory._released = True
        if memory.kind == "VRAM":
            _close_cuda_ipc(memory)
            return
        # Replace the shared mapping with an inaccessible one at the same address (see module doc).
        result = _libc.mmap(
            memory._map_base,
            memory._map_length,
            _PROT_NONE,
            mmap.MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE,
            -1,
            0,
        )
        if result in (None, _MAP_FAILED):
            # Could not tombstone; unmapping is the lesser evil compared to keeping the file alive.
            _libc.munmap(memory._map_base, memory._map_length)
        with self._lock:
            self.tombstoned_bytes += memory._map_length

    def _map_shm(self, spec: ExportSpec, field_name: str, owner_uid: int | None) -> MappedMemory:
        if not spec.shm_path:
            raise InvalidArgument(f"{field_name}.shm_path", "is required for DRAM exports")
        path = Path(spec.shm_path)
        if not path.is_absolute():
            raise InvalidArgument(f"{field_name}.shm_path", f"must be an absolute path, got {spec.shm_path!r}")
        real = Path(os.path.realpath(path))
        if not any(real.is_relative_to(directory) for directory in self._shm_dirs):
            allowed = ", ".join(str(directory) for directory in self._shm_dirs)
            raise InvalidArgument(
                f"{field_name}.shm_path", f"{spec.shm_path} is outside the allowed shm dirs ({allowed})"
            )
        try:
            fd = os.open(real, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise InvalidArgument(f"{field_name}.shm_path", f"{spec.shm_path} does not exist") from None
        except OSError as exc:
            raise InvalidArgument(f"{field_name}.shm_path", f"cannot open {spec.shm_path}: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidArgument(f"{field_name}.shm_path", f"{spec.shm_path} is not a regular file")
            if owner_uid is not None and info.st_uid != owner_uid:
                # The daemon (often root) opens what its caller may not: map only the caller's own files.
                raise PermissionDenied(
                    f"{field_name}.shm_path: {spec.shm_path} belongs to uid {info.st_uid}, not to the caller "
                    f"(uid {owner_uid}); an engine registers only shared memory it created"
                )
            if spec.length == 0:
                raise InvalidArgument(f"{field_name}.length", "must be > 0")
            if spec.owner_locked and _unlocked(fd):
                # The file is removed once its worker is gone if nobody holds its lock: a file its
                # owner never locked would be deleted from under a live owner.
                raise InvalidArgument(
                    f"{field_name}.owner_locked",
                    f"is set but no process holds a lock on {spec.shm_path}; lock it (flock) for its life "
                    "or leave owner_locked unset",
                )
            if spec.offset + spec.length > info.st_size:
                raise InvalidArgument(
                    f"{field_name}.length",
                    f"offset {spec.offset} + length {spec.length} exceeds the size of {spec.shm_path} ({info.st_size})",
                )
            page = mmap.PAGESIZE
            map_offset = spec.offset - spec.offset % page
            map_length = spec.offset + spec.length - map_offset
            flags = mmap.MAP_SHARED | (_MAP_POPULATE if self._populate else 0)
            base = _libc.mmap(None, map_length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, map_offset)
            if base in (None, _MAP_FAILED):
                errno = ctypes.get_errno()
                raise FailedPrecondition(f"mmap of {spec.shm_path} failed: {os.strerror(errno)}")
        finally:
            os.close(fd)
        return MappedMemory(
            kind="DRAM",
            address=base + (spec.offset - map_offset),
            length=spec.length,
            device_id=0,
            orphan_path=str(real) if spec.owner_locked else "",
            _map_base=base,
            _map_length=map_length,
        )


def _unlocked(fd: int) -> bool:
    """Whether no process holds a flock on the file: a non-blocking probe that we release at once."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


# --- VRAM over CUDA IPC -------------------------------------------------------------------------


def _open_cuda_ipc(spec: ExportSpec, field_name: str) -> MappedMemory:
    opened = cuda_ipc.open_handle(spec.cuda_ipc_handle, spec.device_id, spec.offset, spec.length, field_name)
    try:
        uuid = cuda_ipc.device_uuid(opened.device_id)
    except FailedPrecondition:
        uuid = ""  # peers then use NIXL for this worker
    return MappedMemory(
        kind="VRAM",
        address=opened.pointer + spec.offset,
        length=spec.length,
        device_id=opened.device_id,
        ipc_handle=spec.cuda_ipc_handle,
        ipc_offset=spec.offset,
        gpu_uuid=uuid,
        _cuda=opened,
    )


def _close_cuda_ipc(memory: MappedMemory) -> None:
    if memory._cuda is not None:
        try:
            cuda_ipc.close_handle(memory._cuda)
        except FailedPrecondition:
            pass  # the driver refused; the mapping goes with the process


# --- write fences -------------------------------------------------------------------------------

FenceToken = list[tuple[MappedMemory, int]]  # (mapping, page address) per fenced page


class WriteFences:
    """Makes pages of DRAM mappings read-only in this process while a stale remote WRITE may still
    land in them (see the module docstring). Called from the event loop thread."""

    def __init__(self) -> None:
        self._pages: dict[int, int] = {}  # page address -> number of fences holding it

    @property
    def fenced_pages(self) -> int:
        return len(self._pages)

    def revoke(self, memories: list[MappedMemory], ranges: list[tuple[int, int]]) -> FenceToken:
        """Fence the pages under ``ranges`` (addresses in our mappings); returns what to lift.
        Raises OSError if a page could not be protected (the caller must then not reuse it)."""
        page = mmap.PAGESIZE
        token: FenceToken = []
        wanted: set[int] = set()
        for address, length in ranges:
            first = address - address % page
            wanted.update(range(first, address + length, page))
        for start in sorted(wanted):
            memory = next(
                (m for m in memories if m.kind == "DRAM" and m._map_base <= start < m._map_base + m._map_length), None
            )
            if memory is None or memory._released:
                continue  # not ours to protect, or already a tombstone (which refuses every write)
            token.append((memory, start))
        to_protect = [start for _, start in token if start not in self._pages]
        for first, count in _runs(to_protect, page):
            if _libc.mprotect(first, count * page, mmap.PROT_READ) != 0:
                raise OSError(ctypes.get_errno(), f"mprotect: {os.strerror(ctypes.get_errno())}")
        for _, start in token:
            self._pages[start] = self._pages.get(start, 0) + 1
        return token

    def lift(self, token: FenceToken) -> None:
        """Make the pages writable again where no other fence holds them (tombstones stay)."""
        page = mmap.PAGESIZE
        to_open = []
        for memory, start in token:
            count = self._pages.get(start, 0) - 1
            if count > 0:
                self._pages[start] = count
                continue
            self._pages.pop(start, None)
            if not memory._released:
                to_open.append(start)
        for first, count in _runs(sorted(to_open), page):
            _libc.mprotect(first, count * page, mmap.PROT_READ | mmap.PROT_WRITE)


def _runs(pages: list[int], page: int) -> list[tuple[int, int]]:
    """Sorted page addresses -> (first page, number of pages) of each contiguous run."""
    runs: list[tuple[int, int]] = []
    for start in pages:
        if runs and runs[-1][0] + runs[-1][1] * page == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((start, 1))
    return runs
