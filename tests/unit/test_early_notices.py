"""EarlyNotices: READ notifications and releases kept for requests whose SubmitBlocks is late,
bounded in age and count, each handed over once."""

from __future__ import annotations

from sidecar.core.early_notices import EarlyNotices, ReadNotice, ReleaseNotice


def _notice(agent: str = "a0") -> ReadNotice:
    return ReadNotice(agent, 1, "sender", 0.0)


def test_kept_notices_are_handed_over_once() -> None:
    early: EarlyNotices[str] = EarlyNotices(max_age_seconds=2.0)
    assert early.keep("r1", _notice("a0"), now=10.0) == []
    assert early.keep("r1", _notice("a1"), now=10.5) == []
    assert [n.agent_name for n in early.take("r1", now=11.0)] == ["a0", "a1"]
    assert early.take("r1", now=11.0) == [] and len(early) == 0


def test_old_notices_are_dropped_and_named() -> None:
    early: EarlyNotices[str] = EarlyNotices(max_age_seconds=2.0)
    early.keep("old", _notice(), now=10.0)
    early.keep("late", _notice(), now=11.0)
    assert early.take("late", now=13.5) == []  # too old to count when its request came
    assert early.keep("new", _notice(), now=13.5) == ["old"]  # dropped unclaimed, for the log
    assert len(early) == 1


def test_capacity_drops_the_oldest() -> None:
    early: EarlyNotices[int] = EarlyNotices(max_age_seconds=60.0, capacity=2)
    assert early.keep(1, _notice(), now=0.0) == []
    assert early.keep(2, _notice(), now=0.1) == []
    assert early.keep(1, _notice("a1"), now=0.2) == []  # a second one for a kept request takes no room
    assert early.keep(3, _notice(), now=0.3) == [1]
    assert early.take(2, now=0.4) and early.take(3, now=0.4) and len(early) == 0


def test_reads_and_releases_are_handed_over_in_their_order() -> None:
    early: EarlyNotices[str] = EarlyNotices(max_age_seconds=2.0)
    early.keep("r1", _notice("a0"), now=10.0)
    early.keep("r1", ReleaseNotice(consumed=True, reason="done", identity=""), now=10.1)
    assert [type(n) for n in early.take("r1", now=10.2)] == [ReadNotice, ReleaseNotice]


def test_peek_leaves_the_notices_for_every_later_caller_until_they_are_too_old() -> None:
    """A producer's release is shown to each consumer that registers for the request after it."""
    early: EarlyNotices[str] = EarlyNotices(max_age_seconds=2.0)
    early.keep("r1", ReleaseNotice(False, "prefill failed", ""), now=10.0)
    assert [n.reason for n in early.peek("r1", now=11.0) if isinstance(n, ReleaseNotice)] == ["prefill failed"]
    assert len(early.peek("r1", now=11.5)) == 1 and len(early) == 1
    assert early.peek("r1", now=12.5) == [] and early.peek("other", now=11.0) == []
