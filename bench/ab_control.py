"""Before/after of the control path: ``kvsidecar bench --only control`` from two checkouts,
alternating A, B, A, B, ... (``--rounds`` each) on one machine state, then the median over the
rounds of each row's latency and control-path p50/p99 (issue 10's figure: 100 req/s).

    /work/wt/isolated python -m bench.ab_control A_DIR B_DIR --out DIR [--rounds 3]

Each run is ``python -m sidecar.app.cli bench --only control`` with PYTHONPATH=<checkout> from
that checkout's directory; its JSON stays in ``DIR/{a,b}-N.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.checkouts import alternate, in_checkout

REPO = Path(__file__).resolve().parent.parent

FIELDS = (
    ("p50_ms", None),
    ("p99_ms", None),
    ("control_p50_ms", "extra"),
    ("control_p99_ms", "extra"),
    ("control_from_last_call_p50_ms", "extra"),
)


Rows = dict[tuple[str, str], dict[str, float]]


def rows(path: Path) -> Rows:
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
    args.out = args.out.resolve()  # each run's cwd is its checkout
    args.out.mkdir(parents=True, exist_ok=True)
    sides = {args.a.resolve(): "a", args.b.resolve(): "b"}

    def measure(checkout: Path, index: int) -> Rows:
        out = args.out / f"{sides[checkout]}-{index}.json"
        started = time.monotonic()
        command = [sys.executable, "-m", "sidecar.app.cli", "bench", "--only", "control", "--json", str(out)]
        in_checkout(checkout, command)
        print(f"{sides[checkout]}-{index}: {time.monotonic() - started:.0f} s", flush=True)
        return rows(out)

    by_checkout = alternate([args.a, args.b], args.rounds, measure)
    found = {sides[checkout]: results for checkout, results in by_checkout.items()}
    print("| row | side | latency p50 / p99 ms | control p50 / p99 ms | control from the last call p50 ms |")
    print("|---|---|---|---|---|")
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
