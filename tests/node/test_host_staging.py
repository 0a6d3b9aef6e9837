"""Host staging (``sidecar.dataplane.host_staging``): a local engine's GPU KV moved through the
sidecar's own pinned pool, pipelined with NIXL.

The GPU is ``FakeCudaDriver`` (a fake: "device memory" is host memory, copies are memmoves), the
only stand-in; NIXL is real, between two processes over UCX restricted to TCP on loopback
(``tests/support/staging_peer.py``), and the initiator's NIXL agent registers no memory of its
own, so every byte that arrives went through the pool. Cutting into chunks and the pool's bounds
are checked alone. The same scenario between network namespaces is in tests/multihost.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest

from sidecar.config import ConfigError, HostStagingSettings, NixlSettings, load_settings
from sidecar.dataplane import cuda_ipc
from sidecar.dataplane.host_staging import HostStaging, PinnedPool
from sidecar.dataplane.plan.layout import PlanError
from sidecar.dataplane.plan.stage_chunks import cut
from sidecar.dataplane.plane import DataPlane
from tests.support.fake_cuda import FakeCudaDriver
from tests.support.fake_transport import FakeFabric
from tests.support.staging_peer import (
    CASES,
    STAGING,
    TARGET_CASES,
    check_staged_results,
    peer_memory,
    run_pair,
)

LOOPBACK_TCP = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}


# --- cutting rows into chunks (pure) -----------------------------------------------------------


def _rows(addresses: list[int], lengths: list[int], device: int = 0) -> np.ndarray:
    rows = np.empty((len(addresses), 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2] = addresses, lengths, device
    return rows


def _through_chunks(device: np.ndarray, remote: np.ndarray, chunk_bytes: int) -> tuple[bytes, bytes]:
    """Moves a remote "memory" (bytes at addresses 0..) into a device "memory" through slots the
    way the pipeline does, chunk by chunk; returns (what arrived, what a direct copy gives)."""
    memory_remote = np.random.default_rng(3).integers(0, 256, 1 << 16, dtype=np.uint8)
    direct, staged = np.zeros(1 << 16, np.uint8), np.zeros(1 << 16, np.uint8)
    for (d, n, _), (r, _, _) in zip(device.tolist(), remote.tolist(), strict=True):
        direct[d : d + n] = memory_remote[r : r + n]
    chunks = cut(device, remote, chunk_bytes)
    for chunk in range(chunks.count):
        slot = np.full(chunk_bytes, 0xEE, np.uint8)
        rows = chunks.rows(chunk)
        for (r, n, _), offset in zip(chunks.remote[rows].tolist(), chunks.offsets[rows].tolist(), strict=True):
            assert offset + n <= chunk_bytes  # every row lies inside its slot
            slot[offset : offset + n] = memory_remote[r : r + n]  # NIXL's READ into the slot
        for (d, n, _), offset in zip(chunks.device[rows].tolist(), chunks.offsets[rows].tolist(), strict=True):
            staged[d : d + n] = slot[offset : offset + n]  # the batched copy out of the slot
    return staged.tobytes(), direct.tobytes()


def test_rows_cut_at_chunk_boundaries_arrive_as_a_direct_copy_would_place_them() -> None:
    device = _rows([40000, 100, 9000, 20000], [3000, 5000, 700, 9000])
    remote = _rows([0, 5000, 3000, 12000], [3000, 5000, 700, 9000])
    for chunk_bytes in (1024, 4096, 4000, 1 << 20):
        staged, direct = _through_chunks(device, remote, chunk_bytes)
        assert staged == direct, chunk_bytes
    chunks = cut(device, remote, 4096)
    assert chunks.total == 17700 and chunks.count == 5
    assert [chunks.chunk_bytes_of(c) for c in range(5)] == [4096] * 4 + [17700 - 4 * 4096]


def test_adjacent_rows_merge_and_a_chunk_fills_its_slot_exactly() -> None:
    # 8 blocks of 1 KiB, contiguous on both sides: one run, cut only where a slot ends.
    device = _rows([(1 << 20) + i * 1024 for i in range(8)], [1024] * 8)
    remote = _rows([i * 1024 for i in range(8)], [1024] * 8)
    chunks = cut(device, remote, 3072)
    assert chunks.count == 3 and len(chunks.device) == 3
    assert chunks.device[:, 1].tolist() == [3072, 3072, 2048]
    assert chunks.offsets.tolist() == [0, 0, 0]


def test_rows_that_do_not_pair_are_refused() -> None:
    with pytest.raises(PlanError, match="differ in length"):
        cut(_rows([0], [10]), _rows([0], [11]), 4096)
    assert cut(_rows([], []), _rows([], []), 4096).count == 0


# --- the pool ----------------------------------------------------------------------------------


def test_the_pool_lends_what_it_has_waits_for_a_slot_and_gives_up_at_the_deadline() -> None:
    async def scenario() -> None:
        with FakeCudaDriver():
            pool = PinnedPool(pool_bytes=4 << 20, chunk_bytes=1 << 20)
            base = await pool.ready()
            assert base and pool.count == 4 and await pool.ready() == base  # allocated once
            first = await pool.lend(3, time.monotonic() + 1)
            second = await pool.lend(3, time.monotonic() + 1)  # only one left: it takes that one
            assert len(first) == 3 and len(second) == 1 and not set(first) & set(second)
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await pool.lend(1, time.monotonic() + 0.2)
            assert 0.15 < time.monotonic() - started < 2
            waiting = asyncio.ensure_future(pool.lend(2, time.monotonic() + 5))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            pool.give_back(second)
            assert await waiting == second

    asyncio.run(scenario())


@pytest.mark.parametrize("gpu_gets_past_it", [False, True])
def test_a_slot_held_by_a_late_copy_returns_only_once_the_gpu_is_past_it(gpu_gets_past_it: bool) -> None:
    async def scenario() -> None:
        with FakeCudaDriver() as fake:
            pool = PinnedPool(pool_bytes=1 << 20, chunk_bytes=1 << 20)
            await pool.ready()
            (slot,) = await pool.lend(1, time.monotonic() + 1)
            fake.hang = not gpu_gets_past_it
            source = np.ones(4096, dtype=np.uint8)
            cuda_ipc.batch_copy(0, [(pool.address(slot), int(source.ctypes.data), 4096)])  # the late copy
            pool.hold(slot, cuda_ipc.batch_copy(0, []))  # the marker queued behind it
            assert pool.held_slots == 1
            if gpu_gets_past_it:
                assert await pool.lend(1, time.monotonic() + 1) == [slot]
                assert pool.held_slots == 0
            else:
                with pytest.raises(TimeoutError):
                    await pool.lend(1, time.monotonic() + 0.1)
                assert pool.held_slots == 1

    asyncio.run(scenario())


# --- settings ----------------------------------------------------------------------------------


def test_settings_bound_the_pool_and_name_the_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_HOST_STAGING__MODE", "always")
    settings = load_settings({"host_staging": {"chunk_bytes": str(1 << 20)}})
    assert settings.host_staging.mode == "always" and settings.host_staging.chunk_bytes == 1 << 20
    with pytest.raises(ConfigError, match="host_staging"):
        load_settings({"host_staging": {"mode": "sometimes"}})
    with pytest.raises(ConfigError, match="exceeds pool_bytes"):
        load_settings({"host_staging": {"pool_bytes": str(1 << 20), "chunk_bytes": str(2 << 20)}})


def test_the_mode_decides_which_transfers_stage_and_always_turns_device_copies_off() -> None:
    transport = FakeFabric().transport(NixlSettings(), lambda batch, seen_at: None, lambda op, result: None)

    def plane(mode: str) -> DataPlane:
        return DataPlane(transport, "me", host_staging=HostStaging(transport, HostStagingSettings(mode=mode)))

    auto, always, off = plane("auto"), plane("always"), plane("off")
    assert auto.device_copy and not always.device_copy and off.device_copy
    for staging in (auto.host_staging, always.host_staging):
        assert staging is not None
        assert staging.applies("VRAM", "peer", "DRAM") and not staging.applies("DRAM", "peer", "DRAM")
    assert off.host_staging is not None and not off.host_staging.applies("VRAM", "peer", "DRAM")
    assert DataPlane(transport, "me").device_copy  # no host staging: as before


# --- real NIXL over TCP ------------------------------------------------------------------------


@pytest.mark.slow
def test_staged_pulls_and_pushes_over_nixl_tcp_move_every_byte_and_a_stuck_copy_fails_at_the_deadline(
    tmp_path: Path,
) -> None:
    with peer_memory(tmp_path, seed=11):
        # pull-gpu first: the target snapshots P into its fake GPU at start, and the pushes write P
        run_pair(tmp_path, ["initiator", *TARGET_CASES, *CASES], LOOPBACK_TCP, timeout=240)
    results = json.loads((tmp_path / "results.json").read_text())
    check_staged_results(results)
    # Target-side staging: the peer's KV in its (fake) GPU memory, its agent registering only its
    # pinned pool: every byte went GPU -> the peer's pool -> NIXL READ -> our pool -> our GPU.
    gpu = results["pull-gpu"]
    assert gpu["ok"] and gpu["equal"] and gpu["notifications"] == 1, gpu
    assert gpu["launches"] == [1] * -(-gpu["bytes"] // STAGING.chunk_bytes), gpu["launches"]
    assert gpu["observed"] == [["READ", "host_staging", gpu["bytes"]]], gpu["observed"]
    # Push staging: into the peer's (fake) GPU through a slot of its pool lent per chunk, the
    # peer's agent registering only that pool (no WRITE could reach its GPU memory), the peer
    # copying each slot into its GPU; the one notification only after the last copy.
    push = results["push-gpu"]
    assert push["ok"] and push["equal"] and push["notifications"] == 1, push
    assert push["launches"] == [1] * -(-push["bytes"] // STAGING.chunk_bytes), push["launches"]
    assert push["observed"] == [["WRITE", "host_staging", push["bytes"]]], push["observed"]
    (completion,) = [step for step in push["steps"] if step["kind"] == "nixl_completion"]
    assert "staged_by_peer=yes path=host_staging" in completion["detail"], completion
