"""The owner thread's polling cadence while it only waits for a notification
(``sidecar.dataplane.transport.polling.NotificationWaits``), without NIXL: a wait polls slowly
only for the part that recent waits say a notification cannot come in, never sleeps more than
QUIET_DELAY_S at a time there, and an earlier arrival shortens the next quiet part."""

from __future__ import annotations

import pytest

from sidecar.dataplane.transport.polling import MIN_DELAY_S, QUIET_DELAY_S, NotificationWaits

HOT = MIN_DELAY_S


def waits_that_lasted(*lengths: float) -> NotificationWaits:
    """Waits, one at a time, each seen ``length`` seconds after it began."""
    waits = NotificationWaits()
    now = 100.0
    for length in lengths:
        waits.change(1, now)
        waits.seen(now + length)
        waits.change(-1, now + length)
        now += 1.0
    return waits


def test_without_enough_history_a_wait_polls_at_the_cadence_it_is_given() -> None:
    waits = waits_that_lasted(0.002, 0.002, 0.002)  # three waits: not enough to go by
    waits.change(1, 200.0)
    assert waits.delay(HOT, 200.0) == HOT
    assert NotificationWaits().delay(HOT, 200.0) == HOT  # nothing expected


def test_a_wait_polls_slowly_only_while_recent_waits_say_nothing_can_have_come() -> None:
    waits = waits_that_lasted(0.0017, 0.0019, 0.0018, 0.0021, 0.0017)
    quiet = waits.quiet_for()
    assert 0.0008 < quiet < 0.0017  # the shortest wait, less a margin for the flush the initiator waits on
    waits.change(1, 200.0)
    assert waits.delay(HOT, 200.0) == QUIET_DELAY_S  # at its start: one quiet step
    assert waits.delay(HOT, 200.0 + quiet - 0.0001) == pytest.approx(0.0001)  # never past the quiet part
    assert waits.delay(HOT, 200.0 + quiet) == HOT  # then the hot cadence, as before
    assert waits.delay(0.0002, 200.0 + 0.01) == 0.0002  # and the cadence's own back-off
    for at in (0.0, 0.0003, 0.0006, 0.0009):  # no step is longer than QUIET_DELAY_S
        assert HOT <= waits.delay(HOT, 200.0 + at) <= QUIET_DELAY_S


def test_an_earlier_arrival_ends_the_quiet_part() -> None:
    waits = waits_that_lasted(0.002, 0.002, 0.002, 0.002)
    assert waits.quiet_for() > 0
    waits.change(1, 50.0)
    waits.seen(50.0003)  # this one came after 0.3 ms
    waits.change(-1, 50.0003)
    assert waits.quiet_for() == 0.0
    waits.change(1, 60.0)
    assert waits.delay(HOT, 60.0) == HOT


def test_with_several_waits_the_oldest_decides_and_none_is_sampled() -> None:
    waits = waits_that_lasted(0.002, 0.002, 0.002, 0.002)
    quiet = waits.quiet_for()
    waits.change(1, 300.0)
    waits.change(2, 300.001)
    waits.seen(300.0011)  # which wait ended is unknown: not a sample
    assert waits.quiet_for() == quiet
    assert waits.delay(HOT, 300.0 + quiet) == HOT  # the oldest wait is past its quiet part
    waits.change(-1, 300.0012)  # the oldest ends; the next began 1 ms ago
    assert waits.delay(HOT, 300.0012) == pytest.approx(min(QUIET_DELAY_S, quiet - 0.0002))
    waits.change(-5, 300.002)  # more ends than began (the transport's count clamps at 0 too)
    assert waits.delay(HOT, 300.002) == HOT
