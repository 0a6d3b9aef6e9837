"""Where one request's control path goes: a per-request timeline of 1-block push and pull
requests between two real sidecars (``TransferPair``: two ``kvsidecar serve`` daemons, simulated
engines in this process), started open loop at ``--rate`` per second like ``kvsidecar bench
--only control``.

Every mark is a wall-clock time (``time.time()``, one clock for every process on this host):
the simulated engines' own (``TransferPair.client_marks``: SubmitBlocks sent and returned, the
Pull returned, the terminal event's arrival on the engine's event thread, the waiting caller woke)
and each sidecar's trace events (the ``Trace`` query, ``P:``/``D:``), with the finer points their
``measured`` values place before the event: the call reaching the interceptor (``rpc_to_admit``),
the NIXL owner thread taking the post, its post returning, DONE seen (``owner_*``), the owner
thread seeing a notification (``loop_wake``). Marks are offsets from the producer's SubmitBlocks;
the table lists each mark's median offset over the requests and the median gap from the mark
before it, so the gaps add up to the median request.

    python -m bench.control_timeline --rate 100 --count 300 [--modes push pull pull-confirmed] [--json OUT]

Pulls are vouched after the first (as the vLLM shim's are, ``kvsidecar.voucher``);
``pull-confirmed`` measures pulls that confirm with the producer's sidecar before each READ.

Run it on a quiet machine (the figures are thread wake-ups of tens of microseconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
from collections import defaultdict
from pathlib import Path

from engine_shim.memory import KvLayout
from sidecar.core.trace import Timeline
from sidecar.tools.bench import _open_loop
from sidecar.tools.workload import TransferPair

KIB = 1024
START = "P-engine SubmitBlocks"


def sidecar_marks(timelines: list[Timeline]) -> dict[str, float]:
    """Each trace event of the producer's and consumer's timelines as ``P:kind`` / ``D:kind``,
    plus the sub-steps its measured times locate (first occurrence of each)."""
    marks: dict[str, float] = {}

    def put(name: str, at: float) -> None:
        marks.setdefault(name, at)

    for timeline in timelines:
        if timeline.side not in ("producer", "consumer"):
            continue
        who = "P" if timeline.side == "producer" else "D"
        for event in timeline.events:
            at, measured = event.unix_s, event.measured
            if "rpc_to_admit" in measured:
                put(f"{who}: call reached the interceptor", at - measured["rpc_to_admit"])
            if "loop_wake" in measured:
                put(f"{who}: owner thread saw the notification", at - measured["loop_wake"])
            if "owner_wait" in measured and "loop_resume" in measured:
                reported = at - measured["loop_resume"]
                posted = reported - measured["owner_done"]
                taken = posted - measured["owner_post"]
                put(f"{who}: post queued for the owner thread", taken - measured["owner_wait"])
                put(f"{who}: owner thread took the post", taken)
                put(f"{who}: NIXL post returned", posted)
                put(f"{who}: owner thread saw DONE", reported)
            put(f"{who}: {event.kind}", at)
    return marks


def run(mode: str, rate: float, count: int) -> tuple[list[dict[str, float]], list[float]]:
    layout = KvLayout(1, 256, 64 * KIB)
    with TransferPair(layout, vouch=mode != "pull-confirmed") as pair:
        pair.fill_producer(seed=1)
        transfer = pair.push if mode == "push" else pair.pull
        for _ in range(5):  # warm-up: handshake, connections, prepared lists
            transfer([0], [1])
        pair.completed.clear()
        pair.client_marks = {}
        lock = threading.Lock()
        latencies: list[float] = []

        def one() -> None:
            latency = transfer([0], [1])
            with lock:
                latencies.append(latency)

        _open_loop(one, count, rate, workers=64)
        requests = []
        for request_id, *_ in list(pair.completed):
            marks = dict(pair.client_marks.get(request_id, {}))
            marks.update(pair.client_marks.get(request_id + "-d", {}))
            marks.update(sidecar_marks(pair.trace(request_id)))
            start = marks.get(START)
            if start is None:
                continue
            requests.append({name: (at - start) * 1000.0 for name, at in marks.items()})
        return requests, [latency * 1000.0 for latency in latencies]


def table(requests: list[dict[str, float]]) -> list[tuple[str, float, float]]:
    """(mark, median offset ms, median gap from the previous mark ms), in order of median offset;
    marks before the SubmitBlocks (a push's registration) are left out."""
    offsets: dict[str, list[float]] = defaultdict(list)
    for marks in requests:
        for name, offset in marks.items():
            offsets[name].append(offset)
    order = sorted((statistics.median(v), name) for name, v in offsets.items() if statistics.median(v) >= 0)
    rows = []
    previous = None
    for median, name in order:
        gaps = [m[name] - m[previous] for m in requests if previous and name in m and previous in m]
        rows.append((name, median, statistics.median(gaps) if gaps else median))
        previous = name
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--modes", nargs="+", default=["push", "pull"], choices=["push", "pull", "pull-confirmed"])
    parser.add_argument("--json", type=Path, help="write every request's marks here")
    args = parser.parse_args()
    dump = {}
    for mode in args.modes:
        requests, latencies = run(mode, args.rate, args.count)
        dump[mode] = requests
        print(f"\n{mode} at {args.rate:g} req/s: {len(requests)} requests traced, latency p50 "
              f"{statistics.median(latencies):.3f} ms")  # fmt: skip
        print("| mark | median offset ms | median gap ms |\n|---|---|---|")
        for name, offset, gap in table(requests):
            print(f"| {name} | {offset:.3f} | {gap:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(dump, indent=1))


if __name__ == "__main__":
    main()
