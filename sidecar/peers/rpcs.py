"""The rows of the peer client's table: one ``PeerRpc`` per PeerService RPC the client calls, and
the descriptor (``peer_rpc``) that turns a row into the client's typed method.

A row names the RPC (its gRPC method and its handler in ``peers.routes``), its request and
response types, the setting that bounds a call, whether a call waits for a connection by default
(the retry policy: a peer that is restarting gets until the deadline to come back), whether the
handler takes the caller's identity, and whether the call may ride the peer stream. Every call
goes through ``PeerClient.call``. Imported by the client; no thread of its own.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from google.protobuf.message import Message

from sidecar.config import Settings

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)
Req_contra = TypeVar("Req_contra", bound=Message, contravariant=True)
Resp_co = TypeVar("Resp_co", bound=Message, covariant=True)


def _call_timeout(settings: Settings) -> float:
    return settings.peer_call_timeout_seconds


@dataclass(frozen=True)
class PeerRpc(Generic[Req, Resp]):
    """One PeerService RPC as the client calls it."""

    method: str  # the gRPC method, e.g. "PushReg"
    request: type[Req]
    response: type[Resp]
    # The handler in ``PeerRoutes`` takes the caller's certificate identity as its second argument.
    identity: bool = False
    # Rides the peer stream (``peers.stream``) when one is open to the peer; unary otherwise.
    stream: bool = False
    # The deadline of one call, from the settings.
    timeout: Callable[[Settings], float] = _call_timeout
    # Retry policy: by default a call waits for a connection (until its deadline) instead of
    # failing at once; callers that want a dead peer detected at once pass wait_for_ready=False.
    wait_for_ready: bool = True
    route: str = field(init=False)  # the ``PeerRoutes`` field that answers it: PushReg -> push_reg

    def __post_init__(self) -> None:
        object.__setattr__(self, "route", re.sub(r"(?<!^)(?=[A-Z])", "_", self.method).lower())


class PeerCall(Protocol[Req_contra, Resp_co]):
    def __call__(self, address: str, request: Req_contra, wait_for_ready: bool | None = None) -> Awaitable[Resp_co]: ...


class _Client(Protocol):
    """What a row's method calls: ``PeerClient.call`` (not imported: the client imports us)."""

    def call(
        self, rpc: PeerRpc[Req, Resp], address: str, request: Req, wait_for_ready: bool = True
    ) -> Awaitable[Resp]: ...


# Every row of the client's table, by gRPC method name.
PEER_RPCS: dict[str, PeerRpc[Any, Any]] = {}


class _PeerMethod(Generic[Req, Resp]):
    """``client.<name>(address, request, wait_for_ready=None)``: one call of the row's RPC (a
    non-data descriptor: a test may still replace the method on one instance)."""

    def __init__(self, rpc: PeerRpc[Req, Resp]) -> None:
        self.rpc = rpc

    def __get__(self, client: _Client, owner: type | None = None) -> PeerCall[Req, Resp]:
        rpc = self.rpc

        def call(address: str, request: Req, wait_for_ready: bool | None = None) -> Awaitable[Resp]:
            return client.call(rpc, address, request, rpc.wait_for_ready if wait_for_ready is None else wait_for_ready)

        return call


def peer_rpc(
    method: str,
    request: type[Req],
    response: type[Resp],
    *,
    identity: bool = False,
    stream: bool = False,
) -> _PeerMethod[Req, Resp]:
    """One row of the table (see ``PeerRpc``), as the client's method."""
    rpc = PeerRpc(method, request, response, identity=identity, stream=stream)
    PEER_RPCS[method] = rpc
    return _PeerMethod(rpc)
