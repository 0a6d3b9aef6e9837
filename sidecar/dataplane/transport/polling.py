"""When the owner thread polls NIXL (pure): NIXL's progress thread is off, so the owner thread
drives progress itself while anything is in flight or expected, and sleeps between polls as long
as this cadence says (``owner.NixlTransport._run``).
"""

from __future__ import annotations

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


def next_poll_delay(delay: float, since_activity: float, poll_max: float, waits_only_for_connects: bool) -> float:
    """The owner thread's next sleep between polls, ``since_activity`` seconds after it last
    posted, completed or received something (pure)."""
    if since_activity < _WARM_WINDOW_S:
        return min(max(delay * 2, MIN_DELAY_S), _WARM_DELAY_S)
    return min(delay * 2, max(poll_max, _CONNECT_DELAY_S) if waits_only_for_connects else poll_max)
