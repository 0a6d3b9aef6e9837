"""Back-off after an overloaded sidecar's refusal: the engine stops asking for a short, bounded
time and refuses the same kind of call itself meanwhile (the engine recomputes, as it would have
after the sidecar's refusal), so a burst past the node's capacity does not spend the node's CPU,
and the engine's, on refusals.

The sidecar's admission by queueing delay (``sidecar.core.admission``) refuses with
RESOURCE_EXHAUSTED and a hint, ``retry after N ms`` (about one request's share of what the node
moves); only refusals carrying it start a back-off, never longer than ``MAX_S``. A call is keyed
by its method and its transfer mode (a push SubmitBlocks refused says nothing about a pull one).

Thread-safe: ``SidecarClient``'s callers and its RPC threads use it.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time
from typing import Any

import grpc

MAX_S = 0.1
BACKING_OFF = "not asked again yet: backing off"
_HINT = re.compile(r"retry after (\d+) ms")


class RefusalBackoff:
    """Per call kind: until when to refuse locally, and the sidecar's reason to repeat."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[tuple[str, int], tuple[float, str]] = {}
        self.local_refusals = 0

    @staticmethod
    def key(method: str, request: Any) -> tuple[str, int]:
        return method, int(getattr(request, "mode", 0))

    def refused_locally(self, method: str, request: Any) -> str | None:
        """The reason to refuse this call without asking, or None to ask the sidecar."""
        key = self.key(method, request)
        with self._lock:
            entry = self._until.get(key)
            if entry is None:
                return None
            if time.monotonic() >= entry[0]:
                del self._until[key]
                return None
            self.local_refusals += 1
        return f"{entry[1]} ({BACKING_OFF})"

    def observe_future(self, method: str, request: Any, done: concurrent.futures.Future[Any]) -> None:
        self.observe(method, request, None if done.cancelled() else done.exception())

    def observe(self, method: str, request: Any, error: BaseException | None) -> None:
        """Note a call's outcome: a RESOURCE_EXHAUSTED with a retry hint starts a back-off."""
        if not isinstance(error, grpc.RpcError) or error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return
        details = error.details() or ""
        hint = _HINT.search(details)
        if hint is None:
            return
        until = time.monotonic() + min(MAX_S, int(hint.group(1)) / 1000.0)
        with self._lock:
            self._until[self.key(method, request)] = (until, details)
