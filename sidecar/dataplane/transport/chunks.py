"""The chunk scheduler: how a large transfer is cut into bounded posts, and in which order the
posts of several transfers go (pure: no NIXL; the owner thread calls it).

Between two processes on one host UCX copies by CMA inside ``agent.transfer()``, on the owner
thread, so one 128 MiB post held every other request's post (and its completion) for the whole
copy. So a transfer whose descriptors add up to more than ``max_post_bytes`` is cut into chunks
of about that many bytes (``chunk_rows``), and the chunks of different transfers are posted round
robin, one per turn of the owner loop, with its command queue drained between two chunks: a small
request waits for at most one chunk's copy. Only the last chunk carries the notification, and it
is posted only once every other chunk is DONE (``Split.ready``), so a peer never learns of data
still in flight; every chunk is checked against the transfer's deadline and ``not_after`` before
it is posted, and a transfer ends (``on_end``) once no chunk of it is outstanding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sidecar.dataplane.contract import NOT_POSTED_LATE, TransferResult, is_disconnect


def chunk_rows(sizes: np.ndarray, limit: int) -> list[np.ndarray] | None:
    """The descriptor rows of each chunk, descriptors whose byte lengths are ``sizes`` cut at
    every ``limit`` bytes of their running total (a descriptor is never cut: a chunk starts at the
    first descriptor that starts in its window); None when one post is enough."""
    if not limit or len(sizes) < 2:
        return None
    sizes = np.asarray(sizes, dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    cuts = np.flatnonzero(np.diff(starts // limit)) + 1  # a chunk per window of `limit` bytes
    if not len(cuts):
        return None
    return np.split(np.arange(len(sizes)), cuts)


@dataclass(eq=False)
class Split:
    """A transfer posted as ``chunks`` bounded posts. ``make(i)`` creates chunk ``i``'s handle
    (the last one carries the notification); ``owner`` and ``future`` are the transport's."""

    owner: Any
    agent_name: str
    remote_name: str
    op: str
    deadline: float
    not_after: float | None
    future: Any  # what the transfer's caller awaits (the transport completes it)
    make: Callable[[int], Any]
    chunks: int
    posted: int = 0
    outstanding: int = 0
    total: TransferResult = field(default_factory=lambda: TransferResult(True))
    failure: TransferResult | None = None
    observed: bool = True  # reported to on_xfer_done (RunsSpec.observed)

    def ready(self) -> bool:
        """Whether a chunk may be posted now: the last one only once every other is DONE."""
        return self.failure is None and (self.posted < self.chunks - 1 or self.outstanding == 0)


def split_of(
    spec: Any, owner: Any, future: Any, sizes: np.ndarray, make: Callable[[Any, bytes], Any], limit: int
) -> Split | None:
    """A ``Split`` of the transfer ``spec`` (a ``TransferSpec`` or ``RunsSpec``) over descriptors
    whose byte lengths are ``sizes``, cut at every ``limit`` bytes (``make(rows, notification)``
    creates the handle of a chunk of rows; only the last carries ``spec.notification``), or None
    when one post is enough."""
    rows = chunk_rows(sizes, limit)
    if rows is None:
        return None
    last = len(rows) - 1
    notification = spec.notification
    return Split(
        owner,
        spec.agent_name,
        spec.remote.name,
        spec.op,
        spec.deadline,
        spec.not_after,
        future,
        lambda index: make(rows[index], notification if index == last else b""),
        len(rows),
    )


# Posts chunk ``index`` of a split (makes its handle and hands it to NIXL); raises only when the
# handle cannot be made (a failed post reaches ``ChunkScheduler.chunk_done`` instead).
PostChunk = Callable[[Split, int], None]


class ChunkScheduler:
    """Split transfers with chunks left to post, posted round robin. ``on_end(split, result)`` is
    called once per split, when its last outstanding chunk ended or it failed with none out."""

    def __init__(self, on_end: Callable[[Split, TransferResult], None]) -> None:
        self._queue: deque[Split] = deque()
        self._on_end = on_end

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, split: Split) -> None:
        self._queue.append(split)

    def any_ready(self) -> bool:
        return any(split.ready() for split in self._queue)

    def post_next(self, now: float, post: PostChunk) -> bool:
        """Post one chunk of the first split that has one ready, then move that split to the back
        of the queue (round robin); a split found past its deadline or ``not_after`` fails instead.
        Returns whether anything happened."""
        for _ in range(len(self._queue)):
            split = self._queue.popleft()
            if not split.ready():
                self._queue.append(split)
                continue
            if split.not_after is not None and now > split.not_after:
                self.fail(split, NOT_POSTED_LATE)
                return True
            if now > split.deadline:
                self.fail(split, f"{split.op} did not complete within its deadline")
                return True
            index = split.posted
            split.posted += 1
            if split.posted < split.chunks:
                self._queue.append(split)
            split.outstanding += 1
            try:
                post(split, index)
            except Exception as exc:
                failed = TransferResult(False, f"transfer setup failed: {exc}", peer_gone=is_disconnect(exc))
                self.chunk_done(split, failed)
            return True
        return False

    def chunk_done(self, split: Split, result: TransferResult) -> None:
        """A posted chunk ended (DONE, failed, or released late)."""
        split.outstanding -= 1
        if result.ok:
            total = split.total
            total.bytes += result.bytes
            total.descriptors += result.descriptors
            total.duration_s += result.duration_s
            total.post_s += result.post_s
        elif split.failure is None:
            split.failure = result
        self._end_if_done(split)

    def fail(self, split: Split, reason: str, peer_gone: bool = False) -> None:
        """No more chunks of ``split`` are posted; it ends once its posted chunks have."""
        if split.failure is None:
            split.failure = TransferResult(False, reason, peer_gone=peer_gone)
        self._end_if_done(split)

    def fail_where(self, reason: str, agent_name: str | None = None, remote_name: str | None = None) -> None:
        """Stop the splits of ``agent_name`` (to ``remote_name``), or all: their agent, remote
        metadata or prepared lists are about to go, and a later chunk must not use them."""
        for split in list(self._queue):
            if (agent_name is None or split.agent_name == agent_name) and (
                remote_name is None or split.remote_name == remote_name
            ):
                self.fail(split, reason)

    def _end_if_done(self, split: Split) -> None:
        if split.outstanding or (split.failure is None and split.posted < split.chunks):
            return
        if split in self._queue:
            self._queue.remove(split)
        self._on_end(split, split.failure or split.total)
