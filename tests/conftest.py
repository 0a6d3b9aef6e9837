"""Shared fixtures: short temporary directories (Unix socket paths are limited to 107 bytes),
sidecar and simulated-engine processes that are always killed, and a check that no test leaves
shared-memory files behind (another test run on the same machine may have files there meanwhile:
those are left alone).

Under pytest-xdist (``make test`` runs most tests on two workers) the other worker is
such another run: its files are told from ours by their creator, a process this worker started
(every such process is a child started through ``subprocess``, recorded below) or the worker itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.processes import EngineProcess, SidecarProcess

SHM = Path("/dev/shm")


# Under xdist: the pids of the children this worker started during the current test. A dead
# creator's file is ours only if it was one of them (the other worker's children die and leave
# files for its own check to find). Per test, because pids come round again (pid_max is 32768
# here, and threads take pids too): a pid recorded minutes ago may now be the other worker's.
_XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
_started_here: set[int] = set()
if _XDIST_WORKER:
    _popen_init = subprocess.Popen.__init__

    def _recording_init(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        _popen_init(self, *args, **kwargs)
        _started_here.add(self.pid)

    subprocess.Popen.__init__ = _recording_init  # type: ignore[method-assign]


def _of_another_run(name: str) -> bool:
    """A file whose creator (``kvsidecar-<pid>-...``) is alive and not this test session or a
    process it started: another run on the same machine, whose files are not ours to judge or
    remove. A dead creator's file counts as ours (a test's child that leaked it), under xdist only
    if this worker started it."""
    try:
        pid = int(name.split("-")[1])
    except (IndexError, ValueError):
        return _XDIST_WORKER  # a name a test chose (no creator in it): under xdist, either worker's
    if pid == os.getpid():
        return False
    try:
        return os.getpid() not in {parent.pid for parent in psutil.Process(pid).parents()}
    except psutil.NoSuchProcess:  # dead (also if it died just now)
        return _XDIST_WORKER and pid not in _started_here
    except psutil.Error:
        return False


def _our_shm_files() -> set[str]:
    return {name for name in os.listdir(SHM) if name.startswith("kvsidecar-")}


@pytest.fixture(autouse=True)
def no_leaked_shm() -> Iterator[None]:
    _started_here.clear()
    before = _our_shm_files()
    yield
    leaked = {name for name in _our_shm_files() - before if not _of_another_run(name)}
    for name in leaked:
        (SHM / name).unlink(missing_ok=True)
    assert not leaked, f"shared-memory files left behind: {sorted(leaked)}"


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sidecars(workdir: Path) -> Iterator[Callable[..., SidecarProcess]]:
    started: list[SidecarProcess] = []

    def start(
        name: str = "sidecar", args: list[str] | None = None, env: dict[str, str] | None = None
    ) -> SidecarProcess:
        process = SidecarProcess(workdir, name, list(args or []), dict(env or {}))
        started.append(process)
        return process.start()

    yield start
    for process in started:
        process.kill()


@pytest.fixture(params=["socket", "grpc"])
def session_transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The transport a ``SidecarClient``'s engine session takes in the test: the plain Unix
    socket next to the engine socket, or the gRPC Session stream (the client then looks for the
    socket where there is none, as with a sidecar without it)."""
    if request.param == "grpc":
        import engine_shim.client

        monkeypatch.setattr(engine_shim.client, "session_socket_for", lambda path: Path(f"{path}.absent"))
    return str(request.param)


@pytest.fixture
def engines(workdir: Path) -> Iterator[Callable[..., EngineProcess]]:
    started: list[EngineProcess] = []

    def start(sidecar: SidecarProcess, engine_id: str, role: str, **options: Any) -> EngineProcess:
        engine = EngineProcess(workdir, sidecar.socket, engine_id, role, **options)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.kill()
