"""A consumer that gives up on a pull tells the producer, so a release there is not held back.

A producer whose engine releases a request while a consumer may still READ it (a heartbeat found
it) hands the blocks back only once that consumer notified or released it, or at the READ's bound
(``readable_until``: the heartbeat + ``lease_extension_seconds``, 20 s by default). From then on it
answers that consumer's heartbeats "unknown", and a consumer that hears "unknown" for a request its
producer had confirmed judges it lost and fails it without reading. It must say so (a Release):
otherwise the producer, which cannot see that no READ will come, holds the blocks and keeps its
engine waiting for the whole bound. Found as issue 35's flake of
``test_a_graceful_restart_under_load_loses_no_request[d-hold]`` ("P had no answer within 20s").

In-process node, ``test_node_parts``'s harness (P and D on one node, the same-node peer path).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from engine_shim.client import SidecarClient, remote
from kvsidecar.v1 import engine_pb2
from tests.node.test_node_parts import ADDRESS, D, P, harness, run


def test_a_pull_a_heartbeat_round_fails_releases_its_producers_closing_request(tmp_path: Path) -> None:
    """D's pull was confirmed by a heartbeat (P's READ bound set), P's engine released the request
    (P waits for the READ), and D's next heartbeat round hears "unknown" before the READ started:
    D fails its pull, and P's engine gets FINISHED_SENDING at once, not at the READ's bound."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:
            consumer = h.node.consumer
            h.p.fill([3, 4], seed=3)
            await h.node.producer.submit(SidecarClient.submit_request(P, "req-g", [[3, 4]]))
            # Hold the pull between its confirmation heartbeat and its READ (the handshake waits).
            gate = asyncio.Event()
            handshake = h.node.peers.engine

            async def gated_handshake(*args: Any) -> Any:
                await gate.wait()
                return await handshake(*args)

            h.node.peers.engine = gated_handshake  # type: ignore[method-assign]
            pull = SidecarClient.pull_request(D, "req-g-d", [[7, 8]], remote(ADDRESS, P, "req-g", [[3, 4]]))
            await consumer.pull(pull)
            for _ in range(100):
                if (D, "req-g-d") in consumer.keepalive.confirmed:
                    break
                await asyncio.sleep(0.02)
            assert (D, "req-g-d") in consumer.keepalive.confirmed, "the pull was never confirmed"
            assert h.node.producer.requests[(P, "req-g")].readable_until > 0

            # P's engine releases it: P waits for the READ the heartbeat allowed.
            released = await h.node.release(engine_pb2.ReleaseRequest(engine_id=P, request_id="req-g", reason="abort"))
            assert released.found
            assert h.node.producer.requests[(P, "req-g")].closing is not None

            # D's heartbeat round: "unknown" for a confirmed request, so D fails it (no READ).
            await consumer.heartbeat_once()
            failed = await h.next_event(D)
            assert failed.kind == engine_pb2.LOAD_FAILED and failed.request_id == "req-g-d", failed
            gate.set()

            # P hears it was given up: its engine gets the blocks back now (the bound is 20 s).
            sent = await h.next_event(P, timeout=3.0)
            assert sent.kind == engine_pb2.FINISHED_SENDING and sent.request_id == "req-g", sent
            assert (P, "req-g") not in h.node.producer.requests
            await asyncio.sleep(0.1)  # the pull task ends without reading
            assert not h.fabric.transfers, "D read blocks it had given up"
            assert not consumer.requests

    run(scenario)


def test_a_pull_whose_confirmation_hears_unknown_releases_its_producers_closing_request(tmp_path: Path) -> None:
    """D's queue kept the request alive (a heartbeat confirmed it, P's READ bound set) and P's engine
    released it; D's Pull then asks P before reading, hears "unknown" and fails without reading:
    P's engine gets FINISHED_SENDING at once."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:
            consumer = h.node.consumer
            await _kept_alive_then_released(h, "req-k")

            pull = SidecarClient.pull_request(D, "req-k-d", [[7, 8]], remote(ADDRESS, P, "req-k", [[3, 4]]))
            await consumer.pull(pull)
            failed = await h.next_event(D)
            assert failed.kind == engine_pb2.LOAD_FAILED and "no longer holds" in failed.reason, failed
            sent = await h.next_event(P, timeout=3.0)
            assert sent.kind == engine_pb2.FINISHED_SENDING and sent.request_id == "req-k", sent
            assert not h.fabric.transfers, "D read blocks it had given up"

    run(scenario)


def test_a_keep_alive_a_heartbeat_round_judges_lost_releases_its_producers_closing_request(tmp_path: Path) -> None:
    """A request in D's queue (KeepAlive) whose producer answers "unknown" after confirming it is
    lost (its Pull will fail): P, whose engine released it meanwhile, is told at once."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:
            consumer = h.node.consumer
            await _kept_alive_then_released(h, "req-q")

            await consumer.heartbeat_once()
            assert (D, "req-q-d") in consumer.keepalive.lost
            sent = await h.next_event(P, timeout=3.0)
            assert sent.kind == engine_pb2.FINISHED_SENDING and sent.request_id == "req-q", sent

    run(scenario)


def test_a_pull_whose_handshake_times_out_releases_its_producers_request(tmp_path: Path) -> None:
    """D's handshake with P's sidecar gets no answer within ``peer_call_timeout_seconds`` (a slow or
    hung node): D fails the pull without reading, and tells P, whose engine gets its blocks back at
    once rather than when the lease runs out (30 s)."""

    async def scenario() -> None:
        async with harness(tmp_path, peer_call_timeout_seconds=0.2) as h:
            await h.node.producer.submit(SidecarClient.submit_request(P, "req-h", [[3, 4]]))
            never = asyncio.Event()

            async def hung_handshake(*args: Any) -> Any:
                await never.wait()

            h.node.peers.engine = hung_handshake  # type: ignore[method-assign]
            pull = SidecarClient.pull_request(D, "req-h-d", [[7, 8]], remote(ADDRESS, P, "req-h", [[3, 4]]))
            await h.node.consumer.pull(pull)
            failed = await h.next_event(D)
            assert failed.kind == engine_pb2.LOAD_FAILED and "timed out" in failed.reason, failed
            sent = await h.next_event(P, timeout=3.0)
            assert sent.kind == engine_pb2.FINISHED_SENDING and sent.request_id == "req-h", sent
            assert (P, "req-h") not in h.node.producer.requests
            assert not h.fabric.transfers, "D read blocks it had given up"

    run(scenario)


async def _kept_alive_then_released(h: Any, request: str) -> None:
    """P holds ``request``; D's keep-alive for it (``<request>-d``) is confirmed by a heartbeat
    (P's READ bound set); then P's engine releases it, and P waits for D's READ."""
    consumer = h.node.consumer
    await h.node.producer.submit(SidecarClient.submit_request(P, request, [[3, 4]]))
    keep = engine_pb2.KeepAliveRequest(engine_id=D, request_id=f"{request}-d", remote=remote(ADDRESS, P, request))
    assert (await consumer.keep_alive(keep)).producer_holds
    await consumer.heartbeat_once()
    assert (D, f"{request}-d") in consumer.keepalive.confirmed
    await h.node.release(engine_pb2.ReleaseRequest(engine_id=P, request_id=request, reason="abort"))
    assert h.node.producer.requests[(P, request)].closing is not None
