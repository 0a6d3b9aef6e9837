"""The chunk scheduler without NIXL (``sidecar.dataplane.transport.chunks``): where a large
transfer is cut, the order chunks of several transfers are posted in, that the notification's
chunk goes last and only once every other chunk is DONE, and how a transfer ends."""

from __future__ import annotations

import concurrent.futures

import numpy as np

from sidecar.dataplane.contract import NOT_POSTED_LATE, TransferResult
from sidecar.dataplane.transport.chunks import ChunkScheduler, Split, chunk_rows

KIB = 1024


def split(name: str, chunks: int, deadline: float = 100.0, not_after: float | None = None) -> Split:
    return Split(
        owner=None,
        agent_name=name,
        remote_name=f"{name}-remote",
        op="READ",
        deadline=deadline,
        not_after=not_after,
        future=concurrent.futures.Future(),
        make=lambda index: (name, index),
        chunks=chunks,
    )


class Recorder:
    def __init__(self) -> None:
        self.posted: list[tuple[str, int]] = []
        self.ended: list[tuple[str, TransferResult]] = []
        self.scheduler = ChunkScheduler(lambda s, result: self.ended.append((s.agent_name, result)))

    def post(self, s: Split, index: int) -> None:
        self.posted.append(s.make(index))


def test_a_transfer_is_cut_at_every_limit_of_bytes_and_never_inside_a_descriptor() -> None:
    rows = chunk_rows(np.full(1024, 16 * KIB), 4 << 20)
    assert rows is not None
    assert [len(r) for r in rows] == [256, 256, 256, 256]
    assert np.array_equal(np.concatenate(rows), np.arange(1024))
    # Uneven descriptors: a chunk starts at the first descriptor that starts in its window.
    rows = chunk_rows(np.array([3, 3, 3, 3]), 4)
    assert rows is not None and [list(r) for r in rows] == [[0, 1], [2], [3]]


def test_no_cut_when_one_post_is_enough_or_splitting_is_off() -> None:
    assert chunk_rows(np.full(16, KIB), 1 << 20) is None
    assert chunk_rows(np.array([8 << 20]), 1 << 20) is None  # one descriptor is never cut
    assert chunk_rows(np.full(1024, 16 * KIB), 0) is None


def test_chunks_of_two_transfers_go_round_robin_and_each_last_chunk_waits_for_the_others() -> None:
    r = Recorder()
    a, b = split("a", 3), split("b", 2)
    r.scheduler.add(a)
    r.scheduler.add(b)
    while r.scheduler.post_next(0.0, r.post):
        pass
    # a0, b0, a1 posted; b's last chunk waits for b0, a's for a0 and a1.
    assert r.posted == [("a", 0), ("b", 0), ("a", 1)]
    assert not r.scheduler.any_ready()
    r.scheduler.chunk_done(b, TransferResult(True, bytes=10))
    assert r.scheduler.post_next(0.0, r.post) and r.posted[-1] == ("b", 1)
    r.scheduler.chunk_done(a, TransferResult(True, bytes=1))
    assert not r.scheduler.post_next(0.0, r.post)  # a1 still out
    r.scheduler.chunk_done(a, TransferResult(True, bytes=2))
    assert r.scheduler.post_next(0.0, r.post) and r.posted[-1] == ("a", 2)
    r.scheduler.chunk_done(b, TransferResult(True, bytes=20))
    r.scheduler.chunk_done(a, TransferResult(True, bytes=3))
    assert [(name, result.ok, result.bytes) for name, result in r.ended] == [("b", True, 30), ("a", True, 6)]
    assert len(r.scheduler) == 0


def test_a_transfer_past_its_deadline_or_not_after_posts_nothing_more_and_ends_once_its_chunks_have() -> None:
    r = Recorder()
    late = split("late", 3, not_after=5.0)
    r.scheduler.add(late)
    assert r.scheduler.post_next(1.0, r.post)  # chunk 0 out
    assert r.scheduler.post_next(6.0, r.post)  # past not_after: fails, chunk 0 still out
    assert r.posted == [("late", 0)] and not r.ended
    r.scheduler.chunk_done(late, TransferResult(True))
    assert [(name, result.error) for name, result in r.ended] == [("late", NOT_POSTED_LATE)]
    overdue = split("overdue", 2, deadline=2.0)
    r.scheduler.add(overdue)
    assert r.scheduler.post_next(3.0, r.post)
    assert r.ended[-1][0] == "overdue" and "deadline" in r.ended[-1][1].error
    assert len(r.scheduler) == 0


def test_a_failed_chunk_fails_the_transfer_and_a_chunk_that_cannot_be_made_too() -> None:
    r = Recorder()
    a = split("a", 3)
    r.scheduler.add(a)
    r.scheduler.post_next(0.0, r.post)
    r.scheduler.chunk_done(a, TransferResult(False, "peer gone", peer_gone=True))
    assert r.ended[0][1].error == "peer gone" and not r.scheduler.post_next(0.0, r.post)

    def refuse(s: Split, index: int) -> None:
        raise RuntimeError("nixlRemoteDisconnectError")

    b = split("b", 2)
    r.scheduler.add(b)
    assert r.scheduler.post_next(0.0, refuse)
    assert r.ended[-1][0] == "b" and r.ended[-1][1].error.startswith("transfer setup failed")
    assert r.ended[-1][1].peer_gone and len(r.scheduler) == 0


def test_fail_where_stops_only_the_transfers_of_that_agent_and_remote() -> None:
    r = Recorder()
    a, b = split("a", 2), split("b", 2)
    r.scheduler.add(a)
    r.scheduler.add(b)
    r.scheduler.fail_where("unloaded", "a", "a-remote")
    assert [name for name, _ in r.ended] == ["a"]
    r.scheduler.fail_where("shutting down")
    assert [name for name, _ in r.ended] == ["a", "b"] and len(r.scheduler) == 0
