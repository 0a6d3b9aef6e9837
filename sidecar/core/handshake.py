"""Answering handshakes: a peer (or this sidecar, for a same-node transfer) asks for one of our
engines, with the compatibility hash of its own engine; it gets the engine's workers, regions and
agents, or FAILED_PRECONDITION naming both hashes.

Runs on the event loop thread.
"""

from __future__ import annotations

from kvsidecar.v1 import peer_pb2
from sidecar import PROTOCOL_VERSION
from sidecar.core import validation
from sidecar.core.arrivals import await_engine
from sidecar.core.context import NodeContext
from sidecar.core.registry import Engine
from sidecar.dataplane.views import EngineView
from sidecar.errors import FailedPrecondition, NotFound
from sidecar.logs import get_logger
from sidecar.metrics import SidecarMetrics

log = get_logger("kvsidecar.node")

# After serving a handshake, poll NIXL this long so the caller's agents can connect to ours (the
# benchmarks wait it out before measuring a sidecar's idle CPU).
HANDSHAKE_WARM_SECONDS = 5.0


def check_compatibility(engine: Engine, their_hash: str, who: str, metrics: SidecarMetrics) -> None:
    """FAILED_PRECONDITION unless ``their_hash`` (when given) is the engine's compatibility hash."""
    if their_hash and their_hash != engine.compatibility_hash:
        metrics.handshake_failures.labels(reason="compatibility_hash").inc()
        log.warning(
            "compatibility_hash_mismatch",
            engine_id=engine.engine_id,
            local=engine.compatibility_hash,
            remote=their_hash,
            peer=who,
        )
        raise FailedPrecondition(
            f"compatibility hash mismatch for engine {engine.engine_id!r}: local {engine.compatibility_hash}, "
            f"{who} {their_hash}; the engines differ in model, dtype, KV layout factors or versions"
        )


class Handshakes:
    def __init__(self, ctx: NodeContext) -> None:
        self._ctx = ctx

    async def handle(self, request: peer_pb2.HandshakeRequest) -> peer_pb2.HandshakeResponse:
        validation.identifier(request.engine_id, "engine_id")
        validation.address(request.caller.address, "caller.address", required=False)
        if request.caller.versions.protocol and request.caller.versions.protocol != PROTOCOL_VERSION:
            raise FailedPrecondition(
                f"protocol revision {request.caller.versions.protocol} is not {PROTOCOL_VERSION}; "
                "upgrade the older sidecar"
            )
        await self._ctx.peers.note_caller(request.caller)
        await await_engine(self._ctx, request.engine_id)
        self._ctx.trace.learn(request.caller)
        engine = self._engine(request.engine_id, request.compatibility_hash, request.caller.address or "?")
        self._ctx.transport.warm(HANDSHAKE_WARM_SECONDS)
        return peer_pb2.HandshakeResponse(sidecar=self._ctx.identity.info(), engine=engine.descriptor())

    def local_engine_view(self, engine_id: str, compatibility_hash: str) -> EngineView:
        """A local engine as the other side of a same-node transfer (no handshake, no cache)."""
        engine = self._engine(engine_id, compatibility_hash, "this sidecar")
        return engine.view(self._ctx.identity.advertise_address, self._ctx.identity.sidecar_id)

    def _engine(self, engine_id: str, compatibility_hash: str, who: str) -> Engine:
        registry = self._ctx.registry
        if engine_id not in registry.engines:
            raise NotFound(f"engine_id: engine {engine_id!r} is not served by this sidecar")
        engine = registry.require_engine(engine_id, "engine_id")
        check_compatibility(engine, compatibility_hash, f"sidecar {who}", self._ctx.metrics)
        return engine
