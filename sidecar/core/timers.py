"""A ``DeadlineHeap`` that fires a callback on the event loop when deadlines pass.

One ``TimerHandle`` per heap, set for a time no later than the earliest deadline, so an idle
sidecar makes no periodic wake-ups. A handle is re-armed only when a deadline comes *earlier*
than it: when the earliest key is cancelled or extended (every request's end, with deadlines set
in arrival order) the handle stays, fires early, finds nothing due and re-arms for the deadline
then earliest; re-arming at each end cost the loop a cancelled handle and a heap push per request
and timer. Used on the event loop thread only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from sidecar.core.leases import DeadlineHeap

K = TypeVar("K", bound=Hashable)


class DeadlineTimer(Generic[K]):
    """Keys with deadlines on ``time.monotonic()``; ``on_expired(keys)`` runs when they pass."""

    def __init__(self, on_expired: Callable[[list[K]], None]) -> None:
        self.heap: DeadlineHeap[K] = DeadlineHeap()
        self._on_expired = on_expired
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for: float | None = None

    def __len__(self) -> int:
        return len(self.heap)

    def __contains__(self, key: object) -> bool:
        return key in self.heap

    def set(self, key: K, deadline: float) -> None:
        self.heap.set(key, deadline)
        self._reschedule()

    def extend(self, key: K, deadline: float) -> bool:
        extended = self.heap.extend(key, deadline)
        self._reschedule()
        return extended

    def cancel(self, key: K) -> bool:
        cancelled = self.heap.cancel(key)
        self._reschedule()
        return cancelled

    def deadline(self, key: K) -> float | None:
        return self.heap.deadline(key)

    def remaining(self, key: K) -> float | None:
        deadline = self.heap.deadline(key)
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _reschedule(self) -> None:
        upcoming = self.heap.next_deadline()
        armed = self._armed_for
        if upcoming == armed or (armed is not None and (upcoming is None or upcoming > armed)):
            return  # armed for that deadline, or earlier (see the module doc)
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed_for = upcoming
        if upcoming is not None:
            loop = asyncio.get_running_loop()
            # loop.time() is time.monotonic() on Linux's default loop; convert anyway.
            when = loop.time() + max(0.0, upcoming - time.monotonic())
            self._handle = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._armed_for = None
        expired = self.heap.pop_expired(time.monotonic())
        self._reschedule()
        if expired:
            self._on_expired(expired)
