"""NIXL descriptor arrays of worker views, and the indices that select blocks in them. Pure logic.

Descriptor order is region-major: index = region_index * num_blocks + physical_block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sidecar.dataplane.plan.layout import BlockIds, PlanError, Slice, WorkerLayout


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


def physical_block_ids(logical: Sequence[int] | np.ndarray, physical_per_logical: int) -> np.ndarray:
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


# Block lists at least this long are checked with numpy (below it Python's max and set are cheaper).
_BULK_IDS = 64


def descriptor_indices(worker: WorkerLayout, block_ids: BlockIds) -> np.ndarray:
    """Indices into a view of ``worker`` selecting ``block_ids`` (per group) in every region.

    Raises PlanError for an id past the worker's blocks or listed twice: requests are validated
    before they get here, and this keeps a descriptor from ever landing outside the named blocks
    (an id past the end would select the next region's blocks)."""
    limit = worker.num_blocks // max(worker.physical_per_logical, 1)
    per_group = []
    for group, ids in enumerate(block_ids):
        # A few ids: Python's max and set cost less than numpy's set-up; many (a request of
        # thousands of blocks): checked in bulk on the sorted array.
        if len(ids) < _BULK_IDS:
            if ids and max(ids) >= limit:
                raise PlanError(f"group {group}: block id {max(ids)} is out of range (the engine has {limit} blocks)")
            if len(set(ids)) != len(ids):
                raise PlanError(f"group {group}: block ids repeat")
            per_group.append(physical_block_ids(ids, worker.physical_per_logical))
            continue
        logical = np.asarray(ids, dtype=np.int64)
        ordered = np.sort(logical)
        if ordered[-1] >= limit:
            raise PlanError(f"group {group}: block id {ordered[-1]} is out of range (the engine has {limit} blocks)")
        if (ordered[1:] == ordered[:-1]).any():
            raise PlanError(f"group {group}: block ids repeat")
        per_group.append(physical_block_ids(logical, worker.physical_per_logical))
    # One array operation for every region (a worker has one per layer, or two: K and V), not one
    # per region: region r's part is its group's ids + r * num_blocks, region after region.
    if len(per_group) == 1 and worker.num_groups == 1:  # one KV cache group (the common case)
        return (worker.region_starts + per_group[0][None, :]).reshape(-1).astype(np.int32)
    groups = worker.region_groups
    regions = np.flatnonzero(groups < len(per_group))  # the regions of the groups named
    if not len(regions):
        return np.empty(0, dtype=np.int32)
    offsets = (regions * worker.num_blocks)[:, None]
    if len(per_group) == 1:
        return (offsets + per_group[0][None, :]).reshape(-1).astype(np.int32)
    if len({len(ids) for ids in per_group}) == 1:
        return (np.stack(per_group)[groups[regions]] + offsets).reshape(-1).astype(np.int32)
    parts = [per_group[groups[region]] + region * worker.num_blocks for region in regions]
    return np.concatenate(parts).astype(np.int32)
