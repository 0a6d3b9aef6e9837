"""DeadlineHeap: expiry by deadline, not by insertion order (vllm #58222)."""

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
