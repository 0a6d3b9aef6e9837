"""Push staging (``sidecar.dataplane.staged_push``, ``sidecar.core.push_staging``): a producer on
another node pushes into a GPU consumer by WRITing each chunk into a slot of the consumer
sidecar's pinned pool (lent by a Stage call), and the consumer's sidecar copies the slot into its
engine, instead of the producer WRITing the consumer engine's imported GPU memory.

Whole nodes in-process, as tests/node/test_target_staging.py: two sidecars over real gRPC on loopback
(the Stage calls), the GPU is ``FakeCudaDriver`` (a fake: "device memory" is host memory), NIXL is
``FakeFabric`` (a fake that checks every address against what each agent registered). The
consumer is made "another node" by its handshake (no node-local exports), so no device copy serves
the pair. Checked: every byte arrives in the consumer's GPU, no WRITE touches its GPU memory,
FINISHED_RECEIVING only after the last copy into it, slots come back (landed, handed back, or at
the lease's end from a producer that vanished), a consumer copy that never completes holds the
blocks until it does, and an older consumer (no ``accepts_push``) is written as before.
Over real NIXL between two processes: tests/node/test_host_staging.py (case ``push-gpu``).
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar.core.consumer import ConsumerRequest
from sidecar.dataplane import target_staging
from sidecar.dataplane.contract import RunsSpec
from sidecar.dataplane.target_staging import pack_rows
from sidecar.errors import FailedPrecondition, InvalidArgument, NotFound
from tests.node.test_device_copy import D, P, Sidecar, gpu_kv, push, shm_kv, sidecar
from tests.node.test_target_staging import BIG, CHUNK, _settings
from tests.support.fake_cuda import FakeCudaDriver
from tests.support.fake_transport import FakeFabric


@pytest.fixture
def fake() -> Iterator[FakeCudaDriver]:
    with FakeCudaDriver() as driver:
        yield driver


def _another_node(side: Sidecar, older: bool = False) -> None:
    """The consumer's handshake as a sidecar on another node answers it (``older``: one that
    lends no slots for pushes, as before push staging)."""
    answer = side.node.handshakes.handle

    async def as_peer(request: peer_pb2.HandshakeRequest) -> peer_pb2.HandshakeResponse:
        response = await answer(request)
        for worker in response.engine.workers:
            del worker.node_local_exports[:]
            if older:
                worker.staging_pool.accepts_push = False
        return response

    object.__setattr__(side.node.routes, "handshake", as_peer)


def _pool(side: Sidecar) -> tuple[int, int]:
    worker = side.node.registry.worker(D, 0, 0)
    assert worker is not None and worker.staging_pool is not None
    return worker.staging_pool[0], worker.staging_pool[1]


async def _slots_back(side: Sidecar, seconds: float = 2.0) -> None:
    server = side.node.context.dataplane.staging_server
    assert server is not None
    for _ in range(int(seconds / 0.02)):
        if server.lent_slots == 0 and server.pool.free_slots == server.pool.count:
            return
        await asyncio.sleep(0.02)
    assert server.lent_slots == 0 and server.pool.free_slots == server.pool.count


@pytest.mark.parametrize("p_memory", ["gpu", "host"])
def test_a_push_into_a_gpu_consumer_on_another_node_writes_only_its_pool(
    tmp_path: Path, fake: FakeCudaDriver, p_memory: str
) -> None:
    """P on a GPU: each chunk is copied into P's pool, then WRITTEN into a slot of D's; P in host
    memory: WRITTEN from its blocks. Either way D's sidecar copies each slot into D's GPU, and the
    notification comes once the last copy is done."""

    async def scenario() -> None:
        fabric = FakeFabric()
        async with (
            AsyncExitStack() as stack,
            sidecar(tmp_path, "p", fabric, **_settings()) as p_side,
            sidecar(tmp_path, "d", fabric, **_settings()) as d_side,
        ):
            _another_node(d_side)
            p = gpu_kv(fake, P, BIG) if p_memory == "gpu" else shm_kv(stack, P, BIG)
            d = gpu_kv(fake, D, BIG)
            await p_side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await d_side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            pool_base, pool_bytes = _pool(d_side)
            gpu_start = d.allocation.pointer if d.allocation else 0
            gpu_end = gpu_start + (d.allocation.nbytes if d.allocation else 0)
            for serial in range(2):
                p.fill([2, 9, 4, 7], seed=serial)
                fabric.transfers.clear()
                launches = len(fake.batch_launches)
                await push(p_side, d_side, f"r{serial}", [2, 9, 4, 7], [1, 3, 5, 11])
                received = await d_side.event(D)
                assert received.kind == engine_pb2.FINISHED_RECEIVING, received
                sent = await p_side.event(P)
                assert sent.kind == engine_pb2.FINISHED_SENDING, sent
                assert d.blocks([1, 3, 5, 11]) == p.blocks([2, 9, 4, 7])
                writes = [t for t in fabric.transfers if isinstance(t, RunsSpec)]
                assert len(writes) == 8 and all(t.op == "WRITE" and t.remote_mem == "DRAM" for t in writes)
                for write in writes:  # every byte went into D's pool, none into D's GPU memory
                    starts, ends = write.remote_descs[:, 0], write.remote_descs[:, 0] + write.remote_descs[:, 1]
                    assert (starts >= pool_base).all() and (ends <= pool_base + pool_bytes).all()
                    assert ((ends <= gpu_start) | (starts >= gpu_end)).all()
                    assert not write.notification  # the notification follows the last copy, alone
                # D copied each chunk slot -> GPU (and P each GPU -> its own slot, on a GPU).
                assert len(fake.batch_launches) - launches == (16 if p_memory == "gpu" else 8)
            await _slots_back(d_side)
            (completion,) = p_side.completions(P, "r1")
            assert "staged_by_peer=yes path=host_staging" in completion, completion

    asyncio.run(scenario())


def test_an_older_consumer_without_push_staging_is_written_as_before(tmp_path: Path, fake: FakeCudaDriver) -> None:
    async def scenario() -> None:
        fabric = FakeFabric()
        async with (
            sidecar(tmp_path, "p", fabric, **_settings()) as p_side,
            sidecar(tmp_path, "d", fabric, **_settings()) as d_side,
        ):
            _another_node(d_side, older=True)
            p, d = gpu_kv(fake, P), gpu_kv(fake, D)
            await p_side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await d_side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            p.fill([4], seed=3)
            await push(p_side, d_side, "r", [4], [8])
            received = await d_side.event(D)
            assert received.kind == engine_pb2.FINISHED_RECEIVING, received
            assert d.blocks([8]) == p.blocks([4])
            writes = [t for t in fabric.transfers if isinstance(t, RunsSpec)]
            assert writes and all(t.remote_mem == "VRAM" for t in writes)  # today's path

    asyncio.run(scenario())


def test_a_consumer_copy_that_never_completes_holds_the_blocks_until_it_does(
    tmp_path: Path, fake: FakeCudaDriver
) -> None:
    """D's slot -> GPU copy hangs: P's landing call misses its deadline and P fails the push
    (TransferFailed), but D's LOAD_FAILED, which hands the blocks back to the engine, waits until
    the copy completes; its slot is free again after it."""

    async def scenario() -> None:
        fabric = FakeFabric()
        overrides = _settings(
            transfer_timeout_seconds=0.5, push_registration_timeout_seconds=1.0, peer_call_timeout_seconds=0.5
        )
        async with (
            AsyncExitStack() as stack,
            sidecar(tmp_path, "p", fabric, **overrides) as p_side,
            sidecar(tmp_path, "d", fabric, **overrides) as d_side,
        ):
            _another_node(d_side)
            p, d = shm_kv(stack, P, BIG), gpu_kv(fake, D, BIG)  # only D copies: only D's copy hangs
            await p_side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await d_side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            p.fill([2, 9], seed=1)
            fake.hang = True
            await push(p_side, d_side, "hung", [2, 9], [1, 3])
            await p_side.event(P, timeout=10)  # P's push ended (failed): its blocks are its own again
            (detail,) = p_side.completions(P, "hung")
            assert "did not copy chunk" in detail and "DEADLINE_EXCEEDED" in detail, detail
            worker = d_side.node.registry.worker(D, 0, 0)
            assert worker is not None
            await asyncio.sleep(2.5)  # past the deadline and D's registration watchdog: still held
            assert worker.events.empty(), worker.events.get_nowait()
            assert d_side.node.context.dataplane.late_copies.copies >= 1
            fake.release()
            failed = await d_side.event(D, timeout=10)
            assert failed.kind == engine_pb2.LOAD_FAILED, failed
            assert list(failed.failed_block_ids) == [1, 3]
            assert d_side.node.context.dataplane.late_copies.copies == 0
            server = d_side.node.context.dataplane.staging_server
            assert server is not None and server.lent_slots == 0 and server.pool.held_slots == 2
            # The late copies' slots are free again once the GPU is past them (lent again at once).
            back = await server.pool.lend(server.pool.count, asyncio.get_running_loop().time() + 2)
            assert len(back) == server.pool.count

    asyncio.run(scenario())


def test_inbound_stage_lends_only_for_an_expected_push_and_lands_only_in_its_blocks(
    tmp_path: Path, fake: FakeCudaDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer can WRITE only slots lent to the request, and the consumer's sidecar copies only
    into the request's own destination blocks; a slot a producer never lands (it crashed) comes
    back at the end of its lease."""
    monkeypatch.setattr(target_staging, "INBOUND_LEASE_MARGIN_S", 0.1)

    async def scenario() -> None:
        async with sidecar(tmp_path, "d", FakeFabric(), **_settings()) as d_side:
            d = gpu_kv(fake, D, BIG)
            await d_side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            worker = d_side.node.registry.worker(D, 0, 0)
            assert worker is not None
            region = worker.layout.regions[0]
            pending = _expected(d_side, "x-d", [[1, 3]])
            server = d_side.node.context.dataplane.staging_server
            assert server is not None

            def call(request_id: str, **more: Any) -> peer_pb2.StageRequest:
                return peer_pb2.StageRequest(
                    engine_id=D, request_id=request_id, agent_name=worker.agent_name, inbound=True,
                    timeout_seconds=0.3, **more,
                )  # fmt: skip

            def rows(block: int, length: int = CHUNK) -> bytes:
                return pack_rows(np.array([[region.base + block * region.block_stride, length, 0]], np.uint64))

            with pytest.raises(NotFound):
                await d_side.node.routes.stage(call("never-expected", lend=True))
            lent = await d_side.node.routes.stage(call("x-d", lend=True))
            assert server.lent_slots == 1
            with pytest.raises(InvalidArgument, match="request's blocks"):
                await d_side.node.routes.stage(call("x-d", rows=rows(5), landed_slot=lent.slot))
            with pytest.raises(FailedPrecondition, match="not lent"):
                await d_side.node.routes.stage(call("x-d", rows=rows(1), landed_slot=(lent.slot + 1) % 8))
            assert server.lent_slots == 1
            # The producer vanishes: the slot comes back at its lease's end.
            await asyncio.sleep(0.6)
            assert server.lent_slots == 0 and server.pool.free_slots == server.pool.count
            # A landing into the request's block copies the slot into the engine.
            lent = await d_side.node.routes.stage(call("x-d", lend=True))
            ctypes.memset(lent.address, 0x5A, CHUNK)
            await d_side.node.routes.stage(call("x-d", rows=rows(3), landed_slot=lent.slot))
            assert d.array[d.layout.block_slice(0, 3)].tobytes() == b"\x5a" * CHUNK
            assert server.lent_slots == 0 and server.pool.free_slots == server.pool.count
            assert pending.key in d_side.node.consumer.requests

    asyncio.run(scenario())


def _expected(side: Sidecar, request_id: str, blocks: list[list[int]]) -> ConsumerRequest:
    """A push this consumer expects, put in its table directly (no producer to register with)."""
    pending = ConsumerRequest(
        engine_id=D, request_id=request_id, transfer_id="t", mode=common_pb2.TRANSFER_MODE_PUSH,
        local_blocks=tuple(tuple(group) for group in blocks), remote=engine_pb2.RemoteBlocks(),
    )  # fmt: skip
    side.node.consumer.requests[pending.key] = pending
    return pending
