"""The owner thread's polling cadence while it only waits for a notification
(``sidecar.dataplane.transport.polling.NotificationWaits``), without NIXL: a wait polls slowly
only for the part that recent waits say a notification cannot come in, never sleeps more than
QUIET_DELAY_S (the warm cadence) at a time there, and an earlier arrival shortens the next quiet
part."""

from __future__ import annotations

import pytest

from sidecar.dataplane.transport.polling import MIN_DELAY_S, QUIET_DELAY_S, NotificationWaits

HOT = MIN_DELAY_S
POLL_MAX = 0.001  # poll_interval_max_ms's default


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
    assert waits.delay(HOT, 200.0, POLL_MAX) == HOT
    assert NotificationWaits().delay(HOT, 200.0, POLL_MAX) == HOT  # nothing expected


def test_a_wait_polls_slowly_only_while_recent_waits_say_nothing_can_have_come() -> None:
    waits = waits_that_lasted(0.0017, 0.0019, 0.0018, 0.0021, 0.0017)
    quiet = waits.quiet_for()
    assert 0.001 < quiet < 0.0017  # the shortest wait, less a margin for the flush the initiator waits on
    waits.change(1, 200.0)
    assert waits.delay(HOT, 200.0, POLL_MAX) == QUIET_DELAY_S  # at its start: one quiet step
    assert waits.delay(HOT, 200.0 + quiet - 0.0001, POLL_MAX) == pytest.approx(0.0001)  # never past its end
    assert waits.delay(HOT, 200.0 + quiet, POLL_MAX) == HOT  # then the hot cadence, as before
    assert waits.delay(0.0002, 200.0 + 0.01, POLL_MAX) == 0.0002  # and the cadence's own back-off
    # poll_interval_max_ms still bounds every gap between polls while something is expected.
    assert waits.delay(HOT, 200.0, 0.0001) == 0.0001


def test_no_quiet_step_is_longer_than_the_warm_cadence() -> None:
    """Long waits too (large transfers, cut in chunks whose flushes need this side's polls long
    before the notification): the waiting side never polls slower than it did before."""
    for lengths in ((0.0017, 0.0019, 0.0018, 0.0021), (0.009, 0.008, 0.010, 0.0085)):
        waits = waits_that_lasted(*lengths)
        quiet = waits.quiet_for()
        waits.change(1, 200.0)
        for fraction in (0.0, 0.3, 0.6, 0.9):
            assert HOT < waits.delay(HOT, 200.0 + fraction * quiet, POLL_MAX) <= QUIET_DELAY_S
        assert waits.delay(HOT, 200.0 + quiet, POLL_MAX) == HOT


def test_an_earlier_arrival_ends_the_quiet_part() -> None:
    waits = waits_that_lasted(0.002, 0.002, 0.002, 0.002)
    assert waits.quiet_for() > 0
    waits.change(1, 50.0)
    waits.seen(50.0002)  # this one came after 0.2 ms
    waits.change(-1, 50.0002)
    assert waits.quiet_for() == 0.0
    waits.change(1, 60.0)
    assert waits.delay(HOT, 60.0, POLL_MAX) == HOT


def test_with_several_waits_the_oldest_decides_and_none_is_sampled() -> None:
    waits = waits_that_lasted(0.002, 0.002, 0.002, 0.002)
    quiet = waits.quiet_for()
    waits.change(1, 300.0)
    waits.change(2, 300.001)
    waits.seen(300.0011)  # which wait ended is unknown: not a sample
    assert waits.quiet_for() == quiet
    assert waits.delay(HOT, 300.0 + quiet, POLL_MAX) == HOT  # the oldest wait is past its quiet part
    waits.change(-1, 300.0012)  # the oldest ends; the next began 1 ms ago
    assert waits.delay(HOT, 300.0012, POLL_MAX) == QUIET_DELAY_S  # the next is in its quiet part
    waits.change(-5, 300.002)  # more ends than began (the transport's count clamps at 0 too)
    assert waits.delay(HOT, 300.002, POLL_MAX) == HOT
