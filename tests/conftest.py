"""Shared fixtures: short temporary directories (Unix socket paths are limited to 107 bytes),
sidecar and simulated-engine processes that are always killed, and a check that no test leaves
shared-memory files behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import EngineProcess, SidecarProcess

SHM = Path("/dev/shm")


def _our_shm_files() -> set[str]:
    return {name for name in os.listdir(SHM) if name.startswith("kvsidecar-")}


@pytest.fixture(autouse=True)
def no_leaked_shm() -> Iterator[None]:
    before = _our_shm_files()
    yield
    leaked = _our_shm_files() - before
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
