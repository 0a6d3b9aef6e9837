"""Moving one request's blocks between a local engine and another engine (remote, or local on the
same node), through the NIXL transport.

An ``EngineView`` describes the other engine uniformly, whether it came from a peer's handshake
or from this sidecar's own registry: its workers' layouts (addresses in the address space of the
sidecar that serves it) and their NIXL agents. Called on the event loop thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvsidecar.v1 import common_pb2, peer_pb2
from sidecar.dataplane.contract import DlistSpec, RemoteAgent, TransferResult, TransferSpec, Transport
from sidecar.dataplane.plan.blocks import check_block_ids
from sidecar.dataplane.plan.compatible import check_compatible
from sidecar.dataplane.plan.descriptors import descriptor_indices, view_descriptors
from sidecar.dataplane.plan.layout import BlockIds, Pairing, PlanError, RegionLayout, Slice, WorkerLayout
from sidecar.dataplane.plan.tp import expected_notifications, pairings, unpaired_targets

_KIND_NAMES = {common_pb2.MEMORY_KIND_DRAM: "DRAM", common_pb2.MEMORY_KIND_VRAM: "VRAM"}


def _ignore(kind: str, detail: str) -> None:
    return None


@dataclass(frozen=True)
class WorkerView:
    layout: WorkerLayout
    agent: RemoteAgent
    mem_type: str


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
        num_groups = 1 + max((region.group_id for region in layout.regions), default=0)
        return check_block_ids(block_ids, num_groups, layout.num_blocks, layout.physical_per_logical)


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
        workers.append(
            WorkerView(
                layout=layout_from_descriptor(worker),
                agent=RemoteAgent(worker.agent_name, worker.agent_metadata),
                mem_type=_KIND_NAMES.get(kind, "DRAM"),
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

    ``timeout`` bounds every transfer; ``not_after`` (monotonic) refuses to post after it."""

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
    # Told of each post and each completion, as (kind, detail): the request's trace.
    on_step: Callable[[str, str], None] = _ignore


class DataPlane:
    """Plans and posts one request's transfers between a local engine and an ``EngineView``."""

    def __init__(self, transport: Transport, sidecar_id: str) -> None:
        self._transport = transport
        self._sidecar_id = sidecar_id

    @staticmethod
    def check(initiator: list[LocalWorker], initiator_tp: int, target: EngineView) -> None:
        check_compatible(
            [w.layout for w in initiator], initiator_tp, [w.layout for w in target.workers], target.tp_size
        )

    async def run(self, job: TransferJob) -> TransferOutcome:
        """Post every transfer of ``job`` (per initiator worker and TP pairing) and wait for all."""
        deadline = time.monotonic() + job.timeout
        target = job.target
        is_mla = target.is_mla
        jobs = []
        for worker in job.initiator:
            local_ids = descriptor_indices(worker.layout, job.initiator_blocks)
            for pairing in pairings(job.initiator_tp, target.tp_size, worker.layout.tp_rank, is_mla):
                other = target.worker(pairing.target_rank, worker.layout.pp_rank)
                jobs.append(self._post(job, worker, other, pairing, local_ids, deadline))
        for rank in unpaired_targets(job.initiator_tp, target.tp_size, is_mla):
            for worker in job.initiator:
                if worker.layout.tp_rank == 0:
                    other = target.worker(rank, worker.layout.pp_rank)
                    payload = self.notice(target, job.target_request_id, job.transfer_id, job.initiator_tp, rank)
                    jobs.append(self._notify_only(worker, other, payload))
        results = list(await asyncio.gather(*jobs))
        failed = [result for result in results if not result.ok]
        return TransferOutcome(
            ok=not failed,
            error="; ".join(sorted({result.error for result in failed})),
            bytes=sum(result.bytes for result in results),
            descriptors=sum(result.descriptors for result in results),
            peer_gone=any(result.peer_gone for result in failed),
            results=results,
        )

    def notice(
        self, target: EngineView, request_id: str, transfer_id: str, initiator_tp: int, target_rank: int
    ) -> bytes:
        return peer_pb2.TransferNotice(
            engine_id=target.engine_id,
            request_id=request_id,
            expected=expected_notifications(initiator_tp, target.tp_size, target_rank, target.is_mla),
            sender_sidecar_id=self._sidecar_id,
            transfer_id=transfer_id,
        ).SerializeToString()

    async def _post(
        self,
        job: TransferJob,
        worker: LocalWorker,
        other: WorkerView,
        pairing: Pairing,
        local_ids: np.ndarray,
        deadline: float,
    ) -> TransferResult:
        remote_ids = descriptor_indices(other.layout, job.target_blocks)
        payload = self.notice(job.target, job.target_request_id, job.transfer_id, job.initiator_tp, pairing.target_rank)
        job.on_step(
            "posted", f"{job.op} {worker.agent_name} -> {other.agent.name} ({len(remote_ids)} blocks x regions)"
        )
        result = await self._transport.transfer(
            TransferSpec(
                agent_name=worker.agent_name,
                op=job.op,
                remote=other.agent,
                local_list=_view_spec(worker.layout, pairing.initiator_slice, worker.mem_type),
                local_indices=local_ids,
                remote_list=_view_spec(other.layout, pairing.target_slice, other.mem_type),
                remote_indices=remote_ids,
                notification=payload,
                deadline=deadline,
                not_after=job.not_after,
            )
        )
        job.on_step("nixl_completion", _describe(job.op, worker.agent_name, result))
        return result

    async def _notify_only(self, worker: LocalWorker, other: WorkerView, payload: bytes) -> TransferResult:
        try:
            await self._transport.notify(worker.agent_name, other.agent, payload)
        except Exception as exc:
            return TransferResult(False, f"notification failed: {exc}")
        return TransferResult(True)


def _describe(op: str, agent_name: str, result: TransferResult) -> str:
    if not result.ok:
        return f"{op} on {agent_name} failed: {result.error}"
    return (
        f"{op} on {agent_name} done: {result.bytes} bytes, {result.descriptors} descriptors, "
        f"post {result.post_s * 1000:.3f} ms, transfer {result.duration_s * 1000:.3f} ms"
    )


def _view_spec(layout: WorkerLayout, view: Slice, mem_type: str) -> DlistSpec:
    return DlistSpec(
        key=("view", view.index, view.count), build=lambda: view_descriptors(layout, view), mem_type=mem_type
    )
