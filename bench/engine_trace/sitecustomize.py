"""Diagnostics: a per-step timeline of vLLM engines, for ``bench/vllm_pd.py``.

Put this directory first on the vLLM servers' ``PYTHONPATH`` with
``KVBENCH_SERVER_PYTHONPATH=bench/engine_trace`` and name a file in ``KVBENCH_TRACE``: every
Python process of both servers (API server, EngineCore, workers) then appends wall-clock lines
``<unix time> <pid> <what>`` to that file, next to the client's leg times that ``bench/vllm_pd.py``
writes there. ``python -m bench.engine_timeline FILE`` turns them into per-request phases.

Logged: EngineCore ``add_request`` and every ``step`` that ran the model, produced outputs or took
over 2 ms; a worker's ``execute_model`` that had tokens; the kvsidecar shim's
``update_state_after_alloc``, ``request_finished``, request calls (issued, answered), events
reaching the worker and transfer results; vLLM's NIXL connectors' transfer results. Modules are
patched when first imported (an import hook), so nothing is imported early; a ``sitecustomize``
later on the path (the bench's CPU fixes) still runs. Diagnostics only: the lines cost tens of
microseconds each, and the bench's figures come from runs without it.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import runpy
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_PATH = os.environ.get("KVBENCH_TRACE")
_WRITE = threading.Lock()
_FINDING = threading.local()


def log(line: str) -> None:
    if _PATH:
        with _WRITE, open(_PATH, "a") as out:
            out.write(f"{time.time():.6f} {os.getpid()} {line}\n")


def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(make(original)))


def _announce(describe: Callable[..., str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper that logs ``describe(*arguments)`` and then calls the original."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            log(describe(*args))
            return original(self, *args, **kwargs)

        return traced

    return make


def _engine_core(module: Any) -> None:
    def step(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.time()
            result = original(self, *args, **kwargs)
            took = time.time() - started
            outputs, executed = result if isinstance(result, tuple) else ({}, None)
            count = sum(len(o.outputs) for o in (outputs or {}).values())
            if executed or count or took > 0.002:
                log(f"core step start={started:.6f} dur_ms={took * 1e3:.2f} executed={executed} outputs={count}")
            return result

        return traced

    _wrap(module.EngineCore, "step", step)
    _wrap(module.EngineCore, "add_request", _announce(lambda request, *_: f"core add {request.request_id}"))


def _worker(module: Any) -> None:
    def execute(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.time()
            result = original(self, scheduler_output, *args, **kwargs)
            tokens = getattr(scheduler_output, "total_num_scheduled_tokens", -1)
            if tokens:
                log(f"worker execute start={started:.6f} dur_ms={(time.time() - started) * 1e3:.2f} tokens={tokens}")
            return result

        return traced

    _wrap(module.Worker, "execute_model", execute)


def _results(label: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            if result.finished_recving or result.finished_sending:
                received, sent = sorted(result.finished_recving or ()), sorted(result.finished_sending or ())
                log(f"{label} results recv={received} send={sent}")
            return result

        return traced

    return make


def _shim_scheduler(module: Any) -> None:
    def finished(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, request, *args, **kwargs)
            log(f"shim request_finished {request.request_id}")
            return result

        return traced

    _wrap(
        module.SchedulerSide,
        "update_state_after_alloc",
        _announce(lambda request, _blocks, external, *_: f"shim alloc {request.request_id} n={external}"),
    )
    _wrap(module.SchedulerSide, "request_finished", finished)


def _shim_worker(module: Any) -> None:
    _wrap(
        module.WorkerSide,
        "_event_arrived",
        _announce(lambda event, *_: f"shim event kind={event.kind} {event.request_id}"),
    )
    _wrap(module.WorkerSide, "get_transfer_results", _results("shim"))


def _shim_client(module: Any) -> None:
    def call(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
                started = time.time()
                future = original(self, *args, **kwargs)
                future.add_done_callback(
                    lambda _: log(f"client {name} answered after {(time.time() - started) * 1e3:.2f} ms")
                )
                log(f"client {name} issued {args[1] if len(args) > 1 else ''}")
                return future

            return traced

        return make

    for name in ("pull_async", "expect_push_async", "submit_blocks_async"):
        _wrap(module.SidecarClient, name, call(name))


def _nixl_worker(module: Any) -> None:
    _wrap(module.NixlBaseConnectorWorker, "get_transfer_results", _results("nixl"))


_PATCHES: dict[str, Callable[[Any], None]] = {
    "vllm.v1.engine.core": _engine_core,
    "vllm.v1.worker.gpu_worker": _worker,
    "engine_shim.vllm.scheduler": _shim_scheduler,
    "engine_shim.vllm.worker": _shim_worker,
    "engine_shim.client": _shim_client,
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker": _nixl_worker,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _PATCHES or getattr(_FINDING, "active", False):
            return None
        _FINDING.active = True  # other hooks (the CPU fixes) ask the finders again: not us
        try:
            spec = next(
                (
                    found
                    for finder in sys.meta_path
                    if finder is not self and hasattr(finder, "find_spec")
                    for found in [finder.find_spec(fullname, path, target)]
                    if found is not None
                ),
                None,
            )
        finally:
            _FINDING.active = False
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            try:
                _PATCHES[fullname](module)
            except Exception as error:  # a vLLM without the hooked names: say so, run untraced
                log(f"trace patch of {fullname} failed: {error!r}")

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _run_next_sitecustomize() -> None:
    """This module shadows any later ``sitecustomize`` (the bench's CPU fixes): run that one too."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if entry and os.path.abspath(entry) != here and os.path.isfile(os.path.join(entry, "sitecustomize.py")):
            runpy.run_path(os.path.join(entry, "sitecustomize.py"), run_name="sitecustomize_chained")
            return


if _PATH:
    sys.meta_path.insert(0, _PatchOnImport())
_run_next_sitecustomize()
