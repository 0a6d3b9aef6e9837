"""Two sidecars of different versions: the pinned older commit (tests/support/skew.py builds it from
git into a temporary venv) and this checkout, each with a simulated engine running its own side's
code, through pull, push and multi-turn, with the old side as producer and as consumer. Every byte
is checked (docs/compatibility.md).

`make test` runs pull in both directions; `make skew` runs every case (marker ``skew_full``)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from engine_shim.client import SidecarClient
from kvsidecar.v1 import common_pb2, peer_pb2
from sidecar import FEATURES
from sidecar.config import Settings
from sidecar.errors import Unimplemented
from sidecar.metrics import SidecarMetrics
from sidecar.peers.client import PeerClient
from sidecar.tools.proto_compat import PINNED_COMMIT, CompatError
from tests.support.moves import kv
from tests.support.processes import PUSH_MODE, EngineProcess, SidecarProcess, wait_until
from tests.support.skew import OldCheckout

pytestmark = pytest.mark.skew

LAYERS, BLOCKS, BLOCK_LEN = 2, 64, 4096
DIRECTIONS = ["old_p-new_d", "new_p-old_d"]


@pytest.fixture(scope="module")
def old() -> Iterator[OldCheckout]:
    root = Path(tempfile.mkdtemp(prefix="kvs-skew-", dir="/tmp"))
    try:
        try:
            checkout = OldCheckout.create(PINNED_COMMIT, root)
        except CompatError as exc:  # CI's clone lacks the commit: say so, never skip quietly
            pytest.fail(str(exc))
        found = checkout.imports_from()
        assert all(Path(path).is_relative_to(checkout.src) for path in found.values()), found
        yield checkout
    finally:
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Side:
    sidecar: SidecarProcess
    engine: EngineProcess
    old: bool


@dataclass
class Pair:
    p: Side
    d: Side

    @property
    def new(self) -> Side:
        return self.d if self.p.old else self.p


@pytest.fixture(params=DIRECTIONS)
def pair(request: pytest.FixtureRequest, workdir: Path, old: OldCheckout) -> Iterator[Pair]:
    old_p = request.param.startswith("old_p")
    sidecars: list[SidecarProcess] = []
    engines: list[EngineProcess] = []

    def side(name: str, is_old: bool) -> Side:
        wrapper = [str(old.python)] if is_old else []
        sidecar = SidecarProcess(workdir, f"{name}-{'old' if is_old else 'new'}", wrapper=wrapper)
        sidecars.append(sidecar)
        sidecar.start(timeout=60.0)
        engine = EngineProcess(
            workdir, sidecar.socket, name.upper(), "both",
            layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN, wrapper=wrapper,
        )  # fmt: skip
        engines.append(engine)
        return Side(sidecar, engine, is_old)

    try:
        pair = Pair(side("p", old_p), side("d", not old_p))
        # The old sidecar really is the old code: it announces no features, this checkout all of its own.
        assert list(_status(pair.p).sidecar.versions.features) == ([] if old_p else list(FEATURES))
        assert list(_status(pair.d).sidecar.versions.features) == (list(FEATURES) if old_p else [])
        yield pair
    finally:
        for engine in engines:
            engine.kill()
        for sidecar in sidecars:
            sidecar.kill()


def _status(side: Side):  # -> engine_pb2.GetStatusResponse
    with SidecarClient(side.sidecar.socket, timeout=10.0) as client:
        return client.status()


def _same_bytes(p: Side, p_blocks: list[int], d: Side, d_blocks: list[int]) -> None:
    sent = kv(p.engine.buffers[0], LAYERS, BLOCKS, BLOCK_LEN)[:, p_blocks]
    received = kv(d.engine.buffers[0], LAYERS, BLOCKS, BLOCK_LEN)[:, d_blocks]
    assert sent.any() and np.array_equal(sent, received)


def _finished(pair: Pair, p_request: str, d_request: str) -> None:
    assert pair.d.engine.wait_event(d_request, 30)[0]["event"] == "FINISHED_RECEIVING"
    assert pair.p.engine.wait_event(p_request, 30)[0]["event"] == "FINISHED_SENDING"


def _new_side_sees_the_old_peer(pair: Pair, observer: Side) -> None:
    """The side of this checkout that handshook the old one shows its version and (no) features."""
    peer = next(side for side in (pair.p, pair.d) if side is not observer)
    [row] = [row for row in _status(observer).peers if row.address == peer.engine.peer_address]
    assert row.versions.kvsidecar and list(row.versions.features) == []


def test_pull_across_versions(pair: Pair) -> None:
    p_blocks, d_blocks = [3, 4, 5, 6], [40, 41, 42, 43]
    for round_ in range(2):  # the second reuses the handshake
        request = f"pull-{round_}"
        assert pair.p.engine.command("fill", blocks=p_blocks, seed=11 + round_)["ok"]
        assert pair.p.engine.command("submit", request_id=request, blocks=[p_blocks], num_tokens=64)["ok"]
        remote = {"address": pair.p.engine.peer_address, "engine_id": "P", "request_id": request,
                  "blocks": [p_blocks], "num_tokens": 64}  # fmt: skip
        reply = pair.d.engine.command("pull", request_id=f"{request}-d", blocks=[d_blocks], remote=remote)
        assert reply["ok"], reply
        _finished(pair, request, f"{request}-d")
        _same_bytes(pair.p, p_blocks, pair.d, d_blocks)
    if pair.p.old:  # D (this checkout) handshook the old P
        _new_side_sees_the_old_peer(pair, pair.d)


@pytest.mark.skew_full
def test_push_across_versions(pair: Pair) -> None:
    p_blocks, d_blocks = [7, 8, 9], [20, 21, 22]
    for round_, order in enumerate(("expect_first", "submit_first")):
        request = f"push-{round_}"
        assert pair.p.engine.command("fill", blocks=p_blocks, seed=21 + round_)["ok"]
        remote = {"address": pair.p.engine.peer_address, "engine_id": "P", "request_id": request}
        submit = {"request_id": request, "blocks": [p_blocks], "num_tokens": 48, "mode": PUSH_MODE,
                  "transfer_id": f"t-{request}"}  # fmt: skip
        expect = {"request_id": f"{request}-d", "blocks": [d_blocks], "remote": remote}
        if order == "submit_first":
            assert pair.p.engine.command("submit", **submit)["ok"]
        reply = pair.d.engine.command("expect_push", **expect)
        assert reply["ok"], reply
        if order == "expect_first":
            assert pair.p.engine.command("submit", **submit)["ok"]
        _finished(pair, request, f"{request}-d")
        _same_bytes(pair.p, p_blocks, pair.d, d_blocks)
    if pair.d.old:  # P (this checkout) handshook the old D to write into it
        _new_side_sees_the_old_peer(pair, pair.p)


@pytest.mark.skew_full
def test_multiturn_hold_and_remote_lookup_across_versions(pair: Pair) -> None:
    """D holds a finished turn; P finds it by conversation (a QueryCache to D's sidecar) and pulls it."""
    held = [10, 11, 12]
    assert pair.d.engine.command("fill", blocks=held, seed=31)["ok"]
    reply = pair.d.engine.command("hold", request_id="turn1-d", blocks=[held], conversation_id="conv-skew",
                                  num_tokens=40, ttl_seconds=60)  # fmt: skip
    assert reply["ok"], reply
    found = pair.p.engine.command("query", address=pair.d.engine.peer_address, conversation_id="conv-skew")
    assert found["ok"], found
    [entry] = found["entries"]
    assert entry["request_id"] == "turn1-d" and entry["blocks"] == [held] and entry["num_tokens"] == 40
    remote = {"address": entry["address"], "engine_id": "D", "request_id": "turn1-d", "blocks": entry["blocks"]}
    reply = pair.p.engine.command("pull", request_id="turn2-p", blocks=[[3, 4, 5]], remote=remote)
    assert reply["ok"], reply
    assert pair.p.engine.wait_event("turn2-p", 30)[0]["event"] == "FINISHED_RECEIVING"
    wait_until(
        lambda: any(e["event"] == "FINISHED_SENDING" for e in pair.d.engine.events_for("turn1-d")),
        30, what="D's hold read and freed",
    )  # fmt: skip
    _same_bytes(pair.d, held, pair.p, [3, 4, 5])
    assert (
        pair.p.engine.command("query", address=pair.d.engine.peer_address, conversation_id="conv-skew")["entries"] == []
    )


def test_a_peer_without_an_rpc_is_feature_absent_not_a_failing_peer(tmp_path: Path) -> None:
    """A newer sidecar calling an RPC an older peer lacks gets UNIMPLEMENTED: ``Unimplemented``
    (docs/compatibility.md), and the peer's failure count (heartbeats give up on it) stays 0."""

    async def scenario() -> None:
        server = grpc.aio.server()  # serves no PeerService at all: every RPC is UNIMPLEMENTED
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        settings = Settings(engine_socket=tmp_path / "e.sock", metrics_listen="off", peer_call_timeout_seconds=5)

        async def unload(address: str, names: list[str]) -> None:
            return None

        client = PeerClient(settings, lambda: common_pb2.SidecarInfo(), unload, SidecarMetrics())
        address = f"127.0.0.1:{port}"
        try:
            for _ in range(3):
                with pytest.raises(Unimplemented, match="UNIMPLEMENTED"):
                    await client.query_cache(address, peer_pb2.PeerQueryCacheRequest(conversation_id="c"))
            assert client.failures(address) == 0
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(scenario())
