"""PeerService servicer: one line per RPC, through the node's routing table (``peers.routes``),
the same table a call to this sidecar's own address takes; the calls that act on a transfer carry
the caller's certificate identity (mTLS, ``sidecar.tls``). Runs on the event loop thread.

The peer stream (``Stream``) carries a peer's unary calls: each runs the very method below that its
unary RPC runs, wrapped by the same ``CallInterceptor`` (``api.session.SessionDispatcher``), with
the stream's context, so ``peer_identity`` is the certificate of the peer that opened the stream.
Open streams end once ``ending()`` says so (the node stopped), or they would hold the server's
shutdown for its whole grace; their callers then go unary."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2, peer_pb2_grpc
from sidecar.api.interceptor import CallInterceptor
from sidecar.api.session import SessionDispatcher
from sidecar.metrics import SidecarMetrics
from sidecar.peers.routes import PeerRoutes
from sidecar.tls import peer_identity

SERVICE = peer_pb2.DESCRIPTOR.services_by_name["PeerService"]
# What the stream carries: every unary call but the handshake (a new peer's first call, and the
# one that tells a caller whom it talks to).
STREAMED = frozenset(m.name for m in SERVICE.methods if not m.client_streaming and m.name != "Handshake")


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    def __init__(
        self,
        routes: PeerRoutes,
        interceptor: CallInterceptor | None = None,
        ending: Callable[[], bool] = lambda: False,
    ) -> None:
        self._routes = routes
        self._stream = SessionDispatcher(
            self, interceptor or CallInterceptor(SidecarMetrics()), ending, service=SERVICE, methods=STREAMED
        )

    async def Stream(
        self, request_iterator: AsyncIterator[engine_pb2.SessionCalls], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.SessionAnswers]:
        async for answers in self._stream.serve(request_iterator, context):
            yield answers

    async def Handshake(
        self, request: peer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.HandshakeResponse:
        return await self._routes.handshake(request)

    async def PushReg(
        self, request: peer_pb2.PushRegRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.PushRegResponse:
        return await self._routes.push_reg(request, peer_identity(context))

    async def Heartbeat(
        self, request: peer_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.HeartbeatResponse:
        return await self._routes.heartbeat(request, peer_identity(context))

    async def QueryCache(
        self, request: peer_pb2.PeerQueryCacheRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.PeerQueryCacheResponse:
        return await self._routes.query_cache(request)

    async def TransferFailed(
        self, request: peer_pb2.TransferFailedRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.TransferFailedResponse:
        return await self._routes.transfer_failed(request, peer_identity(context))

    async def Release(
        self, request: peer_pb2.PeerReleaseRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.PeerReleaseResponse:
        return await self._routes.release(request, peer_identity(context))

    async def GetDigests(
        self, request: peer_pb2.GetDigestsRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.GetDigestsResponse:
        return await self._routes.get_digests(request)

    async def Trace(
        self, request: common_pb2.TraceRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.TraceResponse:
        return await self._routes.trace(request)

    async def Stage(self, request: peer_pb2.StageRequest, context: grpc.aio.ServicerContext) -> peer_pb2.StageResponse:
        return await self._routes.stage(request)
