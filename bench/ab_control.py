"""Before/after of the control path: ``kvsidecar bench --only control`` from two checkouts,
alternating A, B, A, B, ... (``--rounds`` each) on one machine state, then the median over the
rounds of each row's latency and control-path p50/p99 (issue 10's figure: 100 req/s).

    /work/wt/isolated python bench/ab_control.py A_DIR B_DIR --out DIR [--rounds 3]

Each run is ``python -m sidecar.app.cli bench --only control`` with PYTHONPATH=<checkout> from
that checkout's directory; its JSON stays in ``DIR/{a,b}-N.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

FIELDS = (
    ("p50_ms", None),
    ("p99_ms", None),
    ("control_p50_ms", "extra"),
    ("control_p99_ms", "extra"),
    ("control_from_last_call_p50_ms", "extra"),
)


def run(checkout: Path, out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    command = [sys.executable, "-m", "sidecar.app.cli", "bench", "--only", "control", "--json", str(out)]
    subprocess.run(command, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def rows(path: Path) -> dict[tuple[str, str], dict[str, float]]:
    found = {}
    for row in json.loads(path.read_text()):
        if row["scenario"].startswith("control-plane"):
            values = {name: (row["extra"] if where else row).get(name) for name, where in FIELDS}
            found[(row["scenario"], row["path"])] = {k: v for k, v in values.items() if v is not None}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for index in range(1, args.rounds + 1):
        for side, checkout in (("a", args.a), ("b", args.b)):
            started = time.monotonic()
            run(checkout.resolve(), args.out / f"{side}-{index}.json")
            print(f"{side}-{index}: {time.monotonic() - started:.0f} s", flush=True)
    print("| row | side | latency p50 / p99 ms | control p50 / p99 ms | control from the last call p50 ms |")
    print("|---|---|---|---|---|")
    found = {side: [rows(args.out / f"{side}-{n}.json") for n in range(1, args.rounds + 1)] for side in "ab"}
    for key in sorted(found["a"][0]):
        for side in "ab":
            medians = {
                name: statistics.median(run[key][name] for run in found[side] if name in run.get(key, {}))
                for name, _ in FIELDS
            }
            print(
                f"| {key[0]} {key[1]} | {side} | {medians['p50_ms']:.2f} / {medians['p99_ms']:.2f} | "
                f"{medians['control_p50_ms']:.2f} / {medians['control_p99_ms']:.2f} | "
                f"{medians['control_from_last_call_p50_ms']:.2f} |"
            )


if __name__ == "__main__":
    main()
