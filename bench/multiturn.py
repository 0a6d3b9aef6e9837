"""Multi-turn reuse: P's time to first token at turn 2 when it loads the history from D through the
sidecars vs when it recomputes it, with P's prefix cache off and on.

Processes, all in ONE invocation: sidecars ``a`` (P's) and ``b`` (D's) on loopback; ``vllm serve`` D
(``kv_consumer``, ``multi_turn``: it holds every finished turn) and ``vllm serve`` P (``kv_both``,
``multi_turn``), P started twice: prefix caching off, then on. The model is bench/vllm_pd.py's
KV-heavy tiny random Llama (16 KiB of KV per token); P's vLLM is pinned to core 0, D's to core 1.

Per history size H and run, a fresh conversation (its own ``conversation_id``):
- turn 1: a prompt of H - ANSWER tokens: P's leg (``max_tokens=1``), then D's leg with P's
  ``kv_transfer_params`` (D answers ANSWER tokens and holds the turn);
- turn 2: history + answer + NEW tokens: P's leg is timed (non-streamed, one token: its latency
  is P's TTFT); D's leg (one token) follows, untimed, so P's blocks are consumed.
In the same P server, reuse and recompute alternate conversation by conversation: recompute sends
``"multi_turn": false`` in P's ``kv_transfer_params`` (P does not look for D's hold and computes what
its own prefix cache lacks). P's prompt tokens by source (``vllm:prompt_tokens_by_source``) are
recorded per turn 2 so the table shows what was loaded. Medians per (prefix cache, size, mode) and
the ratio recompute / reuse.

P runs with the connector's defaults (``multi_turn_query_timeout``, the measured break-even), as a
user gets them; ``--query-timeout`` sets the bound. With ``--turns N`` every conversation goes on to
turn N (each turn: the history, D's answer, NEW tokens); the table still times turn 2, and every
reuse turn from the second (warm-up included) is counted: did P load from D, and its lookup
outcome (``vllm:kvsidecar_multi_turn_lookups_total``).

Run: ``python -m bench.multiturn [--json bench/out/multiturn.json] [--png bench/out/multiturn.png]
[--sizes 1024 4096 8192] [--runs 3] [--turns 2]``; ``make bench-multiturn``. Kills what it started (process
groups) and removes the shim's /dev/shm files on success, failure and Ctrl-C; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.vllm_pd import MODEL_SPEC, Reaper, Server
from sidecar.tools.launcher import DaemonProcess
from tests.support.tiny_models import build_tiny_llama
from tests.support.vllm_engine import sidecar_kv_transfer_config

REPO = Path(__file__).resolve().parents[1]

ANSWER = 128  # D's answer at turn 1 (tokens)
NEW = 64  # the user's new message at turn 2 (tokens)
SOURCES = ("external_kv_transfer", "local_cache_hit", "local_compute")
LOOKUPS = "vllm:kvsidecar_multi_turn_lookups_total{"  # P's lookup outcomes (hit, or why it computed)
# Where a reuse turn's time goes, from P's /metrics (sums of the connector's histograms, seconds):
# the scheduler holding the request back for its lookup, and the Pull until the KV was in.
PARTS = {
    "lookup_wait": "vllm:kvsidecar_multi_turn_wait_seconds_sum",
    "load": "vllm:kvsidecar_receive_time_seconds_sum",
    "queue": "vllm:request_queue_time_seconds_sum",
    "prefill": "vllm:request_prefill_time_seconds_sum",
    "e2e": "vllm:e2e_request_latency_seconds_sum",
}


@dataclass
class Row:
    prefix_caching: bool
    size: int
    mode: str  # "reuse" | "recompute"
    ttft_ms: list[float] = field(default_factory=list)
    sources: list[dict[str, float]] = field(default_factory=list)
    # Every turn from the second of this row's conversations (warm-up included): P's lookup
    # outcome and whether it loaded from D.
    later_turns: list[dict[str, Any]] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ttft_ms) if self.ttft_ms else float("nan")


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def prompt_sources(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10.0) as response:
        text = response.read().decode()
    found = dict.fromkeys(SOURCES, 0.0)
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            for source in SOURCES:
                if f'source="{source}"' in line:
                    found[source] += float(line.rsplit(" ", 1)[1])
        for part, name in PARTS.items():
            if line.startswith(name + "{"):
                found[part] = found.get(part, 0.0) + float(line.rsplit(" ", 1)[1]) * 1000.0  # ms
        if line.startswith(LOOKUPS) and 'outcome="' in line:
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            found[f"lookup:{outcome}"] = found.get(f"lookup:{outcome}", 0.0) + float(line.rsplit(" ", 1)[1])
    return found


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path, reaper: Reaper) -> None:
        self.args = args
        self.workdir = workdir
        self.reaper = reaper
        self.token = uuid.uuid4().hex[:6]
        self.model = build_tiny_llama(workdir / "model", **MODEL_SPEC)
        self.rng = random.Random(16)
        self.rows: list[Row] = []

    def sidecar(self, name: str) -> DaemonProcess:
        sidecar = DaemonProcess(self.workdir, name, [])
        self.reaper.sidecars.append(sidecar)
        return sidecar.start()

    def server(self, name: str, role: str, cpu: int, socket: Path, prefix_caching: bool = True) -> Server:
        engine_id = f"mtb-{name}-{self.token}"
        # The connector's own defaults (multi_turn_query_timeout, the measured break-even) unless
        # --query-timeout is given: what a user gets.
        extra: dict[str, Any] = {"multi_turn": True, "transfer_mode": "pull"}
        if self.args.query_timeout:
            extra["multi_turn_query_timeout"] = self.args.query_timeout
        config = sidecar_kv_transfer_config(engine_id, role, socket, extra)
        flags = [] if prefix_caching else ["--no-enable-prefix-caching"]
        server = Server(
            self.workdir, name, self.model, cpu=cpu, kv_space_gib=2, kv_transfer_config=config, patch_dirs=[],
            extra_args=flags,
        )  # fmt: skip
        self.reaper.servers.append(server)
        self.reaper.engine_ids.append(engine_id)
        server.wait_ready(600.0)
        return server

    def turn(self, prefill: Server, decode: Server, prompt: list[int], conversation: str, reuse: bool,
             answer: int) -> tuple[float, list[int], dict[str, float]]:  # fmt: skip
        """P's leg (timed) then D's leg; returns P's latency, D's answer and P's prompt tokens by source."""
        params: dict[str, Any] = {"do_remote_decode": True, "conversation_id": conversation,
                                  "transfer_id": uuid.uuid4().hex, "transfer_mode": "pull"}  # fmt: skip
        if not reuse:
            params["multi_turn"] = False
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        before = prompt_sources(prefill.url)
        started = time.perf_counter()
        p_answer = post(f"{prefill.url}/v1/completions", {**body, "kv_transfer_params": params})
        ttft_ms = (time.perf_counter() - started) * 1000.0
        d_params = dict(p_answer.get("kv_transfer_params") or {}, conversation_id=conversation)
        d_body = {**body, "max_tokens": answer, "return_token_ids": True, "kv_transfer_params": d_params}
        tokens = post(f"{decode.url}/v1/completions", d_body)["choices"][0]["token_ids"]
        deadline = time.monotonic() + 15.0
        while True:  # P's metrics catch up with its last request
            after = prompt_sources(prefill.url)
            delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in {*after, *before}}
            looked = not reuse or any(value for key, value in delta.items() if key.startswith("lookup:"))
            counted = sum(delta.get(source, 0.0) for source in SOURCES) >= len(prompt)
            if (counted and looked) or time.monotonic() > deadline:
                return ttft_ms, tokens, delta
            time.sleep(0.05)

    def conversation(
        self, prefill: Server, decode: Server, size: int, reuse: bool, row: Row | None = None
    ) -> tuple[float, dict[str, float]]:
        """Turns 1..--turns; returns P's TTFT at turn 2 and its prompt sources. Every turn from the
        second (D answers ANSWER tokens but at the last) goes to ``row.later_turns``."""
        conversation = f"bench-{uuid.uuid4().hex[:8]}"
        prompt = [self.rng.randrange(3, 1000) for _ in range(size - ANSWER)]
        _, answer, _ = self.turn(prefill, decode, prompt, conversation, True, ANSWER)
        second: tuple[float, dict[str, float]] | None = None
        for index in range(2, self.args.turns + 1):
            prompt = prompt + answer + [self.rng.randrange(3, 1000) for _ in range(NEW)]
            last = index == self.args.turns
            ttft_ms, answer, sources = self.turn(prefill, decode, prompt, conversation, reuse, 1 if last else ANSWER)
            second = second or (ttft_ms, sources)
            outcomes = {key[len("lookup:") :]: value for key, value in sources.items() if key.startswith("lookup:")}
            if row is not None:
                row.later_turns.append(
                    {"turn": index, "history": len(prompt) - NEW, "loaded": sources.get("external_kv_transfer", 0.0),
                     "ttft_ms": ttft_ms, "outcomes": {k: v for k, v in outcomes.items() if v}}
                )  # fmt: skip
        assert second is not None
        return second

    def run(self) -> None:
        a, b = self.sidecar("a"), self.sidecar("b")
        decode = self.server("decode", "kv_consumer", 1, b.socket)
        for prefix_caching in {"off": (False,), "on": (True,), "both": (False, True)}[self.args.prefix_caching]:
            prefill = self.server(f"prefill-pc{int(prefix_caching)}", "kv_both", 0, a.socket, prefix_caching)
            try:
                for size in self.args.sizes:
                    rows = {mode: Row(prefix_caching, size, mode) for mode in ("reuse", "recompute")}
                    self.conversation(prefill, decode, size, True, rows["reuse"])  # warm-up: TTFT not recorded
                    for run in range(self.args.runs):
                        for mode in ("reuse", "recompute") if run % 2 == 0 else ("recompute", "reuse"):
                            ttft_ms, sources = self.conversation(prefill, decode, size, mode == "reuse", rows[mode])
                            rows[mode].ttft_ms.append(ttft_ms)
                            rows[mode].sources.append(sources)
                            print(f"prefix_caching={prefix_caching} size={size} {mode}: {ttft_ms:.0f} ms {sources}",
                                  flush=True)  # fmt: skip
                    self.rows.extend(rows.values())
            finally:
                prefill.stop()


def markdown(rows: list[Row]) -> str:
    lines = [
        "| P's prefix cache | history (tokens) | P's TTFT, recompute | P's TTFT, reuse from D | recompute / reuse "
        "| P's prompt tokens loaded from D (reuse) | reuse: lookup wait, load (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    by_key = {(row.prefix_caching, row.size, row.mode): row for row in rows}
    for (caching, size, mode), row in sorted(by_key.items()):
        if mode != "reuse":
            continue
        recompute = by_key[(caching, size, "recompute")]
        loaded = statistics.median(s["external_kv_transfer"] for s in row.sources) if row.sources else 0
        parts = [statistics.median(s.get(part, 0.0) for s in row.sources) if row.sources else 0.0 for part in PARTS]
        lines.append(
            f"| {'on' if caching else 'off'} | {size} | {recompute.median_ms:.0f} ms | {row.median_ms:.0f} ms "
            f"| {recompute.median_ms / row.median_ms:.2f}x | {loaded:.0f} | {parts[0]:.0f}, {parts[1]:.0f} |"
        )
    return "\n".join(lines)


def loaded_turns(rows: list[Row]) -> str:
    """Per prefix-cache setting and size: reuse turns from the second that loaded from D, and the
    lookup outcomes of all of them (hit, or why P computed)."""
    lines = []
    for row in sorted(rows, key=lambda r: (r.prefix_caching, r.size)):
        if row.mode != "reuse" or not row.later_turns:
            continue
        outcomes: dict[str, float] = {}
        for turn in row.later_turns:
            for outcome, count in turn["outcomes"].items():
                outcomes[outcome] = outcomes.get(outcome, 0.0) + count
        loaded = sum(1 for turn in row.later_turns if turn["loaded"] > 0)
        lines.append(
            f"prefix cache {'on' if row.prefix_caching else 'off'}, {row.size}: {loaded} of {len(row.later_turns)} "
            f"reuse turns from the second loaded from D; lookups {dict(sorted(outcomes.items()))}"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for axis, caching in zip(axes, (False, True), strict=True):
        for mode, marker in (("recompute", "o"), ("reuse", "s")):
            points = sorted((r.size, r.median_ms) for r in rows if r.prefix_caching == caching and r.mode == mode)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker=marker, label=mode)
        axis.set_title(f"P's prefix cache {'on' if caching else 'off'}")
        axis.set_xlabel("history at turn 2 (tokens)")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("P's TTFT at turn 2 (ms, median)")
    axes[0].legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.multiturn", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prefix-caching", choices=("off", "on", "both"), default="both", help="P's prefix cache")
    parser.add_argument("--turns", type=int, default=2, help="turns per conversation (the table times turn 2)")
    parser.add_argument(
        "--query-timeout", type=float, default=0.0, help="P's multi_turn_query_timeout (default: the connector's)"
    )
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "out" / "multiturn.json")
    parser.add_argument("--png", type=Path, default=REPO / "bench" / "out" / "multiturn.png")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kvmtb-", dir="/tmp"))
    reaper = Reaper()
    bench = Bench(args, workdir, reaper)
    try:
        bench.run()
    finally:
        reaper.kill_all()
        shutil.rmtree(workdir, ignore_errors=True)
    table = markdown(bench.rows)
    print(table)
    print(loaded_turns(bench.rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"rows": [asdict(row) for row in bench.rows], "table": table, "loaded_turns": loaded_turns(bench.rows)}
    args.json.write_text(json.dumps(report, indent=1))
    plot(bench.rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
