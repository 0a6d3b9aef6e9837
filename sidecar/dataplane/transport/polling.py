"""When the owner thread polls NIXL (pure): NIXL's progress thread is off, so the owner thread
drives progress itself while anything is in flight or expected, and sleeps between polls as long
as this cadence says (``owner.NixlTransport._run``).
"""

from __future__ import annotations

from collections import deque

# Poll cadence while something is expected: every ~50 us for 2 ms after activity (completions and
# notifications follow within microseconds), every 200 us for 100 ms after it (a busy sidecar's
# next request), then backing off to poll_interval_max_ms (a push that waits for a long prefill).
HOT_WINDOW_S = 0.002
MIN_DELAY_S = 0.00005
_WARM_WINDOW_S = 0.1
_WARM_DELAY_S = 0.0002
# Polled only so that a peer that just handshaked can wire up to our agents (``warm``), with no
# transfer or notification expected: its first transfer almost always follows at once (the warm
# window above), so later the owner thread polls at this pace. At poll_interval_max_ms it kept a
# sidecar at 0.05-0.09 of a core for the 5 s after every handshake; this costs a late first
# transfer at most this much more, once per peer.
_CONNECT_DELAY_S = 0.01

# A side that only waits for a notification (nothing of its own in flight) cannot be woken by
# NIXL, so it polls; and with UCX's "peer" error handling its polls are needed twice per transfer:
# once to answer the initiator's flush (after which the initiator sends the notification) and once
# to receive it, ~0.25 ms later. Neither can happen before the other side posts, and the other
# side's control path takes about as long from one request to the next: at 100 req/s a wait lasted
# ~1.7 ms, of which the hot cadence spent ~1.2 ms polling for nothing (13-22 wake-ups per request).
# So while a wait is younger than the shortest of the last _WAIT_SAMPLES waits less _QUIET_MARGIN_S
# (the flush is needed 0.21-0.25 ms before the notification is seen: bench.control_timeline, pull
# at 100 req/s, P's wait against D's post), the owner thread polls at QUIET_DELAY_S, the warm cadence
# (never slower than it polled before): an earlier transfer is seen at most that much later, and
# it shortens the next quiet part. Not slower: a large transfer's chunks need the waiting side's
# polls (each chunk's flush) long before its notification; and sleeping through a short quiet
# part at once (D's wake-ups 22 -> 9-11 per push) cost push p99 0.1-0.6 ms in 4 of 5 rounds.
QUIET_DELAY_S = _WARM_DELAY_S
_QUIET_MARGIN_S = 0.0003
_WAIT_SAMPLES = 16
_MIN_WAIT_SAMPLES = 4


def next_poll_delay(delay: float, since_activity: float, poll_max: float, waits_only_for_connects: bool) -> float:
    """The owner thread's next sleep between polls, ``since_activity`` seconds after it last
    posted, completed or received something (pure)."""
    if since_activity < _WARM_WINDOW_S:
        return min(max(delay * 2, MIN_DELAY_S), _WARM_DELAY_S)
    return min(delay * 2, max(poll_max, _CONNECT_DELAY_S) if waits_only_for_connects else poll_max)


class NotificationWaits:
    """The waits for expected notifications: when each began, and how long recent ones lasted (from
    the rise of the expected count to the poll that saw the notification), which says how long a
    new wait stays quiet. ``change`` runs on the loop thread (``expect_notifications``; deque
    appends and pops are atomic), ``seen``/``delay`` on the owner thread."""

    def __init__(self) -> None:
        self._starts: deque[float] = deque()  # oldest first
        self._samples: deque[float] = deque(maxlen=_WAIT_SAMPLES)

    def change(self, delta: int, now: float) -> None:
        """The expected count changed by ``delta``: waits began (now), or the oldest ended."""
        if delta > 0:
            self._starts.extend([now] * delta)
        for _ in range(min(-delta, len(self._starts))):
            self._starts.popleft()

    def seen(self, now: float) -> None:
        """A poll saw notifications: with one wait pending its length is a clean sample (with
        several, which one ended is unknown)."""
        try:
            if len(self._starts) == 1:
                self._samples.append(max(0.0, now - self._starts[0]))
        except IndexError:  # the loop thread ended it meanwhile
            pass

    def quiet_for(self) -> float:
        """How long a wait polls at the quiet cadence: 0 until enough waits were seen."""
        if len(self._samples) < _MIN_WAIT_SAMPLES:
            return 0.0
        return max(0.0, min(self._samples) - _QUIET_MARGIN_S)

    def delay(self, delay: float, now: float, poll_max: float) -> float:
        """The sleep of a side that only waits: ``delay`` (the cadence above) once the oldest wait
        is past its quiet part, else up to its end in steps of at most QUIET_DELAY_S (and
        ``poll_max``, poll_interval_max_ms: still the longest gap while something is expected)."""
        try:
            since_wait = now - self._starts[0]
        except IndexError:  # nothing expected (or the loop thread just ended the last wait)
            return delay
        quiet_for = self.quiet_for()
        if since_wait >= quiet_for:
            return delay
        return max(delay, min(quiet_for - since_wait, QUIET_DELAY_S, poll_max))
