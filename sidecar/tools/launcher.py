"""Starting ``kvsidecar serve`` as a child process: for the demo, the benchmark and the tests.

The child gets its own session (process group) so a kill takes everything it started; readiness
is a GetStatus answer on its engine socket, which also tells the address it advertises. Every wait
has a bound. A sidecar still starting refuses the polls: they are logged at DEBUG, and once, at
WARNING, only when the bound passes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from engine_shim.client import SessionToken, engine_channel
from kvsidecar.engine_auth import auth_socket_for
from kvsidecar.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger("kvsidecar.launcher")
REPO_ROOT = Path(__file__).resolve().parents[2]


def kill_group(process: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGKILL a child started in its own session together with everything it started, and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        pass


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child Python: this checkout importable, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


@dataclass
class DaemonProcess:
    """One sidecar daemon on ``workdir/<name>.sock`` and a loopback port (0: any free port)."""

    workdir: Path
    name: str = "sidecar"
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    peer_port: int = 0
    # Command prefix, e.g. ``ip netns exec NS`` to run the daemon on another (namespaced) host.
    wrapper: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None
    address: str = ""
    sidecar_id: str = ""

    @property
    def socket(self) -> Path:
        return self.workdir / f"{self.name}.sock"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        command = [
            *self.wrapper, sys.executable, "-m", "sidecar.app.cli", "serve",
            "--engine-socket", str(self.socket),
            "--peer-listen", f"127.0.0.1:{self.peer_port}",
            "--metrics-listen", "off",
            "--log-format", "json",
            # The daemon asks for SIGTERM when this process dies (prctl, after exec): a demo or a
            # test that is killed leaves no daemons behind. Not a preexec_fn: that forces fork(),
            # and grpc's fork handlers can hang a parent with live channels.
            "--parent-pid", str(os.getpid()),
            *self.args,
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(self.env),
                start_new_session=True,
            )
        try:
            self._wait_ready(timeout)
        except BaseException:  # not ready in time, or Ctrl-C: the caller never got it to stop it
            self.kill()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        # One token for every poll: its refusals (a sidecar still starting, or a socket file left
        # by the one before a restart) are expected until the bound, so they log at DEBUG.
        token = SessionToken(auth_socket_for(self.socket), timeout=1.0, problem_level=logging.DEBUG)
        problem = f"no socket at {self.socket}"
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"sidecar {self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.socket.exists():
                status, problem = self._status(token)
                if status is not None:
                    self.address = status.sidecar.address
                    self.sidecar_id = status.sidecar.sidecar_id
                    self.peer_port = int(self.address.rsplit(":", 1)[1])
                    return
            if time.monotonic() > deadline:
                log.warning("sidecar %s not ready within %ss: %s", self.name, timeout, problem)
                raise TimeoutError(f"sidecar {self.name} not ready within {timeout}s ({problem}):\n{self.log_tail()}")
            time.sleep(0.05)

    def _status(self, token: SessionToken | None = None) -> tuple[engine_pb2.GetStatusResponse | None, str]:
        """The sidecar's status, or None and why not."""
        try:
            with engine_channel(self.socket, token=token) as channel:
                stub = engine_pb2_grpc.EngineServiceStub(channel)
                response: engine_pb2.GetStatusResponse = stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=1.0)
                return response, ""
        except grpc.RpcError as exc:
            if token is not None and token.problem:
                return None, f"no session token: {token.problem}"
            return None, str(exc.details())

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; returns the exit status (SIGKILL after ``timeout``)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.process is not None:
            kill_group(self.process)

    def restart(self, timeout: float = 30.0) -> DaemonProcess:
        """Kill and start again on the same socket and port (a restarted sidecar)."""
        self.kill()
        return self.start(timeout)
