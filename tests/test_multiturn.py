"""Multi-turn reuse (decode -> prefill): D holds a finished turn's blocks, P finds them with a cache
query and pulls them instead of recomputing; the hold ends with P's read or with its TTL."""

from __future__ import annotations

import time

import numpy as np

from tests.test_pull import kv


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
