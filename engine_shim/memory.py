"""Exporting an engine worker's KV memory to the sidecar through POSIX shared memory.

``SharedBuffer`` creates a named tmpfs file under ``/dev/shm`` and maps it: the worker uses the
mapping as its KV cache (vLLM's CPU KV buffer, or a GPU engine's host staging buffer), and the
sidecar maps the same file by name. No header, no refcounting: the file holds exactly the KV bytes.

Ownership follows the shared-memory contract (``kvsidecar.shm``): the creating process holds an
exclusive ``flock`` on the file for the buffer's life and unlinks it on close, so a file whose
creator died is an orphan the sidecar removes when it sees the engine die, and the next buffer
made with the default name removes once it is a minute old (a demo or benchmark killed with its
sidecars would otherwise keep its memory until reboot).

``kv_registration`` describes the common vLLM layout (one storage, one region per layer, each a
slab of ``num_blocks`` blocks) as a RegisterWorkerRequest.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsidecar.shm import SHM_DIR, SIMULATED_PREFIX, create_locked, remove_orphans
from kvsidecar.v1 import common_pb2, engine_pb2

log = logging.getLogger(__name__)

# How long a default-named file must be unchanged before the next buffer takes it for an orphan:
# until then it is left to the sidecar that watched its engine die (which counts the removal).
ORPHAN_AGE_S = 60.0


class SharedBuffer:
    """A named shared-memory file mapped read-write in this process, locked while it lives."""

    def __init__(self, size: int, name: str | None = None, directory: Path = SHM_DIR, populate: bool = False) -> None:
        if size <= 0:
            raise ValueError("size must be > 0")
        self.size = size
        if name is None:
            for orphan in remove_orphans(directory, SIMULATED_PREFIX, ORPHAN_AGE_S):
                log.warning("removed %s, left behind by a process that was killed", orphan)
            name = f"{SIMULATED_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = directory / name
        self._fd = create_locked(directory, self.path.name, size)  # tmpfs: reads as zeros
        try:
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mmap = mmap.mmap(self._fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self.path.unlink(missing_ok=True)
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

    def upload(self) -> None:
        """Nothing to do: the sidecar maps these very pages (``CudaBuffer`` copies to its device)."""

    def download(self) -> None:
        """Nothing to do: ``array`` is the memory itself."""

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
