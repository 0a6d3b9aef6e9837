"""What a stopping sidecar waits for (``Node.drain``), on one in-process node (fake transport):
the blocks its producers submitted until consumers take them, and a multi-turn hold only while a
consumer was promised it may read it (its heartbeat found the hold); an idle hold, which may live
for minutes, never keeps a restart waiting. Both bounded by the drain's grace."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from engine_shim.client import SidecarClient
from kvsidecar.v1 import peer_pb2
from tests.node.test_node_parts import P, harness, run


def test_the_drain_waits_for_a_hold_being_read_but_not_for_an_idle_one(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with harness(tmp_path) as h:
            await h.node.producer.hold(SidecarClient.hold_blocks_request(P, "turn-1", [[3, 4]], conversation_id="c"))
            started = time.monotonic()
            await h.node.drain(3.0)
            assert time.monotonic() - started < 1.0, "an idle hold kept the drain waiting"
            assert h.node.producer.awaiting_consumers() == 0

            # A consumer's heartbeat found the hold: its READ may be under way, so the drain waits
            # for it (until the READ's notification ends the hold, or the grace).
            heartbeat = peer_pb2.HeartbeatRequest(
                caller_sidecar_id="reader", engine_id=P, requests=[peer_pb2.RequestKey(request_id="turn-1")]
            )
            assert not (await h.node.producer.handle_heartbeat(heartbeat)).unknown
            assert h.node.producer.awaiting_consumers() == 1
            started = time.monotonic()
            await h.node.drain(1.0)
            assert time.monotonic() - started >= 0.9, "the drain did not wait for the promised READ"
            assert (P, "turn-1") in h.node.producer.requests  # still held: the bound ended the wait
            await asyncio.sleep(0)

    run(scenario)
