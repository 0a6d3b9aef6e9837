"""Host staging over real NIXL between two processes, for tests and a measurement (not the daemon).

- ``target DIR``: a peer engine's KV in shared-memory files (made and filled by the caller, named
  in ``DIR/spec.json``) behind real NIXL agents, one per layout; writes each agent's metadata to
  ``DIR/<agent>.meta`` and every notification's request id to ``DIR/notes.jsonl``; ends when
  ``DIR/stop`` appears (or after two minutes).
- ``initiator DIR CASE...``: a local engine whose KV is "GPU memory" from ``FakeCudaDriver`` (a
  fake: host memory standing in for a GPU, copies run by memmove) moves requests with the data
  plane's host staging (``sidecar.dataplane.host_staging``) over a real ``NixlTransport``. Its NIXL
  agent registers no memory of its own, so every byte crosses NIXL through the pinned pool. Writes
  what happened per case to ``DIR/results.json`` (bytes compared, copy launches, trace, errors).
- target-side staging (case ``pull-gpu``): the target also holds "Pg", the bytes of "P" in its
  own ``FakeCudaDriver`` "GPU memory", behind an agent that registers NOTHING but the target's
  pinned pool (``target_staging.StagingServer``), and serves ``PeerService.Stage`` over real gRPC
  (port in ``DIR/stage.port``): every byte the initiator gets must come through both pools.
- push staging (case ``push-gpu``, after ``pull-gpu``): the initiator pushes into "Pg"; the
  target lends slots of its pool (Stage with ``inbound``) and copies each landed slot into its
  fake GPU memory, which no agent registered, so every byte must come through both pools; at the
  push's notification it writes that memory to ``DIR/push-gpu.bin`` for the initiator to compare.
- ``measure DIR``: the same bytes through host staging and through today's engine-side staging
  (the engine copies its whole KV to a host buffer, then one NIXL WRITE), median of several runs.

UCX's transports come from the environment (the caller restricts them to TCP on an interface).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from engine_shim.memory import SharedBuffer
from kvsidecar.v1 import peer_pb2, peer_pb2_grpc
from sidecar.config import HostStagingSettings, NixlSettings
from sidecar.dataplane.contract import RemoteAgent, RunsSpec, TransferResult, XferDoneCallback
from sidecar.dataplane.host_staging import HostStaging, PinnedPool
from sidecar.dataplane.plan.convert import Side, block_shape, logical_tokens
from sidecar.dataplane.plan.layout import RegionLayout, WorkerLayout
from sidecar.dataplane.plane import DataPlane
from sidecar.dataplane.target_staging import StagingServer, unpack_rows
from sidecar.dataplane.transport import NixlTransport
from sidecar.dataplane.views import EngineView, LocalWorker, TransferJob, WorkerView
from sidecar.errors import SidecarError
from tests.support.fake_cuda import FakeCudaDriver

LAYERS, BLOCKS, HEADS, CHUNK = 4, 64, 4, 64  # CHUNK: bytes per (token, head)
TOKENS = 600
# The peer's layouts: "P" like the local engine (byte for byte), "Pc" another layout and block size.
PEER_LAYOUTS = {"P": ("HND", 16), "Pc": ("NHD", 32), "Pg": ("HND", 16)}
LOCAL_LAYOUT = ("HND", 16)
STAGING = HostStagingSettings(pool_bytes=1 << 20, chunk_bytes=64 << 10, slots=3)
CASES = ("pull", "push", "pull-convert", "push-convert", "pull-hang")
# Needs the target's gRPC port on loopback (not in the namespaces test).
TARGET_CASES = ("pull-gpu", "push-gpu")
# The stuck copy of "pull-hang" (deadline 1.5 s) is released this long after the post.
HANG_RELEASE_S = 3.5


def layout(base: int, kv_layout: str, block_size: int, blocks: int = BLOCKS, device_id: int = 0) -> WorkerLayout:
    block_len = block_size * HEADS * CHUNK
    regions = tuple(
        RegionLayout(f"layer{i}", base + i * blocks * block_len, block_len, block_len, 0) for i in range(LAYERS)
    )
    return WorkerLayout(
        0, 0, regions, blocks, 1, block_size, kv_layout, HEADS, HEADS, False, device_id, CHUNK // 2, "float16"
    )


def region_size(block_size: int, blocks: int = BLOCKS) -> int:
    return LAYERS * blocks * block_size * HEADS * CHUNK


# --- target ------------------------------------------------------------------------------------


async def target(directory: Path) -> None:
    spec = json.loads((directory / "spec.json").read_text())
    notes = (directory / "notes.jsonl").open("a")
    pushed_into: list[np.ndarray] = []  # Pg's fake GPU memory

    def on_notifications(batch: list[tuple[str, bytes]], seen_at: float) -> None:
        for agent, payload in batch:
            notice = peer_pb2.TransferNotice.FromString(payload)
            if notice.request_id == "push-gpu" and pushed_into:  # what the push left in the GPU
                (directory / "push-gpu.bin").write_bytes(pushed_into[0].tobytes())
            notes.write(json.dumps({"agent": agent, "request_id": notice.request_id}) + "\n")
        notes.flush()

    transport = NixlTransport(NixlSettings(), on_notifications)
    transport.start(asyncio.get_running_loop())
    memories = {name: np.memmap(path, dtype=np.uint8, mode="r+") for name, path in spec["files"].items()}
    for name, memory in memories.items():
        meta = await transport.create_agent(name, [(int(memory.ctypes.data), memory.size, 0)], "DRAM")
        (directory / f"{name}.base").write_text(str(int(memory.ctypes.data)))  # its address there
        (directory / f"{name}.meta").write_bytes(meta)
    with FakeCudaDriver() as fake:
        server = await serve_stage(directory, transport, fake, memories["P"], pushed_into)
        transport.expect_notifications(1)
        (directory / "target.ready").touch()
        until = time.monotonic() + 120
        while not (directory / "stop").exists() and time.monotonic() < until:
            await asyncio.sleep(0.05)
        await server.stop(0)
        await transport.stop()


class _StageOnly(peer_pb2_grpc.PeerServiceServicer):
    """PeerService with only Stage, over a ``StagingServer`` for one fake-GPU worker."""

    def __init__(self, server: StagingServer, regions: list[tuple[int, int]]) -> None:
        self._server, self._regions = server, regions

    async def Stage(self, request: peer_pb2.StageRequest, context: Any) -> peer_pb2.StageResponse:
        if request.inbound:
            return await self._inbound(request, context)
        self._server.give_back(list(request.done_slots))
        if not request.rows:
            return peer_pb2.StageResponse()
        try:
            staged = await self._server.stage(0, self._regions, unpack_rows(request.rows), request.timeout_seconds)
        except SidecarError as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        return peer_pb2.StageResponse(slot=staged.slot, address=staged.address)

    async def _inbound(self, request: peer_pb2.StageRequest, context: Any) -> peer_pb2.StageResponse:
        """Push staging, as ``core.push_staging`` serves it (the request checks aside)."""
        key = (request.engine_id, request.request_id)
        self._server.give_back(list(request.done_slots), key)
        try:
            if request.rows:
                rows, timeout = unpack_rows(request.rows), request.timeout_seconds
                await self._server.land(key, 0, request.landed_slot, self._regions, rows, timeout, set())
            if not request.lend:
                return peer_pb2.StageResponse()
            lent = await self._server.lend(key, request.timeout_seconds)
        except SidecarError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return peer_pb2.StageResponse(slot=lent.slot, address=lent.address)


async def serve_stage(
    directory: Path, transport: NixlTransport, fake: FakeCudaDriver, source: np.ndarray, pushed_into: list[np.ndarray]
) -> Any:
    """The "Pg" worker: P's bytes in fake GPU memory, its agent registering only the pool."""
    gpu = fake.allocate(source.size)
    gpu.view()[:] = source
    pushed_into.append(gpu.view())
    pool = PinnedPool(STAGING.pool_bytes, STAGING.chunk_bytes)
    base = await pool.ready()
    await transport.create_agent("Pg", [], "DRAM")
    (directory / "Pg.meta").write_bytes(await transport.register_host("Pg", base, pool.nbytes))
    (directory / "Pg.base").write_text(str(gpu.pointer))
    (directory / "Pg.pool").write_text(json.dumps([base, pool.nbytes, pool.chunk_bytes]))
    server = grpc.aio.server()
    peer_pb2_grpc.add_PeerServiceServicer_to_server(
        _StageOnly(StagingServer(pool), [(gpu.pointer, gpu.nbytes)]), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    (directory / "stage.port").write_text(str(port))
    return server


# --- initiator ---------------------------------------------------------------------------------


class Initiator:
    def __init__(
        self, directory: Path, fake: FakeCudaDriver, transport: NixlTransport, observe: XferDoneCallback | None = None
    ) -> None:
        self.directory = directory
        self.spec = json.loads((directory / "spec.json").read_text())
        self.fake = fake
        self.transport = transport
        self.staging = HostStaging(transport, STAGING)
        self.plane = DataPlane(transport, "sidecar-d", host_staging=self.staging, on_xfer_done=observe)
        kv_layout, block_size = LOCAL_LAYOUT
        self.gpu = fake.allocate(region_size(block_size))
        self.local = layout(self.gpu.pointer, kv_layout, block_size)
        self.peers = {name: np.memmap(path, dtype=np.uint8, mode="r") for name, path in self.spec["files"].items()}
        self.peers["Pg"] = self.peers["P"]  # the target's fake GPU holds P's bytes

    def peer_layout(self, name: str, here: bool = False) -> WorkerLayout:
        """The peer's layout at its addresses in the target process (``here``: in this one)."""
        kv_layout, block_size = PEER_LAYOUTS[name]
        base = int(self.peers[name].ctypes.data) if here else int((self.directory / f"{name}.base").read_text())
        return layout(base, kv_layout, block_size)

    def view(self, name: str) -> EngineView:
        agent = RemoteAgent(name, (self.directory / f"{name}.meta").read_bytes())
        if name != "Pg":
            worker = WorkerView(self.peer_layout(name), agent, "DRAM")
            return EngineView(name, "target", "sidecar-p", 1, 1, "", "", (worker,))
        address, length, chunk = json.loads((self.directory / "Pg.pool").read_text())
        worker = WorkerView(
            self.peer_layout(name), agent, "VRAM", staging_pool=(address, length, chunk), accepts_push=True
        )
        if self.plane.stage_remote is None:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{(self.directory / 'stage.port').read_text()}")
            stub = peer_pb2_grpc.PeerServiceStub(channel)

            async def stage(address: str, request: peer_pb2.StageRequest) -> peer_pb2.StageResponse:
                response: peer_pb2.StageResponse = await stub.Stage(request, timeout=10)
                return response

            self.plane.stage_remote = stage
        return EngineView(name, "target", "sidecar-p", 1, 1, "", "", (worker,))

    async def run(self, case: str) -> dict[str, Any]:
        op = "READ" if case.startswith("pull") else "WRITE"
        peer = "Pc" if "convert" in case else ("Pg" if "gpu" in case else "P")
        peer_layout = self.peer_layout(peer)
        p_blocks = list(range(3, 3 + -(-TOKENS // peer_layout.block_size)))
        d_blocks = list(reversed(range(BLOCKS - -(-TOKENS // self.local.block_size), BLOCKS)))
        if op == "WRITE":  # the local engine holds the request: random bytes in its blocks
            self.gpu.view()[:] = np.random.default_rng(len(case)).integers(0, 256, self.gpu.nbytes, dtype=np.uint8)
        else:
            self.gpu.view()[:] = 0
        if case.endswith("hang"):
            self.fake.hang = True
        steps: list[dict[str, Any]] = []
        launches_before = len(self.fake.batch_launches)
        job = TransferJob(
            op=op, initiator=[LocalWorker(self.local, "D", "VRAM")], initiator_tp=1, target=self.view(peer),
            initiator_blocks=(tuple(d_blocks),), target_blocks=(tuple(p_blocks),), target_request_id=case,
            transfer_id=case, timeout=1.5 if case.endswith("hang") else 20.0, num_tokens=TOKENS,
            on_step=lambda kind, detail, measured=None: steps.append(
                {"kind": kind, "detail": detail, "measured": measured or {}}
            ),
        )  # fmt: skip
        started = time.monotonic()
        held_during: list[int] = []
        if case.endswith("hang"):
            # Past the deadline the stuck copy is held (the engine's blocks with it); then the
            # device gets going again and the copy lands late, in blocks the engine does not have.
            loop = asyncio.get_running_loop()
            loop.call_later(HANG_RELEASE_S - 0.5, lambda: held_during.append(self.plane.late_copies.copies))
            loop.call_later(HANG_RELEASE_S, self.fake.release)
        outcome = await self.plane.run(job)
        elapsed = time.monotonic() - started
        notified = await self.notified(case, 10.0 if outcome.ok else 1.0)
        local_side = Side(self.local, d_blocks, 0)
        peer_here = self.peer_layout(peer, here=True)
        peer_memory = self.peers[peer]
        if case == "push-gpu":  # what the target's fake GPU holds after the push
            dump = self.directory / "push-gpu.bin"
            peer_memory = np.frombuffer(dump.read_bytes(), dtype=np.uint8) if dump.exists() else np.zeros(0, np.uint8)
            peer_here = layout(int(peer_memory.ctypes.data), *PEER_LAYOUTS[peer])
        peer_side = Side(peer_here, p_blocks, 0)
        equal = len(peer_memory) > 0 and all(
            np.array_equal(
                self.tokens(self.gpu.view(), self.local, index, local_side),
                self.tokens(peer_memory, peer_here, index, peer_side),
            )
            for index in range(LAYERS)
        )
        return {
            "ok": outcome.ok,
            "op": op,
            "error": outcome.error,
            "bytes": outcome.bytes,
            "elapsed_s": elapsed,
            "equal": equal,
            "notifications": notified,
            "launches": self.fake.batch_launches[launches_before:],
            "held_slots": self.staging.pool.held_slots,
            "copies_held_before_release": held_during[0] if held_during else None,
            "copies_held_after": self.plane.late_copies.copies,
            "steps": steps,
        }

    @staticmethod
    def tokens(memory: np.ndarray, worker: WorkerLayout, index: int, side: Side) -> np.ndarray:
        region = worker.regions[index]
        base = worker.regions[0].base
        part = memory[region.base - base : region.base - base + worker.num_blocks * region.block_stride]
        return logical_tokens(part, region, block_shape(worker, region), worker.num_blocks, side, 0, TOKENS)

    async def notified(self, request_id: str, wait_s: float) -> int:
        """How many notifications for ``request_id`` the target saw (waiting up to ``wait_s``)."""
        until = time.monotonic() + wait_s
        while True:
            path = self.directory / "notes.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            count = sum(json.loads(line)["request_id"] == request_id for line in lines)
            if count or time.monotonic() > until:
                await asyncio.sleep(0.2)  # a second (wrong) notification would arrive by now
                lines = path.read_text().splitlines() if path.exists() else []
                return sum(json.loads(line)["request_id"] == request_id for line in lines)
            await asyncio.sleep(0.02)


async def initiator(directory: Path, cases: list[str]) -> None:
    await wait_ready(directory)
    observed: list[list[Any]] = []  # (op, path, bytes) as the node's transfer metrics get them

    def observe(op: str, result: TransferResult, path: str = "nixl") -> None:
        observed.append([op, path, result.bytes])

    transport = NixlTransport(NixlSettings(), lambda batch, seen_at: None, observe)
    transport.start(asyncio.get_running_loop())
    results: dict[str, Any] = {}
    with FakeCudaDriver() as fake:
        await transport.create_agent("D", [], "DRAM")  # no memory of its own: only the pool moves
        initiator = Initiator(directory, fake, transport, observe)
        for case in cases:
            results[case] = await initiator.run(case)
            results[case]["observed"], observed[:] = list(observed), []
        await transport.stop()
    (directory / "results.json").write_text(json.dumps(results, indent=1))


async def wait_ready(directory: Path) -> None:
    until = time.monotonic() + 60
    while not (directory / "target.ready").exists():
        if time.monotonic() > until:
            raise TimeoutError("the target process did not start")
        await asyncio.sleep(0.05)


# --- measurement -------------------------------------------------------------------------------


async def measure(directory: Path, runs: int = 5) -> None:
    """Push (WRITE) and pull (READ) ``measure_blocks`` blocks of every layer to and from the peer
    "P": through host staging, and as today's engine-side staging does it (the engine copies the
    request to a host buffer, then one NIXL WRITE; or one READ, then the engine copies it in);
    the median seconds of ``runs`` each, after one warm-up round."""
    await wait_ready(directory)
    spec = json.loads((directory / "spec.json").read_text())
    blocks = spec["measure_blocks"]
    transport = NixlTransport(NixlSettings(), lambda batch, seen_at: None)
    transport.start(asyncio.get_running_loop())
    with FakeCudaDriver() as fake:
        settings = HostStagingSettings(pool_bytes=spec["pool_bytes"], chunk_bytes=spec["chunk_bytes"], slots=4)
        staging = HostStaging(transport, settings)
        plane = DataPlane(transport, "sidecar-d", host_staging=staging)
        kv_layout, block_size = LOCAL_LAYOUT
        gpu = fake.allocate(LAYERS * blocks * spec["block_len"])
        gpu.view()[:] = 7
        local = replace_block_len(layout(gpu.pointer, kv_layout, block_size, blocks), spec["block_len"], blocks)
        engine_host = np.ones(gpu.nbytes, dtype=np.uint8)  # the engine's host staging buffer (today)
        await transport.create_agent("D", [(int(engine_host.ctypes.data), engine_host.size, 0)], "DRAM")
        peer_base = int((directory / "P.base").read_text())
        peer_layout = replace_block_len(layout(peer_base, kv_layout, block_size, blocks), spec["block_len"], blocks)
        view = EngineView("P", "target", "sidecar-p", 1, 1, "", "", (
            WorkerView(peer_layout, RemoteAgent("P", (directory / "P.meta").read_bytes()), "DRAM"),
        ))  # fmt: skip
        ids = (tuple(range(blocks)),)
        rows = np.array([[int(engine_host.ctypes.data), engine_host.size, 0]], dtype=np.uint64)
        remote = np.array([[peer_base, engine_host.size, 0]], dtype=np.uint64)
        times: dict[str, list[float]] = {}
        for serial in range(runs + 1):  # the first round warms up (wire-up, pool allocation)
            for op in ("WRITE", "READ"):
                job = TransferJob(op, [LocalWorker(local, "D", "VRAM")], 1, view, ids, ids, f"m{serial}", "m", 60.0)
                started = time.monotonic()
                outcome = await plane.run(job)
                assert outcome.ok, outcome.error
                times.setdefault(f"host_staging_{op}", []).append(time.monotonic() - started)
                started = time.monotonic()
                if op == "WRITE":
                    np.copyto(engine_host, gpu.view())  # the engine's device -> host copy (memcpy here)
                spec = RunsSpec("D", op, view.workers[0].agent, rows, "DRAM", remote, "DRAM", b"", started + 60)
                result = await transport.transfer_runs(spec)
                assert result.ok, result.error
                if op == "READ":
                    np.copyto(gpu.view(), engine_host)  # the engine's host -> device copy
                times.setdefault(f"engine_side_{op}", []).append(time.monotonic() - started)
        await transport.stop()
    nbytes = gpu.nbytes
    report: dict[str, Any] = {"bytes": nbytes, "runs": runs}
    for name, seconds in times.items():
        median = statistics.median(seconds[1:])
        report[f"{name}_s"] = round(median, 5)
        report[f"{name}_gbps"] = round(nbytes / median / 1e9, 3)
    (directory / "measure.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


def replace_block_len(worker: WorkerLayout, block_len: int, blocks: int) -> WorkerLayout:
    base = worker.regions[0].base
    regions = tuple(
        RegionLayout(f"layer{i}", base + i * blocks * block_len, block_len, block_len, 0) for i in range(LAYERS)
    )
    return replace(worker, regions=regions)


# --- the caller's side (the test process) ------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def peer_memory(directory: Path, seed: int, measure_blocks: int = 0, block_len: int = 0) -> Iterator[dict[str, Any]]:
    """The peer engine's KV files ("P", "Pc"; random bytes), named in ``DIR/spec.json``; with
    ``measure_blocks``, "P" is sized for ``measure`` instead. Removed on exit."""
    sizes = {name: region_size(block_size) for name, (_, block_size) in PEER_LAYOUTS.items() if name != "Pg"}
    if measure_blocks:
        sizes = {"P": LAYERS * measure_blocks * block_len}
    with contextlib.ExitStack() as stack:
        buffers = {name: stack.enter_context(SharedBuffer(size)) for name, size in sizes.items()}
        rng = np.random.default_rng(seed)
        for buffer in buffers.values():
            buffer.array[:] = rng.integers(0, 256, buffer.size, dtype=np.uint8)
        spec = {
            "files": {name: str(buffer.path) for name, buffer in buffers.items()},
            "measure_blocks": measure_blocks,
            "block_len": block_len,
            "pool_bytes": 64 << 20,
            "chunk_bytes": 8 << 20,
        }
        (directory / "spec.json").write_text(json.dumps(spec))
        yield {name: buffer.array for name, buffer in buffers.items()}


def run_pair(
    directory: Path,
    role_args: Sequence[str],
    env: dict[str, str],
    target_prefix: Sequence[str] = (),
    initiator_prefix: Sequence[str] = (),
    timeout: float = 120.0,
) -> subprocess.CompletedProcess[str]:
    """Start ``target`` (with ``target_prefix``, e.g. ``ip netns exec``), run the initiator role
    (``role_args``: "initiator" CASE... or "measure") to its end, stop the target. Both inherit
    this process's environment plus ``env`` (UCX's transports)."""
    environment = {**os.environ, **env}
    command = [sys.executable, "-m", "tests.support.staging_peer"]
    target = subprocess.Popen(
        [*target_prefix, *command, "target", str(directory)], cwd=REPO, env=environment,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        done = subprocess.run(
            [*initiator_prefix, *command, role_args[0], str(directory), *role_args[1:]],
            cwd=REPO, env=environment, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    finally:
        (directory / "stop").touch()
        try:
            target.wait(timeout=20)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()
    if done.returncode != 0:
        output = target.stdout.read() if target.stdout else ""
        raise AssertionError(
            f"{role_args[0]} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}\n--- target:\n{output}"
        )
    if target.stdout:
        target.stdout.close()
    return done


def main() -> None:
    role, directory = sys.argv[1], Path(sys.argv[2])
    if role == "target":
        asyncio.run(target(directory))
    elif role == "initiator":
        asyncio.run(initiator(directory, sys.argv[3:] or list(CASES)))
    elif role == "measure":
        asyncio.run(measure(directory))
    else:
        raise SystemExit(f"unknown role {role!r}: target | initiator | measure")


def check_staged_results(results: dict) -> None:
    """What every staged case must show (tests/node/test_host_staging.py, tests/multihost)."""
    chunks = -(-results["pull"]["bytes"] // STAGING.chunk_bytes)
    assert chunks > STAGING.slots  # the pipeline cycles through its slots
    for case in ("pull", "push", "pull-convert", "push-convert"):
        result = results[case]
        assert result["ok"], (case, result["error"])
        assert result["equal"], f"{case}: the tokens at the destination differ from the source's"
        assert result["notifications"] == 1, f"{case}: the peer must get exactly one notification"
        # One batched copy launch per chunk, no per-block launches.
        assert result["launches"] == [1] * -(-result["bytes"] // STAGING.chunk_bytes), (case, result["launches"])
        (completion,) = [step for step in result["steps"] if step["kind"] == "nixl_completion"]
        assert "path=host_staging" in completion["detail"], completion
        assert completion["measured"]["copy_transfer"] > 0
        # The transfer metrics count the staged transfer once, whole (not its chunks' NIXL posts).
        assert result["observed"] == [[result["op"], "host_staging", result["bytes"]]], (case, result["observed"])
    hang = results["pull-hang"]
    assert not hang["ok"] and "did not complete within its deadline" in hang["error"], hang["error"]
    assert "GPU copy" in hang["error"] and hang["notifications"] == 0
    # The stuck copy writes the engine's blocks: past the 1.5 s deadline the failure is held until
    # the copy completes (released at HANG_RELEASE_S), then reported; its slot is free again.
    assert hang["copies_held_before_release"] >= 1, hang
    assert HANG_RELEASE_S <= hang["elapsed_s"] < HANG_RELEASE_S + 6, hang["elapsed_s"]
    assert "engine's blocks were held until then" in hang["error"], hang["error"]
    assert hang["copies_held_after"] == 0 and hang["held_slots"] == 0, hang


if __name__ == "__main__":
    main()
