"""A node pair driven past what it can move (issue 35, item 3): admission refuses with
RESOURCE_EXHAUSTED and the bound it hit (the engine recomputes), never a hang or a queue past the
bound; what bounds the transfers a sidecar drives is the wait a new one would see
(``admission_max_queue_delay_ms``, ``sidecar.core.admission``), well before the count
(``max_pending_requests``); the sidecars' pending requests, memory and fds stay bounded; and once
the burst ends the pair moves every request again. Real daemons, real NIXL on loopback, simulated engines
(``tests/support/traffic.py``), open-loop arrivals (``tests/support/overload.py``).

Latency under load is a benchmark figure (``python -m bench.overload``), not asserted here.
``make test`` runs a seconds-long burst at 10x in pull mode; ``make overload`` runs both modes at
2x and 10x for longer.
"""

from __future__ import annotations

import json

import pytest

from tests.support.overload import PhaseResult, Sampler, SlotPool, capacity, offer
from tests.support.traffic import ShimEngine

MAX_PENDING = 16
SLOTS = 32
BOUND_MS = 10
BLOCKS = 4  # per request: 4 layers x 4 blocks x 256 KiB = 4 MiB
CASES = [
    pytest.param("pull", 10.0, 4.0, id="pull-10x"),
    pytest.param("push", 10.0, 20.0, marks=pytest.mark.overload_full, id="push-10x"),
    pytest.param("pull", 2.0, 20.0, marks=pytest.mark.overload_full, id="pull-2x"),
    pytest.param("push", 2.0, 20.0, marks=pytest.mark.overload_full, id="push-2x"),
]
# Generous: what matters is that nothing grows with the number of requests offered.
RSS_GROWTH = 256 * 1024 * 1024
FD_GROWTH = 64


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "factor", "seconds"), CASES)
def test_overload_is_refused_with_a_reason_stays_bounded_and_recovers(
    sidecars, mode: str, factor: float, seconds: float
) -> None:
    args = ["--set", f"max_pending_requests={MAX_PENDING}", "--set", f"admission_max_queue_delay_ms={BOUND_MS}"]
    p_side, d_side = sidecars("p", args), sidecars("d", args)
    p = ShimEngine(p_side.socket, "P", layers=4, blocks=SLOTS * BLOCKS, block_len=256 * 1024)
    try:
        d = ShimEngine(d_side.socket, "D", layers=4, blocks=SLOTS * BLOCKS, block_len=256 * 1024)
        try:
            pool = SlotPool(p, SLOTS, BLOCKS)
            sampler = Sampler([p_side, d_side]).start()
            try:
                base = capacity(p, d, mode, 3, 2.0, pool)
                rate = max(base.moved_per_s, 5.0)
                warm = sampler.peak()
                burst = offer(p, d, mode, factor * rate, seconds, pool, "burst")
                peak = sampler.peak()
                after = offer(p, d, mode, 0.5 * rate, 2.0, pool, "after")
                idle = sampler.now()
            finally:
                sampler.stop()
        finally:
            d.close()
    finally:
        p.close()
    print(json.dumps({"mode": mode, "factor": factor, **{r.name: r.__dict__ for r in (base, burst, after)}}))

    for phase in (base, burst, after):
        assert not phase.counts.get("lost"), phase
        assert not phase.counts.get("corrupt"), phase
    # Past capacity the sidecars refused work, each refusal RESOURCE_EXHAUSTED naming the bound:
    # the estimated queueing delay against admission_max_queue_delay_ms (or, for requests that
    # wait on the other side rather than load this one, the count).
    assert burst.counts.get("refused", 0) > 0, burst
    assert set(burst.refusal_codes) == {"RESOURCE_EXHAUSTED"}, burst.refusal_reasons
    delay = f"the bound is {BOUND_MS} ms (admission_max_queue_delay_ms)"
    count = f"the limit is {MAX_PENDING}"
    assert all(delay in reason or count in reason for reason in burst.refusal_reasons), burst.refusal_reasons
    assert burst.counts.get("moved", 0) > 0, burst  # and kept moving what it admitted
    driver = "d" if mode == "pull" else "p"
    assert peak[driver]["admission_throughput_per_second"] > 0, peak[driver]
    if mode == "pull":
        # The wait bounded what D admitted, not the count: in its own account, the most READs it
        # ever drove at once stayed far below max_pending_requests (at this bound, its throughput
        # and service time allow a few), and with them what a request queued behind.
        assert any(delay in reason and "estimated queueing delay" in reason for reason in burst.refusal_reasons)
        assert 0 < peak["d"]["admission_peak_in_flight"] <= MAX_PENDING // 2, peak["d"]
        assert peak["d"]["pending_receives"] <= MAX_PENDING // 2, peak["d"]
    # Bounded: requests held per side never past the limit; memory and fds did not grow with the load.
    for name, seen in peak.items():
        assert seen["pending_receives"] <= MAX_PENDING and seen["leases"] <= MAX_PENDING, (name, seen)
        assert seen["rss"] - warm[name]["rss"] < RSS_GROWTH, (name, seen, warm[name])
        assert seen["fds"] - warm[name]["fds"] < FD_GROWTH, (name, seen, warm[name])
    # Recovered: at half the capacity again it moves what it is offered (a stall of this shared
    # machine may still refuse a few), and once idle nothing is left pending on either side.
    assert _mostly_moved(after), after
    assert all(not any(counters.values()) for counters in idle.status.values()), idle.status


def _mostly_moved(phase: PhaseResult) -> bool:
    offered = sum(phase.counts.values()) + phase.engine_full
    return phase.counts.get("moved", 0) >= 0.9 * offered and set(phase.counts) <= {"moved", "refused"}
