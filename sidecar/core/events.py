"""Worker event streams: what reaches each registered worker's ``WatchEvents`` stream, or the
watch of its engine session stream (``api.session``).

``emit`` queues a copy of an event for every worker of an engine (vLLM reports a request done only
once every worker has) and wakes the session streams watching it; ``watch`` is the WatchEvents
stream itself; ``subscribe`` is the same watch for a reader that takes events when woken (the
session stream, several per message); ``close`` ends one worker's streams. A worker that stops
consuming is cut off at ``max_queued_events`` with RESOURCE_EXHAUSTED instead of growing without
bound: events wait in the worker's queue until a stream takes them to send, so a slow reader
leaves them there. When a worker's last stream closes (the engine died or restarted),
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

_KIND_NAMES = {number: name for name, number in engine_pb2.EventKind.items()}


def kind_name(kind: int) -> str:
    """``EventKind.Name(kind)`` from a table (protobuf's lookup costs a microsecond per event)."""
    name = _KIND_NAMES.get(kind)
    return name if name is not None else engine_pb2.EventKind.Name(kind)


class Subscription:
    """One watch of a worker's events (a WatchEvents stream, or a WatchEvents call on a session
    stream): the worker counts it as attached until ``close``."""

    def __init__(self, events: WorkerEvents, worker: Worker) -> None:
        self._events = events
        self.worker = worker
        self._wake: Callable[[], None] | None = None
        self._started = False
        self.closed = False

    def listen(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` whenever something is queued for this watch (and once now)."""
        self._wake = wake
        self.worker.listeners.append(wake)
        wake()

    def take(self, limit: int) -> tuple[list[engine_pb2.Event], StreamClosed | None]:
        """Up to ``limit`` events queued now (WATCH_STARTED first), without waiting; and the
        stream's end if it came (nothing follows it)."""
        taken: list[engine_pb2.Event] = []
        if not self._started:
            self._started = True
            taken.append(self._events.started())
        queue = self.worker.events
        while len(taken) < limit and not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, StreamClosed):
                return taken, item
            taken.append(item)
        if not queue.empty() and self._wake is not None:
            self._wake()  # more than ``limit``: the reader comes back for the rest
        return taken, None

    def close(self) -> None:
        """Detach from the worker (idempotent); its last stream gone, the worker is dropped."""
        if self.closed:
            return
        self.closed = True
        if self._wake is not None and self._wake in self.worker.listeners:
            self.worker.listeners.remove(self._wake)
        self._events.detach(self.worker)


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
        """Queue ``event`` for every worker of the engine. The caller hands ``event`` over: the last
        worker queues it as it is (the others a copy each), so it must not change it afterwards."""
        engine = self._registry.engines.get(engine_id)
        if engine is None:
            return
        self._metrics.child(self._metrics.events, kind_name(event.kind)).inc()
        workers = engine.ordered_workers()
        last = workers[-1] if workers else None
        for worker in workers:
            if worker.overflowed:
                continue
            if worker.events.qsize() >= self._settings.max_queued_events:
                worker.overflowed = True
                log.error("event_queue_overflow", worker=worker.worker_id, queued=worker.events.qsize())
                reason = f"more than {self._settings.max_queued_events} events were not consumed"
                self._queue(worker, StreamClosed(reason, True))
                continue
            if worker is last:
                self._queue(worker, event)  # nobody else gets it: no copy
                continue
            copy = engine_pb2.Event()
            copy.CopyFrom(event)
            self._queue(worker, copy)

    def close(self, worker: Worker, reason: str) -> None:
        """End the worker's stream (it was removed, or the sidecar stops)."""
        self._queue(worker, StreamClosed(reason))

    @staticmethod
    def _queue(worker: Worker, item: engine_pb2.Event | StreamClosed) -> None:
        worker.events.put_nowait(item)
        for wake in worker.listeners:
            wake()

    def started(self) -> engine_pb2.Event:
        """The first event of every watch."""
        return engine_pb2.Event(kind=engine_pb2.WATCH_STARTED, sidecar_id=self._sidecar_id)

    def subscribe(self, request: engine_pb2.WatchEventsRequest) -> Subscription:
        """Attach a watch to the worker ``request`` names (NOT_FOUND if it is not registered)."""
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
        return Subscription(self, worker)

    def detach(self, worker: Worker) -> None:
        worker.watchers -= 1
        if worker.watchers == 0 and self._registry.by_agent(worker.agent_name) is worker and not self.draining:
            # The worker's connection is gone: the engine restarted or died.
            self.on_detached(worker)

    async def watch(self, request: engine_pb2.WatchEventsRequest) -> AsyncIterator[engine_pb2.Event]:
        subscription = self.subscribe(request)
        worker = subscription.worker
        try:
            yield self.started()
            while True:
                event = await worker.events.get()
                if isinstance(event, StreamClosed):
                    if event.exhausted:
                        raise ResourceExhausted(event.reason)
                    return
                yield event
        finally:
            subscription.close()
