"""Latency and CPU per request of the control-plane rows, for one or several checkouts, alternating.

    python -m bench.control_cpu [CHECKOUT ...] [--rounds 3] [--rate 100] [--count 300]
        [--modes push pull] [--json OUT]

For each round and checkout (default: this one) a child process runs, from that checkout's
directory with PYTHONPATH=<checkout>, that checkout's own ``control_plane`` (``kvsidecar bench``'s
control rows: two ``kvsidecar serve`` daemons, the simulated engines in the child, 1-block requests
open loop at ``--rate``) and reads, around each row's open loop only, the CPU time of each daemon
by thread (``/proc/PID/task``: the event loop ``python``, the NIXL owner ``kvsidecar-nixl``, gRPC's
``event_engine``...) and of the child itself (the simulated engines and the load generator), and
each thread's wake-ups per request (voluntary context switches, ``wakeups`` in the JSON). The
row's own Trace queries afterwards (today's ``control_path``) are left out, so checkouts from before
tracing compare. Why CPU: on a shared 2-core machine latency moves by a third between minutes,
while CPU per request is what a node pays and moves far less. Prints a table of medians over the
rounds; ``--json`` keeps every row.

Works with the module layout before ``sidecar/tools/`` (``sidecar.bench``, ``sidecar.workload``),
so the commit an issue measured can run against today's (``git worktree add DIR COMMIT``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]

REPO = Path(__file__).resolve().parent.parent


def cpu_by_thread(pid: int) -> dict[str, float]:
    """CPU seconds by thread name (threads of one name summed); psutil gives each thread's times,
    ``/proc/PID/task/TID/comm`` its name."""
    found: dict[str, float] = {}
    for thread in psutil.Process(pid).threads():
        try:
            name = Path(f"/proc/{pid}/task/{thread.id}/comm").read_text().strip()
        except OSError:
            continue  # the thread ended
        found[name] = found.get(name, 0.0) + thread.user_time + thread.system_time
    return found


def _wakeups(pid: int) -> dict[str, int]:
    """Wake-ups by thread name: each thread's voluntary context switches (it went to sleep and was
    woken: a futex, epoll or queue wait that ended) from ``/proc/PID/task/TID/status``."""
    found: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except OSError:
            continue  # the thread ended
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                found[name] = found.get(name, 0) + int(line.split()[1])
    return found


def _own_cpu() -> float:
    times = os.times()
    return times.user + times.system


def measure(rate: float, count: int, modes: list[str], settle: float) -> list[dict[str, Any]]:
    """In the child: one row per mode, this checkout's code (cwd and PYTHONPATH)."""
    try:
        import sidecar.tools.bench as bench_module
        from sidecar.tools.workload import TransferPair
    except ImportError:  # the layout before sidecar/tools/
        import sidecar.bench as bench_module  # type: ignore[no-redef]
        from sidecar.workload import TransferPair  # type: ignore[no-redef]
    from engine_shim.memory import KvLayout

    if hasattr(bench_module, "control_path"):
        bench_module.control_path = lambda pair: {}  # its Trace queries run after the load
    rows = []
    with TransferPair(KvLayout(1, 256, 64 * 1024)) as pair:
        pair.fill_producer(seed=1)
        pids = {side: daemon.process.pid for side, daemon in zip(("p_sidecar", "d_sidecar"), pair.daemons, strict=True)}
        for mode in modes:
            bench_module.control_plane(pair, mode, rate, 20)  # warm: connections, prepared lists, polling
            time.sleep(settle)  # past the handshake's warm polling (5 s): the steady state
            woken = {side: _wakeups(pid) for side, pid in {**pids, "engines_and_load": os.getpid()}.items()}
            before = {side: cpu_by_thread(pid) for side, pid in pids.items()}
            own = _own_cpu()
            row = bench_module.control_plane(pair, mode, rate, count)
            own = _own_cpu() - own
            after = {side: cpu_by_thread(pid) for side, pid in pids.items()}
            wakeups: dict[str, dict[str, float]] = {}
            for side, pid in {**pids, "engines_and_load": os.getpid()}.items():
                now = _wakeups(pid)
                wakeups[side] = {
                    name: round((n - woken[side].get(name, 0)) / count, 2)
                    for name, n in now.items()
                    if n > woken[side].get(name, 0)
                }
            cpu: dict[str, Any] = {"engines_and_load": own / count * 1000}
            for side in pids:
                by_thread = {
                    name: (after[side][name] - before[side].get(name, 0.0)) / count * 1000 for name in after[side]
                }
                cpu[side] = sum(by_thread.values())
                cpu[f"{side}_threads"] = {name: ms for name, ms in by_thread.items() if ms > 0}
            latency = {"p50_ms": row.p50_ms, "p99_ms": row.p99_ms}
            rows.append({"mode": mode, **latency, "cpu_ms_per_request": cpu, "wakeups": wakeups})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkouts", type=Path, nargs="*", default=[REPO])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--modes", nargs="+", default=["push", "pull"], choices=["push", "pull"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--settle", type=float, default=6.0,
                        help="seconds between the warm-up and the measured row (a handshake keeps the NIXL "
                             "owner thread polling for 5 s; 0 measures that too)")  # fmt: skip
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.rate, args.count, args.modes, args.settle)))
        return
    # Imported here, not at the top: the child measures another checkout's code, which must be
    # the first ``sidecar`` on its path.
    from bench.checkouts import alternate, in_checkout

    found: dict[str, list[dict[str, Any]]] = {}

    def run_round(checkout: Path, index: int) -> None:
        command = [sys.executable, str(Path(__file__).resolve()), "--child", "--rate", str(args.rate),
                   "--count", str(args.count), "--settle", str(args.settle), "--modes", *args.modes]  # fmt: skip
        done = in_checkout(checkout, command)
        for row in json.loads(done.stdout.strip().splitlines()[-1]):
            found.setdefault(f"{checkout} {row['mode']}", []).append(row)
            cpu = row["cpu_ms_per_request"]
            print(f"round {index} {checkout} {row['mode']}: p50 {row['p50_ms']:.2f} ms, CPU ms/request "
                  f"P's sidecar {cpu['p_sidecar']:.2f}, D's {cpu['d_sidecar']:.2f}, "
                  f"engines+load {cpu['engines_and_load']:.2f}", flush=True)  # fmt: skip
            for side, by_thread in row["wakeups"].items():
                top = sorted(by_thread.items(), key=lambda item: -item[1])
                print(f"  wake-ups per request, {side}: {sum(by_thread.values()):.1f} "
                      f"({', '.join(f'{name} {n:g}' for name, n in top)})")  # fmt: skip

    alternate(args.checkouts, args.rounds, run_round)
    print("| checkout, mode | latency p50 / p99 ms | CPU ms per request: P's sidecar / D's sidecar / engines+load |")
    print("|---|---|---|")
    for key, rows in found.items():

        def median(pick: Any, rows: list[dict[str, Any]] = rows) -> float:
            return statistics.median(pick(row) for row in rows)

        print(
            f"| {key} | {median(lambda r: r['p50_ms']):.2f} / {median(lambda r: r['p99_ms']):.2f} | "
            f"{median(lambda r: r['cpu_ms_per_request']['p_sidecar']):.2f} / "
            f"{median(lambda r: r['cpu_ms_per_request']['d_sidecar']):.2f} / "
            f"{median(lambda r: r['cpu_ms_per_request']['engines_and_load']):.2f} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
