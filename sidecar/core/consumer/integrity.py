"""The consumer's integrity check (``integrity = "digest"``): received blocks against the
producer's digests before FINISHED_RECEIVING. Used by pull (digests asked before the READ) and
push (digests carried by the WRITE notifications). Runs on the event loop thread; the digests
themselves are computed in a worker thread.
"""

from __future__ import annotations

import asyncio

from kvsidecar.v1 import engine_pb2, peer_pb2
from sidecar.core.consumer.table import ConsumerRequest, ConsumerTable
from sidecar.core.context import NodeContext
from sidecar.dataplane.integrity import DigestSpan, check_span, digests, first_mismatch
from sidecar.dataplane.plan.convert import single_group
from sidecar.dataplane.plan.layout import PlanError


class DigestCheck:
    def __init__(self, ctx: NodeContext, table: ConsumerTable) -> None:
        self._ctx = ctx
        self._table = table

    def applies(self, pending: ConsumerRequest) -> bool:
        """Digests cover one KV cache group; hybrid models' requests move unchecked."""
        return self._ctx.settings.integrity == "digest" and len(pending.local_blocks) == 1

    async def finish_checked(self, pending: ConsumerRequest, expected: peer_pb2.KvDigests | None) -> None:
        """FINISHED_RECEIVING if the local blocks match the producer's digests, else LOAD_FAILED
        naming the first block that differs. Runs in a task of the local engine."""
        problem = await self._check_digests(pending, expected)
        if not self._table.is_open(pending):
            return  # failed meanwhile (watchdog, release)
        if problem:
            self._table.fail(pending, problem, reason_label="integrity")
        else:
            self._table.finish(pending, engine_pb2.Event(kind=engine_pb2.FINISHED_RECEIVING))

    async def _check_digests(self, pending: ConsumerRequest, expected: peer_pb2.KvDigests | None) -> str | None:
        if expected is None or not expected.values:
            return "integrity check failed: the producer sent no digests (is its sidecar too old?)"
        engine = self._ctx.registry.engines.get(pending.engine_id)
        if engine is None:  # its worker went meanwhile (drop_engine failed the request)
            return f"integrity check could not run: engine {pending.engine_id!r} is gone"
        span = DigestSpan.from_proto(expected)
        layouts = [worker.layout for worker in engine.ordered_workers()]
        try:
            blocks = single_group(pending.local_blocks, "the request")
            problem = check_span(span, span.first + len(blocks) * layouts[0].block_size)
            if problem:
                return f"integrity check failed: the producer's digests cover {problem}"
            mine = await asyncio.to_thread(digests, layouts, blocks, span.first, span)
        except (PlanError, IndexError, ValueError) as exc:
            return f"integrity check could not run: {exc}"
        bad = first_mismatch(mine, list(expected.values))
        if bad is None:
            return None
        token = span.first + bad * span.granule
        block = blocks[(token - span.first) // layouts[0].block_size]
        last = min(token + span.granule, span.end) - 1
        return (
            f"integrity check failed: block {block} (tokens {token}..{last}) does not match the producer's "
            f"digest ({len(mine)} digests of {span.granule} tokens compared)"
        )
