"""What the owner thread hands to the event loop: transfer results and notifications, coalesced.

The owner thread queues each transfer's result and each poll's batch of notifications here, and
``flush``es after each command and each poll: one ``loop.call_soon_threadsafe`` (one write to the
loop's self-pipe, one wake-up of the loop) carries everything queued since the last delivery, and
none is scheduled while one is still pending, so an idle loop gets a result at once and a busy one
wakes once for many results and notifications instead of once per transfer
(``asyncio.wrap_future``'s way) and once per poll. The
loop thread runs ``_deliver``, in the order things were queued.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from sidecar.dataplane.contract import NotificationsCallback, TransferResult
from sidecar.logs import get_logger

log = get_logger("kvsidecar.transport")


class LoopOutbox:
    """Owner thread -> event loop thread, one wake-up per delivery."""

    def __init__(self, on_notifications: NotificationsCallback) -> None:
        self._on_notifications = on_notifications
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        # (waiter, result) of a transfer, or (None, (batch, seen_at)) of notifications.
        self._queued: list[tuple[Any, Any]] = []
        self._scheduled = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def result(self, waiter: asyncio.Future[TransferResult], result: TransferResult) -> None:
        """A transfer's result for its waiter (owner thread; delivered at the next ``flush``)."""
        with self._lock:
            self._queued.append((waiter, result))

    def notifications(self, batch: list[tuple[str, bytes]], seen_at: float) -> None:
        """A poll's notifications for ``on_notifications`` (owner thread)."""
        with self._lock:
            self._queued.append((None, (batch, seen_at)))

    def flush(self) -> None:
        """Wake the loop for what is queued, unless a delivery is already pending (owner thread)."""
        with self._lock:
            if not self._queued or self._scheduled or self._loop is None:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody waits any more
            with self._lock:
                self._scheduled = False
                self._queued.clear()

    def _deliver(self) -> None:
        with self._lock:
            queued, self._queued = self._queued, []
            self._scheduled = False
        for waiter, value in queued:
            if waiter is None:
                try:
                    self._on_notifications(*value)
                except Exception:  # one bad batch must not keep the others (or results) from the loop
                    log.exception("notification_delivery_failed")
            elif not waiter.done():
                waiter.set_result(value)
