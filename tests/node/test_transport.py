"""The NIXL owner thread on its own: real agents in this process, real registered memory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from engine_shim.memory import SharedBuffer
from sidecar.config import NixlSettings
from sidecar.dataplane.contract import DlistSpec, RemoteAgent, RunsSpec, TransferSpec
from sidecar.dataplane.plan.descriptors import descriptor_indices, view_descriptors
from sidecar.dataplane.plan.layout import RegionLayout, Slice, WorkerLayout
from sidecar.dataplane.transport import NixlTransport, next_poll_delay

BLOCKS, BLOCK_LEN, LAYERS = 64, 16384, 2


def layout(base: int) -> WorkerLayout:
    regions = tuple(
        RegionLayout(f"l{i}", base + i * BLOCKS * BLOCK_LEN, BLOCK_LEN, BLOCK_LEN, 0) for i in range(LAYERS)
    )
    return WorkerLayout(0, 0, regions, BLOCKS, 1, 16, "LBHNC", 1, 1, False)


@contextlib.asynccontextmanager
async def agent_pair(
    transport: NixlTransport, seed: int
) -> AsyncIterator[tuple[SharedBuffer, SharedBuffer, WorkerLayout, WorkerLayout, bytes]]:
    """Agents "src" (random bytes from ``seed``) and "dst" over two shared buffers of one layout:
    (source, target, source layout, target layout, src's metadata)."""
    size = LAYERS * BLOCKS * BLOCK_LEN
    with SharedBuffer(size) as source, SharedBuffer(size) as target:
        source.array[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        src, dst = layout(source.array.ctypes.data), layout(target.array.ctypes.data)
        meta_src = await transport.create_agent("src", [(source.array.ctypes.data, size, 0)], "DRAM")
        await transport.create_agent("dst", [(target.array.ctypes.data, size, 0)], "DRAM")
        yield source, target, src, dst, meta_src


def test_reads_merge_adjacent_blocks_and_move_the_bytes() -> None:
    async def scenario() -> None:
        notes: list[tuple[str, bytes]] = []
        transport = NixlTransport(NixlSettings(), lambda batch, seen_at: notes.extend(batch))
        transport.start(asyncio.get_running_loop())
        async with agent_pair(transport, seed=1) as (source, target, src, dst, meta_src):
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


def read_twice(settings: NixlSettings, seen: list[tuple[int, int, str]]) -> bool:
    """Two READs between two agents of one transport; ``seen`` gets, for each NIXL post, the
    posting thread's scheduling policy, real-time priority and kernel name, and after each transfer
    the owner thread's policy once it is idle. Returns whether the bytes arrived. Also run by the
    subprocess of ``test_post_priority_fails_soft_when_not_permitted``."""

    async def scenario() -> bool:
        transport = NixlTransport(settings, lambda batch, seen_at: None)
        transport.start(asyncio.get_running_loop())
        async with agent_pair(transport, seed=3) as (source, target, src, dst, meta_src):
            # Observe the real post from inside it: the owner thread's state while NIXL copies.
            agent = transport._agents["dst"].agent
            post = agent.transfer

            def observed(handle: object) -> str:
                tid = threading.get_native_id()
                with open(f"/proc/self/task/{tid}/comm") as comm:
                    seen.append((os.sched_getscheduler(0), os.sched_getparam(0).sched_priority, comm.read().strip()))
                return str(post(handle))

            agent.transfer = observed
            local_list = DlistSpec("whole", lambda: view_descriptors(dst, Slice()))
            remote_list = DlistSpec("whole", lambda: view_descriptors(src, Slice()))
            for blocks in (list(range(0, 32)), list(range(32, BLOCKS))):
                ids = (tuple(blocks),)
                result = await transport.transfer(TransferSpec(
                    "dst", "READ", RemoteAgent("src", meta_src), local_list, descriptor_indices(dst, ids),
                    remote_list, descriptor_indices(src, ids), b"", time.monotonic() + 10,
                ))  # fmt: skip
                assert result.ok, result.error
                # Once idle it sleeps as a normal thread (it lowers itself before sleeping).
                deadline = time.monotonic() + 5
                while set(owner_policies()) != {os.SCHED_OTHER} and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                policies = set(owner_policies())  # with NIXL's threads the owner started (same name)
                seen.append((policies.pop() if len(policies) == 1 else -1, -1, "between posts"))
            moved = bool(np.array_equal(source.array, target.array))
            await transport.drop_agent("dst")
            await transport.drop_agent("src")
        await transport.stop()
        return moved

    return asyncio.run(scenario())


def owner_policies(name: str = "kvsidecar-nixl") -> list[int]:
    """Scheduling policies of this process's threads named ``name``: the owner thread and the
    threads NIXL started from it (they inherit its name, and must not inherit a raised priority)."""
    found = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as comm:
            if comm.read().strip() == name:
                found.append(os.sched_getscheduler(int(tid)))
    return found


def test_posts_run_at_the_real_time_priority_and_the_owner_thread_is_named() -> None:
    """On one host the copy runs inside NIXL's post; with ``nixl.post_priority`` the owner thread
    runs each post as SCHED_FIFO (next to busy-looping engines it otherwise waits for a CPU) and is
    a normal thread again between posts. Its kernel name makes it findable (top -H, /proc)."""
    if os.geteuid() != 0 and resource.getrlimit(resource.RLIMIT_RTPRIO)[0] < 3:
        pytest.skip("needs root (CAP_SYS_NICE) or RLIMIT_RTPRIO >= 3")
    seen: list[tuple[int, int, str]] = []
    assert read_twice(NixlSettings(post_priority=3), seen)
    between = (os.SCHED_OTHER, -1, "between posts")
    assert seen == [(os.SCHED_FIFO, 3, "kvsidecar-nixl"), between] * 2
    seen.clear()
    assert read_twice(NixlSettings(post_priority=0), seen)
    assert seen == [(os.SCHED_OTHER, 0, "kvsidecar-nixl"), between] * 2


def test_post_priority_fails_soft_when_not_permitted() -> None:
    """A sidecar without CAP_SYS_NICE or RLIMIT_RTPRIO (here: a subprocess as an unprivileged user
    with no capabilities) still moves the bytes at normal priority and says why, once."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to start an unprivileged process")
    script = (
        "from sidecar.logs import configure_logging; configure_logging('json');"
        "from sidecar.config import NixlSettings; from tests.node.test_transport import read_twice;"
        "seen = []; ok = read_twice(NixlSettings(post_priority=1), seen); print('RESULT', ok, seen)"
    )
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
    command += ["--bounding-set=-all", sys.executable, "-c", script]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HOME": "/"}  # NIXL reads ~/.nixl.cfg
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    expected = [(os.SCHED_OTHER, 0, "kvsidecar-nixl"), (os.SCHED_OTHER, -1, "between posts")] * 2
    assert f"RESULT True {expected}" in done.stdout, done.stdout + done.stderr
    refused = [line for line in done.stderr.splitlines() if "nixl_post_priority_not_permitted" in line]
    assert len(refused) == 1, done.stderr[-3000:]
    assert "LimitRTPRIO" in refused[0] and "nixl.post_priority" in refused[0]


def test_polling_only_for_a_peer_to_wire_up_backs_off_further_than_while_work_is_expected() -> None:
    """After a handshake the owner thread polls for 5 s so the peer can connect to our agents; with
    no transfer or notification expected it settles at 10 ms (not poll_interval_max: that kept an
    idle sidecar at 0.05-0.09 of a core for 5 s after each handshake). Right after activity, and
    whenever work is expected, the cadence is unchanged."""
    poll_max = NixlSettings().poll_interval_max_ms / 1000.0

    def settled(waits_only_for_connects: bool) -> float:
        delay = 0.00005
        for _ in range(20):
            delay = next_poll_delay(delay, 1.0, poll_max, waits_only_for_connects)
        return delay

    assert settled(waits_only_for_connects=False) == poll_max
    assert settled(waits_only_for_connects=True) == 0.01
    # Within 100 ms of activity both poll every 200 us (a peer's first transfer follows at once).
    for only_connects in (False, True):
        assert next_poll_delay(0.0002, 0.05, poll_max, only_connects) == 0.0002


def test_a_peer_agent_registered_again_gets_its_lists_prepared_anew() -> None:
    """Prepared descriptor lists are reused across transfers, keyed by the remote agent's name:
    when the peer's agent of that name comes back over other memory (new metadata), the lists
    prepared against the old one must go with it, so a READ takes the bytes from the new memory,
    never from the old addresses (which here still hold other bytes, mapped and registered)."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        peer = NixlTransport(NixlSettings(), lambda batch, seen_at: None)
        reader = NixlTransport(NixlSettings(), lambda batch, seen_at: None)
        peer.start(loop)
        reader.start(loop)
        size = LAYERS * BLOCKS * BLOCK_LEN
        with SharedBuffer(size) as old, SharedBuffer(size) as new, SharedBuffer(size) as target:
            old.array[:] = 0x11
            new.array[:] = np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8)
            dst = layout(target.array.ctypes.data)
            await reader.create_agent("reader", [(target.array.ctypes.data, size, 0)], "DRAM")
            peer.expect_notifications(1)  # the peer progresses (wire-up, notifications)
            ids = (tuple(range(BLOCKS)),)
            local_list = DlistSpec("whole", lambda: view_descriptors(dst, Slice()))

            async def read_from(buffer: SharedBuffer) -> None:
                src = layout(buffer.array.ctypes.data)
                meta = await peer.create_agent("kv", [(buffer.array.ctypes.data, size, 0)], "DRAM")
                remote_list = DlistSpec("whole", lambda: view_descriptors(src, Slice()))
                result = await reader.transfer(TransferSpec(
                    "reader", "READ", RemoteAgent("kv", meta), local_list, descriptor_indices(dst, ids),
                    remote_list, descriptor_indices(src, ids), b"", time.monotonic() + 10,
                ))  # fmt: skip
                assert result.ok, result.error

            await read_from(old)
            assert (target.array == 0x11).all()
            await peer.drop_agent("kv")  # the old memory stays mapped and keeps its bytes
            await read_from(new)
            assert np.array_equal(target.array, new.array), "the READ used the lists of the old registration"
            peer.expect_notifications(-1)
            await reader.drop_agent("reader")
            await peer.drop_agent("kv")
        await reader.stop()
        await peer.stop()

    asyncio.run(scenario())
