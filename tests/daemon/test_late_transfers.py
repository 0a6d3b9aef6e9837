"""A transfer must never land in, or be reported from, blocks the other side already gave back
(issue 17: KV written after its blocks were handed back).

Real sidecars, simulated engines, real NIXL and shared memory. A paused sidecar is a real SIGSTOP
of its process. The test plays the engine's reuse of freed blocks by overwriting them through the
engine's own shared-memory file the moment their terminal event arrives.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine_shim.client import SidecarClient
from tests.support.moves import PUSH, expect, start_pull
from tests.support.processes import EngineProcess, SidecarProcess, stopped, wait_until

# Large enough that a transfer takes tens of milliseconds, so a signal can land inside it.
LAYERS, BLOCKS, BLOCK_LEN = 2, 384, 131072
SHAPE = {"layers": LAYERS, "blocks": BLOCKS, "block_len": BLOCK_LEN}
MOVED = list(range(1, BLOCKS))


def kv(engine: EngineProcess, writable: bool = False) -> np.ndarray:
    return np.memmap(
        engine.buffers[0], dtype=np.uint8, mode="r+" if writable else "r", shape=(LAYERS, BLOCKS, BLOCK_LEN)
    )


def reuse(engine: EngineProcess, blocks: list[int], value: int) -> None:
    """What the engine does with blocks it got back: writes another request's KV into them."""
    view = kv(engine, writable=True)
    view[:, blocks] = value
    view.flush()


def until_reading(sidecar: SidecarProcess, request_id: str) -> bool:
    """Polls the consumer's status until its READ of ``request_id`` is under way; False if it ended first."""
    with SidecarClient(sidecar.socket) as client:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            rows = [r for r in client.status(include_requests=True).requests if r.request_id == request_id]
            if not rows:
                return False
            if rows[0].state == "reading":
                return True
    return False


@pytest.mark.parametrize("gives_up", ["engine_release", "heartbeats_fail"])
def test_push_write_never_lands_after_the_consumer_gave_up(sidecars, engines, gives_up: str) -> None:
    """P's sidecar is stopped while its WRITEs into D are due or in flight. D gives up (its engine
    releases the request, or P stops answering heartbeats) and the engine reuses the blocks; when
    P resumes, none of its WRITE may land there. Once P answered again, the same blocks take a
    push normally (the fence is lifted)."""
    fast = ["--set", "peer_call_timeout_seconds=1", "--set", "heartbeat_interval_seconds=0.3"]
    p_side, d_side = sidecars("p"), sidecars("d", args=fast)
    producer = engines(p_side, "P", "producer", **SHAPE)
    consumer = engines(d_side, "D", "consumer", **SHAPE)
    assert producer.command("fill", blocks=list(range(BLOCKS)), seed=5)["ok"]
    # Warm the handshakes both ways so the WRITE starts right after the submission.
    expect(consumer, producer, "warm-d", [0], transfer_id="t-warm")
    assert producer.command("submit", request_id="warm-p", blocks=[[0]], transfer_id="t-warm", mode=PUSH)["ok"]
    assert consumer.wait_event("warm-d", 10)[0]["event"] == "FINISHED_RECEIVING"

    expect(consumer, producer, "late-d", MOVED, transfer_id="t-late")
    assert producer.command("submit", request_id="late-p", blocks=[MOVED], transfer_id="t-late", mode=PUSH)["ok"]
    with stopped(p_side):
        if gives_up == "engine_release":
            assert consumer.command("release", request_id="late-d")["ok"]
        events = consumer.wait_event("late-d", 20)
        if events[0]["event"] == "FINISHED_RECEIVING":
            pytest.skip("the WRITE completed before the producer's sidecar was stopped")  # not the race under test
        assert events[0]["event"] == "LOAD_FAILED", events
        assert sorted(events[0]["failed_block_ids"]) == MOVED
        reuse(consumer, MOVED, 0)
    # P resumes: its WRITE (pending, or cut off mid-way) must not touch the reused blocks.
    sent = producer.wait_event("late-p", 20)[0]
    assert sent["event"] == "FINISHED_SENDING", sent
    time.sleep(0.5)
    assert not kv(consumer)[:, MOVED].any(), "a WRITE landed in blocks D had already handed back"

    # The fence lifts once P answers; the same blocks then take a push again.
    assert producer.command("fill", blocks=[7], seed=6)["ok"]

    def pushed() -> bool:
        request = f"again-{time.monotonic_ns()}"
        expect(consumer, producer, f"{request}-d", [3], transfer_id=request)
        assert producer.command("submit", request_id=f"{request}-p", blocks=[[7]], transfer_id=request, mode=PUSH)["ok"]
        return consumer.wait_event(f"{request}-d", 20)[0]["event"] == "FINISHED_RECEIVING"

    wait_until(pushed, 20, 0.5, "a push into the formerly fenced blocks")
    assert np.array_equal(kv(producer)[:, 7], kv(consumer)[:, 3])


@pytest.mark.parametrize("producer_lets_go", ["engine_release", "lease_expiry"])
def test_pull_never_reports_bytes_the_producer_reused(sidecars, engines, producer_lets_go: str) -> None:
    """D's sidecar is stopped in the middle of its READ. P lets the blocks go (its engine releases
    the request, or the lease expires without heartbeats) and reuses them; when D resumes, its READ
    must not be reported as FINISHED_RECEIVING unless its bytes are the ones P offered."""
    p_side, d_side = sidecars("p", args=["--lease-seconds", "2"]), sidecars("d")
    producer = engines(p_side, "P", "producer", **SHAPE)
    consumer = engines(d_side, "D", "consumer", **SHAPE)
    assert producer.command("fill", blocks=list(range(BLOCKS)), seed=7)["ok"]
    offered = np.array(kv(producer)[:, MOVED])
    # Warm the handshake so the READ starts right after the Pull.
    assert producer.command("submit", request_id="warm-p", blocks=[[0]])["ok"]
    assert start_pull(consumer, producer, "warm-d", [0], "warm-p", [0])["ok"]
    assert consumer.wait_event("warm-d", 10)[0]["event"] == "FINISHED_RECEIVING"

    assert producer.command("submit", request_id="read-p", blocks=[MOVED])["ok"]
    assert start_pull(consumer, producer, "read-d", MOVED, "read-p", MOVED)["ok"]
    if not until_reading(d_side, "read-d"):
        pytest.skip("the READ completed before the consumer's sidecar could be stopped")  # not the race under test
    with stopped(d_side):
        if producer_lets_go == "engine_release":
            assert producer.command("release", request_id="read-p")["ok"]
        freed = producer.wait_event("read-p", 20)[0]
        assert freed["event"] in ("FINISHED_SENDING", "LEASE_EXPIRED"), freed
        reuse(producer, MOVED, 0xAB)
    received = consumer.wait_event("read-d", 20)[0]
    if received["event"] == "FINISHED_RECEIVING":
        assert np.array_equal(np.array(kv(consumer)[:, MOVED]), offered), "D reported bytes P had already reused"
    else:
        assert received["event"] == "LOAD_FAILED" and sorted(received["failed_block_ids"]) == MOVED, received
        assert "deadline" in received["reason"], received


# --- peers that die or restart ------------------------------------------------------------------


def test_a_push_whose_producer_sidecar_dies_fails_within_heartbeat_periods(sidecars, engines) -> None:
    """A dead producer sidecar refuses connections: each heartbeat counts a failure at once instead
    of waiting out the call timeout, so D fails after heartbeat_failures_allowed periods."""
    d_args = ["--set", "heartbeat_interval_seconds=0.5", "--set", "peer_call_timeout_seconds=4"]
    p_side, d_side = sidecars("p"), sidecars("d", args=d_args)
    producer = engines(p_side, "P", "producer", layers=2, blocks=16, block_len=4096)
    consumer = engines(d_side, "D", "consumer", layers=2, blocks=16, block_len=4096)
    assert expect(consumer, producer, "dead-d", [1, 2], transfer_id="t-dead")["registered"]
    p_side.kill()
    started = time.monotonic()
    event = consumer.wait_event("dead-d", 30)[0]
    elapsed = time.monotonic() - started
    assert event["event"] == "LOAD_FAILED" and "stopped answering" in event["reason"], event
    assert sorted(event["failed_block_ids"]) == [1, 2]
    failures = [e for e in d_side.log_events() if e.get("event") == "heartbeat_failed"]
    assert failures and all("DEADLINE_EXCEEDED" not in e["error"] for e in failures), failures
    # Generous: 2 failures x 0.5 s periods; waiting out the 4 s call timeout each time needs > 8 s.
    assert elapsed < 8.0


@pytest.mark.parametrize("before", ["pull", "push"])
def test_the_first_pull_after_a_producer_engine_restart_succeeds(sidecars, engines, before: str) -> None:
    """P's engine restarts under the same sidecar (new memory, new NIXL agent); D's cached handshake
    of it is stale. After a pull, the READ through it would fail as a disconnect. After a push (the
    view came from the push registration's handshake: D never read from the engine, so there is no
    NIXL connection to lose), it would fail at transfer setup (NIXL_ERR_BACKEND; issue 12, chaos
    bug 1). Either way D's first pull from the new engine succeeds: the confirming heartbeat names
    the engine's new generation, and D handshakes again."""
    p_side, d_side = sidecars("p"), sidecars("d")
    small = {"layers": 2, "blocks": 16, "block_len": 4096}
    producer = engines(p_side, "P", "producer", **small)
    consumer = engines(d_side, "D", "consumer", **small)
    assert producer.command("fill", blocks=[1], seed=1)["ok"]
    if before == "pull":
        assert producer.command("submit", request_id="before-p", blocks=[[1]])["ok"]
        assert start_pull(consumer, producer, "before-d", [2], "before-p", [1])["ok"]
    else:
        expect(consumer, producer, "before-d", [2], transfer_id="t-before")
        assert producer.command("submit", request_id="before-p", blocks=[[1]], transfer_id="t-before",
                                mode=PUSH)["ok"]  # fmt: skip
    assert consumer.wait_event("before-d", 10)[0]["event"] == "FINISHED_RECEIVING"
    producer.kill()
    producer = engines(p_side, "P", "producer", **small)
    assert producer.command("fill", blocks=[3], seed=2)["ok"]
    assert producer.command("submit", request_id="after-p", blocks=[[3]])["ok"]
    assert start_pull(consumer, producer, "after-d", [4], "after-p", [3])["ok"]
    event = consumer.wait_event("after-d", 15)[0]
    assert event["event"] == "FINISHED_RECEIVING", event
    small_kv = (2, 16, 4096)
    source = np.memmap(producer.buffers[0], dtype=np.uint8, mode="r", shape=small_kv)
    target = np.memmap(consumer.buffers[0], dtype=np.uint8, mode="r", shape=small_kv)
    assert np.array_equal(source[:, 3], target[:, 4])


def test_a_consumer_engine_killed_mid_push_frees_the_producer_with_the_reason(sidecars, engines) -> None:
    """D's engine dies while P's WRITE is due: P's blocks are freed with FINISHED_SENDING and a
    reason that says the consumer let go, not LEASE_EXPIRED (no lease expired)."""
    p_side, d_side = sidecars("p"), sidecars("d")
    producer = engines(p_side, "P", "producer", **SHAPE)
    consumer = engines(d_side, "D", "consumer", **SHAPE)
    assert producer.command("fill", blocks=list(range(BLOCKS)), seed=5)["ok"]
    expect(consumer, producer, "gone-d", MOVED, transfer_id="t-gone")
    assert producer.command("submit", request_id="gone-p", blocks=[MOVED], transfer_id="t-gone", mode=PUSH)["ok"]
    with stopped(p_side):
        consumer.kill()  # D's sidecar drops the engine (its memory goes) and tells P
        wait_until(
            lambda: any(e.get("event") == "worker_removed" for e in d_side.log_events()),
            10,
            0.05,
            "D's sidecar dropping the engine",
        )
        time.sleep(0.3)
    sent = producer.wait_event("gone-p", 20)[0]
    assert sent["event"] == "FINISHED_SENDING", sent
    assert "released by consumer" in sent["reason"] or not sent["reason"], sent
