"""The one routing table of PeerService: which object of the node answers each peer call.

The node fills it with the owners' bound methods (handshake -> ``core.handshake``, PushReg,
Heartbeat, QueryCache, Release and GetDigests -> the producer, TransferFailed -> the consumer,
Trace -> ``core.trace``); the PeerService servicer (``api.peer``: each unary RPC, and each call
on a peer stream) and the peer client's same-node short cut
(``peers.client``) both call through it, so a call to this sidecar's own address never leaves the
process and is answered by the same code as one from the network.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvsidecar.v1 import common_pb2, peer_pb2
from sidecar.dataplane.views import EngineView

# The identity of a call this sidecar makes to its own address (never leaves the process).
LOCAL = ""


@dataclass(frozen=True)
class PeerRoutes:
    handshake: Callable[[peer_pb2.HandshakeRequest], Awaitable[peer_pb2.HandshakeResponse]]
    # The calls that act on a transfer take the caller's certificate identity too ("" for a
    # plaintext or local caller; sidecar.tls): only a party to the transfer may act on it.
    push_reg: Callable[[peer_pb2.PushRegRequest, str], Awaitable[peer_pb2.PushRegResponse]]
    heartbeat: Callable[[peer_pb2.HeartbeatRequest, str], Awaitable[peer_pb2.HeartbeatResponse]]
    query_cache: Callable[[peer_pb2.PeerQueryCacheRequest], Awaitable[peer_pb2.PeerQueryCacheResponse]]
    transfer_failed: Callable[[peer_pb2.TransferFailedRequest, str], Awaitable[peer_pb2.TransferFailedResponse]]
    release: Callable[[peer_pb2.PeerReleaseRequest, str], Awaitable[peer_pb2.PeerReleaseResponse]]
    get_digests: Callable[[peer_pb2.GetDigestsRequest], Awaitable[peer_pb2.GetDigestsResponse]]
    trace: Callable[[common_pb2.TraceRequest], Awaitable[common_pb2.TraceResponse]]
    stage: Callable[[peer_pb2.StageRequest], Awaitable[peer_pb2.StageResponse]]
    # A local engine as the other side of a same-node transfer (read from the registry each time).
    local_engine_view: Callable[[str, str], EngineView]
