"""Fixtures for tests across hosts: a ``Cluster`` of network-namespace hosts, each running one
sidecar (UCX restricted to TCP on its interface) and simulated engines. Everything started is
killed and every namespace removed, also when a test fails; the whole directory is skipped with
the reason where namespaces cannot be made."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.netns import UCX_ENV, Host, Network, unavailable
from tests.support.processes import EngineProcess, SidecarProcess

PEER_PORT = 50151  # every host has its own port space: all sidecars use the default port


@pytest.fixture(scope="session")
def netns_available() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(f"multihost tests need network namespaces: {reason}")


@dataclass
class Cluster:
    """Hosts on one bridge; ``sidecar`` and ``engine`` start processes on a host."""

    network: Network
    workdir: Path
    sidecars: dict[str, SidecarProcess] = field(default_factory=dict)
    engines: list[EngineProcess] = field(default_factory=list)

    def __getitem__(self, host: str) -> Host:
        return self.network[host]

    def sidecar(self, host: str, args: list[str] | None = None, by_name: bool = True) -> SidecarProcess:
        """The sidecar of ``host``, listening on its bridge address and advertising its DNS name
        (``by_name``, as a Kubernetes headless service would) or its address."""
        node = self.network[host]
        advertise = self.network.fqdn(host) if by_name else node.address
        command = ["--peer-listen", f"{node.address}:{PEER_PORT}", "--advertise", f"{advertise}:{PEER_PORT}"]
        process = SidecarProcess(self.workdir, host, [*command, *(args or [])], dict(UCX_ENV), wrapper=node.prefix)
        self.sidecars[host] = process
        return process.start()

    def engine(self, host: str, engine_id: str, role: str, **options: Any) -> EngineProcess:
        engine = EngineProcess(
            self.workdir, self.sidecars[host].socket, engine_id, role, wrapper=self.network[host].prefix, **options
        )
        self.engines.append(engine)
        return engine

    def close(self) -> None:
        for engine in self.engines:
            engine.kill()
        for sidecar in self.sidecars.values():
            sidecar.kill()
        self.network.close()


@pytest.fixture
def cluster(netns_available: None, workdir: Path) -> Iterator[Callable[[list[str]], Cluster]]:
    made: list[Cluster] = []

    def make(hosts: list[str]) -> Cluster:
        network = Network(hosts)
        made.append(Cluster(network, workdir))
        network.open()
        return made[-1]

    yield make
    for each in made:
        each.close()
