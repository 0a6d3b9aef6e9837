"""Registered engines and their workers: geometry, mapped memory, NIXL agent, event queue.

Bookkeeping only; the node does the I/O (mapping memory, creating agents) around it. Lives on the
event loop thread.
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kvsidecar import voucher
from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar.dataplane import device_copy
from sidecar.dataplane.contract import RemoteAgent
from sidecar.dataplane.memory import MappedMemory
from sidecar.dataplane.plan.layout import WorkerLayout
from sidecar.dataplane.views import EngineView, LocalWorker, WorkerView
from sidecar.errors import FailedPrecondition, NotFound, PermissionDenied

WorkerKey = tuple[str, int, int]  # (engine_id, pp_rank, tp_rank)

PRODUCER_ROLES = (common_pb2.ENGINE_ROLE_PRODUCER, common_pb2.ENGINE_ROLE_BOTH)
CONSUMER_ROLES = (common_pb2.ENGINE_ROLE_CONSUMER, common_pb2.ENGINE_ROLE_BOTH)


def worker_id(engine_id: str, pp_rank: int, tp_rank: int) -> str:
    return f"{engine_id}/pp{pp_rank}/tp{tp_rank}"


class StreamClosed:
    """Queued to a worker's event queue to end its WatchEvents stream."""

    def __init__(self, reason: str, exhausted: bool = False) -> None:
        self.reason = reason
        self.exhausted = exhausted


@dataclass
class Worker:
    engine_id: str
    tp_rank: int
    pp_rank: int
    agent_name: str
    agent_metadata: bytes
    layout: WorkerLayout
    geometry: common_pb2.KvGeometry
    memories: list[MappedMemory]
    mem_type: str
    registered_bytes: int
    pid: int
    fingerprint: bytes
    events: asyncio.Queue[engine_pb2.Event | StreamClosed]
    watchers: int = 0
    # Called after each event queued (``core.events``): wakes a session stream that watches it.
    listeners: list[Callable[[], None]] = field(default_factory=list)
    overflowed: bool = False
    attach_timer: asyncio.TimerHandle | None = None
    # A VRAM worker's: the sidecar's pinned pool registered with its agent, (address, length,
    # chunk_bytes), served to peers' Stage calls (dataplane.target_staging); None: not offered.
    staging_pool: tuple[int, int, int] | None = None

    @property
    def key(self) -> WorkerKey:
        return (self.engine_id, self.pp_rank, self.tp_rank)

    @property
    def worker_id(self) -> str:
        return worker_id(self.engine_id, self.pp_rank, self.tp_rank)

    def local(self) -> LocalWorker:
        return LocalWorker(self.layout, self.agent_name, self.mem_type)

    def descriptor(self) -> peer_pb2.WorkerDescriptor:
        kind = common_pb2.MEMORY_KIND_VRAM if self.mem_type == "VRAM" else common_pb2.MEMORY_KIND_DRAM
        node = device_copy.node_id()
        return peer_pb2.WorkerDescriptor(
            # A same-node peer opens VRAM itself and device-copies (dataplane.device_copy).
            node_local_exports=[
                peer_pb2.NodeLocalExport(
                    cuda_ipc_handle=memory.ipc_handle,
                    offset=memory.ipc_offset,
                    length=memory.length,
                    address=memory.address,
                    gpu_uuid=memory.gpu_uuid,
                    node_id=node,
                )
                for memory in self.memories
                if memory.kind == "VRAM" and memory.ipc_handle and memory.gpu_uuid and node
            ],
            staging_pool=(
                peer_pb2.StagingPool(
                    address=self.staging_pool[0],
                    length=self.staging_pool[1],
                    chunk_bytes=self.staging_pool[2],
                    accepts_push=True,  # push staging (core.push_staging)
                )
                if self.staging_pool
                else None
            ),
            tp_rank=self.tp_rank,
            pp_rank=self.pp_rank,
            agent_name=self.agent_name,
            agent_metadata=self.agent_metadata,
            geometry=self.geometry,
            regions=[
                peer_pb2.RemoteRegion(
                    name=region.name,
                    base_address=region.base,
                    block_len=region.block_len,
                    block_stride=region.block_stride,
                    group_id=region.group_id,
                    kind=kind,
                    device_id=self.layout.device_id,
                )
                for region in self.layout.regions
            ],
        )


@dataclass
class Engine:
    engine_id: str
    role: int
    tp_size: int
    pp_size: int
    compatibility_hash: str
    engine_version: str
    workers: dict[tuple[int, int], Worker] = field(default_factory=dict)
    generation: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # Signs and checks the engine's pull vouchers (kvsidecar.voucher); new with every generation,
    # so a voucher from before a (re-)registration verifies nowhere.
    voucher_key: bytes = field(default_factory=lambda: secrets.token_bytes(voucher.KEY_BYTES))
    # The uid whose engine-socket call registered the first worker: only it (and root or the
    # daemon's uid) may act on the engine. None: registered in-process, anyone's.
    owner_uid: int | None = None

    @property
    def complete(self) -> bool:
        return len(self.workers) == self.tp_size * self.pp_size

    def new_generation(self) -> None:
        """A worker came or went: peers' cached views and vouchers of the old one are stale."""
        self.generation = uuid.uuid4().hex[:12]
        self.voucher_key = secrets.token_bytes(voucher.KEY_BYTES)

    @property
    def num_groups(self) -> int:
        first = next(iter(self.workers.values()), None)
        if first is None:
            return 0
        return first.layout.num_groups

    @property
    def num_blocks(self) -> int:
        first = next(iter(self.workers.values()), None)
        return first.layout.num_blocks if first else 0

    @property
    def physical_per_logical(self) -> int:
        first = next(iter(self.workers.values()), None)
        return first.layout.physical_per_logical if first else 1

    def ordered_workers(self) -> list[Worker]:
        return [self.workers[key] for key in sorted(self.workers)]

    def local_workers(self) -> list[LocalWorker]:
        return [worker.local() for worker in self.ordered_workers()]

    def descriptor(self) -> peer_pb2.EngineDescriptor:
        return peer_pb2.EngineDescriptor(
            engine_id=self.engine_id,
            role=self.role,  # type: ignore[arg-type]
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            compatibility_hash=self.compatibility_hash,
            engine_version=self.engine_version,
            workers=[worker.descriptor() for worker in self.ordered_workers()],
            generation=self.generation,
            voucher_key=self.voucher_key,
        )

    def view(self, address: str, sidecar_id: str) -> EngineView:
        """This engine as an ``EngineView`` (the same-node path uses it as the other side)."""
        return EngineView(
            engine_id=self.engine_id,
            address=address,
            sidecar_id=sidecar_id,
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            compatibility_hash=self.compatibility_hash,
            generation=self.generation,
            workers=tuple(
                WorkerView(worker.layout, RemoteAgent(worker.agent_name, worker.agent_metadata), worker.mem_type)
                for worker in self.ordered_workers()
            ),
            voucher_key=self.voucher_key,
        )


class Registry:
    """Engines by id; workers by (engine, pp, tp) and by NIXL agent name."""

    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}
        self._by_agent: dict[str, Worker] = {}
        # Calls waiting for an engine to be complete (core.arrivals), resolved by add().
        self._arrivals: dict[str, list[asyncio.Future[None]]] = {}

    def worker(self, engine_id: str, tp_rank: int, pp_rank: int) -> Worker | None:
        engine = self.engines.get(engine_id)
        return None if engine is None else engine.workers.get((pp_rank, tp_rank))

    def by_agent(self, agent_name: str) -> Worker | None:
        return self._by_agent.get(agent_name)

    def agent_names(self, engine_id: str) -> list[str]:
        """The NIXL agents of ``engine_id``'s workers here (none if it is gone)."""
        engine = self.engines.get(engine_id)
        return [worker.agent_name for worker in engine.ordered_workers()] if engine is not None else []

    def engine_versions(self) -> str:
        """The registered engines' versions, for this sidecar's ``SidecarInfo``."""
        return ", ".join(sorted({engine.engine_version for engine in self.engines.values() if engine.engine_version}))

    def add(self, engine: Engine, worker: Worker) -> None:
        engine.workers[(worker.pp_rank, worker.tp_rank)] = worker
        engine.new_generation()
        self.engines[engine.engine_id] = engine
        self._by_agent[worker.agent_name] = worker
        if engine.complete:
            for waiter in self._arrivals.pop(engine.engine_id, []):
                if not waiter.done():
                    waiter.set_result(None)

    def is_complete(self, engine_id: str) -> bool:
        engine = self.engines.get(engine_id)
        return engine is not None and engine.complete

    @property
    def arrival_waiters(self) -> int:
        return sum(len(waiters) for waiters in self._arrivals.values())

    async def wait_complete(self, engine_id: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``engine_id`` to be registered with all its workers."""
        if self.is_complete(engine_id):
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._arrivals.setdefault(engine_id, [])
        waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
            return True
        except TimeoutError:
            return False
        finally:
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._arrivals.pop(engine_id, None)

    def remove(self, worker: Worker) -> None:
        engine = self.engines.get(worker.engine_id)
        self._by_agent.pop(worker.agent_name, None)
        if engine is None:
            return
        engine.workers.pop((worker.pp_rank, worker.tp_rank), None)
        engine.new_generation()
        if not engine.workers:
            del self.engines[worker.engine_id]

    def require_owner(self, engine_id: str, uid: int | None, method: str) -> None:
        """PERMISSION_DENIED unless ``uid`` may act on ``engine_id``: its owner, or any uid while
        the engine is not registered. A ``uid`` of None acts on every engine (root, the daemon's
        uid, in-process callers: ``api.engine_auth.acting_uid``)."""
        engine = self.engines.get(engine_id)
        if uid is None or engine is None or engine.owner_uid is None or engine.owner_uid == uid:
            return
        raise PermissionDenied(
            f"{method}: engine {engine_id!r} belongs to uid {engine.owner_uid}; "
            f"uid {uid} may act only on its own engines"
        )

    def require_engine(self, engine_id: str, field_name: str, roles: tuple[int, ...] | None = None) -> Engine:
        """The complete engine ``engine_id``, or a NOT_FOUND / FAILED_PRECONDITION error."""
        engine = self.engines.get(engine_id)
        if engine is None:
            raise NotFound(f"{field_name}: engine {engine_id!r} is not registered with this sidecar")
        if not engine.complete:
            raise FailedPrecondition(
                f"engine {engine_id!r} has {len(engine.workers)} of {engine.tp_size * engine.pp_size} "
                "workers registered"
            )
        if roles is not None and engine.role not in roles:
            role = common_pb2.EngineRole.Name(engine.role)
            raise FailedPrecondition(f"engine {engine_id!r} is registered as {role}, which cannot do this")
        return engine

    @property
    def workers(self) -> list[Worker]:
        return list(self._by_agent.values())
