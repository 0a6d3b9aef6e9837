"""Across hosts: GB/s and latency between two network-namespace hosts, kvsidecar vs raw NIXL,
same transfers, one invocation (`make bench-multihost`; needs root).

The outer process builds two hosts on a bridge (tests/multihost/netns.py: ``p0`` and ``d0``, UCX
restricted to TCP on their interface) and re-runs this module inside ``p0``. There:

- ``kvsidecar-pull`` / ``kvsidecar-push``: a sidecar on each host; the simulated engines live in
  this process (on p0) and reach d0's sidecar through its Unix socket: only the sidecars move KV,
  over the bridge. Latency = producer's SubmitBlocks -> consumer's FINISHED_RECEIVING.
- ``raw-nixl-2proc``: a NIXL agent in this process (p0) WRITEs the same blocks into the same
  consumer memory through an agent in a process on d0 (``sidecar.bench_target``), prepared lists
  and a notification, progress by polling: the floor for any NIXL-based transport between them.

Each scenario: a warm-up, then ``--runs`` runs; GB/s is the median over runs, latency percentiles
over all requests, the ratio is against raw NIXL measured in the same invocation, and the last run
of each row is verified byte for byte (`sidecar/tools/bench.py` does the measuring).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

KIB = 1024
MIB = 1024 * KIB
PEER_PORT = 50151


def outer(args: argparse.Namespace) -> int:
    from tests.multihost.netns import UCX_ENV, Network, unavailable

    reason = unavailable()
    if reason:
        print(f"bench-multihost needs network namespaces: {reason}", file=sys.stderr)
        return 2
    with Network(["p0", "d0"]) as net:
        command = [
            *net["p0"].prefix, sys.executable, "-m", "bench.multihost", "--inside",
            "--d-netns", net["d0"].netns, "--p-address", net["p0"].address, "--d-address", net["d0"].address,
            "--runs", str(args.runs), "--json", str(args.json),
        ]  # fmt: skip
        env = {**os.environ, **UCX_ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        return subprocess.run(command, env=env, timeout=1800).returncode


def inside(args: argparse.Namespace) -> int:
    from engine_shim.memory import KvLayout
    from sidecar.tools.bench import RawNixl, Row, Scenario, block_sets, kvsidecar_path, measure, render
    from sidecar.tools.launcher import DaemonProcess
    from sidecar.tools.workload import TransferPair

    d_wrapper = ["ip", "netns", "exec", args.d_netns]
    plan = [Scenario(64 * KIB, blocks, "adjacent", 1) for blocks in (1, 16, 256)]
    plan += [Scenario(64 * KIB, 256, "scattered", 1), Scenario(64 * KIB, 16, "adjacent", 8)]
    layout = KvLayout(1, 1024, 64 * KIB)
    run_bytes = 32 * MIB
    rows: list[Row] = []

    def daemon(workdir: Path, name: str) -> DaemonProcess:
        address = args.p_address if name == "p" else args.d_address
        listen = ["--peer-listen", f"{address}:{PEER_PORT}"]
        return DaemonProcess(workdir, name, listen, wrapper=[] if name == "p" else d_wrapper)

    pair = TransferPair(layout, make_daemon=lambda name: daemon(pair.workdir, name))
    started = time.monotonic()
    with pair:
        pair.fill_producer(seed=7)
        # Over TCP the target's progress calls move the bytes: poll as a sidecar does after activity.
        raw = RawNixl(pair, separate_process=True, target_wrapper=d_wrapper, target_poll_s=0.00005)
        try:
            paths = {
                "kvsidecar-pull": kvsidecar_path(pair, "pull"),
                "kvsidecar-push": kvsidecar_path(pair, "push"),
                "raw-nixl-2proc": raw.transfer,
            }
            for scenario in plan:
                assert max(block_sets(scenario, layout.num_blocks)[0]) < layout.num_blocks
                found = {}
                for name, path in paths.items():
                    print(f"  {scenario.name} {name}", file=sys.stderr, flush=True)
                    found[name] = measure(pair, scenario, name, path, args.runs, run_bytes)
                floor = found["raw-nixl-2proc"].gbps
                for row in found.values():
                    row.ratio_vs_raw_nixl = row.gbps / floor if floor else None
                    row.extra["between"] = "network namespaces, UCX_TLS=" + os.environ.get("UCX_TLS", "")
                rows.extend(found.values())
        finally:
            raw.close()
    print(render(rows))
    print(f"\n{len(rows)} rows in {time.monotonic() - started:.0f}s -> {args.json}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([asdict(row) for row in rows], indent=2))
    return 0 if all(row.verified for row in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.multihost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per scenario (median GB/s)")
    parser.add_argument("--json", type=Path, default=Path("bench/out/multihost.json"))
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--d-netns", help=argparse.SUPPRESS)
    parser.add_argument("--p-address", help=argparse.SUPPRESS)
    parser.add_argument("--d-address", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return inside(args) if args.inside else outer(args)


if __name__ == "__main__":
    sys.exit(main())
