"""Push mode with real processes: D registers its blocks with P's sidecar, P's sidecar WRITEs them
when prefill ends, in either order; failures reach the waiting side explicitly."""

from __future__ import annotations

import itertools
import random
import signal
import time
import uuid

import numpy as np
import pytest

from tests.support.moves import PUSH, PUSH_SHAPE, engine_pair, expect, kv, start_pull
from tests.support.processes import EngineProcess, wait_until

LAYERS, BLOCKS, BLOCK_LEN = PUSH_SHAPE["layers"], PUSH_SHAPE["blocks"], PUSH_SHAPE["block_len"]


def vllm_id(base: str) -> str:
    """A vLLM-style request id: the shared base plus this engine's random 8-hex suffix."""
    return f"{base}-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("same", [False, True], ids=["two_sidecars", "same_sidecar"])
def test_both_orders_in_random_interleavings_byte_for_byte(sidecars, engines, same: bool) -> None:
    producer, consumer, _, _ = engine_pair(sidecars, engines, same)
    assert producer.command("fill", blocks=list(range(BLOCKS)), seed=21)["ok"]
    rng = random.Random(8)
    d_free = list(range(BLOCKS))
    rng.shuffle(d_free)
    requests = []
    for index in range(24):
        count = rng.randint(1, 5)
        p_blocks = rng.sample(range(BLOCKS), count)
        d_blocks = [d_free.pop() for _ in range(count)]
        base = f"cmpl-{uuid.uuid4().hex[:12]}-0"
        transfer_id = f"xfer-{index}" if index % 2 == 0 else ""  # half match on base ids
        requests.append((base, transfer_id, p_blocks, d_blocks, vllm_id(base), vllm_id(base)))
    operations = [("d", r) for r in requests] + [("p", r) for r in requests]
    rng.shuffle(operations)
    for side, (_, transfer_id, p_blocks, d_blocks, p_id, d_id) in operations:
        if side == "p":
            reply = producer.command("submit", request_id=p_id, blocks=[p_blocks], transfer_id=transfer_id, mode=PUSH)
            assert reply["ok"], reply
        else:
            expect(consumer, producer, d_id, d_blocks, transfer_id=transfer_id)
    for _, _, _, _, p_id, d_id in requests:
        assert consumer.wait_event(d_id, 20)[0]["event"] == "FINISHED_RECEIVING", consumer.events_for(d_id)
        assert producer.wait_event(p_id, 20)[0]["event"] == "FINISHED_SENDING", producer.events_for(p_id)
    source, target = (
        kv(producer.buffers[0], LAYERS, BLOCKS, BLOCK_LEN),
        kv(consumer.buffers[0], LAYERS, BLOCKS, BLOCK_LEN),
    )
    written = set()
    for base, _, p_blocks, d_blocks, _, _ in requests:
        for src, dst in zip(p_blocks, d_blocks, strict=True):
            assert np.array_equal(source[:, src], target[:, dst]), f"{base}: D block {dst} != P block {src}"
        written.update(d_blocks)
    untouched = sorted(set(range(BLOCKS)) - written)
    assert not target[:, untouched].any()


def test_partial_prefix_hit_on_d_writes_only_the_tail(sidecars, engines) -> None:
    producer, consumer, _, _ = engine_pair(sidecars, engines)
    assert producer.command("fill", blocks=list(range(BLOCKS)), seed=4)["ok"]
    expect(consumer, producer, "partial-d", [100, 101], transfer_id="t-partial")
    assert producer.command(
        "submit", request_id="partial-p", blocks=[[10, 11, 12, 13, 14]], transfer_id="t-partial", mode=PUSH
    )["ok"]
    assert consumer.wait_event("partial-d", 10)[0]["event"] == "FINISHED_RECEIVING"
    source, target = (
        kv(producer.buffers[0], LAYERS, BLOCKS, BLOCK_LEN),
        kv(consumer.buffers[0], LAYERS, BLOCKS, BLOCK_LEN),
    )
    assert np.array_equal(source[:, [13, 14]], target[:, [100, 101]])
    others = [b for b in range(BLOCKS) if b not in (100, 101)]
    assert not target[:, others].any()


def test_d_dies_after_push_reg_and_p_lease_frees_the_blocks(sidecars, engines) -> None:
    producer, consumer, p_side, _ = engine_pair(sidecars, engines, p_args=["--lease-seconds", "1.5"])
    expect(consumer, producer, "orphan-d", [1, 2], transfer_id="t-orphan")
    consumer.kill()  # D's engine dies; its sidecar drops the registration at P
    started = time.monotonic()
    assert producer.command("submit", request_id="orphan-p", blocks=[[5, 6]], transfer_id="t-orphan", mode=PUSH)["ok"]
    event = producer.wait_event("orphan-p", 10)[0]
    assert event["event"] in ("LEASE_EXPIRED", "FINISHED_SENDING"), event
    assert time.monotonic() - started < 6.0
    # P's sidecar keeps serving: a new consumer on it works.
    consumer2 = engines(p_side, "D2", "consumer", layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN)
    assert producer.command("fill", blocks=[7], seed=3)["ok"]
    expect(consumer2, producer, "after-d", [9], transfer_id="t-after")
    assert producer.command("submit", request_id="after-p", blocks=[[7]], transfer_id="t-after", mode=PUSH)["ok"]
    assert consumer2.wait_event("after-d", 10)[0]["event"] == "FINISHED_RECEIVING"


def test_d_sidecar_gone_between_registration_and_write_p_frees(sidecars, engines) -> None:
    producer, consumer, p_side, d_side = engine_pair(sidecars, engines)
    expect(consumer, producer, "lost-d", [1, 2], transfer_id="t-lost")
    d_side.kill()
    started = time.monotonic()
    assert producer.command("submit", request_id="lost-p", blocks=[[5, 6]], transfer_id="t-lost", mode=PUSH)["ok"]
    event = producer.wait_event("lost-p", 20)[0]
    assert event["event"] == "FINISHED_SENDING" and event["reason"], event
    assert time.monotonic() - started < 12.0
    assert any(e.get("event") == "push_failed" for e in p_side.log_events())
    assert p_side.process is not None and p_side.process.poll() is None


def test_write_into_an_unregistered_region_fails_a_live_d_promptly(sidecars, engines) -> None:
    """D has two workers; one unregisters (its region is gone) while a push is pending. The live
    worker gets load-failed at once, and P frees its blocks."""
    producer, consumer, _p_side, d_side = engine_pair(sidecars, engines, tp=2, heads=1)
    expect(consumer, producer, "half-d", [1, 2], transfer_id="t-half")
    from engine_shim.client import SidecarClient

    started = time.monotonic()
    with SidecarClient(d_side.socket) as client:
        client.unregister_worker("D", tp_rank=1)
    event = consumer.wait_event("half-d", 10, ranks=1)[0]
    assert event["event"] == "LOAD_FAILED" and event["rank"] == 0
    assert sorted(event["failed_block_ids"]) == [1, 2]
    assert time.monotonic() - started < 5.0
    assert producer.command("submit", request_id="half-p", blocks=[[5, 6]], transfer_id="t-half", mode=PUSH)["ok"]
    # The registration was withdrawn, so P's blocks wait for their lease or a release; release them.
    assert producer.command("release", request_id="half-p")["ok"]
    assert {e["event"] for e in producer.wait_event("half-p", 10)} == {"FINISHED_SENDING"}


def test_p_notices_a_restarted_d_engine_and_handshakes_again(sidecars, engines) -> None:
    producer, consumer, _, d_side = engine_pair(sidecars, engines)
    assert producer.command("fill", blocks=[1, 2], seed=9)["ok"]
    expect(consumer, producer, "first-d", [3], transfer_id="t-first")
    assert producer.command("submit", request_id="first-p", blocks=[[1]], transfer_id="t-first", mode=PUSH)["ok"]
    assert consumer.wait_event("first-d", 10)[0]["event"] == "FINISHED_RECEIVING"
    # D's engine restarts under the same sidecar: new memory, new agent.
    consumer.kill()
    consumer2 = engines(d_side, "D", "consumer", layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN)
    expect(consumer2, producer, "second-d", [4], transfer_id="t-second")
    assert producer.command("submit", request_id="second-p", blocks=[[2]], transfer_id="t-second", mode=PUSH)["ok"]
    assert consumer2.wait_event("second-d", 10)[0]["event"] == "FINISHED_RECEIVING"
    source, target = (
        kv(producer.buffers[0], LAYERS, BLOCKS, BLOCK_LEN),
        kv(consumer2.buffers[0], LAYERS, BLOCKS, BLOCK_LEN),
    )
    assert np.array_equal(source[:, 2], target[:, 4])


def test_expect_push_to_a_p_sidecar_that_is_down_fails_within_a_bound(sidecars, engines) -> None:
    producer, consumer, p_side, _ = engine_pair(sidecars, engines)
    p_side.kill()
    started = time.monotonic()
    reply = consumer.command(
        "expect_push",
        request_id="nowhere-d",
        blocks=[[1]],
        remote={"address": producer.peer_address, "engine_id": "P"},
        transfer_id="t-nowhere",
    )
    assert reply["ok"] and reply["registered"] is False
    event = consumer.wait_event("nowhere-d", 15)[0]
    assert event["event"] == "LOAD_FAILED" and "push registration failed" in event["reason"]
    assert time.monotonic() - started < 10.0


def test_registration_watchdog_fails_d_and_withdraws_the_registration(sidecars, engines) -> None:
    producer, consumer, p_side, _ = engine_pair(sidecars, engines)
    started = time.monotonic()
    expect(consumer, producer, "late-d", [1], transfer_id="t-late", timeout_seconds=1.0)
    event = consumer.wait_event("late-d", 10)[0]
    assert event["event"] == "LOAD_FAILED" and "watchdog" in event["reason"]
    assert 0.9 < time.monotonic() - started < 6.0
    from engine_shim.client import SidecarClient

    with SidecarClient(p_side.socket) as client:
        assert client.status().pending_push_registrations == 0
    # The late producer submission is not written into blocks D already gave back.
    assert producer.command(
        "submit", request_id="late-p", blocks=[[2]], transfer_id="t-late", mode=PUSH, lease_seconds=1.0
    )["ok"]
    assert producer.wait_event("late-p", 10)[0]["event"] == "LEASE_EXPIRED"
    assert not kv(consumer.buffers[0], LAYERS, BLOCKS, BLOCK_LEN).any()


def test_status_shows_pending_registrations_and_unmatched_submissions(sidecars, engines) -> None:
    producer, consumer, p_side, _ = engine_pair(sidecars, engines)
    expect(consumer, producer, "waiting-d", [1], transfer_id="t-waiting")
    assert producer.command("submit", request_id="lonely-p", blocks=[[3]], transfer_id="t-lonely", mode=PUSH)["ok"]
    from engine_shim.client import SidecarClient

    with SidecarClient(p_side.socket) as client:
        status = client.status(include_requests=True)
    assert status.pending_push_registrations == 1
    assert status.unmatched_submissions == 1
    assert status.leases == 1
    assert any(row.request_id == "lonely-p" and row.state == "leased" for row in status.requests)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_heterogeneous_tp_moves_each_ranks_heads(sidecars, engines, mode: str, p_tp: int, d_tp: int) -> None:
    """Head-major KV split across TP ranks: the side with more ranks holds a slice of the other's block."""
    total_heads, head_bytes, blocks = 2, 2048, 32
    p_side, d_side = sidecars("p"), sidecars("d")
    producer = engines(
        p_side,
        "P",
        "producer",
        tp=p_tp,
        heads=total_heads // p_tp,
        layers=2,
        blocks=blocks,
        block_len=head_bytes * total_heads // p_tp,
    )
    consumer = engines(
        d_side,
        "D",
        "consumer",
        tp=d_tp,
        heads=total_heads // d_tp,
        layers=2,
        blocks=blocks,
        block_len=head_bytes * total_heads // d_tp,
    )
    assert producer.command("fill", blocks=list(range(blocks)), seed=13)["ok"]
    p_blocks, d_blocks = [3, 4, 9], [20, 21, 25]
    if mode == "pull":
        assert producer.command("submit", request_id="h-p", blocks=[p_blocks])["ok"]
        assert start_pull(consumer, producer, "h-d", d_blocks, "h-p", p_blocks)["ok"]
    else:
        expect(consumer, producer, "h-d", d_blocks, transfer_id="t-h")
        assert producer.command("submit", request_id="h-p", blocks=[p_blocks], transfer_id="t-h", mode=PUSH)["ok"]
    assert {e["event"] for e in consumer.wait_event("h-d", 15)} == {"FINISHED_RECEIVING"}
    assert {e["event"] for e in producer.wait_event("h-p", 15)} == {"FINISHED_SENDING"}

    # Reassemble every block head by head on both sides and compare.
    def heads(engine: EngineProcess, tp: int, block_ids: list[int]) -> np.ndarray:
        per_rank = [kv(path, 2, blocks, head_bytes * total_heads // tp)[:, block_ids] for path in engine.buffers]
        return np.concatenate(per_rank, axis=2)  # [layer, block, all heads' bytes]

    assert np.array_equal(heads(producer, p_tp, p_blocks), heads(consumer, d_tp, d_blocks))


def test_a_producer_release_fails_the_waiting_consumer_at_once(sidecars, engines) -> None:
    """Both legs dispatched at once, and the prefill fails: D learns it now, not at its watchdog."""
    producer, consumer, _, _ = engine_pair(sidecars, engines)
    expect(consumer, producer, "cmpl-x-0-aaaaaaaa", [1, 2])
    started = time.monotonic()
    assert producer.command("release", request_id="cmpl-x-0-bbbbbbbb", reason="prefill failed")["ok"]
    event = consumer.wait_event("cmpl-x-0-aaaaaaaa", 10)[0]
    assert event["event"] == "LOAD_FAILED" and "released" in event["reason"]
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("known", ["transfer_id", "producer_request_id"])
def test_a_push_released_before_its_blocks_came_frees_them_at_submission(sidecars, engines, known: str) -> None:
    """D's request is aborted while it waits for P's prefill (a client that went away, both legs
    dispatched at once): when P's blocks come, P's engine gets them back at once, not at its
    lease's end (30 s here), and nothing is written into D's blocks, which D has handed back."""
    producer, consumer, _, _ = engine_pair(sidecars, engines)
    assert producer.command("fill", blocks=[5, 6], seed=4)["ok"]
    if known == "transfer_id":
        expect(consumer, producer, "gone-d", [1, 2], transfer_id="t-gone")
        submit = {"transfer_id": "t-gone"}
    else:  # no transfer id: D names P's request (the router forwarded P's answer)
        expect(consumer, producer, "gone-d", [1, 2], remote={"request_id": "gone-p"})
        submit = {}
    assert consumer.command("release", request_id="gone-d", reason="client went away")["ok"]
    event = consumer.wait_event("gone-d", 10)[0]
    assert event["event"] == "LOAD_FAILED" and "client went away" in event["reason"], event
    assert producer.command("submit", request_id="gone-p", blocks=[[5, 6]], mode=PUSH, **submit)["ok"]
    event = producer.wait_event("gone-p", 5)[0]
    assert event["event"] == "FINISHED_SENDING", event
    assert "client went away" in event["reason"] and "before its SubmitBlocks came" in event["reason"], event
    assert not kv(consumer.buffers[0], LAYERS, BLOCKS, BLOCK_LEN).any()


def test_a_decode_leg_retried_after_a_release_still_gets_the_push(sidecars, engines) -> None:
    """The router retries the decode leg with the same transfer id after the first one was
    aborted: the released registration must not free the blocks the retry waits for."""
    producer, consumer, _, _ = engine_pair(sidecars, engines)
    assert producer.command("fill", blocks=[5, 6], seed=9)["ok"]
    expect(consumer, producer, "first-d", [1, 2], transfer_id="t-retry")
    assert consumer.command("release", request_id="first-d", reason="aborted")["ok"]
    assert consumer.wait_event("first-d", 10)[0]["event"] == "LOAD_FAILED"
    expect(consumer, producer, "retry-d", [3, 4], transfer_id="t-retry")
    assert producer.command("submit", request_id="retry-p", blocks=[[5, 6]], transfer_id="t-retry", mode=PUSH)["ok"]
    assert consumer.wait_event("retry-d", 10)[0]["event"] == "FINISHED_RECEIVING", consumer.events_for("retry-d")
    assert producer.wait_event("retry-p", 10)[0]["event"] == "FINISHED_SENDING"
    source = kv(producer.buffers[0], LAYERS, BLOCKS, BLOCK_LEN)
    target = kv(consumer.buffers[0], LAYERS, BLOCKS, BLOCK_LEN)
    assert np.array_equal(source[:, [5, 6]], target[:, [3, 4]])
    assert not target[:, [1, 2]].any()


def test_a_full_prefix_hit_on_d_in_push_mode_frees_both_sides_without_writing(sidecars, engines) -> None:
    producer, consumer, _, _ = engine_pair(sidecars, engines, p_args=["--lease-seconds", "60"])
    assert producer.command("fill", blocks=[1, 2], seed=2)["ok"]
    reply = expect(consumer, producer, "hit-d", [], transfer_id="t-hit")
    assert reply["registered"]
    assert consumer.wait_event("hit-d", 5)[0]["event"] == "FINISHED_RECEIVING"
    assert producer.command("submit", request_id="hit-p", blocks=[[1, 2]], transfer_id="t-hit", mode=PUSH)["ok"]
    event = producer.wait_event("hit-p", 5)[0]
    assert event["event"] == "FINISHED_SENDING"
    assert not kv(consumer.buffers[0], LAYERS, BLOCKS, BLOCK_LEN).any()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_draining_producer_sidecar_serves_blocks_it_holds_then_exits(sidecars, engines, mode: str) -> None:
    """SIGTERM to P's sidecar while D has yet to take P's blocks (a prefill node's rolling
    restart): new work is refused, but the drain waits for D, D gets P's bytes instead of
    recomputing, and P's sidecar then exits 0 well within its grace."""
    producer, consumer, p_side, _ = engine_pair(sidecars, engines, p_args=["--set", "shutdown_grace_seconds=20"])
    assert producer.command("fill", blocks=[3, 4, 5], seed=9)["ok"]
    submit = {"mode": PUSH, "transfer_id": "t-drain"} if mode == "push" else {}
    assert producer.command("submit", request_id="drain-p", blocks=[[3, 4, 5]], **submit)["ok"]
    assert p_side.process is not None
    p_side.process.send_signal(signal.SIGTERM)
    # A fresh id per try: a re-submit of a request already held is a lease extension, answered OK
    # even while draining, so one "late" accepted before the signal landed would never be refused.
    # One accepted is released, as an engine gives back a request it aborts: the drain rightly
    # waits for a consumer of every accepted submission, so a forgotten one would hold it for most
    # of the grace.
    tries = itertools.count()

    def refused_for_draining() -> bool:
        request_id = f"late-{next(tries)}"
        reply = producer.command("submit", request_id=request_id, blocks=[[6]])
        if reply["ok"]:
            assert producer.command("release", request_id=request_id)["ok"]
        return not reply["ok"] and "draining" in reply.get("error", "")

    wait_until(refused_for_draining, 10, 0.05, "draining")
    refused = producer.command("submit", request_id="late-refused", blocks=[[7]])
    assert not refused["ok"] and "draining" in refused["error"], refused
    if mode == "push":
        assert expect(consumer, producer, "drain-d", [10, 11, 12], transfer_id="t-drain")["registered"]
    else:
        assert start_pull(consumer, producer, "drain-d", [10, 11, 12], "drain-p", [3, 4, 5])["ok"]
    assert consumer.wait_event("drain-d", 10)[0]["event"] == "FINISHED_RECEIVING"
    sent = producer.wait_event("drain-p", 10)[0]
    assert sent["event"] == "FINISHED_SENDING" and "shutting down" not in sent.get("reason", ""), sent
    assert p_side.process.wait(10) == 0  # the drain ended when D took the blocks, not at the grace
    source, target = (
        kv(producer.buffers[0], LAYERS, BLOCKS, BLOCK_LEN),
        kv(consumer.buffers[0], LAYERS, BLOCKS, BLOCK_LEN),
    )
    assert np.array_equal(source[:, [3, 4, 5]], target[:, [10, 11, 12]])
