"""Cutting a host-staged transfer into pipeline chunks. Pure logic, vectorized (numpy).

A staged transfer is a list of paired descriptor rows: row i of ``device`` (the local engine's GPU
memory) moves to or from row i of ``remote`` (the peer's memory), their lengths equal row by row.
Laid end to end the rows form one byte stream; chunk c is bytes [c * C, (c + 1) * C) of it and
fills one staging slot of C bytes, so a row that crosses a chunk boundary is cut there. Every
chunk but the last fills its slot exactly, and no step walks the rows one by one in Python.

Used by ``sidecar.dataplane.host_staging`` on the event loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sidecar.dataplane.plan.layout import PlanError


@dataclass(frozen=True)
class StageChunks:
    """Rows cut at chunk boundaries: chunk c is rows ``bounds[c]:bounds[c + 1]``, row i lies at
    ``offsets[i]`` in its chunk's slot."""

    device: np.ndarray  # Nx3 uint64 (address, length, device id)
    remote: np.ndarray  # Nx3 uint64
    offsets: np.ndarray  # N uint64
    bounds: np.ndarray  # chunks + 1 int64
    chunk_bytes: int
    total: int

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    def rows(self, chunk: int) -> slice:
        return slice(int(self.bounds[chunk]), int(self.bounds[chunk + 1]))

    def chunk_bytes_of(self, chunk: int) -> int:
        return min(self.chunk_bytes, self.total - chunk * self.chunk_bytes)


def coalesce(device: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge each row into the one before where both sides continue contiguously (adjacent blocks
    of a region): fewer NIXL descriptors and fewer copies."""
    if len(device) < 2:
        return device, remote
    lengths = device[:-1, 1]
    joins = (
        (device[1:, 0] == device[:-1, 0] + lengths)
        & (remote[1:, 0] == remote[:-1, 0] + lengths)
        & (device[1:, 2] == device[:-1, 2])
        & (remote[1:, 2] == remote[:-1, 2])
    )
    if not joins.any():
        return device, remote
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    summed = np.add.reduceat(device[:, 1].astype(np.int64), starts).astype(np.uint64)
    device, remote = device[starts].copy(), remote[starts].copy()
    device[:, 1] = summed
    remote[:, 1] = summed
    return device, remote


def cut(device: np.ndarray, remote: np.ndarray, chunk_bytes: int) -> StageChunks:
    """``device``/``remote`` (paired Nx3 rows) coalesced and cut into chunks of ``chunk_bytes``."""
    if device.shape != remote.shape or (len(device) and device.shape[1] != 3):
        raise PlanError(f"staged rows do not pair: {device.shape} vs {remote.shape}")
    if chunk_bytes <= 0:
        raise PlanError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    device = np.asarray(device, dtype=np.uint64)
    remote = np.asarray(remote, dtype=np.uint64)
    if not np.array_equal(device[:, 1], remote[:, 1]):
        raise PlanError("staged rows differ in length between the two sides")
    keep = device[:, 1] > 0
    device, remote = coalesce(device[keep], remote[keep])
    lengths = device[:, 1].astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        empty = np.empty((0, 3), dtype=np.uint64)
        return StageChunks(empty, empty.copy(), np.empty(0, dtype=np.uint64), np.zeros(1, np.int64), chunk_bytes, 0)
    starts = np.cumsum(lengths) - lengths
    cuts = np.union1d(starts, np.arange(chunk_bytes, total, chunk_bytes, dtype=np.int64))
    pieces = np.diff(np.append(cuts, total)).astype(np.uint64)
    row = np.searchsorted(starts, cuts, side="right") - 1
    into = (cuts - starts[row]).astype(np.uint64)
    out_device, out_remote = device[row], remote[row]
    for side in (out_device, out_remote):
        side[:, 0] += into
        side[:, 1] = pieces
    chunk = cuts // chunk_bytes
    count = -(-total // chunk_bytes)
    bounds = np.searchsorted(chunk, np.arange(count + 1), side="left").astype(np.int64)
    offsets = (cuts - chunk * chunk_bytes).astype(np.uint64)
    return StageChunks(out_device, out_remote, offsets, bounds, chunk_bytes, total)
