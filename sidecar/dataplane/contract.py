"""What the node needs of a transport, and the values that cross it.

``Transport`` is the protocol the data plane, the producer, the consumer, registration and the
process shell use; ``sidecar.dataplane.transport.NixlTransport`` implements it with real NIXL
agents on one owner thread, and tests use an in-process fake (``tests/support/fake_transport.py``)
that moves bytes between mapped buffers, so the node's state machines can be built and driven
without NIXL. Transfers are described by value (``TransferSpec``); callbacks reach the node on
the event loop thread (notifications) or on the transport's own thread (``on_xfer_done``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from sidecar.config import NixlSettings

# (local agent name, notification payload) batches, delivered on the event loop thread.
# (batch of (local agent name, payload), time.monotonic() when the owner thread saw the batch).
NotificationsCallback = Callable[[list[tuple[str, bytes]], float], None]


@dataclass(frozen=True)
class DlistSpec:
    """A descriptor list to prepare once and reuse: ``build`` returns the Nx3 (address, length,
    device) array; it runs on the transport's thread."""

    key: Hashable
    build: Callable[[], np.ndarray]
    mem_type: str = "DRAM"


@dataclass(frozen=True)
class RemoteAgent:
    """A peer's agent as the handshake described it."""

    name: str
    metadata: bytes


@dataclass(frozen=True)
class NodeExport:
    """A peer's VRAM export as its handshake described it (``peer.proto`` ``NodeLocalExport``): the
    engine's CUDA IPC handle and range, where the peer's sidecar mapped the range (``address``),
    the GPU's UUID and the node's id. A sidecar on the same node opens it and device-copies."""

    handle: bytes
    offset: int
    length: int
    address: int
    gpu_uuid: str
    node_id: str


@dataclass
class TransferResult:
    ok: bool
    error: str = ""
    bytes: int = 0
    descriptors: int = 0
    duration_s: float = 0.0
    post_s: float = 0.0
    peer_gone: bool = False
    # Where a one-post transfer's hand-off time went on the owner thread (seconds, by name:
    # owner_wait = queued -> taken, owner_post = taken -> post returned, owner_done = post returned
    # -> DONE seen), and when it was reported (time.monotonic()), for the request's trace.
    handoff: dict[str, float] = field(default_factory=dict)
    reported_at: float = 0.0


NOT_POSTED_LATE = "not posted: past its deadline (the producer's lease or the consumer's push registration ended)"


def is_disconnect(exc: BaseException) -> bool:
    """Whether a NIXL exception says the peer is gone (``nixlRemoteDisconnectError`` and kin)."""
    return "Disconnect" in type(exc).__name__ or "disconnect" in str(exc).lower()


class XferDoneCallback(Protocol):
    """(op, result) of every finished transfer, called on the transport's thread (metrics only);
    the data plane calls it too, on the event loop, for a device copy or a host-staged transfer
    (``path`` = "device_copy" | "host_staging"; the transport's own transfers are "nixl")."""

    def __call__(self, op: str, result: TransferResult, path: str = "nixl") -> None: ...


@dataclass(frozen=True)
class TransferSpec:
    """One READ or WRITE between a local agent and a remote one, with its notification.

    ``local_indices`` / ``remote_indices`` select descriptors of the two prepared lists;
    ``deadline`` (monotonic) bounds it; ``not_after`` (monotonic) refuses to post it once passed
    (``NOT_POSTED_LATE``): the producer's lease ended, or a push consumer's registration did, while
    the transfer waited to be posted."""

    agent_name: str
    op: str  # "READ" | "WRITE"
    remote: RemoteAgent
    local_list: DlistSpec
    local_indices: np.ndarray
    remote_list: DlistSpec
    remote_indices: np.ndarray
    notification: bytes
    deadline: float
    not_after: float | None = None


@dataclass(frozen=True)
class RunsSpec:
    """A READ or WRITE over explicit Nx3 (address, length, device) descriptor arrays: row i of
    ``local`` moves to or from row i of ``remote_descs`` (a converting plan's runs)."""

    agent_name: str
    op: str  # "READ" | "WRITE"
    remote: RemoteAgent
    local: np.ndarray
    local_mem: str
    remote_descs: np.ndarray
    remote_mem: str
    notification: bytes
    deadline: float
    not_after: float | None = None
    # False: not reported to the transport's on_xfer_done (a chunk of a host-staged transfer,
    # which the data plane reports whole, path=host_staging).
    observed: bool = True


@dataclass(eq=False)
class Staging:
    """A transport-owned buffer registered with one agent, for transfers that convert layouts
    through a copy; lent by ``Transport.staging`` and given back with ``unstage``."""

    array: np.ndarray
    busy: bool = False

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)


class Transport(Protocol):
    """The node's transport: agents per local worker, one-sided transfers with notifications."""

    nixl_version: str

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...

    async def stop(self, timeout: float = 5.0) -> None: ...

    async def ping(self) -> None:
        """Returns once the transport's thread has run a no-op (the liveness probe)."""

    @property
    def in_flight(self) -> int: ...

    async def create_agent(self, name: str, regions: list[tuple[int, int, int]], mem_type: str) -> bytes:
        """Create an agent over ``regions`` (address, length, device); returns its metadata."""

    async def drop_agent(self, name: str) -> None: ...

    async def drop_remote(self, names: list[str]) -> None: ...

    async def transfer(self, spec: TransferSpec) -> TransferResult:
        """Post one transfer and wait for its end; never raises for transfer failures."""

    async def transfer_runs(self, spec: RunsSpec) -> TransferResult:
        """Post one transfer over explicit descriptors and wait for its end; never raises."""

    async def staging(self, agent_name: str, nbytes: int) -> Staging:
        """Lend a buffer of at least ``nbytes`` registered with ``agent_name``."""

    def unstage(self, staging: Staging) -> None:
        """Give a staging buffer back (no transfer on it may still run)."""

    async def register_host(self, agent_name: str, address: int, nbytes: int) -> bytes:
        """Register host memory the caller owns (and keeps for the process's life) with
        ``agent_name``'s agent as DRAM, once per agent (later calls return at once); it is
        deregistered with the agent. The host-staging pool's pinned memory. Returns the agent's
        metadata as it is now (with the range: what peers need to READ it)."""

    async def notify(self, agent_name: str, remote: RemoteAgent, payload: bytes) -> None: ...

    def expect_notifications(self, delta: int) -> None:
        """Count of things waiting for notifications (a real transport polls while it is > 0)."""

    def warm(self, seconds: float) -> None:
        """Poll for a while with nothing expected (a peer that just handshaked connects)."""


# How the node builds its transport (``NixlTransport`` unless a test injects another).
TransportFactory = Callable[[NixlSettings, NotificationsCallback, XferDoneCallback], Transport]
