"""vLLM's own P/D proxies, unchanged, in front of kvsidecar and real CPU vLLM (issue 16).

The proxies are vLLM's files, extracted from vLLM's source distribution of the installed version
(``tests/support/upstream.py``; ``make upstream``), never copied into this repository. If they
cannot be fetched these tests fail with the reason.

- ``toy_proxy_server.py`` (vLLM's NIXL integration-test proxy): P gets ``do_remote_decode``, D gets
  the ``kv_transfer_params`` P returned. P's ``transfer_mode`` (its kv_transfer_config) travels in
  them, so the same proxy drives pull and push. Answers equal a plain instance's; D's prompt
  came from P (D's ``vllm:prompt_tokens_by_source``, and the bytes D's sidecar READ in pull mode or
  P's sidecar WROTE in push mode).
- ``disagg_proxy_multiturn.py``: conversations of 4 turns. The proxy pops ``conversation_id`` and
  would forward D's ``kv_transfer_params`` from the last chunk of D's stream, which vLLM 0.32's
  completion stream never carries: P's sidecar finds D's hold of the previous turn by the prompt's
  block hashes among the peers it knows. Every answer equals a plain instance's given the full
  conversation (streamed turns by token ids, the last one non-streamed by text: both of the
  proxy's paths); from turn 2 on P loads all but the new suffix from D.

Processes (started on first use, shared by the module, killed by process group at the end): sidecars
``a`` (P's) and ``b`` (D's), both with metrics; ``vllm serve`` D (``kv_consumer``, ``multi_turn``) and
one P per mode (``kv_both``, ``multi_turn``, prefix caching off so every prompt token P did not
compute came from D); a plain offline engine (the reference); the proxies. ``make test`` runs the
pull cases; the push cases (one more vLLM server) are marked ``upstream_full``
(``make upstream-proxies`` runs all).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sidecar.tools.launcher import kill_group
from tests.support.conversations import (
    BLOCK,
    BLOCK_BYTES,
    LAYERS,
    QUERY_TIMEOUT,
    PrefillCounters,
    Turn,
    check,
    fresh_tokens,
    healthy,
    loaded_from_d,
    post,
    post_stream,
    scrape,
    series_sum,
)
from tests.support.processes import SidecarProcess, python_env, wait_until
from tests.support.tiny_models import build_tiny_llama
from tests.support.upstream import upstream_file
from tests.support.vllm_engine import (
    VllmEngineProcess,
    VllmServer,
    free_port,
    remove_engine_shm_files,
    remove_orphaned_shm,
    sidecar_kv_transfer_config,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 12
# proxy file -> its health endpoint
PROXIES = {"toy_proxy_server.py": "/healthcheck", "disagg_proxy_multiturn.py": "/health"}


@pytest.fixture(autouse=True)
def no_leaked_shm() -> Iterator[None]:
    """Replaces conftest's check (other runs on the machine trip it); the engines' KV files are
    checked by engine id when ``stack`` ends."""
    yield


@dataclass
class Stack:
    workdir: Path
    model: Path
    token: str
    a: SidecarProcess
    b: SidecarProcess
    metrics: dict[str, int]  # sidecar name -> Prometheus port
    baseline: VllmEngineProcess
    decode: VllmServer
    prefills: dict[str, VllmServer] = field(default_factory=dict)  # mode -> P
    proxies: dict[tuple[str, str], tuple[subprocess.Popen[bytes], str]] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(17))

    def engine_ids(self) -> list[str]:
        return [self.decode.engine_id, *(server.engine_id for server in self.prefills.values())]

    def prefill(self, mode: str) -> VllmServer:
        if mode not in self.prefills:
            # The tiny model computes faster than any load: the measured break-even would skip the
            # loads this test checks, so the threshold alone decides.
            extra = {"multi_turn": True, "multi_turn_query_timeout": QUERY_TIMEOUT, "transfer_mode": mode,
                     "multi_turn_measure_costs": False}  # fmt: skip
            config = sidecar_kv_transfer_config(f"up-prefill-{mode}-{self.token}", "kv_both", self.a.socket, extra)
            server = VllmServer(
                self.workdir, f"prefill-{mode}", self.model, cpu=0, kv_transfer_config=config,
                extra_args=["--no-enable-prefix-caching"],
            )  # fmt: skip
            self.prefills[mode] = server
            server.wait_ready()
        return self.prefills[mode]

    def proxy(self, name: str, mode: str) -> str:
        """vLLM's proxy ``name`` in front of P (``mode``) and D, started once; its URL."""
        if (name, mode) not in self.proxies:
            prefill = self.prefill(mode)
            port = free_port()
            command = [
                sys.executable, str(upstream_file(name)), "--host", "127.0.0.1", "--port", str(port),
                "--prefiller-host", "127.0.0.1", "--prefiller-port", str(prefill.port),
                "--decoder-host", "127.0.0.1", "--decoder-port", str(self.decode.port),
            ]  # fmt: skip
            with (self.workdir / f"proxy-{name}-{mode}.log").open("ab") as log:
                process = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, env=python_env(), start_new_session=True
                )
            url = f"http://127.0.0.1:{port}"
            self.proxies[(name, mode)] = (process, url)
            wait_until(lambda: healthy(url + PROXIES[name]) or process.poll() is not None, 60.0, 0.2, f"{name}")
            assert process.poll() is None, f"{name} exited: {(self.workdir / f'proxy-{name}-{mode}.log').read_text()}"
        return self.proxies[(name, mode)][1]

    def sidecar_bytes(self, sidecar: str, op: str) -> float:
        text = scrape(f"http://127.0.0.1:{self.metrics[sidecar]}/metrics")
        return series_sum(text, "kvsidecar_transfer_bytes_total", op)

    def vouched_reads(self) -> float:
        """D's sidecar's pull READs that P's voucher vouched for (no confirming call to P)."""
        text = scrape(f"http://127.0.0.1:{self.metrics['b']}/metrics")
        return series_sum(text, "kvsidecar_pull_reads_total", 'checked_by="voucher"')

    def decode_sources(self) -> tuple[float, float]:
        """D's prompt tokens loaded from outside and computed (vllm:prompt_tokens_by_source)."""
        text, name = scrape(f"{self.decode.url}/metrics"), "vllm:prompt_tokens_by_source_total"
        return series_sum(text, name, 'source="external_kv_transfer"'), series_sum(text, name, 'source="local_compute"')

    def reference(self, prompt: list[int]) -> dict[str, Any]:
        return self.baseline.generate(prompt, MAX_TOKENS)


def _body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    for name in PROXIES:
        upstream_file(name)  # fetched before anything starts: a missing file fails at once
    workdir = Path(tempfile.mkdtemp(prefix="kvup-", dir="/tmp"))  # short: Unix socket paths
    token = uuid.uuid4().hex[:8]
    metrics = {"a": free_port(), "b": free_port()}
    a = SidecarProcess(workdir, "a", ["--metrics-listen", f"127.0.0.1:{metrics['a']}"])
    b = SidecarProcess(workdir, "b", ["--metrics-listen", f"127.0.0.1:{metrics['b']}"])
    shm_before = {path.name for path in Path("/dev/shm").iterdir()}
    baseline: VllmEngineProcess | None = None
    decode: VllmServer | None = None
    made: Stack | None = None
    try:
        a.start()
        b.start()
        baseline = VllmEngineProcess(workdir, "baseline", model, cpu=0)
        config = sidecar_kv_transfer_config(f"up-decode-{token}", "kv_consumer", b.socket, {"multi_turn": True})
        decode = VllmServer(workdir, "decode", model, cpu=1, kv_transfer_config=config)
        made = Stack(workdir, model, token, a, b, metrics, baseline, decode)
        made.prefill("pull")  # started while the others start
        baseline.wait_ready(180.0)
        decode.wait_ready()
        yield made
    finally:
        engine_ids = made.engine_ids() if made is not None else []
        if made is not None:
            for process, _ in made.proxies.values():
                kill_group(process)
            for server in made.prefills.values():
                server.stop()
        if decode is not None:
            decode.stop()
        if baseline is not None:
            baseline.stop(timeout=20.0)
        for sidecar in (a, b):
            sidecar.kill()
        leaked = [path for engine_id in engine_ids for path in remove_engine_shm_files(engine_id)]
        remove_orphaned_shm(shm_before)  # vLLM's own queues of a killed server
        if os.environ.get("KVSIDECAR_KEEP_TEST_LOGS"):
            print(f"\nlogs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        assert not leaked, f"KV shared-memory files left behind: {leaked}"


def _toy_proxy(stack: Stack, mode: str) -> None:
    url = stack.proxy("toy_proxy_server.py", mode)
    moved_op, moved_by = ("READ", "b") if mode == "pull" else ("WRITE", "a")  # P->D: D reads, or P writes
    for length in (70, 161):  # a partial last block, and several blocks
        prompt = fresh_tokens(length, stack.rng)
        d_before, moved_before = stack.decode_sources(), stack.sidecar_bytes(moved_by, moved_op)
        answer = post(f"{url}/v1/completions", _body(prompt))["choices"][0]
        reference = stack.reference(prompt)
        assert answer["token_ids"] == reference["token_ids"], f"toy proxy, {mode}, {length} tokens"
        assert answer["text"] == reference["text"]

        def on_d(before: tuple[float, float] = d_before, length: int = length) -> tuple[float, float] | None:
            now = stack.decode_sources()
            delta = (now[0] - before[0], now[1] - before[1])
            return delta if sum(delta) >= length else None

        external, computed = wait_until(on_d, 15.0, 0.1, "D's prompt token metrics")
        # D computed at most the last prompt token: the rest came from P, every block of it.
        assert external >= length - 1 and computed <= 1, f"toy proxy, {mode}: D {external}, {computed}"
        moved = stack.sidecar_bytes(moved_by, moved_op) - moved_before
        blocks = -(-length // BLOCK)  # every block of the prompt (an inline load counts one token less)
        assert moved == blocks * LAYERS * BLOCK_BYTES, f"toy proxy, {mode}: {moved} bytes {moved_op} by {moved_by}"


def _multiturn_proxy(stack: Stack, mode: str, turns: int = 4) -> None:
    url = stack.proxy("disagg_proxy_multiturn.py", mode)
    counters = PrefillCounters(stack.prefill(mode).url, stack.metrics["a"])
    conversation = f"up-{mode}-{stack.token}"
    prompt = fresh_tokens(150, stack.rng)
    done: list[Turn] = []
    for index in range(turns):
        what = f"upstream multi-turn proxy, {mode}, turn {index + 1}"
        before = counters.now()
        reference = stack.reference(prompt)
        body = _body(prompt, conversation_id=conversation)
        if index < turns - 1:  # streamed: the proxy passes D's chunks through; token ids compared
            chunks = post_stream(f"{url}/v1/completions", body)
            choices = [choice for chunk in chunks for choice in chunk["choices"]]
            answer = [token for choice in choices for token in choice.get("token_ids") or ()]
            text = "".join(choice.get("text") or "" for choice in choices)
            assert answer == reference["token_ids"], what
        else:  # non-streamed: the proxy collects D's stream into one answer (text only)
            text = post(f"{url}/v1/completions", body)["choices"][0]["text"]
            answer = reference["token_ids"]
        assert text == reference["text"], what
        turn = counters.turn(before, prompt, answer)
        expected = loaded_from_d(len(done[-1].prompt) + len(done[-1].answer), len(prompt)) if done else 0
        assert index == 0 or expected > 0, what  # the scenario must exercise reuse
        check(turn, expected, what)
        done.append(turn)
        prompt = prompt + answer + fresh_tokens(40, stack.rng)


def test_toy_proxy_pull(stack: Stack) -> None:
    vouched_before = stack.vouched_reads()
    _toy_proxy(stack, "pull")
    # P's shim vouched for its blocks (kvsidecar.voucher) once its sidecar's first answer gave it
    # the key: D's sidecar read the second prompt's KV without asking P's sidecar first.
    assert stack.vouched_reads() > vouched_before, "no pull read on P's voucher"
    # The shim capped the shm queue busy loop in both of D's engine processes (engine_spin), so an
    # engine that only waits for KV leaves the cores to the sidecar.
    log = stack.decode.log_path.read_text(errors="replace")
    capped = [line for line in log.splitlines() if "busy-loop at most" in line]
    assert any("EngineCore" in line for line in capped), capped
    assert any("Worker" in line for line in capped), capped
    # A request reaching D's EngineCore ends its workers' idle waits (input_wake): the EngineCore
    # found vLLM's input queue and the worker listens.
    assert "input to the EngineCore wakes 1 idle worker(s)" in log
    assert "idle steps wake on input to the EngineCore" in log


def test_multiturn_proxy_pull(stack: Stack) -> None:
    _multiturn_proxy(stack, "pull")


@pytest.mark.upstream_full
def test_toy_proxy_push(stack: Stack) -> None:
    _toy_proxy(stack, "push")


@pytest.mark.upstream_full
def test_multiturn_proxy_push(stack: Stack) -> None:
    _multiturn_proxy(stack, "push")
