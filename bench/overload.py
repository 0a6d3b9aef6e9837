"""Overload: a node pair (two sidecars on loopback, real NIXL, simulated engines in this process)
driven at 2x and 10x what it moves, then back to half of it.

Per mode (pull, push), in one pair of daemons started with ``max_pending_requests=--max-pending``:
1. ``capacity``: closed loop, ``--lanes`` requests always in flight, ``--warm`` s: what the pair
   moves (requests/s); the offered rates below are multiples of it;
2. ``unloaded``: open loop at 0.5x for ``--warm`` s: the unloaded p50/p99 of a request (P's
   SubmitBlocks -> D's FINISHED_RECEIVING);
3. ``2x``, then ``recover-2x`` (0.5x, ``--warm`` s), ``10x``, ``recover-10x``: ``--seconds`` s
   each burst.
Arrivals are open loop (``tests/support/overload.py``): an arrival takes a free slot of KV blocks
on both engines (``--slots`` of them) or, with none free, counts as ``engine_full`` (the engine
itself would have queued it: its KV blocks are the first bound). ``reached/s`` is what got to the
sidecars. Per phase: counts by outcome (moved with every byte compared, refused with the status
and reason, failed, lost, corrupt), p50/p99 of the moved requests and their ratio to the unloaded
p99, and each sidecar's peak RSS, fds and pending counters (GetStatus, sampled every 0.25 s).

Run: ``python -m bench.overload [--json bench/out/overload.json] [--seconds 60] [--max-pending 8]
[--max-queue-delay-ms 20] [--capacity 150] [--block-kib 1024] [--modes pull push]``; ``make
bench-overload``. ``--max-queue-delay-ms 0`` is the count bound alone (as before admission by
queueing delay); ``--capacity`` offers multiples of a fixed rate, so runs compare at equal load.
Kills what it started and removes its /dev/shm files on success, failure and Ctrl-C; every wait is
bounded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sidecar.tools.launcher import DaemonProcess
from tests.support.overload import PhaseResult, Sampler, SlotPool, capacity, offer
from tests.support.traffic import ShimEngine

LAYERS = 4


def run_mode(args: argparse.Namespace, workdir: Path, mode: str) -> dict[str, Any]:
    settings = ["--set", f"max_pending_requests={args.max_pending}"]
    if args.max_queue_delay_ms is not None:
        settings += ["--set", f"admission_max_queue_delay_ms={args.max_queue_delay_ms}"]
    sidecars = [DaemonProcess(workdir, f"{name}-{mode}", settings) for name in ("p", "d")]
    engines: list[ShimEngine] = []
    try:
        for sidecar in sidecars:
            sidecar.start()
        blocks = args.slots * args.blocks
        for sidecar, engine_id in zip(sidecars, ("P", "D"), strict=True):
            engines.append(ShimEngine(sidecar.socket, engine_id, layers=LAYERS, blocks=blocks,
                                      block_len=args.block_kib * 1024))  # fmt: skip
        p, d = engines
        pool = SlotPool(p, args.slots, args.blocks)
        sampler = Sampler(sidecars).start()
        phases: list[tuple[PhaseResult, dict[str, Any]]] = []

        def phase(run: Any) -> PhaseResult:
            started = time.monotonic()
            result: PhaseResult = run()
            phases.append((result, sampler.peak(started, time.monotonic())))
            print(f"{mode} {result.name}: {_line(result)}", file=sys.stderr)
            return result

        base = phase(lambda: capacity(p, d, mode, args.lanes, args.warm, pool))
        # A given capacity makes runs (checkouts, settings) offer the same load.
        rate = args.capacity or max(base.moved_per_s, 1.0)
        unloaded = phase(lambda: offer(p, d, mode, 0.5 * rate, args.warm, pool, "unloaded"))
        for factor in (2, 10):
            phase(lambda f=factor: offer(p, d, mode, f * rate, args.seconds, pool, f"{f}x"))  # type: ignore[misc]
            phase(lambda f=factor: offer(p, d, mode, 0.5 * rate, args.warm, pool, f"recover-{f}x"))  # type: ignore[misc]
        sampler.stop()
        return {
            "mode": mode,
            "capacity_per_s": rate,
            "request_bytes": LAYERS * args.blocks * args.block_kib * 1024,
            "unloaded_p99_s": unloaded.p99_s,
            "unloaded_sidecar_p99_s": unloaded.sidecar_p99_s,
            "phases": [
                {
                    **asdict(result),
                    "p99_vs_unloaded": _ratio(result.p99_s, unloaded.p99_s),
                    "sidecar_p99_vs_unloaded": _ratio(result.sidecar_p99_s, unloaded.sidecar_p99_s),
                    "peak": peak,
                }
                for result, peak in phases
            ],
        }
    finally:
        for engine in engines:
            engine.close()
        for sidecar in sidecars:
            if sidecar.process is not None:
                try:
                    sidecar.terminate(20)
                except Exception:
                    sidecar.kill()


def _ratio(value: float, base: float) -> float | None:
    return round(value / base, 2) if base else None


def _line(result: PhaseResult) -> str:
    return (
        f"offered {result.rate:.0f}/s reached {result.reached_per_s:.0f}/s moved {result.moved_per_s:.0f}/s "
        f"p50 {result.p50_s * 1000:.1f} ms p99 {result.p99_s * 1000:.1f} ms (sidecar p50 "
        f"{result.sidecar_p50_s * 1000:.1f} p99 {result.sidecar_p99_s * 1000:.1f}) {result.counts} "
        f"engine_full {result.engine_full} {result.refusal_codes} {result.refusals_by}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.overload", description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--modes", nargs="+", default=["pull", "push"], choices=["pull", "push"])
    parser.add_argument("--seconds", type=float, default=60.0, help="each burst (2x, 10x)")
    parser.add_argument("--warm", type=float, default=10.0, help="capacity, unloaded and recovery phases")
    parser.add_argument("--max-pending", type=int, default=8, help="the sidecars' max_pending_requests")
    parser.add_argument(
        "--max-queue-delay-ms", type=float, default=20.0, help="the sidecars' admission bound (ms; 0: off)"
    )
    parser.add_argument("--capacity", type=float, help="offer multiples of this (requests/s), not of the measured")
    parser.add_argument("--lanes", type=int, default=4, help="requests in flight while measuring capacity")
    parser.add_argument("--slots", type=int, default=32, help="requests the engines have KV blocks for at once")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per request (per layer)")
    parser.add_argument("--block-kib", type=int, default=1024, help="bytes of one block of one layer, KiB")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kvs-overload-", dir="/tmp"))
    try:
        results = {
            "settings": vars(args) | {"json": str(args.json)},
            "modes": [run_mode(args, workdir, m) for m in args.modes],
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = json.dumps(results, indent=2, default=str)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
