"""The NIXL owner thread's own cost per transfer, against raw NIXL on the same memory, in one
process and without gRPC: what ``kvsidecar bench --only transfers`` cannot separate from the
control path (its kvsidecar rows include two daemons' RPCs).

    python -m bench.transport_floor [--blocks 1024] [--block-kib 16] [--runs 40]

Two agents in this process over two buffers of ``--blocks`` blocks; each transfer READs all of
them, adjacent (merged by NIXL into one descriptor) or scattered (every other block, twice the
buffer). Rows: raw NIXL (make_prepped_xfer + transfer + check_xfer_state on this thread), and
``NixlTransport.transfer`` from an event loop with posts split at ``nixl.max_post_bytes``
(default 4 MiB) and unsplit (0), interleaved round by round (the order rotating). Prints p50 /
p10 ms per transfer, the ratio of the p50s to raw and the median of each round's ratio to raw
(the figure that holds on a shared, noisy machine).
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


class Raw:
    """Two raw NIXL agents in this process: make_prepped_xfer + transfer + check_xfer_state on
    the calling thread (the source agent polled too: it must progress for the wire-up)."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, block: int) -> None:
        api, _ = load_nixl()
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        self.agents = {name: api.nixl_agent(f"floor-raw-{name}", config) for name in ("src", "dst")}
        for name, array in (("src", src), ("dst", dst)):
            self.agents[name].create_backend("UCX", {})
            self.agents[name].register_memory([(array.ctypes.data, array.size, 0, "")], "DRAM")
        self.agents["dst"].add_remote_agent(self.agents["src"].get_agent_metadata())
        blocks = src.size // block
        dst_rows, src_rows = descriptors(dst.ctypes.data, blocks, block), descriptors(src.ctypes.data, blocks, block)
        self.local = self.agents["dst"].prep_xfer_dlist("NIXL_INIT_AGENT", dst_rows, "DRAM")
        self.remote = self.agents["dst"].prep_xfer_dlist("floor-raw-src", src_rows, "DRAM")

    def once(self, indices: np.ndarray) -> float:
        agent = self.agents["dst"]
        started = time.perf_counter()
        handle = agent.make_prepped_xfer("READ", self.local, indices, self.remote, indices, notif_msg=b"n")
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
            self.agents["src"].get_new_notifs()
        elapsed = time.perf_counter() - started
        handle.release()
        return elapsed


class Through:
    """``NixlTransport.transfer`` from the event loop, posts split at ``max_post_bytes``."""

    def __init__(self, label: str, max_post_bytes: int) -> None:
        self.label = label
        self.transport = NixlTransport(NixlSettings(max_post_bytes=max_post_bytes), lambda batch, seen_at: None)

    async def start(self, src: np.ndarray, dst: np.ndarray, block: int) -> None:
        self.transport.start(asyncio.get_running_loop())
        blocks = src.size // block
        self.src, self.dst = f"src-{self.label}", f"dst-{self.label}"
        self.meta = await self.transport.create_agent(self.src, [(src.ctypes.data, src.size, 0)], "DRAM")
        await self.transport.create_agent(self.dst, [(dst.ctypes.data, dst.size, 0)], "DRAM")
        self.local = DlistSpec("all", lambda: descriptors(dst.ctypes.data, blocks, block))
        self.remote = DlistSpec("all", lambda: descriptors(src.ctypes.data, blocks, block))
        self.transport.expect_notifications(1)

    async def once(self, indices: np.ndarray) -> float:
        started = time.perf_counter()
        spec = TransferSpec(
            self.dst, "READ", RemoteAgent(self.src, self.meta), self.local, indices, self.remote, indices, b"n",
            time.monotonic() + 30,
        )  # fmt: skip
        result = await self.transport.transfer(spec)
        assert result.ok, result.error
        return time.perf_counter() - started

    async def stop(self) -> None:
        self.transport.expect_notifications(-1)
        await self.transport.stop()


async def interleaved(
    src: np.ndarray, dst: np.ndarray, block: int, indices: np.ndarray, runs: int
) -> dict[str, list[float]]:
    """Every path once per round, the order rotating, so a slow moment of a shared machine hits
    each path alike (the first round, which prepares the lists, is not counted)."""
    raw = Raw(src, dst, block)
    through = [Through("4MiB", 4 << 20), Through("whole", 0)]
    for path in through:
        await path.start(src, dst, block)
    labels = ["raw NIXL", "NixlTransport, 4 MiB posts", "NixlTransport, one post"]
    times: dict[str, list[float]] = {label: [] for label in labels}

    async def once(index: int) -> float:
        return raw.once(indices) if index == 0 else await through[index - 1].once(indices)

    for round_ in range(runs + 1):
        for step in range(len(labels)):
            index = (round_ + step) % len(labels)
            elapsed = await once(index)
            if round_:
                times[labels[index]].append(elapsed)
    for path in through:
        await path.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--block-kib", type=int, default=16)
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    block = args.block_kib * 1024
    print("| pattern | path | p50 ms | p10 ms | x raw (p50) | x raw (median per round) |\n|---|---|---|---|---|---|")
    for pattern in ("adjacent", "scattered"):
        count = args.blocks * (2 if pattern == "scattered" else 1)
        src = np.random.default_rng(1).integers(0, 256, count * block, dtype=np.uint8)
        dst = np.zeros_like(src)
        step = 2 if pattern == "scattered" else 1
        indices = np.arange(0, count, step, dtype=np.int32)
        rows = asyncio.run(interleaved(src, dst, block, indices, args.runs))
        floor = statistics.median(rows["raw NIXL"])
        for label, times in rows.items():
            p50, p10 = statistics.median(times), float(np.percentile(times, 10))
            # Per round: this path's time against raw NIXL's in the same round.
            paired = statistics.median(r / t for r, t in zip(rows["raw NIXL"], times, strict=True))
            print(f"| {pattern} | {label} | {p50 * 1e3:.3f} | {p10 * 1e3:.3f} | {floor / p50:.2f} | {paired:.2f} |")


if __name__ == "__main__":
    main()
