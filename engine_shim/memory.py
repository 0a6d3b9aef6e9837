"""Exporting an engine worker's KV memory to the sidecar through POSIX shared memory.

``SharedBuffer`` creates a named tmpfs file under ``/dev/shm`` and maps it: the worker uses the
mapping as its KV cache (vLLM's CPU KV buffer, or a GPU engine's host staging buffer), and the
sidecar maps the same file by name. No header, no refcounting: the file holds exactly the KV bytes.

Ownership: the creating process holds an exclusive ``flock`` on the file for the buffer's life
and unlinks it on close. A process that dies without closing (SIGKILL, OOM) drops the lock with
it, which is how the sidecar tells an orphaned file from a live one and removes it
(``remove_if_orphaned``). The file is created nameless (``O_TMPFILE``), locked,
and only then linked under its name, so no one ever sees it named and unlocked.

``kv_registration`` describes the common vLLM layout (one storage, one region per layer, each a
slab of ``num_blocks`` blocks) as a RegisterWorkerRequest.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsidecar.v1 import common_pb2, engine_pb2

SHM_DIR = Path("/dev/shm")


class SharedBuffer:
    """A named shared-memory file mapped read-write in this process, locked while it lives."""

    def __init__(self, size: int, name: str | None = None, directory: Path = SHM_DIR, populate: bool = False) -> None:
        if size <= 0:
            raise ValueError("size must be > 0")
        self.size = size
        self.path = directory / (name or f"kvsidecar-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            # Without O_EXCL: a nameless file may be linked once, below.
            self._fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot create a shared-memory file in {directory}: {exc.strerror}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(self._fd, size)  # tmpfs: reads as zeros
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mmap = mmap.mmap(self._fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            _link(self._fd, self.path)
        except BaseException:
            os.close(self._fd)
            raise
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    def export(self, offset: int = 0, length: int | None = None) -> engine_pb2.MemoryExport:
        return engine_pb2.MemoryExport(
            kind=common_pb2.MEMORY_KIND_DRAM,
            shm_path=str(self.path),
            offset=offset,
            length=self.size - offset if length is None else length,
            owner_locked=True,
        )

    def close(self) -> None:
        """Remove the file's name and drop this process's mapping (the memory goes when the
        sidecar unmaps it too). Views of ``array`` must not be used afterwards."""
        if self._fd < 0:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)  # releases the lock after the name is gone
        self._fd = -1
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # numpy or torch views still alive; the mapping goes with them

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _link(fd: int, path: Path) -> None:
    """Give the nameless file ``fd`` the name ``path``: linkat(AT_SYMLINK_FOLLOW) on its /proc
    magic link. os.link uses linkat only when a dir_fd is given; plain link() would link the
    symlink itself."""
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=directory, follow_symlinks=True)
    finally:
        os.close(directory)


def remove_if_orphaned(path: Path) -> bool:
    """Remove ``path`` if it is a ``SharedBuffer`` file whose creator died without closing it:
    the creator's lock is gone, so this process can take it. True if it removed the file.

    Only for files made by ``SharedBuffer`` (or another owner that keeps the same lock): any other
    file is never locked and would look orphaned."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # gone already, or not ours to open
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its creator is alive
        try:
            if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                return False  # the name now belongs to another file
            os.unlink(path)
        except OSError:
            return False  # gone meanwhile, or a directory we may not remove names from
        return True
    finally:
        os.close(fd)


@dataclass(frozen=True)
class KvLayout:
    """Layer-major KV: ``num_layers`` regions, each ``num_blocks`` blocks of ``block_len`` bytes."""

    num_layers: int
    num_blocks: int
    block_len: int
    block_size: int = 16
    kv_layout: str = "LBHNC"
    num_kv_heads: int = 1
    total_num_kv_heads: int = 1
    physical_blocks_per_logical: int = 1
    head_size: int = 0
    dtype: str = ""

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.block_len

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def block_slice(self, layer: int, block: int) -> slice:
        start = layer * self.layer_bytes + block * self.block_len
        return slice(start, start + self.block_len)


def kv_registration(
    engine_id: str,
    role: int,
    layout: KvLayout,
    exports: Sequence[engine_pb2.MemoryExport],
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    compat_factors: Mapping[str, str] | None = None,
    layer_names: Sequence[str] | None = None,
    engine_version: str = "",
) -> engine_pb2.RegisterWorkerRequest:
    """A RegisterWorkerRequest for ``layout`` inside ``exports[0]`` (layer after layer)."""
    names = list(layer_names) if layer_names is not None else [f"layers.{i}" for i in range(layout.num_layers)]
    return engine_pb2.RegisterWorkerRequest(
        engine_id=engine_id,
        role=role,  # type: ignore[arg-type]
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        geometry=common_pb2.KvGeometry(
            block_size=layout.block_size,
            physical_blocks_per_logical=layout.physical_blocks_per_logical,
            kv_layout=layout.kv_layout,
            num_blocks=layout.num_blocks,
            num_kv_heads=layout.num_kv_heads,
            total_num_kv_heads=layout.total_num_kv_heads,
            head_size=layout.head_size,
            dtype=layout.dtype,
        ),
        exports=list(exports),
        regions=[
            engine_pb2.KvRegion(
                name=names[layer],
                export_index=0,
                offset=layer * layout.layer_bytes,
                block_len=layout.block_len,
                block_stride=layout.block_len,
                group_id=0,
            )
            for layer in range(layout.num_layers)
        ],
        compat_factors=dict(compat_factors or {"model": "simulated"}),
        engine_version=engine_version,
        pid=os.getpid(),
    )
