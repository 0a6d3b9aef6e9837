"""Admission by queueing delay without a node (``sidecar.core.admission``), on a fake clock: the
estimate (in flight / throughput while busy - one transfer's time alone), that nothing is refused
with nothing ahead or before a measurement, that idle time does not make a node look slow, that
transfers running in parallel are not taken for a queue, the refusal's reason, and the engine
shim's back-off on it (``engine_shim.backoff``)."""

from __future__ import annotations

import time

import grpc
import pytest

from engine_shim.backoff import MAX_S, RefusalBackoff
from engine_shim.session import SessionCallError
from kvsidecar.v1 import common_pb2, engine_pb2
from sidecar.core.admission import SAMPLE, QueueDelay
from sidecar.errors import ResourceExhausted


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def serial(queue: QueueDelay, clock: Clock, count: int, each: float, gap: float = 0.0) -> None:
    """``count`` transfers one after another, ``each`` seconds, ``gap`` idle seconds between."""
    for _ in range(count):
        ticket = queue.started()
        clock.now += each
        queue.ended(ticket)
        clock.now += gap


def test_the_time_alone_follows_faster_transfers_at_once_and_slower_ones_slowly() -> None:
    clock = Clock()
    queue = QueueDelay("transfers", 0.010, clock)
    serial(queue, clock, 4, 0.005)
    assert queue.solo_s == pytest.approx(0.005)
    serial(queue, clock, 4, 0.050)  # an overloaded machine slows everything: not service time
    assert queue.solo_s < 0.010
    serial(queue, clock, 4, 0.002)
    assert queue.solo_s < 0.003


def test_a_failed_transfer_is_no_evidence_of_throughput() -> None:
    clock = Clock()
    queue = QueueDelay("transfers", 0.020, clock)
    serial(queue, clock, SAMPLE, 0.005)
    assert queue.rate == pytest.approx(200.0)
    # A consumer died: 3 pushes sit until their deadline, then fail; the node is not slower.
    stuck = [queue.started() for _ in range(3)]
    clock.now += 5.0
    for ticket in stuck:
        queue.ended(ticket, ok=False)
    serial(queue, clock, 2 * SAMPLE, 0.005)
    assert queue.rate == pytest.approx(200.0)
    assert queue.solo_s == pytest.approx(0.005)


def test_overlapping_transfers_only_lower_the_time_alone() -> None:
    clock = Clock()
    queue = QueueDelay("transfers", 0.020, clock)
    for took in (0.010, 0.004):  # two at once, never one alone: the faster bounds the service time
        first, second = queue.started(), queue.started()
        clock.now += took
        queue.ended(first)
        queue.ended(second)
    assert queue.solo_s < 0.008
    slow = [queue.started(), queue.started()]
    clock.now += 0.100
    for ticket in slow:
        queue.ended(ticket)
    assert queue.solo_s < 0.008  # contention, not service


def test_nothing_is_refused_before_a_measurement_or_with_nothing_ahead() -> None:
    clock = Clock()
    queue = QueueDelay("transfers", 0.001, clock)
    tickets = [queue.started() for _ in range(50)]  # no completion yet: no estimate
    queue.check()
    for ticket in tickets:
        clock.now += 1.0
        queue.ended(ticket)
    assert queue.rate > 0 and queue.in_flight == 0
    queue.check()  # nothing ahead: admitted however slow the node measured


def test_throughput_is_measured_over_busy_time_only() -> None:
    clock = Clock()
    queue = QueueDelay("transfers", 0.010, clock)
    # 10 ms each, 1 s idle between: the node moves 100/s while busy, though 1/s arrive.
    serial(queue, clock, 2 * SAMPLE, 0.010, gap=1.0)
    assert queue.rate == pytest.approx(100.0)
    assert queue.solo_s == pytest.approx(0.010)
    queue.started()
    assert queue.wait_s() == pytest.approx(0.0)  # one ahead at 100/s, 10 ms each alone: no wait
    queue.check()


def test_a_saturated_node_refuses_past_the_bound_and_says_why() -> None:
    clock = Clock()
    queue = QueueDelay("transfers", 0.020, clock)
    serial(queue, clock, SAMPLE, 0.005)  # alone: 5 ms each, 200/s
    # Then rounds of 8 at once that share the node: they end 5 ms apart (200/s), none alone.
    for _ in range(3):
        tickets = [queue.started() for _ in range(8)]
        for ticket in tickets:
            clock.now += 0.005
            queue.ended(ticket)
    assert queue.rate == pytest.approx(200.0)
    assert queue.solo_s == pytest.approx(0.005)
    ahead = [queue.started() for _ in range(4)]  # 4 / 200/s - 5 ms = 15 ms: within the bound
    queue.check()
    ahead += [queue.started(), queue.started()]  # 6: 25 ms
    assert queue.wait_s() == pytest.approx(0.025)
    with pytest.raises(ResourceExhausted) as refused:
        queue.check()
    reason = str(refused.value)
    assert "the estimated queueing delay is 25 ms" in reason
    assert "the bound is 20 ms (admission_max_queue_delay_ms)" in reason
    assert "retry after 5 ms" in reason
    assert queue.refused == 1 and queue.peak_in_flight == 8  # the rounds of 8
    status = queue.status()
    assert status.in_flight == 6 and status.bound_ms == pytest.approx(20.0) and status.refused == 1
    # Work drains: admitted again.
    for ticket in ahead[:2]:
        clock.now += 0.005
        queue.ended(ticket)
    queue.check()


def test_transfers_that_run_in_parallel_are_not_a_queue() -> None:
    clock = Clock()
    queue = QueueDelay("transfers", 0.010, clock)
    serial(queue, clock, SAMPLE, 0.050)  # a large transfer: 50 ms alone
    for _ in range(40):
        # 4 at once, each still 50 ms (a fast link): 80/s while busy.
        tickets = [queue.started() for _ in range(4)]
        clock.now += 0.050
        for ticket in tickets:
            queue.ended(ticket)
    assert queue.rate == pytest.approx(80.0, rel=0.01)
    for _ in range(4):
        queue.started()
    assert queue.wait_s() == pytest.approx(0.0, abs=0.001)  # 4 / 80/s - 50 ms
    queue.check()


def test_no_bound_never_refuses() -> None:
    clock = Clock()
    queue = QueueDelay("transfers", 0.0, clock)
    serial(queue, clock, SAMPLE, 0.010)
    for _ in range(100):
        queue.started()
    assert queue.wait_s() > 0.5
    queue.check()


def test_the_shim_backs_off_after_a_refusal_with_a_hint_only() -> None:
    backoff = RefusalBackoff()
    pull = engine_pb2.PullRequest()
    push = engine_pb2.SubmitBlocksRequest(mode=common_pb2.TRANSFER_MODE_PUSH)
    plain = engine_pb2.SubmitBlocksRequest(mode=common_pb2.TRANSFER_MODE_PULL)
    count = SessionCallError(grpc.StatusCode.RESOURCE_EXHAUSTED, "8 requests are pending, the limit is 8")
    backoff.observe("Pull", pull, count)
    assert backoff.refused_locally("Pull", pull) is None  # no hint: the engine asks every time
    hinted = "the estimated queueing delay is 30 ms (...), the bound is 20 ms; retry after 50 ms"
    backoff.observe("SubmitBlocks", push, SessionCallError(grpc.StatusCode.RESOURCE_EXHAUSTED, hinted))
    reason = backoff.refused_locally("SubmitBlocks", push)
    assert reason is not None and reason.startswith(hinted)
    assert backoff.refused_locally("SubmitBlocks", plain) is None  # a pull's submission is not refused
    assert backoff.refused_locally("Pull", pull) is None
    long = "... retry after 100000 ms"
    backoff.observe("Pull", pull, SessionCallError(grpc.StatusCode.RESOURCE_EXHAUSTED, long))
    until, _ = backoff._until[("Pull", 0)]
    assert until - time.monotonic() <= MAX_S  # bounded, whatever the hint
