"""The values the data plane moves between: another engine as seen from here (``EngineView``,
its ``WorkerView``s, built from a peer's handshake by ``view_from_descriptor`` or from this
sidecar's own registry), a local worker (``LocalWorker``), one request's transfers
(``TransferJob``) and their outcome (``TransferOutcome``). Pure values: the registry, the peer
client and core import them without importing the mover (``plane``). Any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvsidecar.v1 import common_pb2, peer_pb2
from sidecar.dataplane.contract import NodeExport, RemoteAgent, TransferResult
from sidecar.dataplane.plan.blocks import check_block_ids
from sidecar.dataplane.plan.layout import BlockIds, PlanError, RegionLayout, WorkerLayout

_KIND_NAMES = {common_pb2.MEMORY_KIND_DRAM: "DRAM", common_pb2.MEMORY_KIND_VRAM: "VRAM"}


class StepHook(Protocol):
    """What the data plane tells a request's trace: a step, and durations measured inside it."""

    def __call__(self, kind: str, detail: str, measured: dict[str, float] | None = None) -> None: ...


def _ignore(kind: str, detail: str, measured: dict[str, float] | None = None) -> None:
    return None


@dataclass(frozen=True)
class WorkerView:
    layout: WorkerLayout
    agent: RemoteAgent
    mem_type: str
    # A peer's VRAM worker: what a sidecar on the same node needs to open its memory itself
    # (empty for DRAM workers, this sidecar's own engines, and peers older than this field).
    exports: tuple[NodeExport, ...] = ()
    # A peer's VRAM worker whose sidecar stages it for READs (``target_staging``): its pinned
    # pool (address, length, chunk_bytes) in that sidecar's address space; None: not offered.
    staging_pool: tuple[int, int, int] | None = None
    # That sidecar also lends pool slots for a push into the worker (``staged_push``).
    accepts_push: bool = False


@dataclass(frozen=True)
class EngineView:
    """Another engine as seen from here."""

    engine_id: str
    address: str
    sidecar_id: str
    tp_size: int
    pp_size: int
    compatibility_hash: str
    generation: str
    workers: tuple[WorkerView, ...]
    # Checks the engine's pull vouchers for this generation (kvsidecar.voucher); b"" if unknown.
    voucher_key: bytes = b""

    def worker(self, tp_rank: int, pp_rank: int) -> WorkerView:
        for worker in self.workers:
            if worker.layout.tp_rank == tp_rank and worker.layout.pp_rank == pp_rank:
                return worker
        raise PlanError(f"engine {self.engine_id} has no worker tp{tp_rank}/pp{pp_rank}")

    @property
    def agent_names(self) -> list[str]:
        return [worker.agent.name for worker in self.workers]

    @property
    def is_mla(self) -> bool:
        return bool(self.workers) and self.workers[0].layout.is_mla

    def block_ids_problem(self, block_ids: BlockIds) -> str | None:
        """Why ``block_ids`` do not name blocks of this engine (out of range, repeated, too many
        groups), or None: checked against the geometry its sidecar advertised."""
        if not self.workers:
            return f"engine {self.engine_id} has no workers"
        layout = self.workers[0].layout
        return check_block_ids(block_ids, layout.num_groups, layout.num_blocks, layout.physical_per_logical)


def worker_layout(
    tp_rank: int, pp_rank: int, regions: tuple[RegionLayout, ...], geometry: common_pb2.KvGeometry, device_id: int
) -> WorkerLayout:
    """A worker's layout from its registered geometry (local registration or a peer's handshake)."""
    return WorkerLayout(
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        regions=regions,
        num_blocks=geometry.num_blocks,
        physical_per_logical=geometry.physical_blocks_per_logical or 1,
        block_size=geometry.block_size,
        kv_layout=geometry.kv_layout,
        num_kv_heads=geometry.num_kv_heads,
        total_num_kv_heads=geometry.total_num_kv_heads,
        is_mla=geometry.is_mla,
        device_id=device_id,
        head_size=geometry.head_size,
        dtype=geometry.dtype,
    )


def layout_from_descriptor(worker: peer_pb2.WorkerDescriptor) -> WorkerLayout:
    regions = tuple(
        RegionLayout(region.name, region.base_address, region.block_len, region.block_stride, region.group_id)
        for region in worker.regions
    )
    device_id = worker.regions[0].device_id if worker.regions else 0
    return worker_layout(worker.tp_rank, worker.pp_rank, regions, worker.geometry, device_id)


def view_from_descriptor(address: str, sidecar_id: str, engine: peer_pb2.EngineDescriptor) -> EngineView:
    workers = []
    for worker in engine.workers:
        kind = worker.regions[0].kind if worker.regions else common_pb2.MEMORY_KIND_DRAM
        exports = tuple(
            NodeExport(e.cuda_ipc_handle, e.offset, e.length, e.address, e.gpu_uuid, e.node_id)
            for e in worker.node_local_exports
        )
        pool = worker.staging_pool if worker.HasField("staging_pool") else None
        workers.append(
            WorkerView(
                layout=layout_from_descriptor(worker),
                agent=RemoteAgent(worker.agent_name, worker.agent_metadata),
                mem_type=_KIND_NAMES.get(kind, "DRAM"),
                exports=exports,
                staging_pool=(pool.address, pool.length, pool.chunk_bytes) if pool and pool.chunk_bytes else None,
                accepts_push=bool(pool and pool.chunk_bytes and pool.accepts_push),
            )
        )
    return EngineView(
        engine_id=engine.engine_id,
        address=address,
        sidecar_id=sidecar_id,
        tp_size=engine.tp_size,
        pp_size=engine.pp_size or 1,
        compatibility_hash=engine.compatibility_hash,
        generation=engine.generation,
        workers=tuple(workers),
        voucher_key=engine.voucher_key,
    )


@dataclass
class TransferOutcome:
    """The result of all transfers of one request."""

    ok: bool
    error: str = ""
    bytes: int = 0
    descriptors: int = 0
    peer_gone: bool = False
    results: list[TransferResult] = field(default_factory=list)


@dataclass(frozen=True)
class LocalWorker:
    """What the data plane needs of a local worker."""

    layout: WorkerLayout
    agent_name: str
    mem_type: str


@dataclass(frozen=True)
class TransferJob:
    """One request's transfers: move ``initiator_blocks`` <-> ``target_blocks`` (same lengths per
    group) between the local ``initiator`` workers and the ``target`` engine with ``op``, each
    transfer notifying ``target_request_id`` on the target side.

    ``timeout`` bounds every transfer; ``not_after`` (monotonic) refuses to post after it. The
    source's blocks (the target's in a READ, the initiator's in a WRITE) hold the request from
    token 0; the destination's may be fewer (a prefix-cache hit): then only the source's tail
    moves. ``num_tokens`` (the request's token count, 0 if unknown) aligns the two when their
    block sizes differ; ``digests`` (integrity) travel in every notification."""

    op: str  # "READ" (pull: the consumer initiates) | "WRITE" (push: the producer initiates)
    initiator: list[LocalWorker]
    initiator_tp: int
    target: EngineView
    initiator_blocks: BlockIds
    target_blocks: BlockIds
    target_request_id: str
    transfer_id: str
    timeout: float
    not_after: float | None = None
    # Told of each post and each completion, with NIXL's own times (the request's trace).
    on_step: StepHook = field(default=_ignore)
    num_tokens: int = 0
    digests: peer_pb2.KvDigests | None = None
