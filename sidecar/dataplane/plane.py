"""Moving one request's blocks between a local engine and another engine (remote, or local on the
same node), through the NIXL transport, or by device copy where both sides' memory is (or can be)
mapped here and one is VRAM (``device_copy``; chosen in ``DataPlane._device_route``).

The other engine is an ``EngineView`` (``views``: the values, built from a peer's handshake or
this sidecar's registry; addresses in the address space of the sidecar that serves it). Called
on the event loop thread.

Two paths:
- *byte for byte* (same tokens per block and layout; head slices for different TP sizes): whole
  blocks through views NIXL prepared once (``planning``);
- *converted* (block size, layout, or TP with a token-major layout differ): per (initiator,
  target) worker pair, a token-level plan (``plan.convert``). Where its descriptor runs are long
  enough, NIXL moves them directly; where they are short the pair goes through a DRAM staging
  buffer and a local permutation (``convert_staging``).

Device copy (node-local GPU memory): the same plans (byte for byte or converted) give (dst, src,
nbytes) rows in this process's addresses, ONE batched launch per request and device, waited for
off the loop within the transfer's deadline; then each target worker gets the notification NIXL
would have carried (delivered in-process for an engine of this sidecar, through the transport's
notify for a peer sidecar's). The trace's completion event says ``path=device_copy`` (or
``path=nixl``) and measures the copy's own post -> done as ``copy_transfer``.

Host staging (a local GPU worker that no device copy serves: another node): either path's rows
go to ``host_staging`` (``DataPlane._stages``), which copies them GPU <-> the sidecar's pinned
pool in chunks overlapped with NIXL moving the pool (``path=host_staging``); a peer that stages
its own GPU side is asked through ``target_staging`` / ``staged_push``.

Every transfer's notification says what ended (``TransferNotice.mode``: PULL for a READ, PUSH for
a WRITE), so the target's sidecar hands it to the one side it names. The device-copy path reuses
``run``'s pairing and notices, so it sits here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import numpy as np

from kvsidecar.v1 import common_pb2, peer_pb2
from sidecar.dataplane import device_copy
from sidecar.dataplane.contract import (
    DlistSpec,
    NotificationsCallback,
    RunsSpec,
    TransferResult,
    TransferSpec,
    Transport,
    XferDoneCallback,
)
from sidecar.dataplane.convert_staging import STAGING_BELOW_BYTES, ConvertedMove, Span, staged
from sidecar.dataplane.host_staging import PATH as HOST_STAGING
from sidecar.dataplane.host_staging import HostStaging, StagedMove, describe_staged
from sidecar.dataplane.integrity import DigestSpan
from sidecar.dataplane.integrity import granule as digest_granule
from sidecar.dataplane.plan.blocks import trim_to_tail
from sidecar.dataplane.plan.convert import (
    Side,
    block_shape,
    check_exchange,
    needs_conversion,
    predicted_run_bytes,
    run_descriptors,
    single_group,
    transfer_span,
)
from sidecar.dataplane.plan.descriptors import descriptor_indices, view_descriptors
from sidecar.dataplane.plan.layout import BlockIds, Pairing, PlanError, Slice, WorkerLayout
from sidecar.dataplane.plan.tp import expected_notifications, pairings, unpaired_targets
from sidecar.dataplane.staged_push import LentSlot, PushStager
from sidecar.dataplane.target_staging import RemoteStager, StagedSlot, StagingServer, pack_rows
from sidecar.dataplane.views import EngineView, LocalWorker, TransferJob, TransferOutcome, WorkerView

# Asks a peer sidecar (address) to stage a chunk (PeerService.Stage).
StageRemote = Callable[[str, peer_pb2.StageRequest], Awaitable[peer_pb2.StageResponse]]


class DataPlane:
    """Plans and posts one request's transfers between a local engine and an ``EngineView``."""

    def __init__(
        self,
        transport: Transport,
        sidecar_id: str,
        staging_below_bytes: int = STAGING_BELOW_BYTES,
        deliver_local: NotificationsCallback | None = None,
        host_staging: HostStaging | None = None,
        on_xfer_done: XferDoneCallback | None = None,
    ) -> None:
        self._transport = transport
        self._sidecar_id = sidecar_id
        self.staging_below_bytes = staging_below_bytes
        # Notifications for this sidecar's own agents (the node's, as if NIXL brought them).
        self._deliver_local = deliver_local
        # A local GPU worker's transfers through pinned host memory (None: never; host_staging.py).
        self.host_staging = host_staging
        # The transfer metrics for the paths the transport does not see whole (device copies,
        # staged transfers); the transport reports its own NIXL transfers.
        self._on_xfer_done = on_xfer_done
        # False: NIXL (or host staging) even where a device copy could run; host staging's
        # "always" mode turns it off (the cross-node path, forced on one node).
        self.device_copy = not (host_staging is not None and host_staging.forced)
        self.peer_memory = device_copy.PeerMappings()
        # Target-side staging, both roles: this sidecar's VRAM workers' pool served to peers
        # (None: host staging off or no GPU), and the call that asks a peer to stage (the node
        # sets it; None: never ask).
        self.staging_server: StagingServer | None = None
        if host_staging is not None and host_staging.settings.mode != "off":
            self.staging_server = StagingServer(host_staging.pool)
        self.stage_remote: StageRemote | None = None
        # Device copies past their deadline whose transfer's outcome waits for them (metrics).
        self.late_copies = device_copy.LateCopies()
        if host_staging is not None:
            host_staging.late_copies = self.late_copies

    def expect_notifications(self, delta: int) -> None:
        """A request of ours starts (+1) or stops (-1) waiting for the notifications of transfers
        into or out of its engine: the transport polls for them while any request waits."""
        self._transport.expect_notifications(delta)

    @staticmethod
    def converts(initiator: list[LocalWorker], initiator_tp: int, target: EngineView) -> bool:
        if not initiator or not target.workers:
            return False
        return needs_conversion(initiator[0].layout, initiator_tp, target.workers[0].layout, target.tp_size)

    @staticmethod
    def check(
        initiator: list[LocalWorker], initiator_tp: int, target: EngineView, names: tuple[str, str] = ("here", "")
    ) -> None:
        """Raise PlanError unless KV can move between the engines; the message names both sides'
        values, each followed by its side's name in ``names`` (local, then the target's engine)."""
        names = (names[0], names[1] or f"on {target.engine_id}")
        mine, theirs = [w.layout for w in initiator], [w.layout for w in target.workers]
        check_exchange(mine, initiator_tp, theirs, target.tp_size, names)

    async def run(self, job: TransferJob) -> TransferOutcome:
        """Post every transfer of ``job`` (per initiator worker and TP pairing) and wait for all."""
        deadline = time.monotonic() + job.timeout
        target = job.target
        is_mla = target.is_mla
        jobs = []
        converted = self.converts(job.initiator, job.initiator_tp, target)
        if converted:
            span = self._span(job.op, job.initiator, target, job.initiator_blocks, job.target_blocks, job.num_tokens)
        elif _same_lengths(job.initiator_blocks, job.target_blocks):
            pass  # nothing to trim (no prefix hit): the job as it is, not a copy of it
        elif job.op == "READ":
            job = replace(job, target_blocks=trim_to_tail(job.target_blocks, job.initiator_blocks))
        else:
            job = replace(job, initiator_blocks=trim_to_tail(job.initiator_blocks, job.target_blocks))
        route = await self._device_route(job.initiator, target)
        if route is not None:
            return await self._device_copy(job, route, span if converted else None, deadline)
        for worker in job.initiator:
            for pairing in pairings(job.initiator_tp, target.tp_size, worker.layout.tp_rank, is_mla):
                other = target.worker(pairing.target_rank, worker.layout.pp_rank)
                payload = self.notice(job, pairing.target_rank)
                if converted:
                    local = Side(
                        worker.layout, single_group(job.initiator_blocks, "the local engine"), span.initiator_first
                    )
                    remote = Side(other.layout, single_group(job.target_blocks, "the peer"), span.target_first)
                    move = ConvertedMove(job.op, worker, other, local, remote, span, payload, deadline, job.not_after)
                    jobs.append(self._traced_converted(job, move))
                else:
                    local_ids = descriptor_indices(worker.layout, job.initiator_blocks)
                    jobs.append(self._post(job, worker, other, pairing, local_ids, payload, deadline))
        for rank in unpaired_targets(job.initiator_tp, target.tp_size, is_mla):
            for worker in job.initiator:
                if worker.layout.tp_rank == 0:
                    other = target.worker(rank, worker.layout.pp_rank)
                    payload = self.notice(job, rank)
                    jobs.append(self._notify_only(worker, other, payload))
        # One transfer (TP 1, the common case) is awaited in place: gather would wrap it in a task
        # that starts a loop iteration later, after whatever else is ready.
        results = [await jobs[0]] if len(jobs) == 1 else list(await asyncio.gather(*jobs))
        failed = [result for result in results if not result.ok]
        return TransferOutcome(
            ok=not failed,
            error="; ".join(sorted({result.error for result in failed})),
            bytes=sum(result.bytes for result in results),
            descriptors=sum(result.descriptors for result in results),
            peer_gone=any(result.peer_gone for result in failed),
            results=results,
        )

    async def _device_route(self, initiator: list[LocalWorker], target: EngineView) -> dict[str, WorkerView] | None:
        """The path selection: the target's workers with addresses of this process where a device
        copy moves this transfer, else None (NIXL). A device copy needs one side in VRAM and both
        mapped here: the target is an engine of this sidecar, or a peer sidecar's VRAM engine on
        this node whose handles open here (a peer without them, an older one, keeps NIXL).
        DRAM <-> DRAM is always NIXL."""
        if not self.device_copy or not initiator or not target.workers:
            return None
        kinds = {initiator[0].mem_type, *(worker.mem_type for worker in target.workers)}
        if "VRAM" not in kinds:
            return None
        if target.sidecar_id == self._sidecar_id:
            return {worker.agent.name: worker for worker in target.workers}
        if not all(worker.mem_type == "VRAM" and worker.exports for worker in target.workers):
            return None
        route = {}
        for worker in target.workers:
            mapping = await self.peer_memory.map_worker(worker.agent.name, worker.exports)
            if mapping is None:
                return None
            try:
                route[worker.agent.name] = replace(worker, layout=mapping.translate(worker.layout))
            except PlanError:
                return None
        return route

    async def _device_copy(
        self, job: TransferJob, route: dict[str, WorkerView], span: Span | None, deadline: float
    ) -> TransferOutcome:
        """Every (initiator, target) pair's rows of ``job`` in ONE batched copy per device, then
        each target worker's notification, as NIXL would have sent it."""
        target = job.target
        batches: dict[int, list[np.ndarray]] = {}
        notices: list[tuple[LocalWorker, WorkerView, bytes]] = []
        for worker in job.initiator:
            for pairing in pairings(job.initiator_tp, target.tp_size, worker.layout.tp_rank, target.is_mla):
                other = target.worker(pairing.target_rank, worker.layout.pp_rank)
                here = route[other.agent.name]
                rows = self._copy_rows(job, worker, here, pairing, span)
                device = worker.layout.device_id if worker.mem_type == "VRAM" else here.layout.device_id
                batches.setdefault(device, []).append(rows)
                payload = self.notice(job, pairing.target_rank)
                notices.append((worker, other, payload))
        for rank in unpaired_targets(job.initiator_tp, target.tp_size, target.is_mla):
            for worker in job.initiator:
                if worker.layout.tp_rank == 0:
                    other = target.worker(rank, worker.layout.pp_rank)
                    payload = self.notice(job, rank)
                    notices.append((worker, other, payload))
        merged = {device: np.concatenate(parts) for device, parts in batches.items()}
        copies = sum(len(rows) for rows in merged.values())
        names = ", ".join(sorted({worker.agent_name for worker in job.initiator}))
        job.on_step(
            "posted",
            f"{job.op} {names} -> {target.engine_id} path=device_copy ({copies} copies, GPUs {sorted(merged)})",
        )
        peer = target.sidecar_id != self._sidecar_id
        if peer:
            self.peer_memory.hold(route)
        try:
            copied = await device_copy.run_copies(merged, deadline, job.not_after, self.late_copies)
        finally:
            if peer:
                await self.peer_memory.release(route)
        result = TransferResult(
            copied.ok, copied.error, bytes=copied.bytes, descriptors=copies, duration_s=copied.duration_s,
            post_s=copied.post_s,
        )  # fmt: skip
        if not copied.ok:
            job.on_step("nixl_completion", f"{job.op} on {names} failed: {copied.error} path=device_copy")
            return TransferOutcome(False, copied.error, results=[result])
        self._observe(job.op, result, device_copy.PATH)
        job.on_step(
            "nixl_completion",
            f"{job.op} on {names} done: {copied.bytes} bytes, {copies} copies in {copied.runs} runs, "
            f"{copied.launches} launches, post {copied.post_s * 1000:.3f} ms, transfer "
            f"{copied.duration_s * 1000:.3f} ms path=device_copy",
            {"nixl_post": copied.post_s, "nixl_transfer": copied.duration_s, "copy_transfer": copied.duration_s},
        )
        results = [result, *await self._notify_all(notices, local=not peer)]
        failed = [r for r in results if not r.ok]
        return TransferOutcome(
            ok=not failed,
            error="; ".join(sorted({r.error for r in failed})),
            bytes=copied.bytes,
            descriptors=copies,
            results=results,
        )

    @staticmethod
    def _copy_rows(
        job: TransferJob, worker: LocalWorker, other: WorkerView, pairing: Pairing, span: Span | None
    ) -> np.ndarray:
        """One pair's (dst, src, nbytes) rows, from the same plan NIXL's descriptors come from."""
        if span is None:
            local_ids = descriptor_indices(worker.layout, job.initiator_blocks)
            remote_ids = descriptor_indices(other.layout, job.target_blocks)
            local = device_copy.selected_descriptors(worker.layout, pairing.initiator_slice, local_ids)
            remote = device_copy.selected_descriptors(other.layout, pairing.target_slice, remote_ids)
            return device_copy.copy_rows(job.op, local, remote)
        mine = Side(worker.layout, single_group(job.initiator_blocks, "the local engine"), span.initiator_first)
        theirs = Side(other.layout, single_group(job.target_blocks, "the peer"), span.target_first)
        source, dest = (theirs, mine) if job.op == "READ" else (mine, theirs)
        src, dst = run_descriptors(source, dest, span.first, span.end)
        return device_copy.copy_rows("READ", dst, src)

    async def _notify_all(
        self, notices: list[tuple[LocalWorker, WorkerView, bytes]], local: bool
    ) -> list[TransferResult]:
        """The notifications a device copy's target workers would have had from NIXL: handed to
        this node's notification handler on the next loop iteration (as NIXL's owner thread
        does), or sent through the transport to a peer sidecar's agents."""
        if local and self._deliver_local is not None:
            batch = [(other.agent.name, payload) for _, other, payload in notices]
            asyncio.get_running_loop().call_soon(self._deliver_local, batch, time.monotonic())
            return []
        return list(await asyncio.gather(*(self._notify_only(w, other, payload) for w, other, payload in notices)))

    def notice(self, job: TransferJob, target_rank: int) -> bytes:
        """The notification target worker ``target_rank`` gets once ``job``'s transfer to or from it
        ended; its ``mode`` names the side of the target's sidecar it is for (a READ: the producer;
        a WRITE: the consumer)."""
        target = job.target
        return peer_pb2.TransferNotice(
            mode=common_pb2.TRANSFER_MODE_PUSH if job.op == "WRITE" else common_pb2.TRANSFER_MODE_PULL,
            engine_id=target.engine_id,
            request_id=job.target_request_id,
            expected=expected_notifications(job.initiator_tp, target.tp_size, target_rank, target.is_mla),
            sender_sidecar_id=self._sidecar_id,
            transfer_id=job.transfer_id,
            digests=job.digests,
        ).SerializeToString()

    def digest_span(
        self,
        op: str,
        initiator: list[LocalWorker],
        initiator_tp: int,
        target: EngineView,
        initiator_blocks: BlockIds,
        target_blocks: BlockIds,
        num_tokens: int,
    ) -> DigestSpan:
        """The tokens a transfer moves, for integrity digests (same arguments as ``run``)."""
        mine, theirs = initiator[0].layout, target.workers[0].layout
        if self.converts(initiator, initiator_tp, target):
            span = self._span(op, initiator, target, initiator_blocks, target_blocks, num_tokens)
            return DigestSpan(span.first, span.end, digest_granule(mine, theirs))
        local = single_group(initiator_blocks, "the local engine")
        remote = single_group(target_blocks, "the peer")
        source, dest = (remote, local) if op == "READ" else (local, remote)
        capacity = len(source) * mine.block_size
        first = (len(source) - len(dest)) * mine.block_size
        end = num_tokens if first < num_tokens <= capacity else capacity
        return DigestSpan(first, end, digest_granule(mine, theirs))

    @staticmethod
    def _span(
        op: str,
        initiator: list[LocalWorker],
        target: EngineView,
        initiator_blocks: BlockIds,
        target_blocks: BlockIds,
        num_tokens: int,
    ) -> Span:
        mine, theirs = initiator[0].layout, target.workers[0].layout
        local = single_group(initiator_blocks, "the local engine")
        remote = single_group(target_blocks, "the peer")
        if op == "READ":
            first, end = transfer_span(num_tokens, len(remote), theirs.block_size, len(local), mine.block_size)
            return Span(first, end, first, 0)
        first, end = transfer_span(num_tokens, len(local), mine.block_size, len(remote), theirs.block_size)
        return Span(first, end, 0, first)

    async def _traced_converted(self, job: TransferJob, move: ConvertedMove) -> TransferResult:
        span, mine, theirs = move.span, move.worker.agent_name, move.other.agent.name
        if self._stages(move.worker, move.other, move.op):
            source, dest = (move.remote, move.local) if move.op == "READ" else (move.local, move.remote)
            try:
                src, dst = run_descriptors(source, dest, span.first, span.end)
            except PlanError as exc:
                return TransferResult(False, f"conversion failed: {exc}")
            rows = (dst, src) if move.op == "READ" else (src, dst)
            return await self._host_staged(job, move.worker, move.other, rows, move.payload, move.deadline)
        job.on_step("posted", f"{job.op} {mine} -> {theirs} (converted, tokens {span.first}..{span.end - 1})")
        result = await self._post_converted(move)
        job.on_step("nixl_completion", _describe(job.op, mine, result), _measured(result))
        return result

    async def _post_converted(self, move: ConvertedMove) -> TransferResult:
        op, worker, other, span = move.op, move.worker, move.other, move.span
        source, dest = (move.remote, move.local) if op == "READ" else (move.local, move.remote)
        shapes = [block_shape(side.worker, side.worker.regions[0]) for side in (source, dest)]
        if worker.mem_type == "DRAM" and predicted_run_bytes(*shapes) < self.staging_below_bytes:
            try:
                return await staged(self._transport, move, lambda: self._notify_only(worker, other, move.payload))
            except (PlanError, ValueError, IndexError) as exc:  # a plan or a copy that does not fit
                return TransferResult(False, f"conversion failed: {exc}")
        src, dst = run_descriptors(source, dest, span.first, span.end)
        if not len(src):
            return await self._notify_only(worker, other, move.payload)
        mine, theirs = (dst, src) if op == "READ" else (src, dst)
        return await self._transport.transfer_runs(
            RunsSpec(
                worker.agent_name, op, other.agent, mine, worker.mem_type, theirs, other.mem_type, move.payload,
                move.deadline, move.not_after,
            )
        )  # fmt: skip

    async def _post(
        self,
        job: TransferJob,
        worker: LocalWorker,
        other: WorkerView,
        pairing: Pairing,
        local_ids: np.ndarray,
        payload: bytes,
        deadline: float,
    ) -> TransferResult:
        remote_ids = descriptor_indices(other.layout, job.target_blocks)
        if self._stages(worker, other, job.op):
            rows = (
                device_copy.selected_descriptors(worker.layout, pairing.initiator_slice, local_ids),
                device_copy.selected_descriptors(other.layout, pairing.target_slice, remote_ids),
            )
            return await self._host_staged(job, worker, other, rows, payload, deadline)
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
        job.on_step("nixl_completion", _describe(job.op, worker.agent_name, result), _measured(result, resumed=True))
        return result

    def _stages(self, worker: LocalWorker, other: WorkerView, op: str = "") -> bool:
        """Whether this pair's bytes go through the pinned host pool (host_staging.py)."""
        staging = self.host_staging
        peer_stages = (op == "READ" and self._target_stages(other)) or (op == "WRITE" and self._push_stages(other))
        return staging is not None and staging.applies(worker.mem_type, other.agent.name, other.mem_type, peer_stages)

    def _target_stages(self, other: WorkerView) -> bool:
        return other.mem_type == "VRAM" and other.staging_pool is not None and self.stage_remote is not None

    def _push_stages(self, other: WorkerView) -> bool:
        return self._target_stages(other) and other.accepts_push

    def _stager(self, job: TransferJob, other: WorkerView) -> RemoteStager | PushStager | None:
        """A pull from a peer worker that stages its GPU memory, or a push into one whose sidecar
        lends its pool's slots: the Stage calls for it."""
        stage_remote = self.stage_remote
        if job.op == "WRITE" and stage_remote is not None and self._push_stages(other):
            return self._push_stager(job, other, stage_remote)
        if job.op != "READ" or stage_remote is None or not self._target_stages(other):
            return None
        assert other.staging_pool is not None
        address, base = job.target.address, job.target

        async def call(rows: np.ndarray, remaining: float, done: list[int]) -> StagedSlot:
            request = peer_pb2.StageRequest(
                engine_id=base.engine_id, request_id=job.target_request_id, transfer_id=job.transfer_id,
                agent_name=other.agent.name, rows=pack_rows(rows), timeout_seconds=max(remaining, 0.0),
                done_slots=done,
            )  # fmt: skip
            response = await stage_remote(address, request)
            return StagedSlot(response.slot, response.address)

        return RemoteStager(call, other.staging_pool[2])

    def _push_stager(self, job: TransferJob, other: WorkerView, stage_remote: StageRemote) -> PushStager:
        """A push into a peer's GPU worker through its pool (``staged_push``): Stage calls with
        ``inbound``, naming the consumer's request."""
        assert other.staging_pool is not None
        address, target = job.target.address, job.target

        async def call(
            rows: np.ndarray | None, landed: int, lend: bool, remaining: float, done: list[int]
        ) -> LentSlot | None:
            request = peer_pb2.StageRequest(
                engine_id=target.engine_id, request_id=job.target_request_id, transfer_id=job.transfer_id,
                agent_name=other.agent.name, rows=pack_rows(rows) if rows is not None else b"",
                timeout_seconds=max(remaining, 0.0), done_slots=done, inbound=True, landed_slot=landed, lend=lend,
            )  # fmt: skip
            response = await stage_remote(address, request)
            return LentSlot(response.slot, response.address) if lend else None

        return PushStager(call, other.staging_pool[2])

    async def _host_staged(
        self,
        job: TransferJob,
        worker: LocalWorker,
        other: WorkerView,
        rows: tuple[np.ndarray, np.ndarray],
        payload: bytes,
        deadline: float,
    ) -> TransferResult:
        assert self.host_staging is not None
        mine, theirs = worker.agent_name, other.agent.name
        job.on_step("posted", f"{job.op} {mine} -> {theirs} ({len(rows[0])} runs) path={HOST_STAGING}")
        stager = self._stager(job, other)
        result = await self.host_staging.move(
            StagedMove(
                job.op, mine, worker.layout.device_id, other.agent, other.mem_type, rows[0], rows[1], payload,
                deadline, job.not_after, stager, worker.mem_type,
            )
        )  # fmt: skip
        job.on_step("nixl_completion", describe_staged(job.op, mine, result, stager is not None), _measured(result))
        self._observe(job.op, result, HOST_STAGING)
        return result

    def _observe(self, op: str, result: TransferResult, path: str) -> None:
        if self._on_xfer_done is not None and result.ok:
            self._on_xfer_done(op, result, path)

    async def _notify_only(self, worker: LocalWorker, other: WorkerView, payload: bytes) -> TransferResult:
        try:
            await self._transport.notify(worker.agent_name, other.agent, payload)
        except Exception as exc:
            return TransferResult(False, f"notification failed: {exc}")
        return TransferResult(True)


def _describe(op: str, agent_name: str, result: TransferResult) -> str:
    if not result.ok:
        return f"{op} on {agent_name} failed: {result.error} path=nixl"
    return (
        f"{op} on {agent_name} done: {result.bytes} bytes, {result.descriptors} descriptors, "
        f"post {result.post_s * 1000:.3f} ms, transfer {result.duration_s * 1000:.3f} ms path=nixl"
    )


def _same_lengths(initiator: BlockIds, target: BlockIds) -> bool:
    """Both sides list as many blocks per group: ``trim_to_tail`` would keep every block."""
    return len(initiator) == len(target) and all(len(a) == len(b) for a, b in zip(initiator, target, strict=True))


# (layout's id, slice, memory type) -> (the layout, its spec); the layout is kept so its id is not
# reused while the entry lives. Bounded: cleared past _VIEW_SPECS_MAX (re-handshaken peers).
_view_specs: dict[tuple[int, int, int, str], tuple[WorkerLayout, DlistSpec]] = {}
_VIEW_SPECS_MAX = 4096


def _view_spec(layout: WorkerLayout, view: Slice, mem_type: str) -> DlistSpec:
    """The spec of a worker's view, built once per (layout, slice, memory type) and not per post."""
    key = (id(layout), view.index, view.count, mem_type)
    cached = _view_specs.get(key)
    if cached is not None and cached[0] is layout:
        return cached[1]
    if len(_view_specs) >= _VIEW_SPECS_MAX:
        _view_specs.clear()
    spec = DlistSpec(
        key=("view", view.index, view.count), build=lambda: view_descriptors(layout, view), mem_type=mem_type
    )
    _view_specs[key] = (layout, spec)
    return spec


def _measured(result: TransferResult, resumed: bool = False) -> dict[str, float] | None:
    """NIXL's own post and transfer times of a completed transfer, for the request's stages, and
    where the hand-off to and from the owner thread went (``TransferResult.handoff``; with
    ``resumed``, ``loop_resume``: the owner thread reported it -> this coroutine ran again)."""
    if not result.ok:
        return None
    measured = {"nixl_post": result.post_s, "nixl_transfer": result.duration_s, **result.handoff}
    if resumed and result.reported_at:
        measured["loop_resume"] = max(0.0, time.monotonic() - result.reported_at)
    return measured
