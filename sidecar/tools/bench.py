"""``kvsidecar bench``: the same transfers through kvsidecar and through what a user would pick
instead, measured side by side in one invocation.

Paths, all moving the same source blocks into the same destination blocks of the same shared
memory:
- ``kvsidecar-push`` / ``kvsidecar-pull``: two sidecar daemons on loopback, simulated engines in
  this process; latency = producer's SubmitBlocks -> consumer's FINISHED_RECEIVING event;
- ``kvsidecar-push-same-node``: both engines on one sidecar (NIXL between two agents of one
  process, the same-node path);
- ``raw-nixl``: two NIXL agents in this process with prepared descriptor lists; between two
  agents of one process NIXL copies memory, so this is the floor of the same-node path;
- ``raw-nixl-2proc``: the same with the target agent in a second process, the floor of any
  transport between two processes (and what vLLM's in-engine connector does between P and D);
- ``memcpy``: ``numpy.copyto`` of the same bytes in this process (the machine's limit).

Then the *mixed* load: large requests back to back in two streams while 1-block requests arrive
open loop, once with NIXL posts split into chunks (``nixl.max_post_bytes``, the default) and once
with one post per transfer, each on its own pair of sidecars: p50/p99 of the small requests say
how long one waits behind another request's copy.

Each scenario runs several times; a row reports latency percentiles over every request, GB/s as
the median over runs, and the ratio to raw NIXL measured in the same invocation. Before the last
run of a scenario the destination is overwritten, and afterwards compared with the source, so a
row's ``verified`` says the bytes it claims really moved.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from engine_shim.cuda_memory import CudaBuffer
from engine_shim.memory import KvLayout, SharedBuffer
from sidecar.core.stages import stage_durations
from sidecar.tools.launcher import child_env
from sidecar.tools.workload import TransferPair

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class Scenario:
    block_bytes: int
    blocks: int
    pattern: str  # "adjacent" or "scattered"
    concurrency: int

    @property
    def name(self) -> str:
        size = f"{self.block_bytes // MIB}MiB" if self.block_bytes >= MIB else f"{self.block_bytes // KIB}KiB"
        return f"{size}x{self.blocks}-{self.pattern}-c{self.concurrency}"

    @property
    def request_bytes(self) -> int:
        return self.block_bytes * self.blocks


@dataclass
class Row:
    scenario: str
    path: str
    bytes: int
    p50_ms: float
    p99_ms: float
    gbps: float
    ratio_vs_raw_nixl: float | None
    requests: int
    runs: int
    verified: bool
    block_bytes: int
    blocks: int
    pattern: str
    concurrency: int
    extra: dict[str, Any] = field(default_factory=dict)


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def block_sets(scenario: Scenario, pool: int) -> tuple[list[int], list[int]]:
    """Source and destination blocks: one run of adjacent blocks, or blocks spread with gaps."""
    if scenario.pattern == "adjacent" or scenario.blocks == 1:
        return list(range(1, 1 + scenario.blocks)), list(range(pool - scenario.blocks, pool))
    rng = np.random.default_rng(scenario.blocks)
    source = sorted(rng.choice(pool, scenario.blocks, replace=False).tolist())
    destination = rng.permutation(rng.choice(pool, scenario.blocks, replace=False)).tolist()
    return source, destination


class RawNixl:
    """A NIXL agent in this process WRITEing the pair's source blocks into its destination blocks
    with prepared lists and a notification, progress driven by polling (no progress thread), as
    the sidecar does. The target agent lives in this process (``separate_process=False``: the
    in-process floor) or in a child process (the floor for a transfer between two processes, which
    is what an in-engine connector does between a prefill and a decode engine); ``target_wrapper``
    runs that child elsewhere (``ip netns exec NS``: on another host), polling every
    ``target_poll_s``."""

    def __init__(
        self,
        pair: TransferPair,
        separate_process: bool = False,
        target_wrapper: Sequence[str] = (),
        target_poll_s: float = 0.0001,
    ) -> None:
        from sidecar.dataplane.transport import load_nixl

        api, _ = load_nixl()
        assert pair.producer is not None and pair.consumer is not None
        layout = self.layout = pair.layout
        source_buffer = pair.producer.workers[0].buffer
        target = pair.consumer.workers[0].buffer
        if isinstance(source_buffer, CudaBuffer):
            # GPU engines: the device memory itself, registered as VRAM (the target process
            # allocates its own, as an engine would: the raw floor never goes through CUDA IPC).
            mem_type, source_base = "VRAM", int(source_buffer.tensor.data_ptr())
        else:
            mem_type, source_base = "DRAM", int(source_buffer.array.ctypes.data)
        config = api.nixl_agent_config(enable_prog_thread=False, capture_telemetry=False, backends=["UCX"])
        self.writer = api.nixl_agent(f"bench-raw-writer-{id(self)}", config)
        self.writer.register_memory([(source_base, layout.total_bytes, 0, "")], mem_type)
        self.target: Any = None
        self.child: subprocess.Popen[str] | None = None
        if separate_process:
            # The child maps the destination file itself (or allocates GPU memory); its addresses
            # are what we write to.
            where = "cuda:0" if mem_type == "VRAM" else str(cast(SharedBuffer, target).path)
            self.child = subprocess.Popen(
                [*target_wrapper, sys.executable, "-m", "sidecar.tools.bench_target", where,
                 str(layout.total_bytes), str(target_poll_s)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(),
            )  # fmt: skip
            assert self.child.stdout is not None
            address, metadata = self.child.stdout.readline().split()
            target_name = self.writer.add_remote_agent(bytes.fromhex(metadata))
            target_base = int(address)
        else:
            if mem_type == "VRAM":
                raise ValueError("the in-process raw NIXL floor is measured on DRAM only")
            self.target = api.nixl_agent(f"bench-raw-target-{id(self)}", config)
            self.target.register_memory([(target.array.ctypes.data, layout.total_bytes, 0, "")], "DRAM")
            target_name = self.writer.add_remote_agent(self.target.get_agent_metadata())
            target_base = target.array.ctypes.data
        self.target_name = target_name.decode() if isinstance(target_name, bytes) else target_name

        def descriptors(base: int) -> np.ndarray:
            rows = np.zeros((layout.num_blocks * layout.num_layers, 3), dtype=np.uint64)
            rows[:, 0] = base + np.arange(rows.shape[0], dtype=np.uint64) * np.uint64(layout.block_len)
            rows[:, 1] = layout.block_len
            return rows

        self.local = self.writer.prep_xfer_dlist("NIXL_INIT_AGENT", descriptors(source_base), mem_type)
        self.remote = self.writer.prep_xfer_dlist(self.target_name, descriptors(target_base), mem_type)

    def transfer(self, source: Sequence[int], destination: Sequence[int], count: int) -> list[float]:
        """``count`` concurrent WRITEs of the blocks; returns each one's latency."""
        # Descriptor i is block i % num_blocks of layer i // num_blocks: a block id names every layer.
        layers = np.arange(self.layout.num_layers, dtype=np.int32)[:, None] * self.layout.num_blocks
        src = (layers + np.asarray(source, dtype=np.int32)).ravel()
        dst = (layers + np.asarray(destination, dtype=np.int32)).ravel()
        started = time.perf_counter()
        handles = []
        for _ in range(count):
            handle = self.writer.make_prepped_xfer("WRITE", self.local, src, self.remote, dst, notif_msg=b"bench")
            self.writer.transfer(handle)
            handles.append(handle)
        latencies = [0.0] * count
        pending = set(range(count))
        deadline = started + 60.0
        while pending:
            if self.target is not None:
                self.target.get_new_notifs()  # the in-process target's progress (wire-up, notifications)
            for index in list(pending):
                state = self.writer.check_xfer_state(handles[index])
                if state == "DONE":
                    latencies[index] = time.perf_counter() - started
                    pending.discard(index)
                elif state != "PROC":
                    raise RuntimeError(f"raw NIXL transfer failed: {state}")
            if time.perf_counter() > deadline:
                raise TimeoutError("raw NIXL transfers did not finish within 60s")
        for handle in handles:
            handle.release()
        return latencies

    def close(self) -> None:
        self.local.release()
        self.remote.release()
        self.writer.remove_remote_agent(self.target_name)
        if self.child is not None:
            assert self.child.stdin is not None
            self.child.stdin.close()
            try:
                self.child.wait(10)
            except subprocess.TimeoutExpired:
                self.child.kill()


def layer_major(memory: Any, layout: KvLayout) -> Any:
    """``memory`` (a numpy array or a torch tensor over a buffer) as (layers, blocks, bytes)."""
    return memory[: layout.total_bytes].reshape(layout.num_layers, layout.num_blocks, layout.block_len)


def copy_blocks(source: Any, target: Any, src: Sequence[int], dst: Sequence[int]) -> None:
    """Copy blocks ``src`` of every layer of ``source`` into blocks ``dst`` of ``target`` (both
    ``layer_major``, numpy or torch alike): one slice copy where both block lists are runs."""

    def run(ids: Sequence[int]) -> bool:
        return list(ids) == list(range(ids[0], ids[0] + len(ids)))

    if run(src) and run(dst):
        target[:, dst[0] : dst[0] + len(dst)] = source[:, src[0] : src[0] + len(src)]
    else:
        target[:, list(dst)] = source[:, list(src)]


def memcpy_paths(pair: TransferPair) -> Callable[[Sequence[int], Sequence[int], int], list[float]]:
    assert pair.producer is not None and pair.consumer is not None
    source = layer_major(pair.producer.workers[0].buffer.array, pair.layout)
    target = layer_major(pair.consumer.workers[0].buffer.array, pair.layout)

    def copy(src: Sequence[int], dst: Sequence[int], count: int) -> list[float]:
        latencies = []
        started = time.perf_counter()
        for _ in range(count):
            copy_blocks(source, target, src, dst)
            latencies.append(time.perf_counter() - started)
        return latencies

    return copy


def kvsidecar_path(pair: TransferPair, mode: str) -> Callable[[Sequence[int], Sequence[int], int], list[float]]:
    transfer = pair.push if mode == "push" else pair.pull

    def run(src: Sequence[int], dst: Sequence[int], count: int) -> list[float]:
        if count == 1:
            return [transfer(src, dst)]
        with ThreadPoolExecutor(count) as executor:
            return list(executor.map(lambda _: transfer(src, dst), range(count)))

    return run


def measure(
    pair: TransferPair,
    scenario: Scenario,
    path: str,
    run: Callable[[Sequence[int], Sequence[int], int], list[float]],
    runs: int,
    run_bytes: int,
    check: bool = True,
) -> Row:
    """``check=False``: the path does not write into the pair's consumer (a raw floor into memory of
    its own); its row says so instead of claiming a verification."""
    source, destination = block_sets(scenario, pair.layout.num_blocks)
    rounds = max(1, min(64, run_bytes // (scenario.request_bytes * scenario.concurrency)))
    run(source, destination, scenario.concurrency)  # warm-up: connections, prepared lists, page faults
    latencies: list[float] = []
    rates: list[float] = []
    verified = True
    for index in range(runs):
        last = check and index == runs - 1
        if last:
            pair.poison(destination)
        started = time.perf_counter()
        for _ in range(rounds):
            latencies.extend(run(source, destination, scenario.concurrency))
        elapsed = time.perf_counter() - started
        rates.append(scenario.request_bytes * scenario.concurrency * rounds / elapsed / 1e9)
        if last:
            verified = pair.verify(source, destination)
    return Row(
        scenario=scenario.name,
        path=path,
        bytes=scenario.request_bytes,
        p50_ms=percentile(latencies, 0.5) * 1000,
        p99_ms=percentile(latencies, 0.99) * 1000,
        gbps=statistics.median(rates),
        ratio_vs_raw_nixl=None,
        requests=len(latencies),
        runs=runs,
        verified=verified and check,
        block_bytes=scenario.block_bytes,
        blocks=scenario.blocks,
        pattern=scenario.pattern,
        concurrency=scenario.concurrency,
        extra={} if check else {"verified": "not checked: the path writes into memory of its own"},
    )


def _open_loop(call: Callable[[], None], count: int, rate: float, workers: int) -> float:
    """Start ``count`` calls open loop at ``rate`` per second (each on its schedule, whether or not
    the earlier ones finished) and wait for all of them; returns the seconds from the first start."""
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as executor:
        futures = []
        for index in range(count):
            delay = started + index / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(executor.submit(call))
        for future in futures:
            future.result()
    return time.perf_counter() - started


def control_plane(pair: TransferPair, mode: str, rate: float, count: int) -> Row:
    """Open loop: 1-block requests started every 1/rate seconds, each in its own thread."""
    scenario = Scenario(pair.layout.block_len, 1, "adjacent", 1)
    source, destination = block_sets(scenario, pair.layout.num_blocks)
    transfer = pair.push if mode == "push" else pair.pull
    latencies: list[float] = []
    lock = threading.Lock()

    def one() -> None:
        latency = transfer(source, destination)
        with lock:
            latencies.append(latency)

    transfer(source, destination)  # warm-up
    pair.completed.clear()
    elapsed = _open_loop(one, count, rate, workers=64)
    extra: dict[str, Any] = {"target_rps": rate, "achieved_rps": count / elapsed}
    extra.update(control_path(pair))
    return Row(
        scenario=f"control-plane-{rate:g}rps",
        path=f"kvsidecar-{mode}",
        bytes=scenario.request_bytes,
        p50_ms=percentile(latencies, 0.5) * 1000,
        p99_ms=percentile(latencies, 0.99) * 1000,
        gbps=scenario.request_bytes * count / elapsed / 1e9,
        ratio_vs_raw_nixl=None,
        requests=count,
        runs=1,
        verified=pair.verify(source, destination),
        block_bytes=scenario.block_bytes,
        blocks=1,
        pattern="adjacent",
        concurrency=0,
        extra=extra,
    )


CONTROL_PATH = (
    "control path = the request's latency (producer's SubmitBlocks -> consumer's FINISHED_RECEIVING, "
    "as the engines saw it) minus NIXL's own transfer time for it (NIXL telemetry, from the Trace query); "
    "from the last call: the same from the engine call that let the transfer start (a pull's Pull: with vLLM "
    "the producer's SubmitBlocks is asynchronous and overlaps the router's hop; a push's SubmitBlocks)"
)


def control_path(pair: TransferPair) -> dict[str, Any]:
    """Control-path p50/p99 over the pair's completed requests, and each side's mean stage times
    (sidecar.stages over the Trace of every request still kept)."""
    controls: list[float] = []
    from_last_call: list[float] = []
    stages: dict[str, list[float]] = {}
    for request_id, latency, since_last_call in list(pair.completed):
        timelines = pair.trace(request_id)
        nixl = 0.0
        for timeline in timelines:
            if timeline.side not in ("producer", "consumer"):
                continue
            for stage, seconds in stage_durations(timeline).items():
                stages.setdefault(f"{timeline.side}/{stage}", []).append(seconds)
            nixl += sum(e.measured.get("nixl_transfer", 0.0) for e in timeline.events)
        if timelines:
            controls.append(max(0.0, latency - nixl))
            from_last_call.append(max(0.0, since_last_call - nixl))
    if not controls:
        return {}
    return {
        "control_path_definition": CONTROL_PATH,
        "control_path_requests": len(controls),
        "control_p50_ms": percentile(controls, 0.5) * 1000,
        "control_p99_ms": percentile(controls, 0.99) * 1000,
        "control_from_last_call_p50_ms": percentile(from_last_call, 0.5) * 1000,
        "control_from_last_call_p99_ms": percentile(from_last_call, 0.99) * 1000,
        "stages_mean_ms": {name: statistics.fmean(values) * 1000 for name, values in sorted(stages.items())},
    }


def mixed_load(pair: TransferPair, mode: str, label: str, large_blocks: int, small_count: int) -> Row:
    """Two streams of ``large_blocks``-block requests back to back while ``small_count`` 1-block
    requests start open loop at ``MIXED_SMALL_RPS``; latencies are the small requests'."""
    transfer = pair.push if mode == "push" else pair.pull
    pool = pair.layout.num_blocks
    large_src, large_dst = list(range(large_blocks)), list(range(large_blocks, 2 * large_blocks))
    small_src, small_dst = [pool - 2], [pool - 1]
    transfer(large_src, large_dst)  # warm-up: prepared lists, connections, page faults
    transfer(small_src, small_dst)
    stop = threading.Event()
    large: list[float] = []
    small: list[float] = []
    lock = threading.Lock()

    def stream() -> None:
        while not stop.is_set():
            latency = transfer(large_src, large_dst)
            with lock:
                large.append(latency)

    def one() -> None:
        latency = transfer(small_src, small_dst)
        with lock:
            small.append(latency)

    pair.poison(large_dst + small_dst)
    streams = [threading.Thread(target=stream, daemon=True) for _ in range(MIXED_STREAMS)]
    for thread in streams:
        thread.start()
    time.sleep(0.05)  # both streams are moving
    elapsed = _open_loop(one, small_count, MIXED_SMALL_RPS, workers=16)
    stop.set()
    for thread in streams:
        thread.join(pair.request_timeout)
    block = pair.layout.block_len
    return Row(
        scenario=f"mixed-{block // KIB}KiBx{large_blocks}+1-{label}",
        path=f"kvsidecar-{mode}",
        bytes=block,
        p50_ms=percentile(small, 0.5) * 1000,
        p99_ms=percentile(small, 0.99) * 1000,
        gbps=pair.request_bytes(large_blocks) * len(large) / elapsed / 1e9,
        ratio_vs_raw_nixl=None,
        requests=len(small),
        runs=1,
        verified=pair.verify(large_src, large_dst) and pair.verify(small_src, small_dst),
        block_bytes=block,
        blocks=1,
        pattern="adjacent",
        concurrency=MIXED_STREAMS,
        extra={
            "large_bytes": pair.request_bytes(large_blocks),
            "large_requests": len(large),
            "large_p50_ms": percentile(large, 0.5) * 1000 if large else None,
            "small_rps": small_count / elapsed,
            "split": label,
        },
    )


MIXED_STREAMS = 2
MIXED_SMALL_RPS = 50.0
# (label, sidecar settings) of the mixed load: the default split posts, and one post per transfer.
MIXED_VARIANTS = (("split", ()), ("one-post", ("--set", "nixl.max_post_bytes=0")))
SECTIONS = ("transfers", "control", "mixed")


def run_mixed(quick: bool, progress: Callable[[str], None]) -> list[Row]:
    large_blocks = 256 if quick else 1024  # 16 / 64 MiB of 64 KiB blocks
    small_count = 20 if quick else 100
    layout = KvLayout(1, 2 * large_blocks + 8, 64 * KIB)
    rows = []
    for label, args in MIXED_VARIANTS:
        with TransferPair(layout, sidecar_args=args) as pair:
            pair.fill_producer(seed=7)
            for mode in ("push", "pull"):
                progress(f"mixed load {label} {mode}")
                rows.append(mixed_load(pair, mode, label, large_blocks, small_count))
    return rows


def scenarios(quick: bool) -> dict[int, list[Scenario]]:
    sizes = [64 * KIB] if quick else [16 * KIB, 64 * KIB, MIB]
    counts = [1, 64] if quick else [1, 64, 1024]
    plan: dict[int, list[Scenario]] = {}
    for size in sizes:
        plan[size] = [
            Scenario(size, count, pattern, concurrency)
            for count in counts
            for pattern in (("adjacent",) if count == 1 else ("adjacent", "scattered"))
            for concurrency in (1, 16)
            # 16 concurrent GiB-sized requests would only measure memory pressure on this box.
            if not (size * count >= 1 << 30 and concurrency > 1)
        ]
    return plan


def selected(plan: dict[int, list[Scenario]], names: Sequence[str]) -> dict[int, list[Scenario]]:
    """The scenarios of ``plan`` named in ``names`` (all when empty), by block size."""
    if not names:
        return plan
    unknown = set(names) - {s.name for found in plan.values() for s in found}
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(sorted(unknown))}")
    return {size: [s for s in found if s.name in names] for size, found in plan.items()}


def run_bench(
    json_path: Path,
    png_path: Path | None,
    quick: bool,
    progress: Callable[[str], None],
    sections: Sequence[str] = SECTIONS,
    names: Sequence[str] = (),
) -> list[Row]:
    runs = 3 if quick else 5
    run_bytes = 16 * MIB if quick else 128 * MIB
    rows: list[Row] = []
    for block_bytes, plan in selected(scenarios(quick), names).items():
        control = block_bytes == 64 * KIB and "control" in sections
        if ("transfers" not in sections or not plan) and not control:
            continue
        max_blocks = max((s.blocks for s in plan), default=1)
        layout = KvLayout(1, max(256, 2 * max_blocks), block_bytes)
        with TransferPair(layout) as pair, TransferPair(layout, same_node=True) as local_pair:
            pair.fill_producer(seed=block_bytes)
            local_pair.fill_producer(seed=block_bytes)
            raws = [RawNixl(pair), RawNixl(pair, separate_process=True)] if "transfers" in sections else []
            paths = {
                "kvsidecar-push": (pair, kvsidecar_path(pair, "push")),
                "kvsidecar-pull": (pair, kvsidecar_path(pair, "pull")),
                "kvsidecar-push-same-node": (local_pair, kvsidecar_path(local_pair, "push")),
                **({"raw-nixl": (pair, raws[0].transfer), "raw-nixl-2proc": (pair, raws[1].transfer)} if raws else {}),
                "memcpy": (pair, memcpy_paths(pair)),
            }
            try:
                for scenario in plan if raws else []:
                    found = {}
                    for name, (owner, path) in paths.items():
                        progress(f"{scenario.name} {name}")
                        found[name] = measure(owner, scenario, name, path, runs, run_bytes)
                    floor = found["raw-nixl"].gbps
                    floor_2proc = found["raw-nixl-2proc"].gbps
                    for row in found.values():
                        row.ratio_vs_raw_nixl = row.gbps / floor if floor else None
                        row.extra["ratio_vs_raw_nixl_2proc"] = row.gbps / floor_2proc if floor_2proc else None
                    rows.extend(found.values())
                if control:
                    rates = [1.0, 100.0, 1000.0]
                    counts = [3, 50, 200] if quick else [10, 300, 2000]
                    for rate, count in zip(rates, counts, strict=True):
                        for mode in ("push", "pull"):
                            progress(f"control plane {rate:g} rps {mode}")
                            rows.append(control_plane(pair, mode, rate, count))
            finally:
                for raw in raws:
                    raw.close()
    if "mixed" in sections:
        rows.extend(run_mixed(quick, progress))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps([asdict(row) for row in rows], indent=2))
    if png_path is not None:
        plot(rows, png_path)
    return rows


def plot(rows: list[Row], png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [row for row in rows if row.ratio_vs_raw_nixl is not None]
    scenario_names = list(dict.fromkeys(row.scenario for row in data))
    paths = list(dict.fromkeys(row.path for row in data))
    width = 0.8 / max(len(paths), 1)
    figure, axis = plt.subplots(figsize=(max(8.0, 0.9 * len(scenario_names)), 5.5))
    for index, path in enumerate(paths):
        values = {row.scenario: row.gbps for row in data if row.path == path}
        positions = [i + index * width for i in range(len(scenario_names))]
        axis.bar(positions, [values.get(name, 0.0) for name in scenario_names], width, label=path)
    axis.set_xticks([i + width * (len(paths) - 1) / 2 for i in range(len(scenario_names))])
    axis.set_xticklabels(scenario_names, rotation=60, ha="right", fontsize=8)
    axis.set_ylabel("GB/s (median of runs)")
    axis.set_yscale("log")
    axis.set_title("kvsidecar vs raw NIXL vs memcpy, same transfers, one invocation")
    axis.legend()
    figure.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=110)
    plt.close(figure)


def render(rows: list[Row]) -> str:
    headers = ["scenario", "path", "bytes/req", "p50 ms", "p99 ms", "GB/s", "x raw NIXL", "x raw 2proc", "ok"]
    table = [headers]
    for row in rows:
        table.append(
            [
                row.scenario,
                row.path,
                str(row.bytes),
                f"{row.p50_ms:.3f}",
                f"{row.p99_ms:.3f}",
                f"{row.gbps:.2f}",
                f"{row.ratio_vs_raw_nixl:.2f}" if row.ratio_vs_raw_nixl is not None else "-",
                f"{row.extra['ratio_vs_raw_nixl_2proc']:.2f}" if row.extra.get("ratio_vs_raw_nixl_2proc") else "-",
                "yes" if row.verified else "-" if "verified" in row.extra else "NO",
            ]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    controls = [row for row in rows if "control_p50_ms" in row.extra]
    if controls:
        lines.append(f"\n{CONTROL_PATH}:")
        for row in controls:
            extra = row.extra
            lines.append(
                f"  {row.scenario:24s} {row.path:16s} control p50 {extra['control_p50_ms']:.3f} ms, "
                f"p99 {extra['control_p99_ms']:.3f} ms; from the last call p50 "
                f"{extra['control_from_last_call_p50_ms']:.3f} ms, p99 {extra['control_from_last_call_p99_ms']:.3f} ms "
                f"({extra['control_path_requests']} requests traced)"
            )
    return "\n".join(lines)


def main_bench(
    json_path: Path,
    png_path: Path | None,
    quick: bool,
    sections: Sequence[str] = SECTIONS,
    names: Sequence[str] = (),
) -> int:
    def progress(message: str) -> None:
        print(f"  {message}", file=sys.stderr, flush=True)

    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        print(f"kvsidecar bench: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
        return 2
    try:
        selected(scenarios(quick), names)
    except ValueError as exc:
        print(f"kvsidecar bench: {exc}")
        return 2

    started = time.monotonic()
    rows = run_bench(json_path, png_path, quick, progress, sections, names)
    print(render(rows))
    print(
        f"\n{len(rows)} rows in {time.monotonic() - started:.0f}s -> {json_path}"
        + (f", {png_path}" if png_path else "")
    )
    return 0 if all(row.verified for row in rows) else 1
