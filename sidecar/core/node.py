"""The node: the composition root of one sidecar, independent of gRPC.

It builds the parts and hands each the same ``NodeContext`` (settings, identity, registry, peer
client, data plane and transport, metrics, worker events, task spawner); no part imports the node.
The parts own the calls (the servicers call them directly, see ``api``):

- ``registrations`` (``core.registration``): RegisterWorker, UnregisterWorker, worker removal;
- ``events`` (``core.events``): WatchEvents and what reaches each worker;
- ``producer`` (``core.producer``): SubmitBlocks, HoldBlocks; PushReg, Heartbeat, peer Release;
- ``consumer`` (``core.consumer``): Pull, ExpectPush, KeepAlive; TransferFailed;
- ``holds`` (``core.holds``): QueryCache both ways;
- ``handshakes`` (``core.handshake``): Handshake;
- ``tracing`` (``core.trace``): Trace both ways (the recorder itself is ``context.trace``).
The node itself keeps what spans parts: the lifecycle (start, drain, stop), Release (both sides
of a request), GetStatus, and the routing of transport notifications to the side that expects
them. ``routes`` is PeerService's routing table.

The transport is injected (``transport_factory``; NIXL's ``NixlTransport`` by default), so tests
build a whole node without NIXL.

Threads: everything here runs on the event loop thread. The transport's thread hands
notifications back through ``_on_notifications`` (scheduled on the loop) and never touches this
object's state.
"""

from __future__ import annotations

import asyncio
import time

from kvsidecar.v1 import engine_pb2, peer_pb2
from sidecar.config import Settings
from sidecar.core import validation
from sidecar.core.consumer import ConsumerSide
from sidecar.core.context import Identity, NodeContext, Tasks
from sidecar.core.events import WorkerEvents
from sidecar.core.handshake import Handshakes
from sidecar.core.holds import Holds
from sidecar.core.notices import side_for
from sidecar.core.producer import ProducerSide
from sidecar.core.registration import Registrations
from sidecar.core.registry import Registry
from sidecar.core.stages import mode_of, stage_durations
from sidecar.core.staging import StageRoute
from sidecar.core.trace import Timeline, TraceRecorder, Tracing
from sidecar.dataplane.contract import TransferResult, Transport, TransportFactory
from sidecar.dataplane.host_staging import HostStaging
from sidecar.dataplane.memory import MemoryImporter
from sidecar.dataplane.plane import DataPlane
from sidecar.dataplane.transport import NixlTransport
from sidecar.errors import NotFound
from sidecar.logs import get_logger
from sidecar.metrics import SidecarMetrics
from sidecar.peers.client import PeerClient
from sidecar.peers.routes import PeerRoutes

log = get_logger("kvsidecar.node")


class Node:
    def __init__(
        self,
        settings: Settings,
        metrics: SidecarMetrics | None = None,
        transport_factory: TransportFactory = NixlTransport,
    ) -> None:
        self.settings = settings
        self.transport: Transport = transport_factory(settings.nixl, self._on_notifications, self._on_xfer_done)
        self.metrics = metrics or SidecarMetrics(self.transport.nixl_version)
        self.registry = Registry()
        self.identity = Identity(settings, self.transport.nixl_version, self.registry)
        self.tasks = Tasks(settings)
        self.peers = PeerClient(settings, self.identity.info, self._unload_peer_agents, self.metrics)
        self.events = WorkerEvents(settings, self.registry, self.metrics, self.identity.sidecar_id)
        self.context = NodeContext(
            settings=settings,
            identity=self.identity,
            registry=self.registry,
            peers=self.peers,
            dataplane=DataPlane(
                self.transport,
                self.identity.sidecar_id,
                settings.staging_below_bytes,
                self._on_notifications,
                host_staging=HostStaging(self.transport, settings.host_staging),
                on_xfer_done=self._on_xfer_done,
            ),
            transport=self.transport,
            metrics=self.metrics,
            events=self.events,
            tasks=self.tasks,
            trace=TraceRecorder(settings.trace_requests, on_done=self._observe_stages),
        )
        late = self.context.dataplane.late_copies
        self.metrics.device_copies_held.set_function(lambda: late.copies)
        self.metrics.device_copy_held_bytes.set_function(lambda: late.bytes)
        lent = self.context.dataplane.staging_server
        self.metrics.staging_slots_lent.set_function(lambda: lent.lent_slots if lent is not None else 0)
        self.registrations = Registrations(
            self.context, MemoryImporter(settings.shm_dirs, settings.nixl.populate_mappings)
        )
        self.handshakes = Handshakes(self.context)
        self.holds = Holds(self.context)
        self.producer = ProducerSide(self.context, self.holds)
        self.consumer = ConsumerSide(self.context)
        self.tracing = Tracing(self.context.trace, self.identity.info, self.peers)
        # Wiring between parts, here so that no part knows another's owner.
        self.holds.lease_deadline = self.producer.leases.deadline
        self.registrations.drop_engine = self._drop_engine
        self.events.on_detached = self.registrations.detached
        self.routes = PeerRoutes(
            handshake=self.handshakes.handle,
            push_reg=self.producer.push.handle_push_reg,
            heartbeat=self.producer.handle_heartbeat,
            query_cache=self.holds.handle_query_cache,
            transfer_failed=self.consumer.handle_transfer_failed,
            release=self.producer.handle_release,
            get_digests=self.producer.handle_get_digests,
            trace=self.tracing.query,
            stage=StageRoute(self.context, self.producer, self.consumer.push_staging.handle).handle,
            local_engine_view=self.handshakes.local_engine_view,
        )
        self.context.dataplane.stage_remote = self.peers.stage
        self.peers.bind_local(self.routes)

    @property
    def sidecar_id(self) -> str:
        return self.identity.sidecar_id

    @property
    def draining(self) -> bool:
        return self.tasks.draining

    def _set_draining(self) -> None:
        self.tasks.draining = True
        self.events.draining = True

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self, advertise_address: str, bound_addresses: list[str]) -> None:
        self.identity.advertise_address = advertise_address
        self.peers.set_self_addresses([advertise_address, *bound_addresses])
        self.transport.start(asyncio.get_running_loop())
        self.consumer.start()
        log.info(
            "node_started",
            sidecar_id=self.identity.sidecar_id,
            advertise=advertise_address,
            nixl=self.transport.nixl_version,
        )

    async def drain(self, grace: float) -> None:
        """Refuse new work and give running requests up to ``grace`` seconds to finish, including
        blocks our producers computed that consumers have yet to pull or register for: a prefill
        engine's rolling restart then costs its decoders no recompute."""
        self._set_draining()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (
            len(self.tasks) or self.consumer.requests or self.producer.awaiting_consumers()
        ):
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Fail what is left, release every NIXL object and mapping, close every stream."""
        self._set_draining()
        await self.consumer.stop()
        await self.tasks.cancel_all(timeout=2.0)
        # Stop NIXL and revoke memory *before* telling engines their blocks are free: a peer may
        # still be reading them, and only a destroyed agent and a tombstoned mapping stop it.
        await self.transport.stop()
        await self.context.dataplane.peer_memory.close_all()
        self.registrations.release_all_memory()
        self.consumer.fail_all("the sidecar is shutting down")
        self.producer.finish_all("the sidecar is shutting down")
        for worker in self.registry.workers:
            self.events.close(worker, "the sidecar is shutting down")
        self.producer.leases.close()
        await self.peers.close()

    def _drop_engine(self, engine_id: str, reason: str) -> int:
        """End every request of an engine whose worker goes; returns how many ended."""
        before = len(self.producer.requests) + len(self.consumer.requests)
        self.producer.drop_engine(engine_id, reason)
        self.consumer.drop_engine(engine_id, reason)
        self.holds.drop_engine(engine_id)
        return before - len(self.producer.requests) - len(self.consumer.requests)

    # --- calls that span both sides -----------------------------------------------------------

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

    # --- transport callbacks --------------------------------------------------------------------

    def _on_notifications(self, batch: list[tuple[str, bytes]], seen_at: float = 0.0) -> None:
        # seen_at: when the owner thread saw the batch; the trace measures the hand-off from it.
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
            side = side_for(notice.mode, self.consumer.holds_push((notice.engine_id, notice.request_id)))
            part = self.consumer if side == "consumer" else self.producer
            if not part.on_notice(worker, notice, seen_at):
                log.warning(
                    "notification_for_unknown_request",
                    engine_id=notice.engine_id,
                    request_id=notice.request_id,
                    hint="it may have expired or been released",
                )

    def _observe_stages(self, timeline: Timeline) -> None:
        """The request's stage histograms, at its terminal event. Observed in a callback of its
        own, after the engine's event was handed to the stream (the callback that ends a request
        runs to its end before the stream writes), on a copy of the events recorded so far."""
        if timeline.side not in ("producer", "consumer"):
            return
        ended = Timeline(timeline.side, timeline.engine_id, timeline.request_id, mode=timeline.mode,
                         events=list(timeline.events))  # fmt: skip
        try:
            asyncio.get_running_loop().call_soon(self._record_stages, ended)
        except RuntimeError:  # no loop (a part driven without one): observe now
            self._record_stages(ended)

    def _record_stages(self, timeline: Timeline) -> None:
        metrics, mode = self.metrics, mode_of(timeline)
        for stage, seconds in stage_durations(timeline).items():
            metrics.child(metrics.request_stage, timeline.side, mode, stage).observe(seconds)

    def _on_xfer_done(self, op: str, result: TransferResult, path: str = "nixl") -> None:
        # Runs on the transport thread (or the loop, for the data plane's own paths);
        # prometheus_client metrics are thread-safe.
        if result.ok:
            metrics = self.metrics
            child = metrics.child
            child(metrics.xfer_duration, op, path).observe(result.duration_s)
            child(metrics.xfer_post, op, path).observe(result.post_s)
            child(metrics.xfer_bytes, op, path).inc(result.bytes)
            child(metrics.xfer_request_bytes, op, path).observe(result.bytes)
            child(metrics.xfer_descriptors, op, path).observe(result.descriptors)

    async def _unload_peer_agents(self, address: str, agent_names: list[str]) -> None:
        # The peer's view is gone (restart, engine re-registered or left): so is its VRAM opened here.
        await self.context.dataplane.peer_memory.forget(agent_names)
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
            sidecar=self.identity.info(),
            uptime_seconds=time.monotonic() - self.identity.started,
            engines=engines,
            peers=self.peers.status(),
            leases=len(self.producer.leases),
            transfers_in_flight=self.transport.in_flight,
            pending_push_registrations=self.producer.push.matcher.pending_registrations,
            unmatched_submissions=self.producer.push.matcher.unmatched_submissions,
            pending_receives=len(self.consumer.requests),
            held_requests=len(self.holds),
            held_blocks=self.holds.index.held_blocks,
            draining=self.draining,
            admission=self.tasks.transfers.status(),
        )
        if request.include_requests:
            response.requests.extend(self.producer.status_rows())
            response.requests.extend(self.consumer.status_rows())
        return response
