"""Before/after of ``kvsidecar bench``'s transfer rows, robust to a shared machine: sidecar daemons
of several checkouts and raw NIXL between two processes, interleaved request batch by batch.

    cd /tmp && PYTHONPATH=<this checkout> python -m bench.ab_transfers A_DIR B_DIR \
        [--scenarios 16KiBx1024-adjacent-c1 ...] [--rounds 12] [--modes pull push] [--json OUT]

One process holds, per block size, a ``TransferPair`` (two ``kvsidecar serve`` daemons, the
simulated engines here) for each checkout (the daemons run that checkout's code: PYTHONPATH=<it>,
so run this from a directory that is no checkout) and ``RawNixl`` with its target in a second
process (the floor: what an in-engine connector does between P and D). Each round runs one batch
per path (``concurrency`` requests at once, as ``kvsidecar bench`` does), the order rotating
round by round, so a slow moment hits every path alike; a row reports GB/s (median over rounds),
p50 latency, the median over rounds of its batch's GB/s against raw NIXL's in the same round, and
CPU milliseconds per request of each daemon (``/proc``, around its batches only): latency moves by
a third between minutes on a shared 2-core box, CPU per request far less. The bytes of the last
batch of every kvsidecar path are verified.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.control_cpu import cpu_by_thread
from engine_shim.memory import KvLayout
from sidecar.tools.bench import RawNixl, Scenario, block_sets, scenarios, selected
from sidecar.tools.launcher import DaemonProcess
from sidecar.tools.workload import TransferPair

DEFAULT = (
    "16KiBx64-adjacent-c1", "16KiBx64-adjacent-c16", "64KiBx64-adjacent-c1", "64KiBx64-adjacent-c16",
    "16KiBx1024-adjacent-c1", "16KiBx1024-adjacent-c16", "1MiBx64-adjacent-c1", "1MiBx64-adjacent-c16",
)  # fmt: skip


def cpu_seconds(pids: Sequence[int]) -> list[dict[str, float]]:
    """CPU seconds of each daemon by thread name (``/proc/PID/task/TID/comm``: ``python`` is the
    event loop, ``kvsidecar-nixl`` the NIXL owner thread, ``event_engine`` gRPC's, ...)."""
    return [cpu_by_thread(pid) for pid in pids]


def batch(run: Callable[[], float], count: int) -> list[float]:
    if count == 1:
        return [run()]
    with ThreadPoolExecutor(count) as executor:
        return list(executor.map(lambda _: run(), range(count)))


def pair_for(checkout: Path, layout: KvLayout, workdir: Path) -> TransferPair:
    """A pair whose daemons run ``checkout``'s code."""
    env = {"PYTHONPATH": str(checkout)}
    return TransferPair(layout, make_daemon=lambda name: DaemonProcess(workdir, name, [], env=env))


def run_scenario(
    scenario: Scenario, pairs: dict[str, TransferPair], raw: RawNixl, modes: Sequence[str], rounds: int
) -> list[dict[str, Any]]:
    first = next(iter(pairs.values()))
    source, destination = block_sets(scenario, first.layout.num_blocks)
    count = scenario.concurrency
    # Batches per turn: about 32 MiB a turn (at most 16 batches), so small requests add up to a
    # measurable time and CPU (the kernel counts CPU in 10 ms ticks).
    batches = max(1, min(16, (32 << 20) // (scenario.request_bytes * count)))
    paths: dict[str, tuple[Callable[[], list[float]], TransferPair | None]] = {
        "raw-nixl-2proc": (lambda: raw.transfer(source, destination, count), None)
    }
    for label, pair in pairs.items():
        for mode in modes:
            transfer = pair.pull if mode == "pull" else pair.push

            def run(transfer: Callable[..., float] = transfer) -> list[float]:
                return batch(lambda: transfer(source, destination), count)

            paths[f"{label}-{mode}"] = (run, pair)
    for run, _ in paths.values():
        run()  # warm-up: connections, prepared lists, page faults
    names = list(paths)
    latencies: dict[str, list[float]] = {name: [] for name in names}
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[dict[str, float]]] = {name: [{}, {}] for name in names}
    for index in range(rounds):
        for step in range(len(names)):
            name = names[(index + step) % len(names)]
            run, pair = paths[name]
            pids = [daemon.process.pid for daemon in pair.daemons if daemon.process] if pair else []
            before = cpu_seconds(pids)
            if pair is not None and index == rounds - 1:
                pair.poison(destination)
            started = time.perf_counter()
            for _ in range(batches):
                latencies[name].extend(run())
            elapsed = time.perf_counter() - started
            if pair is not None and index == rounds - 1 and not pair.verify(source, destination):
                raise SystemExit(f"{scenario.name} {name}: the bytes did not arrive")
            for side, (now, then) in enumerate(zip(cpu_seconds(pids), before, strict=True)):
                for thread, seconds in now.items():
                    spent = cpu[name][side]
                    spent[thread] = spent.get(thread, 0.0) + seconds - then.get(thread, 0.0)
            rates[name].append(scenario.request_bytes * count * batches / elapsed / 1e9)
    rows = []
    for name in names:
        paired = statistics.median(r / f for r, f in zip(rates[name], rates["raw-nixl-2proc"], strict=True))
        requests = rounds * count * batches
        rows.append({
            "scenario": scenario.name, "path": name, "gbps": statistics.median(rates[name]),
            "p50_ms": statistics.median(latencies[name]) * 1000, "x_raw_2proc": paired,
            "cpu_ms_per_request": [sum(side.values()) / requests * 1000 for side in cpu[name]],
            "cpu_ms_per_request_by_thread": [
                {thread: round(seconds / requests * 1000, 3) for thread, seconds in side.items() if seconds > 0}
                for side in cpu[name]
            ],
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkouts", type=Path, nargs="+")
    parser.add_argument("--scenarios", nargs="+", default=list(DEFAULT))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--modes", nargs="+", default=["pull", "push"], choices=["pull", "push"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    labels = {checkout.resolve(): checkout.resolve().name for checkout in args.checkouts}
    if len(set(labels.values())) != len(labels):
        labels = {checkout: f"c{index}" for index, checkout in enumerate(labels)}
    rows: list[dict[str, Any]] = []
    for block_bytes, plan in selected(scenarios(False), args.scenarios).items():
        if not plan:
            continue
        layout = KvLayout(1, max(256, 2 * max(s.blocks for s in plan)), block_bytes)
        with tempfile.TemporaryDirectory(prefix="kvs-ab-") as workdir:
            pairs = {label: pair_for(checkout, layout, Path(workdir) / label) for checkout, label in labels.items()}
            try:
                for pair in pairs.values():
                    pair.start()
                    pair.fill_producer(seed=block_bytes)
                raw = RawNixl(next(iter(pairs.values())), separate_process=True)
                try:
                    for scenario in plan:
                        found = run_scenario(scenario, pairs, raw, args.modes, args.rounds)
                        for row in found:
                            cpu = "/".join(f"{ms:.2f}" for ms in row["cpu_ms_per_request"])
                            threads = " ".join(
                                f"{side}:{thread}={ms:.2f}"
                                for side, found in zip("PD", row["cpu_ms_per_request_by_thread"], strict=True)
                                for thread, ms in sorted(found.items(), key=lambda item: -item[1])[:3]
                            )
                            print(f"| {row['scenario']} | {row['path']} | {row['gbps']:.2f} | {row['p50_ms']:.3f} | "
                                  f"{row['x_raw_2proc']:.2f} | {cpu} | {threads} |", flush=True)  # fmt: skip
                        rows.extend(found)
                finally:
                    raw.close()
            finally:
                for pair in pairs.values():
                    pair.close()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    print("| scenario | path | GB/s | p50 ms | x raw 2proc (median per round) | CPU ms/request P/D sidecar "
          "| top threads (ms/request) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    main()
