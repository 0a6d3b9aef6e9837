"""Deadlines kept in a heap (leases, watchdogs, hold TTLs). Pure logic: no clock, no I/O.

vLLM's lease reaper once assumed insertion order was expiry order and stranded blocks behind a
renewed head entry (vllm #58222). Here every key has exactly one live deadline and the heap is
ordered by deadline; stale heap entries from extensions or cancellations are skipped lazily.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DeadlineHeap(Generic[K]):
    """A set of keys, each with one deadline (a float on any monotonic clock)."""

    def __init__(self) -> None:
        self._deadline: dict[K, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._deadline)

    def __contains__(self, key: object) -> bool:
        return key in self._deadline

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._deadline))

    def set(self, key: K, deadline: float) -> None:
        """Arm or move ``key``'s deadline (earlier or later)."""
        seq = next(self._seq)
        self._deadline[key] = (deadline, seq)
        heapq.heappush(self._heap, (deadline, seq, key))
        self._compact_if_bloated()

    def extend(self, key: K, deadline: float) -> bool:
        """Move ``key``'s deadline later, never earlier. False if the key is unknown."""
        current = self._deadline.get(key)
        if current is None:
            return False
        if deadline > current[0]:
            self.set(key, deadline)
        return True

    def cancel(self, key: K) -> bool:
        return self._deadline.pop(key, None) is not None

    def deadline(self, key: K) -> float | None:
        current = self._deadline.get(key)
        return None if current is None else current[0]

    def next_deadline(self) -> float | None:
        self._drop_stale_head()
        return self._heap[0][0] if self._heap else None

    def pop_expired(self, now: float) -> list[K]:
        """Remove and return every key whose deadline is <= now, earliest first."""
        expired: list[K] = []
        while True:
            self._drop_stale_head()
            if not self._heap or self._heap[0][0] > now:
                return expired
            _, _, key = heapq.heappop(self._heap)
            del self._deadline[key]
            expired.append(key)

    def _drop_stale_head(self) -> None:
        while self._heap:
            deadline, seq, key = self._heap[0]
            if self._deadline.get(key) == (deadline, seq):
                return
            heapq.heappop(self._heap)

    def _compact_if_bloated(self) -> None:
        # Extensions leave stale entries behind; rebuild when they dominate the heap.
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._deadline):
            self._heap = [(deadline, seq, key) for key, (deadline, seq) in self._deadline.items()]
            heapq.heapify(self._heap)
