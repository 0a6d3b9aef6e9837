"""A request a producer engine offered (``SubmitBlocks``, ``HoldBlocks``), as the producer side
and its push writer (``core.push``) both see it, and who may act on it. Plain data and one rule;
no I/O but a log line. Used on the event loop thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvsidecar.v1 import common_pb2
from sidecar.core.admission import Ticket
from sidecar.core.matching import Registration
from sidecar.core.notices import NoticeTally
from sidecar.dataplane.plan.layout import BlockIds
from sidecar.errors import NotFound, PermissionDenied
from sidecar.logs import get_logger

log = get_logger("kvsidecar.producer")

RequestKey = tuple[str, str]  # (engine_id, request_id)


@dataclass
class ProducerRequest:
    engine_id: str
    request_id: str
    transfer_id: str
    block_ids: BlockIds
    num_tokens: int
    mode: int
    lease_seconds: float
    created: float = field(default_factory=time.monotonic)
    notices: NoticeTally = field(default_factory=NoticeTally)
    writing: bool = False
    # A push's WRITEs, from the match: this node's work, counted in ``ctx.tasks.transfers`` until it ends.
    queued: Ticket | None = field(default=None, repr=False, compare=False)
    # While writing: the registration's deadline for posting a WRITE (``PushOrder.writes_until``).
    writes_until: float = 0.0
    held: bool = False
    bytes_moved: int = 0
    # Until when (monotonic) a consumer may still READ these blocks (see the module docstring).
    readable_until: float = 0.0
    # Released (or its hold TTL ended) but a consumer may still READ: the event to emit when freed.
    closing: tuple[int, str] | None = None
    # Why a push's blocks are freed once its WRITEs end: (event kind, reason).
    end: tuple[int, str] | None = None
    # The consumer's certificate identity (mTLS): from its push registration, or the first peer
    # that heartbeats or releases a pull. Other peers may not act on the request.
    peer_identity: str = ""

    @property
    def key(self) -> RequestKey:
        return (self.engine_id, self.request_id)

    @property
    def accepts_pull(self) -> bool:
        return self.mode != common_pb2.TRANSFER_MODE_PUSH

    @property
    def accepts_push(self) -> bool:
        return self.mode != common_pb2.TRANSFER_MODE_PULL and not self.held

    def end_after_writes(self, kind: int, reason: str) -> None:
        """Free this request, being pushed, once its WRITEs are terminal, with this event; the
        first reason given wins."""
        if self.end is None:
            self.end = (kind, reason)


def authorize(holder: ProducerRequest | Registration[Any], identity: str, action: str, what: str) -> None:
    """With mTLS, only the peer that is a party to a transfer may act on it (``sidecar.tls``).
    The first authenticated peer to act on a pull claims it; a push is its registration's.
    ``identity``: the caller's certificate names with mTLS, "" without (a plaintext port, the
    local Unix socket, or this sidecar calling itself)."""
    if not identity:
        return
    current = holder.peer_identity if isinstance(holder, ProducerRequest) else holder.identity
    if not current:
        if isinstance(holder, ProducerRequest):
            holder.peer_identity = identity
        return
    if current != identity:
        log.warning("peer_refused", action=action, request=what, peer_identity=identity, party=current)
        raise PermissionDenied(f"{action}: {what} belongs to the peer with certificate {current!r}, not {identity!r}")


def count_blocks(blocks: BlockIds) -> int:
    return sum(len(group) for group in blocks)


class HasRequestKey(Protocol):
    """A peer's call naming a producer request (GetDigestsRequest, StageRequest)."""

    @property
    def engine_id(self) -> str: ...
    @property
    def request_id(self) -> str: ...


def held_for_pull(pending: ProducerRequest | None, request: HasRequestKey) -> ProducerRequest:
    """The request a peer may read now (GetDigests, Stage), as found for ``request``; NotFound
    if it is not held, not pullable, or closing."""
    if pending is None or not pending.accepts_pull or pending.closing is not None:
        raise NotFound(f"request {request.request_id!r} of engine {request.engine_id!r} is not held here")
    return pending
