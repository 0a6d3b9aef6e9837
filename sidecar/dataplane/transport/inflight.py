"""One NIXL post in flight and what it reports when it ends (owner thread only).

A post keeps its handle until NIXL releases it (``release``): a transfer that cannot be released
may still move bytes, so the owner thread keeps it (and its blocks) and reports only later. A post
NIXL reports DONE after its deadline is a failure (``result``): its bytes may have moved after the
other side reused the memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sidecar.dataplane.contract import TransferResult
from sidecar.dataplane.transport.agents import Agent
from sidecar.dataplane.transport.chunks import Split
from sidecar.logs import get_logger

log = get_logger("kvsidecar.transport")


@dataclass
class Post:
    agent_name: str
    handle: Any
    op: str
    deadline: float
    future: Any  # the caller's waiter (completed through the outbox)
    started: float
    cancel_reason: str = ""
    split: Split | None = None  # the transfer this post is a chunk of
    queued: float = 0.0  # when the loop queued the command (0: not measured)
    posted: float = 0.0  # when the post returned
    observed: bool = True  # reported to on_xfer_done (RunsSpec.observed)

    def release(self) -> bool:
        try:
            self.handle.release()
            return True
        except Exception:
            return False

    def result(self, state: Agent) -> TransferResult:
        """The result of a post NIXL reported DONE, with NIXL's telemetry and the hand-off's times
        (the trace's owner_wait / owner_post / owner_done)."""
        now = time.monotonic()
        if now > self.deadline:
            log.warning("nixl_transfer_done_after_deadline", agent=self.agent_name, op=self.op)
            return TransferResult(False, f"{self.op} completed only after its deadline; its data is not trusted")
        result = TransferResult(True, duration_s=now - self.started)
        if self.queued and self.posted:
            result.handoff = {
                "owner_wait": self.started - self.queued,
                "owner_post": self.posted - self.started,
                "owner_done": now - self.posted,
            }
        try:
            telemetry = state.agent.get_xfer_telemetry(self.handle)
            result.bytes = int(telemetry.totalBytes)
            result.descriptors = int(telemetry.descCount)
            result.duration_s = telemetry.xferDuration / 1e6
            result.post_s = telemetry.postDuration / 1e6
        except Exception:
            pass
        return result
