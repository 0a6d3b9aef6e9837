"""What the scheduler-role connector tells every worker-role connector each step.

Built on vLLM's scheduler thread, read on each worker's thread; plain builtins only (vLLM ships it
between processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class SidecarConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells every worker each step (plain builtins only)."""

    # Consumer: requests whose KV the sidecar now fetches -> (time.monotonic() of the Pull /
    # ExpectPush call, their local block ids of all groups, flat).
    recv_started: dict[str, tuple[float, list[int]]] = field(default_factory=dict)
    # Consumer: the subset of recv_started that this step loads inline (vLLM scheduled the request
    # with its KV counted as computed) -> seconds the workers wait for the outcome before the
    # forward; its outcome is not reported to vLLM as a finished receive.
    recv_inline: dict[str, float] = field(default_factory=dict)
    # Consumer: request calls that failed (the request must be recomputed) -> reason.
    recv_failed: dict[str, str] = field(default_factory=dict)
    # Producer: requests whose blocks the sidecar now holds for a consumer -> time.monotonic() of
    # the SubmitBlocks call.
    send_started: dict[str, float] = field(default_factory=dict)
    # Producer: submissions that failed -> reason; their blocks can be freed at once.
    send_abandoned: dict[str, str] = field(default_factory=dict)
    # This step computes nothing (vLLM scheduled no token: every request waits, e.g. for its KV),
    # so the worker may wait briefly for an event instead of spinning the engine loop.
    idle: bool = False
