"""The engine side of the request timeline and of waiting for KV: the connector's stats as vLLM's
stat loggers see them (call -> event seen, event seen -> step: kept, cross processes as plain
builtins, aggregate across workers, reduce to medians), and the worker's idle wait (a step that
computes nothing waits for the next event and applies it in that step). vLLM is imported; no
engine is started."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_shim.vllm.stats import SidecarKVConnectorStats, build
from kvsidecar.v1 import engine_pb2

REPO = Path(__file__).resolve().parents[2]


def test_importing_the_benchmarks_builders_leaves_the_environment_of_later_vllm_servers_alone() -> None:
    """vLLM prints its "KV Transfer metrics" line at INFO. ``bench/shim_step.py`` set
    VLLM_LOGGING_LEVEL=ERROR when imported, and tests import its builders: from then on every vLLM
    server the test session started (its environment a copy of the session's) logged no stats
    line (test_vllm_e2e.py's proxy test waited 15 s for D's and failed in the full suite)."""
    code = "import os; before = dict(os.environ); import bench.shim_step; print(dict(os.environ) == before)"
    env = {key: value for key, value in os.environ.items() if not key.startswith("VLLM_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True", "importing bench.shim_step changed os.environ"


def test_stage_timings_survive_take_aggregate_and_reduce() -> None:
    worker_a, worker_b = SidecarKVConnectorStats(), SidecarKVConnectorStats()
    worker_a.record("received", 4096, 12.0)
    worker_a.record_stages(0.010, 0.0005)
    worker_b.record_stages(0.030, -0.000001)  # clocks of one host never go back; clamp noise to 0
    taken_a, taken_b = worker_a.take(), worker_b.take()
    assert taken_a is not None and taken_b is not None and worker_a.is_empty()
    merged = build(json.loads(json.dumps(taken_a.data)))  # what crosses the process boundary
    merged.aggregate(taken_b)
    assert merged.data["call_to_event_seconds"] == [0.010, 0.030]
    assert merged.data["event_to_step_seconds"] == [0.0005, 0.0]
    summary = merged.reduce()
    assert summary["Median call->event (ms)"] == 20.0 and summary["Median event->step (ms)"] == 0.25


def test_multi_turn_lookups_reach_the_stat_logger_and_metrics() -> None:
    """The scheduler's multi-turn outcomes (hits, misses by reason, tokens loaded) join the
    workers' stats, reduce to the log line's counts, and become vllm:kvsidecar_multi_turn_*."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from engine_shim.vllm.stats import SidecarPromMetrics

    scheduler = SidecarKVConnectorStats()
    scheduler.record_lookups({"hit": 2, "local_cache": 1}, 320, [0.0, 0.004, 0.0])
    worker = SidecarKVConnectorStats()
    worker.record("received", 4096, 3.0)
    merged = build(json.loads(json.dumps(worker.data)))  # vLLM aggregates the scheduler's into the workers'
    merged.aggregate(build(json.loads(json.dumps(scheduler.data))))
    merged.aggregate(build({"multi_turn_lookups": {"hit": 1, "timeout": 1}, "multi_turn_tokens_loaded": 64}))
    summary = merged.reduce()
    assert summary["Num received"] == 1
    assert (summary["Num multi-turn hits"], summary["Num multi-turn misses"]) == (3, 2)
    assert summary["Multi-turn tokens loaded"] == 384 and summary["Median multi-turn wait (ms)"] == 0.0
    assert "Num multi-turn hits" not in worker.reduce()  # engines without multi-turn: no such fields

    registry = CollectorRegistry()

    def bound(cls: Any) -> Any:
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)  # labelled children do not register

        return Bound

    types = {kind: bound(kind) for kind in (Counter, Gauge, Histogram)}
    prom = SidecarPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        types,
        ["model_name", "engine"],
        {0: ["tiny", "0"]},  # type: ignore[arg-type]
    )
    prom.observe(merged.data, 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvsidecar_multi_turn_lookups_total{engine="0",model_name="tiny",outcome="hit"} 3.0' in text
    assert 'vllm:kvsidecar_multi_turn_lookups_total{engine="0",model_name="tiny",outcome="local_cache"} 1.0' in text
    assert 'vllm:kvsidecar_multi_turn_tokens_loaded_total{engine="0",model_name="tiny"} 384.0' in text
    assert 'vllm:kvsidecar_multi_turn_wait_seconds_count{engine="0",model_name="tiny"} 3.0' in text


# --- the worker's idle wait ----------------------------------------------------------------------
# A worker-role SidecarConnector on a real vLLM config (tiny Llama, no engine). Its event stream is
# stood in for by a thread calling the watcher's entry point (``_event_arrived``) and the
# supervisor's ``_Connected`` marker: what is tested is when vLLM's per-step call sees an event.


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from engine_shim.vllm.connector import SidecarConnector
    from engine_shim.vllm.worker import _Connected
    from tests.support.tiny_models import build_tiny_llama, kv_cache_config

    workdir = tmp_path_factory.mktemp("idle")
    kv_transfer = KVTransferConfig(
        kv_connector="SidecarConnector",
        kv_connector_module_path="engine_shim.vllm_connector",
        kv_role="kv_consumer",
        engine_id="idle-D",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"sidecar_socket": str(workdir / "none.sock"), "idle_wait": 30.0},
    )
    args = EngineArgs(
        model=str(build_tiny_llama(workdir / "model")), dtype="float32", block_size=32, max_model_len=1024,
        enforce_eager=True, kv_transfer_config=kv_transfer,
    )  # fmt: skip
    config = args.create_engine_config()
    connector = SidecarConnector(config, KVConnectorRole.WORKER, kv_cache_config(config, 64))
    side = connector.worker_side
    assert side is not None
    side._inbox.put(_Connected(0, "sidecar"))
    yield connector
    connector.shutdown()


def _step(connector: Any, idle: bool, **meta: Any) -> tuple[set[str], float]:
    from engine_shim.vllm.metadata import SidecarConnectorMetadata

    connector.bind_connector_metadata(SidecarConnectorMetadata(idle=idle, **meta))
    connector.start_load_kv(None)
    started = time.monotonic()
    results = connector.get_transfer_results(set())
    connector.clear_connector_metadata()
    return set(results.finished_recving or ()), time.monotonic() - started


def _later(connector: Any, request_id: str, delay: float) -> threading.Thread:
    event = engine_pb2.Event(kind=engine_pb2.FINISHED_RECEIVING, request_id=request_id)
    thread = threading.Timer(delay, connector.worker_side._event_arrived, (event,))
    thread.start()
    return thread


def test_an_idle_step_waits_for_the_event_and_applies_it_in_the_same_step(worker: Any) -> None:
    # The receive starts; its event comes while the next step computes nothing.
    assert _step(worker, idle=False, recv_started={"a": (time.monotonic(), [1, 2])})[0] == set()
    sender = _later(worker, "a", 0.2)
    finished, _ = _step(worker, idle=True)
    sender.join()
    assert finished == {"a"}  # seen in this step, not the next one
    stats = worker.get_kv_connector_stats()
    assert stats is not None and len(stats.data["event_to_step_seconds"]) == 1


def test_a_step_that_computes_or_has_nothing_outstanding_never_waits(worker: Any) -> None:
    # Nothing outstanding: an idle step returns at once (a 30 s wait would show).
    assert _step(worker, idle=True)[1] < 10.0
    # A step that computes returns at once too; the event is applied by a later step.
    _step(worker, idle=False, recv_started={"b": (time.monotonic(), [3])})
    sender = _later(worker, "b", 0.5)
    finished, took = _step(worker, idle=False)
    sender.join()
    assert finished == set() and took < 10.0
    assert _step(worker, idle=False)[0] == {"b"}


def test_input_reaching_the_engine_core_ends_an_idle_wait(worker: Any) -> None:
    # The EngineCore side as the scheduler role sets it up, on a plain queue standing in for
    # vLLM's input queue (tests/vllm/test_vllm_upstream.py checks a real EngineCore gets it).
    from engine_shim.vllm.input_wake import InputWaker, socket_name, wake_workers_on_input

    assert worker.worker_side._wake_listener.start()
    input_queue: queue.Queue[Any] = queue.Queue()
    waker = InputWaker([socket_name("idle-D", 0, 0, 0)])
    wake_workers_on_input(input_queue, waker)
    _step(worker, idle=False, recv_started={"c": (time.monotonic(), [5])})
    request = threading.Timer(0.2, input_queue.put_nowait, (("ADD", "a new request"),))
    request.start()
    finished, took = _step(worker, idle=True)
    request.join()
    assert finished == set() and took < 10.0  # woken by the request, not by the 30 s bound
    assert input_queue.get_nowait() == ("ADD", "a new request")  # the queue still works as vLLM's
    # The receive is still outstanding: its event is applied by the next idle step.
    sender = _later(worker, "c", 0.2)
    assert _step(worker, idle=True)[0] == {"c"}
    sender.join()
    waker.close()
