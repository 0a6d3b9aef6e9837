"""EngineService servicer: one line per RPC, calling the part of the node that owns it.

Validation lives in the owners; logging context, metrics and the mapping of errors to statuses
in ``api.interceptor``. Runs on the event loop thread."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvsidecar.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from sidecar.core.node import Node


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, node: Node) -> None:
        self._node = node
        self._registrations = node.registrations
        self._events = node.events
        self._producer = node.producer
        self._consumer = node.consumer
        self._holds = node.holds

    async def RegisterWorker(
        self, request: engine_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.RegisterWorkerResponse:
        return await self._registrations.register_worker(request)

    async def UnregisterWorker(
        self, request: engine_pb2.UnregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.UnregisterWorkerResponse:
        return await self._registrations.unregister_worker(request)

    async def SubmitBlocks(
        self, request: engine_pb2.SubmitBlocksRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.SubmitBlocksResponse:
        return await self._producer.submit(request)

    async def ExpectPush(
        self, request: engine_pb2.ExpectPushRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ExpectPushResponse:
        return await self._consumer.expect_push(request)

    async def KeepAlive(
        self, request: engine_pb2.KeepAliveRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.KeepAliveResponse:
        return await self._consumer.keep_alive(request)

    async def Pull(self, request: engine_pb2.PullRequest, context: grpc.aio.ServicerContext) -> engine_pb2.PullResponse:
        return await self._consumer.pull(request)

    async def HoldBlocks(
        self, request: engine_pb2.HoldBlocksRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.HoldBlocksResponse:
        return await self._producer.hold(request)

    async def QueryCache(
        self, request: engine_pb2.QueryCacheRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.QueryCacheResponse:
        return await self._holds.query_cache(request)

    async def Release(
        self, request: engine_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ReleaseResponse:
        return await self._node.release(request)

    async def WatchEvents(
        self, request: engine_pb2.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.Event]:
        async for event in self._events.watch(request):
            yield event

    async def Trace(
        self, request: common_pb2.TraceRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.TraceResponse:
        return await self._node.tracing.query(request)

    async def GetStatus(
        self, request: engine_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetStatusResponse:
        return self._node.status(request)
