"""The NIXL owner thread on its own: real agents in this process, real registered memory."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from engine_shim.memory import SharedBuffer
from sidecar.config import NixlSettings
from sidecar.dataplane.contract import DlistSpec, RemoteAgent, RunsSpec, TransferSpec
from sidecar.dataplane.plan.descriptors import descriptor_indices, view_descriptors
from sidecar.dataplane.plan.layout import RegionLayout, Slice, WorkerLayout
from sidecar.dataplane.transport import NixlTransport

BLOCKS, BLOCK_LEN, LAYERS = 64, 16384, 2


def layout(base: int) -> WorkerLayout:
    regions = tuple(
        RegionLayout(f"l{i}", base + i * BLOCKS * BLOCK_LEN, BLOCK_LEN, BLOCK_LEN, 0) for i in range(LAYERS)
    )
    return WorkerLayout(0, 0, regions, BLOCKS, 1, 16, "LBHNC", 1, 1, False)


def test_reads_merge_adjacent_blocks_and_move_the_bytes() -> None:
    async def scenario() -> None:
        notes: list[tuple[str, bytes]] = []
        transport = NixlTransport(NixlSettings(), lambda batch, seen_at: notes.extend(batch))
        transport.start(asyncio.get_running_loop())
        size = LAYERS * BLOCKS * BLOCK_LEN
        with SharedBuffer(size) as source, SharedBuffer(size) as target:
            source.array[:] = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
            src, dst = layout(source.array.ctypes.data), layout(target.array.ctypes.data)
            meta_src = await transport.create_agent("src", [(source.array.ctypes.data, size, 0)], "DRAM")
            await transport.create_agent("dst", [(target.array.ctypes.data, size, 0)], "DRAM")
            transport.expect_notifications(1)

            local_list = DlistSpec("whole", lambda: view_descriptors(dst, Slice()))
            remote_list = DlistSpec("whole", lambda: view_descriptors(src, Slice()))

            async def read(blocks: list[int], note: bytes) -> tuple[int, int]:
                ids = (tuple(blocks),)
                result = await transport.transfer(TransferSpec(
                    "dst", "READ", RemoteAgent("src", meta_src), local_list, descriptor_indices(dst, ids),
                    remote_list, descriptor_indices(src, ids), note, time.monotonic() + 10,
                ))  # fmt: skip
                assert result.ok, result.error
                return result.bytes, result.descriptors

            moved, descriptors = await read(list(range(8, 40)), b"adjacent")
            assert moved == 32 * LAYERS * BLOCK_LEN
            assert descriptors == LAYERS, "32 adjacent blocks per layer should become one descriptor per layer"
            moved, descriptors = await read([1, 5, 9, 13], b"scattered")
            assert descriptors == 4 * LAYERS
            view_src = source.array.reshape(LAYERS, BLOCKS, BLOCK_LEN)
            view_dst = target.array.reshape(LAYERS, BLOCKS, BLOCK_LEN)
            read_blocks = [*range(8, 40), 1, 5, 9, 13]
            assert np.array_equal(view_src[:, read_blocks], view_dst[:, read_blocks])
            others = [b for b in range(BLOCKS) if b not in read_blocks]
            assert not view_dst[:, others].any()
            deadline = time.monotonic() + 5
            while len(notes) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert sorted(payload for _, payload in notes) == [b"adjacent", b"scattered"]
            assert {agent for agent, _ in notes} == {"src"}
            transport.expect_notifications(-1)
            assert transport.in_flight == 0
            await transport.drop_agent("dst")
            await transport.drop_agent("src")
        await transport.stop()

    asyncio.run(scenario())


def test_a_refused_post_is_a_failed_result_not_an_exception() -> None:
    async def scenario() -> None:
        transport = NixlTransport(NixlSettings(), lambda batch, seen_at: None)
        transport.start(asyncio.get_running_loop())
        with SharedBuffer(BLOCKS * BLOCK_LEN) as buffer:
            await transport.create_agent("a", [(buffer.array.ctypes.data, BLOCKS * BLOCK_LEN, 0)], "DRAM")
            one = WorkerLayout(0, 0, (RegionLayout("l0", buffer.array.ctypes.data, BLOCK_LEN, BLOCK_LEN, 0),),
                               BLOCKS, 1, 16, "LBHNC", 1, 1, False)  # fmt: skip
            spec = DlistSpec("whole", lambda: view_descriptors(one, Slice()))
            indices = np.array([0], dtype=np.int32)
            # Unknown remote metadata, an expired lease, and a vanished local agent.
            garbage = await transport.transfer(TransferSpec("a", "WRITE", RemoteAgent("ghost", b"not metadata"), spec,
                                               indices, spec, indices, b"", time.monotonic() + 5))  # fmt: skip
            assert not garbage.ok and "setup failed" in garbage.error
            late = await transport.transfer(TransferSpec("a", "WRITE", RemoteAgent("ghost", b"x"), spec, indices,
                                            spec, indices, b"", time.monotonic() + 5,
                                            not_after=time.monotonic() - 1))  # fmt: skip
            assert not late.ok and "lease" in late.error
            await transport.drop_agent("a")
            gone = await transport.transfer(TransferSpec("a", "WRITE", RemoteAgent("ghost", b"x"), spec, indices, spec,
                                            indices, b"", time.monotonic() + 5))  # fmt: skip
            assert not gone.ok and "gone" in gone.error
        await transport.stop()

    asyncio.run(scenario())


def test_a_large_transfer_goes_in_chunks_and_a_small_one_is_not_held_behind_it() -> None:
    """Over CMA each copy runs inside NIXL's post on the owner thread: a large transfer is posted
    in bounded chunks, round robin with other requests' posts, so a small transfer queued behind it
    completes first. The large one's bytes all arrive, and its notification only once, at the end."""
    big_blocks, big_len = 128, 256 << 10  # 32 MiB in 128 chunks of 256 KiB

    async def scenario() -> None:
        notes: list[tuple[str, bytes]] = []
        finished: list[int] = []  # bytes of each transfer, in the order the owner thread ended them
        transport = NixlTransport(
            NixlSettings(max_post_bytes=big_len),
            lambda batch, seen_at: notes.extend(batch),
            lambda op, result: finished.append(result.bytes),
        )
        transport.start(asyncio.get_running_loop())
        size = big_blocks * big_len
        with SharedBuffer(size, populate=True) as source, SharedBuffer(size, populate=True) as target:
            source.array[:] = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
            src, dst = (
                WorkerLayout(0, 0, (RegionLayout("l0", buffer.array.ctypes.data, big_len, big_len, 0),), big_blocks,
                             1, 16, "LBHNC", 1, 1, False)
                for buffer in (source, target)
            )  # fmt: skip
            meta_dst = await transport.create_agent("dst", [(target.array.ctypes.data, size, 0)], "DRAM")
            await transport.create_agent("src", [(source.array.ctypes.data, size, 0)], "DRAM")
            transport.expect_notifications(1)
            src_list = DlistSpec("whole", lambda: view_descriptors(src, Slice()))
            dst_list = DlistSpec("whole", lambda: view_descriptors(dst, Slice()))

            def write(blocks: list[int], note: bytes) -> TransferSpec:
                ids = (tuple(blocks),)
                return TransferSpec("src", "WRITE", RemoteAgent("dst", meta_dst), src_list,
                                    descriptor_indices(src, ids), dst_list, descriptor_indices(dst, ids), note,
                                    time.monotonic() + 30)  # fmt: skip

            large = asyncio.ensure_future(transport.transfer(write(list(range(1, big_blocks)), b"large")))
            await asyncio.sleep(0)  # the large transfer's post is queued first
            small = await transport.transfer(write([0], b"small"))
            assert small.ok, small.error
            result = await large
            assert result.ok, result.error
            assert result.bytes == (big_blocks - 1) * big_len
            assert finished == [big_len, (big_blocks - 1) * big_len], "the small transfer waited for the large one"
            assert np.array_equal(source.array, target.array)
            deadline = time.monotonic() + 5
            while len(notes) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert sorted(payload for _, payload in notes) == [b"large", b"small"]  # one each, none per chunk
            # Explicit descriptors (a converting plan's runs) are split the same way.
            target.array[:] = 0
            rows = view_descriptors(src, Slice()), view_descriptors(dst, Slice())
            runs = await transport.transfer_runs(RunsSpec("src", "WRITE", RemoteAgent("dst", meta_dst), rows[0], "DRAM",
                                                          rows[1], "DRAM", b"runs", time.monotonic() + 30))  # fmt: skip
            assert runs.ok and runs.bytes == size, runs
            assert np.array_equal(source.array, target.array)
            while len(notes) < 3 and time.monotonic() < deadline + 5:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert sorted(payload for _, payload in notes) == [b"large", b"runs", b"small"]
            transport.expect_notifications(-1)
            assert transport.in_flight == 0
            await transport.drop_agent("src")
            await transport.drop_agent("dst")
        await transport.stop()

    asyncio.run(scenario())
