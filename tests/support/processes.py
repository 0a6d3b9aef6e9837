"""Real processes for tests and benchmarks: sidecar daemons and simulated engines.

Every process is tracked by PID and killed (with its process group) at cleanup; every wait has a
bound. Sockets live in per-test temporary directories.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sidecar.tools.launcher import REPO_ROOT, DaemonProcess, child_env, kill_group

REPO = REPO_ROOT
python_env = child_env


def wait_until(predicate: Any, timeout: float, interval: float = 0.02, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met within {timeout}s")
        time.sleep(interval)


class SidecarProcess(DaemonProcess):
    """A sidecar daemon for a test, with access to its JSON log."""

    def log_events(self) -> list[dict[str, Any]]:
        events = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        return events


PUSH_MODE = 2  # common_pb2.TRANSFER_MODE_PUSH


def start_transfer(
    producer: EngineProcess,
    consumer: EngineProcess,
    mode: str,
    request: str,
    p_blocks: list[int],
    d_blocks: list[int],
    num_tokens: int,
) -> dict[str, Any]:
    """Start moving ``request`` (D's request id ``{request}-d``): pull (P submits, D pulls) or push
    (D expects, P submits). Returns the last command's reply; the caller waits for the events."""
    remote = {"address": producer.peer_address, "engine_id": producer.engine_id, "request_id": request}
    if mode == "pull":
        submitted = producer.command("submit", request_id=request, blocks=[p_blocks], num_tokens=num_tokens)
        assert submitted["ok"], submitted
        remote |= {"blocks": [p_blocks], "num_tokens": num_tokens}
        return consumer.command("pull", request_id=f"{request}-d", blocks=[d_blocks], remote=remote)
    expected = consumer.command("expect_push", request_id=f"{request}-d", blocks=[d_blocks], remote=remote)
    assert expected["ok"], expected
    return producer.command("submit", request_id=request, blocks=[p_blocks], num_tokens=num_tokens, mode=PUSH_MODE)


class EngineProcess:
    """A simulated engine (``python -m engine_shim.simulated``) in a child process, driven over
    JSON lines. Events and replies are collected by a reader thread."""

    def __init__(
        self,
        workdir: Path,
        socket: Path,
        engine_id: str,
        role: str,
        *,
        tp: int = 1,
        layers: int = 2,
        blocks: int = 64,
        block_len: int = 4096,
        heads: int = 1,
        model: str = "simulated",
        block_size: int = 16,
        kv_layout: str = "LBHNC",
        head_size: int = 0,
        dtype: str = "",
        memory: str = "shm",
        wrapper: list[str] | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.log_path = workdir / f"engine-{engine_id}.log"
        command = [
            *(wrapper or []),  # e.g. ``ip netns exec NS``: an engine on another (namespaced) host
            sys.executable,
            "-m",
            "engine_shim.simulated",
            "--socket",
            str(socket),
            "--engine-id",
            engine_id,
            "--role",
            role,
            "--tp",
            str(tp),
            "--layers",
            str(layers),
            "--blocks",
            str(blocks),
            "--block-len",
            str(block_len),
            "--heads",
            str(heads),
            "--model",
            model,
            "--block-size",
            str(block_size),
            "--kv-layout",
            kv_layout,
            "--head-size",
            str(head_size),
            "--dtype",
            dtype,
            "--memory",
            memory,
        ]
        stderr = self.log_path.open("ab")
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=python_env(),
            start_new_session=True,
        )
        stderr.close()
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self.events: list[dict[str, Any]] = []
        self._events_lock = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._next_id = 0
        try:
            self.ready = self._next_message(lambda m: "ready" in m, 30.0)["ready"]
        except BaseException:
            self.kill()
            raise
        self.peer_address: str = self.ready["peer_address"]
        self.buffers = [Path(path) for path in self.ready["buffers"]]
        self.layers, self.blocks, self.block_len, self.tp = layers, blocks, block_len, tp

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            if "event" in message:
                message["received_at"] = time.monotonic()  # when the test process read it
                with self._events_lock:
                    self.events.append(message)
                    self._events_lock.notify_all()
            else:
                self.messages.put(message)

    def _next_message(self, predicate: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"engine {self.engine_id}: no answer within {timeout}s; log:\n{self.log_tail()}")
            try:
                message = self.messages.get(timeout=remaining)
            except queue.Empty:
                continue
            if predicate(message):
                return message

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def command(self, op: str, timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        self._next_id += 1
        ident = self._next_id
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps({"op": op, "id": ident, **fields}) + "\n").encode())
        self.process.stdin.flush()
        return self._next_message(lambda m: m.get("id") == ident, timeout)

    def wait_event(self, request_id: str, timeout: float = 30.0, ranks: int | None = None) -> list[dict[str, Any]]:
        """The terminal events of ``request_id``, one per worker (waits until all ranks have one)."""
        ranks = self.tp if ranks is None else ranks
        deadline = time.monotonic() + timeout
        with self._events_lock:
            while True:
                found = [e for e in self.events if e.get("request_id") == request_id]
                if len({e["rank"] for e in found}) >= ranks:
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"engine {self.engine_id}: no event for {request_id} within {timeout}s")
                self._events_lock.wait(remaining)

    def events_for(self, request_id: str) -> list[dict[str, Any]]:
        with self._events_lock:
            return [e for e in self.events if e.get("request_id") == request_id]

    def stop(self, timeout: float = 15.0) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(b'{"op": "exit"}\n')
                self.process.stdin.flush()
                self.process.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self._remove_buffers()

    def kill(self) -> None:
        kill_group(self.process)
        self._remove_buffers()

    def _remove_buffers(self) -> None:
        # The engine names its files kvsidecar-<pid>-*; remove them even if it died before saying so.
        for path in Path("/dev/shm").glob(f"kvsidecar-{self.process.pid}-*"):
            path.unlink(missing_ok=True)


@contextmanager
def stopped(sidecar: SidecarProcess) -> Iterator[None]:
    """SIGSTOP the sidecar's process for the block (it answers nothing: calls to it stay in
    flight), SIGCONT after it."""
    assert sidecar.process is not None
    os.kill(sidecar.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(sidecar.process.pid, signal.SIGCONT)
