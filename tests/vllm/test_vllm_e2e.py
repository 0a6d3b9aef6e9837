"""End to end with real vLLM on the CPU: prefill and decode engines exchange KV through sidecars.

Processes (all started once per module, killed by PID/process group at the end):
- sidecars ``a`` and ``b`` (``kvsidecar serve``);
- ``baseline``: vLLM without a connector, the reference output;
- ``prefill`` (on ``a``), ``decode`` (on ``b``) and ``local_decode`` (on ``a``, same sidecar as P):
  offline vLLM engines with the SidecarConnector, driven over JSON lines (tests.support.vllm_engine);
- for the proxy test only: two ``vllm serve`` API servers and ``examples/pd_proxy.py``.

Every prompt is used once (fresh seeds), so no engine answers from its local prefix cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from engine_shim.client import SidecarClient
from tests.support.conversations import healthy, post, post_stream, scrape
from tests.support.processes import REPO, SidecarProcess, python_env, wait_until
from tests.support.tiny_models import build_tiny_llama, prompt_words
from tests.support.vllm_engine import (
    VllmEngineProcess,
    VllmServer,
    free_port,
    remove_engine_shm_files,
    remove_orphaned_shm,
    sidecar_kv_transfer_config,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK_SIZE = 32
MAX_TOKENS = 12
LAYERS = 2
# One block of one layer: 2 KV heads x 32 tokens x (2 x 32 head dims) x 4 bytes.
BLOCK_BYTES = 2 * BLOCK_SIZE * 64 * 4
PROMPT_LENGTHS = (100, 170, 230, 300)
LEASE_SECONDS = 3.0
_seeds = count(1000)


@pytest.fixture(autouse=True)
def no_leaked_shm() -> Iterator[None]:
    """Replaces conftest's check of every ``kvsidecar-*`` file in /dev/shm, which other test runs on
    the machine trip: this module's engines live for the whole module, make no such files, and
    their own (``kvsvllm-*``) files are checked by engine id when ``cluster`` ends."""
    yield


def fresh_prompt(length: int) -> str:
    return prompt_words(length, next(_seeds))


def early_push_params(cluster: Cluster, transfer_id: str) -> dict[str, Any]:
    """A decode leg sent before the prefill leg answered (push): D knows only P's engine id and
    sidecar address, and the router's transfer id."""
    host, _, port = cluster.a.address.rpartition(":")
    return {
        "do_remote_prefill": True,
        "remote_engine_id": cluster.engine_ids[0],
        "remote_host": host,
        "remote_port": int(port),
        "transfer_id": transfer_id,
        "transfer_mode": "push",
        "tp_size": 1,
    }


def blocks_of(length: int) -> int:
    return -(-length // BLOCK_SIZE)


@dataclass
class Cluster:
    workdir: Path
    model: Path
    token: str
    a: SidecarProcess
    b: SidecarProcess
    baseline: VllmEngineProcess
    prefill: VllmEngineProcess
    decode: VllmEngineProcess
    local_decode: VllmEngineProcess
    engine_ids: list[str] = field(default_factory=list)
    references: dict[str, dict[str, Any]] = field(default_factory=dict)

    def reference(self, prompt: str) -> list[int]:
        tokens: list[int] = self.baseline_answer(prompt)["token_ids"]
        return tokens

    def baseline_answer(self, prompt: str) -> dict[str, Any]:
        """One vLLM instance without a connector: the output every P/D combination must match."""
        if prompt not in self.references:
            self.references[prompt] = self.baseline.generate(prompt, MAX_TOKENS)
        return self.references[prompt]

    def prefill_leg(self, prompt: str, mode: str, transfer_id: str | None = None) -> dict[str, Any]:
        answer = self.prefill.generate(
            prompt, 1, {"do_remote_decode": True, "transfer_id": transfer_id or uuid.uuid4().hex, "transfer_mode": mode}
        )
        params: dict[str, Any] = answer["kv_transfer_params"]
        assert params and params["do_remote_prefill"] and params["transfer_mode"] == mode, answer
        return params


def decode_params(params: dict[str, Any]) -> dict[str, Any]:
    # vLLM copies P's own cache hits into D's num_cached_tokens when this key is present; without
    # it D reports what *it* did not compute, which is what these tests check.
    return {key: value for key, value in params.items() if key != "remote_prefill_cached_tokens"}


def assert_loaded_from_outside(answer: dict[str, Any], length: int, mode: str) -> None:
    transfer = answer["transfer"]
    assert transfer is not None and transfer["outcome"] == "received", answer
    # The scheduler loaded the whole prompt but its last token, which vLLM recomputes to sample the
    # first output token: a load inside that step (inline_load) does not count that token as
    # loaded; an asynchronous load counts it, then recomputes it.
    loaded = length - 1 if transfer["inline"] else length
    assert answer["external_tokens"] == loaded, answer
    # D's own prefill statistics count what was loaded as cached, not computed.
    assert answer["num_cached_tokens"] == loaded, answer
    if mode == "pull":
        assert transfer["bytes"] == blocks_of(length) * LAYERS * BLOCK_BYTES, answer


# More kv_connector_extra_config per engine.
EXTRA: dict[str, dict[str, Any]] = {
    "local_decode": {"memory_export": "torch_shm"},
    "decode": {"inline_load_max_tokens": 8192},
}


def start_engines(cluster_dir: Path, model: Path, token: str, a: SidecarProcess, b: SidecarProcess) -> Cluster:
    engines: list[VllmEngineProcess] = []
    try:
        baseline = VllmEngineProcess(cluster_dir, "baseline", model, cpu=0)
        engines.append(baseline)
        specs = [
            ("prefill", a, "kv_producer", 0),
            ("decode", b, "kv_consumer", 1),
            ("local_decode", a, "kv_consumer", 1),
        ]
        made = {}
        for name, sidecar, role, cpu in specs:
            engine = VllmEngineProcess(
                cluster_dir,
                name,
                model,
                cpu=cpu,
                sidecar=sidecar.socket,
                engine_id=f"{name}-{token}",
                role=role,
                # D runs one sequence at a time, so a request can be made to wait in its queue.
                max_num_seqs=1 if name == "decode" else 8,
                # The same-sidecar decoder shares its KV through the fallback export (torch's shm).
                # D loads a pull into an idle engine inline (opt-in); the hetero module, the
                # upstream clients and the benchmark's default rows cover asynchronous loads.
                extra=EXTRA.get(name),
            )
            engines.append(engine)
            made[name] = engine
        for engine in engines:
            engine.wait_ready(180.0)
    except BaseException:
        for engine in engines:
            engine.kill()
        raise
    cluster = Cluster(cluster_dir, model, token, a, b, baseline, made["prefill"], made["decode"], made["local_decode"])
    cluster.engine_ids = [f"{name}-{token}" for name, *_ in specs]
    return cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    # Unix socket paths are limited to 107 bytes: keep the sidecars' directory short.
    workdir = Path(tempfile.mkdtemp(prefix="kvsv-", dir="/tmp"))
    token = uuid.uuid4().hex[:8]
    # Submitted blocks are held for LEASE_SECONDS without a consumer heartbeat, short enough that
    # the keep-alive test shows heartbeats are what keeps them. Consumers heartbeat every
    # lease/6 seconds of *their own* setting, so both sidecars get it.
    lease = ["--lease-seconds", str(LEASE_SECONDS)]
    a, b = SidecarProcess(workdir, "a", lease), SidecarProcess(workdir, "b", lease)
    shm_before = {path.name for path in Path("/dev/shm").iterdir()}
    cluster = None
    try:
        a.start()
        b.start()
        cluster = start_engines(workdir, model, token, a, b)
        yield cluster
    finally:
        if cluster is not None:
            engines = (cluster.baseline, cluster.prefill, cluster.decode, cluster.local_decode)
            for engine in engines:
                engine.request_exit()  # all shut down at once
            for engine in engines:
                engine.stop(timeout=20.0)
        for sidecar in (a, b):
            sidecar.kill()
        leaked = [
            path for engine_id in (cluster.engine_ids if cluster else []) for path in remove_engine_shm_files(engine_id)
        ]
        # vLLM's own queues (multiprocessing shared memory) outlive a `vllm serve` whose group had
        # to be killed, resource tracker included: vLLM's, not ours, so removed rather than failed.
        vllm_orphans = remove_orphaned_shm(shm_before)
        if vllm_orphans:
            print(f"\nremoved vLLM's orphaned shared memory: {vllm_orphans}")
        if os.environ.get("KVSIDECAR_KEEP_TEST_LOGS"):
            print(f"\nlogs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        assert not leaked, f"KV shared-memory files left behind: {leaked}"


# --- P and D on two sidecars -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_decode_with_prefill_kv_equals_single_instance(cluster: Cluster, mode: str) -> None:
    for length in PROMPT_LENGTHS:
        prompt = fresh_prompt(length)
        params = cluster.prefill_leg(prompt, mode)
        assert params["remote_host"] + ":" + str(params["remote_port"]) == cluster.a.address
        assert params["remote_engine_id"] == cluster.engine_ids[0]
        assert len(params["remote_block_ids"][0]) == blocks_of(length)
        answer = cluster.decode.generate(prompt, MAX_TOKENS, decode_params(params))
        assert answer["token_ids"] == cluster.reference(prompt), f"{mode}, {length} tokens"
        assert_loaded_from_outside(answer, length, mode)
        # D computed nothing in its last step: a pull loads inside the step of the first token
        # (inline_load); a push stays asynchronous (it may wait for a prefill).
        assert answer["transfer"]["inline"] is (mode == "pull"), answer


def test_push_with_both_legs_dispatched_at_once(cluster: Cluster) -> None:
    """The router sends D its leg first (it only knows P's engine id and sidecar) and P second,
    with the same transfer_id; D's registration waits at P's sidecar until P's blocks arrive."""
    for length in (130, 260):
        prompt = fresh_prompt(length)
        transfer_id = uuid.uuid4().hex
        decode_leg = cluster.decode.send(
            "generate",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            kv_transfer_params=early_push_params(cluster, transfer_id),
        )
        time.sleep(0.3)  # let D register first (the other order is the sequential test above)
        cluster.prefill_leg(prompt, "push", transfer_id)
        answer = cluster.decode.reply(decode_leg, timeout=60.0)
        assert answer["token_ids"] == cluster.reference(prompt)
        assert_loaded_from_outside(answer, length, "push")


def test_negative_control_corrupted_prefill_kv_changes_the_output(cluster: Cluster) -> None:
    """Zeroing P's blocks after the prefill and before D loads them changes D's output: D really
    decodes from the transferred KV (and the positive tests are not vacuous)."""
    changed = 0
    for length in (120, 250):
        prompt = fresh_prompt(length)
        params = cluster.prefill_leg(prompt, "pull")
        cluster.prefill.command("corrupt", blocks=params["remote_block_ids"][0])
        answer = cluster.decode.generate(prompt, MAX_TOKENS, decode_params(params))
        assert_loaded_from_outside(answer, length, "pull")
        changed += answer["token_ids"] != cluster.reference(prompt)
    assert changed == 2


def test_keep_alive_holds_producer_blocks_while_consumer_request_waits(cluster: Cluster) -> None:
    """D is busy, so a P/D request waits in its queue longer than P's lease: the shim's KeepAlive
    makes D's sidecar heartbeat P's sidecar from the request's arrival, and the KV is still there
    when the request is finally scheduled."""
    # D runs one sequence at a time: 12 x 400 decode steps keep it busy ~25 s on this project's
    # slowest machine and several times the lease on a fast one (the assertion below checks it).
    busy = [cluster.decode.send("generate", prompt=fresh_prompt(40), max_tokens=400) for _ in range(12)]
    prompt = fresh_prompt(210)
    params = cluster.prefill_leg(prompt, "pull")
    answered = time.monotonic()
    waiting = cluster.decode.send(
        "generate", prompt=prompt, max_tokens=MAX_TOKENS, kv_transfer_params=decode_params(params)
    )
    for ident in busy:
        cluster.decode.reply(ident, timeout=120.0)
    answer = cluster.decode.reply(waiting, timeout=60.0)
    waited = time.monotonic() - answered
    assert waited > LEASE_SECONDS + 1.0, f"D was not busy long enough ({waited:.1f}s) to outlive P's lease"
    assert answer["token_ids"] == cluster.reference(prompt)
    assert_loaded_from_outside(answer, 210, "pull")
    # P's blocks were released because D read them, not because the lease ran out. (P's engine
    # learns it at its next step: a plain request makes one.)
    cluster.prefill.generate(fresh_prompt(10), 1)
    record = cluster.prefill.command("transfer", request_id=params["remote_request_id"])["transfer"]
    assert record is not None and record["outcome"] == "sent", record


def test_consumer_abort_releases_both_sides(cluster: Cluster) -> None:
    """D aborts a request waiting for a push: its sidecar drops the request and P's sidecar the
    registration, and vLLM gets its blocks back."""
    before = _status(cluster.decode)
    waiting = cluster.decode.send(
        "generate",
        prompt=fresh_prompt(190),
        max_tokens=MAX_TOKENS,
        kv_transfer_params=early_push_params(cluster, uuid.uuid4().hex),
    )
    wait_until(lambda: _sidecar_status(cluster.a).pending_push_registrations >= 1, 30.0, 0.1, "push registered at P")
    assert _sidecar_status(cluster.b).pending_receives == 1
    cluster.decode.command("abort", generate_id=waiting)
    assert cluster.decode.reply(waiting, timeout=10.0)["aborted"]
    wait_until(lambda: _sidecar_status(cluster.b).pending_receives == 0, 30.0, 0.1, "D's sidecar released it")
    wait_until(
        lambda: _sidecar_status(cluster.a).pending_push_registrations == 0, 30.0, 0.1, "P's registration dropped"
    )

    def blocks_back() -> bool:
        status = _status(cluster.decode)
        return bool(
            status["vllm_requests"] == before["vllm_requests"] and status["free_blocks"] == before["free_blocks"]
        )

    wait_until(blocks_back, 30.0, 0.1, "vLLM freed the aborted request's blocks")


# --- P and D on the same sidecar -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_same_sidecar(cluster: Cluster, mode: str) -> None:
    for length in (110, 290):
        prompt = fresh_prompt(length)
        params = cluster.prefill_leg(prompt, mode)
        answer = cluster.local_decode.generate(prompt, MAX_TOKENS, decode_params(params))
        assert answer["token_ids"] == cluster.reference(prompt), f"{mode}, {length} tokens"
        assert_loaded_from_outside(answer, length, mode)
        assert answer["transfer"]["inline"] is False, answer  # this D keeps the default: asynchronous


# --- the proxy in front of vLLM's API servers ------------------------------------------------------


def test_proxy_pull_push_and_concurrent_push(cluster: Cluster) -> None:
    """``examples/pd_proxy.py`` in front of two ``vllm serve`` instances (API + EngineCore
    processes, as deployed), in pull, push and concurrent-push flow."""
    token = cluster.token
    prefill_id, decode_id = f"srv-prefill-{token}", f"srv-decode-{token}"

    servers = [
        VllmServer(
            cluster.workdir,
            "prefill",
            cluster.model,
            cpu=0,
            kv_transfer_config=sidecar_kv_transfer_config(prefill_id, "kv_producer", cluster.a.socket),
            extra_env=STATS_EVERY_SECOND,
        ),
        VllmServer(
            cluster.workdir,
            "decode",
            cluster.model,
            cpu=1,
            kv_transfer_config=sidecar_kv_transfer_config(decode_id, "kv_consumer", cluster.b.socket),
            extra_env=STATS_EVERY_SECOND,
        ),
    ]
    proxies: list[subprocess.Popen[bytes]] = []
    try:
        for server in servers:
            server.wait_ready()
        urls = {}
        for mode, concurrent in (("pull", False), ("push", False), ("push", True)):
            port = free_port()
            command = [
                sys.executable,
                str(REPO / "examples" / "pd_proxy.py"),
                "--prefill",
                servers[0].url,
                "--decode",
                servers[1].url,
                "--port",
                str(port),
                "--mode",
                mode,
                "--timeout",
                "120",
            ]
            if concurrent:
                command += ["--concurrent", "--prefill-kv", f"{prefill_id}@{cluster.a.address}"]
            log = (cluster.workdir / f"proxy-{mode}-{concurrent}.log").open("ab")
            proxies.append(
                subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, env=python_env(), start_new_session=True
                )
            )
            log.close()
            urls[(mode, concurrent)] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            wait_until(lambda url=url: healthy(f"{url}/health"), 30.0, 0.2, f"proxy {url}")
        for (mode, concurrent), url in urls.items():
            for length in (140, 270):
                prompt = fresh_prompt(length)
                answer = post(
                    f"{url}/v1/completions",
                    {
                        "model": "tiny",
                        "prompt": prompt,
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0.0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    },
                )
                got = answer["choices"][0]
                assert got["token_ids"] == cluster.reference(prompt), f"{mode} concurrent={concurrent} {length}"
            # A streamed answer passes through the proxy chunk by chunk.
            prompt = fresh_prompt(180)
            text = _stream_text(
                f"{url}/v1/completions",
                {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
            )
            assert text == cluster.baseline_answer(prompt)["text"], f"{mode} concurrent={concurrent} streamed"
        # vLLM's own stat logger prints the connector's numbers ("KV Transfer metrics: ...").
        wait_until(lambda: _logged_count(servers[1], "Num received") > 0, 15.0, 0.2, "D logs KV received")
        wait_until(lambda: _logged_count(servers[0], "Num sent") > 0, 15.0, 0.2, "P logs KV sent")
        assert _logged_count(servers[1], "Num load failures") == 0
        # ... and its /metrics has them as vllm:kvsidecar_* series.
        wait_until(
            lambda: (_metric(servers[1], "vllm:kvsidecar_receive_time_seconds_count") or 0) > 0,
            15.0,
            0.2,
            "D's metrics",
        )
        wait_until(lambda: (_metric(servers[0], "vllm:kvsidecar_sent_bytes_count") or 0) > 0, 15.0, 0.2, "P's metrics")
        assert (_metric(servers[1], "vllm:kvsidecar_received_bytes_sum") or 0) > 0
        assert _metric(servers[1], "vllm:kvsidecar_load_failures_total") == 0  # present, and zero
        # The engine's part of each request's timeline (call -> event seen -> step that applied it).
        assert (_metric(servers[1], "vllm:kvsidecar_call_to_event_seconds_count") or 0) > 0
        assert (_metric(servers[1], "vllm:kvsidecar_event_to_step_seconds_count") or 0) > 0
    finally:
        for proxy in proxies:
            proxy.kill()
            proxy.wait(10)
        for server in servers:
            server.stop()


def _stream_text(url: str, body: dict[str, Any], timeout: float = 120.0) -> str:
    """POST with ``stream: true`` and join the text of the server-sent events."""
    chunks = post_stream(url, body, timeout)
    return "".join(chunk["choices"][0]["text"] if chunk.get("choices") else "" for chunk in chunks)


# --- failures ------------------------------------------------------------------------------------


def _status(engine: VllmEngineProcess) -> dict[str, Any]:
    return engine.command("status", timeout=10.0)


def _wait_registered(engine: VllmEngineProcess, sidecar: SidecarProcess, timeout: float = 30.0) -> None:
    def registered() -> bool:
        status = _status(engine)
        # The worker's stream and the scheduler's channel reconnect independently (the latter
        # after gRPC's reconnect backoff): both must be back before a prefill is offered again.
        return bool(status["connected"] and status["sidecar_id"] == sidecar.sidecar_id and status["offers_kv"])

    wait_until(registered, timeout, 0.2, f"{engine.name} registered with the restarted sidecar")


def _sidecar_status(sidecar: SidecarProcess) -> Any:
    with SidecarClient(sidecar.socket, timeout=5.0) as client:
        return client.status()


# The stats line is logged at INFO: ask for it, whatever the session's environment says.
STATS_EVERY_SECOND = {"VLLM_LOG_STATS_INTERVAL": "1", "VLLM_LOGGING_LEVEL": "INFO"}


def _logged_count(server: VllmServer, name: str) -> int:
    """The sum of ``name=<n>`` over the "KV Transfer metrics" lines in a vLLM server's log."""
    text = server.log_path.read_text(errors="replace")
    return sum(
        int(match)
        for line in text.splitlines()
        if "KV Transfer metrics:" in line
        for match in re.findall(rf"{re.escape(name)}=(\d+)", line)
    )


def _metric(server: VllmServer, name: str) -> float | None:
    """The sum of a series over all its label sets on a vLLM server's /metrics (None if absent)."""
    text = scrape(f"{server.url}/metrics")
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    return sum(values) if values else None


def _pending_receives(sidecar: SidecarProcess) -> int:
    return int(_sidecar_status(sidecar).pending_receives)


def test_a_killed_vllm_engine_leaves_no_kv_file_behind(cluster: Cluster) -> None:
    """vLLM killed with SIGKILL cannot remove its KV file from /dev/shm; its sidecar removes it
    when the engine's event stream closes, and leaves the live engines' files alone."""
    engine = VllmEngineProcess(
        cluster.workdir,
        "doomed",
        cluster.model,
        cpu=1,
        sidecar=cluster.b.socket,
        engine_id=f"doomed-{cluster.token}",
        role="kv_consumer",
    )
    try:
        engine.wait_ready(180.0)
        files, live = engine.shm_paths(), cluster.decode.shm_paths()
        assert files and all(path.exists() for path in files + live), (files, live)
        os.killpg(engine.process.pid, signal.SIGKILL)
        engine.process.wait(10)
        wait_until(lambda: not any(path.exists() for path in files), 15.0, 0.1, "the killed engine's KV file removed")
        assert all(path.exists() for path in live)
        # The sidecar logs the removal just after the unlink the wait above saw.
        wait_until(
            lambda: any(event.get("event") == "orphaned_shm_file_removed" for event in cluster.b.log_events()),
            5.0,
            0.1,
            "the sidecar's orphaned_shm_file_removed log event",
        )
    finally:
        engine.kill()


def test_consumer_sidecar_restart_fails_inflight_request_to_recompute(cluster: Cluster) -> None:
    """D waits for a push that never comes when its sidecar dies: the closed event stream fails the
    request, vLLM recomputes it (same output), and the shim registers with the new sidecar."""
    prompt = fresh_prompt(180)
    reference = cluster.reference(prompt)
    waiting = cluster.decode.send(
        "generate",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        kv_transfer_params=early_push_params(cluster, uuid.uuid4().hex),
    )
    wait_until(lambda: _pending_receives(cluster.b) >= 1, 30.0, 0.1, "D's push registered")
    started = time.monotonic()
    cluster.b.restart()
    answer = cluster.decode.reply(waiting, timeout=60.0)
    elapsed = time.monotonic() - started
    assert answer["token_ids"] == reference
    assert answer["transfer"]["outcome"] == "load_failed", answer
    # Either the closed event stream failed it, or (if the sidecar died while still answering) the
    # ExpectPush call itself; both end in vLLM recomputing the prompt.
    assert answer["transfer"]["reason"], answer
    assert elapsed < 30.0
    _wait_registered(cluster.decode, cluster.b)
    prompt = fresh_prompt(150)
    params = cluster.prefill_leg(prompt, "pull")
    recovered = cluster.decode.generate(prompt, MAX_TOKENS, decode_params(params))
    assert recovered["token_ids"] == cluster.reference(prompt)
    assert_loaded_from_outside(recovered, 150, "pull")


def test_prefill_sidecar_killed_before_decode_loads(cluster: Cluster) -> None:
    """P's sidecar dies after P answered and before D loads: D's request still completes with the
    right output (vLLM recomputes) within a bound; after a restart the P shim registers again and
    transfers work. P's blocks, held for D when the sidecar died, go back to P's vLLM."""
    prompt = fresh_prompt(220)
    reference = cluster.reference(prompt)
    cluster.prefill.generate(fresh_prompt(10), 1)  # a step, so P frees what earlier consumers read
    free_before = _status(cluster.prefill)["free_blocks"]
    params = cluster.prefill_leg(prompt, "pull")
    cluster.a.kill()
    try:
        started = time.monotonic()
        answer = cluster.decode.generate(prompt, MAX_TOKENS, decode_params(params), timeout=90.0)
        elapsed = time.monotonic() - started
        assert answer["token_ids"] == reference
        assert answer["transfer"]["outcome"] == "load_failed", answer
        if not answer["transfer"]["inline"]:
            assert answer["num_cached_tokens"] == 0  # computed by D itself
        # (vLLM keeps the num_cached_tokens of a synchronous load that failed; the output above,
        # equal to the reference, is D's recompute: the prompt's blocks hold no KV of it.)
        assert elapsed < 30.0, f"recompute took {elapsed:.1f}s"
        cluster.prefill.generate(fresh_prompt(10), 1)  # P's next step learns the stream was lost
        record = cluster.prefill.command("transfer", request_id=params["remote_request_id"])["transfer"]
        assert record is not None and record["outcome"] == "send_abandoned", record
        assert _status(cluster.prefill)["free_blocks"] == free_before
        # A prefill that finishes while its sidecar is down is not held for a consumer: P answers
        # (with no parameters, or ones whose transfer fails) and D computes the prompt itself.
        prompt = fresh_prompt(140)
        answer = cluster.prefill.generate(prompt, 1, {"do_remote_decode": True, "transfer_id": uuid.uuid4().hex})
        params = answer["kv_transfer_params"]
        decoded = cluster.decode.generate(prompt, MAX_TOKENS, decode_params(params) if params else None, timeout=90.0)
        assert decoded["token_ids"] == cluster.reference(prompt)
        if not (decoded["transfer"] or {}).get("inline"):
            assert decoded["num_cached_tokens"] == 0  # (not kept by a failed synchronous load)
        cluster.prefill.generate(fresh_prompt(10), 1)
        assert _status(cluster.prefill)["free_blocks"] == free_before
    finally:
        cluster.a.restart()
    _wait_registered(cluster.prefill, cluster.a)
    _wait_registered(cluster.local_decode, cluster.a)
    for decode in (cluster.decode, cluster.local_decode):
        prompt = fresh_prompt(160)
        params = cluster.prefill_leg(prompt, "pull")
        recovered = decode.generate(prompt, MAX_TOKENS, decode_params(params))
        assert recovered["token_ids"] == cluster.reference(prompt)
        assert_loaded_from_outside(recovered, 160, "pull")


def test_the_kv_allocation_is_a_locked_shm_file_and_falls_back_where_it_cannot_be() -> None:
    """vLLM's one int8 KV allocation becomes a SharedBuffer (its creator's lock held, so the sidecar
    never takes it for an orphan); where the file cannot be made, vLLM gets its ordinary tensor
    and the shim's torch-shm export takes over, instead of vLLM failing to start."""
    import torch

    from engine_shim.vllm.kv_memory import ShmKvAllocation
    from kvsidecar.shm import remove_if_orphaned

    allocation = ShmKvAllocation({8192}, Path("/dev/shm") / f"kvsvllm-test-{uuid.uuid4().hex[:8]}")
    with allocation:
        tensor = torch.zeros(8192, dtype=torch.int8)
        other = torch.zeros(4096, dtype=torch.int8)  # not the KV cache: untouched
    assert allocation.buffer is not None and allocation.path.exists()
    try:
        assert tensor.untyped_storage().data_ptr() == allocation.buffer.array.ctypes.data
        assert other.untyped_storage().data_ptr() != allocation.buffer.array.ctypes.data
        tensor[:3] = torch.tensor([5, 6, 7], dtype=torch.int8)
        assert list(allocation.buffer.array[:3]) == [5, 6, 7]
        assert not remove_if_orphaned(allocation.path), "a live engine's KV file was taken for an orphan"
    finally:
        allocation.buffer.close()
    assert not allocation.path.exists()

    missing = ShmKvAllocation({8192}, Path("/nonexistent-dir") / "kvsvllm-x")
    with missing:
        fallback = torch.zeros(8192, dtype=torch.int8)
    assert missing.buffer is None and fallback.shape == (8192,) and not fallback.any()


def test_connector_stats_add_up_across_workers_and_intervals() -> None:
    """What vLLM's stat logger prints: outcomes recorded on two workers, taken once per step,
    shipped as plain data, rebuilt and aggregated, then reduced."""
    from engine_shim.vllm.stats import SidecarKVConnectorStats
    from engine_shim.vllm_connector import SidecarConnector

    first, second = SidecarKVConnectorStats(), SidecarKVConnectorStats()
    assert first.take() is None  # nothing happened: vLLM gets None
    first.record("received", 2_000_000, 12.0)
    first.record("load_failed", 0, 0.0)
    second.record("received", 1_000_000, 4.0)
    second.record("sent", 3_000_000, 9.0)
    second.record("lease_expired", 0, 0.0)
    taken = [stats.take() for stats in (first, second)]
    assert first.is_empty() and second.is_empty()
    merged = SidecarConnector.build_kv_connector_stats(json.loads(json.dumps(taken[0].data)))
    assert merged is not None
    merged.aggregate(SidecarConnector.build_kv_connector_stats(taken[1].data))  # type: ignore[arg-type]
    summary = merged.reduce()
    assert summary["Num received"] == 2 and summary["Num sent"] == 1
    assert summary["MB received"] == 3.0 and summary["MB sent"] == 3.0
    assert summary["Median receive time (ms)"] == 8.0
    assert summary["Num load failures"] == 1 and summary["Num leases expired"] == 1
    assert SidecarConnector.build_kv_connector_stats(None).is_empty()  # type: ignore[union-attr]
