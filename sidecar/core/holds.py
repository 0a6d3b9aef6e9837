"""Held blocks (multi-turn): what this sidecar's engines keep after a finished request for a peer
to reuse, and cache queries about them, both ways.

A held request is a producer request with the hold TTL as its lease (``core.producer``), so the
producer's lease timer expires holds; this object indexes them (``core.cache_index``) and answers:
- ``query_cache`` (EngineService): a local engine asks a peer sidecar (or this one) what it holds;
- ``handle_query_cache`` (PeerService): a peer asks what our engines hold.
Multi-turn reuse policy (when a hold is worth pulling instead of recomputing) belongs here.

Runs on the event loop thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar.core import validation
from sidecar.core.cache_index import CacheIndex, HeldBlocks, HeldKey
from sidecar.core.context import NodeContext
from sidecar.dataplane.plan.layout import BlockIds
from sidecar.errors import InvalidArgument


class Holds:
    def __init__(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        self.index = CacheIndex()
        # Set by the node: when a held request's lease (its TTL) ends, monotonic, or None.
        self.lease_deadline: Callable[[HeldKey], float | None] = lambda key: None

    def __len__(self) -> int:
        return len(self.index)

    def hold(self, engine_id: str, request_id: str, conversation_id: str, blocks: BlockIds, num_tokens: int) -> None:
        """Index held blocks for cache queries; the producer lease (the hold TTL) expires them."""
        self.index.hold(HeldBlocks(engine_id, request_id, conversation_id, blocks, num_tokens, time.monotonic()))
        self._ctx.metrics.held_requests.set(len(self.index))

    def release(self, key: HeldKey) -> None:
        self.index.remove(key)
        self._ctx.metrics.held_requests.set(len(self.index))

    def drop_engine(self, engine_id: str) -> None:
        for key in self.index.keys_of_engine(engine_id):
            self.release(key)

    async def query_cache(self, request: engine_pb2.QueryCacheRequest) -> engine_pb2.QueryCacheResponse:
        validation.identifier(request.engine_id, "engine_id")
        if not request.conversation_id and not request.request_id:
            raise InvalidArgument("conversation_id", "conversation_id or request_id is required")
        validation.address(request.address, "address", required=False)
        validation.identifier(request.conversation_id, "conversation_id", required=False)
        validation.identifier(request.request_id, "request_id", required=False)
        peer_request = peer_pb2.PeerQueryCacheRequest(
            caller_sidecar_id=self._ctx.identity.sidecar_id,
            conversation_id=request.conversation_id,
            request_id=request.request_id,
        )
        response = await self._ctx.peers.query_cache(request.address, peer_request)
        return engine_pb2.QueryCacheResponse(entries=response.entries)

    async def handle_query_cache(self, request: peer_pb2.PeerQueryCacheRequest) -> peer_pb2.PeerQueryCacheResponse:
        if not request.conversation_id and not request.request_id:
            raise InvalidArgument("conversation_id", "conversation_id or request_id is required")
        now = time.monotonic()
        entries = []
        for held in self.index.query(request.conversation_id, request.request_id, request.engine_id):
            engine = self._ctx.registry.engines.get(held.engine_id)
            deadline = self.lease_deadline((held.engine_id, held.request_id))
            entries.append(
                engine_pb2.CacheEntry(
                    engine_id=held.engine_id,
                    request_id=held.request_id,
                    conversation_id=held.conversation_id,
                    block_ids=common_pb2.GroupedBlockIds(
                        groups=[common_pb2.BlockIdList(ids=list(group)) for group in held.block_ids]
                    ),
                    num_tokens=held.num_tokens,
                    expires_in_seconds=max(0.0, deadline - now) if deadline is not None else 0.0,
                    address=self._ctx.identity.advertise_address,
                    tp_size=engine.tp_size if engine else 0,
                )
            )
        return peer_pb2.PeerQueryCacheResponse(sidecar_id=self._ctx.identity.sidecar_id, entries=entries)
