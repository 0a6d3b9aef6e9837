"""The worker's KV memory on a GPU: vLLM's KV cache allocated so that CUDA IPC can export it.

vLLM 0.32 allocates a worker's whole KV cache as one ``torch.zeros(n, dtype=int8, device=cuda)``
(``vllm/v1/worker/utils.py: allocate_kv_cache``) inside the connector's ``get_mem_pool_context()``
and views it per layer. ``CudaKvAllocation`` is that context: a ``TorchFunctionMode`` that turns
exactly that call (``n`` one of the sizes ``kv_cache_config`` announces, int8, a CUDA device) into
the same ``torch.zeros`` inside a private ``torch.cuda.MemPool`` with PyTorch's expandable segments
off, and lets every other call pass. So:

- the KV cache is one plain ``cudaMalloc`` segment of its own, which ``cudaIpcGetMemHandle`` can
  export (``engine_shim.cuda_memory.export_cuda_storage``). An expandable segment
  (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) is VMM memory that legacy CUDA IPC cannot
  export, and a block of the shared pool may sit in one: that is why the pool is private and the
  setting is turned off around this one allocation (and restored, the whole configuration string,
  as vLLM's ``CuMemAllocator`` does, because PyTorch resets every option a new string omits);
- vLLM's memory accounting is unchanged: the bytes still come from PyTorch's caching allocator, at
  the moment and in the size vLLM asked for, so ``torch.cuda.memory_reserved()``,
  ``memory_allocated()`` and ``cudaMemGetInfo`` count them exactly as vLLM's profiling expects (the
  segment is rounded up to PyTorch's 2 MiB granule, as any large allocation is);
- returning a context replaces vLLM's sleep-mode pool for the KV cache (``CuMemAllocator``: VMM
  memory, not exportable either): with ``enable_sleep_mode`` the KV cache stays resident while the
  engine sleeps.

If the hook did not see the allocation (another vLLM, ``memory_export="torch_shm"``), the worker
exports the storage PyTorch gave anyway; that works unless it sits in an expandable segment, which
the export refuses saying so. Imports no vLLM (the GPU harness runs where vLLM is not installed).

Runs on vLLM's worker thread, during ``initialize_kv_cache``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# (size, device) -> (the zeroed int8 tensor, what must stay alive as long as it: its pool)
Allocator = Callable[[int, torch.device], tuple[torch.Tensor, Any]]

EXPANDABLE = "expandable_segments"
_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


class CudaKvAllocation(TorchFunctionMode):
    """Turns vLLM's one KV allocation on a GPU into an exportable one (see the module doc); every
    other call passes. ``allocate`` is ``zeros_in_private_pool`` except in tests without a GPU."""

    def __init__(self, sizes: set[int], allocate: Allocator | None = None) -> None:
        super().__init__()
        self.sizes = sizes
        self._allocate = allocate or zeros_in_private_pool
        self.data_ptr: int | None = None  # of the KV cache's storage, once allocated
        self.nbytes = 0
        self.device: torch.device | None = None
        self._keep: Any = None  # the private pool: freed memory returns to it, so it lives as long

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and self.data_ptr is None:
            size = single_size(args, kwargs)
            device = kwargs.get("device")
            if size in self.sizes and kwargs.get("dtype") == torch.int8 and device is not None:
                device = torch.device(device)
                if device.type == "cuda":
                    tensor, self._keep = self._allocate(size, device)
                    self.data_ptr = tensor.untyped_storage().data_ptr()
                    self.nbytes, self.device = size, device
                    return tensor
        return func(*args, **kwargs)

    def holds(self, storage: Any) -> bool:
        """True if ``storage`` is the KV cache this hook allocated."""
        return self.data_ptr is not None and storage.data_ptr() == self.data_ptr


def single_size(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int | None:
    """The size of a one-dimensional ``torch.zeros``/``empty`` call, else None."""
    value = args[0] if args else kwargs.get("size")
    if isinstance(value, int):
        return value
    if isinstance(value, (tuple, list, torch.Size)) and len(value) == 1 and isinstance(value[0], int):
        return int(value[0])
    return None


def zeros_in_private_pool(size: int, device: torch.device) -> tuple[torch.Tensor, Any]:
    """``size`` zeroed bytes on ``device`` in a fresh private pool, expandable segments off: a
    ``cudaMalloc`` segment of its own. Returns the tensor and the pool (keep it alive)."""
    pool = torch.cuda.MemPool()
    with expandable_segments_off(), torch.cuda.use_mem_pool(pool, device=device):
        tensor = torch.zeros(size, dtype=torch.int8, device=device)
    return tensor, pool


@contextlib.contextmanager
def expandable_segments_off() -> Iterator[None]:
    """PyTorch's allocator with ``expandable_segments`` off for the block, the rest of its
    configuration kept; restored after."""
    conf = allocator_conf()
    if not conf_flag(conf, EXPANDABLE):
        yield
        return
    _set_allocator_conf(with_conf_flag(conf, EXPANDABLE, False))
    try:
        yield
    finally:
        _set_allocator_conf(conf)


def allocator_conf() -> str:
    """The allocator configuration in effect: the live one where PyTorch tells it, else the
    environment's."""
    try:
        settings = torch.cuda.memory._snapshot().get("allocator_settings") or {}
        for name in _CONF_VARIABLES:
            if settings.get(name):
                return str(settings[name])
    except Exception:  # no CUDA, or a PyTorch without allocator settings in its snapshot
        pass
    return next((os.environ[name] for name in _CONF_VARIABLES if os.environ.get(name)), "")


def conf_flag(conf: str, key: str) -> bool:
    for field in conf.split(","):
        name, _, value = field.partition(":")
        if name.strip() == key:
            return value.strip().lower() in ("true", "1")
    return False


def with_conf_flag(conf: str, key: str, enabled: bool) -> str:
    """``conf`` with only ``key`` set to ``enabled``, every other field verbatim (pure)."""
    wanted = f"{key}:{'True' if enabled else 'False'}"
    fields = [field.strip() for field in conf.split(",") if field.strip()]
    for index, field in enumerate(fields):
        if field.partition(":")[0].strip() == key:
            fields[index] = wanted
            return ",".join(fields)
    return ",".join([*fields, wanted])


def _set_allocator_conf(conf: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(conf)
    else:
        torch.cuda.memory._set_allocator_settings(conf)
