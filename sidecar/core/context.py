"""What every part of the node is handed instead of the node itself: settings, identity, the
registry, the peer client, the data plane and transport, metrics, worker events, the task
spawner and the per-request trace recorder. The node (``core.node``) builds one ``NodeContext``
and gives it to each part; no part imports the node.

Everything here is used on the event loop thread.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvsidecar.v1 import common_pb2
from sidecar import FEATURES, PROTOCOL_VERSION, __version__
from sidecar.config import Settings
from sidecar.core.admission import QueueDelay
from sidecar.core.events import WorkerEvents
from sidecar.core.registry import Registry
from sidecar.core.trace import TraceRecorder
from sidecar.dataplane.contract import Transport
from sidecar.dataplane.plane import DataPlane
from sidecar.errors import DRAINING, Draining, ResourceExhausted
from sidecar.logs import get_logger
from sidecar.metrics import SidecarMetrics
from sidecar.peers.client import PeerClient

log = get_logger("kvsidecar.node")


class Identity:
    """Who this sidecar is: its instance id (new at every start), the address peers reach it at,
    and the ``SidecarInfo`` it names itself with in every peer call."""

    def __init__(self, settings: Settings, nixl_version: str, registry: Registry) -> None:
        self.sidecar_id = uuid.uuid4().hex
        self.advertise_address = settings.advertise or settings.peer_listen
        self.nixl_version = nixl_version
        self.started = time.monotonic()
        self._registry = registry

    def info(self) -> common_pb2.SidecarInfo:
        return common_pb2.SidecarInfo(
            sidecar_id=self.sidecar_id,
            address=self.advertise_address,
            versions=common_pb2.VersionInfo(
                kvsidecar=__version__,
                nixl=self.nixl_version,
                vllm=self._registry.engine_versions(),
                grpc=grpc.__version__,
                protocol=PROTOCOL_VERSION,
                features=FEATURES,
            ),
            clock_unix_s=time.time(),
            hostname=socket.gethostname(),
        )


class Tasks:
    """Background work of requests, remembering which engines each touches (so a worker's memory
    is revoked only after the transfers on it ended), and the node's admission state."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._tasks: dict[asyncio.Task[Any], tuple[str, ...]] = {}
        self.draining = False
        # The transfers this node drives (its pulls' READs, its pushes' WRITEs): admission by the
        # wait a new one would see behind them (``core.admission``).
        self.transfers = QueueDelay("transfers", settings.admission_max_queue_delay_ms / 1000.0)

    def spawn(self, coroutine: Coroutine[Any, Any, Any], engines: list[str]) -> asyncio.Task[Any]:
        """Run a request's work in the background, remembering which engines it touches."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks[task] = tuple(engines)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("background_task_failed", error=repr(task.exception()))

    def touching(self, engine_id: str) -> list[asyncio.Task[Any]]:
        return [task for task, engines in self._tasks.items() if engine_id in engines]

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel_all(self, timeout: float) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    def check_capacity(self, current: int, transfer: bool = False) -> None:
        """Refuse new work while draining, or past ``max_pending_requests``, or (``transfer``: work
        this node drives) past ``admission_max_queue_delay_ms`` of estimated queueing delay."""
        if self.draining:
            raise Draining(DRAINING)
        if current >= self._settings.max_pending_requests:
            raise ResourceExhausted(
                f"{current} requests are pending, the limit is {self._settings.max_pending_requests}"
            )
        if transfer:
            self.transfers.check()


@dataclass(frozen=True)
class NodeContext:
    """The node's shared services, handed to each of its parts."""

    settings: Settings
    identity: Identity
    registry: Registry
    peers: PeerClient
    dataplane: DataPlane
    transport: Transport
    metrics: SidecarMetrics
    events: WorkerEvents
    tasks: Tasks
    # Per-request timelines (``core.trace``); the node passes one sized by ``trace_requests``, a
    # context built without it records nothing.
    trace: TraceRecorder = field(default_factory=lambda: TraceRecorder(0))
