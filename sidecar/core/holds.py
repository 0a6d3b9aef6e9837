"""Held blocks (multi-turn): what this sidecar's engines keep after a finished request for a peer
to reuse, and cache queries about them, both ways.

A held request is a producer request with the hold TTL as its lease (``core.producer``), so the
producer's lease timer expires holds; this object indexes them (``core.cache_index``) and answers:
- ``query_cache`` (EngineService): a local engine asks a peer sidecar (or this one) what it holds;
- ``handle_query_cache`` (PeerService): a peer asks what our engines hold.
Queries find holds by conversation, by request id, or by the asker's prompt block hashes (the
leading blocks whose hashes match are reported per entry); with ``known_peers`` a local engine's
query goes to this sidecar and every peer it knows at once, each answer bounded. The hold policy
(the share of an engine's blocks holds may use, oldest released first) is the producer's
(``core.producer.hold``); whether a hold is worth pulling is the engine's (engine_shim.vllm.multiturn).

Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar.core import validation
from sidecar.core.cache_index import CacheIndex, HeldBlocks, HeldKey
from sidecar.core.context import NodeContext
from sidecar.dataplane.plan.layout import BlockIds
from sidecar.errors import DeadlineExceeded, InvalidArgument
from sidecar.logs import get_logger

log = get_logger("kvsidecar.holds")


class Holds:
    def __init__(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        self.index = CacheIndex()
        # Set by the node: when a held request's lease (its TTL) ends, monotonic, or None.
        self.lease_deadline: Callable[[HeldKey], float | None] = lambda key: None

    def __len__(self) -> int:
        return len(self.index)

    def hold(
        self,
        engine_id: str,
        request_id: str,
        conversation_id: str,
        blocks: BlockIds,
        num_tokens: int,
        block_hashes: tuple[bytes, ...] = (),
    ) -> None:
        """Index held blocks for cache queries; the producer lease (the hold TTL) expires them."""
        held = HeldBlocks(engine_id, request_id, conversation_id, blocks, num_tokens, time.monotonic(), block_hashes)
        self.index.hold(held)
        self._update_gauges()

    def release(self, key: HeldKey, why: str = "released") -> None:
        """A hold ended; ``why`` labels kvsidecar_hold_releases_total (read, ttl, cap, ...)."""
        if self.index.remove(key) is not None:
            self._ctx.metrics.hold_releases.labels(reason=why).inc()
        self._update_gauges()

    def drop_engine(self, engine_id: str) -> None:
        for key in self.index.keys_of_engine(engine_id):
            self.release(key, "engine_gone")

    def _update_gauges(self) -> None:
        self._ctx.metrics.held_requests.set(len(self.index))
        self._ctx.metrics.held_blocks.set(self.index.held_blocks)

    async def query_cache(self, request: engine_pb2.QueryCacheRequest) -> engine_pb2.QueryCacheResponse:
        """Ask one sidecar (``address``; empty: this one) or, with ``known_peers``, this sidecar and
        every peer it knows at once, each bounded by ``timeout_seconds``: a peer that fails or is
        late is listed in ``unreachable``, never waited for past the bound."""
        ctx = self._ctx
        validation.identifier(request.engine_id, "engine_id")
        validation.address(request.address, "address", required=False)
        validation.identifier(request.conversation_id, "conversation_id", required=False)
        validation.identifier(request.request_id, "request_id", required=False)
        hashes = validation.block_hashes(request.block_hashes, "block_hashes", ctx.settings.max_blocks_per_request)
        if not request.conversation_id and not request.request_id and not hashes:
            raise InvalidArgument("conversation_id", "conversation_id, request_id or block_hashes is required")
        timeout = validation.duration(
            request.timeout_seconds, "timeout_seconds", ctx.settings.peer_call_timeout_seconds, maximum=600.0
        )
        peer_request = peer_pb2.PeerQueryCacheRequest(
            caller_sidecar_id=ctx.identity.sidecar_id,
            conversation_id=request.conversation_id,
            request_id=request.request_id,
            block_hashes=hashes,
        )
        addresses = ["", *ctx.peers.known_addresses()] if request.known_peers else [request.address]
        started = time.monotonic()

        # A lookup only saves a recompute: a peer that is down or restarting answers UNAVAILABLE at
        # once (the engine recomputes now) instead of being waited for until the bound.
        async def ask(address: str) -> peer_pb2.PeerQueryCacheResponse:
            async with asyncio.timeout(timeout):
                return await ctx.peers.query_cache(address, peer_request, wait_for_ready=False)

        answers = await asyncio.gather(*(ask(address) for address in addresses), return_exceptions=True)
        entries: list[engine_pb2.CacheEntry] = []
        unreachable: list[str] = []
        for address, answer in zip(addresses, answers, strict=True):
            if isinstance(answer, BaseException):
                if not request.known_peers:
                    if isinstance(answer, TimeoutError):
                        raise DeadlineExceeded(f"peer {address}: no cache answer within {timeout:g}s")
                    raise answer
                log.info("cache_query_unanswered", peer=address, error=repr(answer))
                unreachable.append(address)
                continue
            entries.extend(answer.entries)
        entries.sort(key=lambda entry: (entry.matched_blocks, entry.expires_in_seconds), reverse=True)
        log.debug(
            "cache_query_answered",
            peers=len(addresses),
            entries=len(entries),
            matched_blocks=entries[0].matched_blocks if entries else 0,
            ms=round((time.monotonic() - started) * 1000.0, 2),
        )
        self._count_lookup(entries, bool(hashes), unreachable, request.engine_id)
        return engine_pb2.QueryCacheResponse(entries=entries, unreachable=unreachable)

    def _count_lookup(
        self, entries: list[engine_pb2.CacheEntry], by_hash: bool, unreachable: list[str], engine_id: str
    ) -> None:
        """Lookup outcome metrics on the asking side: hits (and the tokens they cover), misses by reason."""
        metrics = self._ctx.metrics
        best = entries[0] if entries else None
        if best is not None and (best.matched_blocks or not by_hash):
            metrics.cache_lookups.labels(outcome="hit").inc()
            engine = self._ctx.registry.engines.get(engine_id)
            block_size = engine.ordered_workers()[0].layout.block_size if engine and engine.workers else 0
            metrics.cache_matched_tokens.inc(best.matched_blocks * block_size if by_hash else best.num_tokens)
            return
        if best is not None:
            reason = "prefix_mismatch"
        elif unreachable:
            reason = "peer_unreachable"
        else:
            reason = "no_hold"
        metrics.cache_lookups.labels(outcome=reason).inc()

    async def handle_query_cache(self, request: peer_pb2.PeerQueryCacheRequest) -> peer_pb2.PeerQueryCacheResponse:
        ctx = self._ctx
        validation.identifier(request.conversation_id, "conversation_id", required=False)
        validation.identifier(request.request_id, "request_id", required=False)
        hashes = validation.block_hashes(request.block_hashes, "block_hashes", ctx.settings.max_blocks_per_request)
        if not request.conversation_id and not request.request_id and not hashes:
            raise InvalidArgument("conversation_id", "conversation_id, request_id or block_hashes is required")
        now = time.monotonic()
        entries = []
        for match in self.index.query(request.conversation_id, request.request_id, request.engine_id, hashes):
            held = match.entry
            engine = ctx.registry.engines.get(held.engine_id)
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
                    address=ctx.identity.advertise_address,
                    tp_size=engine.tp_size if engine else 0,
                    block_hashes=held.block_hashes,
                    matched_blocks=match.matched_blocks,
                    engine_generation=engine.generation if engine else "",
                )
            )
        return peer_pb2.PeerQueryCacheResponse(sidecar_id=ctx.identity.sidecar_id, entries=entries)
