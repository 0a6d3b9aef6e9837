"""Diagnostic, not shipped: gRPC Python keeps one channel-spin thread per channel, as a ``sitecustomize``.

What it shows. gRPC Python drives the calls a client makes with ``.future()`` (the SidecarConnector's
``SubmitBlocks``, ``ExpectPush``, ``Pull``, ``KeepAlive``) from a "channel spin" thread. When a call
is made on a channel with no other call in flight, ``grpc._channel`` starts a *new* thread and
``Thread.start()`` waits until that thread runs; the thread exits again when the channel's last call
completes. In a CPU vLLM engine on this 2-core box, both cores are busy while a P/D request is in
flight (each EngineCore steps every millisecond while a request waits for KV or pushed blocks wait
for their WRITE, and each pinned worker spins on its shared-memory queue), and vLLM's scheduler
thread was measured waiting 30-34 ms in ``request_finished`` (P's ``SubmitBlocks``) and up to ~390 ms
in ``update_state_after_alloc`` (D's ``ExpectPush``) for that new thread; the call's bytes only move
once it runs.

``bench/vllm_pd.py`` puts a copy of this file, named ``sitecustomize.py``, on the PYTHONPATH of the
``*-grpc-spin`` configurations' vLLM servers. When ``grpc._channel`` is first imported its
``_run_channel_spin_thread`` is replaced by one that starts the spin thread once per channel and keeps
it (idle, it blocks in gRPC's completion queue with the GIL released). The shim is unchanged: this
measures what a persistent sender thread in the shim would buy. It writes one
``kvbench-grpc-spin: patched`` line to stderr (the server's log), which the benchmark checks.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

_MODULE = "grpc._channel"


def _patch(module: types.ModuleType) -> None:
    cygrpc: Any = module.cygrpc

    def run_channel_spin_thread(state: Any) -> None:
        if getattr(state, "_kvbench_spinning", False):
            return
        state._kvbench_spinning = True

        def channel_spin() -> None:
            while True:
                cygrpc.block_if_fork_in_progress(state)
                event = state.channel.next_call_event()
                if event.completion_type == cygrpc.CompletionType.queue_timeout:
                    continue
                if event.tag(event):
                    with state.lock:
                        state.managed_calls -= 1  # the thread stays when it reaches 0

        thread = cygrpc.ForkManagedThread(target=channel_spin)
        thread.setDaemon(True)
        thread.start()

    module._run_channel_spin_thread = run_channel_spin_thread  # type: ignore[attr-defined]
    sys.stderr.write("kvbench-grpc-spin: patched grpc._channel (one persistent spin thread per channel)\n")
    sys.stderr.flush()


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader) -> None:
        self._real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._real.exec_module(module)
        _patch(module)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


if not any(isinstance(finder, _PatchingFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _PatchingFinder())
