"""Target-side host staging (``sidecar.dataplane.target_staging``): a consumer on another node
pulls a producer's GPU KV from the producer sidecar's pinned pool, chunk by chunk, after a Stage
call each, instead of from the engine's imported GPU memory.

Whole nodes in-process: two sidecars over real gRPC on loopback (the Stage calls), the GPU is
``FakeCudaDriver`` (a fake: "device memory" is host memory) and NIXL is ``FakeFabric`` (a fake
that checks every address against what each agent registered, so a READ that strayed outside the
producer's pool would fail). The peer is made "another node" by its handshake's node id (as in
tests/node/test_device_copy.py), so no device copy serves the pair. Checked: every byte arrives, every
READ comes from the producer's pool, the pipeline cycles through its slots, slots come back
(handed back, or at their lease's end from a consumer that never does), a stuck staging copy
fails the pull within its deadline and keeps its slot until the GPU is past it, and an older
producer (no pool advertised) is read as before.
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

from engine_shim.client import SidecarClient
from engine_shim.memory import KvLayout
from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar.config import HostStagingSettings
from sidecar.dataplane.contract import RunsSpec
from sidecar.dataplane.host_staging import PinnedPool
from sidecar.dataplane.target_staging import StagingServer, _check_rows, merged_ranges, pack_rows, unpack_rows
from sidecar.errors import DeadlineExceeded, InvalidArgument, NotFound
from tests.node.test_device_copy import D, P, Sidecar, gpu_kv, pull, shm_kv, sidecar
from tests.support.fake_cuda import FakeCudaDriver
from tests.support.fake_transport import FakeFabric

CHUNK = 64 << 10
STAGING = HostStagingSettings(pool_bytes=1 << 20, chunk_bytes=CHUNK, slots=2)
# 4 blocks x 2 layers x 64 KiB = 8 chunks: more than either side's slots in flight.
BIG = KvLayout(num_layers=2, num_blocks=16, block_len=CHUNK)


@pytest.fixture
def fake() -> Iterator[FakeCudaDriver]:
    with FakeCudaDriver() as driver:
        yield driver


# --- the pure parts -----------------------------------------------------------------------------


def test_rows_travel_as_packed_triples_and_must_lie_in_the_workers_memory_and_the_slot() -> None:
    rows = np.array([[1 << 40, 4096, 0], [(1 << 40) + 8192, 100, 4096]], dtype=np.uint64)
    assert np.array_equal(unpack_rows(pack_rows(rows)), rows)
    with pytest.raises(InvalidArgument):
        unpack_rows(b"\0" * 23)
    # The request's blocks: three of 4 KiB, the first two adjacent (a row may span them), the
    # third apart; listed out of order.
    blocks = merged_ranges([((1 << 40) + 8192, 4096), (1 << 40, 4096), ((1 << 40) + 4096, 4096)])
    assert blocks.tolist() == [[1 << 40, (1 << 40) + 12288]]
    allowed = merged_ranges([(1 << 40, 8192), ((1 << 40) + 65536, 4096)])
    _check_rows(np.array([[(1 << 40) + 100, 8000, 0], [(1 << 40) + 65536, 4096, 8000]], np.uint64), allowed, 1 << 14)
    for outside in ([(1 << 40) + 4096, 8192, 0], [(1 << 40) + 60000, 100, 0], [(1 << 40) - 10, 20, 0]):
        with pytest.raises(InvalidArgument, match="request's blocks"):
            _check_rows(np.array([outside], np.uint64), allowed, 1 << 14)
    with pytest.raises(InvalidArgument, match="slot"):
        _check_rows(np.array([[1 << 40, 4096, 4096]], np.uint64), allowed, 4096)
    with pytest.raises(InvalidArgument):
        _check_rows(np.zeros((0, 3), dtype=np.uint64), allowed, 8192)


def test_a_staged_slot_holds_the_rows_and_comes_back_when_handed_back_or_at_its_lease(fake: FakeCudaDriver) -> None:
    async def scenario() -> None:
        pool = PinnedPool(4 * CHUNK, CHUNK)
        server = StagingServer(pool)
        gpu = fake.allocate(1 << 20)
        gpu.view()[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
        rows = np.array([[gpu.pointer + 1000, 3000, 0], [gpu.pointer + 50_000, 500, 3000]], dtype=np.uint64)
        staged = await server.stage(0, [(gpu.pointer, gpu.nbytes)], rows, 5.0)
        slot = ctypes.string_at(staged.address, 3500)
        assert slot == gpu.view()[1000:4000].tobytes() + gpu.view()[50_000:50_500].tobytes()
        assert server.lent_slots == 1 and pool.free_slots == 3
        server.give_back([staged.slot, staged.slot, 99])  # twice and unknown: harmless
        assert server.lent_slots == 0 and pool.free_slots == 4
        # A consumer that never hands it back: the slot returns at the end of its lease.
        await server.stage(0, [(gpu.pointer, gpu.nbytes)], rows, 0.2)
        assert pool.free_slots == 3
        await asyncio.sleep(0.4)
        assert server.lent_slots == 0 and pool.free_slots == 4

    asyncio.run(scenario())


def test_a_staging_copy_that_does_not_complete_fails_at_the_deadline_and_keeps_its_slot(fake: FakeCudaDriver) -> None:
    async def scenario() -> None:
        pool = PinnedPool(2 * CHUNK, CHUNK)
        server = StagingServer(pool)
        gpu = fake.allocate(1 << 20)
        fake.hang = True
        started = asyncio.get_running_loop().time()
        with pytest.raises(DeadlineExceeded):
            await server.stage(0, [(gpu.pointer, gpu.nbytes)], np.array([[gpu.pointer, 100, 0]], np.uint64), 0.3)
        assert asyncio.get_running_loop().time() - started < 3
        assert pool.held_slots == 1 and server.lent_slots == 0  # may still be written: not lent again
        fake.release()
        await pool.lend(2, asyncio.get_running_loop().time() + 2)  # both free once the GPU is past it
        assert pool.held_slots == 0

    asyncio.run(scenario())


# --- two sidecars on two "nodes" ----------------------------------------------------------------


def _another_node(side: Sidecar, older: bool = False) -> None:
    """The producer's handshake as a sidecar on another node (or an older one) answers it."""
    answer = side.node.handshakes.handle

    async def as_peer(request: peer_pb2.HandshakeRequest) -> peer_pb2.HandshakeResponse:
        response = await answer(request)
        for worker in response.engine.workers:
            del worker.node_local_exports[:]
            if older:
                worker.ClearField("staging_pool")
        return response

    object.__setattr__(side.node.routes, "handshake", as_peer)


def _settings(**more: Any) -> dict[str, Any]:
    return {"host_staging": STAGING, "lease_seconds": 30, **more}


@pytest.mark.parametrize("d_memory", ["gpu", "host"])
def test_a_pull_from_a_gpu_producer_on_another_node_reads_every_chunk_from_its_pool(
    tmp_path: Path, fake: FakeCudaDriver, d_memory: str
) -> None:
    """D on a GPU: each slot is READ into D's own pool, then copied into D's GPU; D in host
    memory: each slot is READ straight into D's blocks."""

    async def scenario() -> None:
        fabric = FakeFabric()
        async with (
            AsyncExitStack() as stack,
            sidecar(tmp_path, "p", fabric, **_settings()) as p_side,
            sidecar(tmp_path, "d", fabric, **_settings()) as d_side,
        ):
            _another_node(p_side)
            p = gpu_kv(fake, P, BIG)
            d = gpu_kv(fake, D, BIG) if d_memory == "gpu" else shm_kv(stack, D, BIG)
            await p_side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await d_side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            worker = p_side.node.registry.worker(P, 0, 0)
            assert worker is not None and worker.staging_pool is not None
            pool_base, pool_bytes, _ = worker.staging_pool
            for serial in range(2):
                p.fill([2, 9, 4, 7], seed=serial)
                fabric.transfers.clear()
                await pull(p_side, d_side, f"r{serial}", [2, 9, 4, 7], [1, 3, 5, 11])
                received = await d_side.event(D)
                assert received.kind == engine_pb2.FINISHED_RECEIVING, received
                sent = await p_side.event(P)
                assert sent.kind == engine_pb2.FINISHED_SENDING, sent
                assert d.blocks([1, 3, 5, 11]) == p.blocks([2, 9, 4, 7])
                reads = [t for t in fabric.transfers if isinstance(t, RunsSpec)]
                assert len(reads) == 8 and all(t.op == "READ" and t.remote_mem == "DRAM" for t in reads)
                for read in reads:  # every byte came out of the producer sidecar's pool
                    starts, ends = read.remote_descs[:, 0], read.remote_descs[:, 0] + read.remote_descs[:, 1]
                    assert (starts >= pool_base).all() and (ends <= pool_base + pool_bytes).all()
                assert sum(bool(t.notification) for t in reads) == 1 and reads[-1].notification
                # Into D's pool (then one copy per chunk into its GPU), or straight into its blocks.
                assert all(t.local_mem == "DRAM" for t in reads)
            server = p_side.node.context.dataplane.staging_server
            assert server is not None
            for _ in range(100):  # the last slot comes back with the consumer's closing call
                if server.lent_slots == 0:
                    break
                await asyncio.sleep(0.02)
            assert server.lent_slots == 0 and server.pool.free_slots == server.pool.count
            assert p_side.node.metrics.registry.get_sample_value("kvsidecar_staging_slots_lent") == 0
            (completion,) = d_side.completions(D, "r1-d")
            assert "staged_by_peer=yes path=host_staging" in completion, completion

    asyncio.run(scenario())


def test_a_stuck_staging_copy_fails_the_pull_within_its_deadline(tmp_path: Path, fake: FakeCudaDriver) -> None:
    async def scenario() -> None:
        fabric = FakeFabric()
        async with (
            sidecar(tmp_path, "p", fabric, **_settings()) as p_side,
            sidecar(tmp_path, "d", fabric, **_settings()) as d_side,
        ):
            _another_node(p_side)
            p, d = gpu_kv(fake, P, BIG), gpu_kv(fake, D, BIG)
            await p_side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await d_side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            fake.hang = True  # the producer's first staging copy never completes
            started = asyncio.get_running_loop().time()
            await pull(p_side, d_side, "stuck", [2, 9], [1, 3], timeout_seconds=1.0)
            failed = await d_side.event(D, timeout=10)
            assert failed.kind == engine_pb2.LOAD_FAILED, failed
            assert "did not stage" in failed.reason, failed.reason
            assert asyncio.get_running_loop().time() - started < 6
            server = p_side.node.context.dataplane.staging_server
            assert server is not None and server.pool.held_slots >= 1
            fake.release()

    asyncio.run(scenario())


def test_an_older_producer_without_a_pool_is_read_from_its_gpu_memory_as_before(
    tmp_path: Path, fake: FakeCudaDriver
) -> None:
    async def scenario() -> None:
        fabric = FakeFabric()
        async with (
            sidecar(tmp_path, "p", fabric, **_settings()) as p_side,
            sidecar(tmp_path, "d", fabric, **_settings()) as d_side,
        ):
            _another_node(p_side, older=True)
            p, d = gpu_kv(fake, P), gpu_kv(fake, D)
            await p_side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await d_side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            p.fill([4], seed=3)
            await pull(p_side, d_side, "r", [4], [8])
            received = await d_side.event(D)
            assert received.kind == engine_pb2.FINISHED_RECEIVING, received
            assert d.blocks([8]) == p.blocks([4])
            (read,) = fabric.transfers
            assert isinstance(read, RunsSpec) and read.remote_mem == "VRAM"

    asyncio.run(scenario())


def test_stage_refuses_rows_outside_the_requests_blocks_and_requests_not_held(
    tmp_path: Path, fake: FakeCudaDriver
) -> None:
    """A Stage call reads only what a READ of the held request could: its own blocks."""

    async def scenario() -> None:
        async with sidecar(tmp_path, "p", FakeFabric(), **_settings()) as p_side:
            p = gpu_kv(fake, P, BIG)
            await p_side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await p_side.node.producer.submit(SidecarClient.submit_request(P, "held", [[2, 3]]))
            worker = p_side.node.registry.worker(P, 0, 0)
            assert worker is not None
            region = worker.layout.regions[0]

            def call(request_id: str, block: int, length: int = CHUNK) -> peer_pb2.StageRequest:
                rows = np.array([[region.base + block * region.block_stride, length, 0]], np.uint64)
                return peer_pb2.StageRequest(
                    engine_id=P, request_id=request_id, agent_name=worker.agent_name, rows=pack_rows(rows),
                    timeout_seconds=5,
                )  # fmt: skip

            staged = await p_side.node.routes.stage(call("held", 2, 2 * CHUNK - CHUNK))  # its block
            assert staged.address and p_side.node.context.dataplane.staging_server is not None
            await p_side.node.routes.stage(peer_pb2.StageRequest(done_slots=[staged.slot]))
            with pytest.raises(InvalidArgument, match="request's blocks"):
                await p_side.node.routes.stage(call("held", 5))  # the worker's, not the request's
            with pytest.raises(NotFound):
                await p_side.node.routes.stage(call("never-submitted", 2))
            assert p_side.node.context.dataplane.staging_server.lent_slots == 0

    asyncio.run(scenario())
