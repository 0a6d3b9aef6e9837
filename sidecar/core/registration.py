"""Worker registration: mapping a worker's exported KV memory, creating its NIXL agent, and
dropping it again (unregistered, its event stream closed, or never attached).

Mapping runs off the event loop (``asyncio.to_thread``): with ``nixl.populate_mappings`` it
pre-faults the whole KV cache, which takes seconds for a large engine and would otherwise stall
every other RPC of the sidecar meanwhile. Everything else runs on the event loop thread.

Removal order matters: the engine's requests end first, transfers that touch its memory are
awaited (bounded), then its agent is destroyed and its mapping revoked, and only then is the
worker's stream closed; a killed engine's locked KV file is removed once its lock is gone.

Ownership: the uid whose call registers an engine's first worker owns the engine; another uid's
worker for it is refused, and so is a shared-memory file its caller does not own
(``api.engine_auth``, "Whose engine").
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path

from kvsidecar.shm import remove_if_orphaned
from kvsidecar.v1 import engine_pb2
from sidecar.core import validation
from sidecar.core.context import NodeContext
from sidecar.core.registry import Engine, Worker, worker_id
from sidecar.dataplane.memory import ExportSpec, MappedMemory, MemoryImporter
from sidecar.dataplane.plan.layout import RegionLayout
from sidecar.dataplane.views import worker_layout
from sidecar.errors import DRAINING, Draining, FailedPrecondition, NotFound, PermissionDenied, ResourceExhausted
from sidecar.logs import get_logger

log = get_logger("kvsidecar.node")


class Registrations:
    def __init__(self, ctx: NodeContext, memory: MemoryImporter) -> None:
        self._ctx = ctx
        self.memory = memory
        self._agent_counter = itertools.count()
        # Set by the node: end every request of an engine (its worker is going); returns how many.
        self.drop_engine: Callable[[str, str], int] = lambda engine_id, reason: 0

    async def register_worker(
        self, request: engine_pb2.RegisterWorkerRequest, uid: int | None = None
    ) -> engine_pb2.RegisterWorkerResponse:
        """``uid``: the caller's, if it may act only on its own engines and files
        (``api.engine_auth.acting_uid``); None for root, the daemon's uid and in-process callers."""
        ctx = self._ctx
        if ctx.tasks.draining:
            raise Draining(DRAINING)
        spec = validation.register_worker(request)
        if ctx.settings.integrity == "digest" and spec.exports[0].kind == "VRAM":
            # Digests are computed by reading the KV from the CPU, which cannot read device memory.
            raise FailedPrecondition(
                "exports: integrity=digest reads KV from the CPU and cannot check VRAM exports; "
                "run this sidecar with integrity=off for GPU engines"
            )
        if spec.tp_size * spec.pp_size > ctx.settings.max_workers_per_engine:
            # An engine's workers are its TP x PP ranks: this bounds them before any is mapped.
            raise ResourceExhausted(
                f"tp_size x pp_size: {spec.tp_size} x {spec.pp_size} workers, the limit is "
                f"max_workers_per_engine={ctx.settings.max_workers_per_engine}"
            )
        existing = ctx.registry.worker(spec.engine_id, spec.tp_rank, spec.pp_rank)
        if existing is not None:
            if existing.fingerprint == spec.fingerprint:
                return self._registered(existing)
            await self.remove_worker(existing, "re-registered with new content")
        self._engine_for(spec, uid)  # refuse a worker that cannot join before mapping anything
        started = time.monotonic()
        try:
            memories = await self._map_all(spec.exports, uid)
        except asyncio.CancelledError:
            self._cancelled(spec.engine_id, spec.tp_rank, "mapping its memory", started)
            raise
        mapped = time.monotonic()
        try:
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
            layout = worker_layout(spec.tp_rank, spec.pp_rank, regions, geometry, memories[0].device_id)
            mem_type = memories[0].kind
            serial = next(self._agent_counter)
            sidecar_id = ctx.identity.sidecar_id
            agent_name = f"kvs-{sidecar_id[:8]}-{serial}-{spec.engine_id}-pp{spec.pp_rank}-tp{spec.tp_rank}"
            regions_of_agent = [(memory.address, memory.length, memory.device_id) for memory in memories]
            creating = asyncio.ensure_future(ctx.transport.create_agent(agent_name, regions_of_agent, mem_type))
        except BaseException:
            self._release(memories)
            raise
        try:
            metadata = await asyncio.shield(creating)
        except asyncio.CancelledError:
            # The caller gave up (its deadline passed): the owner thread still creates the agent
            # and registers the memory; drop it once it exists, and only then revoke the memory.
            self._cancelled(spec.engine_id, spec.tp_rank, "creating its NIXL agent", started)
            ctx.tasks.spawn(self._undo_agent(creating, agent_name, memories), engines=[])
            raise
        except BaseException:
            self._release(memories)
            raise
        try:
            # Another uid's registration may have created the engine while this one mapped (the
            # servicer checked the caller against the engine as it was when the call came).
            ctx.registry.require_owner(spec.engine_id, uid, "RegisterWorker")
            # Ranks of one engine register at once (each worker process its own): the engine is
            # looked up again after the awaits, or each rank of a new engine would make its own and
            # the last one added would replace the others.
            engine = self._engine_for(spec, uid)
            raced = ctx.registry.worker(spec.engine_id, spec.tp_rank, spec.pp_rank)
            if raced is not None and raced.fingerprint != spec.fingerprint:
                # A registration of this same rank, with other content, finished while this one mapped.
                raise FailedPrecondition(
                    f"engine {spec.engine_id!r} rank tp{spec.tp_rank}/pp{spec.pp_rank} was registered with "
                    "other content by a concurrent call; unregister it first"
                )
        except (PermissionDenied, FailedPrecondition, ResourceExhausted):
            ctx.tasks.spawn(self._undo_agent(creating, agent_name, memories), engines=[])
            raise
        if raced is not None:
            ctx.tasks.spawn(self._undo_agent(creating, agent_name, memories), engines=[])
            return self._registered(raced)
        staging_pool = None
        if mem_type == "VRAM":
            metadata, staging_pool = await self._offer_staging(agent_name, metadata)
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
            staging_pool=staging_pool,
        )
        ctx.registry.add(engine, worker)
        worker.attach_timer = asyncio.get_running_loop().call_later(
            ctx.settings.worker_attach_timeout_seconds, self._attach_timeout, worker
        )
        self._update_gauges()
        log.info(
            "worker_registered",
            worker=worker.worker_id,
            agent=agent_name,
            bytes=worker.registered_bytes,
            regions=len(regions),
            engine_complete=engine.complete,
            pid=spec.pid,
            # Where a slow registration spent its time (pre-faulting the mapping; NIXL agent and
            # memory registration on the owner thread, queued behind its other commands).
            map_s=round(mapped - started, 3),
            agent_s=round(time.monotonic() - mapped, 3),
        )
        return self._registered(worker)

    async def _map_all(self, exports: tuple[ExportSpec, ...], uid: int | None) -> list[MappedMemory]:
        """Map every export on a worker thread (pre-faulting may take seconds); all or none.
        ``uid``: the owner every shared-memory file must have (None: any)."""

        def map_all() -> list[MappedMemory]:
            mapped: list[MappedMemory] = []
            try:
                for index, export in enumerate(exports):
                    mapped.append(self.memory.map(export, f"exports[{index}]", uid))
            except BaseException:
                for memory in mapped:
                    self.memory.release(memory)
                raise
            return mapped

        task = asyncio.ensure_future(asyncio.to_thread(map_all))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # The call was cancelled while mapping: release what the thread maps once it is done.
            task.add_done_callback(self._release_mapped)
            raise

    def _release(self, memories: list[MappedMemory]) -> None:
        for memory in memories:
            self.memory.release(memory)

    def _engine_for(self, spec: validation.WorkerSpec, uid: int | None) -> Engine:
        """The engine a worker of ``spec`` joins: the registered one, whose shape it must share,
        or a new one (not yet in the registry: ``registry.add`` puts it there)."""
        ctx = self._ctx
        engine = ctx.registry.engines.get(spec.engine_id)
        if engine is None:
            if len(ctx.registry.engines) >= ctx.settings.max_engines:
                raise ResourceExhausted(
                    f"engine_id: {len(ctx.registry.engines)} engines are registered, the limit is "
                    f"max_engines={ctx.settings.max_engines}"
                )
            return Engine(
                spec.engine_id, spec.role, spec.tp_size, spec.pp_size, spec.compatibility_hash, spec.engine_version,
                owner_uid=uid,
            )  # fmt: skip
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
        return engine

    async def _undo_agent(self, creating: asyncio.Future[bytes], agent_name: str, memories: list[MappedMemory]) -> None:
        """A registration whose caller left while its agent was being created: drop the agent when
        the owner thread has made it, then revoke the mapping (in that order: NIXL must not keep a
        registration of a tombstoned range)."""
        try:
            try:
                await creating
            except Exception:
                return  # never created: nothing to drop
            await self._ctx.transport.drop_agent(agent_name)
            log.info("abandoned_agent_dropped", agent=agent_name)
        finally:
            self._release(memories)

    @staticmethod
    def _cancelled(engine_id: str, tp_rank: int, stage: str, started: float) -> None:
        """The caller gave up (its deadline passed) while the registration was still at ``stage``."""
        log.warning("worker_registration_cancelled", engine_id=engine_id, tp_rank=tp_rank, stage=stage,
                    waited_s=round(time.monotonic() - started, 3))  # fmt: skip

    def _release_mapped(self, task: asyncio.Future[list[MappedMemory]]) -> None:
        if not task.cancelled() and task.exception() is None:
            for memory in task.result():
                self.memory.release(memory)

    def _registered(self, worker: Worker) -> engine_pb2.RegisterWorkerResponse:
        engine = self._ctx.registry.engines[worker.engine_id]
        return engine_pb2.RegisterWorkerResponse(
            worker_id=worker.worker_id,
            agent_name=worker.agent_name,
            peer_address=self._ctx.identity.advertise_address,
            sidecar_id=self._ctx.identity.sidecar_id,
            compatibility_hash=engine.compatibility_hash,
            registered_bytes=worker.registered_bytes,
            engine_complete=engine.complete,
        )

    async def unregister_worker(
        self, request: engine_pb2.UnregisterWorkerRequest
    ) -> engine_pb2.UnregisterWorkerResponse:
        validation.identifier(request.engine_id, "engine_id")
        worker = self._ctx.registry.worker(request.engine_id, request.tp_rank, request.pp_rank)
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
                    self._ctx.metrics.orphaned_files_removed.inc()
                    log.warning("orphaned_shm_file_removed", path=path, hint="its engine exited without removing it")
                    pending.discard(path)
                elif not os.path.exists(path):
                    pending.discard(path)
            if not pending:
                return

    async def remove_worker(self, worker: Worker, reason: str) -> int:
        """Drop a worker: its engine's requests end, its agent and memory go. Returns the number
        of requests released."""
        ctx = self._ctx
        if ctx.registry.by_agent(worker.agent_name) is not worker:
            return 0
        ctx.registry.remove(worker)
        if worker.attach_timer is not None:
            worker.attach_timer.cancel()
        engine_id = worker.engine_id
        released = self.drop_engine(engine_id, f"worker {worker.worker_id} {reason}")
        # Transfers that touch this worker's memory must end before the memory is revoked; the
        # transport's deadlines bound the wait.
        started = time.monotonic()
        touching = ctx.tasks.touching(engine_id)
        if touching:
            await asyncio.wait(touching, timeout=ctx.settings.transfer_timeout_seconds + 1.0)
        waited = time.monotonic()
        await ctx.transport.drop_agent(worker.agent_name)
        # A transfer still running past its deadline is a device copy held until the GPU completes
        # it (``device_copy.LateCopies``): the memory it writes stays mapped until then.
        held = [task for task in touching if not task.done()]
        if held:
            log.warning("worker_memory_kept_for_late_copy", worker=worker.worker_id, transfers=len(held))
            ctx.tasks.spawn(self._release_memory_after(worker, held), engines=[])
        else:
            self._release_memory(worker)
        ctx.events.close(worker, reason)
        self._update_gauges()
        log.info(
            "worker_removed",
            worker=worker.worker_id,
            reason=reason,
            requests_released=released,
            transfers_wait_s=round(waited - started, 3),
            drop_agent_s=round(time.monotonic() - waited, 3),
        )
        return released

    async def _offer_staging(self, agent_name: str, metadata: bytes) -> tuple[bytes, tuple[int, int, int] | None]:
        """A VRAM worker's agent gets the sidecar's pinned pool registered, so that peers on other
        nodes READ its KV from there after a Stage call (``dataplane.target_staging``); returns
        the agent's metadata with the pool in it. Not offered (logged) where the pool cannot be."""
        server = self._ctx.dataplane.staging_server
        if server is None:
            return metadata, None
        try:
            base = await server.pool.ready()
            metadata = await self._ctx.transport.register_host(agent_name, base, server.pool.nbytes)
        except Exception as exc:
            log.warning("target_staging_not_offered", agent=agent_name, error=str(exc))
            return metadata, None
        return metadata, (base, server.pool.nbytes, server.pool.chunk_bytes)

    def _release_memory(self, worker: Worker) -> None:
        for memory in worker.memories:
            self.memory.release(memory)
        orphans = [memory.orphan_path for memory in worker.memories if memory.orphan_path]
        if orphans:
            self._ctx.tasks.spawn(self._remove_orphaned_files(orphans), engines=[])

    async def _release_memory_after(self, worker: Worker, held: list[asyncio.Task[object]]) -> None:
        """Unbounded on purpose: a copy that never completes keeps the memory mapped (a leak the
        operator sees: ``kvsidecar_device_copies_held``), never a write into unmapped memory."""
        await asyncio.wait(held)
        self._release_memory(worker)
        log.info("worker_memory_released_after_late_copy", worker=worker.worker_id)

    def detached(self, worker: Worker) -> None:
        """The worker's last event stream closed: the engine restarted or died."""
        self._ctx.tasks.spawn(self.remove_worker(worker, "event stream closed"), engines=[])

    def _attach_timeout(self, worker: Worker) -> None:
        worker.attach_timer = None
        if worker.watchers == 0 and self._ctx.registry.by_agent(worker.agent_name) is worker:
            timeout = self._ctx.settings.worker_attach_timeout_seconds
            log.warning("worker_never_attached", worker=worker.worker_id, timeout=timeout)
            self._ctx.tasks.spawn(self.remove_worker(worker, "never opened WatchEvents"), engines=[])

    def _update_gauges(self) -> None:
        workers = self._ctx.registry.workers
        self._ctx.metrics.workers.set(len(workers))
        self._ctx.metrics.registered_bytes.set(sum(worker.registered_bytes for worker in workers))

    def release_all_memory(self) -> None:
        """Revoke every worker's mapping (shutdown, after the transport stopped)."""
        for worker in self._ctx.registry.workers:
            for memory in worker.memories:
                self.memory.release(memory)
