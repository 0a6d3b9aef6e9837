"""Arrivals out of order: a consumer's Pull or PushReg that reaches P's sidecar before P's engine
has registered (P starting, or restarting) waits for the engine, bounded by
``engine_arrival_wait_seconds``, instead of failing at once. Real sidecars, real NIXL, simulated
engines that check bytes."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from tests.support.moves import kv
from tests.support.processes import EngineProcess

# A simulated engine takes 1-3 s to start on a busy machine: P's sidecar waits up to 8 s for it
# (within the 10 s peer call deadline), and D gives P's SubmitBlocks as long after that.
P_ARGS = ["--set", "engine_arrival_wait_seconds=8", "--set", "peer_call_timeout_seconds=10"]
# D's grace for a SubmitBlocks its Pull overtook is short: without P's sidecar waiting for the
# engine, D would give up while P's engine is still starting.
D_ARGS = ["--set", "peer_call_timeout_seconds=10", "--set", "producer_unknown_grace_seconds=1"]
BLOCKS, D_BLOCKS = [3, 4, 5], [10, 11, 12]


def _remote(address: str, request_id: str) -> dict[str, Any]:
    return {"address": address, "engine_id": "P", "request_id": request_id, "blocks": [BLOCKS]}


def _intact(producer: EngineProcess, consumer: EngineProcess) -> bool:
    return bool(np.array_equal(kv(producer.buffers[0], 2, 64, 4096)[:, BLOCKS],
                               kv(consumer.buffers[0], 2, 64, 4096)[:, D_BLOCKS]))  # fmt: skip


def test_a_pull_that_arrives_before_p_registers_waits_for_it(sidecars, engines) -> None:
    p_side, d_side = sidecars("p", args=P_ARGS), sidecars("d", args=D_ARGS)
    consumer = engines(d_side, "D", "consumer")
    assert consumer.command("pull", request_id="early-d", blocks=[D_BLOCKS], remote=_remote(p_side.address, "early"))[
        "ok"
    ]
    time.sleep(1.5)  # longer than D's grace
    producer = engines(p_side, "P", "producer")  # P's engine starts only now
    assert producer.command("fill", blocks=BLOCKS, seed=5)["ok"]
    assert producer.command("submit", request_id="early", blocks=[BLOCKS])["ok"]
    events = consumer.wait_event("early-d", 30)
    assert events[0]["event"] == "FINISHED_RECEIVING", events
    assert _intact(producer, consumer)
    assert producer.wait_event("early", 10)[0]["event"] == "FINISHED_SENDING"
    assert any(e.get("event") == "engine_arrived_while_peer_waited" for e in p_side.log_events())


def test_a_push_registration_that_arrives_before_p_restarts_waits_for_it(sidecars, engines) -> None:
    p_side, d_side = sidecars("p", args=P_ARGS), sidecars("d", args=D_ARGS)
    consumer = engines(d_side, "D", "consumer")
    engines(p_side, "P", "producer").kill()  # P restarting: its old engine is gone
    p_side_status = wait_unregistered(p_side)
    assert p_side_status
    replies: list[dict[str, Any]] = []
    remote = {"address": p_side.address, "engine_id": "P"}
    asking = threading.Thread(
        target=lambda: replies.append(
            consumer.command("expect_push", request_id="late-d", blocks=[D_BLOCKS], remote=remote, transfer_id="t1")
        )
    )
    asking.start()
    producer = engines(p_side, "P", "producer")  # the new P engine registers while PushReg waits
    asking.join(30)
    assert replies and replies[0]["ok"] and replies[0]["registered"], replies
    assert producer.command("fill", blocks=BLOCKS, seed=6)["ok"]
    assert producer.command("submit", request_id="late", blocks=[BLOCKS], transfer_id="t1", mode=2)["ok"]
    events = consumer.wait_event("late-d", 30)
    assert events[0]["event"] == "FINISHED_RECEIVING", events
    assert _intact(producer, consumer)


def test_an_engine_that_never_comes_fails_the_pull_after_the_bound(sidecars, engines) -> None:
    p_side = sidecars("p", args=["--set", "engine_arrival_wait_seconds=1.5"])
    d_side = sidecars("d", args=D_ARGS)
    consumer = engines(d_side, "D", "consumer")
    started = time.monotonic()
    assert consumer.command("pull", request_id="never-d", blocks=[D_BLOCKS], remote=_remote(p_side.address, "x"))["ok"]
    events = consumer.wait_event("never-d", 30)
    waited = time.monotonic() - started
    assert events[0]["event"] == "LOAD_FAILED" and "no longer holds" in events[0]["reason"], events
    assert sorted(events[0]["failed_block_ids"]) == D_BLOCKS
    assert waited >= 1.5 + 1, f"failed after {waited:.2f}s: it did not wait for the engine, then the grace"
    assert any(e.get("event") == "engine_did_not_arrive" for e in p_side.log_events())


def wait_unregistered(sidecar: Any, timeout: float = 10.0) -> bool:
    from tests.chaos.cells import status

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not status(sidecar).engines:
            return True
        time.sleep(0.05)
    return False


def test_a_pull_that_gave_up_waiting_never_reads_later(sidecars, engines) -> None:
    """D's Pull overtook P's SubmitBlocks and gave up after the grace (LOAD_FAILED: D's engine
    reuses the blocks). P's SubmitBlocks arriving afterwards must not be read into them, and D
    said it gave up (a Release, kept until the SubmitBlocks came): P's engine gets its blocks back
    at once, not at the lease's end."""
    p_side = sidecars("p", args=["--set", "engine_arrival_wait_seconds=0"])
    d_side = sidecars("d", args=["--set", "producer_unknown_grace_seconds=0.5",
                                 "--set", "heartbeat_interval_seconds=0.02"])  # fmt: skip
    producer = engines(p_side, "P", "producer")
    consumer = engines(d_side, "D", "consumer")
    for attempt in range(3):  # the race between D's heartbeat loop and its pull: a few tries
        request = f"gave-up-{attempt}"
        reply = consumer.command(
            "pull", request_id=f"{request}-d", blocks=[D_BLOCKS], remote=_remote(p_side.address, request)
        )
        assert reply["ok"], reply
        event = consumer.wait_event(f"{request}-d", 10)[0]
        assert event["event"] == "LOAD_FAILED", event
        assert consumer.command("fill", blocks=D_BLOCKS, seed=70 + attempt)["ok"]  # D reuses its blocks
        reused = np.array(kv(consumer.buffers[0], 2, 64, 4096)[:, D_BLOCKS])
        assert producer.command("fill", blocks=BLOCKS, seed=80 + attempt)["ok"]
        assert producer.command("submit", request_id=request, blocks=[BLOCKS], lease_seconds=1)["ok"]
        ended = producer.wait_event(request, 10)[0]
        assert ended["event"] == "FINISHED_SENDING" and "released by consumer" in ended["reason"], ended
        assert np.array_equal(kv(consumer.buffers[0], 2, 64, 4096)[:, D_BLOCKS], reused), "a late READ landed"
