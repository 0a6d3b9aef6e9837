"""``kvsidecar demo``: the product doing its job on a laptop.

Starts a producer sidecar and a consumer sidecar on loopback with embedded defaults, a simulated
engine on each (KV blocks in real shared memory, registered with real NIXL agents), and moves a
realistic mix of requests in push and in pull mode. Every destination block is overwritten before
its request and compared byte for byte with the source afterwards. Exit status 0 only if every
request arrived intact.
"""

from __future__ import annotations

import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tqdm import tqdm

from engine_shim.memory import KvLayout
from sidecar.tools.workload import TransferFailed, TransferPair

LAYERS = 4


@dataclass
class ModeResult:
    mode: str
    requests: int = 0
    bytes: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    corrupted: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.corrupted and not self.failures

    def row(self) -> list[str]:
        latencies = sorted(self.latencies) or [0.0]
        p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
        return [
            self.mode,
            str(self.requests),
            f"{self.bytes / 2**30:.2f}",
            f"{self.bytes / self.seconds / 1e9:.2f}" if self.seconds else "-",
            f"{statistics.median(latencies) * 1000:.2f}",
            f"{p99 * 1000:.2f}",
            "yes" if self.ok else f"NO ({self.corrupted} corrupted, {len(self.failures)} failed)",
        ]


class BlockPool:
    """Destination blocks handed out to requests in flight (a tiny stand-in for vLLM's allocator)."""

    def __init__(self, count: int) -> None:
        self._free = list(range(count))
        self._ready = threading.Condition()

    def take(self, count: int, rng: random.Random) -> list[int]:
        with self._ready:
            if not self._ready.wait_for(lambda: len(self._free) >= count, timeout=60):
                raise TransferFailed("no destination blocks became free within 60s")
            rng.shuffle(self._free)
            taken, self._free = self._free[:count], self._free[count:]
            return taken

    def give(self, blocks: list[int]) -> None:
        with self._ready:
            self._free.extend(blocks)
            self._ready.notify_all()


def _source_blocks(rng: random.Random, count: int, pool: int) -> list[int]:
    """Half the requests read one contiguous run, half scattered blocks (both common in vLLM)."""
    if rng.random() < 0.5:
        start = rng.randrange(0, pool - count + 1)
        return list(range(start, start + count))
    return rng.sample(range(pool), count)


def run_mode(
    pair: TransferPair, mode: str, sizes: list[int], concurrency: int, seed: int, progress: tqdm
) -> ModeResult:
    result = ModeResult(mode)
    pool = BlockPool(pair.layout.num_blocks)
    lock = threading.Lock()
    transfer = pair.push if mode == "push" else pair.pull

    def one(index: int, size: int) -> None:
        rng = random.Random(seed * 100_003 + index)
        source = _source_blocks(rng, size, pair.layout.num_blocks)
        destination = pool.take(size, rng)
        try:
            pair.poison(destination)
            latency = transfer(source, destination)
            intact = pair.verify(source, destination)
            with lock:
                result.requests += 1
                result.bytes += pair.request_bytes(size)
                result.latencies.append(latency)
                result.corrupted += 0 if intact else 1
        except TransferFailed as exc:
            with lock:
                result.failures.append(str(exc))
        finally:
            pool.give(destination)
            progress.update(1)

    started = time.perf_counter()
    executor = ThreadPoolExecutor(concurrency, thread_name_prefix=f"demo-{mode}")
    try:
        for future in [executor.submit(one, index, size) for index, size in enumerate(sizes)]:
            future.result()
    except BaseException:
        # Ctrl-C: drop what has not started; what runs ends within its bounded wait.
        executor.shutdown(wait=True, cancel_futures=True)
        raise
    executor.shutdown()
    result.seconds = time.perf_counter() - started
    return result


def render(results: list[ModeResult], block_kib: int) -> str:
    headers = ["mode", "requests", "GiB moved", "GB/s", "p50 ms", "p99 ms", "all bytes verified"]
    rows = [headers] + [r.row() for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    note = (
        f"\nblocks of {block_kib} KiB ({LAYERS} layers), latency = producer's SubmitBlocks -> consumer's "
        "finished-receiving event"
    )
    return "\n".join(lines) + note


def run_demo(
    requests: int = 200,
    modes: tuple[str, ...] = ("push", "pull"),
    min_blocks: int = 8,
    max_blocks: int = 256,
    block_kib: int = 64,
    concurrency: int = 4,
    seed: int = 0,
    same_node: bool = False,
) -> int:
    block_bytes = block_kib * 1024
    if block_bytes % LAYERS:
        raise SystemExit(f"--block-kib must give a multiple of {LAYERS} bytes")
    layout = KvLayout(LAYERS, max(1024, max_blocks * concurrency), block_bytes // LAYERS)
    rng = random.Random(seed)
    sizes = [rng.randint(min_blocks, max_blocks) for _ in range(requests)]
    topology = "one sidecar (same node)" if same_node else "two sidecars on loopback"
    print(f"kvsidecar demo: {requests} requests of {min_blocks}-{max_blocks} blocks per mode, {topology}", flush=True)
    results: list[ModeResult] = []
    with TransferPair(layout, same_node=same_node) as pair:
        pair.fill_producer(seed)
        with tqdm(total=requests * len(modes), unit="req", file=sys.stderr, dynamic_ncols=True) as progress:
            for mode in modes:
                progress.set_description(mode)
                results.append(run_mode(pair, mode, sizes, concurrency, seed, progress))
    print(render(results, block_kib))
    for result in results:
        for failure in result.failures[:5]:
            print(f"  {result.mode}: {failure}", file=sys.stderr)
    if all(result.ok for result in results):
        print("\nOK: every byte arrived intact.")
        return 0
    print("\nFAILED: some requests did not arrive intact.", file=sys.stderr)
    return 1
