"""The node: everything one sidecar knows and does, independent of gRPC.

It owns the registry of local engines and workers (with their mapped memory and NIXL agents), the
producer and consumer sides, the peer directory, the cache index of held blocks, and the NIXL
transport. The EngineService and PeerService servicers are thin adapters over its methods; tests
drive it directly.

Threads: everything here runs on the event loop thread. The transport's owner thread hands
notifications back through ``_on_notifications`` (scheduled on the loop) and never touches this
object's state.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import grpc

from engine_shim.memory import remove_if_orphaned
from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar import PROTOCOL_VERSION, __version__, validation
from sidecar.cache_index import CacheIndex, HeldBlocks
from sidecar.config import Settings
from sidecar.consumer import ConsumerSide
from sidecar.dataplane import DataPlane, EngineView
from sidecar.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from sidecar.logs import get_logger
from sidecar.memory import MappedMemory, MemoryImporter
from sidecar.metrics import SidecarMetrics
from sidecar.peers import PeerDirectory
from sidecar.planning import RegionLayout, WorkerLayout
from sidecar.producer import ProducerRequest, ProducerSide
from sidecar.registry import Engine, Registry, Worker, worker_id
from sidecar.transport import NixlTransport, TransferResult

log = get_logger("kvsidecar.node")

# After serving a handshake, poll NIXL this long so the caller's agents can connect to ours.
_HANDSHAKE_WARM_SECONDS = 5.0


class _StreamClosed:
    """Queued to a worker's event queue to end its WatchEvents stream."""

    def __init__(self, reason: str, exhausted: bool = False) -> None:
        self.reason = reason
        self.exhausted = exhausted


class Node:
    def __init__(self, settings: Settings, metrics: SidecarMetrics | None = None) -> None:
        self.settings = settings
        self.sidecar_id = uuid.uuid4().hex
        self.transport = NixlTransport(settings.nixl, self._on_notifications, self._on_xfer_done)
        self.metrics = metrics or SidecarMetrics(self.transport.nixl_version)
        self.memory = MemoryImporter(settings.shm_dirs, settings.nixl.populate_mappings)
        self.registry = Registry()
        self.cache = CacheIndex()
        self.peers = PeerDirectory(settings, self, self.sidecar_info, self._unload_peer_agents, self.metrics)
        self.dataplane = DataPlane(self.transport, self.sidecar_id)
        self.producer = ProducerSide(self)
        self.consumer = ConsumerSide(self)
        self.advertise_address = settings.advertise or settings.peer_listen
        self.started = time.monotonic()
        self.draining = False
        self._agent_counter = itertools.count()
        self._tasks: dict[asyncio.Task[Any], tuple[str, ...]] = {}

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self, advertise_address: str, bound_addresses: list[str]) -> None:
        self.advertise_address = advertise_address
        self.peers.set_self_addresses([advertise_address, *bound_addresses])
        self.transport.start(asyncio.get_running_loop())
        self.consumer.start()
        log.info(
            "node_started", sidecar_id=self.sidecar_id, advertise=advertise_address, nixl=self.transport.nixl_version
        )

    async def drain(self, grace: float) -> None:
        """Refuse new work and give running requests up to ``grace`` seconds to finish, including
        blocks our producers computed that consumers have yet to pull or register for: a prefill
        engine's rolling restart then costs its decoders no recompute."""
        self.draining = True
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (
            self._tasks or self.consumer.requests or self.producer.awaiting_consumers()
        ):
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Fail what is left, release every NIXL object and mapping, close every stream."""
        self.draining = True
        await self.consumer.stop()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        # Stop NIXL and revoke memory *before* telling engines their blocks are free: a peer may
        # still be reading them, and only a destroyed agent and a tombstoned mapping stop it.
        await self.transport.stop()
        for worker in self.registry.workers:
            for memory in worker.memories:
                self.memory.release(memory)
        self.consumer.fail_all("the sidecar is shutting down")
        self.producer.finish_all("the sidecar is shutting down")
        for worker in self.registry.workers:
            worker.events.put_nowait(_StreamClosed("the sidecar is shutting down"))  # type: ignore[arg-type]
        self.producer.leases.close()
        await self.peers.close()

    def spawn(self, coroutine: Coroutine[Any, Any, Any], engines: list[str]) -> asyncio.Task[Any]:
        """Run a request's work in the background, remembering which engines it touches."""
        task = asyncio.ensure_future(coroutine)
        self._tasks[task] = tuple(engines)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("background_task_failed", error=repr(task.exception()))

    def check_capacity(self, current: int) -> None:
        if self.draining:
            raise Unavailable("the sidecar is draining for shutdown")
        if current >= self.settings.max_pending_requests:
            raise ResourceExhausted(
                f"{current} requests are pending, the limit is {self.settings.max_pending_requests}"
            )

    def sidecar_info(self) -> common_pb2.SidecarInfo:
        return common_pb2.SidecarInfo(
            sidecar_id=self.sidecar_id,
            address=self.advertise_address,
            versions=common_pb2.VersionInfo(
                kvsidecar=__version__,
                nixl=self.transport.nixl_version,
                vllm=self._engine_versions(),
                grpc=grpc.__version__,
                protocol=PROTOCOL_VERSION,
            ),
            clock_unix_s=time.time(),
            hostname=socket.gethostname(),
        )

    def _engine_versions(self) -> str:
        return ", ".join(
            sorted({engine.engine_version for engine in self.registry.engines.values() if engine.engine_version})
        )

    # --- registration -------------------------------------------------------------------------

    async def register_worker(self, request: engine_pb2.RegisterWorkerRequest) -> engine_pb2.RegisterWorkerResponse:
        if self.draining:
            raise Unavailable("the sidecar is draining for shutdown")
        spec = validation.register_worker(request)
        if spec.tp_size * spec.pp_size > self.settings.max_workers_per_engine:
            # An engine's workers are its TP x PP ranks: this bounds them before any is mapped.
            raise ResourceExhausted(
                f"tp_size x pp_size: {spec.tp_size} x {spec.pp_size} workers, the limit is "
                f"max_workers_per_engine={self.settings.max_workers_per_engine}"
            )
        existing = self.registry.worker(spec.engine_id, spec.tp_rank, spec.pp_rank)
        if existing is not None:
            if existing.fingerprint == spec.fingerprint:
                return self._registered(existing)
            await self.remove_worker(existing, "re-registered with new content")
        engine = self.registry.engines.get(spec.engine_id)
        if engine is not None:
            mismatch = (
                ("role", engine.role, spec.role),
                ("tp_size", engine.tp_size, spec.tp_size),
                ("pp_size", engine.pp_size, spec.pp_size),
                ("compat_factors", engine.compatibility_hash, spec.compatibility_hash),
            )
            for name, theirs, mine in mismatch:
                if theirs != mine:
                    raise FailedPrecondition(
                        f"{name}: engine {spec.engine_id!r} already has workers registered with a different {name}; "
                        "unregister them first"
                    )
        else:
            if len(self.registry.engines) >= self.settings.max_engines:
                raise ResourceExhausted(
                    f"engine_id: {len(self.registry.engines)} engines are registered, the limit is "
                    f"max_engines={self.settings.max_engines}"
                )
            engine = Engine(
                spec.engine_id, spec.role, spec.tp_size, spec.pp_size, spec.compatibility_hash, spec.engine_version
            )
        memories: list[MappedMemory] = []
        try:
            for index, export in enumerate(spec.exports):
                memories.append(self.memory.map(export, f"exports[{index}]"))
            regions = tuple(
                RegionLayout(
                    region.name,
                    memories[region.export_index].address + region.offset,
                    region.block_len,
                    region.block_stride,
                    region.group_id,
                )
                for region in spec.regions
            )
            geometry = spec.geometry
            layout = WorkerLayout(
                tp_rank=spec.tp_rank,
                pp_rank=spec.pp_rank,
                regions=regions,
                num_blocks=geometry.num_blocks,
                physical_per_logical=geometry.physical_blocks_per_logical or 1,
                block_size=geometry.block_size,
                kv_layout=geometry.kv_layout,
                num_kv_heads=geometry.num_kv_heads,
                total_num_kv_heads=geometry.total_num_kv_heads,
                is_mla=geometry.is_mla,
                device_id=memories[0].device_id,
            )
            mem_type = memories[0].kind
            serial = next(self._agent_counter)
            agent_name = f"kvs-{self.sidecar_id[:8]}-{serial}-{spec.engine_id}-pp{spec.pp_rank}-tp{spec.tp_rank}"
            metadata = await self.transport.create_agent(
                agent_name, [(memory.address, memory.length, memory.device_id) for memory in memories], mem_type
            )
        except BaseException:
            for memory in memories:
                self.memory.release(memory)
            raise
        worker = Worker(
            engine_id=spec.engine_id,
            tp_rank=spec.tp_rank,
            pp_rank=spec.pp_rank,
            agent_name=agent_name,
            agent_metadata=metadata,
            layout=layout,
            geometry=geometry,
            memories=memories,
            mem_type=mem_type,
            registered_bytes=sum(memory.length for memory in memories),
            pid=spec.pid,
            fingerprint=spec.fingerprint,
            events=asyncio.Queue(),
        )
        self.registry.add(engine, worker)
        worker.attach_timer = asyncio.get_running_loop().call_later(
            self.settings.worker_attach_timeout_seconds, self._attach_timeout, worker
        )
        self._update_registration_gauges()
        log.info(
            "worker_registered",
            worker=worker.worker_id,
            agent=agent_name,
            bytes=worker.registered_bytes,
            regions=len(regions),
            engine_complete=engine.complete,
            pid=spec.pid,
        )
        return self._registered(worker)

    def _registered(self, worker: Worker) -> engine_pb2.RegisterWorkerResponse:
        engine = self.registry.engines[worker.engine_id]
        return engine_pb2.RegisterWorkerResponse(
            worker_id=worker.worker_id,
            agent_name=worker.agent_name,
            peer_address=self.advertise_address,
            sidecar_id=self.sidecar_id,
            compatibility_hash=engine.compatibility_hash,
            registered_bytes=worker.registered_bytes,
            engine_complete=engine.complete,
        )

    async def unregister_worker(
        self, request: engine_pb2.UnregisterWorkerRequest
    ) -> engine_pb2.UnregisterWorkerResponse:
        validation.identifier(request.engine_id, "engine_id")
        worker = self.registry.worker(request.engine_id, request.tp_rank, request.pp_rank)
        if worker is None:
            raise NotFound(f"worker {worker_id(request.engine_id, request.pp_rank, request.tp_rank)} is not registered")
        released = await self.remove_worker(worker, "unregistered by the engine")
        return engine_pb2.UnregisterWorkerResponse(requests_released=released)

    async def _remove_orphaned_files(self, paths: list[str]) -> None:
        """Remove the KV files of a worker that died without removing them (killed). Its lock
        goes only when its process has fully exited, which may be a moment after its event stream
        closed, so look a few times; a live worker keeps its lock and its file."""
        pending = set(paths)
        for delay in (0.0, 0.5, 2.0, 5.0):
            await asyncio.sleep(delay)
            for path in sorted(pending):
                if remove_if_orphaned(Path(path)):
                    self.metrics.orphaned_files_removed.inc()
                    log.warning("orphaned_shm_file_removed", path=path, hint="its engine exited without removing it")
                    pending.discard(path)
                elif not os.path.exists(path):
                    pending.discard(path)
            if not pending:
                return

    async def remove_worker(self, worker: Worker, reason: str) -> int:
        """Drop a worker: its engine's requests end, its agent and memory go. Returns the number
        of requests released."""
        if self.registry.by_agent(worker.agent_name) is not worker:
            return 0
        self.registry.remove(worker)
        if worker.attach_timer is not None:
            worker.attach_timer.cancel()
        engine_id = worker.engine_id
        before = len(self.producer.requests) + len(self.consumer.requests)
        self.producer.drop_engine(engine_id, f"worker {worker.worker_id} {reason}")
        self.consumer.drop_engine(engine_id, f"worker {worker.worker_id} {reason}")
        for key in self.cache.keys_of_engine(engine_id):
            self.cache_release(key, "engine_gone")
        released = before - len(self.producer.requests) - len(self.consumer.requests)
        # Transfers that touch this worker's memory must end before the memory is revoked; the
        # transport's deadlines bound the wait.
        touching = [task for task, engines in self._tasks.items() if engine_id in engines]
        if touching:
            await asyncio.wait(touching, timeout=self.settings.transfer_timeout_seconds + 1.0)
        await self.transport.drop_agent(worker.agent_name)
        for memory in worker.memories:
            self.memory.release(memory)
        orphans = [memory.orphan_path for memory in worker.memories if memory.orphan_path]
        if orphans:
            self.spawn(self._remove_orphaned_files(orphans), engines=[])
        worker.events.put_nowait(_StreamClosed(reason))  # type: ignore[arg-type]
        self._update_registration_gauges()
        log.info("worker_removed", worker=worker.worker_id, reason=reason, requests_released=released)
        return released

    def _attach_timeout(self, worker: Worker) -> None:
        worker.attach_timer = None
        if worker.watchers == 0 and self.registry.by_agent(worker.agent_name) is worker:
            log.warning(
                "worker_never_attached", worker=worker.worker_id, timeout=self.settings.worker_attach_timeout_seconds
            )
            self.spawn(self.remove_worker(worker, "never opened WatchEvents"), engines=[])

    def _update_registration_gauges(self) -> None:
        workers = self.registry.workers
        self.metrics.workers.set(len(workers))
        self.metrics.registered_bytes.set(sum(worker.registered_bytes for worker in workers))

    # --- events -------------------------------------------------------------------------------

    async def watch_events(self, request: engine_pb2.WatchEventsRequest) -> AsyncIterator[engine_pb2.Event]:
        validation.identifier(request.engine_id, "engine_id")
        worker = self.registry.worker(request.engine_id, request.tp_rank, request.pp_rank)
        if worker is None:
            raise NotFound(
                f"worker {worker_id(request.engine_id, request.pp_rank, request.tp_rank)} is not registered; "
                "call RegisterWorker first"
            )
        worker.watchers += 1
        if worker.attach_timer is not None:
            worker.attach_timer.cancel()
            worker.attach_timer = None
        try:
            yield engine_pb2.Event(kind=engine_pb2.WATCH_STARTED, sidecar_id=self.sidecar_id)
            while True:
                event = await worker.events.get()
                if isinstance(event, _StreamClosed):
                    if event.exhausted:
                        raise ResourceExhausted(event.reason)
                    return
                yield event
        finally:
            worker.watchers -= 1
            if worker.watchers == 0 and self.registry.by_agent(worker.agent_name) is worker and not self.draining:
                # The worker's connection is gone: the engine restarted or died.
                self.spawn(self.remove_worker(worker, "event stream closed"), engines=[])

    def emit(self, engine_id: str, event: engine_pb2.Event) -> None:
        """Queue ``event`` for every worker of the engine."""
        engine = self.registry.engines.get(engine_id)
        if engine is None:
            return
        self.metrics.events.labels(kind=engine_pb2.EventKind.Name(event.kind)).inc()
        for worker in engine.ordered_workers():
            if worker.overflowed:
                continue
            if worker.events.qsize() >= self.settings.max_queued_events:
                worker.overflowed = True
                log.error("event_queue_overflow", worker=worker.worker_id, queued=worker.events.qsize())
                worker.events.put_nowait(
                    _StreamClosed(f"more than {self.settings.max_queued_events} events were not consumed", True)  # type: ignore[arg-type]
                )
                continue
            copy = engine_pb2.Event()
            copy.CopyFrom(event)
            worker.events.put_nowait(copy)

    # --- request calls ------------------------------------------------------------------------

    async def submit_blocks(self, request: engine_pb2.SubmitBlocksRequest) -> engine_pb2.SubmitBlocksResponse:
        return await self.producer.submit(request)

    async def expect_push(self, request: engine_pb2.ExpectPushRequest) -> engine_pb2.ExpectPushResponse:
        return await self.consumer.expect_push(request)

    async def pull(self, request: engine_pb2.PullRequest) -> engine_pb2.PullResponse:
        return await self.consumer.pull(request)

    async def keep_alive(self, request: engine_pb2.KeepAliveRequest) -> engine_pb2.KeepAliveResponse:
        return await self.consumer.keep_alive(request)

    async def hold_blocks(self, request: engine_pb2.HoldBlocksRequest) -> engine_pb2.HoldBlocksResponse:
        return await self.producer.hold(request)

    async def release(self, request: engine_pb2.ReleaseRequest) -> engine_pb2.ReleaseResponse:
        validation.identifier(request.engine_id, "engine_id")
        validation.identifier(request.request_id, "request_id")
        validation.identifier(request.transfer_id, "transfer_id", required=False)
        if request.engine_id not in self.registry.engines:
            raise NotFound(f"engine_id: engine {request.engine_id!r} is not registered with this sidecar")
        reason = request.reason or "released by the engine"
        consumer = self.consumer.release(request.engine_id, request.request_id, reason)
        producer = self.producer.release(request.engine_id, request.request_id, request.transfer_id, reason)
        return engine_pb2.ReleaseResponse(found=consumer is not None or producer, peer_notified=consumer is not None)

    async def query_cache(self, request: engine_pb2.QueryCacheRequest) -> engine_pb2.QueryCacheResponse:
        """Ask one sidecar (``address``; empty: this one) or, with ``known_peers``, this sidecar and
        every peer it knows at once, each bounded by ``timeout_seconds``: a peer that fails or is
        late is listed in ``unreachable``, never waited for past the bound."""
        validation.identifier(request.engine_id, "engine_id")
        validation.address(request.address, "address", required=False)
        validation.identifier(request.conversation_id, "conversation_id", required=False)
        validation.identifier(request.request_id, "request_id", required=False)
        hashes = validation.block_hashes(request.block_hashes, "block_hashes", self.settings.max_blocks_per_request)
        if not request.conversation_id and not request.request_id and not hashes:
            raise InvalidArgument("conversation_id", "conversation_id, request_id or block_hashes is required")
        timeout = validation.duration(
            request.timeout_seconds, "timeout_seconds", self.settings.peer_call_timeout_seconds, maximum=600.0
        )
        peer_request = peer_pb2.PeerQueryCacheRequest(
            caller_sidecar_id=self.sidecar_id,
            conversation_id=request.conversation_id,
            request_id=request.request_id,
            block_hashes=hashes,
        )
        addresses = ["", *self.peers.known_addresses()] if request.known_peers else [request.address]
        started = time.monotonic()
        answers = await asyncio.gather(
            *(asyncio.wait_for(self.peers.call(address, "QueryCache", peer_request), timeout) for address in addresses),
            return_exceptions=True,
        )
        entries: list[engine_pb2.CacheEntry] = []
        unreachable: list[str] = []
        for address, answer in zip(addresses, answers, strict=True):
            if isinstance(answer, BaseException):
                if not request.known_peers:
                    if isinstance(answer, TimeoutError):
                        raise DeadlineExceeded(f"peer {address}: no cache answer within {timeout:g}s")
                    raise answer
                log.info("cache_query_unanswered", peer=address, error=repr(answer))
                unreachable.append(address)
                continue
            for entry in answer.entries:
                cached = self.peers.cached_generation(entry.address, entry.engine_id)
                if cached is not None and entry.engine_generation and cached != entry.engine_generation:
                    await self.peers.forget_engine(entry.address, entry.engine_id, "engine re-registered")
            entries.extend(answer.entries)
        entries.sort(key=lambda entry: (entry.matched_blocks, entry.expires_in_seconds), reverse=True)
        log.debug(
            "cache_query_answered",
            peers=len(addresses),
            entries=len(entries),
            matched_blocks=entries[0].matched_blocks if entries else 0,
            ms=round((time.monotonic() - started) * 1000.0, 2),
        )
        self._count_lookup(entries, bool(hashes), unreachable, request.engine_id)
        return engine_pb2.QueryCacheResponse(entries=entries, unreachable=unreachable)

    def _count_lookup(
        self, entries: list[engine_pb2.CacheEntry], by_hash: bool, unreachable: list[str], engine_id: str
    ) -> None:
        """Lookup outcome metrics on the asking side: hits (and the tokens they cover), misses by reason."""
        best = entries[0] if entries else None
        if best is not None and (best.matched_blocks or not by_hash):
            self.metrics.cache_lookups.labels(outcome="hit").inc()
            engine = self.registry.engines.get(engine_id)
            block_size = engine.ordered_workers()[0].layout.block_size if engine and engine.workers else 0
            self.metrics.cache_matched_tokens.inc(best.matched_blocks * block_size if by_hash else best.num_tokens)
            return
        if best is not None:
            reason = "prefix_mismatch"
        elif unreachable:
            reason = "peer_unreachable"
        else:
            reason = "no_hold"
        self.metrics.cache_lookups.labels(outcome=reason).inc()

    # --- cache index --------------------------------------------------------------------------

    def cache_hold(self, pending: ProducerRequest, conversation_id: str, block_hashes: tuple[bytes, ...]) -> None:
        """Index held blocks for cache queries; the producer lease (the hold TTL) expires them."""
        entry = HeldBlocks(
            pending.engine_id,
            pending.request_id,
            conversation_id,
            pending.block_ids,
            pending.num_tokens,
            time.monotonic(),
            block_hashes,
        )
        self.cache.hold(entry)
        self._update_hold_gauges()

    def cache_release(self, key: tuple[str, str], why: str) -> None:
        if self.cache.remove(key) is not None:
            self.metrics.hold_releases.labels(reason=why).inc()
        self._update_hold_gauges()

    def _update_hold_gauges(self) -> None:
        self.metrics.held_requests.set(len(self.cache))
        self.metrics.held_blocks.set(self.cache.held_blocks)

    # --- PeerService --------------------------------------------------------------------------

    async def handle_handshake(self, request: peer_pb2.HandshakeRequest) -> peer_pb2.HandshakeResponse:
        validation.identifier(request.engine_id, "engine_id")
        validation.address(request.caller.address, "caller.address", required=False)
        if request.caller.versions.protocol and request.caller.versions.protocol != PROTOCOL_VERSION:
            raise FailedPrecondition(
                f"protocol revision {request.caller.versions.protocol} is not {PROTOCOL_VERSION}; "
                "upgrade the older sidecar"
            )
        await self.peers.note_caller(request.caller)
        engine = self._handshake_engine(request.engine_id, request.compatibility_hash, request.caller.address or "?")
        self.transport.warm(_HANDSHAKE_WARM_SECONDS)
        return peer_pb2.HandshakeResponse(sidecar=self.sidecar_info(), engine=engine.descriptor())

    def local_engine_view(self, engine_id: str, compatibility_hash: str) -> EngineView:
        """A local engine as the other side of a same-node transfer (no handshake, no cache)."""
        engine = self._handshake_engine(engine_id, compatibility_hash, "this sidecar")
        return engine.view(self.advertise_address, self.sidecar_id)

    def _handshake_engine(self, engine_id: str, compatibility_hash: str, who: str) -> Engine:
        if engine_id not in self.registry.engines:
            raise NotFound(f"engine_id: engine {engine_id!r} is not served by this sidecar")
        engine = self.registry.require_engine(engine_id, "engine_id")
        self.check_compatibility(engine, compatibility_hash, f"sidecar {who}")
        return engine

    def check_compatibility(self, engine: Engine, their_hash: str, who: str) -> None:
        if their_hash and their_hash != engine.compatibility_hash:
            self.metrics.handshake_failures.labels(reason="compatibility_hash").inc()
            log.warning(
                "compatibility_hash_mismatch",
                engine_id=engine.engine_id,
                local=engine.compatibility_hash,
                remote=their_hash,
                peer=who,
            )
            raise FailedPrecondition(
                f"compatibility hash mismatch for engine {engine.engine_id!r}: local {engine.compatibility_hash}, "
                f"{who} {their_hash}; the engines differ in model, dtype, KV layout factors or versions"
            )

    async def handle_push_reg(self, request: peer_pb2.PushRegRequest) -> peer_pb2.PushRegResponse:
        return await self.producer.handle_push_reg(request)

    async def handle_heartbeat(self, request: peer_pb2.HeartbeatRequest) -> peer_pb2.HeartbeatResponse:
        return await self.producer.handle_heartbeat(request)

    async def handle_query_cache(self, request: peer_pb2.PeerQueryCacheRequest) -> peer_pb2.PeerQueryCacheResponse:
        validation.identifier(request.conversation_id, "conversation_id", required=False)
        validation.identifier(request.request_id, "request_id", required=False)
        hashes = validation.block_hashes(request.block_hashes, "block_hashes", self.settings.max_blocks_per_request)
        if not request.conversation_id and not request.request_id and not hashes:
            raise InvalidArgument("conversation_id", "conversation_id, request_id or block_hashes is required")
        now = time.monotonic()
        entries = []
        for match in self.cache.query(request.conversation_id, request.request_id, request.engine_id, hashes):
            held = match.entry
            engine = self.registry.engines.get(held.engine_id)
            deadline = self.producer.leases.deadline((held.engine_id, held.request_id))
            entries.append(
                engine_pb2.CacheEntry(
                    engine_id=held.engine_id,
                    request_id=held.request_id,
                    conversation_id=held.conversation_id,
                    block_ids=common_pb2.GroupedBlockIds(
                        groups=[common_pb2.BlockIdList(ids=list(group)) for group in held.block_ids]
                    ),
                    num_tokens=held.num_tokens,
                    expires_in_seconds=max(0.0, deadline - now) if deadline is not None else 0.0,
                    address=self.advertise_address,
                    tp_size=engine.tp_size if engine else 0,
                    block_hashes=held.block_hashes,
                    matched_blocks=match.matched_blocks,
                    engine_generation=engine.generation if engine else "",
                )
            )
        return peer_pb2.PeerQueryCacheResponse(sidecar_id=self.sidecar_id, entries=entries)

    async def handle_transfer_failed(self, request: peer_pb2.TransferFailedRequest) -> peer_pb2.TransferFailedResponse:
        return await self.consumer.handle_transfer_failed(request)

    async def handle_release(self, request: peer_pb2.PeerReleaseRequest) -> peer_pb2.PeerReleaseResponse:
        return await self.producer.handle_release(request)

    # --- transport callbacks --------------------------------------------------------------------

    def _on_notifications(self, batch: list[tuple[str, bytes]]) -> None:
        for agent_name, payload in batch:
            worker = self.registry.by_agent(agent_name)
            if worker is None:
                continue
            try:
                notice = peer_pb2.TransferNotice.FromString(payload)
            except Exception:
                log.warning("malformed_notification", agent=agent_name, size=len(payload))
                continue
            if notice.engine_id != worker.engine_id:
                log.warning("misrouted_notification", agent=agent_name, engine_id=notice.engine_id)
                continue
            if not (self.consumer.on_notice(worker, notice) or self.producer.on_notice(worker, notice)):
                log.warning(
                    "notification_for_unknown_request",
                    engine_id=notice.engine_id,
                    request_id=notice.request_id,
                    hint="it may have expired or been released",
                )

    def _on_xfer_done(self, op: str, result: TransferResult) -> None:
        # Runs on the transport thread; prometheus_client metrics are thread-safe.
        if result.ok:
            self.metrics.xfer_duration.labels(op=op).observe(result.duration_s)
            self.metrics.xfer_post.labels(op=op).observe(result.post_s)
            self.metrics.xfer_bytes.labels(op=op).inc(result.bytes)
            self.metrics.xfer_request_bytes.labels(op=op).observe(result.bytes)
            self.metrics.xfer_descriptors.labels(op=op).observe(result.descriptors)

    async def _unload_peer_agents(self, address: str, agent_names: list[str]) -> None:
        await self.transport.drop_remote(agent_names)

    # --- status -------------------------------------------------------------------------------

    def status(self, request: engine_pb2.GetStatusRequest) -> engine_pb2.GetStatusResponse:
        engines = []
        for engine in sorted(self.registry.engines.values(), key=lambda e: e.engine_id):
            workers = engine.ordered_workers()
            engines.append(
                engine_pb2.EngineStatus(
                    engine_id=engine.engine_id,
                    role=engine.role,  # type: ignore[arg-type]
                    tp_size=engine.tp_size,
                    pp_size=engine.pp_size,
                    complete=engine.complete,
                    compatibility_hash=engine.compatibility_hash,
                    geometry=workers[0].geometry if workers else None,
                    workers=[
                        engine_pb2.WorkerStatus(
                            worker_id=worker.worker_id,
                            tp_rank=worker.tp_rank,
                            pp_rank=worker.pp_rank,
                            agent_name=worker.agent_name,
                            registered_bytes=worker.registered_bytes,
                            num_regions=len(worker.layout.regions),
                            watching=worker.watchers > 0,
                            pid=worker.pid,
                        )
                        for worker in workers
                    ],
                )
            )
        response = engine_pb2.GetStatusResponse(
            sidecar=self.sidecar_info(),
            uptime_seconds=time.monotonic() - self.started,
            engines=engines,
            peers=self.peers.status(),
            leases=len(self.producer.leases),
            transfers_in_flight=self.transport.in_flight,
            pending_push_registrations=self.producer.matcher.pending_registrations,
            unmatched_submissions=self.producer.matcher.unmatched_submissions,
            pending_receives=len(self.consumer.requests),
            held_requests=len(self.cache),
            held_blocks=self.cache.held_blocks,
            draining=self.draining,
        )
        if request.include_requests:
            response.requests.extend(self.producer.status_rows())
            response.requests.extend(self.consumer.status_rows())
        return response
