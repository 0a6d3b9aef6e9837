"""Pull vouchers (kvsidecar.voucher): a consumer's sidecar holding the producer engine's valid voucher
reads without first confirming the lease with the producer's sidecar; anything it cannot verify
(forged, other blocks, another key, expired) takes the confirming path with its checks; and the
producer never hands vouched blocks back before the voucher's time, even if its engine releases
them. Real sidecars, simulated engines, real NIXL and shared memory."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine_shim.vllm.params import voucher_of
from kvsidecar import voucher
from kvsidecar.voucher import PARAM_VOUCHED_UNTIL_MS, PARAM_VOUCHER
from tests.support.moves import kv, trace_over_socket
from tests.support.processes import EngineProcess, stopped, wait_until


def _vouched_submit(
    producer: EngineProcess, request_id: str, blocks: list[int], seconds: float = 10.0
) -> tuple[bytes, int]:
    """Submit as the vLLM shim does once it knows the key: the key comes with a first answer."""
    key = bytes.fromhex(producer.command("submit", request_id=f"{request_id}-key", blocks=[[63]])["voucher_key"])
    assert producer.command("release", request_id=f"{request_id}-key")["ok"]
    until_ms = int((time.time() + seconds) * 1000)
    reply = producer.command("submit", request_id=request_id, blocks=[blocks], vouched_until_ms=until_ms)
    assert reply["ok"] and bytes.fromhex(reply["voucher_key"]) == key, reply
    return key, until_ms


def _pull(consumer: EngineProcess, producer: EngineProcess, request_id: str, local: list[int], p_request: str,
          p_blocks: list[int], signed: bytes = b"", until_ms: int = 0) -> dict:  # fmt: skip
    remote = {"address": producer.peer_address, "engine_id": producer.engine_id, "request_id": p_request,
              "blocks": [p_blocks], "voucher": signed.hex(), "vouched_until_ms": until_ms}  # fmt: skip
    reply = consumer.command("pull", request_id=request_id, blocks=[local], remote=remote)
    assert reply["ok"], reply
    return consumer.wait_event(request_id, 15)[0]


def _consumer_kinds(side, request_id: str) -> list[str]:
    mine = trace_over_socket(side, request_id=request_id).sidecars[0]
    (timeline,) = [t for t in mine.requests if t.side == "consumer"]
    return [event.kind for event in timeline.events]


def _pair(sidecars, engines, consumer_args: tuple[str, ...] = (), env: dict[str, str] | None = None):
    p_side, d_side = sidecars("p", [], env), sidecars("d", list(consumer_args), env)
    producer = engines(p_side, "P", "producer")
    consumer = engines(d_side, "D", "consumer")
    assert producer.command("fill", blocks=list(range(64)), seed=5)["ok"]
    # A first pull handshakes (the consumer learns the producer's key with it).
    assert producer.command("submit", request_id="warm", blocks=[[1]])["ok"]
    assert _pull(consumer, producer, "warm-d", [40], "warm", [1])["event"] == "FINISHED_RECEIVING"
    return producer, consumer, p_side, d_side


@pytest.fixture
def pair(sidecars, engines):
    return _pair(sidecars, engines)


def test_a_vouched_pull_reads_without_asking_the_producer(pair) -> None:
    producer, consumer, p_side, d_side = pair
    key, until_ms = _vouched_submit(producer, "v1", [2, 3, 4])
    signed = voucher.sign(key, "P", "v1", [[2, 3, 4]], until_ms)
    assert _pull(consumer, producer, "v1-d", [10, 11, 12], "v1", [2, 3, 4], signed, until_ms)["event"] == (
        "FINISHED_RECEIVING"
    )
    assert producer.wait_event("v1", 10)[0]["event"] == "FINISHED_SENDING"  # the READ's notification
    p_kv, d_kv = kv(producer.buffers[0], 2, 64, 4096), kv(consumer.buffers[0], 2, 64, 4096)
    assert np.array_equal(p_kv[:, [2, 3, 4]], d_kv[:, [10, 11, 12]])
    kinds = _consumer_kinds(d_side, "v1-d")
    assert "vouched" in kinds and "confirmed" not in kinds, kinds
    # The producer's sidecar was not asked: no heartbeat reached it for this request.
    (p_part,) = [
        part
        for part in trace_over_socket(p_side, request_id="v1").sidecars
        if part.sidecar.sidecar_id == p_side.sidecar_id
    ]
    (p_timeline,) = [t for t in p_part.requests if t.side == "producer"]
    assert "heartbeat" not in [event.kind for event in p_timeline.events]


def test_what_does_not_verify_takes_the_confirming_path(pair) -> None:
    producer, consumer, _, d_side = pair
    key, until_ms = _vouched_submit(producer, "v2", [5, 6])
    # The pull names other blocks than the voucher (another request's KV): the voucher does not
    # verify, the producer's check refuses them, and nothing is read.
    signed = voucher.sign(key, "P", "v2", [[5, 6]], until_ms)
    event = _pull(consumer, producer, "v2-foreign", [30, 31], "v2", [20, 21], signed, until_ms)
    assert event["event"] == "LOAD_FAILED" and "did not submit the blocks" in event["reason"], event
    assert not kv(consumer.buffers[0], 2, 64, 4096)[:, [30, 31]].any()
    # A voucher under another key, or one that ran out, or a longer validity than was signed:
    # confirmed with the producer, and then read.
    for name, signed, until in (
        ("forged", voucher.sign(b"k" * 32, "P", "v2", [[5, 6]], until_ms), until_ms),
        ("stretched", voucher.sign(key, "P", "v2", [[5, 6]], until_ms), until_ms + 60_000),
        ("expired", voucher.sign(key, "P", "v2", [[5, 6]], int(time.time() * 1000)), int(time.time() * 1000)),
    ):
        assert producer.command("submit", request_id=f"v2-{name}", blocks=[[5, 6]])["ok"]
        request = f"v2-{name}-d"
        signed = voucher.sign(key, "P", f"v2-{name}", [[5, 6]], until) if name == "expired" else signed
        assert _pull(consumer, producer, request, [32, 33], f"v2-{name}", [5, 6], signed, until)["event"] == (
            "FINISHED_RECEIVING"
        ), name
        kinds = _consumer_kinds(d_side, request)
        assert "confirmed" in kinds and "vouched" not in kinds, (name, kinds)
    # An engine cannot make its sidecar hold blocks for days.
    far = int((time.time() + 90_000) * 1000)
    reply = producer.command("submit", request_id="v2-far", blocks=[[9]], vouched_until_ms=far)
    assert not reply["ok"] and "vouched_until_ms" in reply["error"] and "INVALID_ARGUMENT" in reply["error"], reply


def test_the_producer_holds_vouched_blocks_through_a_release_until_the_voucher_ends(pair) -> None:
    producer, consumer, _, d_side = pair
    key, until_ms = _vouched_submit(producer, "v3", [7, 8], seconds=2.0)
    released = time.monotonic()
    assert producer.command("release", request_id="v3")["ok"]
    # Its engine released it, but a consumer may still read on the voucher: P keeps the blocks.
    signed = voucher.sign(key, "P", "v3", [[7, 8]], until_ms)
    assert _pull(consumer, producer, "v3-d", [34, 35], "v3", [7, 8], signed, until_ms)["event"] == "FINISHED_RECEIVING"
    assert "vouched" in _consumer_kinds(d_side, "v3-d")
    # Freed after the READ notified (or, without a reader, once the voucher and the skew passed).
    assert producer.wait_event("v3", 10)[0]["event"] == "FINISHED_SENDING"
    key, until_ms = _vouched_submit(producer, "v4", [9], seconds=1.0)
    released = time.monotonic()
    assert producer.command("release", request_id="v4")["ok"]
    assert producer.wait_event("v4", 10)[0]["event"] == "FINISHED_SENDING"
    # Not before the voucher's time (1 s) + the clock skew allowance (0.5 s), less the submit's age.
    assert time.monotonic() - released > 1.2


def test_kv_transfer_params_carry_the_voucher_and_bad_ones_are_ignored() -> None:
    signed = voucher.sign(b"k" * 32, "P", "r", [[1, 2]], 123)
    assert voucher_of({PARAM_VOUCHER: signed.hex(), PARAM_VOUCHED_UNTIL_MS: 123}) == (signed, 123)
    assert voucher_of({PARAM_VOUCHER: "not hex", PARAM_VOUCHED_UNTIL_MS: 123}) == (b"", 0)
    assert voucher_of({}) == (b"", 0)
    assert voucher.verify(b"k" * 32, signed, "P", "r", [[1, 2]], 123)
    for changed in (("Q", "r", [[1, 2]], 123), ("P", "s", [[1, 2]], 123), ("P", "r", [[1, 3]], 123),
                    ("P", "r", [[1], [2]], 123), ("P", "r", [[1, 2]], 124)):  # fmt: skip
        assert not voucher.verify(b"k" * 32, signed, *changed), changed
    assert not voucher.verify(b"short", signed, "P", "r", [[1, 2]], 123)


def test_a_vouched_pull_from_a_hung_producer_sidecar_ends_by_the_voucher(sidecars, engines) -> None:
    """A stopped producer sidecar answers nothing: the pull ends by the voucher's bound (its time
    less the skew allowance), never later. It fails at that deadline with nothing reported read,
    or, since a READ is one-sided and the voucher holds the blocks, completes with P's exact bytes
    (UCX's tcp transport needs the producer's progress for a READ, yet CI saw one complete once);
    the producer, resumed, frees its blocks."""
    producer, consumer, p_side, _ = _pair(sidecars, engines, env={"UCX_TLS": "tcp"})
    key, until_ms = _vouched_submit(producer, "v5", [12, 13], seconds=3.0)
    signed = voucher.sign(key, "P", "v5", [[12, 13]], until_ms)
    with stopped(p_side):
        started = time.monotonic()
        event = _pull(consumer, producer, "v5-d", [36, 37], "v5", [12, 13], signed, until_ms)
        assert time.monotonic() - started < 3.0 + 1.0  # the voucher's 3 s (less the skew), and slack
    if event["event"] == "LOAD_FAILED":
        assert "deadline" in event["reason"] and sorted(event["failed_block_ids"]) == [36, 37], event
    else:
        assert event["event"] == "FINISHED_RECEIVING", event
        p_kv, d_kv = kv(producer.buffers[0], 2, 64, 4096), kv(consumer.buffers[0], 2, 64, 4096)
        assert np.array_equal(p_kv[:, [12, 13]], d_kv[:, [36, 37]])
    assert producer.wait_event("v5", 10)[0]["event"] in ("FINISHED_SENDING", "LEASE_EXPIRED")


def test_a_vouched_pull_from_a_dead_producer_sidecar_fails_and_reads_nothing(pair) -> None:
    producer, consumer, p_side, _ = pair
    key, until_ms = _vouched_submit(producer, "v6", [14, 15])
    signed = voucher.sign(key, "P", "v6", [[14, 15]], until_ms)
    p_side.kill()
    event = _pull(consumer, producer, "v6-d", [38, 39], "v6", [14, 15], signed, until_ms)
    assert event["event"] == "LOAD_FAILED", event
    assert not kv(consumer.buffers[0], 2, 64, 4096)[:, [38, 39]].any()


def test_the_benchmark_pair_pulls_vouched_as_the_vllm_shim_does() -> None:
    """``kvsidecar bench``'s control path measures the default pull: once a SubmitBlocks answer gave
    the producer's key, every pull reads on its voucher (no confirming heartbeat), bytes intact;
    ``vouch=False`` still measures the confirming path."""
    from engine_shim.memory import KvLayout
    from sidecar.tools.workload import TransferPair

    def kinds_of(pair: TransferPair, request_id: str) -> list[str]:
        (timeline,) = [t for t in pair.trace(request_id) if t.side == "consumer"]
        return [event.kind for event in timeline.events]

    for vouch in (True, False):
        with TransferPair(KvLayout(1, 16, 4096), vouch=vouch) as pair:
            pair.fill_producer(seed=7)
            for index in range(2):
                pair.poison([4, 5])
                pair.pull([1, 2], [4, 5])
                assert pair.verify([1, 2], [4, 5])
                kinds = kinds_of(pair, f"pull-{index}")
                # The first pull has no key yet (the vLLM shim's first request goes unvouched too).
                vouched = vouch and index > 0
                assert ("vouched" in kinds) is vouched and ("confirmed" in kinds) is not vouched, (vouch, kinds)


def _check_read_before_submission(pair, request_id: str, blocks: list[int], local: list[int]) -> None:
    """A vouched pull of ``request_id`` that reaches the producer's sidecar before the engine's
    SubmitBlocks does, as with vLLM: its shim signs the voucher and hands the parameters to the
    router while SubmitBlocks is still on the way (the call is asynchronous). Another request
    stays held meanwhile, so the producer's transport is polling when the READ's notification
    comes. The SubmitBlocks is sent 0.3 s after the pull. The bytes arrive, and the producer's
    engine gets its blocks back at once (FINISHED_SENDING), not at the lease's end (30 s)."""
    producer, consumer, _, _ = pair
    key, _ = _vouched_submit(producer, f"{request_id}-busy", [60])
    until_ms = int((time.time() + 10) * 1000)
    signed = voucher.sign(key, "P", request_id, [blocks], until_ms)
    submitter = threading.Timer(
        0.3,
        lambda: producer.command("submit", request_id=request_id, blocks=[blocks], vouched_until_ms=until_ms),
    )
    submitter.start()
    try:
        event = _pull(consumer, producer, f"{request_id}-d", local, request_id, blocks, signed, until_ms)
    finally:
        submitter.join()
    assert event["event"] == "FINISHED_RECEIVING", event
    p_kv, d_kv = kv(producer.buffers[0], 2, 64, 4096), kv(consumer.buffers[0], 2, 64, 4096)
    assert np.array_equal(p_kv[:, blocks], d_kv[:, local])
    assert producer.wait_event(request_id, 5)[0]["event"] == "FINISHED_SENDING"


def test_a_read_that_came_before_its_submission_frees_the_blocks_at_once(pair) -> None:
    """The READ's notification came before the request: it is kept and counted at SubmitBlocks."""
    _check_read_before_submission(pair, "v7", [16, 17], [41, 42])


def test_digests_of_a_request_not_yet_submitted_wait_for_its_submission(sidecars, engines) -> None:
    """integrity=digest asks the producer for digests before the READ: a producer sidecar that
    has not seen the SubmitBlocks yet is asked again (within producer_unknown_grace_seconds), not
    taken for one that lost the request."""
    _check_read_before_submission(_pair(sidecars, engines, ("--integrity", "digest")), "v8", [18, 19], [43, 44])


def test_a_release_that_came_before_its_submission_frees_the_blocks_at_once(pair, engines) -> None:
    """A vouched pull that fails before it READs (here: D's engine has another layer count)
    tells the producer's sidecar to free the blocks. When that release arrives before the engine's
    SubmitBlocks (vLLM's is asynchronous), it is kept and applied when the request comes: P's
    engine gets its blocks back at once, not at the voucher's (10 s) or the lease's end (30 s)."""
    producer, _, p_side, d_side = pair
    other = engines(d_side, "D-other", "consumer", layers=3)
    key, _ = _vouched_submit(producer, "v9-busy", [61])
    until_ms = int((time.time() + 10) * 1000)
    signed = voucher.sign(key, "P", "v9", [[20, 21]], until_ms)
    event = _pull(other, producer, "v9-d", [45, 46], "v9", [20, 21], signed, until_ms)
    assert event["event"] == "LOAD_FAILED" and "layers" in event["reason"], event
    # The consumer's release reaches P's sidecar (sent as the load fails) before the SubmitBlocks.
    wait_until(
        lambda: any(e.get("event") == "consumer_released" and e.get("request_id") == "v9" for e in p_side.log_events()),
        10,
        what="the consumer's release at P's sidecar",
    )
    reply = producer.command("submit", request_id="v9", blocks=[[20, 21]], vouched_until_ms=until_ms)
    assert reply["ok"], reply
    freed = producer.wait_event("v9", 5)[0]  # not at the voucher's end (10 s)
    assert freed["event"] == "FINISHED_SENDING" and "before its SubmitBlocks" in freed["reason"], freed
    # Nothing was read: the consumer's blocks are untouched.
    assert not kv(other.buffers[0], 3, 64, 4096)[:, [45, 46]].any()
