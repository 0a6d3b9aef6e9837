"""Driving a node pair past what it can move: the phases of ``bench.overload`` and
``tests/daemon/test_overload.py``.

``capacity`` measures what the pair moves with ``lanes`` requests always in flight (closed loop).
``offer`` then issues requests at a fixed rate (open loop: arrivals do not wait for earlier
requests, as users' requests do not) for a bounded time; each arrival takes a free ``Slot`` of
blocks on both engines (an arrival that finds none is counted ``engine_full``: the engine itself
would have queued it) and runs ``traffic.move`` on a thread of its own. ``Sampler`` records, every
``interval`` seconds, each sidecar's RSS and open fds and its GetStatus counters (pending
requests, leases, transfers in flight), so a test can assert they stay bounded.

Threads: ``offer``'s caller issues; one thread per slot runs requests; the sampler has its own.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import psutil

from engine_shim.backoff import BACKING_OFF
from engine_shim.client import engine_channel
from kvsidecar.v1 import engine_pb2, engine_pb2_grpc
from sidecar.tools.launcher import DaemonProcess
from tests.support.traffic import Outcome, ShimEngine, Slot, Tally, move


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class PhaseResult:
    name: str
    rate: float  # offered requests/s (0: closed loop)
    seconds: float
    counts: dict[str, int]
    engine_full: int = 0
    reached_per_s: float = 0.0  # requests that reached the sidecars (not engine_full), per second
    moved_per_s: float = 0.0
    p50_s: float = 0.0
    p99_s: float = 0.0
    # The same in D's sidecar's own account (Event.duration_ms: its call -> the event): the node's
    # latency without this process's own delays (it shares the cores it drives).
    sidecar_p50_s: float = 0.0
    sidecar_p99_s: float = 0.0
    refusal_codes: dict[str, int] = field(default_factory=dict)
    refusal_reasons: list[str] = field(default_factory=list)
    # Refusals the engine made itself, backing off after a sidecar's (``engine_shim.backoff``).
    refused_locally: int = 0
    # Refusals by the call refused and the bound: "D Pull: delay", "P SubmitBlocks: count", ...
    refusals_by: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, rate: float, seconds: float, outcomes: list[Outcome], engine_full: int = 0) -> PhaseResult:
        counts: dict[str, int] = {}
        codes: dict[str, int] = {}
        reasons: set[str] = set()
        for outcome in outcomes:
            counts[outcome.kind] = counts.get(outcome.kind, 0) + 1
            if outcome.kind == "refused":
                codes[outcome.code] = codes.get(outcome.code, 0) + 1
                reasons.add(f"{outcome.code}: {outcome.detail}")
        local = sum(1 for o in outcomes if o.kind == "refused" and BACKING_OFF in o.detail)
        by: dict[str, int] = {}
        for outcome in outcomes:
            if outcome.kind == "refused":
                kind = _refusal_kind(outcome.detail)
                by[kind] = by.get(kind, 0) + 1
        latencies = [o.seconds for o in outcomes if o.kind == "moved"]
        own = [o.sidecar_s for o in outcomes if o.kind == "moved"]
        return cls(
            name, rate, seconds, counts, engine_full, len(outcomes) / seconds, len(latencies) / seconds,
            percentile(latencies, 0.5), percentile(latencies, 0.99), percentile(own, 0.5), percentile(own, 0.99),
            codes, sorted(reasons)[:8], local, by,
        )  # fmt: skip


def _refusal_kind(detail: str) -> str:
    call = detail.split(":", 1)[0]
    if BACKING_OFF in detail:
        return f"{call}: backing off"
    if "estimated queueing delay" in detail:
        return f"{call}: delay"
    if "requests are pending" in detail:
        return f"{call}: count"
    return f"{call}: other"


def capacity(p: ShimEngine, d: ShimEngine, mode: str, lanes: int, seconds: float, pool: SlotPool) -> PhaseResult:
    """Closed loop: ``lanes`` requests always in flight for ``seconds`` (the pool's fixed content)."""
    tally = Tally()
    stop = threading.Event()
    counter = iter(range(1 << 62))

    def lane() -> None:
        while not stop.is_set():
            slot = pool.free.get()
            try:
                tally.add(move(p, d, mode, f"capacity-{next(counter)}", slot))
            finally:
                pool.free.put(slot)

    threads = [threading.Thread(target=lane, name=f"capacity-{i}", daemon=True) for i in range(lanes)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(60)
    return PhaseResult.of("capacity", 0.0, seconds, tally.outcomes)


class SlotPool:
    """Disjoint blocks for ``count`` requests at once, each with fixed random content on P (so a
    request's cost to this driver is a memset and a compare, not generating its bytes)."""

    def __init__(self, p: ShimEngine, count: int, blocks: int) -> None:
        self.free: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        rng = np.random.default_rng(count)
        for i in range(count):
            ids = list(range(i * blocks, (i + 1) * blocks))
            shape = (p.layout.num_layers * blocks, p.layout.block_len)
            p.write(ids, rng.integers(0, 256, shape, np.uint8))
            self.free.put(Slot(ids, ids, p.blocks(ids)))
        self.count = count


def offer(
    p: ShimEngine,
    d: ShimEngine,
    mode: str,
    rate: float,
    seconds: float,
    pool: SlotPool,
    name: str,
    wait_s: float = 30.0,
) -> PhaseResult:
    """Open loop at ``rate`` requests/s for ``seconds``; returns when every request ended."""
    tally = Tally()
    engine_full = 0
    counter = iter(range(1 << 62))

    def run(slot: Slot) -> None:
        try:
            tally.add(move(p, d, mode, f"{name}-{next(counter)}", slot, wait_s))
        finally:
            pool.free.put(slot)

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=pool.count, thread_name_prefix=f"offer-{name}") as executor:
        k = 0
        while True:
            due = started + k / rate
            if due - started >= seconds:
                break
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            k += 1
            try:
                slot = pool.free.get_nowait()
            except queue.Empty:
                engine_full += 1
                continue
            executor.submit(run, slot)
    return PhaseResult.of(name, rate, seconds, tally.outcomes, engine_full)


@dataclass
class Sample:
    at: float
    rss: dict[str, int]
    fds: dict[str, int]
    status: dict[str, dict[str, int]]
    # GetStatus.admission: the transfers the sidecar drives and its estimate of a new one's wait.
    admission: dict[str, dict[str, float]] = field(default_factory=dict)


class Sampler:
    """Every ``interval`` s: each sidecar's RSS, open fds and GetStatus counters."""

    FIELDS = ("pending_receives", "leases", "transfers_in_flight", "pending_push_registrations")
    ADMISSION = ("in_flight", "peak_in_flight", "throughput_per_second", "solo_ms", "queue_delay_ms", "refused")

    def __init__(self, sidecars: Sequence[DaemonProcess], interval: float = 0.25) -> None:
        self._sidecars = list(sidecars)
        self._interval = interval
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="overload-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        channels = {s.name: engine_channel(s.socket) for s in self._sidecars}
        try:
            while not self._stop.is_set():
                self.samples.append(self.sample(channels))
                self._stop.wait(self._interval)
        finally:
            for channel in channels.values():
                channel.close()

    def sample(self, channels: dict[str, grpc.Channel]) -> Sample:
        rss, fds, status, admission = {}, {}, {}, {}
        for sidecar in self._sidecars:
            assert sidecar.process is not None
            try:
                process = psutil.Process(sidecar.process.pid)
                rss[sidecar.name] = process.memory_info().rss
                fds[sidecar.name] = process.num_fds()
            except psutil.Error:
                continue
            try:
                stub = engine_pb2_grpc.EngineServiceStub(channels[sidecar.name])
                reply = stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=2.0)
                status[sidecar.name] = {name: getattr(reply, name) for name in self.FIELDS}
                admission[sidecar.name] = {name: getattr(reply.admission, name) for name in self.ADMISSION}
            except grpc.RpcError:
                status[sidecar.name] = {}
        return Sample(time.monotonic(), rss, fds, status, admission)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def now(self) -> Sample:
        """One sample, taken on the caller's thread."""
        channels = {s.name: engine_channel(s.socket) for s in self._sidecars}
        try:
            return self.sample(channels)
        finally:
            for channel in channels.values():
                channel.close()

    def peak(self, since: float = 0.0, until: float = float("inf")) -> dict[str, Any]:
        """Per sidecar: the highest RSS, fds and status counters sampled in [since, until]."""
        out: dict[str, Any] = {}
        for sample in self.samples:
            if not since <= sample.at <= until:
                continue
            for name in sample.rss:
                entry = out.setdefault(name, {"rss": 0, "fds": 0})
                entry["rss"] = max(entry["rss"], sample.rss[name])
                entry["fds"] = max(entry["fds"], sample.fds[name])
                for key, value in sample.status.get(name, {}).items():
                    entry[key] = max(entry.get(key, 0), value)
                for key, value in sample.admission.get(name, {}).items():
                    entry[f"admission_{key}"] = max(entry.get(f"admission_{key}", 0), value)
        return out
