"""The shim's cap on vLLM's shm queue busy loop (``engine_shim.vllm.engine_spin``).

An engine that only waits for KV must leave the cores to the sidecar: vLLM's shm queue readers
spin on ``sched_yield`` for 1 s after their last read unless the cap is in force. Each case runs in
a fresh interpreter (the cap wraps a vLLM class for the whole process) with vLLM's real
``SpinCondition`` and a real zmq notification socket, and reports how a reader idle for 20 ms
waits: it returns at once (spins) or sleeps until the writer's notification or the timeout, at
most ``IDLE_RECHECK_S`` at a time. A sleeping reader whose notification is lost gets the message
by that bound through vLLM's real ``MessageQueue`` and shared-memory ring buffer, not after 5 s.
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
from engine_shim.vllm.engine_spin import IDLE_RECHECK_S

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, os, sys, threading, time
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path
from engine_shim.vllm.config import ShimConfig
from engine_shim.vllm.engine_spin import IDLE_RECHECK_S
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


def test_an_idle_engine_reader_sleeps_until_notified_instead_of_spinning(workdir: Path) -> None:
    outcome = probe("default", workdir)
    assert outcome["applied"] is True
    # vLLM alone would return at once (one sched_yield) and be called again: a spin. Capped, an idle
    # reader sleeps, those built before the cap as well as after it, for the recheck bound rather
    # than the caller's whole timeout (400 ms; vLLM's read loop passes up to 5 s)...
    for waited in (outcome["before_idle_s"], outcome["after_idle_s"]):
        assert 0.8 * IDLE_RECHECK_S <= waited < 0.3, outcome
    # ...and wakes on the writer's notification.
    assert outcome["notified_s"] < 0.3, outcome
    # Below the worker's idle wait, or an engine waiting for KV would spin between its steps.
    assert 0 <= outcome["limit"] < ShimConfig(sidecar_socket="unused").idle_wait


def test_a_negative_engine_busy_loop_leaves_vllm_spinning(workdir: Path) -> None:
    outcome = probe("-1", workdir)
    assert outcome["applied"] is False
    assert outcome["before_idle_s"] < 0.3, outcome
    assert outcome["after_idle_s"] < 0.3, outcome


LOST_NOTIFICATION = r"""
import json, os, sys, threading, time
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
from engine_shim.vllm.engine_spin import cap_busy_loop

cap_busy_loop(float(sys.argv[1]))
writer = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
ready = threading.Thread(target=reader.wait_until_ready)
ready.start()
writer.wait_until_ready()
ready.join()
writer.enqueue("first")
assert reader.dequeue(timeout=10) == "first"
writer._spin_condition.notify = lambda: None  # the next notification is lost
time.sleep(0.02)  # past the capped busy loop: the reader sleeps on the notification socket
threading.Timer(0.05, writer.enqueue, ("second",)).start()
started = time.monotonic()
got = reader.dequeue(timeout=30)
print(json.dumps({"got": got, "waited_s": time.monotonic() - started}))
writer.shutdown()
reader.shutdown()
for name in os.listdir(os.environ["VLLM_RPC_BASE_PATH"]):  # zmq leaves bound ipc sockets' files
    os.unlink(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], name))
"""


def test_a_lost_notification_delays_a_sleeping_engine_reader_by_the_recheck_bound_not_5_s(workdir: Path) -> None:
    before = set(Path("/dev/shm").iterdir())
    env = {**os.environ, "VLLM_RPC_BASE_PATH": str(workdir)}
    limit = str(ShimConfig(sidecar_socket="unused").engine_busy_loop)
    result = subprocess.run(
        [sys.executable, "-c", LOST_NOTIFICATION, limit],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["got"] == "second"
    # Written 50 ms after the reader went to sleep; vLLM alone would find it at its 5 s recheck.
    assert outcome["waited_s"] < 0.05 + IDLE_RECHECK_S + 0.5, outcome
    # vLLM's queue segments (Python's shared_memory names, psm_*); kvsidecar's files are the autouse
    # fixture's (conftest: it tells ours from those of another run on the machine, which this
    # global listing cannot).
    left = {path for path in set(Path("/dev/shm").iterdir()) - before if path.name.startswith("psm_")}
    assert not left, f"the probe left shared memory behind: {sorted(left)}"
    assert not list(workdir.iterdir()), "the probe left zmq socket files behind"
