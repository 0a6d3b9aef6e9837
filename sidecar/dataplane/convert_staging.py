"""The converted path's DRAM staging pipeline: a converted transfer whose descriptor runs are
short (a layout change makes one per token and head) moves whole blocks between the peer and a
registered staging buffer in the peer's layout, and numpy permutes them locally in a worker
thread: READ into staging then scatter into the local blocks (pull), or gather into staging then
WRITE (push). No conversion runs in an engine. Called by ``plane.DataPlane`` on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import numpy as np

from sidecar.dataplane.contract import RunsSpec, Staging, TransferResult, Transport
from sidecar.dataplane.memory import region_bytes
from sidecar.dataplane.plan.convert import BlockShape, Side, block_shape, copy_tokens, run_descriptors, shared_heads
from sidecar.dataplane.plan.layout import RegionLayout, WorkerLayout
from sidecar.dataplane.views import LocalWorker, WorkerView

# Converted transfers whose descriptor runs average fewer bytes than this go through a staging
# buffer (bench/README.md: per-descriptor cost makes short runs slower than a local permutation).
STAGING_BELOW_BYTES = 16384


@dataclass(frozen=True)
class Span:
    """Tokens [first, end) of a converted transfer, and where each side's block list starts."""

    first: int
    end: int
    initiator_first: int
    target_first: int


@dataclass(frozen=True)
class ConvertedMove:
    """One (initiator worker, target worker) pair's part of a converted transfer: ``op`` between
    ``local`` and ``remote`` over tokens ``span``, then ``payload`` notifies ``other``;
    ``deadline`` and ``not_after`` as in ``TransferSpec``."""

    op: str
    worker: LocalWorker
    other: WorkerView
    local: Side
    remote: Side
    span: Span
    payload: bytes
    deadline: float
    not_after: float | None


# Sends the move's notification once every transfer is done (``DataPlane._notify_only``).
Notify = Callable[[], Awaitable[TransferResult]]


async def staged(transport: Transport, move: ConvertedMove, notify: Notify) -> TransferResult:
    """Move whole blocks between the peer and a staging buffer in the peer's layout and block
    size (restricted to the heads both workers hold); permute locally. Pipelined by groups of
    layers: NIXL moves one group while numpy permutes the next (push) or the previous (pull),
    each transfer without a notification; the notification follows once every transfer is
    DONE, so the peer never learns of data still in flight."""
    op, worker, other, local, remote, span = move.op, move.worker, move.other, move.local, move.remote, move.span
    region = remote.worker.regions[0]
    shape = block_shape(remote.worker, region)
    head_first, head_end = shared_heads(block_shape(local.worker, local.worker.regions[0]), shape)
    heads = head_end - head_first
    first_block = (span.first - remote.first_token) // shape.tokens
    count = -(-(span.end - remote.first_token) // shape.tokens) - first_block
    staged_block = shape.tokens * heads * shape.chunk
    regions = remote.worker.regions
    staging = await transport.staging(worker.agent_name, staged_block * count * len(regions))
    results: list[TransferResult] = []
    in_flight: list[asyncio.Future[TransferResult]] = []
    try:
        mirror = _staging_side(staging, remote, shape, heads, head_first, first_block, count)
        source, dest = (remote, mirror) if op == "READ" else (mirror, remote)

        def post(group: range) -> None:
            src, dst = run_descriptors(_part(source, group), _part(dest, group), span.first, span.end)
            mine, theirs = (dst, src) if op == "READ" else (src, dst)
            spec = RunsSpec(
                worker.agent_name, op, other.agent, mine, "DRAM", theirs, other.mem_type, b"", move.deadline,
                move.not_after,
            )  # fmt: skip
            in_flight.append(asyncio.ensure_future(transport.transfer_runs(spec)))

        async def permute(group: range) -> None:
            into, out = _part(local, group), _part(mirror, group)
            if op == "READ":
                into, out = out, into
            await asyncio.to_thread(_permute, into, out, span, head_first, heads)

        groups = _groups(len(regions), staged_block * count)
        if op == "WRITE":
            for group in groups:
                await permute(group)
                post(group)
        else:
            post(groups[0])
            for index, group in enumerate(groups):
                results.append(await in_flight.pop(0))
                if not results[-1].ok:
                    break
                if index + 1 < len(groups):
                    post(groups[index + 1])
                await permute(group)
    finally:
        # Never hand the staging buffer back while a transfer on it may run.
        results += await asyncio.gather(*in_flight)
        transport.unstage(staging)
    failed = [result for result in results if not result.ok]
    if failed:
        return failed[0]
    notified = await notify()
    return TransferResult(
        notified.ok,
        notified.error,
        bytes=sum(result.bytes for result in results),
        descriptors=sum(result.descriptors for result in results),
        duration_s=sum(result.duration_s for result in results),
    )


def _staging_side(
    staging: Staging, remote: Side, shape: BlockShape, heads: int, head_first: int, first_block: int, count: int
) -> Side:
    """A worker laid out like ``remote`` (same layout and tokens per block) holding only the
    shared heads, whose ``count`` blocks, region after region, are the staging buffer and stand
    for the remote's physical blocks from ``first_block`` on."""
    block_len = shape.tokens * heads * shape.chunk
    regions = tuple(
        replace(region, base=staging.address + index * count * block_len, block_len=block_len, block_stride=block_len)
        for index, region in enumerate(remote.worker.regions)
    )
    mirror = replace(
        remote.worker,
        regions=regions,
        num_blocks=count,
        physical_per_logical=1,
        block_size=shape.tokens,
        num_kv_heads=heads,
        tp_rank=head_first // heads,  # block_shape's first head is tp_rank * heads
        device_id=0,
    )
    return Side(mirror, range(count), remote.first_token + first_block * shape.tokens)


def _groups(regions: int, region_bytes: int) -> list[range]:
    """Groups of consecutive regions for a pipelined staged transfer: about four, none smaller
    than 1 MiB (below that the per-transfer cost outweighs the overlap)."""
    count = max(1, min(4, regions, regions * region_bytes // (1 << 20)))
    bounds = [regions * index // count for index in range(count + 1)]
    return [range(bounds[index], bounds[index + 1]) for index in range(count)]


def _part(side: Side, group: range) -> Side:
    """``side`` restricted to the regions in ``group``."""
    return replace(side, worker=replace(side.worker, regions=side.worker.regions[group.start : group.stop]))


def _permute(source: Side, dest: Side, span: Span, head_first: int, heads: int) -> None:
    """Copy tokens [first, end) of heads [head_first, +heads) from ``source`` to ``dest``, both
    in this sidecar's memory, region by region (runs in a worker thread; numpy drops the GIL)."""
    for src_region, dst_region in zip(source.worker.regions, dest.worker.regions, strict=True):
        copy_tokens(
            source, _memory(source.worker, src_region), src_region, dest, _memory(dest.worker, dst_region), dst_region,
            span.first, span.end, head_first, heads,
        )  # fmt: skip


def _memory(worker: WorkerLayout, region: RegionLayout) -> np.ndarray:
    return region_bytes(region.base, region.block_len, region.block_stride, worker.num_blocks)
