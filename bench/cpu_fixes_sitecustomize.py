"""The two CPU fixes a user applies to vLLM's NIXL connectors, as a ``sitecustomize`` module.

``bench/vllm_pd.py`` copies this file as ``sitecustomize.py`` into a temporary directory that it puts
first on the ``PYTHONPATH`` of the "with CPU fixes" vLLM servers (every Python process of the server,
the API process and its EngineCore, imports it at start-up). Nothing in vLLM's or NIXL's installed
files is edited; the patches are applied when the patched modules are first imported:

1. ``nixl_cu12._api`` (vLLM reaches it as ``nixl._api``): ``nixl_agent.__init__`` hard-codes
   ``agent_config.pthrDelay = 0``, so the NIXL progress thread spins a whole core per agent. The
   module's ``nixlBind`` is wrapped so that every ``nixlAgent(name, config)`` it builds gets
   ``config.pthrDelay = KVBENCH_NIXL_PROGRESS_DELAY_US`` (default 1000 us = 1 ms) instead.
2. ``vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker``: ``NixlConnectorWorker``'s
   ``__init__`` calls ``os.sched_setaffinity(0, [last core of each NUMA node])`` on CPU, which moves
   the forward thread of *every* instance onto the same last core, overriding
   ``VLLM_CPU_OMP_THREADS_BIND``. The module's ``os`` is replaced by a proxy whose
   ``sched_setaffinity`` does nothing (and logs that it was skipped); every other ``os`` attribute is
   the real one, and no other module's ``os`` is touched.

3. Only with ``KVBENCH_ENGINE_BUSY_LOOP=<seconds>`` in the environment (a diagnostic, not a fix of
   vLLM's connectors): ``vllm.distributed.device_communicators.shm_broadcast`` gets the busy-loop
   cap that kvsidecar's shim applies to its engines (``engine_shim.vllm.engine_spin``), so a run
   can tell how much of a difference is the transport and how much the engines' spinning.

Each applied patch writes one ``kvbench-cpu-fix: ...`` line to stderr, which lands in the server's
log: the benchmark checks those lines to prove the fixes were active.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

_NIXL_MODULES = ("nixl_cu12._api", "nixl_cu13._api")
_WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_DELAY_US = int(os.environ.get("KVBENCH_NIXL_PROGRESS_DELAY_US", "1000"))


def _say(message: str) -> None:
    sys.stderr.write(f"kvbench-cpu-fix: {message} (pid {os.getpid()})\n")
    sys.stderr.flush()


class _DelayedBind:
    """``nixlBind`` with a progress-thread delay put into every agent configuration."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        if getattr(config, "useProgThread", False):
            config.pthrDelay = _DELAY_US
            _say(f"NIXL agent {name}: progress thread delay {_DELAY_US} us (shipped: 0)")
        return self._real.nixlAgent(name, config)


def _patch_nixl(module: types.ModuleType) -> None:
    module.nixlBind = _DelayedBind(module.nixlBind)  # type: ignore[attr-defined]
    _say(f"{module.__name__}: nixlBind wrapped")


class _OsWithoutRepinning(types.ModuleType):
    """The real ``os`` module, except that ``sched_setaffinity`` leaves the thread where it is."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def sched_setaffinity(pid: int, cpus: Sequence[int]) -> None:
        kept = sorted(os.sched_getaffinity(0))
        _say(f"skipped NIXL worker's os.sched_setaffinity({pid}, {sorted(cpus)}); kept {kept}")


def _patch_worker(module: types.ModuleType) -> None:
    module.os = _OsWithoutRepinning("os")  # type: ignore[attr-defined]
    _say(f"{module.__name__}: os.sched_setaffinity disabled")


def _patch_busy_loop(module: types.ModuleType) -> None:
    from engine_shim.vllm.engine_spin import cap_busy_loop

    limit = float(os.environ["KVBENCH_ENGINE_BUSY_LOOP"])
    if cap_busy_loop(limit):
        _say(f"{module.__name__}: engine busy loop capped at {limit} s")


_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {name: _patch_nixl for name in _NIXL_MODULES}
_PATCHES[_WORKER_MODULE] = _patch_worker
if os.environ.get("KVBENCH_ENGINE_BUSY_LOOP"):
    _PATCHES["vllm.distributed.device_communicators.shm_broadcast"] = _patch_busy_loop


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader, patch: Callable[[types.ModuleType], None]) -> None:
        self._real = real
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._real.exec_module(module)
        self._patch(module)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds the patched modules with the other finders and wraps their loaders."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


if not any(isinstance(finder, _PatchingFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _PatchingFinder())
