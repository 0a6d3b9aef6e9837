"""Exporting an engine worker's KV memory in GPU memory to the sidecar, through CUDA IPC.

``export_cuda_tensor`` (a tensor) and ``export_cuda_storage`` (a whole storage: the vLLM shim's KV
cache) are what a GPU engine's shim does with its KV cache: they ask PyTorch for the IPC handle of
the allocation that holds it (PyTorch's caching allocator hands out ranges of larger segments, so
the export carries the offset inside the allocation) and describe it as a ``MemoryExport`` of kind
VRAM. The sidecar opens the handle in its own process
(``sidecar/dataplane/cuda_ipc.py``) and registers the device pointer with NIXL; the engine keeps
its tensor alive for as long as the worker is registered.

``CudaBuffer`` is the simulated engines' GPU KV buffer (``engine_shim.simulated --memory cuda``):
a device tensor plus a host mirror (``array``) that the simulated engine fills and checks with
numpy, moved to and from the device with ``upload`` / ``download``. Needs a CUDA build of PyTorch
and a GPU; without one, constructing it raises ``RuntimeError`` saying so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvsidecar.cuda_ipc import CUDA_IPC_HANDLE_BYTES
from kvsidecar.v1 import common_pb2, engine_pb2


def cuda_available() -> str | None:
    """None where a GPU can hold simulated KV here, else why not (for skips and errors)."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible to PyTorch {torch.__version__} here"
    return None


def export_cuda_tensor(tensor: Any) -> engine_pb2.MemoryExport:
    """A VRAM ``MemoryExport`` of a contiguous CUDA tensor's bytes."""
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError("only a contiguous CUDA tensor can be exported")
    element = tensor.element_size()
    return export_cuda_storage(tensor.untyped_storage(), tensor.storage_offset() * element, tensor.numel() * element)


def export_cuda_storage(storage: Any, offset: int = 0, length: int | None = None) -> engine_pb2.MemoryExport:
    """A VRAM ``MemoryExport`` of ``length`` bytes (default: to its end) from ``offset`` in a CUDA
    storage (e.g. a vLLM worker's whole KV cache, ``engine_shim.vllm.kv_cuda``). The handle names the
    allocator's segment that holds the storage; the export's offset adds the storage's place in it."""
    shared = storage._share_cuda_()
    device, handle, _storage_bytes, storage_offset = shared[0], shared[1], shared[2], shared[3]
    return engine_pb2.MemoryExport(
        kind=common_pb2.MEMORY_KIND_VRAM,
        cuda_ipc_handle=ipc_handle(bytes(handle)),
        offset=int(storage_offset) + offset,
        length=storage.nbytes() - offset if length is None else length,
        device_id=int(device),
    )


def ipc_handle(shareable: bytes) -> bytes:
    """The ``cudaIpcMemHandle_t`` inside PyTorch's shareable handle (pure). PyTorch >= 2.x writes a
    version byte and a type byte before it (``c10/cuda/CUDACachingAllocator.cpp``: ``'c'`` for a
    plain ``cudaMalloc`` segment, ``'e'`` for an expandable segment, which CUDA IPC cannot open);
    older releases gave the bare 64 bytes."""
    if len(shareable) == CUDA_IPC_HANDLE_BYTES:
        return shareable
    if len(shareable) == CUDA_IPC_HANDLE_BYTES + 2 and shareable[1] == ord("c"):
        return shareable[2:]
    if len(shareable) > 1 and shareable[1] == ord("e"):
        raise RuntimeError(
            "the KV cache sits in an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), "
            "which CUDA IPC cannot export; turn expandable segments off for the KV cache's allocation"
        )
    raise RuntimeError(f"PyTorch gave a CUDA IPC handle of {len(shareable)} bytes in a format not known here")


class CudaBuffer:
    """``size`` bytes of zeroed GPU memory with a host mirror (see the module docstring)."""

    def __init__(self, size: int, device: int = 0) -> None:
        problem = cuda_available()
        if problem is not None:
            raise RuntimeError(f"a CUDA KV buffer needs a GPU: {problem}")
        import torch

        if size <= 0:
            raise ValueError("size must be > 0")
        self.size = size
        self.device = device
        self._torch = torch
        self.tensor = torch.zeros(size, dtype=torch.uint8, device=f"cuda:{device}")
        torch.cuda.synchronize(device)
        self.array = np.zeros(size, dtype=np.uint8)

    def export(self) -> engine_pb2.MemoryExport:
        return export_cuda_tensor(self.tensor)

    def upload(self) -> None:
        """Device <- host mirror; returns once the device holds it."""
        self.tensor.copy_(self._torch.from_numpy(self.array))
        self._torch.cuda.synchronize(self.device)

    def download(self) -> None:
        """Host mirror <- device (what NIXL wrote there)."""
        self._torch.cuda.synchronize(self.device)
        self._torch.from_numpy(self.array).copy_(self.tensor)

    def close(self) -> None:
        self.tensor = self._torch.empty(0, dtype=self._torch.uint8)
        self.array = np.empty(0, dtype=np.uint8)

    def __enter__(self) -> CudaBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
