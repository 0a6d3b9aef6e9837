"""Diagnostics: where a sidecar's NIXL owner thread spends a request (on a CPU, waiting on a run
queue, or asleep, and in which kernel wait), and who had the CPUs meanwhile.

Samples, from ``/proc`` (root for the kernel stacks), every ``--interval`` seconds:

- each ``kvsidecar-nixl`` thread of every running ``sidecar.app.cli serve`` process:
  ``schedstat`` (ns on a CPU, ns runnable but waiting on a run queue, timeslices), its state and
  CPU from ``stat``, and its kernel stack whenever it is not running;
- every ``--all-every`` seconds, every thread of the machine: ``schedstat`` and ``comm``.

Writes JSON lines to ``--out`` when stopped (SIGINT/SIGTERM or ``--duration``). ``--report`` reads
such a file back together with a ``KVBENCH_TRACE`` file of ``bench.vllm_pd`` and prints, per D leg
(send -> first token), each owner thread's CPU, run-queue wait and sleep, the kernel waits it slept
in, and the threads that used the most CPU in that window.

Run it next to a benchmark: ``python -m bench.thread_watch --out W.jsonl & KVBENCH_TRACE=T.txt python
-m bench.vllm_pd ...; kill -INT %1; python -m bench.thread_watch --report W.jsonl --trace T.txt``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import time
from typing import Any


def _read(fd: int, size: int = 4096) -> str:
    return os.pread(fd, size, 0).decode(errors="replace")


def _open(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def _owner_threads() -> dict[int, int]:
    """tid -> pid of every kvsidecar-nixl thread of a running sidecar."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read()
            if b"sidecar.app.cli\x00serve" not in cmdline:
                continue
            for tid in os.listdir(f"/proc/{entry}/task"):
                with open(f"/proc/{entry}/task/{tid}/comm") as handle:
                    if handle.read().strip() == "kvsidecar-nixl":
                        found[int(tid)] = int(entry)
        except OSError:
            continue
    return found


def _all_threads() -> dict[int, tuple[int, str, str]]:
    """tid -> (pid, comm, process name) of every thread."""
    found: dict[int, tuple[int, str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                name = b" ".join(handle.read().split(b"\x00")[:4]).decode(errors="replace")[:80]
            for tid in os.listdir(f"/proc/{entry}/task"):
                with open(f"/proc/{entry}/task/{tid}/comm") as handle:
                    found[int(tid)] = (int(entry), handle.read().strip(), name)
        except OSError:
            continue
    return found


def watch(args: argparse.Namespace) -> None:
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    owners: dict[int, tuple[int, int, int, int | None]] = {}  # tid -> pid, schedstat fd, stat fd, stack fd
    threads: dict[int, tuple[int, str, str, int]] = {}  # tid -> pid, comm, name, schedstat fd
    samples: list[list[Any]] = []
    snapshots: list[list[Any]] = []
    names: dict[int, list[Any]] = {}
    end = time.monotonic() + args.duration if args.duration else float("inf")
    next_scan = next_all = 0.0
    while not stop and time.monotonic() < end:
        now = time.monotonic()
        if now >= next_scan:
            next_scan = now + 0.5
            for tid, pid in _owner_threads().items():
                if tid not in owners:
                    sched = _open(f"/proc/{pid}/task/{tid}/schedstat")
                    stat = _open(f"/proc/{pid}/task/{tid}/stat")
                    if sched is not None and stat is not None:
                        owners[tid] = (pid, sched, stat, _open(f"/proc/{pid}/task/{tid}/stack"))
        if args.all_every and now >= next_all:
            next_all = now + args.all_every
            if not threads or int(now) % 2 == 0:
                for tid, (pid, comm, name) in _all_threads().items():
                    if tid not in threads:
                        fd = _open(f"/proc/{pid}/task/{tid}/schedstat")
                        if fd is not None:
                            threads[tid] = (pid, comm, name, fd)
                            names[tid] = [pid, comm, name]
            row: list[Any] = [time.time()]
            for tid, (_, _, _, fd) in list(threads.items()):
                try:
                    run, wait, _slices = _read(fd, 128).split()
                except (OSError, ValueError):
                    os.close(fd)
                    del threads[tid]
                    continue
                row.append([tid, int(run), int(wait)])
            snapshots.append(row)
        wall = time.time()
        for tid, (pid, sched, stat, stack) in list(owners.items()):
            try:
                run, wait, slices = _read(sched, 128).split()
                fields = _read(stat, 1024).rsplit(")", 1)[1].split()
            except (OSError, ValueError, IndexError):
                del owners[tid]
                continue
            state, cpu = fields[0], int(fields[36])
            top = ""
            if state != "R" and stack is not None:
                try:
                    frames = [line.split("] ", 1)[-1].split("+")[0] for line in _read(stack).splitlines()]
                    top = "<".join(frames[:6])
                except OSError:
                    top = "?"
            samples.append([wall, tid, pid, int(run), int(wait), int(slices), state, cpu, top])
        time.sleep(args.interval)
    with open(args.out, "w") as out:
        out.write(json.dumps({"names": names}) + "\n")
        for sample in samples:
            out.write(json.dumps({"s": sample}) + "\n")
        for snapshot in snapshots:
            out.write(json.dumps({"a": snapshot}) + "\n")


def report(args: argparse.Namespace) -> None:
    names: dict[str, list[Any]] = {}
    samples: list[list[Any]] = []
    snapshots: list[list[Any]] = []
    with open(args.report) as handle:
        for line in handle:
            item = json.loads(line)
            if "names" in item:
                names = item["names"]
            elif "s" in item:
                samples.append(item["s"])
            else:
                snapshots.append(item["a"])
    legs: list[tuple[float, float]] = []
    with open(args.trace) as handle:
        for line in handle:
            parts = line.split()
            if "D-leg" in parts and parts[-1] != "None":
                legs.append((float(parts[parts.index("sent") + 1]), float(parts[-1])))
    by_tid: dict[int, list[list[Any]]] = collections.defaultdict(list)
    for sample in samples:
        by_tid[sample[1]].append(sample)
    for start, first in legs[-args.last :] if args.last else legs:
        print(f"D leg {time.strftime('%H:%M:%S', time.gmtime(start))}: TTFT {1e3 * (first - start):.0f} ms")
        for tid, rows in by_tid.items():
            inside = [row for row in rows if start <= row[0] <= first]
            if len(inside) < 2:
                continue
            a, b = inside[0], inside[-1]
            span = (b[0] - a[0]) * 1e3
            run, wait = (b[3] - a[3]) / 1e6, (b[4] - a[4]) / 1e6
            states = collections.Counter(row[6] for row in inside)
            print(
                f"  owner {tid} (pid {a[2]}): {span:.0f} ms sampled, on CPU {run:.1f} ms, run queue {wait:.1f} ms, "
                f"other {span - run - wait:.1f} ms, slices {b[5] - a[5]}, states {dict(states)}"
            )
            waits = collections.Counter(row[8] for row in inside if row[6] != "R")
            for top, count in waits.most_common(4):
                print(f"    {count:4d} x {row_state(inside, top)} {top}")
        window = [row for row in snapshots if start - args.all_margin <= row[0] <= first + args.all_margin]
        if len(window) >= 2:
            first_row = {t: (r, w) for t, r, w in window[0][1:]}
            used = []
            for tid, run, wait in window[-1][1:]:
                if tid in first_row:
                    used.append(((run - first_row[tid][0]) / 1e6, (wait - first_row[tid][1]) / 1e6, tid))
            used.sort(reverse=True)
            span = (window[-1][0] - window[0][0]) * 1e3
            total = sum(u[0] for u in used)
            print(f"  all threads over {span:.0f} ms: {total:.0f} ms CPU; top:")
            for run, wait, tid in used[: args.top]:
                pid, comm, name = names.get(str(tid), ["?", "?", "?"])
                print(f"    {run:7.1f} ms cpu {wait:7.1f} ms runq  {tid} {comm:16s} pid {pid} {name[:60]}")


def row_state(rows: list[list[Any]], top: str) -> str:
    return "".join(sorted({row[6] for row in rows if row[8] == top}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="bench/thread_watch.py", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--out", default="thread_watch.jsonl")
    parser.add_argument("--interval", type=float, default=0.001)
    parser.add_argument(
        "--all-every", type=float, default=0.05, help="seconds between whole-machine snapshots (0: none)"
    )
    parser.add_argument("--duration", type=float, default=0.0)
    parser.add_argument("--report", help="a --out file to read back (with --trace)")
    parser.add_argument("--trace", help="the KVBENCH_TRACE file of the same run")
    parser.add_argument("--last", type=int, default=0, help="only the last N D legs")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--all-margin", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.report:
        report(args)
    else:
        watch(args)


if __name__ == "__main__":
    main(sys.argv[1:])
