"""The shim's cap on vLLM's shm queue busy loop (``engine_shim.vllm.engine_spin``).

An engine that only waits for KV must leave the cores to the sidecar: vLLM's shm queue readers
spin on ``sched_yield`` for 1 s after their last read unless the cap is in force. Each case runs in
a fresh interpreter (the cap wraps a vLLM class for the whole process) with vLLM's real
``SpinCondition`` and a real zmq notification socket, and reports how a reader idle for 20 ms
waits: it returns at once (spins) or sleeps until the writer's notification or the timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from engine_shim.vllm.config import ShimConfig

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, os, sys, threading, time
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path
from engine_shim.vllm.config import ShimConfig
from engine_shim.vllm.engine_spin import cap_busy_loop

cap = sys.argv[1]
limit = ShimConfig(sidecar_socket="unused").engine_busy_loop if cap == "default" else float(cap)
context = zmq.Context()
address = get_open_zmq_ipc_path()
writer = SpinCondition(False, context, address)
built_before = SpinCondition(True, context, address)  # an engine's readers exist before the connector
applied = cap_busy_loop(limit)
built_after = SpinCondition(True, context, address)
time.sleep(0.2)  # let the subscriptions connect

def idle_wait(reader, notify_after):
    reader.record_read()
    time.sleep(0.02)
    if notify_after is not None:
        threading.Timer(notify_after, writer.notify).start()
    started = time.monotonic()
    reader.wait(timeout_ms=400)
    return time.monotonic() - started

print(json.dumps({
    "applied": applied,
    "limit": limit,
    "before_idle_s": idle_wait(built_before, None),
    "after_idle_s": idle_wait(built_after, None),
    "notified_s": idle_wait(built_after, 0.05),
}))
context.destroy(linger=0)
os.unlink(address.removeprefix("ipc://"))  # zmq leaves a bound ipc socket's file behind
"""


def probe(cap: str, rpc_dir: Path) -> dict[str, Any]:
    # The writer's zmq ipc socket file goes to vLLM's RPC base path: the test's own directory.
    env = {**os.environ, "VLLM_RPC_BASE_PATH": str(rpc_dir)}
    result = subprocess.run(
        [sys.executable, "-c", PROBE, cap], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list(rpc_dir.iterdir()), "the probe left zmq socket files behind"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_an_idle_engine_reader_sleeps_until_notified_instead_of_spinning(tmp_path: Path) -> None:
    outcome = probe("default", tmp_path)
    assert outcome["applied"] is True
    # vLLM alone would return at once (one sched_yield) and be called again: a spin. Capped, an idle
    # reader sleeps for the whole timeout, those built before the cap as well as after it...
    assert outcome["before_idle_s"] >= 0.3, outcome
    assert outcome["after_idle_s"] >= 0.3, outcome
    # ...and wakes on the writer's notification, well before the timeout.
    assert outcome["notified_s"] < 0.3, outcome
    # Below the worker's idle wait, or an engine waiting for KV would spin between its steps.
    assert 0 <= outcome["limit"] < ShimConfig(sidecar_socket="unused").idle_wait


def test_a_negative_engine_busy_loop_leaves_vllm_spinning(tmp_path: Path) -> None:
    outcome = probe("-1", tmp_path)
    assert outcome["applied"] is False
    assert outcome["before_idle_s"] < 0.3, outcome
    assert outcome["after_idle_s"] < 0.3, outcome
