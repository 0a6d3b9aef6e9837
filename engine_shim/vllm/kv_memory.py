"""The worker's KV memory: vLLM's KV cache placed in (or moved to) a shared-memory file the sidecar maps.

vLLM allocates the whole KV cache as one ``torch.zeros(n, int8)`` and views it per layer. Two ways
to share it with the sidecar were verified (reference ``vllm_on_cpu.md`` section 2):

1. ``get_mem_pool_context()`` returns a ``TorchFunctionMode`` (``ShmKvAllocation``) that turns
   exactly that allocation into a tensor over a ``SharedBuffer`` (``engine_shim.memory``): a
   ``/dev/shm`` file this module creates.
2. ``register_kv_caches`` calls ``untyped_storage()._share_filename_cpu_()``, which copies the
   storage into a torch-managed shm file with a 64-byte refcount header.

The default ("auto") is method 1, with method 2 as the fallback when the hook did not see the
allocation (a future vLLM that allocates differently). Method 1 is the robust one: the file holds
exactly the KV bytes (no header whose size depends on the torch version), it is named and owned
by this module (0600, locked while the engine lives, unlinked at shutdown; a killed engine's file
is removed by its sidecar or by the next engine that starts), nothing is copied at start-up, and
it does not depend on torch's shm manager process or sharing strategy. Its one dependency on
vLLM internals (a single int8 ``torch.zeros`` of the size ``kv_cache_config`` announces) fails
safe: if it does not match, method 2 takes over. ``kv_connector_extra_config.memory_export``
("auto" | "mem_pool" | "torch_shm") forces one of them.

On a GPU the KV cache stays in VRAM and is exported over CUDA IPC: ``engine_shim.vllm.kv_cuda``
has the allocation hook (method 1's counterpart), and ``export_storage`` exports a CUDA storage
through ``engine_shim.cuda_memory.export_cuda_storage`` (whether or not the hook made it; "mem_pool"
insists that it did, "torch_shm" leaves vLLM's allocation alone).

Runs on vLLM's worker thread (allocation during model set-up, export during ``register_kv_caches``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from vllm.logger import init_logger

from engine_shim.cuda_memory import export_cuda_storage
from engine_shim.memory import SharedBuffer
from engine_shim.vllm.config import SHM_DIR
from engine_shim.vllm.kv_cuda import CudaKvAllocation, single_size
from kvsidecar.shm import VLLM_PREFIX, remove_orphans
from kvsidecar.v1 import common_pb2, engine_pb2

logger = init_logger("vllm.kvsidecar.kv_memory")

SHM_PREFIX = VLLM_PREFIX  # see kvsidecar.shm: not the simulated engines' prefix


class ShmKvAllocation(TorchFunctionMode):
    """Turns vLLM's one KV allocation (``torch.zeros(n, dtype=int8)`` with ``n`` announced by
    ``kv_cache_config``) into a tensor over a ``SharedBuffer``; every other call passes."""

    def __init__(self, sizes: set[int], path: Path) -> None:
        super().__init__()
        self.sizes = sizes
        self.path = path
        self.buffer: SharedBuffer | None = None
        self.data_ptr = 0

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and not self.data_ptr:
            size = single_size(args, kwargs)
            device = kwargs.get("device")
            on_cpu = device is None or torch.device(device).type == "cpu"
            if size in self.sizes and kwargs.get("dtype") == torch.int8 and on_cpu:
                try:
                    return self._allocate(size)
                except OSError as exc:  # e.g. shm_dir on a filesystem without O_TMPFILE
                    logger.warning("SidecarConnector: cannot put the KV cache in %s (%s)", self.path.parent, exc)
        return func(*args, **kwargs)

    def _allocate(self, size: int) -> torch.Tensor:
        self.buffer = SharedBuffer(size, name=self.path.name, directory=self.path.parent)  # zeros, like torch.zeros
        tensor = torch.from_numpy(self.buffer.array).view(torch.int8)
        self.data_ptr = tensor.untyped_storage().data_ptr()
        logger.info("SidecarConnector: KV cache (%d bytes) allocated in shared memory %s", size, self.path)
        return tensor

    def holds(self, storage: torch.UntypedStorage) -> bool:
        """True if ``storage`` is the KV cache this hook allocated."""
        return self.buffer is not None and bool(self.data_ptr) and self.data_ptr == storage.data_ptr()


def shm_allocation(directory: Path, engine_id: str, rank: str, sizes: set[int]) -> ShmKvAllocation:
    """The allocation hook for one worker, after removing the KV files of killed engines."""
    for orphan in remove_orphans(directory, SHM_PREFIX):
        logger.warning("SidecarConnector: removed %s, left behind by an engine that was killed", orphan)
    name = f"{SHM_PREFIX}{engine_id}-{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return ShmKvAllocation(sizes, directory / name)


def export_storage(
    storage: torch.UntypedStorage, allocation: ShmKvAllocation | CudaKvAllocation | None, memory_export: str
) -> engine_pb2.MemoryExport:
    """The export of one KV storage: over CUDA IPC on a GPU; on the CPU the hook's file when it made
    this storage, else (method 2) a torch shm file the storage is moved into."""
    nbytes = storage.nbytes()
    made = allocation is not None and allocation.holds(storage)
    if memory_export == "mem_pool" and not made:
        raise RuntimeError(
            "SidecarConnector: memory_export='mem_pool' but vLLM did not allocate the KV cache through "
            "get_mem_pool_context(); use memory_export='auto' to fall back to "
            + ("the allocation vLLM made" if storage.device.type == "cuda" else "torch shared memory")
        )
    if storage.device.type == "cuda":
        if not made:
            logger.info("SidecarConnector: exporting the KV cache's CUDA allocation as vLLM made it")
        return export_cuda_storage(storage)
    if isinstance(allocation, ShmKvAllocation) and made and allocation.buffer is not None:
        return allocation.buffer.export(0, nbytes)
    if storage.device.type != "cpu":
        raise NotImplementedError(
            f"SidecarConnector exports KV caches in DRAM or CUDA memory; this one lives on {storage.device}"
        )
    # Fallback: move the storage into a torch-managed shm file (copies it once) and export the
    # bytes after the file's refcount header.
    _, name, _ = storage._share_filename_cpu_()
    path = SHM_DIR / (name.decode() if isinstance(name, bytes) else str(name)).lstrip("/")
    header = path.stat().st_size - nbytes
    if not 0 <= header < 4096:
        raise RuntimeError(f"SidecarConnector: unexpected layout of torch shm file {path}")
    logger.info("SidecarConnector: KV cache shared through torch shm file %s (header %d bytes)", path, header)
    return engine_pb2.MemoryExport(kind=common_pb2.MEMORY_KIND_DRAM, shm_path=str(path), offset=header, length=nbytes)
