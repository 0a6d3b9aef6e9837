"""PeerService servicer: a thin adapter from gRPC to the node's peer handlers."""

from __future__ import annotations

import grpc

from kvsidecar.v1 import peer_pb2, peer_pb2_grpc
from sidecar.node import Node


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, node: Node) -> None:
        self._node = node

    async def Handshake(
        self, request: peer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.HandshakeResponse:
        return await self._node.handle_handshake(request)

    async def PushReg(
        self, request: peer_pb2.PushRegRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.PushRegResponse:
        return await self._node.handle_push_reg(request)

    async def Heartbeat(
        self, request: peer_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.HeartbeatResponse:
        return await self._node.handle_heartbeat(request)

    async def QueryCache(
        self, request: peer_pb2.PeerQueryCacheRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.PeerQueryCacheResponse:
        return await self._node.handle_query_cache(request)

    async def TransferFailed(
        self, request: peer_pb2.TransferFailedRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.TransferFailedResponse:
        return await self._node.handle_transfer_failed(request)

    async def Release(
        self, request: peer_pb2.PeerReleaseRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.PeerReleaseResponse:
        return await self._node.handle_release(request)

    async def GetDigests(
        self, request: peer_pb2.GetDigestsRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.GetDigestsResponse:
        return await self._node.handle_get_digests(request)
