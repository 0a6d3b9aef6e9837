"""Admission by queueing delay: the wait a new request would see behind the transfers this node
already drives, refused (RESOURCE_EXHAUSTED) past ``admission_max_queue_delay_ms``.

A count bound (``max_pending_requests``) lets an admitted request share the node with up to N
others, so its latency is about N times one request's; the right N depends on request sizes and on
what the node moves, which change. ``QueueDelay`` estimates the wait itself:

    estimated wait = in flight / throughput while busy - one request's own time alone

``throughput while busy`` is an EWMA of completions per second of busy time (time with at least
one transfer in flight), sampled every ``SAMPLE`` completions: over busy time, not wall time, so
an arrival-limited rate does not make a fast node look slow. ``one request's own time alone``
follows faster transfers at once and slower ones slowly, and only those that ran with no other
in flight: the service time without contention. ``in flight / throughput`` is when the work ahead is
done; a request admitted now takes its own time anyway, the rest is what it waits. So a node
whose transfers run in parallel (large ones on a fast link) estimates no wait until they contend,
and a saturated one ``in flight / capacity`` less the service time. A request with nothing ahead
is always admitted (progress is never refused); before the first sample there is no estimate.

Only requests whose time in the node is the node's own work count: the consumer's pulls (its
READs) and the producer's pushes once matched (its WRITEs); only pulls are refused by it (a push's
SubmitBlocks comes after its consumer registered: refusing it cost more than it saved). A consumer's push waits on the
producer's prefill and a producer's pull on the consumer's engine; counting those would make
waiting look like slowness. A transfer that failed (a peer gone, a deadline) is no evidence of
what the node moves: it drops the throughput sample it sat in.

The refusal names the estimate, the bound and when to ask again (``retry after N ms``: about one
request's share of the throughput, bounded), which ``engine_shim.backoff`` honours by refusing the
same call locally meanwhile, so a burst does not spend the node's CPU on refusals.

Used on the event loop thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvsidecar.v1 import engine_pb2
from sidecar.errors import ResourceExhausted

# Completions per throughput sample, and the EWMA weight of a new sample.
SAMPLE = 8
ALPHA = 0.25
# A transfer's time alone follows a faster one at once and a slower one slowly: it stands for the
# service time without contention (as Vegas' base RTT). Following slower ones at ALPHA would count
# the CPU contention of an overloaded node as service, and admit more as the node slows.
SOLO_DOWN, SOLO_UP = 0.5, 0.02
# The retry hint's range (ms): at least a poll, at most what a burst's shape changes within.
RETRY_MIN_MS, RETRY_MAX_MS = 1, 100


class Ticket:
    """One admitted transfer: when it started, and whether it has run alone so far."""

    __slots__ = ("solo", "started")

    def __init__(self, started: float, solo: bool) -> None:
        self.started = started
        self.solo = solo


class QueueDelay:
    """One queue of work this node drives (see the module doc). ``bound_s`` 0: never refuses
    (the estimate is still kept, for GetStatus)."""

    def __init__(self, name: str, bound_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.bound_s = bound_s
        self._clock = clock
        self._tickets: set[Ticket] = set()
        self.rate = 0.0  # completions per busy second (EWMA); 0: not measured yet
        self.solo_s = 0.0  # one transfer's time alone (EWMA); 0: none seen yet
        self.admitted = 0
        self.refused = 0
        self.peak_in_flight = 0
        self._since = clock()
        self._busy = 0.0  # busy seconds of the current sample
        self._done = 0  # completions of the current sample

    @property
    def in_flight(self) -> int:
        return len(self._tickets)

    def _advance(self) -> float:
        now = self._clock()
        if self._tickets:
            self._busy += now - self._since
        self._since = now
        return now

    def started(self) -> Ticket:
        now = self._advance()
        for other in self._tickets:
            other.solo = False
        ticket = Ticket(now, solo=not self._tickets)
        self._tickets.add(ticket)
        self.admitted += 1
        self.peak_in_flight = max(self.peak_in_flight, len(self._tickets))
        return ticket

    def ended(self, ticket: Ticket, ok: bool = True) -> None:
        """A transfer ended; ``ok``: it moved its bytes. A failed one (a peer gone, a deadline) says
        nothing of what the node moves, and the busy time it sat through would read as slowness:
        the sample in progress is dropped."""
        if ticket not in self._tickets:
            return
        now = self._advance()
        self._tickets.discard(ticket)
        if not ok:
            self._done, self._busy = 0, 0.0
            return
        took = now - ticket.started
        if not self.solo_s:
            self.solo_s = took
        elif took < self.solo_s:
            self.solo_s += SOLO_DOWN * (took - self.solo_s)
        elif ticket.solo:  # only a transfer that ran alone says the service itself got slower
            self.solo_s += SOLO_UP * (took - self.solo_s)
        self._done += 1
        if self._done >= SAMPLE and self._busy > 0:
            sample = self._done / self._busy
            self.rate = sample if not self.rate else self.rate + ALPHA * (sample - self.rate)
            self._done, self._busy = 0, 0.0

    def wait_s(self) -> float:
        """The estimated wait of a request admitted now (0 with nothing ahead or no estimate)."""
        if not self._tickets or not self.rate:
            return 0.0
        return max(0.0, self.in_flight / self.rate - self.solo_s)

    def status(self) -> engine_pb2.AdmissionStatus:
        return engine_pb2.AdmissionStatus(
            in_flight=self.in_flight,
            peak_in_flight=self.peak_in_flight,
            throughput_per_second=self.rate,
            solo_ms=self.solo_s * 1000.0,
            queue_delay_ms=self.wait_s() * 1000.0,
            bound_ms=self.bound_s * 1000.0,
            admitted=self.admitted,
            refused=self.refused,
        )

    def check(self) -> None:
        """Refuse (RESOURCE_EXHAUSTED) if a new request's estimated wait exceeds the bound."""
        if not self.bound_s:
            return
        wait = self.wait_s()
        if wait <= self.bound_s:
            return
        self.refused += 1
        retry_ms = min(RETRY_MAX_MS, max(RETRY_MIN_MS, round(1000.0 / self.rate)))
        raise ResourceExhausted(
            f"the estimated queueing delay is {wait * 1000:.0f} ms ({self.in_flight} {self.name} in flight at "
            f"{self.rate:.0f}/s, {self.solo_s * 1000:.1f} ms each alone), the bound is {self.bound_s * 1000:.0f} ms "
            f"(admission_max_queue_delay_ms); retry after {retry_ms} ms"
        )
