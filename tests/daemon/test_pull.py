"""Pull mode with real processes: two sidecars (or one), two simulated engines owning KV in shared
memory, real NIXL. D's blocks must equal P's byte for byte; nothing else may change; failures
end in load-failed within a bound; leases free P's blocks."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support.moves import BLOCK_LEN, BLOCKS, LAYERS, kv, pull_and_wait, start_pull
from tests.support.processes import EngineProcess, SidecarProcess, wait_until


@pytest.fixture(params=["two_sidecars", "same_sidecar"])
def pair(request, sidecars, engines) -> tuple[EngineProcess, EngineProcess, list[SidecarProcess]]:
    p_side = sidecars("p")
    d_side = p_side if request.param == "same_sidecar" else sidecars("d")
    producer = engines(p_side, "P", "producer", layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN)
    consumer = engines(d_side, "D", "consumer", layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN)
    return producer, consumer, [p_side, d_side]


def test_pull_many_requests_byte_for_byte(pair) -> None:
    producer, consumer, _ = pair
    assert producer.command("fill", blocks=list(range(BLOCKS)), seed=11)["ok"]
    rng = random.Random(3)
    free = list(range(BLOCKS))
    rng.shuffle(free)
    cases: list[tuple[str, list[int], list[int]]] = []
    # Contiguous runs, scattered blocks, single blocks, and a partial prefix hit on D.
    cases.append(("contiguous", list(range(10, 26)), [free.pop() for _ in range(16)]))
    run_start = 40
    cases.append(("adjacent-both", list(range(run_start, run_start + 8)), []))
    d_run = sorted(free)[:8]
    if d_run == list(range(d_run[0], d_run[0] + 8)):
        cases[-1] = ("adjacent-both", cases[-1][1], d_run)
        for block in d_run:
            free.remove(block)
    else:
        cases[-1] = ("adjacent-both", cases[-1][1], [free.pop() for _ in range(8)])
    for index in range(12):
        count = rng.randint(1, 6)
        cases.append((f"scattered-{index}", rng.sample(range(BLOCKS), count), [free.pop() for _ in range(count)]))
    cases.append(("partial-prefix-hit", [60, 61, 62, 63, 64], [free.pop() for _ in range(2)]))
    written: set[int] = set()
    for name, p_blocks, d_blocks in cases:
        events = pull_and_wait(producer, consumer, name, p_blocks, d_blocks)
        assert {event["event"] for event in events} == {"FINISHED_RECEIVING"}, events
        written.update(d_blocks)
    for name, *_ in cases:
        assert {e["event"] for e in producer.wait_event(name)} == {"FINISHED_SENDING"}
    source, target = kv(producer.buffers[0]), kv(consumer.buffers[0])
    for name, p_blocks, d_blocks in cases:
        tail = p_blocks[len(p_blocks) - len(d_blocks) :]
        for src, dst in zip(tail, d_blocks, strict=True):
            assert np.array_equal(source[:, src], target[:, dst]), f"{name}: D block {dst} != P block {src}"
    untouched = sorted(set(range(BLOCKS)) - written)
    assert untouched and not target[:, untouched].any(), "blocks nobody wrote changed"


def test_full_prefix_hit_reads_nothing_and_still_frees_p(pair) -> None:
    producer, consumer, _ = pair
    assert producer.command("submit", request_id="full-hit", blocks=[[1, 2, 3]], lease_seconds=60)["ok"]
    reply = start_pull(consumer, producer, "full-hit-d", [], "full-hit", [1, 2, 3])
    assert reply["ok"], reply
    assert consumer.wait_event("full-hit-d", 10)[0]["event"] == "FINISHED_RECEIVING"
    assert producer.wait_event("full-hit", 10)[0]["event"] == "FINISHED_SENDING"
    assert not kv(consumer.buffers[0]).any()


def test_compatibility_hash_mismatch_fails_the_pull_with_the_reason(sidecars, engines) -> None:
    p_side, d_side = sidecars("p"), sidecars("d")
    producer = engines(p_side, "P", "producer", layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN, model="model-a")
    consumer = engines(d_side, "D", "consumer", layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN, model="model-b")
    events = pull_and_wait(producer, consumer, "mismatch", [1, 2], [5, 6], timeout=15)
    assert events[0]["event"] == "LOAD_FAILED"
    assert "compatibility hash mismatch" in events[0]["reason"]
    assert sorted(events[0]["failed_block_ids"]) == [5, 6]
    assert not kv(consumer.buffers[0]).any()
    logged = [e for e in p_side.log_events() if e.get("event") == "compatibility_hash_mismatch"]
    assert logged and logged[0]["local"] != logged[0]["remote"]
    # The producer is told at once, not after its lease.
    assert producer.wait_event("mismatch", 10)[0]["event"] == "FINISHED_SENDING"


def test_lease_frees_p_when_d_never_comes(sidecars, engines) -> None:
    p_side = sidecars("p", args=["--lease-seconds", "1.5"])
    producer = engines(p_side, "P", "producer")
    d_side = sidecars("d")
    consumer = engines(d_side, "D", "consumer")
    started = time.monotonic()
    assert producer.command("submit", request_id="orphan", blocks=[[1, 2]])["ok"]
    consumer.kill()  # D dies without ever pulling
    event = producer.wait_event("orphan", 10)[0]
    elapsed = time.monotonic() - started
    assert event["event"] == "LEASE_EXPIRED" and "lease" in event["reason"]
    assert 1.0 < elapsed < 6.0


def test_heartbeats_keep_p_lease_alive_past_its_length(sidecars, engines) -> None:
    # Lease 1.5 s; D's sidecar heartbeats every 0.25 s while its request waits (KeepAlive).
    p_side = sidecars("p", args=["--lease-seconds", "1.5"])
    d_side = sidecars("d", args=["--set", "heartbeat_interval_seconds=0.25"])
    producer = engines(p_side, "P", "producer")
    consumer = engines(d_side, "D", "consumer")
    assert producer.command("fill", blocks=[1, 2], seed=5)["ok"]
    assert producer.command("submit", request_id="waiting", blocks=[[1, 2]])["ok"]
    from engine_shim.client import SidecarClient, remote

    with SidecarClient(d_side.socket) as client:
        kept = client.keep_alive("D", "waiting-d", remote(producer.peer_address, "P", "waiting"))
        assert kept.producer_holds
        time.sleep(4.0)  # well past the 1.5 s lease
    assert producer.events_for("waiting") == [], "the lease expired although D kept heartbeating"
    events = pull_and_wait(producer, consumer, "waiting", [1, 2], [7, 8])
    assert events[0]["event"] == "FINISHED_RECEIVING"
    assert np.array_equal(
        kv(producer.buffers[0], 2, 64, 4096)[:, [1, 2]], kv(consumer.buffers[0], 2, 64, 4096)[:, [7, 8]]
    )


def test_keep_alive_learns_when_p_lost_the_request_and_the_pull_fails_without_reading(sidecars, engines) -> None:
    p_side = sidecars("p", args=["--lease-seconds", "1"])
    d_side = sidecars("d", args=["--set", "heartbeat_interval_seconds=0.2"])
    producer = engines(p_side, "P", "producer")
    consumer = engines(d_side, "D", "consumer")
    assert producer.command("submit", request_id="gone", blocks=[[3]])["ok"]
    assert producer.command("release", request_id="gone")["ok"]  # P frees it (e.g. an abort)
    from engine_shim.client import SidecarClient, remote

    with SidecarClient(d_side.socket) as client:
        client.keep_alive("D", "gone-d", remote(producer.peer_address, "P", "gone"))

        def lost() -> bool:
            return not client.keep_alive("D", "gone-d", remote(producer.peer_address, "P", "gone")).producer_holds

        wait_until(lost, 5, 0.1, "D learns that P dropped the request")
    reply = start_pull(consumer, producer, "gone-d", [9], "gone", [3])
    assert reply["ok"]
    event = consumer.wait_event("gone-d", 5)[0]
    assert event["event"] == "LOAD_FAILED" and "no longer holds" in event["reason"]


def test_p_sidecar_killed_then_restarted(sidecars, engines) -> None:
    """D fails fast against a dead P sidecar, keeps serving, and pulls from the restarted P after a
    fresh handshake."""
    p_side, d_side = sidecars("p"), sidecars("d")
    producer = engines(p_side, "P", "producer", layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN)
    consumer = engines(d_side, "D", "consumer", layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN)
    assert producer.command("fill", blocks=list(range(BLOCKS)), seed=1)["ok"]
    assert pull_and_wait(producer, consumer, "warm", [1, 2, 3], [1, 2, 3])[0]["event"] == "FINISHED_RECEIVING"
    old_id = p_side.sidecar_id

    assert producer.command("submit", request_id="doomed", blocks=[list(range(10, 40))])["ok"]
    p_side.kill()
    started = time.monotonic()
    reply = start_pull(consumer, producer, "doomed-d", list(range(50, 80)), "doomed", list(range(10, 40)))
    assert reply["ok"]
    event = consumer.wait_event("doomed-d", 15)[0]
    elapsed = time.monotonic() - started
    assert event["event"] == "LOAD_FAILED", event
    assert elapsed < 10.0, f"load-failed took {elapsed:.1f}s"
    assert sorted(event["failed_block_ids"]) == list(range(50, 80))

    # D's sidecar still serves, and a restarted P (same port, new instance) works after a handshake.
    producer.kill()
    p_side.restart()
    assert p_side.sidecar_id != old_id
    producer2 = engines(p_side, "P", "producer", layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN)
    assert producer2.command("fill", blocks=list(range(BLOCKS)), seed=2)["ok"]
    events = pull_and_wait(producer2, consumer, "after-restart", [20, 21, 22], [90, 91, 92])
    assert events[0]["event"] == "FINISHED_RECEIVING", events
    source, target = kv(producer2.buffers[0]), kv(consumer.buffers[0])
    assert np.array_equal(source[:, [20, 21, 22]], target[:, [90, 91, 92]])
    restarted = [e for e in d_side.log_events() if e.get("event") in ("peer_restarted", "peer_forgotten")]
    assert restarted, "D never noticed that P restarted"


def _p_sidecar_killed_while_pulled(
    sidecars, engines, failures_allowed: int
) -> tuple[SidecarProcess, EngineProcess, dict[str, int]]:
    """P's sidecar (and engine) die; D heartbeats the dead sidecar (every 0.1 s) until it fails a
    pull "stopped answering". Returns P's stopped sidecar, D's engine and the engines' shape.

    The later pull names P's engine before it registered (out of order): the waits for it are long
    enough for a slow start on a busy machine."""
    slow_calls = ["--set", "peer_call_timeout_seconds=10"]
    p_args = [*slow_calls, "--set", "engine_arrival_wait_seconds=8"]
    d_args = [*slow_calls, "--set", "heartbeat_interval_seconds=0.1", "--set", "producer_unknown_grace_seconds=20",
              "--set", f"heartbeat_failures_allowed={failures_allowed}"]  # fmt: skip
    p_side, d_side = sidecars("p", args=p_args), sidecars("d", args=d_args)
    shape = {"layers": LAYERS, "blocks": BLOCKS, "block_len": BLOCK_LEN}
    producer = engines(p_side, "P", "producer", **shape)
    consumer = engines(d_side, "D", "consumer", **shape)
    assert pull_and_wait(producer, consumer, "warm", [1], [1])[0]["event"] == "FINISHED_RECEIVING"
    producer.kill()
    p_side.kill()
    assert start_pull(consumer, producer, "doomed-d", [2], "doomed", [2])["ok"]
    event = consumer.wait_event("doomed-d", 60)[0]
    assert event["event"] == "LOAD_FAILED" and "stopped answering" in event["reason"], event
    return p_side, consumer, shape


def _pull_from_restarted_p(engines, p_side: SidecarProcess, consumer: EngineProcess, shape: dict[str, int]) -> None:
    """D asks P's (restarted) sidecar for a request of P's engine, which then starts and submits
    it: D's pull must arrive intact."""
    remote = {"address": p_side.address, "engine_id": "P", "request_id": "after", "blocks": [[3, 4]]}
    assert consumer.command("pull", request_id="after-d", blocks=[[5, 6]], remote=remote)["ok"]
    if p_side.process is None or p_side.process.poll() is not None:
        p_side.start()
    producer = engines(p_side, "P", "producer", **shape)
    assert producer.command("fill", blocks=[3, 4], seed=7)["ok"]
    assert producer.command("submit", request_id="after", blocks=[[3, 4]])["ok"]
    event = consumer.wait_event("after-d", 30)[0]
    assert event["event"] == "FINISHED_RECEIVING", event
    assert np.array_equal(kv(producer.buffers[0])[:, [3, 4]], kv(consumer.buffers[0])[:, [5, 6]])


def test_the_first_pull_after_a_producer_sidecar_restart_succeeds(sidecars, engines) -> None:
    """Issue 12, chaos bug 2. After D gave up on a dead P sidecar, D's channel to P waits (backs
    off, up to 2 s) between connection attempts. P's sidecar restarts on the same port and D's next
    pull comes at once: it must reach the restarted P, not fail "stopped answering" on heartbeats
    (one every 0.1 s here) that the backing-off channel failed without trying to connect."""
    p_side, consumer, shape = _p_sidecar_killed_while_pulled(sidecars, engines, failures_allowed=2)
    p_side.start()
    _pull_from_restarted_p(engines, p_side, consumer, shape)


def test_a_pull_counts_only_the_heartbeats_it_missed_itself(sidecars, engines) -> None:
    """The failures D counted against a dead P before a pull came do not count against the pull:
    a pull that comes while P's sidecar is still down (restarting) fails only after missing
    heartbeat_failures_allowed heartbeats of its own (50 x 0.1 s here), and P is back before that."""
    p_side, consumer, shape = _p_sidecar_killed_while_pulled(sidecars, engines, failures_allowed=50)
    _pull_from_restarted_p(engines, p_side, consumer, shape)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_producer_that_freed_its_blocks_does_not_fail_a_transfer_being_checked(sidecars, engines, mode) -> None:
    """With integrity=digest, D checks the bytes after they all arrived, and P frees its blocks
    as soon as the transfer is over (the READ's notification, or its WRITEs completed). A heartbeat
    that finds P no longer holding the request while D's digests run must not fail it: chaos "done"
    cells caught LOAD_FAILED "no longer holds" for transfers whose bytes were correct."""
    checked = ["--set", "integrity=digest"]
    p_side = sidecars("p", args=checked)
    # A heartbeat every 20 ms: several land while D digests 50 MiB.
    d_side = sidecars("d", args=[*checked, "--set", "heartbeat_interval_seconds=0.02"])
    shape = {"layers": 2, "blocks": 1024, "block_len": 65536}
    producer = engines(p_side, "P", "producer", **shape)
    consumer = engines(d_side, "D", "consumer", **shape)
    source, dest = list(range(0, 800, 2)), list(range(1, 801, 2))  # 400 blocks, not adjacent
    assert producer.command("fill", blocks=source, seed=9)["ok"]
    for attempt in range(3):
        request = f"checked-{attempt}"
        if mode == "pull":
            assert producer.command("submit", request_id=request, blocks=[source])["ok"]
            assert start_pull(consumer, producer, f"{request}-d", dest, request, source)["ok"]
        else:
            remote = {"address": producer.peer_address, "engine_id": "P"}
            assert consumer.command("expect_push", request_id=f"{request}-d", blocks=[dest], remote=remote,
                                    transfer_id=f"t-{request}")["ok"]  # fmt: skip
            assert producer.command("submit", request_id=request, blocks=[source], transfer_id=f"t-{request}",
                                    mode=2)["ok"]  # fmt: skip
        event = consumer.wait_event(f"{request}-d", 30)[0]
        assert event["event"] == "FINISHED_RECEIVING", {k: v for k, v in event.items() if k != "failed_block_ids"}
        sent, received = kv(producer.buffers[0], 2, 1024, 65536), kv(consumer.buffers[0], 2, 1024, 65536)
        assert np.array_equal(sent[:, source], received[:, dest])


def test_p_sidecar_killed_during_a_large_pull_ends_in_a_terminal_event(sidecars, engines) -> None:
    p_side, d_side = sidecars("p"), sidecars("d")
    big = {"layers": 4, "blocks": 64, "block_len": 1 << 20}  # 256 MiB per engine
    producer = engines(p_side, "P", "producer", **big)
    consumer = engines(d_side, "D", "consumer", **big)
    assert pull_and_wait(producer, consumer, "warm", [0], [0])[0]["event"] == "FINISHED_RECEIVING"
    blocks = list(range(1, 64))
    assert producer.command("submit", request_id="big", blocks=[blocks])["ok"]
    reply = start_pull(consumer, producer, "big-d", blocks, "big", blocks)
    assert reply["ok"]
    p_side.kill()
    started = time.monotonic()
    event = consumer.wait_event("big-d", 20)[0]
    # Either the READ finished before the kill, or it failed: never a hang.
    assert event["event"] in ("FINISHED_RECEIVING", "LOAD_FAILED")
    assert time.monotonic() - started < 15.0
    assert d_side.process is not None and d_side.process.poll() is None


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    import os

    return ticks / os.sysconf("SC_CLK_TCK")


def test_idle_sidecar_with_registered_engines_uses_almost_no_cpu(sidecars, engines) -> None:
    side = sidecars("idle")
    producer = engines(side, "P", "producer")
    consumer = engines(side, "D", "consumer")
    assert pull_and_wait(producer, consumer, "once", [1], [2])[0]["event"] == "FINISHED_RECEIVING"
    producer.wait_event("once", 10)
    time.sleep(6.0)  # past the post-handshake polling window
    assert side.process is not None
    before, started = cpu_seconds(side.process.pid), time.monotonic()
    time.sleep(5.0)
    used = (cpu_seconds(side.process.pid) - before) / (time.monotonic() - started)
    print(f"idle sidecar CPU: {used * 100:.2f}% of one core")
    assert used < 0.02, f"idle sidecar used {used * 100:.1f}% of a core"


def test_a_pull_after_the_producer_freed_its_blocks_reads_nothing(sidecars, engines) -> None:
    """Without a keep-alive, P's lease ran out and P may have reused the blocks: D must not read them."""
    p_side = sidecars("p", args=["--lease-seconds", "1"])
    d_side = sidecars("d")
    producer = engines(p_side, "P", "producer")
    consumer = engines(d_side, "D", "consumer")
    assert producer.command("fill", blocks=[1, 2], seed=3)["ok"]
    assert producer.command("submit", request_id="stale", blocks=[[1, 2]])["ok"]
    assert producer.wait_event("stale", 10)[0]["event"] == "LEASE_EXPIRED"
    events = pull_and_wait(producer, consumer, "stale-again", [1, 2], [5, 6])  # a fresh submit still works
    assert events[0]["event"] == "FINISHED_RECEIVING"
    reply = start_pull(consumer, producer, "stale-d", [7, 8], "stale", [1, 2])
    assert reply["ok"]
    event = consumer.wait_event("stale-d", 10)[0]
    assert event["event"] == "LOAD_FAILED" and "no longer holds" in event["reason"]
    assert not kv(consumer.buffers[0], 2, 64, 4096)[:, [7, 8]].any()


def test_keep_alive_follows_the_producers_shorter_lease(sidecars, engines) -> None:
    # P leases for 1.5 s; D's own heartbeat period is the default 5 s (its 30 s lease / 6).
    p_side = sidecars("p", args=["--lease-seconds", "1.5"])
    d_side = sidecars("d")
    producer = engines(p_side, "P", "producer")
    engines(d_side, "D", "consumer")
    assert producer.command("submit", request_id="short", blocks=[[1]])["ok"]
    from engine_shim.client import SidecarClient, remote

    with SidecarClient(d_side.socket) as client:
        assert client.keep_alive("D", "short-d", remote(producer.peer_address, "P", "short")).producer_holds
        time.sleep(4.0)
        assert client.keep_alive("D", "short-d", remote(producer.peer_address, "P", "short")).producer_holds
    assert producer.events_for("short") == [], "P's lease expired: D heartbeated at its own, slower pace"


def test_a_pull_that_overtakes_the_producers_submit_waits_for_it(sidecars, engines) -> None:
    """vLLM hands P's kv_transfer_params to the router before P's SubmitBlocks reaches P's sidecar
    (the call is asynchronous): D's Pull may arrive first and must wait for it, briefly."""
    p_side, d_side = sidecars("p"), sidecars("d")
    producer = engines(p_side, "P", "producer")
    consumer = engines(d_side, "D", "consumer")
    assert producer.command("fill", blocks=[4, 5], seed=8)["ok"]
    reply = start_pull(consumer, producer, "early-d", [10, 11], "early", [4, 5])
    assert reply["ok"]
    time.sleep(0.4)
    assert consumer.events_for("early-d") == [], "the pull must not give up while P's submit is on the way"
    assert producer.command("submit", request_id="early", blocks=[[4, 5]])["ok"]
    assert consumer.wait_event("early-d", 10)[0]["event"] == "FINISHED_RECEIVING"
    assert producer.wait_event("early", 10)[0]["event"] == "FINISHED_SENDING"
    assert np.array_equal(
        kv(producer.buffers[0], 2, 64, 4096)[:, [4, 5]], kv(consumer.buffers[0], 2, 64, 4096)[:, [10, 11]]
    )
