"""The NIXL owner thread's own cost per transfer, against raw NIXL on the same memory, in one
process and without gRPC: what ``kvsidecar bench --only transfers`` cannot separate from the
control path (its kvsidecar rows include two daemons' RPCs).

    python -m bench.transport_floor [--blocks 1024] [--block-kib 16] [--runs 40]

Two agents in this process over two buffers of ``--blocks`` blocks; each transfer READs all of
them, adjacent (merged by NIXL into one descriptor) or scattered (every other block, twice the
buffer). Rows: raw NIXL (make_prepped_xfer + transfer + check_xfer_state on this thread), and
``NixlTransport.transfer`` from an event loop with posts split at ``nixl.max_post_bytes``
(default 4 MiB) and unsplit (0). Prints p50 / p10 ms per transfer and the ratio to raw.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

from sidecar.config import NixlSettings
from sidecar.dataplane.contract import DlistSpec, RemoteAgent, TransferSpec
from sidecar.dataplane.transport import NixlTransport, load_nixl


def descriptors(base: int, blocks: int, block: int) -> np.ndarray:
    rows = np.zeros((blocks, 3), dtype=np.uint64)
    rows[:, 0] = base + np.arange(blocks, dtype=np.uint64) * block
    rows[:, 1] = block
    return rows


def raw(src: np.ndarray, dst: np.ndarray, block: int, indices: np.ndarray, runs: int) -> list[float]:
    api, _ = load_nixl()
    config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
    agents = {name: api.nixl_agent(f"floor-raw-{name}", config) for name in ("src", "dst")}
    for name, array in (("src", src), ("dst", dst)):
        agents[name].create_backend("UCX", {})
        agents[name].register_memory([(array.ctypes.data, array.size, 0, "")], "DRAM")
    agents["dst"].add_remote_agent(agents["src"].get_agent_metadata())
    blocks = src.size // block
    local = agents["dst"].prep_xfer_dlist("NIXL_INIT_AGENT", descriptors(dst.ctypes.data, blocks, block), "DRAM")
    remote = agents["dst"].prep_xfer_dlist("floor-raw-src", descriptors(src.ctypes.data, blocks, block), "DRAM")
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        handle = agents["dst"].make_prepped_xfer("READ", local, indices, remote, indices, notif_msg=b"n")
        state = agents["dst"].transfer(handle)
        while state == "PROC":
            state = agents["dst"].check_xfer_state(handle)
            agents["src"].get_new_notifs()
        times.append(time.perf_counter() - started)
        handle.release()
    return times


async def through_transport(
    src: np.ndarray, dst: np.ndarray, block: int, indices: np.ndarray, runs: int, max_post_bytes: int
) -> list[float]:
    transport = NixlTransport(NixlSettings(max_post_bytes=max_post_bytes), lambda batch, seen_at: None)
    transport.start(asyncio.get_running_loop())
    blocks = src.size // block
    meta = await transport.create_agent("src", [(src.ctypes.data, src.size, 0)], "DRAM")
    await transport.create_agent("dst", [(dst.ctypes.data, dst.size, 0)], "DRAM")
    local = DlistSpec("all", lambda: descriptors(dst.ctypes.data, blocks, block))
    remote = DlistSpec("all", lambda: descriptors(src.ctypes.data, blocks, block))
    transport.expect_notifications(1)
    times = []
    for _ in range(runs + 1):  # the first prepares the lists
        started = time.perf_counter()
        spec = TransferSpec(
            "dst", "READ", RemoteAgent("src", meta), local, indices, remote, indices, b"n", time.monotonic() + 30
        )
        result = await transport.transfer(spec)
        assert result.ok, result.error
        times.append(time.perf_counter() - started)
    transport.expect_notifications(-1)
    await transport.stop()
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--block-kib", type=int, default=16)
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    block = args.block_kib * 1024
    print("| pattern | path | p50 ms | p10 ms | x raw (p50) |\n|---|---|---|---|---|")
    for pattern in ("adjacent", "scattered"):
        count = args.blocks * (2 if pattern == "scattered" else 1)
        src = np.random.default_rng(1).integers(0, 256, count * block, dtype=np.uint8)
        dst = np.zeros_like(src)
        step = 2 if pattern == "scattered" else 1
        indices = np.arange(0, count, step, dtype=np.int32)
        rows = {"raw NIXL": raw(src, dst, block, indices, args.runs)}
        for label, limit in (("NixlTransport, 4 MiB posts", 4 << 20), ("NixlTransport, one post", 0)):
            rows[label] = asyncio.run(through_transport(src, dst, block, indices, args.runs, limit))
        floor = statistics.median(rows["raw NIXL"])
        for label, times in rows.items():
            p50, p10 = statistics.median(times), float(np.percentile(times, 10))
            print(f"| {pattern} | {label} | {p50 * 1e3:.3f} | {p10 * 1e3:.3f} | {floor / p50:.2f} |")


if __name__ == "__main__":
    main()
