"""The SidecarConnector's transfer statistics, as vLLM's stat loggers see them.

vLLM asks each worker's connector for a ``KVConnectorStats`` every step (on the worker thread,
after ``get_finished``), ships ``data`` to the scheduler process, merges the workers' with
``aggregate`` and, every logging interval, prints ``reduce()`` as "KV Transfer metrics: ...".
``data`` must stay plain builtins (it crosses processes). The sidecar's Prometheus endpoint has
the full picture; these are the numbers an operator sees in vLLM's own log.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_LISTS = ("receive_seconds", "received_bytes", "sent_bytes")
_COUNTS = ("load_failures", "leases_expired", "sends_abandoned")


@dataclass
class SidecarKVConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {**{key: [] for key in _LISTS}, **{key: 0 for key in _COUNTS}}

    def record(self, outcome: str, nbytes: int, duration_ms: float) -> None:
        """One request's terminal outcome on this worker (see ``_WorkerSide._record``)."""
        if outcome == "received":
            self.data["receive_seconds"].append(duration_ms / 1000.0)
            self.data["received_bytes"].append(nbytes)
        elif outcome == "sent":
            self.data["sent_bytes"].append(nbytes)
        elif outcome == "load_failed":
            self.data["load_failures"] += 1
        elif outcome == "lease_expired":
            self.data["leases_expired"] += 1
        elif outcome == "send_abandoned":
            self.data["sends_abandoned"] += 1

    def take(self) -> SidecarKVConnectorStats | None:
        """This interval's stats (None if nothing happened), leaving this object empty."""
        if self.is_empty():
            return None
        taken = SidecarKVConnectorStats(data=self.data)
        self.reset()
        return taken

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in (*_LISTS, *_COUNTS))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _LISTS:
            self.data[key].extend(other.data.get(key, []))
        for key in _COUNTS:
            self.data[key] += other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        received: list[float] = self.data["receive_seconds"]
        summary: dict[str, int | float] = {
            "Num received": len(received),
            "Num sent": len(self.data["sent_bytes"]),
            "MB received": round(sum(self.data["received_bytes"]) / 1e6, 3),
            "MB sent": round(sum(self.data["sent_bytes"]) / 1e6, 3),
        }
        if received:
            ordered = sorted(received)
            summary["Median receive time (ms)"] = round(statistics.median(ordered) * 1000.0, 3)
            summary["P90 receive time (ms)"] = round(ordered[int(0.9 * (len(ordered) - 1))] * 1000.0, 3)
        summary["Num load failures"] = self.data["load_failures"]
        summary["Num leases expired"] = self.data["leases_expired"]
        summary["Num sends abandoned"] = self.data["sends_abandoned"]
        return summary


def build(data: dict[str, Any] | None) -> SidecarKVConnectorStats:
    return SidecarKVConnectorStats(data=dict(data)) if data else SidecarKVConnectorStats()
