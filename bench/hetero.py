"""Heterogeneous transfers: GB/s of each converted path (block size, KV layout) against the
same-shape path, measured in one invocation at 16 MiB per request, in pull and push.

    python -m bench.hetero --json bench/out/hetero.json [--runs 5] [--quick]

Each case is a ``TransferPair`` (two ``kvsidecar serve`` daemons on loopback, a simulated engine on
each, real shared memory and NIXL) whose engines differ as the case says. Converted cases run
twice: ``direct`` (``staging_below_bytes=0``: one NIXL descriptor per contiguous run) and
``staged`` (every converted transfer through a staging buffer and a numpy permutation); ``auto``
in the output names what the default threshold picks. ``+digest`` rows run with
``integrity = digest``. Geometry: 8 layers x 8 KV heads x 512 bytes per token and head (head size
128, fp16, K and V) = 32 KiB per token, 512 tokens per request, blocks scattered over the pool.
GB/s is the median over runs of (request bytes x requests) / wall time, requests one at a time;
each run of a case alternates with a run of the same-shape pair (kept up for the whole invocation)
so the shared machine's noise hits both alike, and ``x same`` is the ratio of the two medians.
After the runs the consumer's blocks are cleared, moved once more and checked token by token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine_shim.memory import KvLayout
from sidecar.dataplane.convert_staging import STAGING_BELOW_BYTES
from sidecar.tools.workload import TransferPair

LAYERS, HEADS, CHUNK, TOKENS = 8, 8, 512, 512
REQUEST_BYTES = LAYERS * HEADS * CHUNK * TOKENS  # 16 MiB


@dataclass(frozen=True)
class Case:
    name: str
    p_block: int
    p_layout: str
    d_block: int
    d_layout: str
    kind: str  # "same", "block", "layout"


CASES = [
    Case("same-shape 16 HND", 16, "HND", 16, "HND", "same"),
    Case("block 16->64 HND", 16, "HND", 64, "HND", "block"),
    Case("block 64->16 HND", 64, "HND", 16, "HND", "block"),
    Case("block 16->64 NHD", 16, "NHD", 64, "NHD", "block"),
    Case("block 64->16 NHD", 64, "NHD", 16, "NHD", "block"),
    Case("layout NHD->HND 16", 16, "NHD", 16, "HND", "layout"),
    Case("layout HND->NHD 16", 16, "HND", 16, "NHD", "layout"),
]
STRATEGIES = {"direct": 0, "staged": 1 << 30}


@dataclass
class Row:
    case: str
    kind: str
    strategy: str
    mode: str
    integrity: bool
    gbps: float
    p50_ms: float
    same_shape_gbps: float
    ratio_vs_same_shape: float
    mean_run_bytes: int
    auto_picks: str
    verified: bool


def layout(block_size: int, kv_layout: str) -> KvLayout:
    blocks = 2 * TOKENS // block_size + 8
    return KvLayout(
        LAYERS, blocks, block_size * HEADS * CHUNK, block_size=block_size, kv_layout=kv_layout,
        num_kv_heads=HEADS, total_num_kv_heads=HEADS, head_size=128, dtype="float16",
    )  # fmt: skip


def mean_run_bytes(case: Case) -> int:
    """What the direct plan's descriptors average (the quantity the threshold compares)."""
    if case.p_layout != case.d_layout:
        return CHUNK
    small = min(case.p_block, case.d_block)
    if case.kind == "same":
        return case.p_block * HEADS * CHUNK
    return small * CHUNK * (1 if case.p_layout == "HND" else HEADS)


class Engines:
    """One started pair for a case, with its request's blocks."""

    def __init__(self, case: Case, strategy: str, integrity: bool) -> None:
        args = ["--set", f"staging_below_bytes={STRATEGIES.get(strategy, STAGING_BELOW_BYTES)}"]
        if integrity:
            args += ["--integrity", "digest"]
        rng = np.random.default_rng(7)
        p_layout, d_layout = layout(case.p_block, case.p_layout), layout(case.d_block, case.d_layout)
        self.p_blocks = rng.choice(p_layout.num_blocks, TOKENS // case.p_block, replace=False).tolist()
        self.d_blocks = rng.choice(d_layout.num_blocks, TOKENS // case.d_block, replace=False).tolist()
        self.pair = TransferPair(p_layout, sidecar_args=args, consumer_layout=d_layout).__enter__()
        assert self.pair.producer is not None
        self.pair.producer.fill_tokens(self.p_blocks, TOKENS, seed=3)

    def run(self, mode: str, rounds: int, latencies: list[float]) -> float:
        """GB/s of ``rounds`` requests one after another."""
        transfer = self.pair.push if mode == "push" else self.pair.pull
        started = time.perf_counter()
        for _ in range(rounds):
            latencies.append(transfer(self.p_blocks, self.d_blocks, TOKENS))
        return REQUEST_BYTES * rounds / (time.perf_counter() - started) / 1e9

    def verify(self, mode: str) -> bool:
        """Clear the consumer's blocks, move once more, check every token."""
        assert self.pair.consumer is not None
        self.pair.consumer.clear()
        self.run(mode, 1, [])
        check = self.pair.consumer.verify_tokens(self.d_blocks, 0, TOKENS, seed=3)
        return bool(check["bad_count"] == 0 and check["checked_tokens"] == TOKENS * LAYERS)

    def close(self) -> None:
        self.pair.close()


def measure(baseline: Engines, case: Case, strategy: str, integrity: bool, runs: int, rounds: int) -> list[Row]:
    """Runs of the case alternate with runs of the same-shape baseline, so the machine's noise
    (it is shared) hits both alike; the ratio is of the two medians."""
    engines = Engines(case, strategy, integrity)
    rows = []
    try:
        for mode in ("pull", "push"):
            engines.run(mode, 1, [])  # warm-up: handshakes, agents, staging buffers
            baseline.run(mode, 1, [])
            rates, base_rates, latencies = [], [], []
            for _ in range(runs):
                base_rates.append(baseline.run(mode, rounds, []))
                rates.append(engines.run(mode, rounds, latencies))
            run_bytes = mean_run_bytes(case)
            picks = "-" if case.kind == "same" else ("staged" if run_bytes < STAGING_BELOW_BYTES else "direct")
            gbps, base = statistics.median(rates), statistics.median(base_rates)
            rows.append(
                Row(
                    case=case.name, kind=case.kind, strategy=strategy, mode=mode, integrity=integrity, gbps=gbps,
                    p50_ms=statistics.median(latencies) * 1000, same_shape_gbps=base, ratio_vs_same_shape=gbps / base,
                    mean_run_bytes=run_bytes, auto_picks=picks, verified=engines.verify(mode),
                )
            )  # fmt: skip
    finally:
        engines.close()
    return rows


def run(runs: int, rounds: int, quick: bool, progress: Callable[[str], None]) -> list[Row]:
    plan: list[tuple[Case, str, bool]] = [(CASES[0], "direct", False)]
    cases = [CASES[1], CASES[3], CASES[5]] if quick else CASES[1:]
    for case in cases:
        plan += [(case, strategy, False) for strategy in STRATEGIES]
    plan += [(CASES[0], "direct", True), (CASES[5], "staged", True)]
    rows: list[Row] = []
    baseline = Engines(CASES[0], "direct", False)
    try:
        for case, strategy, integrity in plan:
            progress(f"{case.name} {strategy}{' +digest' if integrity else ''}")
            rows += measure(baseline, case, strategy, integrity, runs, rounds)
    finally:
        baseline.close()
    return rows


def render(rows: list[Row]) -> str:
    lines = ["case                  strategy  mode  digest  GB/s   p50 ms  same GB/s  x same  run B   auto    ok"]
    for row in rows:
        lines.append(
            f"{row.case:<21} {row.strategy:<9} {row.mode:<5} {'yes' if row.integrity else 'no':<7} "
            f"{row.gbps:<6.2f} {row.p50_ms:<7.1f} {row.same_shape_gbps:<10.2f} {row.ratio_vs_same_shape:<7.2f} "
            f"{row.mean_run_bytes:<7} {row.auto_picks:<7} {'yes' if row.verified else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.hetero", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4, help="requests per run")
    parser.add_argument("--quick", action="store_true", help="three converted cases instead of six")
    args = parser.parse_args(argv)
    started = time.monotonic()
    rows = run(args.runs, args.rounds, args.quick, lambda message: print(f"  {message}", file=sys.stderr, flush=True))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([asdict(row) for row in rows], indent=2))
    print(render(rows))
    print(f"\n{len(rows)} rows in {time.monotonic() - started:.0f}s -> {args.json}")
    return 0 if all(row.verified for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
