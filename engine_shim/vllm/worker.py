"""The worker role: one TP/PP rank's KV registration and transfer completions (one instance per
rank, in vLLM's worker process).

It owns the rank's KV cache allocation hook and export (``engine_shim.vllm.kv_memory`` in DRAM,
``kv_cuda`` on a GPU), its description (``kv_layout``), its registration with the sidecar
(``RegisterWorker``) and its events (``EventWatcher``: a WatchEvents call on its client's
engine session stream, the only stream it holds; the WatchEvents RPC with an older sidecar).
vLLM's per-step calls
(``get_transfer_results``, ``get_block_ids_with_load_errors``) only read a local queue, except
that in a step where vLLM scheduled no token while transfers are outstanding,
``get_transfer_results`` waits on that queue for up to ``idle_wait`` (the engine loop would
otherwise step again and again and take the cores the sidecars need; the event is then applied in
that step). Anything reaching the EngineCore meanwhile ends the wait (``input_wake``). Each
request's call -> event seen -> step applied times go to the stats
(``vllm:kvsidecar_call_to_event_seconds`` and ``_event_to_step_seconds``).

Threads: vLLM's worker thread calls every method and owns all request state. The watcher's reader
thread (the session stream's, or the WatchEvents fallback's own) puts events on ``_inbox``; a
supervisor thread re-registers after the stream closes (a restarted sidecar) and announces it
through the same queue; the wake listener's thread puts ``_WAKE`` there when the EngineCore
received a request.

How failures reach vLLM: a request call the scheduler saw fail arrives in the step's metadata; the
worker puts the request in ``finished_recving`` *and* ``failed_recving`` (and its blocks in the
load-error set when block ids are unambiguous), so with ``kv_load_failure_policy="recompute"``
vLLM recomputes the prompt. A closed event stream fails every receive the worker waits for and
frees every block it was holding for a consumer, so vLLM never waits on a dead sidecar.
"""

from __future__ import annotations

import atexit
import collections
import os
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorTransferResults
from vllm.logger import init_logger

from engine_shim.client import EventWatcher, SidecarClient
from engine_shim.vllm.compat import (
    attention_backends,
    cache_dtype,
    compat_factors,
    data_parallel_rank,
    is_cpu,
    kv_layout_of,
    parallel_ranks,
    vllm_version,
)
from engine_shim.vllm.config import ROLES, ShimConfig
from engine_shim.vllm.input_wake import WakeListener, socket_name
from engine_shim.vllm.kv_cuda import CudaKvAllocation
from engine_shim.vllm.kv_layout import TOKEN_MAJOR, describe_caches
from engine_shim.vllm.kv_memory import ShmKvAllocation, export_storage, shm_allocation
from engine_shim.vllm.metadata import SidecarConnectorMetadata
from engine_shim.vllm.stats import SidecarKVConnectorStats
from kvsidecar.v1 import common_pb2, engine_pb2

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger("vllm.kvsidecar.worker")


@dataclass
class _StreamClosed:
    generation: int
    reason: str


@dataclass
class _Connected:
    generation: int
    sidecar_id: str


class _Wake:
    """Put on the inbox when the EngineCore received something (``input_wake``): ends an idle wait."""


_WAKE = _Wake()


@dataclass
class _PendingReceive:
    blocks: list[int]
    started: float
    issued: float  # time.monotonic() of the scheduler's Pull / ExpectPush call (same host clock)
    # Loaded inside this step (vLLM's synchronous load): the forward waits for it, and vLLM
    # expects no finished receive for it, only the block ids of a failed one.
    inline: bool = False


class WorkerSide:
    """One rank's registration and completions; request state is touched only by vLLM's worker
    thread (see module doc)."""

    # A receive's outcome can overtake the step that announces the receive (same step, or the
    # next): kept this long. A send is announced at the producer's *next* step, which may be much
    # later on an idle engine, so early send outcomes are kept until announced (bounded count).
    EARLY_RECV_TTL = 120.0
    MAX_EARLY_SENDS = 100_000

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: ShimConfig) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None and transfer.engine_id is not None
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.config = config
        self.engine_id: str = transfer.engine_id
        self.role = ROLES[transfer.kv_role or "kv_both"]
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = parallel_ranks(vllm_config)
        self._single_group = len(kv_cache_config.kv_cache_groups) == 1
        self.client = SidecarClient(config.sidecar_socket, timeout=config.rpc_timeout)
        # Events carry the time.monotonic() the watcher thread received them (the stage timings).
        self._inbox: queue.SimpleQueue[tuple[engine_pb2.Event, float] | _StreamClosed | _Connected | _Wake] = (
            queue.SimpleQueue()
        )
        # Ends an idle step's wait when a request reaches the EngineCore (input_wake); its thread
        # only puts on the inbox.
        self._wake_listener = WakeListener(
            socket_name(self.engine_id, data_parallel_rank(vllm_config), self.tp_rank, self.pp_rank),
            lambda: self._inbox.put(_WAKE),
        )
        self._allocation: ShmKvAllocation | CudaKvAllocation | None = None
        self._registration: engine_pb2.RegisterWorkerRequest | None = None
        self._watcher: EventWatcher | None = None
        self._watcher_lock = threading.Lock()
        self._generation = 0  # of the newest stream (supervisor thread)
        self._active_generation = -1  # of the stream the worker thread considers live
        self.connected = False
        self.sidecar_id = ""
        self.peer_address = ""
        self._need_connect = threading.Event()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        # Request state (vLLM worker thread only).
        self._receives: dict[str, _PendingReceive] = {}
        self._sends: dict[str, float] = {}  # request id -> time.monotonic() of its SubmitBlocks call
        self._early_recv: collections.OrderedDict[str, tuple[engine_pb2.Event, float]] = collections.OrderedDict()
        self._early_send: dict[str, tuple[engine_pb2.Event, float]] = {}
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._step_invalid: set[int] = set()
        self._next_housekeeping = 0.0
        self._step_idle = False  # this step computes nothing (SidecarConnectorMetadata.idle)
        self._last_loss = 0.0  # time.monotonic() of the last lost event stream
        # This interval's outcomes for vLLM's stat loggers (see engine_shim.vllm.stats).
        self.stats = SidecarKVConnectorStats()
        # Terminal outcomes per request (bounded), for tests, benchmarks and debugging.
        self.transfers: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()

    # memory export -----------------------------------------------------------------------------

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        """The KV allocation hook: a shared-memory file on the CPU (``kv_memory``), an exportable
        CUDA segment on a GPU (``kv_cuda``); None leaves vLLM's allocation alone ("torch_shm")."""
        if self.config.memory_export == "torch_shm":
            return None
        sizes = {tensor.size for tensor in self.kv_cache_config.kv_cache_tensors}
        if not sizes:
            return None
        if not is_cpu(self.vllm_config):
            self._allocation = CudaKvAllocation(sizes)
            return self._allocation
        rank = f"pp{self.pp_rank}-tp{self.tp_rank}"
        self._allocation = shm_allocation(Path(self.config.shm_dir), self.engine_id, rank, sizes)
        return self._allocation

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self._registration = self._build_registration(kv_caches)
        try:
            self._connect(self.config.register_timeout)
        except Exception as exc:
            logger.warning(
                "SidecarConnector: registration with %s failed (%s); retrying in the background",
                self.config.sidecar_socket,
                exc,
            )
            self._need_connect.set()
        self._supervisor = threading.Thread(target=self._supervise, name="kvsidecar-shim-supervisor", daemon=True)
        self._supervisor.start()
        if self.config.idle_wait > 0:
            self._wake_listener.start()
        atexit.register(self._close_shm)

    def _build_registration(self, kv_caches: Mapping[str, torch.Tensor]) -> engine_pb2.RegisterWorkerRequest:
        config = self.kv_cache_config
        model = self.vllm_config.model_config
        parallel = self.vllm_config.parallel_config
        num_kv_heads = model.get_num_kv_heads(parallel)
        is_mla = bool(model.use_mla)
        backend = attention_backends(self.vllm_config)
        transfer_groups = list(config.transfer_group_ids)
        group_of: dict[str, int] = {}
        for index, group_id in enumerate(transfer_groups):
            for name in config.kv_cache_groups[group_id].layer_names:
                group_of[name] = index
        described = describe_caches(
            kv_caches,
            group_of,
            lambda storage: export_storage(storage, self._allocation, self.config.memory_export),
            logical_blocks=max(1, config.num_blocks),
            num_kv_heads=num_kv_heads,
            is_mla=is_mla,
            backend=backend,
        )
        num_blocks = described.num_blocks
        logical = max(1, config.num_blocks)
        return engine_pb2.RegisterWorkerRequest(
            engine_id=self.engine_id,
            role=self.role,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            geometry=common_pb2.KvGeometry(
                block_size=self.vllm_config.cache_config.block_size,
                physical_blocks_per_logical=max(1, num_blocks // logical),
                kv_layout=self._layout_name(described.kind),
                num_blocks=num_blocks,
                num_kv_heads=num_kv_heads,
                total_num_kv_heads=model.get_total_num_kv_heads(),
                is_mla=is_mla,
                head_size=int(model.get_head_size()),
                dtype=cache_dtype(self.vllm_config),
            ),
            exports=described.exports,
            regions=described.regions,
            compat_factors=compat_factors(self.vllm_config),
            engine_version=f"vllm {vllm_version()}",
            pid=os.getpid(),
        )

    def _layout_name(self, kind: str | None) -> str:
        """The geometry's layout name: vLLM's CPU layout by its ISA on the CPU (head-major blocks
        only); on a GPU what the strides showed (``kv_layout``: HND or NHD), or vLLM's own name for
        an opaque block-contiguous cache."""
        if is_cpu(self.vllm_config):
            if kind == TOKEN_MAJOR:
                raise NotImplementedError(
                    "SidecarConnector: vLLM's CPU KV cache is token-major (LBNHC); its CPU attention reads "
                    "head-major blocks only, which the sidecar's CPU layout assumes"
                )
            return kv_layout_of(self.vllm_config, self.kv_cache_config)
        return kind or kv_layout_of(self.vllm_config, self.kv_cache_config)

    # connection (init thread, then the supervisor thread) ---------------------------------------

    def _connect(self, timeout: float) -> None:
        registration = self._registration
        assert registration is not None
        if not Path(self.config.sidecar_socket).exists():
            raise ConnectionError(f"no sidecar socket at {self.config.sidecar_socket}")  # fail fast, retry later
        self.client.wait_ready(timeout)
        response = self.client.register_worker(registration)
        with self._watcher_lock:
            self._generation += 1
            generation = self._generation
            old, self._watcher = self._watcher, None
        if old is not None:
            old.cancel()
        watcher = EventWatcher(
            self.client,
            self.engine_id,
            self.tp_rank,
            self.pp_rank,
            on_closed=lambda reason: self._on_closed(generation, reason),
            on_event=self._event_arrived,
        )
        try:
            watcher.wait_connected(timeout)
        except BaseException:
            watcher.cancel()
            raise
        with self._watcher_lock:
            self._watcher = watcher
        self.peer_address = response.peer_address
        self._inbox.put(_Connected(generation, watcher.sidecar_id))
        logger.info(
            "SidecarConnector: worker %s registered with sidecar %s (%s, %d bytes)",
            response.worker_id,
            watcher.sidecar_id[:8],
            response.peer_address,
            response.registered_bytes,
        )

    def _event_arrived(self, event: engine_pb2.Event) -> None:  # watcher thread
        self._inbox.put((event, time.monotonic()))

    def _on_closed(self, generation: int, reason: str) -> None:  # watcher thread
        if self._stopping.is_set():
            return
        self._inbox.put(_StreamClosed(generation, reason))
        with self._watcher_lock:
            current = generation == self._generation
        if current:
            logger.warning("SidecarConnector: event stream closed (%s); registering again", reason)
            self._need_connect.set()

    def _supervise(self) -> None:
        backoff = 0.2
        while not self._stopping.is_set():
            if not self._need_connect.wait(timeout=1.0):
                continue
            if self._stopping.is_set():
                return
            # Cleared before connecting: a stream that closes right after it opened sets it again.
            self._need_connect.clear()
            try:
                self._connect(self.config.register_timeout)
            except Exception as exc:
                logger.debug("SidecarConnector: registering again failed: %s", exc)
                self._need_connect.set()
                self._stopping.wait(backoff)
                # At most 1 s: a restarted sidecar serves within about a second (tests/daemon/test_restart.py),
                # and every second unregistered is a second of recomputed prompts.
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.2

    # per step (vLLM worker thread) --------------------------------------------------------------

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if not isinstance(meta, SidecarConnectorMetadata):
            return
        self._step_idle = meta.idle
        if meta.recv_started or meta.send_started:
            self._drain()  # so that an already-arrived event resolves the request right away
        now = time.monotonic()
        # A request call made before this worker's event stream was last lost went to a sidecar
        # registration that no longer exists: no outcome will come for it.
        for request_id, (issued, blocks) in meta.recv_started.items():
            self._receives[request_id] = _PendingReceive(blocks, now, issued, request_id in meta.recv_inline)
            early = self._early_recv.pop(request_id, None)
            if early is not None:
                self._on_event(*early)
            elif not self.connected or issued < self._last_loss:
                self._fail_receive(request_id, "the sidecar's event stream was lost")
        for request_id, issued in meta.send_started.items():
            self._sends[request_id] = issued
            sent = self._early_send.pop(request_id, None)
            if sent is not None:
                self._on_event(*sent)
            elif not self.connected or issued < self._last_loss:
                self._finish_send(request_id, "the sidecar's event stream was lost")
        for request_id, reason in meta.recv_failed.items():
            self._fail_receive(request_id, reason)
        for request_id, reason in meta.send_abandoned.items():
            self._finish_send(request_id, reason)
        if meta.recv_inline:
            self._load_inline(meta.recv_inline)

    def _load_inline(self, bounds: Mapping[str, float]) -> None:
        """Wait until this step's inline loads ended, each within its bound (``recv_watchdog``: the
        sidecar ends the Pull by its own, short bound; see Receiver._await_inline_call),
        applying every event that arrives meanwhile. A load that ended without its KV, or not in
        time, leaves its blocks invalid: vLLM discards the step's output for the request and
        recomputes the prompt from the first invalid block."""
        started = time.monotonic()
        for request_id, bound in bounds.items():
            while request_id in self._receives:
                remaining = started + bound - time.monotonic()
                if remaining <= 0:
                    self._fail_receive(request_id, f"no outcome from the sidecar within {bound:g}s")
                    break
                try:
                    item = self._inbox.get(timeout=remaining)
                except queue.Empty:
                    continue
                self._apply(item)

    def poll(self) -> None:
        """Apply what the event stream delivered so far (vLLM's worker thread only; results are
        kept for the next ``get_transfer_results``)."""
        self._drain()

    def get_transfer_results(self) -> KVConnectorTransferResults:
        self._drain()
        if self._step_idle:
            self._step_idle = False
            self._wait_for_event()
        if self._receives or self._early_recv:
            now = time.monotonic()
            if now >= self._next_housekeeping:
                self._housekeeping(now)
        results = KVConnectorTransferResults()
        if self._done_sending:
            results.finished_sending, self._done_sending = self._done_sending, set()
        if self._done_recving:
            results.finished_recving, self._done_recving = self._done_recving, set()
        if self._failed_recving:
            results.failed_recving, self._failed_recving = self._failed_recving, set()
        if self._invalid_blocks:
            self._step_invalid, self._invalid_blocks = self._invalid_blocks, set()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self._step_invalid:
            return set()
        invalid, self._step_invalid = self._step_invalid, set()
        return invalid

    def _wait_for_event(self) -> None:
        """In a step that computes nothing, with transfers outstanding and no outcome to report yet:
        block on the inbox for up to ``idle_wait`` instead of returning to vLLM's engine loop, which
        would step again after 1 ms, spinning its shared-memory queues between steps. Frees the
        cores for the sidecars on a small box and applies the event in this step instead of the
        next. A request, abort or shutdown reaching the EngineCore ends the wait at once
        (``input_wake``); without that wake-up (an in-process engine, an unbindable name) it waits
        at most ``idle_wait`` more."""
        if self.config.idle_wait <= 0 or not (self._receives or self._sends):
            return
        if self._done_recving or self._done_sending or self._failed_recving:
            return
        try:
            item = self._inbox.get(timeout=self.config.idle_wait)
        except queue.Empty:
            return
        self._apply(item)
        self._drain()

    def _drain(self) -> None:
        inbox = self._inbox
        while True:
            try:
                item = inbox.get_nowait()
            except queue.Empty:
                return
            self._apply(item)

    def _apply(self, item: tuple[engine_pb2.Event, float] | _StreamClosed | _Connected | _Wake) -> None:
        if isinstance(item, tuple):
            self._on_event(*item)
        elif isinstance(item, _Wake):
            return
        elif isinstance(item, _Connected):
            self._active_generation = item.generation
            self.connected = True
            self.sidecar_id = item.sidecar_id
        elif item.generation == self._active_generation:
            self.connected = False
            self._stream_lost(item.reason)

    def _on_event(self, event: engine_pb2.Event, seen: float) -> None:
        """Apply an event the watcher received at ``seen`` (time.monotonic())."""
        request_id = event.request_id
        kind = event.kind
        if kind in (engine_pb2.FINISHED_RECEIVING, engine_pb2.LOAD_FAILED):
            pending = self._receives.get(request_id)
            if pending is None:
                self._early_recv[request_id] = (event, seen)
                if len(self._early_recv) > 10_000:
                    self._early_recv.popitem(last=False)
                return
            self._time_stages(pending.issued, seen)
            if kind == engine_pb2.FINISHED_RECEIVING:
                del self._receives[request_id]
                if not pending.inline:
                    self._done_recving.add(request_id)
                self._record(request_id, event, "received", inline=pending.inline)
            else:
                self._fail_receive(request_id, event.reason, list(event.failed_block_ids), event)
        elif kind in (engine_pb2.FINISHED_SENDING, engine_pb2.LEASE_EXPIRED):
            issued = self._sends.pop(request_id, None)
            if issued is None:
                self._early_send[request_id] = (event, seen)
                if len(self._early_send) > self.MAX_EARLY_SENDS:
                    self._early_send.pop(next(iter(self._early_send)))
                return
            self._time_stages(issued, seen)
            self._done_sending.add(request_id)
            self._record(request_id, event, "sent" if kind == engine_pb2.FINISHED_SENDING else "lease_expired")

    def _time_stages(self, issued: float, seen: float) -> None:
        """The engine's part of the request timeline: its call -> the event reached this worker,
        and the event reached this worker -> the vLLM step that applies it (now)."""
        self.stats.record_stages(seen - issued, time.monotonic() - seen)

    def _fail_receive(
        self,
        request_id: str,
        reason: str,
        failed: list[int] | None = None,
        event: engine_pb2.Event | None = None,
    ) -> None:
        pending = self._receives.pop(request_id, None)
        if pending is None:
            return
        if not pending.inline:
            self._done_recving.add(request_id)
            self._failed_recving.add(request_id)
        if self._single_group:  # always, for an inline load (Receiver._loads_inline)
            # Block ids are unambiguous only with one KV cache group (vLLM refuses them otherwise).
            self._invalid_blocks.update(failed or pending.blocks)
        self._record(request_id, event, "load_failed", reason, inline=pending.inline)
        logger.warning("SidecarConnector: loading KV for %s failed (%s); vLLM recomputes it", request_id, reason)

    def _finish_send(self, request_id: str, reason: str) -> None:
        if self._sends.pop(request_id, None) is not None:
            self._done_sending.add(request_id)
            self._record(request_id, None, "send_abandoned", reason)

    def _stream_lost(self, reason: str) -> None:
        # The sidecar dropped this worker (or died): nothing it was doing for us continues, so every
        # receive fails and every held block is free.
        self._last_loss = time.monotonic()
        for request_id in list(self._receives):
            self._fail_receive(request_id, f"event stream closed: {reason}")
        for request_id in list(self._sends):
            self._finish_send(request_id, f"event stream closed: {reason}")

    def _housekeeping(self, now: float) -> None:
        self._next_housekeeping = now + 1.0
        limit = self.config.recv_watchdog
        for request_id, pending in list(self._receives.items()):
            if now - pending.started > limit:
                logger.error("SidecarConnector: no outcome for %s after %.0fs", request_id, limit)
                self._fail_receive(request_id, f"no outcome from the sidecar within {limit:g}s")
        while self._early_recv:
            request_id, (_, seen) = next(iter(self._early_recv.items()))
            if now - seen < self.EARLY_RECV_TTL:
                break
            del self._early_recv[request_id]

    def _record(
        self, request_id: str, event: engine_pb2.Event | None, outcome: str, reason: str = "", inline: bool = False
    ) -> None:
        nbytes = event.bytes if event is not None else 0
        duration_ms = event.duration_ms if event is not None else 0.0
        self.stats.record(outcome, nbytes, duration_ms)
        self.transfers[request_id] = {
            "outcome": outcome,
            "bytes": nbytes,
            "duration_ms": duration_ms,
            "reason": reason or (event.reason if event is not None else ""),
            "inline": inline,  # loaded inside the step that computed the first token
        }
        while len(self.transfers) > 4096:
            self.transfers.popitem(last=False)

    # shutdown ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self._stopping.set()
        self._need_connect.set()
        self._wake_listener.close()
        with self._watcher_lock:
            watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
        if self._registration is not None:
            try:
                self.client.stub.UnregisterWorker(
                    engine_pb2.UnregisterWorkerRequest(
                        engine_id=self.engine_id, tp_rank=self.tp_rank, pp_rank=self.pp_rank
                    ),
                    timeout=2.0,
                )
            except grpc.RpcError:
                pass  # gone already, or it drops us when the stream closes
        if self._supervisor is not None:
            self._supervisor.join(timeout=5.0)
        self.client.close()
        self._close_shm()

    def shm_paths(self) -> list[Path]:
        """The KV file this worker exported, if it made one (tests and debugging)."""
        allocation = self._allocation
        if isinstance(allocation, ShmKvAllocation) and allocation.buffer is not None:
            return [allocation.path]
        return []

    def _close_shm(self) -> None:
        # Removes the file's name; vLLM's tensors keep the mapping for as long as they live. (A CUDA
        # KV cache is vLLM's tensor: it goes with the engine.)
        allocation = self._allocation
        if isinstance(allocation, ShmKvAllocation) and allocation.buffer is not None:
            allocation.buffer.close()
