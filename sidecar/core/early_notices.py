"""What a consumer told the producer about a request before the request reached it.

A vouched pull (``kvsidecar.voucher``) READs without asking the producer's sidecar, and the vLLM
shim's SubmitBlocks is asynchronous: the consumer can finish its READ, and its notification
arrive, or give up and release the request, before this sidecar has the request. Such a notice
(``ReadNotice``, ``ReleaseNotice``) is kept here, for as long as a SubmitBlocks may be late
(``producer_unknown_grace_seconds``) and for at most ``capacity`` requests, and applied in order
when the request comes; otherwise the engine would get its blocks back only at the lease's end.
The producer keeps two more kinds of releases here, by transfer id or request id, for a push
(``core.push``): a consumer's that withdrew its registration before the blocks came (applied
at SubmitBlocks), and its own engine's that came before any consumer registered (shown, with
``peek``, to each PushReg that comes for it, which is refused).
Pure bookkeeping, no I/O; the producer calls it on the event loop thread.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, NamedTuple, TypeVar

Key = TypeVar("Key")


class ReadNotice(NamedTuple):
    """A consumer's READ from one of our workers completed (its NIXL notification)."""

    agent_name: str  # our worker that the consumer READ from
    expected: int  # notifications that worker expects for the request (the sender says)
    sender_sidecar_id: str
    seen_at: float  # time.monotonic() when the transport's owner thread saw it


class ReleaseNotice(NamedTuple):
    """A consumer released the request (``PeerRelease``): it will not READ it (any more)."""

    consumed: bool
    reason: str
    identity: str  # the caller's certificate names with mTLS, "" without (``producer_request.authorize``)


EarlyNotice = ReadNotice | ReleaseNotice


class EarlyNotices(Generic[Key]):
    def __init__(self, max_age_seconds: float, capacity: int = 4096) -> None:
        self._max_age = max_age_seconds
        self._capacity = capacity
        self._kept: OrderedDict[Key, tuple[float, list[EarlyNotice]]] = OrderedDict()

    def keep(self, key: Key, notice: EarlyNotice, now: float) -> list[Key]:
        """Keep ``notice`` for ``key``; returns the keys dropped unclaimed (too old, or over
        capacity, oldest first): their notices were for requests that never came here, or that
        had already ended."""
        dropped = self._drop_older_than(now - self._max_age)
        kept_at, notices = self._kept.get(key, (now, []))
        notices.append(notice)
        self._kept[key] = (kept_at, notices)
        while len(self._kept) > self._capacity:
            dropped.append(self._kept.popitem(last=False)[0])
        return dropped

    def take(self, key: Key, now: float) -> list[EarlyNotice]:
        """The notices kept for ``key`` in their order (none if they are too old), forgetting them."""
        if not self._kept:
            return []
        notices = self.peek(key, now)
        self._kept.pop(key, None)
        return notices

    def peek(self, key: Key, now: float) -> list[EarlyNotice]:
        """The notices kept for ``key`` (none if they are too old), left in place."""
        kept_at, notices = self._kept.get(key, (now, []))
        return notices if now - kept_at <= self._max_age else []

    def __len__(self) -> int:
        return len(self._kept)

    def _drop_older_than(self, oldest: float) -> list[Key]:
        dropped = []
        while self._kept:
            key, (kept_at, _) = next(iter(self._kept.items()))
            if kept_at >= oldest:
                break
            del self._kept[key]
            dropped.append(key)
        return dropped
