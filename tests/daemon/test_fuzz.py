"""Fuzzing the contract: every RPC of EngineService and PeerService, over real gRPC, against a real
sidecar process serving one real (simulated) engine, with structurally valid but hostile messages
and with raw random bytes.

For every message: no crash, never INTERNAL, UNKNOWN or a hang (DEADLINE_EXCEEDED). Afterwards:
both health services SERVING, nothing left behind (no leases, registrations, receives, holds,
transfers, strange engines, peers that never handshook), and RSS, fds and threads bounded.

Profiles (``KVSIDECAR_FUZZ_PROFILE``): ``ci`` (default: 100 messages per test, ~400 in all, part of
``make test``) and ``full`` (``make fuzz``: 10,000 structured + 10,000 raw messages per service).
Addresses are only ever loopback (see tests/support/fuzzing.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fuzzing import (
    ENGINE_METHODS,
    ENGINE_SERVICE,
    KNOWN_BLOCKS,
    KNOWN_ENGINE,
    PEER_METHODS,
    PEER_SERVICE,
    FuzzTarget,
    engine_calls,
    peer_calls,
    process_usage,
    wait_clean,
)
from tests.support.moves import kv, pull_and_wait
from tests.support.processes import EngineProcess, SidecarProcess

PROFILES = {"ci": 100, "full": 10_000}
PROFILE = os.environ.get("KVSIDECAR_FUZZ_PROFILE", "ci")
EXAMPLES = PROFILES[PROFILE]
pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(3600 if PROFILE == "full" else 300)]
WITNESS = "witness"  # a second engine, never named by fuzzed messages: it proves the sidecar still moves KV

# Short bounds so whatever a valid-looking message starts ends within seconds.
SETTINGS = {
    "lease_seconds": 3, "worker_attach_timeout_seconds": 2, "peer_call_timeout_seconds": 1,
    "producer_unknown_grace_seconds": 0.5, "push_registration_timeout_seconds": 3, "transfer_timeout_seconds": 3,
    "hold_ttl_seconds": 3,
    # Calls naming engines that never register wait this long for them (the path is exercised; a
    # longer wait would only slow the campaign down).
    "engine_arrival_wait_seconds": 0.02,
}  # fmt: skip
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=PROFILE == "ci",  # the same messages in every CI run; `make fuzz` explores
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
# Bounded RSS: a daemon keeps the high-water mark of the largest messages it parsed (one hostile
# SubmitBlocks naming 300,000 ids costs tens of MiB while it is handled; glibc keeps the pages), so
# the first half of a campaign may raise RSS by up to RSS_CAP_KIB; the second half, sending the
# same kinds of messages, must add at most RSS_SECOND_HALF_KIB: a leak grows with the count.
RSS_CAP_KIB = 768 * 1024
RSS_SECOND_HALF_KIB = 64 * 1024
FD_GROWTH = 8
THREAD_GROWTH = 4


class Campaign:
    """The sidecar, its engine and the running tallies of one fuzz test."""

    def __init__(self, sidecar: SidecarProcess, engine: EngineProcess, witness: EngineProcess, decoy: Path) -> None:
        self.sidecar, self.engine, self.witness, self.decoy = sidecar, engine, witness, decoy
        self.target = FuzzTarget(sidecar)
        assert sidecar.process is not None
        self.pid = sidecar.process.pid
        self.baseline = process_usage(self.pid)
        self.halfway: dict[str, int] | None = None

    def finish(self, label: str) -> None:
        """The checks after a campaign: serving, nothing left, resources back near the baseline."""
        target = self.target
        assert target.serving(), "health is not SERVING after fuzzing"
        target.release_touched()
        left = wait_clean(target, [KNOWN_ENGINE, WITNESS], timeout=30)
        usage = process_usage(self.pid)
        print(f"\n{label}: {target.sent} messages\n{target.table()}")
        print(f"{label}: baseline {self.baseline} -> halfway {self.halfway} -> after {usage}")
        findings = [f"forbidden status: {m} {c} {shape!r}: {example}" for (m, c, shape), example in
                    target.violations.items()]  # fmt: skip
        findings += [f"state left behind: {item}" for item in left]
        findings += [f"engine {e.engine_id} not complete or not watching" for e in target.status().engines
                     if not (e.complete and all(w.watching for w in e.workers))]  # fmt: skip
        for name, slack in (("fds", FD_GROWTH), ("threads", THREAD_GROWTH), ("rss_kib", RSS_CAP_KIB)):
            if usage[name] > self.baseline[name] + slack:
                findings.append(f"{name} grew from {self.baseline[name]} to {usage[name]} (allowed +{slack})")
        halfway = self.halfway or self.baseline
        if usage["rss_kib"] > halfway["rss_kib"] + RSS_SECOND_HALF_KIB:
            findings.append(
                f"rss_kib grew from {halfway['rss_kib']} halfway to {usage['rss_kib']} in the second half "
                f"(allowed +{RSS_SECOND_HALF_KIB}): it grows with the number of messages"
            )
        print("\n".join([f"{label}: findings:", *findings]) if findings else f"{label}: no findings")
        assert not findings, "\n".join(findings)
        # Still serves real work: the witness engine pulls the fuzzed engine's blocks, bytes intact.
        assert self.engine.command("fill", blocks=[1, 2], seed=3)["ok"]
        events = pull_and_wait(self.engine, self.witness, "after-fuzz", [1, 2], [3, 4])
        assert events[0]["event"] == "FINISHED_RECEIVING", events
        assert self.engine.wait_event("after-fuzz", 30)[0]["event"] == "FINISHED_SENDING"
        assert np.array_equal(kv(self.engine.buffers[0], 2, KNOWN_BLOCKS, 4096)[:, [1, 2]],
                              kv(self.witness.buffers[0], 2, KNOWN_BLOCKS, 4096)[:, [3, 4]])  # fmt: skip
        self.target.close()


@pytest.fixture
def campaign(workdir: Path, sidecars: Any, engines: Any) -> Iterator[Campaign]:
    args = [arg for name, value in SETTINGS.items() for arg in ("--set", f"{name}={value}")]
    sidecar = sidecars("fuzz", args=args)
    engine = engines(sidecar, KNOWN_ENGINE, "both", blocks=KNOWN_BLOCKS)
    witness = engines(sidecar, WITNESS, "both", blocks=KNOWN_BLOCKS)
    # A real shared-memory file a hostile RegisterWorker may name (with any geometry).
    decoy = Path("/dev/shm") / f"kvsfuzz-decoy-{os.getpid()}"
    decoy.write_bytes(bytes(64 * 4096))
    try:
        yield Campaign(sidecar, engine, witness, decoy)
    finally:
        decoy.unlink(missing_ok=True)


def _run(campaign: Campaign, strategy: st.SearchStrategy[tuple[str, Any]], service: str, label: str) -> None:
    target = campaign.target
    started = time.monotonic()

    @FUZZ_SETTINGS
    @given(call=strategy)
    def fire(call: tuple[str, Any]) -> None:
        method, request = call
        target.send(service, method, request)
        if target.sent % 500 == 0:
            assert target.serving(), f"not SERVING after {target.sent} messages"
        if target.sent == EXAMPLES // 2:
            campaign.halfway = process_usage(campaign.pid)

    fire()
    print(f"\n{label}: {target.sent} messages in {time.monotonic() - started:.0f} s")
    campaign.finish(label)


def test_engine_service_survives_hostile_messages(campaign: Campaign) -> None:
    _run(campaign, engine_calls(campaign.sidecar.address, campaign.decoy), ENGINE_SERVICE, "EngineService")


def test_peer_service_survives_hostile_messages(campaign: Campaign) -> None:
    _run(campaign, peer_calls(campaign.sidecar.address), PEER_SERVICE, "PeerService")


def test_engine_service_survives_raw_bytes(campaign: Campaign) -> None:
    raw = st.tuples(st.sampled_from([*ENGINE_METHODS, "WatchEvents"]), st.binary(max_size=2048))
    _run(campaign, raw, ENGINE_SERVICE, "EngineService raw bytes")


def test_peer_service_survives_raw_bytes(campaign: Campaign) -> None:
    _run(campaign, st.tuples(st.sampled_from(PEER_METHODS), st.binary(max_size=2048)), PEER_SERVICE,
         "PeerService raw bytes")  # fmt: skip
