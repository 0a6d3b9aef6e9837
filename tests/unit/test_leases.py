"""DeadlineHeap: expiry by deadline, not by insertion order (vllm #58222)."""

from typing import Any

from sidecar.core.leases import DeadlineHeap


def test_expired_in_deadline_order_not_insertion_order() -> None:
    heap: DeadlineHeap[str] = DeadlineHeap()
    heap.set("late", 30.0)
    heap.set("early", 10.0)
    heap.set("middle", 20.0)
    assert heap.pop_expired(25.0) == ["early", "middle"]
    assert list(heap) == ["late"]


def test_renewed_head_does_not_strand_expired_entries_behind_it() -> None:
    heap: DeadlineHeap[str] = DeadlineHeap()
    heap.set("a", 10.0)  # inserted first: the head in insertion order
    heap.set("b", 11.0)
    heap.set("c", 12.0)
    assert heap.extend("a", 100.0)  # a heartbeat renews the head
    assert heap.pop_expired(50.0) == ["b", "c"]
    assert heap.deadline("a") == 100.0


def test_extend_never_shortens_and_unknown_keys_are_reported() -> None:
    heap: DeadlineHeap[str] = DeadlineHeap()
    heap.set("a", 10.0)
    assert heap.extend("a", 5.0)
    assert heap.deadline("a") == 10.0
    assert not heap.extend("missing", 99.0)
    assert "missing" not in heap


def test_cancel_and_next_deadline_skip_stale_entries() -> None:
    heap: DeadlineHeap[str] = DeadlineHeap()
    heap.set("a", 1.0)
    heap.set("b", 2.0)
    assert heap.cancel("a")
    assert not heap.cancel("a")
    assert heap.next_deadline() == 2.0
    assert heap.pop_expired(1.5) == []
    assert len(heap) == 1


def test_many_extensions_keep_the_heap_compact() -> None:
    heap: DeadlineHeap[int] = DeadlineHeap()
    for key in range(10):
        heap.set(key, float(key))
    for round_ in range(1000):
        heap.extend(round_ % 10, 1000.0 + round_)
    assert len(heap._heap) <= 4 * len(heap) + 64
    assert heap.pop_expired(10_000.0) == sorted(range(10), key=lambda key: heap_deadline_after(key))


def heap_deadline_after(key: int) -> float:
    # The last extension of key k happened at round 990 + k.
    return 1000.0 + 990 + key


def test_a_timer_is_not_rearmed_per_request_yet_every_deadline_fires_on_time() -> None:
    """DeadlineTimer: requests that end in arrival order (the earliest deadline cancelled each
    time) do not cost the loop a new timer handle each; the one armed fires early, finds nothing
    due and re-arms, so a later deadline still fires when it passes, and an idle timer disarms."""
    import asyncio
    import time

    from sidecar.core.timers import DeadlineTimer

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        armed: list[float] = []
        call_at = loop.call_at

        def counting(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
            if getattr(callback, "__self__", None) is timer:
                armed.append(when)
            return call_at(when, callback, *args, **kwargs)

        fired: list[tuple[str, float]] = []
        timer: DeadlineTimer[str] = DeadlineTimer(lambda keys: fired.extend((key, time.monotonic()) for key in keys))
        loop.call_at = counting  # type: ignore[method-assign]
        start = time.monotonic()
        for index in range(100):  # 100 requests, each ended before its deadline, in arrival order
            timer.set(f"r{index}", start + 0.05 + index * 0.001)
            if index:
                timer.cancel(f"r{index - 1}")
        assert len(armed) == 1, "cancelling the earliest deadline re-armed the loop's timer"
        await asyncio.sleep(0.25)
        assert [key for key, _ in fired] == ["r99"]
        assert fired[0][1] >= start + 0.05 + 99 * 0.001  # never early
        assert timer._handle is None  # idle: nothing armed
        timer.set("late", time.monotonic() + 0.02)
        timer.set("earlier", time.monotonic() + 0.01)  # an earlier deadline re-arms at once
        await asyncio.sleep(0.1)
        assert [key for key, _ in fired[1:]] == ["earlier", "late"]
        timer.close()

    asyncio.run(scenario())
