"""EngineService servicer: per RPC, the caller's right to the engine it names (``_may_act``),
then one line calling the part of the node that owns it.

Validation lives in the owners; logging context, metrics and the mapping of errors to statuses
in ``api.interceptor``; who may act on which engine in ``api.engine_auth`` ("Whose engine").
``Session`` carries these same unary calls on one stream per engine client: ``api.session`` runs
each through the handler its unary RPC runs, and a worker's events as its WatchEvents would.
Runs on the event loop thread."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvsidecar.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from sidecar.api.engine_auth import CALLER, acting_uid
from sidecar.api.interceptor import CallInterceptor
from sidecar.api.session import SessionDispatcher
from sidecar.core.events import Subscription
from sidecar.core.node import Node
from sidecar.errors import PermissionDenied
from sidecar.logs import get_logger

log = get_logger("kvsidecar.server")


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, node: Node) -> None:
        self._node = node
        self._registrations = node.registrations
        self._events = node.events
        self._producer = node.producer
        self._consumer = node.consumer
        self._holds = node.holds
        self._registry = node.registry
        # The session stream's calls run the handlers the server's interceptor would wrap these
        # methods in (same metrics, so they count as the unary calls they stand for).
        self._session = SessionDispatcher(
            self, CallInterceptor(node.metrics), lambda: node.tasks.draining, watch=self._watch_on_session
        )

    @property
    def session(self) -> SessionDispatcher:
        """The session's dispatcher (the plain-socket session, ``api.session_socket``, serves it too)."""
        return self._session

    def _may_act(self, engine_id: str, method: str) -> int | None:
        """The caller's uid if it may act only on its own engines (None: on any); refuses a call
        naming another uid's engine."""
        uid = acting_uid()
        try:
            self._registry.require_owner(engine_id, uid, method)
        except PermissionDenied:
            caller, owner = CALLER.get(), self._registry.engines[engine_id].owner_uid
            log.warning("engine_owner_refused", method=method, engine_id=engine_id, owner_uid=owner, uid=uid,
                        pid=caller.pid if caller else 0)  # fmt: skip
            raise
        return uid

    async def RegisterWorker(
        self, request: engine_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.RegisterWorkerResponse:
        return await self._registrations.register_worker(request, self._may_act(request.engine_id, "RegisterWorker"))

    async def UnregisterWorker(
        self, request: engine_pb2.UnregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.UnregisterWorkerResponse:
        self._may_act(request.engine_id, "UnregisterWorker")
        return await self._registrations.unregister_worker(request)

    async def SubmitBlocks(
        self, request: engine_pb2.SubmitBlocksRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.SubmitBlocksResponse:
        self._may_act(request.engine_id, "SubmitBlocks")
        return await self._producer.submit(request)

    async def ExpectPush(
        self, request: engine_pb2.ExpectPushRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ExpectPushResponse:
        self._may_act(request.engine_id, "ExpectPush")
        return await self._consumer.expect_push(request)

    async def KeepAlive(
        self, request: engine_pb2.KeepAliveRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.KeepAliveResponse:
        self._may_act(request.engine_id, "KeepAlive")
        return await self._consumer.keep_alive(request)

    async def Pull(self, request: engine_pb2.PullRequest, context: grpc.aio.ServicerContext) -> engine_pb2.PullResponse:
        self._may_act(request.engine_id, "Pull")
        return await self._consumer.pull(request)

    async def HoldBlocks(
        self, request: engine_pb2.HoldBlocksRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.HoldBlocksResponse:
        self._may_act(request.engine_id, "HoldBlocks")
        return await self._producer.hold(request)

    async def QueryCache(
        self, request: engine_pb2.QueryCacheRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.QueryCacheResponse:
        self._may_act(request.engine_id, "QueryCache")
        return await self._holds.query_cache(request)

    async def Release(
        self, request: engine_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ReleaseResponse:
        self._may_act(request.engine_id, "Release")
        return await self._node.release(request)

    async def WatchEvents(
        self, request: engine_pb2.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.Event]:
        self._may_act(request.engine_id, "WatchEvents")
        async for event in self._events.watch(request):
            yield event

    async def _watch_on_session(self, request: engine_pb2.WatchEventsRequest, context: object) -> Subscription:
        """A WatchEvents call on the session stream: the same check, the same watch."""
        self._may_act(request.engine_id, "WatchEvents")
        return self._events.subscribe(request)

    async def Trace(
        self, request: common_pb2.TraceRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.TraceResponse:
        return await self._node.tracing.query(request)

    async def GetStatus(
        self, request: engine_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetStatusResponse:
        return self._node.status(request)

    async def Session(
        self, request_iterator: AsyncIterator[engine_pb2.SessionCalls], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.SessionAnswers]:
        async for answers in self._session.serve(request_iterator, context):
            yield answers
