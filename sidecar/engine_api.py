"""EngineService servicer: a thin adapter from gRPC to ``Node``. Validation, error mapping and
logging context live in the node and in ``server.CallInterceptor``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvsidecar.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from sidecar.node import Node


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, node: Node) -> None:
        self._node = node

    async def RegisterWorker(
        self, request: engine_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.RegisterWorkerResponse:
        return await self._node.register_worker(request)

    async def UnregisterWorker(
        self, request: engine_pb2.UnregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.UnregisterWorkerResponse:
        return await self._node.unregister_worker(request)

    async def SubmitBlocks(
        self, request: engine_pb2.SubmitBlocksRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.SubmitBlocksResponse:
        return await self._node.submit_blocks(request)

    async def ExpectPush(
        self, request: engine_pb2.ExpectPushRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ExpectPushResponse:
        return await self._node.expect_push(request)

    async def KeepAlive(
        self, request: engine_pb2.KeepAliveRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.KeepAliveResponse:
        return await self._node.keep_alive(request)

    async def Pull(self, request: engine_pb2.PullRequest, context: grpc.aio.ServicerContext) -> engine_pb2.PullResponse:
        return await self._node.pull(request)

    async def HoldBlocks(
        self, request: engine_pb2.HoldBlocksRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.HoldBlocksResponse:
        return await self._node.hold_blocks(request)

    async def QueryCache(
        self, request: engine_pb2.QueryCacheRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.QueryCacheResponse:
        return await self._node.query_cache(request)

    async def Release(
        self, request: engine_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ReleaseResponse:
        return await self._node.release(request)

    async def WatchEvents(
        self, request: engine_pb2.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.Event]:
        async for event in self._node.watch_events(request):
            yield event

    async def Trace(
        self, request: common_pb2.TraceRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.TraceResponse:
        return await self._node.trace_request(request)

    async def GetStatus(
        self, request: engine_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetStatusResponse:
        return self._node.status(request)
