"""Arrivals out of order: a peer's Handshake, PushReg or Heartbeat may name an engine of ours that
is still starting or restarting (its RegisterWorker not here yet, or not all its workers). Such a
call waits for the engine, bounded, instead of failing at once; then it answers as before.

Runs on the event loop thread.
"""

from __future__ import annotations

import time

from sidecar.core.context import NodeContext
from sidecar.logs import get_logger

log = get_logger("kvsidecar.node")

# Peer calls that may wait at once for engines to register; more answer at once, so callers
# naming engines that never come cannot pile up.
MAX_ARRIVAL_WAITERS = 256


async def await_engine(ctx: NodeContext, engine_id: str) -> None:
    """Wait for ``engine_id`` to be complete, up to ``engine_arrival_wait_seconds`` and 80 % of
    the peer call deadline (so the caller gets our answer rather than its own timeout)."""
    registry = ctx.registry
    wait = min(ctx.settings.engine_arrival_wait_seconds, 0.8 * ctx.settings.peer_call_timeout_seconds)
    if registry.is_complete(engine_id) or wait <= 0 or ctx.tasks.draining:
        return
    if registry.arrival_waiters >= MAX_ARRIVAL_WAITERS:
        return
    started = time.monotonic()
    if await registry.wait_complete(engine_id, wait):
        log.info("engine_arrived_while_peer_waited", engine_id=engine_id, waited_s=round(time.monotonic() - started, 3))
    else:
        log.info("engine_did_not_arrive", engine_id=engine_id, waited_s=round(wait, 3))
