"""Shared fixtures: short temporary directories (Unix socket paths are limited to 107 bytes),
sidecar and simulated-engine processes that are always killed, and a check that no test leaves
shared-memory files behind (another test run on the same machine may have files there meanwhile:
those are left alone)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.processes import EngineProcess, SidecarProcess

SHM = Path("/dev/shm")


def _of_another_run(name: str) -> bool:
    """A file whose creator (``kvsidecar-<pid>-...``) is alive and not this test session or a
    process it started: another run on the same machine, whose files are not ours to judge or
    remove. A dead creator's file counts as ours: a test's child that leaked it."""
    try:
        pid = int(name.split("-")[1])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid() or not psutil.pid_exists(pid):
        return False
    try:
        return os.getpid() not in {parent.pid for parent in psutil.Process(pid).parents()}
    except psutil.Error:
        return False


def _our_shm_files() -> set[str]:
    return {name for name in os.listdir(SHM) if name.startswith("kvsidecar-")}


@pytest.fixture(autouse=True)
def no_leaked_shm() -> Iterator[None]:
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
