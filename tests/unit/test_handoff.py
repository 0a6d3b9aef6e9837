"""The owner thread's hand-off to the event loop (``sidecar.dataplane.transport.handoff``):
results and notifications queued while a delivery is pending ride that delivery, in order, so the
loop wakes once for them, not once per transfer or per poll."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from sidecar.dataplane.contract import TransferResult
from sidecar.dataplane.transport.handoff import LoopOutbox


def test_what_is_queued_while_a_delivery_is_pending_rides_it_in_order() -> None:
    async def main() -> tuple[list[Any], int, list[TransferResult]]:
        loop = asyncio.get_running_loop()
        wakes = 0
        real = loop.call_soon_threadsafe

        def counting(callback: Any, *args: Any) -> Any:  # counts the loop's cross-thread wake-ups
            nonlocal wakes
            wakes += 1
            return real(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        seen: list[Any] = []
        outbox = LoopOutbox(lambda batch, seen_at: seen.append((batch, seen_at)))
        outbox.bind(loop)
        first: asyncio.Future[TransferResult] = loop.create_future()
        second: asyncio.Future[TransferResult] = loop.create_future()

        def owner_thread() -> None:
            # Three turns of the owner loop before the event loop runs: one wake-up for all.
            outbox.notifications([("a", b"1")], 1.0)
            outbox.flush()
            outbox.result(first, TransferResult(True, bytes=1))
            outbox.flush()
            outbox.notifications([("a", b"2")], 2.0)
            outbox.result(second, TransferResult(False, "failed"))
            outbox.flush()

        thread = threading.Thread(target=owner_thread)
        thread.start()
        thread.join()
        results = [await asyncio.wait_for(first, 5), await asyncio.wait_for(second, 5)]
        assert seen == [([("a", b"1")], 1.0), ([("a", b"2")], 2.0)]
        # Once delivered, the next turn's results wake the loop again.
        third: asyncio.Future[TransferResult] = loop.create_future()
        outbox.result(third, TransferResult(True))
        outbox.flush()
        outbox.flush()  # nothing new: no second wake-up
        results.append(await asyncio.wait_for(third, 5))
        return seen, wakes, results

    _, wakes, results = asyncio.run(main())
    assert wakes == 2
    assert [(r.ok, r.bytes) for r in results] == [(True, 1), (False, 0), (True, 0)]


def test_a_failing_notification_callback_does_not_keep_the_results_from_their_waiters() -> None:
    async def main() -> TransferResult:
        loop = asyncio.get_running_loop()

        def broken(batch: list[tuple[str, bytes]], seen_at: float) -> None:
            raise ValueError("bad batch")

        outbox = LoopOutbox(broken)
        outbox.bind(loop)
        waiter: asyncio.Future[TransferResult] = loop.create_future()
        outbox.notifications([("a", b"x")], 0.0)
        outbox.result(waiter, TransferResult(True))
        outbox.flush()
        return await asyncio.wait_for(waiter, 5)

    assert asyncio.run(main()).ok
