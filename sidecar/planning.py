"""Transfer planning: which worker pairs exchange which byte ranges. Pure logic: no I/O, no NIXL.

Vocabulary:
- A *worker layout* is one engine worker's KV regions (one per layer, usually), each holding
  ``num_blocks`` physical blocks of ``block_len`` bytes, ``block_stride`` bytes apart, at a base
  address in the address space of the sidecar that mapped them.
- A *view* of a worker is a descriptor list over every (region, physical block), optionally
  restricted to one slice of each block (``Slice(index, count)``): with a head-major layout one
  block of a worker with TP=1 holds the heads of two TP=2 workers back to back, so a TP=2 worker
  reads or writes half of it. NIXL prepares each view once; a transfer then selects descriptors by
  index, and NIXL merges runs of adjacent descriptors into one (checked by its telemetry).
- The *initiator* posts the transfer (the consumer in pull, the producer in push); the *target*
  is the other side.

Descriptor order is region-major: index = region_index * num_blocks + physical_block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Layouts where a block's bytes are grouped by KV head, so a contiguous byte slice of a block is
# a contiguous range of heads (vLLM forces "HND" for NIXL; the CPU backend reports "LBHNC").
HEAD_MAJOR_LAYOUTS = frozenset({"HND", "LBHNC"})

BlockIds = tuple[tuple[int, ...], ...]


class PlanError(ValueError):
    """Two workers cannot exchange KV; the message says why."""


@dataclass(frozen=True)
class RegionLayout:
    name: str
    base: int
    block_len: int
    block_stride: int
    group_id: int


@dataclass(frozen=True)
class WorkerLayout:
    tp_rank: int
    pp_rank: int
    regions: tuple[RegionLayout, ...]
    num_blocks: int
    physical_per_logical: int
    block_size: int
    kv_layout: str
    num_kv_heads: int
    total_num_kv_heads: int
    is_mla: bool
    device_id: int = 0


@dataclass(frozen=True)
class Slice:
    """Part ``index`` of ``count`` equal parts of every block."""

    index: int = 0
    count: int = 1


WHOLE = Slice()


@dataclass(frozen=True)
class Pairing:
    """One initiator worker exchanging with one target worker, and the block slices involved."""

    target_rank: int
    initiator_slice: Slice
    target_slice: Slice


def view_descriptors(worker: WorkerLayout, view: Slice) -> np.ndarray:
    """The Nx3 uint64 (address, length, device) array of a view, region-major."""
    rows = []
    blocks = np.arange(worker.num_blocks, dtype=np.uint64)
    for region in worker.regions:
        part = region.block_len // view.count
        desc = np.empty((worker.num_blocks, 3), dtype=np.uint64)
        desc[:, 0] = region.base + blocks * np.uint64(region.block_stride) + np.uint64(view.index * part)
        desc[:, 1] = part
        desc[:, 2] = worker.device_id
        rows.append(desc)
    return np.concatenate(rows) if rows else np.empty((0, 3), dtype=np.uint64)


def physical_block_ids(logical: Sequence[int], physical_per_logical: int) -> np.ndarray:
    """Expand logical block ids to kernel (physical) ids: b -> [b*n, ..., b*n + n - 1]."""
    ids = np.asarray(logical, dtype=np.int64)
    if physical_per_logical == 1:
        return ids
    return (ids[:, None] * physical_per_logical + np.arange(physical_per_logical)).reshape(-1)


def block_byte_ranges(worker: WorkerLayout, block_ids: BlockIds) -> list[tuple[int, int]]:
    """(address, length) of every region's bytes of ``block_ids`` (per group) in ``worker``."""
    per_group = [physical_block_ids(ids, worker.physical_per_logical) for ids in block_ids]
    ranges = []
    for region in worker.regions:
        if region.group_id >= len(per_group):
            continue
        for block in per_group[region.group_id]:
            ranges.append((region.base + int(block) * region.block_stride, region.block_len))
    return ranges


def descriptor_indices(worker: WorkerLayout, block_ids: BlockIds) -> np.ndarray:
    """Indices into a view of ``worker`` selecting ``block_ids`` (per group) in every region.

    Raises PlanError for an id past the worker's blocks or listed twice: requests are validated
    before they get here, and this keeps a descriptor from ever landing outside the named blocks
    (an id past the end would select the next region's blocks)."""
    limit = worker.num_blocks // max(worker.physical_per_logical, 1)
    for group, ids in enumerate(block_ids):
        if ids and max(ids) >= limit:
            raise PlanError(f"group {group}: block id {max(ids)} is out of range (the engine has {limit} blocks)")
        if len(set(ids)) != len(ids):
            raise PlanError(f"group {group}: block ids repeat")
    per_group = [physical_block_ids(ids, worker.physical_per_logical) for ids in block_ids]
    parts = []
    for region_index, region in enumerate(worker.regions):
        if region.group_id >= len(per_group):
            continue
        parts.append(per_group[region.group_id] + region_index * worker.num_blocks)
    if not parts:
        return np.empty(0, dtype=np.int32)
    return np.concatenate(parts).astype(np.int32)


def trim_to_tail(source: BlockIds, destination: BlockIds) -> BlockIds:
    """The tail of ``source`` matching ``destination``'s length, per group.

    A consumer with a partial prefix-cache hit allocates blocks only for the uncomputed tail, so
    only the producer's last blocks move (vLLM's _apply_prefix_caching). A destination longer
    than its source is an error.
    """
    if len(source) != len(destination):
        raise PlanError(f"the two sides list {len(source)} and {len(destination)} KV cache groups")
    trimmed = []
    for group, (src, dst) in enumerate(zip(source, destination, strict=True)):
        if len(dst) > len(src):
            raise PlanError(f"group {group}: {len(dst)} destination blocks but only {len(src)} source blocks")
        trimmed.append(tuple(src[len(src) - len(dst) :]) if dst else ())
    return tuple(trimmed)


def pairings(initiator_tp: int, target_tp: int, initiator_rank: int, is_mla: bool = False) -> list[Pairing]:
    """Which target ranks one initiator rank exchanges with, and which block slices.

    Equal TP sizes pair rank r with rank r. With head-split KV and different TP sizes, the side
    with the larger TP holds 1/k of the heads of the other side's block: it moves its whole block
    to or from slice j of k of the other side's block. MLA KV is replicated on every rank, so the
    initiator exchanges whole blocks with one target rank.
    """
    if initiator_tp == target_tp:
        return [Pairing(initiator_rank, WHOLE, WHOLE)]
    if initiator_tp > target_tp:
        ratio = initiator_tp // target_tp
        target = initiator_rank // ratio
        if is_mla:
            return [Pairing(target, WHOLE, WHOLE)]
        return [Pairing(target, WHOLE, Slice(initiator_rank % ratio, ratio))]
    ratio = target_tp // initiator_tp
    if is_mla:
        return [Pairing(initiator_rank * ratio, WHOLE, WHOLE)]
    return [Pairing(initiator_rank * ratio + j, Slice(j, ratio), WHOLE) for j in range(ratio)]


def expected_notifications(initiator_tp: int, target_tp: int, target_rank: int, is_mla: bool = False) -> int:
    """How many transfers (each with one notification) reach ``target_rank`` for one request.

    MLA with a larger target TP leaves some target ranks without a transfer; the initiator sends
    them a bare notification so they count one as well.
    """
    count = sum(
        1
        for rank in range(initiator_tp)
        for pairing in pairings(initiator_tp, target_tp, rank, is_mla)
        if pairing.target_rank == target_rank
    )
    return max(count, 1)


def unpaired_targets(initiator_tp: int, target_tp: int, is_mla: bool) -> list[int]:
    """Target ranks no initiator transfers to (they get a bare notification from rank 0)."""
    reached = {
        pairing.target_rank
        for rank in range(initiator_tp)
        for pairing in pairings(initiator_tp, target_tp, rank, is_mla)
    }
    return [rank for rank in range(target_tp) if rank not in reached]


def check_compatible(
    initiator: Sequence[WorkerLayout], initiator_tp: int, target: Sequence[WorkerLayout], target_tp: int
) -> None:
    """Raise PlanError unless the two engines' KV can be exchanged byte for byte.

    Checks what the compatibility hash deliberately leaves out (as vLLM does): TP sizes, block
    size, layout, region names and per-region block lengths.
    """
    if not initiator or not target:
        raise PlanError("an engine has no registered workers")
    mine, theirs = initiator[0], target[0]
    if initiator_tp % target_tp and target_tp % initiator_tp:
        raise PlanError(f"TP sizes {initiator_tp} and {target_tp} do not divide one another")
    if mine.block_size != theirs.block_size:
        raise PlanError(
            f"block sizes differ ({mine.block_size} vs {theirs.block_size} tokens); "
            "heterogeneous block sizes are not supported"
        )
    if mine.physical_per_logical != theirs.physical_per_logical:
        raise PlanError(
            f"kernel blocks per logical block differ ({mine.physical_per_logical} vs {theirs.physical_per_logical})"
        )
    if mine.kv_layout != theirs.kv_layout:
        raise PlanError(f"KV layouts differ ({mine.kv_layout!r} vs {theirs.kv_layout!r})")
    if mine.is_mla != theirs.is_mla:
        raise PlanError("one engine uses MLA and the other does not")
    if initiator_tp != target_tp and not mine.is_mla:
        if mine.kv_layout not in HEAD_MAJOR_LAYOUTS:
            raise PlanError(
                f"heterogeneous TP ({initiator_tp} vs {target_tp}) needs a head-major KV layout "
                f"({', '.join(sorted(HEAD_MAJOR_LAYOUTS))}), not {mine.kv_layout!r}"
            )
        for layout, tp in ((mine, initiator_tp), (theirs, target_tp)):
            if layout.num_kv_heads * tp != layout.total_num_kv_heads:
                raise PlanError(
                    f"heterogeneous TP needs KV heads split evenly: {layout.num_kv_heads} heads x TP {tp} "
                    f"!= {layout.total_num_kv_heads} (replicated heads are not supported)"
                )
    names_mine = [region.name for region in mine.regions]
    names_theirs = [region.name for region in theirs.regions]
    if names_mine != names_theirs:
        raise PlanError(
            f"the engines name different KV regions ({len(names_mine)} vs {len(names_theirs)}; first: "
            f"{names_mine[:1]} vs {names_theirs[:1]})"
        )
    for worker in initiator:
        for pairing in pairings(initiator_tp, target_tp, worker.tp_rank, mine.is_mla):
            other = next((w for w in target if w.tp_rank == pairing.target_rank and w.pp_rank == worker.pp_rank), None)
            if other is None:
                raise PlanError(f"target rank tp{pairing.target_rank}/pp{worker.pp_rank} is not registered")
            for region_a, region_b in zip(worker.regions, other.regions, strict=True):
                part_a = region_a.block_len // pairing.initiator_slice.count
                part_b = region_b.block_len // pairing.target_slice.count
                if part_a != part_b or region_a.block_len % pairing.initiator_slice.count:
                    raise PlanError(
                        f"region {region_a.name!r}: {region_a.block_len}-byte blocks (TP {initiator_tp}) do not "
                        f"map onto {region_b.block_len}-byte blocks (TP {target_tp})"
                    )


def check_block_ids(block_ids: BlockIds, num_groups: int, num_blocks: int, physical_per_logical: int) -> str | None:
    """A problem with ``block_ids`` for an engine, or None. Used to validate requests."""
    if len(block_ids) > num_groups:
        return f"{len(block_ids)} KV cache groups given, the engine has {num_groups}"
    limit = num_blocks // max(physical_per_logical, 1)
    for group, ids in enumerate(block_ids):
        for block in ids:
            if block >= limit:
                return f"group {group}: block id {block} is out of range (the engine has {limit} blocks)"
        if len(set(ids)) != len(ids):
            return f"group {group}: block ids repeat"
    return None


def foreign_block_ids(named: BlockIds, submitted: BlockIds) -> str | None:
    """Why ``named`` (a consumer's idea of a producer request's blocks) is not a subset of the
    blocks the producer ``submitted`` for it, group by group, or None."""
    if len(named) > len(submitted):
        return f"{len(named)} KV cache groups named, {len(submitted)} submitted"
    for group, (ids, mine) in enumerate(zip(named, submitted, strict=False)):
        outside = set(ids).difference(mine)
        if outside:
            return f"group {group}: block {min(outside)} was not submitted for this request"
    return None
