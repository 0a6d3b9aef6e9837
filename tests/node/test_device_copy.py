"""Node-local GPU transfers by device copy (issue 33), on whole nodes built in-process.

The nodes are the production code on ``tests/support/fake_transport.py`` (NIXL's stand-in: every
transfer it is asked for is recorded) and ``tests/support/fake_cuda.py`` (the CUDA driver's: fake
device memory is host memory, an opened handle maps it at another address, launches are counted).
Two sidecars talk over real gRPC on loopback. What is checked is what users depend on: which path
moved the bytes (a device copy for VRAM on one node, NIXL otherwise), one launch per request, every
byte where it belongs across TP and layout conversions, the completion reaching both engines as a
NIXL notification would, a copy that never completes failing the load at its deadline, and a
restarted peer's memory opened afresh. The real-GPU versions are in ``tests/daemon/test_gpu.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from engine_shim.client import SidecarClient, remote
from engine_shim.memory import KvLayout, SharedBuffer, kv_registration
from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2, peer_pb2_grpc
from sidecar.api.interceptor import CallInterceptor
from sidecar.api.peer import PeerServicer
from sidecar.config import Settings
from sidecar.core.node import Node
from sidecar.core.registry import StreamClosed
from sidecar.dataplane.contract import RunsSpec
from sidecar.dataplane.device_copy import PeerWorkerMap, copy_rows, selected_descriptors
from sidecar.dataplane.plan.descriptors import descriptor_indices, view_descriptors
from sidecar.dataplane.plan.layout import PlanError, RegionLayout, Slice, WorkerLayout
from tests.support.fake_cuda import FakeAllocation, FakeCudaDriver
from tests.support.fake_transport import FakeFabric

LAYOUT = KvLayout(num_layers=2, num_blocks=16, block_len=256)
OFFSET = 4096  # the KV starts inside its allocation, as in a caching allocator's segment
P, D = "prefill-0", "decode-0"
PUSH = common_pb2.TRANSFER_MODE_PUSH


@pytest.fixture
def fake() -> Iterator[FakeCudaDriver]:
    with FakeCudaDriver() as driver:
        yield driver


@dataclass
class Kv:
    """One engine worker's KV as the engine sees it (fake GPU memory, or a shared-memory file)."""

    engine_id: str
    layout: KvLayout
    array: np.ndarray
    export: engine_pb2.MemoryExport
    allocation: FakeAllocation | None = None

    def fill(self, blocks: list[int], seed: int) -> None:
        rng = np.random.default_rng(seed)
        for layer in range(self.layout.num_layers):
            for block in blocks:
                self.array[self.layout.block_slice(layer, block)] = rng.integers(0, 256, self.layout.block_len)

    def blocks(self, blocks: list[int]) -> bytes:
        return b"".join(
            self.array[self.layout.block_slice(layer, block)].tobytes()
            for layer in range(self.layout.num_layers)
            for block in blocks
        )


@dataclass
class Sidecar:
    node: Node
    address: str
    fabric: FakeFabric

    async def register(self, engine_id: str, role: int, kv: Kv, tp_rank: int = 0, tp_size: int = 1) -> None:
        request = kv_registration(
            engine_id, role, kv.layout, [kv.export], tp_rank=tp_rank, tp_size=tp_size, engine_version="test"
        )
        await self.node.registrations.register_worker(request)

    async def event(self, engine_id: str, tp_rank: int = 0, timeout: float = 5.0) -> engine_pb2.Event:
        worker = self.node.registry.worker(engine_id, tp_rank, 0)
        assert worker is not None
        item = await asyncio.wait_for(worker.events.get(), timeout)
        assert not isinstance(item, StreamClosed), item.reason
        return item

    def completions(self, engine_id: str, request_id: str) -> list[str]:
        """The details of the request's transfer completions in this sidecar's trace."""
        timelines = self.node.context.trace.find({request_id})
        return [
            e.detail for t in timelines if t.engine_id == engine_id for e in t.events if e.kind == "nixl_completion"
        ]


def gpu_kv(fake: FakeCudaDriver, engine_id: str, layout: KvLayout = LAYOUT) -> Kv:
    allocation = fake.allocate(OFFSET + layout.total_bytes)
    export = engine_pb2.MemoryExport(
        kind=common_pb2.MEMORY_KIND_VRAM, cuda_ipc_handle=allocation.handle, offset=OFFSET,
        length=layout.total_bytes, device_id=0,
    )  # fmt: skip
    return Kv(engine_id, layout, allocation.view(OFFSET, layout.total_bytes), export, allocation)


def shm_kv(stack: AsyncExitStack, engine_id: str, layout: KvLayout = LAYOUT) -> Kv:
    buffer = SharedBuffer(layout.total_bytes)
    stack.callback(buffer.close)
    return Kv(engine_id, layout, buffer.array, buffer.export())


def _settings(tmp_path: Path, name: str, address: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "engine_socket": tmp_path / f"{name}.sock",
        "peer_listen": address,
        "metrics_listen": "off",
        "shm_dirs": [Path("/dev/shm")],
        "lease_seconds": 30,
    }
    return Settings(**(values | overrides))


@asynccontextmanager
async def sidecar(
    tmp_path: Path, name: str, fabric: FakeFabric, port: int = 0, **overrides: Any
) -> AsyncIterator[Sidecar]:
    """A node whose PeerService listens on loopback (real gRPC), as a daemon's would."""
    node = Node(_settings(tmp_path, name, "127.0.0.1:0", **overrides), transport_factory=fabric.transport)
    server = grpc.aio.server(interceptors=[CallInterceptor(node.metrics)])
    peer_pb2_grpc.add_PeerServiceServicer_to_server(PeerServicer(node.routes), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    address = f"127.0.0.1:{port}"
    await node.start(address, [])
    await server.start()
    try:
        yield Sidecar(node, address, fabric)
    finally:
        await node.stop()
        await server.stop(0)


async def pull(
    p_side: Sidecar, d_side: Sidecar, request: str, p_blocks: list[int], d_blocks: list[int], **kw: Any
) -> None:
    tokens = kw.pop("num_tokens", 0)
    await p_side.node.producer.submit(SidecarClient.submit_request(P, request, [p_blocks], num_tokens=tokens))
    source = remote(p_side.address, P, request, [p_blocks], num_tokens=tokens)
    await d_side.node.consumer.pull(SidecarClient.pull_request(D, f"{request}-d", [d_blocks], source, **kw))


async def push(p_side: Sidecar, d_side: Sidecar, request: str, p_blocks: list[int], d_blocks: list[int]) -> None:
    expect = SidecarClient.expect_push_request(D, f"{request}-d", [d_blocks], remote(p_side.address, P, request))
    await d_side.node.consumer.expect_push(expect)
    await p_side.node.producer.submit(SidecarClient.submit_request(P, request, [p_blocks], mode=PUSH))


async def finished(p_side: Sidecar, d_side: Sidecar) -> None:
    """Both engines hear of the transfer as after a NIXL transfer's notification."""
    received = await d_side.event(D)
    assert received.kind == engine_pb2.FINISHED_RECEIVING, received
    sent = await p_side.event(P)
    assert sent.kind == engine_pb2.FINISHED_SENDING, sent


# --- the pure parts -----------------------------------------------------------------------------


def _worker(base: int = 1 << 32) -> WorkerLayout:
    regions = tuple(RegionLayout(f"l{i}", base + i * 100_000, 512, 640, 0) for i in range(3))
    return WorkerLayout(0, 0, regions, 40, 2, 16, "HND", 4, 8, False, device_id=1)


@pytest.mark.parametrize("view", [Slice(0, 1), Slice(1, 2), Slice(3, 4)])
def test_the_selected_descriptors_are_the_rows_nixl_would_have_taken(view: Slice) -> None:
    worker = _worker()
    ids = descriptor_indices(worker, [[3, 0, 17, 9]])
    assert np.array_equal(selected_descriptors(worker, view, ids), view_descriptors(worker, view)[ids])


def test_copy_rows_go_from_the_source_to_the_destination_and_refuse_mismatched_plans() -> None:
    local = np.array([[100, 8, 0], [200, 16, 0]], dtype=np.uint64)
    remote = np.array([[900, 8, 0], [700, 16, 0]], dtype=np.uint64)
    assert copy_rows("READ", local, remote).tolist() == [[100, 900, 8], [200, 700, 16]]
    assert copy_rows("WRITE", local, remote).tolist() == [[900, 100, 8], [700, 200, 16]]
    with pytest.raises(PlanError, match="lengths differ"):
        copy_rows("READ", local, remote[::-1].copy())


def test_a_peers_regions_are_moved_onto_its_exports_opened_here_and_nothing_outside_them() -> None:
    worker = _worker(base=1 << 32)
    extent = 2 * 100_000 + 39 * 640 + 512
    mapping = PeerWorkerMap(device_id=0, spans=(((1 << 32) - 64, extent + 64, 7 << 40),))
    here = mapping.translate(worker)
    assert [r.base for r in here.regions] == [(7 << 40) + 64 + i * 100_000 for i in range(3)]
    assert here.device_id == 0 and here.regions[0].block_stride == 640
    short = PeerWorkerMap(device_id=0, spans=(((1 << 32), extent - 1, 7 << 40),))
    with pytest.raises(PlanError, match="outside the peer's advertised exports"):
        short.translate(worker)


# --- one sidecar --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("p_memory", "d_memory"), [("gpu", "gpu"), ("gpu", "shm"), ("shm", "gpu")])
def test_vram_on_one_sidecar_moves_by_one_device_copy_launch_per_request(
    tmp_path: Path, fake: FakeCudaDriver, mode: str, p_memory: str, d_memory: str
) -> None:
    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            side = await stack.enter_async_context(sidecar(tmp_path, "one", FakeFabric()))
            kvs = [
                gpu_kv(fake, e) if memory == "gpu" else shm_kv(stack, e) for e, memory in ((P, p_memory), (D, d_memory))
            ]
            await side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, kvs[0])
            await side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, kvs[1])
            for serial in range(2):
                kvs[0].fill([3, 4, 5], seed=serial)
                move = pull if mode == "pull" else push
                await move(side, side, f"r{serial}", [3, 4, 5], [9, 1, 12])
                await finished(side, side)
                assert kvs[1].blocks([9, 1, 12]) == kvs[0].blocks([3, 4, 5]), "the copied bytes differ"
            assert side.fabric.transfers == [], "NIXL was asked to move node-local VRAM"
            assert fake.batch_launches == [1, 1], "one launch per request"
            initiator = D if mode == "pull" else P
            (detail,) = side.completions(initiator, "r1-d" if mode == "pull" else "r1")
            assert "path=device_copy" in detail and "1 launches" in detail, detail
            # Counted in the transfer metrics as NIXL transfers are, under their path.
            sample = side.node.metrics.registry.get_sample_value
            labels = {"op": "READ" if mode == "pull" else "WRITE", "path": "device_copy"}
            assert sample("kvsidecar_transfer_bytes_total", labels) == 2 * len(kvs[0].blocks([3, 4, 5]))
            assert sample("kvsidecar_nixl_transfer_seconds_count", labels) == 2

    asyncio.run(scenario())


def test_dram_on_one_sidecar_stays_on_nixl(tmp_path: Path, fake: FakeCudaDriver) -> None:
    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            side = await stack.enter_async_context(sidecar(tmp_path, "one", FakeFabric()))
            p, d = shm_kv(stack, P), shm_kv(stack, D)
            await side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            p.fill([2, 3], seed=5)
            await pull(side, side, "r", [2, 3], [4, 5])
            await finished(side, side)
            assert d.blocks([4, 5]) == p.blocks([2, 3])
            assert [spec.op for spec in side.fabric.transfers] == ["READ"] and fake.batch_launches == []
            (detail,) = side.completions(D, "r-d")
            assert "path=nixl" in detail, detail

    asyncio.run(scenario())


def test_tp_ranks_on_one_gpu_are_one_launch_and_each_heads_bytes_land_in_place(
    tmp_path: Path, fake: FakeCudaDriver
) -> None:
    """P at TP 2 (one head each), D at TP 1 (both heads), head-major: D's block is P rank 0's
    block then P rank 1's; both P workers' READs are rows of the same single launch."""
    chunk, tokens = 32, 16
    p_layout = KvLayout(2, 16, tokens * chunk, block_size=tokens, kv_layout="HND", num_kv_heads=1, total_num_kv_heads=2)
    d_layout = KvLayout(
        2, 16, 2 * tokens * chunk, block_size=tokens, kv_layout="HND", num_kv_heads=2, total_num_kv_heads=2
    )

    async def scenario() -> None:
        async with sidecar(tmp_path, "one", FakeFabric()) as side:
            ranks = [gpu_kv(fake, P, p_layout), gpu_kv(fake, P, p_layout)]
            for rank, kv in enumerate(ranks):
                await side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, kv, tp_rank=rank, tp_size=2)
                kv.fill([2, 6], seed=rank)
            d = gpu_kv(fake, D, d_layout)
            await side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            await pull(side, side, "tp", [2, 6], [0, 3])
            assert (await side.event(D)).kind == engine_pb2.FINISHED_RECEIVING
            for rank in range(2):  # every P worker counts its notification, as NIXL's
                assert (await side.event(P, tp_rank=rank)).kind == engine_pb2.FINISHED_SENDING
            for layer in range(2):
                for p_block, d_block in ((2, 0), (6, 3)):
                    got = d.array[d_layout.block_slice(layer, d_block)]
                    want = [kv.array[p_layout.block_slice(layer, p_block)] for kv in ranks]
                    assert np.array_equal(got, np.concatenate(want)), (layer, p_block)
            assert fake.batch_launches == [1] and side.fabric.transfers == []

    asyncio.run(scenario())


def test_block_size_and_layout_conversions_copy_every_token_to_its_place(tmp_path: Path, fake: FakeCudaDriver) -> None:
    """P: 16 tokens per block, token-major; D: 32 per block, head-major. 40 tokens: three of P's
    blocks into two of D's, one device copy of per-token runs."""
    chunk, heads, count = 16, 2, 40
    p_layout = KvLayout(
        2, 16, 16 * heads * chunk, block_size=16, kv_layout="NHD", num_kv_heads=heads, total_num_kv_heads=heads
    )
    d_layout = KvLayout(
        2, 16, 32 * heads * chunk, block_size=32, kv_layout="HND", num_kv_heads=heads, total_num_kv_heads=heads
    )
    p_blocks, d_blocks = [5, 2, 9], [7, 1]

    async def scenario() -> None:
        async with sidecar(tmp_path, "one", FakeFabric()) as side:
            p, d = gpu_kv(fake, P, p_layout), gpu_kv(fake, D, d_layout)
            await side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            p.fill(p_blocks, seed=11)
            await pull(side, side, "cv", p_blocks, d_blocks, num_tokens=count)
            await finished(side, side)
            for layer in range(2):
                for token in range(count):
                    for head in range(heads):
                        p_at = (
                            p_layout.block_slice(layer, p_blocks[token // 16]).start
                            + ((token % 16) * heads + head) * chunk
                        )
                        d_at = (
                            d_layout.block_slice(layer, d_blocks[token // 32]).start + (head * 32 + token % 32) * chunk
                        )
                        assert np.array_equal(d.array[d_at : d_at + chunk], p.array[p_at : p_at + chunk]), (
                            layer,
                            token,
                            head,
                        )
            assert fake.batch_launches == [1] and side.fabric.transfers == []

    asyncio.run(scenario())


async def _no_event(side: Sidecar, engine_id: str, seconds: float) -> None:
    """The engine hears nothing for ``seconds``: its blocks are still the sidecar's."""
    worker = side.node.registry.worker(engine_id, 0, 0)
    assert worker is not None
    await asyncio.sleep(seconds)
    assert worker.events.empty(), worker.events.get_nowait()


def _held(side: Sidecar) -> tuple[int, float | None]:
    late = side.node.context.dataplane.late_copies
    return late.copies, side.node.metrics.registry.get_sample_value("kvsidecar_device_copies_held")


@pytest.mark.parametrize("sidecars", ["one", "two"])
def test_a_hung_device_copy_keeps_the_blocks_from_the_engine_until_the_copy_completes(
    tmp_path: Path, fake: FakeCudaDriver, sidecars: str
) -> None:
    """GPU memory cannot be fenced and a copy cannot be cancelled: a copy past its deadline may
    still write D's blocks, so D's LOAD_FAILED (which hands them back to vLLM for the recompute)
    waits until the copy's completion event fires; then it comes, and nothing stays held."""

    async def scenario() -> None:
        fabric = FakeFabric()
        async with AsyncExitStack() as stack:
            p_side = await stack.enter_async_context(sidecar(tmp_path, "p", fabric))
            d_side = p_side if sidecars == "one" else await stack.enter_async_context(sidecar(tmp_path, "d", fabric))
            p, d = gpu_kv(fake, P), gpu_kv(fake, D)
            await p_side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await d_side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            p.fill([1, 2], seed=1)
            fake.hang = True
            await pull(p_side, d_side, "hung", [1, 2], [3, 4], timeout_seconds=0.5)
            await _no_event(d_side, D, 1.5)  # 1 s past the deadline: held, not failed
            assert _held(d_side) == (1, 1.0) and fake.held_copies == 1
            assert d.blocks([3, 4]) != p.blocks([1, 2])  # the copy has not run
            fake.release()  # the device gets going: the late copy lands now, in blocks still held
            failed = await d_side.event(D, timeout=10)
            assert failed.kind == engine_pb2.LOAD_FAILED, failed
            assert "not complete after" in failed.reason and "held from the engine until then" in failed.reason
            assert list(failed.failed_block_ids) == [3, 4]
            assert _held(d_side) == (0, 0.0) and d_side.node.context.dataplane.late_copies.ended == 1
            (detail,) = d_side.completions(D, "hung-d")
            assert "failed" in detail and "path=device_copy" in detail, detail
            # Nothing leaks: the event was followed to its end, and the node moves the next request.
            assert fake.destroyed_events == len(fake.batch_launches) and fake.calls.count("event_abandoned") == 0
            p.fill([1, 2], seed=2)
            await pull(p_side, d_side, "after", [1, 2], [3, 4])
            received = await d_side.event(D)
            assert received.kind == engine_pb2.FINISHED_RECEIVING, received
            assert d.blocks([3, 4]) == p.blocks([1, 2])

    asyncio.run(scenario())


def test_a_hung_device_copy_of_a_push_holds_the_consumers_blocks_until_it_completes(
    tmp_path: Path, fake: FakeCudaDriver
) -> None:
    """P's sidecar copies into D's GPU memory: P's failure (TransferFailed, then D's LOAD_FAILED)
    waits for the late copy; meanwhile P answers D that a WRITE is in flight, so D holds too."""

    async def scenario() -> None:
        fabric = FakeFabric()
        overrides = {
            "transfer_timeout_seconds": 0.5,
            "push_registration_timeout_seconds": 1.0,
            "peer_call_timeout_seconds": 0.5,
            "lease_seconds": 3,
        }
        async with (
            sidecar(tmp_path, "p", fabric, **overrides) as p_side,
            sidecar(tmp_path, "d", fabric, **overrides) as d_side,
        ):
            p, d = gpu_kv(fake, P), gpu_kv(fake, D)
            await p_side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await d_side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            p.fill([1, 2], seed=1)
            fake.hang = True
            await push(p_side, d_side, "hung", [1, 2], [3, 4])
            await _no_event(d_side, D, 4.0)  # past the WRITE's deadline and D's registration watchdog
            assert _held(p_side)[0] == 1
            fake.release()
            failed = await d_side.event(D, timeout=15)
            assert failed.kind == engine_pb2.LOAD_FAILED, failed
            assert list(failed.failed_block_ids) == [3, 4]
            assert _held(p_side) == (0, 0.0)

    asyncio.run(scenario())


def test_an_engine_leaving_during_a_hung_copy_keeps_its_memory_open_until_the_copy_completes(
    tmp_path: Path, fake: FakeCudaDriver
) -> None:
    """A DMA cannot be called back: the worker's removal does not close the memory the copy
    writes into while the copy may still run; it closes it once the copy completed."""

    async def scenario() -> None:
        async with sidecar(tmp_path, "one", FakeFabric(), transfer_timeout_seconds=0.5) as side:
            p, d = gpu_kv(fake, P), gpu_kv(fake, D)
            await side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            fake.hang = True
            await pull(side, side, "gone", [1], [2], timeout_seconds=0.5)
            await asyncio.sleep(0.1)  # the copy is launched and hangs
            worker = side.node.registry.worker(D, 0, 0)
            assert worker is not None
            await side.node.registrations.remove_worker(worker, "unregistered")  # bounded
            assert "close" not in fake.calls, fake.calls
            fake.release()
            for _ in range(200):
                if "close" in fake.calls:
                    break
                await asyncio.sleep(0.025)
            assert fake.calls == ["event_done", "close"], fake.calls

    asyncio.run(scenario())


# --- two sidecars on one node -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_two_sidecars_on_one_node_copy_vram_directly_and_notify_the_peer(
    tmp_path: Path, fake: FakeCudaDriver, mode: str
) -> None:
    async def scenario() -> None:
        fabric = FakeFabric()
        async with sidecar(tmp_path, "p", fabric) as p_side, sidecar(tmp_path, "d", fabric) as d_side:
            p, d = gpu_kv(fake, P), gpu_kv(fake, D)
            await p_side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await d_side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            for serial in range(2):
                p.fill([0, 7], seed=serial)
                await (pull if mode == "pull" else push)(p_side, d_side, f"r{serial}", [0, 7], [15, 2])
                await finished(p_side, d_side)
                assert d.blocks([15, 2]) == p.blocks([0, 7])
            assert fabric.transfers == [] and fake.batch_launches == [1, 1]
            initiator = d_side if mode == "pull" else p_side
            # The initiator opened the peer engine's handle once, and keeps it for the next request.
            assert initiator.node.context.dataplane.peer_memory.open_handles == 1
            assert (
                "path=device_copy"
                in initiator.completions(D if mode == "pull" else P, "r1-d" if mode == "pull" else "r1")[0]
            )

    asyncio.run(scenario())


def _strip(response: peer_pb2.HandshakeResponse, node: str | None) -> peer_pb2.HandshakeResponse:
    for worker in response.engine.workers:
        if node is None:
            del worker.node_local_exports[:]  # a sidecar older than the field
            worker.ClearField("staging_pool")  # (and than target-side staging)
        for export in worker.node_local_exports:
            export.node_id = node or ""
    return response


@pytest.mark.parametrize("peer", ["older", "other-node"])
def test_a_peer_without_node_local_exports_or_on_another_node_is_read_over_nixl(
    tmp_path: Path, fake: FakeCudaDriver, peer: str
) -> None:
    async def scenario() -> None:
        fabric = FakeFabric()
        async with sidecar(tmp_path, "p", fabric) as p_side, sidecar(tmp_path, "d", fabric) as d_side:
            answer = p_side.node.handshakes.handle

            async def as_peer(request: peer_pb2.HandshakeRequest) -> peer_pb2.HandshakeResponse:
                return _strip(await answer(request), None if peer == "older" else "another-boot-id")

            object.__setattr__(p_side.node.routes, "handshake", as_peer)
            p, d = gpu_kv(fake, P), gpu_kv(fake, D)
            await p_side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, p)
            await d_side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            p.fill([4], seed=3)
            await pull(p_side, d_side, "r", [4], [8])
            await finished(p_side, d_side)
            assert d.blocks([8]) == p.blocks([4])
            # No device copy between the GPUs: NIXL READs into D's pinned host-staging pool (DRAM),
            # then one batched copy pool -> D's GPU (host_staging.py, the cross-node path). A
            # current peer on another node stages its side too: one copy GPU -> its pool, and the
            # READ comes from there (target_staging.py); an older one is read from its GPU memory.
            (read,) = fabric.transfers
            assert read.op == "READ" and isinstance(read, RunsSpec) and read.local_mem == "DRAM"
            assert read.remote_mem == ("VRAM" if peer == "older" else "DRAM")
            assert fake.batch_launches == ([1] if peer == "older" else [1, 1])
            assert d_side.node.context.dataplane.peer_memory.open_handles == 0

    asyncio.run(scenario())


def test_a_restarted_peers_engine_memory_is_opened_afresh_never_through_the_stale_handle(
    tmp_path: Path, fake: FakeCudaDriver
) -> None:
    async def scenario() -> None:
        fabric = FakeFabric()
        async with sidecar(tmp_path, "d", fabric) as d_side:
            d = gpu_kv(fake, D)
            await d_side.register(D, common_pb2.ENGINE_ROLE_CONSUMER, d)
            old = gpu_kv(fake, P)
            async with sidecar(tmp_path, "p", fabric) as p_side:
                port = int(p_side.address.rsplit(":", 1)[1])
                await p_side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, old)
                old.fill([1], seed=1)
                await pull(p_side, d_side, "before", [1], [2])
                await finished(p_side, d_side)
            # The peer sidecar and its engine restart: the old allocation is freed, a new one made.
            assert old.allocation is not None
            fake.free(old.allocation)
            new = gpu_kv(fake, P)
            async with sidecar(tmp_path, "p2", fabric, port=port) as p_side:
                await p_side.register(P, common_pb2.ENGINE_ROLE_PRODUCER, new)
                new.fill([1], seed=2)
                await pull(p_side, d_side, "after", [1], [5])
                await finished(p_side, d_side)
                assert d.blocks([5]) == new.blocks([1]) != old.blocks([1])
            assert fabric.transfers == [] and fake.batch_launches == [1, 1]
            # D's sidecar closed the stale handle and holds only the new engine's memory now.
            assert [a.serial for a in fake.opened_allocations()] == [d.allocation.serial, new.allocation.serial]  # type: ignore[union-attr]

    asyncio.run(scenario())
