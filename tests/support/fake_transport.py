"""``FakeTransport``: a stand-in for the NIXL transport, for unit tests of the node's parts only.

It implements ``sidecar.dataplane.contract.Transport`` in-process: an "agent" is a name over the
memory regions it was created with (real mappings of real shared-memory files: the node's
``MemoryImporter`` maps them as in production), a READ or WRITE copies the selected descriptors'
bytes between two agents' regions with ``memmove``, and its notification reaches the target
agent's node on the event loop, like the NIXL owner thread's notification batches. Every address
is checked against the agents' registered regions before a byte moves, so a planning bug fails
the transfer instead of writing through a stray pointer.

What it is not: NIXL. No UCX, no progress thread, no wire-up; the real-NIXL tests (test_pull,
test_push, test_transport, ...) stay the proof that the real transport works. Tests control it:
- ``fabric.gate``: set to an unset ``asyncio.Event`` to hold every transfer until the test sets it
  (a transfer "in flight" while a lease expires or a release arrives);
- ``fabric.fail_with``: a non-empty error makes every transfer fail with it (a failed WRITE/READ).

Several ``FakeTransport`` instances made by one ``FakeFabric`` reach each other's agents (nodes in
one process); a node gets one with ``Node(settings, transport_factory=fabric.transport)``.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from dataclasses import dataclass, field

import numpy as np

from sidecar.config import NixlSettings
from sidecar.dataplane.contract import (
    NOT_POSTED_LATE,
    NotificationsCallback,
    RemoteAgent,
    RunsSpec,
    Staging,
    TransferResult,
    TransferSpec,
    XferDoneCallback,
)


@dataclass
class _FakeAgent:
    owner: FakeTransport
    regions: list[tuple[int, int, int]]
    staging: list[Staging] = field(default_factory=list)

    def covers(self, address: int, length: int) -> bool:
        return any(base <= address and address + length <= base + size for base, size, _ in self.regions)


@dataclass
class FakeFabric:
    """The agents of every FakeTransport it made, and the tests' controls over transfers."""

    agents: dict[str, _FakeAgent] = field(default_factory=dict)
    gate: asyncio.Event | None = None
    fail_with: str = ""
    transfers: list[TransferSpec | RunsSpec] = field(default_factory=list)

    def transport(
        self, settings: NixlSettings, on_notifications: NotificationsCallback, on_xfer_done: XferDoneCallback
    ) -> FakeTransport:
        return FakeTransport(self, on_notifications, on_xfer_done)


class FakeTransport:
    """See the module docstring. Everything runs on the event loop thread."""

    nixl_version = "fake (tests only)"

    def __init__(
        self, fabric: FakeFabric, on_notifications: NotificationsCallback, on_xfer_done: XferDoneCallback
    ) -> None:
        self._fabric = fabric
        self._on_notifications = on_notifications
        self._on_xfer_done = on_xfer_done
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_flight = 0
        self.expecting = 0
        self.stopped = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    async def stop(self, timeout: float = 5.0) -> None:
        self.stopped = True
        for name in [name for name, agent in self._fabric.agents.items() if agent.owner is self]:
            del self._fabric.agents[name]

    async def ping(self) -> None:
        return None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def create_agent(self, name: str, regions: list[tuple[int, int, int]], mem_type: str) -> bytes:
        if name in self._fabric.agents:
            raise ValueError(f"agent {name} exists")
        self._fabric.agents[name] = _FakeAgent(self, list(regions))
        return f"fake-metadata:{name}".encode()

    async def drop_agent(self, name: str) -> None:
        self._fabric.agents.pop(name, None)

    async def drop_remote(self, names: list[str]) -> None:
        return None

    async def transfer(self, spec: TransferSpec | RunsSpec) -> TransferResult:
        self._fabric.transfers.append(spec)
        self._in_flight += 1
        try:
            result = await self._transfer(spec)
        finally:
            self._in_flight -= 1
        if result.ok and getattr(spec, "observed", True):
            self._on_xfer_done(spec.op, result)
        return result

    async def transfer_runs(self, spec: RunsSpec) -> TransferResult:
        return await self.transfer(spec)

    async def staging(self, agent_name: str, nbytes: int) -> Staging:
        """A buffer added to the agent's registered regions (kept for the agent's life)."""
        staging = Staging(np.zeros(max(nbytes, 1), dtype=np.uint8), busy=True)
        agent = self._fabric.agents[agent_name]
        agent.regions.append((staging.address, staging.array.size, 0))
        agent.staging.append(staging)
        return staging

    def unstage(self, staging: Staging) -> None:
        staging.busy = False

    async def register_host(self, agent_name: str, address: int, nbytes: int) -> bytes:
        """The range joins the agent's registered regions (once)."""
        agent = self._fabric.agents[agent_name]
        if (address, nbytes, 0) not in agent.regions:
            agent.regions.append((address, nbytes, 0))
        return f"fake-metadata:{agent_name}".encode()

    async def _transfer(self, spec: TransferSpec | RunsSpec) -> TransferResult:
        if spec.not_after is not None and time.monotonic() > spec.not_after:
            return TransferResult(False, NOT_POSTED_LATE)
        if self._fabric.gate is not None:
            await self._fabric.gate.wait()
        local = self._fabric.agents.get(spec.agent_name)
        if local is None or local.owner is not self:
            return TransferResult(False, f"local agent {spec.agent_name} is gone")
        remote = self._fabric.agents.get(spec.remote.name)
        if remote is None:
            return TransferResult(False, f"transfer setup failed: unknown remote agent {spec.remote.name}")
        if self._fabric.fail_with:
            return TransferResult(False, f"transfer failed: {self._fabric.fail_with}")
        if isinstance(spec, RunsSpec):
            mine, theirs = spec.local, spec.remote_descs
        else:
            mine = spec.local_list.build()[np.asarray(spec.local_indices, dtype=np.int64)]
            theirs = spec.remote_list.build()[np.asarray(spec.remote_indices, dtype=np.int64)]
        if len(mine) != len(theirs):
            error = f"transfer setup failed: {len(mine)} local vs {len(theirs)} remote descriptors"
            return TransferResult(False, error)
        moved = 0
        for (local_address, local_length, _), (remote_address, remote_length, _) in zip(mine, theirs, strict=True):
            if local_length != remote_length:
                return TransferResult(False, "transfer setup failed: descriptor lengths differ")
            if not local.covers(int(local_address), int(local_length)) or not remote.covers(
                int(remote_address), int(remote_length)
            ):
                return TransferResult(False, "transfer setup failed: a descriptor is outside the registered memory")
        for (local_address, length, _), (remote_address, _, _) in zip(mine, theirs, strict=True):
            source, target = (remote_address, local_address) if spec.op == "READ" else (local_address, remote_address)
            ctypes.memmove(int(target), int(source), int(length))
            moved += int(length)
        remote.owner._deliver(spec.remote.name, spec.notification)
        return TransferResult(True, bytes=moved, descriptors=len(mine))

    async def notify(self, agent_name: str, remote: RemoteAgent, payload: bytes) -> None:
        target = self._fabric.agents.get(remote.name)
        if agent_name not in self._fabric.agents or target is None:
            raise ValueError(f"agent {agent_name} or {remote.name} is gone")
        target.owner._deliver(remote.name, payload)

    def _deliver(self, agent_name: str, payload: bytes) -> None:
        if self._loop is not None and payload:
            self._loop.call_soon(self._on_notifications, [(agent_name, payload)], time.monotonic())

    def expect_notifications(self, delta: int) -> None:
        self.expecting = max(0, self.expecting + delta)

    def warm(self, seconds: float) -> None:
        return None
