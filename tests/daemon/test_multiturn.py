"""Multi-turn reuse (decode -> prefill): D holds a finished turn's blocks, P finds them with a cache
query and pulls them instead of recomputing; the hold ends with P's read or with its TTL."""

from __future__ import annotations

import hashlib
import re
import time
import urllib.request

import numpy as np

from engine_shim.client import SidecarClient
from tests.support.moves import kv, start_pull
from tests.support.processes import EngineProcess, SidecarProcess, wait_until
from tests.support.vllm_engine import free_port


def test_p_pulls_the_blocks_d_holds_for_a_conversation(sidecars, engines) -> None:
    p_side, d_side = sidecars("p"), sidecars("d")
    prefill = engines(p_side, "P", "both")
    decode = engines(d_side, "D", "both")
    assert decode.command("fill", blocks=[10, 11, 12], seed=77)["ok"]
    held = decode.command("hold", request_id="turn1-d", blocks=[[10, 11, 12]], conversation_id="conv-1",
                          num_tokens=40, ttl_seconds=60)  # fmt: skip
    assert held["ok"] and held["ttl_seconds"] == 60

    found = prefill.command("query", address=decode.peer_address, conversation_id="conv-1")
    assert found["ok"], found
    [entry] = found["entries"]
    assert entry["engine_id"] == "D" and entry["request_id"] == "turn1-d" and entry["blocks"] == [[10, 11, 12]]
    assert entry["num_tokens"] == 40 and 0 < entry["expires_in_seconds"] <= 60
    assert entry["address"] == decode.peer_address
    assert prefill.command("query", address=decode.peer_address, conversation_id="other")["entries"] == []

    reply = prefill.command(
        "pull", request_id="turn2-p", blocks=[[3, 4, 5]],
        remote={"address": entry["address"], "engine_id": "D", "request_id": "turn1-d", "blocks": entry["blocks"]},
    )  # fmt: skip
    assert reply["ok"]
    assert prefill.wait_event("turn2-p", 10)[0]["event"] == "FINISHED_RECEIVING"
    assert decode.wait_event("turn1-d", 10)[0]["event"] == "FINISHED_SENDING"  # D's blocks are free again
    assert np.array_equal(
        kv(decode.buffers[0], 2, 64, 4096)[:, [10, 11, 12]], kv(prefill.buffers[0], 2, 64, 4096)[:, [3, 4, 5]]
    )
    assert prefill.command("query", address=decode.peer_address, conversation_id="conv-1")["entries"] == []


def test_held_blocks_are_released_when_their_ttl_ends(sidecars, engines) -> None:
    side = sidecars("d")
    decode = engines(side, "D", "both")
    started = time.monotonic()
    assert decode.command("hold", request_id="old", blocks=[[1]], conversation_id="c", ttl_seconds=1.0)["ok"]
    event = decode.wait_event("old", 10)[0]
    assert event["event"] == "LEASE_EXPIRED" and "hold TTL" in event["reason"]
    assert 0.9 < time.monotonic() - started < 5
    assert decode.command("query", conversation_id="c")["entries"] == []


# --- hold caps, prefix hashes, queries across peers (issue 16) ----------------------------------------


def _hashes(*names: str) -> list[str]:
    """Stand-ins for vLLM's block hashes (opaque digests, hex on the simulated engine's wire)."""
    return [hashlib.sha256(name.encode()).hexdigest() for name in names]


def _metrics(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _metric(body: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", body, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_holds_over_the_share_release_the_oldest_and_give_its_blocks_back(sidecars, engines) -> None:
    port = free_port()
    side = sidecars("d", args=["--hold-max-share", "0.25", "--metrics-listen", f"127.0.0.1:{port}"])
    decode = engines(side, "D", "both")  # 64 blocks: the cap is 16
    first = decode.command("hold", request_id="t1", blocks=[list(range(0, 8))], conversation_id="a")
    assert first["ok"] and first["released_holds"] == 0
    assert decode.command("hold", request_id="t2", blocks=[list(range(8, 14))], conversation_id="b")["ok"]
    # 8 + 6 + 6 > 16: the oldest hold goes, and its engine hears its blocks are free.
    third = decode.command("hold", request_id="t3", blocks=[list(range(14, 20))], conversation_id="c")
    assert third["ok"] and third["released_holds"] == 1, third
    [event] = decode.wait_event("t1", 10)
    assert event["event"] == "LEASE_EXPIRED" and "hold cap" in event["reason"], event
    assert decode.events_for("t2") == [] and decode.events_for("t3") == []
    assert decode.command("query", conversation_id="a")["entries"] == []
    assert [e["request_id"] for e in decode.command("query", conversation_id="c")["entries"]] == ["t3"]
    with SidecarClient(side.socket, timeout=5.0) as client:
        status = client.status()
    assert status.held_requests == 2 and status.held_blocks == 12
    # A hold larger than the whole share is refused, and nothing else is released for it.
    refused = decode.command("hold", request_id="big", blocks=[list(range(20, 37))])
    assert not refused["ok"] and "RESOURCE_EXHAUSTED" in refused["error"] and "hold cap" in refused["error"]
    assert decode.events_for("t2") == []
    body = _metrics(port)
    assert _metric(body, 'kvsidecar_hold_releases_total{reason="cap"}') == 1
    assert _metric(body, 'kvsidecar_hold_releases_total{reason="refused_over_cap"}') == 1
    assert _metric(body, "kvsidecar_held_blocks") == 12


def test_p_finds_d_s_hold_by_prefix_hashes_across_known_peers_and_reads_only_the_common_prefix(
    sidecars, engines
) -> None:
    port = free_port()
    p_side = sidecars("p", args=["--metrics-listen", f"127.0.0.1:{port}"])
    d_side = sidecars("d")
    prefill = engines(p_side, "P", "both")
    decode = engines(d_side, "D", "both")
    # Turn 1 (P -> D): D's sidecar pulls from P's, so P's sidecar now knows D's.
    assert prefill.command("fill", blocks=[1, 2], seed=5)["ok"]
    assert prefill.command("submit", request_id="turn1-p", blocks=[[1, 2]])["ok"]
    assert start_pull(decode, prefill, "turn1-d", [20, 21], "turn1-p", [1, 2])["ok"]
    assert decode.wait_event("turn1-d", 10)[0]["event"] == "FINISHED_RECEIVING"
    # D finished turn 1 (prompt + answer: 3 full blocks) and holds them, with their hashes.
    assert decode.command("fill", blocks=[20, 21, 22], seed=78)["ok"]
    held = _hashes("system+user1", "user1+answer1", "answer1")
    assert decode.command("hold", request_id="turn1-d", blocks=[[20, 21, 22]], num_tokens=96, block_hashes=held)["ok"]

    # Turn 2 with an edited history: P's prompt shares only the first two blocks. No address, no
    # conversation id: P's sidecar asks every peer it knows.
    edited = [*held[:2], *_hashes("edited answer", "user2")]
    found = prefill.command("query", block_hashes=edited, known_peers=True, timeout_seconds=2.0)
    assert found["unreachable"] == []
    [entry] = found["entries"]
    assert entry["address"] == decode.peer_address and entry["request_id"] == "turn1-d"
    assert entry["matched_blocks"] == 2 and entry["block_hashes"] == held and entry["blocks"] == [[20, 21, 22]]
    # Another history (first block differs) finds nothing.
    assert prefill.command("query", block_hashes=_hashes("other"), known_peers=True)["entries"] == []

    # P reads exactly the matched prefix into its own blocks; D's blocks are then free.
    remote = {"address": entry["address"], "engine_id": "D", "request_id": "turn1-d", "blocks": [[20, 21]]}
    assert prefill.command("pull", request_id="turn2-p", blocks=[[40, 41]], remote=remote)["ok"]
    assert prefill.wait_event("turn2-p", 10)[0]["event"] == "FINISHED_RECEIVING"
    wait_until(
        lambda: any(e["event"] == "FINISHED_SENDING" for e in decode.events_for("turn1-d")), 10, what="D's hold read"
    )
    d_kv, p_kv = kv(decode.buffers[0], 2, 64, 4096), kv(prefill.buffers[0], 2, 64, 4096)
    assert np.array_equal(d_kv[:, [20, 21]], p_kv[:, [40, 41]])
    assert not p_kv[:, 42].any()  # the unmatched block was not read
    body = _metrics(port)
    assert _metric(body, 'kvsidecar_cache_lookups_total{outcome="hit"}') == 1
    assert _metric(body, 'kvsidecar_cache_lookups_total{outcome="no_hold"}') == 1


def _d_holds_turn_one(sidecars, engines) -> tuple[SidecarProcess, EngineProcess, EngineProcess]:
    """Turn 1: D's sidecar pulls from P's, so P's sidecar knows D's; D holds the finished turn as
    conversation "conv". Returns D's sidecar, P's engine and D's engine."""
    p_side, d_side = sidecars("p"), sidecars("d")
    prefill = engines(p_side, "P", "both")
    decode = engines(d_side, "D", "both")
    assert prefill.command("submit", request_id="t1-p", blocks=[[1]])["ok"]
    assert start_pull(decode, prefill, "t1", [3], "t1-p", [1])["ok"]
    assert decode.wait_event("t1", 10)[0]["event"] == "FINISHED_RECEIVING"
    assert decode.command("hold", request_id="t1", blocks=[[3]], conversation_id="conv")["ok"]
    return d_side, prefill, decode


def test_a_query_across_peers_is_bounded_when_a_peer_is_gone(sidecars, engines) -> None:
    d_side, prefill, decode = _d_holds_turn_one(sidecars, engines)
    found = prefill.command("query", conversation_id="conv", known_peers=True, timeout_seconds=5.0)
    assert len(found["entries"]) == 1 and found["unreachable"] == [], found
    d_side.kill()
    started = time.monotonic()
    found = prefill.command("query", conversation_id="conv", known_peers=True, timeout_seconds=0.5)
    assert found["entries"] == [] and found["unreachable"] == [decode.peer_address], found
    assert time.monotonic() - started < 5.0  # bounded by timeout_seconds, not the peer call timeout


def test_a_query_to_a_holder_that_is_down_is_unavailable_not_waited_for(sidecars, engines) -> None:
    """A lookup only saves a recompute: asking a holder's sidecar that is down (stopped, or
    restarting) answers UNAVAILABLE at once, so the engine recomputes now, rather than
    DEADLINE_EXCEEDED after waiting for the peer to come back."""
    d_side, prefill, decode = _d_holds_turn_one(sidecars, engines)
    assert len(prefill.command("query", address=decode.peer_address, conversation_id="conv")["entries"]) == 1
    d_side.kill()
    found = prefill.command("query", address=decode.peer_address, conversation_id="conv", timeout_seconds=3.0)
    assert not found["ok"] and "UNAVAILABLE" in found["error"] and "no cache answer" not in found["error"], found


def test_reading_a_released_hold_fails_explicitly(sidecars, engines) -> None:
    p_side, d_side = sidecars("p"), sidecars("d")
    prefill = engines(p_side, "P", "both")
    decode = engines(d_side, "D", "both")
    assert decode.command("hold", request_id="t1", blocks=[[5, 6]], conversation_id="conv")["ok"]
    [entry] = prefill.command("query", address=decode.peer_address, conversation_id="conv")["entries"]
    # D gives the blocks back (the hold cap, its TTL or an abort) before P reads.
    assert decode.command("release", request_id="t1", reason="test")["ok"]
    assert decode.wait_event("t1", 10)[0]["event"] == "FINISHED_SENDING"
    remote = {"address": entry["address"], "engine_id": "D", "request_id": "t1", "blocks": entry["blocks"]}
    assert prefill.command("pull", request_id="t2", blocks=[[7, 8]], remote=remote)["ok"]
    [event] = prefill.wait_event("t2", 15)
    assert event["event"] == "LOAD_FAILED" and "no longer holds" in event["reason"], event


def test_hold_and_query_reject_bad_hashes(sidecars, engines) -> None:
    side = sidecars("d")
    decode = engines(side, "D", "both")
    too_many = decode.command("hold", request_id="t1", blocks=[[1]], block_hashes=_hashes("a", "b"))
    assert not too_many["ok"] and "INVALID_ARGUMENT" in too_many["error"] and "block_hashes" in too_many["error"]
    empty = decode.command("hold", request_id="t1", blocks=[[1]], block_hashes=[""])
    assert not empty["ok"] and "block_hashes[0]" in empty["error"]
    nothing = decode.command("query")
    assert not nothing["ok"] and "INVALID_ARGUMENT" in nothing["error"]
    assert decode.command("query", conversation_id="x")["entries"] == []  # nothing was held


def test_a_conversation_s_next_turn_supersedes_its_earlier_hold(sidecars, engines) -> None:
    side = sidecars("d")
    decode = engines(side, "D", "both")
    assert decode.command("hold", request_id="turn1", blocks=[[1, 2]], conversation_id="conv")["ok"]
    assert decode.command("hold", request_id="other", blocks=[[3]], conversation_id="another")["ok"]
    assert decode.command("hold", request_id="turn2", blocks=[[4, 5, 6]], conversation_id="conv")["ok"]
    [event] = decode.wait_event("turn1", 10)
    assert event["event"] == "FINISHED_SENDING" and "superseded" in event["reason"], event
    assert [e["request_id"] for e in decode.command("query", conversation_id="conv")["entries"]] == ["turn2"]
    assert decode.events_for("other") == []


def test_p_reads_from_a_holder_that_restarted_under_the_same_engine_id(sidecars, engines) -> None:
    p_side, d_side = sidecars("p"), sidecars("d")
    prefill = engines(p_side, "P", "both")
    first = engines(d_side, "D", "both")
    assert first.command("hold", request_id="t1", blocks=[[4, 5]], conversation_id="conv")["ok"]
    [entry] = prefill.command("query", address=first.peer_address, conversation_id="conv")["entries"]
    remote = {"address": entry["address"], "engine_id": "D", "request_id": "t1", "blocks": [[4, 5]]}
    assert prefill.command("pull", request_id="p1", blocks=[[1, 2]], remote=remote)["ok"]
    assert prefill.wait_event("p1", 10)[0]["event"] == "FINISHED_RECEIVING"  # P's sidecar cached D's handshake
    first.kill()
    with SidecarClient(d_side.socket, timeout=5.0) as client:
        wait_until(lambda: not client.status().engines, 10, what="D dropped")
    second = engines(d_side, "D", "both")  # D restarted: same id, new agents
    assert second.command("fill", blocks=[6, 7], seed=9)["ok"]
    assert second.command("hold", request_id="t2", blocks=[[6, 7]], conversation_id="conv")["ok"]
    # The answer names D's new generation: P's sidecar drops its stale handshake, so the read goes
    # to the new agents instead of failing against the old ones.
    [entry] = prefill.command("query", conversation_id="conv", known_peers=True, timeout_seconds=5.0)["entries"]
    remote = {"address": entry["address"], "engine_id": "D", "request_id": "t2", "blocks": [[6, 7]]}
    assert prefill.command("pull", request_id="p2", blocks=[[8, 9]], remote=remote)["ok"]
    [event] = prefill.wait_event("p2", 15)
    assert event["event"] == "FINISHED_RECEIVING", event
    assert np.array_equal(kv(second.buffers[0], 2, 64, 4096)[:, [6, 7]], kv(prefill.buffers[0], 2, 64, 4096)[:, [8, 9]])
