"""A hostile peer and a careless client, against real sidecar processes over gRPC with real NIXL
and shared memory: block ids outside what a request owns, addresses that are not HOST:PORT,
unreachable peers, registrations beyond the limits. Each must be refused with a precise status (or
end in LOAD_FAILED), move no byte outside the named blocks, and leave no state behind.

Every address generated here is loopback (127.0.0.0/8 or ::1)."""

from __future__ import annotations

import fcntl
import os
import socket
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest

from engine_shim.client import SidecarClient, engine_channel, grouped, remote
from engine_shim.memory import KvLayout, SharedBuffer, kv_registration
from kvsidecar.v1 import common_pb2, engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc
from tests.support.moves import kv, start_pull
from tests.support.processes import wait_until

LAYERS, BLOCK_LEN = 2, 4096
P_BLOCKS, D_BLOCKS = 64, 16


def _snapshot(path: Path, blocks: int) -> np.ndarray:
    return np.array(kv(path, LAYERS, blocks, BLOCK_LEN))


def _peer_stub(channel: grpc.Channel) -> peer_pb2_grpc.PeerServiceStub:
    return peer_pb2_grpc.PeerServiceStub(channel)


def _refused(call, request, code=grpc.StatusCode.INVALID_ARGUMENT) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as error:
        call(request, timeout=10)
    assert error.value.code() == code, (error.value.code(), error.value.details())
    return str(error.value.details())


def test_push_reg_naming_blocks_outside_the_consumer_is_refused_and_writes_nothing(sidecars, engines) -> None:
    p_side, d_side = sidecars("p"), sidecars("d")
    producer = engines(p_side, "P", "producer", layers=LAYERS, blocks=P_BLOCKS, block_len=BLOCK_LEN)
    consumer = engines(d_side, "D", "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=BLOCK_LEN)
    assert producer.command("fill", blocks=list(range(P_BLOCKS)), seed=5)["ok"]
    before = _snapshot(consumer.buffers[0], D_BLOCKS)

    def push_reg(request_id: str, ids: list[int]) -> peer_pb2.PushRegRequest:
        return peer_pb2.PushRegRequest(
            caller=common_pb2.SidecarInfo(sidecar_id=d_side.sidecar_id, address=d_side.address),
            prefill_engine_id="P",
            prefill_request_id=f"{request_id}-p",
            decode_engine_id="D",
            request_id=request_id,
            block_ids=grouped([ids]),
        )

    with grpc.insecure_channel(p_side.address) as channel:
        stub = _peer_stub(channel)
        # Two names for one block: refused at once, whatever the consumer's geometry.
        details = _refused(stub.PushReg, push_reg("dup", [5, 5]))
        assert "block_ids" in details and "5" in details and "twice" in details
        # Past D's 16 blocks, before P knows D's geometry: accepted, then refused after the
        # handshake and before any WRITE; P's engine learns why.
        assert not stub.PushReg(push_reg("far", [15, 16]), timeout=10).matched
        assert producer.command("submit", request_id="far-p", blocks=[[1, 2]])["ok"]
        (event,) = producer.wait_event("far-p", 30)
        assert "block_ids" in event["reason"] and "out of range" in event["reason"], event
        # Now P knows D's geometry: refused synchronously, naming the field.
        details = _refused(stub.PushReg, push_reg("far2", [16]))
        assert "block_ids" in details and "out of range" in details
    assert np.array_equal(_snapshot(consumer.buffers[0], D_BLOCKS), before), "bytes landed in D's blocks"
    with SidecarClient(p_side.socket) as client:
        status = client.status()
    assert status.pending_push_registrations == 0 and status.leases == 0


@pytest.mark.parametrize("same_sidecar", [False, True], ids=["two_sidecars", "same_sidecar"])
def test_pull_reads_only_blocks_the_producer_submitted_for_that_request(sidecars, engines, same_sidecar) -> None:
    p_side = sidecars("p")
    d_side = p_side if same_sidecar else sidecars("d")
    producer = engines(p_side, "P", "producer", layers=LAYERS, blocks=P_BLOCKS, block_len=BLOCK_LEN)
    consumer = engines(d_side, "D", "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=BLOCK_LEN)
    assert producer.command("fill", blocks=list(range(P_BLOCKS)), seed=9)["ok"]
    assert producer.command("submit", request_id="r1", blocks=[[1, 2]])["ok"]
    before = _snapshot(consumer.buffers[0], D_BLOCKS)

    # Blocks 40 and 41 exist on P but belong to no request of ours: nothing is read.
    assert start_pull(consumer, producer, "d-foreign", [3, 4], "r1", [40, 41])["ok"]
    (event,) = consumer.wait_event("d-foreign", 30)
    assert event["event"] == "LOAD_FAILED" and "did not submit" in event["reason"], event
    assert sorted(event["failed_block_ids"]) == [3, 4]
    assert np.array_equal(_snapshot(consumer.buffers[0], D_BLOCKS), before), "foreign blocks were read"

    # Repeated remote ids are refused synchronously, naming the field.
    reply = start_pull(consumer, producer, "d-dup", [5, 6], "r1", [1, 1])
    assert not reply["ok"] and "remote.block_ids" in reply["error"] and "twice" in reply["error"], reply

    # The request's own blocks still move, byte for byte (its lease was not disturbed).
    assert start_pull(consumer, producer, "d-own", [3, 4], "r1", [1, 2])["ok"]
    (event,) = consumer.wait_event("d-own", 30)
    assert event["event"] == "FINISHED_RECEIVING", event
    # P's geometry is known by now: ids past its 64 blocks are refused synchronously.
    reply = start_pull(consumer, producer, "d-far", [5], "r1", [P_BLOCKS])
    assert not reply["ok"] and "remote.block_ids" in reply["error"] and "out of range" in reply["error"], reply
    p_kv, d_kv = (
        kv(producer.buffers[0], LAYERS, P_BLOCKS, BLOCK_LEN),
        kv(consumer.buffers[0], LAYERS, D_BLOCKS, BLOCK_LEN),
    )
    assert np.array_equal(d_kv[:, [3, 4]], p_kv[:, [1, 2]])


def test_a_producer_refusing_a_push_registration_fails_the_request_not_the_call(sidecars, engines) -> None:
    # The producer's own limit makes it answer INVALID_ARGUMENT; the consumer used to turn that
    # into TypeError -> INTERNAL and keep a pending receive forever.
    p_side = sidecars("p", args=["--set", "max_blocks_per_request=4"])
    d_side = sidecars("d")
    producer = engines(p_side, "P", "producer", layers=LAYERS, blocks=P_BLOCKS, block_len=BLOCK_LEN)
    consumer = engines(d_side, "D", "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=BLOCK_LEN)
    target = {"address": producer.peer_address, "engine_id": "P", "request_id": "big-p"}
    reply = consumer.command("expect_push", request_id="big", blocks=[list(range(8))], remote=target)
    assert reply["ok"] and not reply["registered"], reply
    (event,) = consumer.wait_event("big", 30)
    assert event["event"] == "LOAD_FAILED" and "block_ids" in event["reason"], event
    with SidecarClient(d_side.socket) as client:
        assert client.status().pending_receives == 0


BAD_ADDRESSES = ["nohostport", "127.0.0.1:0", "127.0.0.1:70000", "[::1", "::1:5", "a b:1", "127.0.0.1:", ":1"]


def test_bad_input_to_every_handler_is_invalid_argument_naming_the_field(sidecars, engines) -> None:
    sidecar = sidecars()
    engines(sidecar, "E", "both", layers=LAYERS, blocks=P_BLOCKS, block_len=BLOCK_LEN)
    with engine_channel(sidecar.socket) as channel:
        engine = engine_pb2_grpc.EngineServiceStub(channel)
        peer = _peer_stub(channel)
        for address in BAD_ADDRESSES:
            cases = [
                (engine.QueryCache, engine_pb2.QueryCacheRequest(engine_id="E", address=address, request_id="r"),
                 "address"),
                (peer.Handshake, peer_pb2.HandshakeRequest(
                    engine_id="E", caller=common_pb2.SidecarInfo(sidecar_id="x", address=address)), "caller.address"),
                (peer.PushReg, peer_pb2.PushRegRequest(
                    caller=common_pb2.SidecarInfo(sidecar_id="x", address=address), prefill_engine_id="E",
                    decode_engine_id="D", request_id="r", block_ids=grouped([[1]])), "caller.address"),
                (engine.Pull, engine_pb2.PullRequest(
                    engine_id="E", request_id="r", local_block_ids=grouped([[1]]),
                    remote=remote(address, "P", "r", [[1]])), "remote.address"),
                (engine.KeepAlive, engine_pb2.KeepAliveRequest(
                    engine_id="E", request_id="r", remote=remote(address, "P", "r")), "remote.address"),
            ]  # fmt: skip
            for call, request, field in cases:
                details = _refused(call, request)
                assert details.startswith(field), (address, details)
        submit, hold = engine_pb2.SubmitBlocksRequest, engine_pb2.HoldBlocksRequest
        blocks = [
            (engine.SubmitBlocks, submit(engine_id="E", request_id="s", block_ids=grouped([[5, 5]]))),
            (engine.SubmitBlocks, submit(engine_id="E", request_id="s", block_ids=grouped([[P_BLOCKS]]))),
            (engine.SubmitBlocks, submit(engine_id="E", request_id="s", block_ids=grouped([[2**32 - 1]]))),
            (engine.HoldBlocks, hold(engine_id="E", request_id="s", block_ids=grouped([[7, 7]]))),
            (peer.Heartbeat, peer_pb2.HeartbeatRequest(
                engine_id="E", requests=[peer_pb2.RequestKey(request_id="s", block_ids=grouped([[1, 1]]))])),
        ]  # fmt: skip
        for call, request in blocks:
            assert "block_ids" in _refused(call, request)
        status = engine.GetStatus(engine_pb2.GetStatusRequest(), timeout=10)
    assert list(status.peers) == [] and status.leases == 0 and status.pending_receives == 0
    assert status.pending_push_registrations == 0
    assert sidecar.process is not None and sidecar.process.poll() is None


def _closed_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return int(port)


def test_unreachable_peers_leave_no_peer_entries(sidecars, engines) -> None:
    sidecar = sidecars(args=["--set", "peer_call_timeout_seconds=0.3", "--set", "producer_unknown_grace_seconds=0.1"])
    consumer = engines(sidecar, "D", "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=BLOCK_LEN)
    port = _closed_port()
    count = 40
    for index in range(count):
        # Distinct loopback addresses nothing listens on (the test runs in its own network namespace).
        address = f"127.0.{index // 200}.{2 + index % 200}:{port}"
        target = {"address": address, "engine_id": "P", "request_id": f"gone-{index}", "blocks": [[1]]}
        assert consumer.command("pull", request_id=f"u-{index}", blocks=[[1]], remote=target)["ok"]
    for index in range(count):
        (event,) = consumer.wait_event(f"u-{index}", 30)
        assert event["event"] == "LOAD_FAILED", event
    with SidecarClient(sidecar.socket) as client:
        status = client.status()
    assert [peer.address for peer in status.peers] == [], "peers that never answered are remembered"
    assert status.pending_receives == 0


def _register(client: SidecarClient, engine_id: str, buffer: SharedBuffer, layout: KvLayout, tp_size: int = 1,
              export: engine_pb2.MemoryExport | None = None) -> engine_pb2.RegisterWorkerResponse:  # fmt: skip
    request = kv_registration(
        engine_id, common_pb2.ENGINE_ROLE_CONSUMER, layout, [export or buffer.export()], tp_size=tp_size
    )
    return client.register_worker(request)


def test_registrations_beyond_the_limits_are_resource_exhausted(sidecars) -> None:
    sidecar = sidecars(args=["--set", "max_engines=2", "--set", "max_workers_per_engine=2"])
    layout = KvLayout(LAYERS, 8, BLOCK_LEN)
    buffer = SharedBuffer(layout.total_bytes)
    try:
        with SidecarClient(sidecar.socket) as client:
            _register(client, "A", buffer, layout)
            _register(client, "B", buffer, layout)
            with pytest.raises(grpc.RpcError) as error:
                _register(client, "C", buffer, layout)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_engines=2" in str(error.value.details())
            client.unregister_worker("B")
            with pytest.raises(grpc.RpcError) as error:
                _register(client, "C", buffer, layout, tp_size=4)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_workers_per_engine=2" in str(error.value.details())
            _register(client, "C", buffer, layout, tp_size=2)  # room again once B left
            status = client.status()
            assert sorted(engine.engine_id for engine in status.engines) == ["A", "C"]
            client.unregister_worker("A")
            client.unregister_worker("C")
    finally:
        buffer.close()


def test_an_owner_locked_export_nobody_locked_is_refused_and_its_file_kept(sidecars) -> None:
    sidecar = sidecars()
    layout = KvLayout(LAYERS, 8, BLOCK_LEN)
    # Named with our pid, as engines name theirs: another test session's leak check then knows the
    # file for another run's and leaves it alone.
    path = Path("/dev/shm") / f"kvsidecar-{os.getpid()}-test-unlocked-{uuid.uuid4().hex[:8]}"
    path.write_bytes(b"\0" * layout.total_bytes)
    try:
        export = engine_pb2.MemoryExport(
            kind=common_pb2.MEMORY_KIND_DRAM, shm_path=str(path), length=layout.total_bytes, owner_locked=True
        )
        with SidecarClient(sidecar.socket) as client:
            with pytest.raises(grpc.RpcError) as error:
                _register(client, "U", None, layout, export=export)  # type: ignore[arg-type]
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "exports[0].owner_locked" in str(error.value.details())
            assert path.exists()
            # Locked by its owner (this test), it registers, and outlives its worker while locked.
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                _register(client, "U", None, layout, export=export)  # type: ignore[arg-type]
                client.unregister_worker("U")
                wait_until(lambda: not client.status().engines, 10, what="the worker to leave")
                assert path.exists(), "a file whose owner still holds its lock was deleted"
            finally:
                os.close(fd)
    finally:
        path.unlink(missing_ok=True)


def test_the_peer_table_is_bounded(sidecars, engines) -> None:
    d_side = sidecars("d", args=["--set", "max_peers=1"])
    consumer = engines(d_side, "D", "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=BLOCK_LEN)
    producers = []
    for name in ("p1", "p2"):
        side = sidecars(name)
        producer = engines(side, name.upper(), "producer", layers=LAYERS, blocks=P_BLOCKS, block_len=BLOCK_LEN)
        assert producer.command("submit", request_id=f"{name}-r", blocks=[[1]])["ok"]
        producers.append(producer)
    assert start_pull(consumer, producers[0], "from-p1", [1], "p1-r", [1])["ok"]
    assert consumer.wait_event("from-p1", 30)[0]["event"] == "FINISHED_RECEIVING"
    # A second peer sidecar does not fit while the first one's engine is in use.
    assert start_pull(consumer, producers[1], "from-p2", [2], "p2-r", [1])["ok"]
    (event,) = consumer.wait_event("from-p2", 30)
    assert event["event"] == "LOAD_FAILED" and "max_peers=1" in event["reason"], event
    with SidecarClient(d_side.socket) as client:
        assert [peer.address for peer in client.status().peers] == [producers[0].peer_address]
