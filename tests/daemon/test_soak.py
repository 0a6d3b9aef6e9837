"""Soak: thousands of mixed requests (pull, push, multi-turn pull-back, aborts at random moments,
lease expiries) through two sidecars with simulated engines, four at a time, every byte checked.
RSS, fds and threads of both sidecars and /dev/shm are sampled as it runs; at the end they must be
flat and nothing may be left (no leases, registrations, receives, holds, transfers).

``KVSIDECAR_SOAK_REQUESTS`` sets the count: 300 in ``make test``, 10,000 in ``make soak``
(bench/README.md has the figures). The workload is ``sidecar.tools.workload.TransferPair``.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine_shim.memory import KvLayout
from sidecar.tools.demo import BlockPool
from sidecar.tools.workload import TransferFailed, TransferPair
from tests.support.fuzzing import leftover, process_usage
from tests.support.processes import wait_until

REQUESTS = int(os.environ.get("KVSIDECAR_SOAK_REQUESTS", "300"))
pytestmark = [pytest.mark.soak, pytest.mark.timeout(max(300, REQUESTS // 2))]
LAYOUT = KvLayout(2, 1024, 8192)
CONCURRENCY = 4
MIX = (("pull", 0.35), ("push", 0.30), ("multiturn", 0.15), ("abort", 0.13), ("expire", 0.07))
# Flat: after the warm-up tenth, what the sidecars may still grow by at the end.
RSS_SLACK_KIB, FD_SLACK, THREAD_SLACK = 32 * 1024, 4, 2


def shm_usage() -> tuple[int, int]:
    files = [p for p in Path("/dev/shm").iterdir() if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def test_soak_mixed_requests_stay_flat_and_leave_nothing(workdir: Path) -> None:
    args = ["--set", "lease_seconds=5", "--set", "integrity=digest"]  # digests checked on every load
    with TransferPair(LAYOUT, sidecar_args=args, workdir=workdir, request_timeout=30, roles=("both", "both")) as pair:
        assert pair.producer is not None and pair.consumer is not None
        pair.fill_producer(1)
        pids = {daemon.name: daemon.process.pid for daemon in pair.daemons if daemon.process is not None}
        p_pool, d_pool = BlockPool(LAYOUT.num_blocks), BlockPool(LAYOUT.num_blocks)
        lock = threading.Lock()
        counts: dict[str, int] = {}
        problems: list[str] = []
        samples: list[dict[str, float]] = []
        done = [0]
        every = max(REQUESTS // 20, 10)
        started = time.monotonic()

        def sample() -> None:
            row: dict[str, float] = {"requests": done[0], "seconds": round(time.monotonic() - started, 1)}
            for name, pid in pids.items():
                for key, value in process_usage(pid).items():
                    row[f"{name}_{key}"] = value
            row["shm_files"], row["shm_bytes"] = shm_usage()
            samples.append(row)

        def one(index: int) -> None:
            rng = random.Random(index)
            roll, kind = rng.random(), MIX[-1][0]
            for name, share in MIX:
                if roll < share:
                    kind = name
                    break
                roll -= share
            size = rng.randint(1, 32)
            source, target = p_pool.take(size, rng), d_pool.take(size, rng)
            try:
                if kind in ("pull", "push"):
                    pair.poison(target)
                    (pair.pull if kind == "pull" else pair.push)(source, target)
                    if not pair.verify(source, target):
                        raise TransferFailed(f"{kind} {index}: D's bytes differ from P's")
                elif kind == "multiturn":
                    pair.consumer.fill(target, seed=10_000 + index)  # type: ignore[union-attr]
                    pair.producer.fill(source, seed=20_000 + index)  # type: ignore[union-attr]
                    pair.multiturn(target, source)
                    if not pair.verify(source, target):
                        raise TransferFailed(f"multiturn {index}: P's pulled-back bytes differ from D's")
                elif kind == "abort":
                    ended = pair.abort(rng.choice(["pull", "push"]), source, target, rng.uniform(0, 0.005))
                    kind = f"abort ({ended})"
                else:
                    ended = pair.expire(source, lease_seconds=0.2)
                    if ended != "LEASE_EXPIRED":
                        raise TransferFailed(f"expire {index}: ended with {ended}")
            except TransferFailed as exc:
                with lock:
                    problems.append(str(exc))
            finally:
                if kind.startswith("multiturn") or kind.startswith("abort"):
                    pair.producer.fill(source, seed=1)  # type: ignore[union-attr]  # restore P's pattern
                p_pool.give(source)
                d_pool.give(target)
                with lock:
                    counts[kind] = counts.get(kind, 0) + 1
                    done[0] += 1
                    if done[0] % every == 0:
                        sample()

        sample()
        with ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="soak") as executor:
            for future in [executor.submit(one, index) for index in range(REQUESTS)]:
                future.result()
        elapsed = time.monotonic() - started

        for daemon in pair.daemons:
            from tests.chaos.cells import status

            left = wait_until(lambda d=daemon: not leftover(status(d), ["bench-P", "bench-D"]) or None, 30,
                              what="nothing left") if not problems else None  # fmt: skip
            assert left is None or left, leftover(status(daemon), ["bench-P", "bench-D"])
        time.sleep(1.0)
        sample()

        keys = [k for k in samples[0] if k not in ("requests", "seconds")]
        print(
            f"\nsoak: {REQUESTS} requests in {elapsed:.0f} s, {CONCURRENCY} at a time: {dict(sorted(counts.items()))}"
        )
        print("  ".join(["requests", "seconds", *keys]))
        for row in samples:
            print("  ".join(str(int(row[k]) if k != "seconds" else row[k]) for k in ["requests", "seconds", *keys]))
        assert not problems, f"{len(problems)} requests failed: {problems[:5]}"

        warm = samples[min(2, len(samples) - 1)]
        final = samples[-1]
        for name in pids:
            assert final[f"{name}_rss_kib"] <= warm[f"{name}_rss_kib"] + RSS_SLACK_KIB, (name, warm, final)
            assert final[f"{name}_fds"] <= warm[f"{name}_fds"] + FD_SLACK, (name, warm, final)
            assert final[f"{name}_threads"] <= warm[f"{name}_threads"] + THREAD_SLACK, (name, warm, final)
        assert final["shm_files"] == samples[0]["shm_files"], (samples[0], final)
        assert final["shm_bytes"] == samples[0]["shm_bytes"], (samples[0], final)
