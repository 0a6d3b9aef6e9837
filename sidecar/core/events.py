"""Worker event streams: what reaches each registered worker's ``WatchEvents`` stream.

``emit`` queues a copy of an event for every worker of an engine (vLLM reports a request done only
once every worker has); ``watch`` is the stream itself; ``close`` ends one worker's stream. A
worker that stops consuming is cut off at ``max_queued_events`` with RESOURCE_EXHAUSTED instead of
growing without bound. When a worker's last stream closes (the engine died or restarted),
``on_detached`` lets registration drop it.

Runs on the event loop thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from kvsidecar.v1 import engine_pb2
from sidecar.config import Settings
from sidecar.core import validation
from sidecar.core.registry import Registry, StreamClosed, Worker, worker_id
from sidecar.errors import NotFound, ResourceExhausted
from sidecar.logs import get_logger
from sidecar.metrics import SidecarMetrics

log = get_logger("kvsidecar.node")


class WorkerEvents:
    def __init__(self, settings: Settings, registry: Registry, metrics: SidecarMetrics, sidecar_id: str) -> None:
        self._settings = settings
        self._registry = registry
        self._metrics = metrics
        self._sidecar_id = sidecar_id
        self.draining = False  # set by the node: streams that close while draining drop nothing
        # Set by the node: a worker whose last stream closed (its engine is gone).
        self.on_detached: Callable[[Worker], None] = lambda worker: None

    def emit(self, engine_id: str, event: engine_pb2.Event) -> None:
        """Queue ``event`` for every worker of the engine."""
        engine = self._registry.engines.get(engine_id)
        if engine is None:
            return
        self._metrics.events.labels(kind=engine_pb2.EventKind.Name(event.kind)).inc()
        for worker in engine.ordered_workers():
            if worker.overflowed:
                continue
            if worker.events.qsize() >= self._settings.max_queued_events:
                worker.overflowed = True
                log.error("event_queue_overflow", worker=worker.worker_id, queued=worker.events.qsize())
                reason = f"more than {self._settings.max_queued_events} events were not consumed"
                worker.events.put_nowait(StreamClosed(reason, True))
                continue
            copy = engine_pb2.Event()
            copy.CopyFrom(event)
            worker.events.put_nowait(copy)

    def close(self, worker: Worker, reason: str) -> None:
        """End the worker's stream (it was removed, or the sidecar stops)."""
        worker.events.put_nowait(StreamClosed(reason))

    async def watch(self, request: engine_pb2.WatchEventsRequest) -> AsyncIterator[engine_pb2.Event]:
        validation.identifier(request.engine_id, "engine_id")
        worker = self._registry.worker(request.engine_id, request.tp_rank, request.pp_rank)
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
            yield engine_pb2.Event(kind=engine_pb2.WATCH_STARTED, sidecar_id=self._sidecar_id)
            while True:
                event = await worker.events.get()
                if isinstance(event, StreamClosed):
                    if event.exhausted:
                        raise ResourceExhausted(event.reason)
                    return
                yield event
        finally:
            worker.watchers -= 1
            if worker.watchers == 0 and self._registry.by_agent(worker.agent_name) is worker and not self.draining:
                # The worker's connection is gone: the engine restarted or died.
                self.on_detached(worker)
