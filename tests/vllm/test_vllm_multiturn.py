"""Multi-turn KV reuse end to end with real vLLM on the CPU (issue 16).

Processes (started once, killed by PID / process group at the end):
- sidecars ``a`` (P's, with its Prometheus endpoint) and ``b`` (D's);
- ``vllm serve`` P (``kv_both``, ``multi_turn``, prefix caching off, so every token P did not
  compute came from D) and D (``kv_consumer``, ``multi_turn``: holds every finished turn);
- ``examples/pd_proxy.py`` in pull mode and in push mode (P->D); it keeps no state;
- a plain offline vLLM engine: the reference answer for every full conversation.

Conversations send token ids (the previous prompt + the answer + new tokens), so the history is
exactly what D computed. For each turn the test reads, on P, vLLM's ``vllm:prompt_tokens_by_source``
(external_kv_transfer / local_compute) and, on P's sidecar, the bytes its NIXL READs moved (P->D
goes through D's READs in pull mode and P's WRITEs in push mode, so P's READs are D->P only).
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

from tests.support.conversations import (
    BLOCK,
    QUERY_TIMEOUT,
    PrefillCounters,
    Turn,
    check,
    fresh_tokens,
    healthy,
    loaded_from_d,
    post,
)
from tests.support.processes import REPO, SidecarProcess, python_env, wait_until
from tests.support.tiny_models import build_tiny_llama
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


@pytest.fixture(autouse=True)
def no_leaked_shm() -> Iterator[None]:
    """Replaces conftest's check (other runs on the machine trip it); the engines' own KV files
    are checked by engine id when ``setup`` ends."""
    yield


@dataclass
class Setup:
    workdir: Path
    model: Path
    token: str
    a: SidecarProcess
    b: SidecarProcess
    a_metrics: int
    baseline: VllmEngineProcess
    prefill: VllmServer
    decode: VllmServer
    proxies: dict[str, str] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(16))

    def counters(self) -> PrefillCounters:
        return PrefillCounters(self.prefill.url, self.a_metrics)

    def turn(self, mode: str, prompt: list[int], conversation_id: str = "") -> Turn:
        """One turn through the proxy: the answer must equal a plain instance's for the same full
        conversation; returns what P's metrics and P's sidecar counted for it."""
        before = self.counters().now()
        body: dict[str, Any] = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if conversation_id:
            body["conversation_id"] = conversation_id
        answer = post(f"{self.proxies[mode]}/v1/completions", body)["choices"][0]["token_ids"]
        reference = self.baseline.generate(prompt, MAX_TOKENS)["token_ids"]
        assert answer == reference, f"{mode} turn of {len(prompt)} tokens: {answer} != {reference}"
        return self.counters().turn(before, prompt, answer)

    def conversation(self, mode: str, first: int, turns: int, new: int, conversation_id: str = "") -> list[Turn]:
        """``turns`` turns; from turn 2 on P must load the previous turn's KV from D."""
        done: list[Turn] = []
        prompt = fresh_tokens(first, self.rng)
        for index in range(turns):
            turn = self.turn(mode, prompt, conversation_id)
            expected = loaded_from_d(len(done[-1].prompt) + len(done[-1].answer), len(prompt)) if done else 0
            what = f"{mode} conversation {conversation_id or '(no id)'} turn {index + 1}"
            assert index == 0 or expected > 0, what  # the scenario must exercise reuse
            check(turn, expected, what)
            done.append(turn)
            prompt = prompt + turn.answer + fresh_tokens(new, self.rng)
        return done


def _servers(workdir: Path, model: Path, token: str, a: SidecarProcess, b: SidecarProcess) -> list[VllmServer]:
    # The tiny model computes faster than any load: the measured break-even would skip the loads
    # this test checks, so the threshold alone decides.
    prefill_extra = {"multi_turn": True, "multi_turn_query_timeout": QUERY_TIMEOUT, "multi_turn_measure_costs": False}
    return [
        VllmServer(
            workdir,
            "prefill",
            model,
            cpu=0,
            kv_transfer_config=sidecar_kv_transfer_config(f"mt-prefill-{token}", "kv_both", a.socket, prefill_extra),
            extra_args=["--no-enable-prefix-caching"],
        ),
        decode_server(workdir, model, token, b),
    ]


def decode_server(workdir: Path, model: Path, token: str, b: SidecarProcess, port: int | None = None) -> VllmServer:
    config = sidecar_kv_transfer_config(f"mt-decode-{token}", "kv_consumer", b.socket, {"multi_turn": True})
    return VllmServer(workdir, "decode", model, cpu=1, kv_transfer_config=config, port=port)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    workdir = Path(tempfile.mkdtemp(prefix="kvmt-", dir="/tmp"))  # short: Unix socket paths
    token = uuid.uuid4().hex[:8]
    a_metrics = free_port()
    a = SidecarProcess(workdir, "a", ["--metrics-listen", f"127.0.0.1:{a_metrics}", "--log-level", "debug"])
    b = SidecarProcess(workdir, "b", ["--log-level", "debug"])
    shm_before = {path.name for path in Path("/dev/shm").iterdir()}
    servers: list[VllmServer] = []
    proxies: list[subprocess.Popen[bytes]] = []
    baseline: VllmEngineProcess | None = None
    made: Setup | None = None
    try:
        a.start()
        b.start()
        baseline = VllmEngineProcess(workdir, "baseline", model, cpu=0)
        servers = _servers(workdir, model, token, a, b)
        baseline.wait_ready(180.0)
        for server in servers:
            server.wait_ready()
        made = Setup(workdir, model, token, a, b, a_metrics, baseline, servers[0], servers[1])
        for mode in ("pull", "push"):
            port = free_port()
            command = [sys.executable, str(REPO / "examples" / "pd_proxy.py"), "--prefill", servers[0].url,
                       "--decode", servers[1].url, "--port", str(port), "--mode", mode, "--timeout", "120"]  # fmt: skip
            with (workdir / f"proxy-{mode}.log").open("ab") as log:
                proxies.append(
                    subprocess.Popen(
                        command, stdout=log, stderr=subprocess.STDOUT, env=python_env(), start_new_session=True
                    )
                )
            made.proxies[mode] = f"http://127.0.0.1:{port}"
        for url in made.proxies.values():
            wait_until(lambda url=url: healthy(f"{url}/health"), 30.0, 0.2, f"proxy {url}")
        yield made
    finally:
        for proxy in proxies:
            proxy.kill()
            proxy.wait(10)
        if made is not None:
            servers = [made.prefill, made.decode]  # the test may have restarted D
        for server in servers:
            server.stop()
        if baseline is not None:
            baseline.stop(timeout=20.0)
        for sidecar in (a, b):
            sidecar.kill()
        leaked = [path for name in ("prefill", "decode") for path in remove_engine_shm_files(f"mt-{name}-{token}")]
        remove_orphaned_shm(shm_before)  # vLLM's own queues of a killed server
        if os.environ.get("KVSIDECAR_KEEP_TEST_LOGS"):
            print(f"\nlogs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        assert not leaked, f"KV shared-memory files left behind: {leaked}"


def test_multi_turn_conversations_reuse_d_s_kv_through_the_proxy(setup: Setup) -> None:
    """Several scenarios on one pair of servers (starting vLLM is the expensive part)."""
    # Four turns by conversation id, P->D by pull and by push; D->P is always P's sidecar reading
    # D's hold.
    chat = setup.conversation("pull", first=150, turns=4, new=40, conversation_id=f"conv-pull-{setup.token}")
    setup.conversation("push", first=130, turns=4, new=40, conversation_id=f"conv-push-{setup.token}")
    # No conversation id at all: P's sidecar finds the hold by the prompt's block hashes among the
    # sidecars it knows.
    setup.conversation("pull", first=140, turns=2, new=40)

    # Threshold: D holds one full block (40 + 12 - 1 computed tokens): 32 < 64, so P computes.
    short = fresh_tokens(40, setup.rng)
    first = setup.turn("pull", short, "conv-short")
    second = setup.turn("pull", short + first.answer + fresh_tokens(40, setup.rng), "conv-short")
    check(second, 0, "below the recompute threshold")

    # An edited history (a token in block 3 changed): only the three blocks before it are reused.
    edited_conv = f"conv-edit-{setup.token}"
    first = setup.turn("pull", fresh_tokens(150, setup.rng), edited_conv)
    history = first.prompt + first.answer
    history[100] = 3 if history[100] != 3 else 4
    edited = setup.turn("pull", history + fresh_tokens(30, setup.rng), edited_conv)
    check(edited, 3 * BLOCK, "edited history")

    # D restarts between turns: its holds are gone, P computes, the answer is still right; the
    # next turn reuses again.
    setup.decode.stop()
    setup.decode = decode_server(setup.workdir, setup.model, setup.token, setup.b, setup.decode.port).wait_ready()
    conv = f"conv-pull-{setup.token}"
    last = chat[-1]
    after_restart = setup.turn("pull", last.prompt + last.answer + fresh_tokens(40, setup.rng), conv)
    check(after_restart, 0, "D restarted")
    again = setup.turn("pull", after_restart.prompt + after_restart.answer + fresh_tokens(40, setup.rng), conv)
    total = len(after_restart.prompt) + len(after_restart.answer)
    check(again, loaded_from_d(total, len(again.prompt)), "the turn after D's restart")
