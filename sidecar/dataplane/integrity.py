"""Integrity digests of a request's KV (setting ``integrity = "digest"``).

One 16-byte BLAKE3 digest per granule of tokens over the request's *logical* content: for each
pipeline stage and layer, the granule's tokens x every KV head of the model x the bytes of one
token of one head, in that order (``KvDigests`` in peer.proto). A producer and a consumer that
differ in block size, KV layout or TP size therefore compute equal digests for equal KV. Layouts
the sidecar cannot interpret are digested as raw whole blocks (TP slices in rank order), which
only byte-for-byte peers (same block size and layout) exchange anyway.

Who hashes when: the producer's sidecar hashes its engine's blocks after SubmitBlocks and before
the lease hands them back (push: before posting the WRITEs, sent in the notification; pull: when
the consumer asks with GetDigests, before it READs); the consumer's sidecar hashes its engine's
blocks after the transfer and before reporting FINISHED_RECEIVING. ``digests`` reads the sidecar's
own mappings of engine memory and runs in a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np

from kvsidecar.v1 import peer_pb2
from sidecar.dataplane.memory import region_bytes
from sidecar.dataplane.plan.convert import Side, block_shape, layout_kind, logical_tokens
from sidecar.dataplane.plan.descriptors import physical_block_ids
from sidecar.dataplane.plan.layout import WorkerLayout

DIGEST_BYTES = 16


@dataclass(frozen=True)
class DigestSpan:
    first: int
    end: int
    granule: int

    @property
    def count(self) -> int:
        return -(-(self.end - self.first) // self.granule)

    def to_proto(self, values: Sequence[bytes] = ()) -> peer_pb2.KvDigests:
        return peer_pb2.KvDigests(
            first_token=self.first, end_token=self.end, granule_tokens=self.granule, values=list(values)
        )

    @classmethod
    def from_proto(cls, message: peer_pb2.KvDigests) -> DigestSpan:
        return cls(message.first_token, message.end_token, message.granule_tokens)


def is_logical(worker: WorkerLayout) -> bool:
    return layout_kind(worker.kv_layout) is not None and not worker.is_mla


def granule(a: WorkerLayout, b: WorkerLayout) -> int:
    """Tokens per digest for a transfer between ``a`` and ``b``: the smaller block size, so every
    granule lies inside one block of each side (a consumer's first block starts on a granule)."""
    if is_logical(a) and is_logical(b):
        return min(a.block_size, b.block_size)
    return a.block_size


def digests(workers: Sequence[WorkerLayout], blocks: Sequence[int], list_first: int, span: DigestSpan) -> list[bytes]:
    """The digests of ``span`` for one engine whose ``blocks`` (one KV group) hold the request's
    tokens from ``list_first`` on. ``workers`` are all of the engine's workers."""
    hashers = [blake3.blake3() for _ in range(span.count)]
    stages: dict[int, list[WorkerLayout]] = {}
    for worker in sorted(workers, key=lambda w: (w.pp_rank, w.tp_rank)):
        stages.setdefault(worker.pp_rank, []).append(worker)
    for ranks in stages.values():
        if ranks[0].is_mla:
            ranks = ranks[:1]  # replicated: every rank holds the same bytes
        for index in range(len(ranks[0].regions)):
            if all(is_logical(worker) for worker in ranks):
                _hash_logical(hashers, ranks, index, blocks, list_first, span)
            else:
                _hash_raw(hashers, ranks, index, blocks, list_first, span)
    return [hasher.digest(DIGEST_BYTES) for hasher in hashers]


def _hash_logical(
    hashers: list[blake3.blake3],
    ranks: list[WorkerLayout],
    index: int,
    blocks: Sequence[int],
    list_first: int,
    span: DigestSpan,
) -> None:
    parts = []
    for worker in ranks:
        region = worker.regions[index]
        memory = region_bytes(region.base, region.block_len, region.block_stride, worker.num_blocks)
        side = Side(worker, blocks, list_first)
        shape = block_shape(worker, region)
        parts.append(logical_tokens(memory, region, shape, worker.num_blocks, side, span.first, span.end))
    # (tokens, every head, chunk), C order so each granule is one contiguous buffer
    values = np.ascontiguousarray(parts[0]) if len(parts) == 1 else np.concatenate(parts, axis=1)
    for number, hasher in enumerate(hashers):
        hasher.update(values[number * span.granule : (number + 1) * span.granule].data)


def _hash_raw(
    hashers: list[blake3.blake3],
    ranks: list[WorkerLayout],
    index: int,
    blocks: Sequence[int],
    list_first: int,
    span: DigestSpan,
) -> None:
    for worker in ranks:
        region = worker.regions[index]
        memory = region_bytes(region.base, region.block_len, region.block_stride, worker.num_blocks)
        ratio = max(worker.physical_per_logical, 1)
        for number, hasher in enumerate(hashers):
            logical = (span.first - list_first) // worker.block_size + number
            for physical in physical_block_ids([blocks[logical]], ratio).tolist():
                start = physical * region.block_stride
                hasher.update(memory[start : start + region.block_len].data)


MAX_DIGESTS = 1 << 20


def check_span(span: DigestSpan, capacity: int) -> str | None:
    """A problem with a span asked of a request holding ``capacity`` tokens, or None."""
    if span.granule <= 0:
        return "granule_tokens must be > 0"
    if not span.first < span.end <= capacity:
        return f"tokens [{span.first}, {span.end}) are not inside the request's {capacity} tokens"
    if span.count > MAX_DIGESTS:
        return f"{span.count} digests asked, at most {MAX_DIGESTS}"
    return None


def first_mismatch(mine: Sequence[bytes], theirs: Sequence[bytes]) -> int | None:
    """Index of the first granule whose digests differ (or that one side lacks), else None."""
    for number in range(max(len(mine), len(theirs))):
        if number >= len(mine) or number >= len(theirs) or mine[number] != theirs[number]:
            return number
    return None
