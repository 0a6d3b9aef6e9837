"""The SidecarConnector's transfer statistics, as vLLM's stat loggers see them.

vLLM asks each worker's connector for a ``KVConnectorStats`` every step (on the worker thread,
after ``get_finished``), ships ``data`` to the scheduler process, merges the workers' with
``aggregate`` and, every logging interval, prints ``reduce()`` as "KV Transfer metrics: ...".
``data`` must stay plain builtins (it crosses processes). ``SidecarPromMetrics`` records the same
observations as ``vllm:kvsidecar_*`` metrics on vLLM's own ``/metrics``. The sidecar's Prometheus
endpoint has the full picture; these are the numbers an operator sees next to vLLM's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

_LISTS = (
    "receive_seconds",
    "received_bytes",
    "sent_bytes",
    "call_to_event_seconds",
    "event_to_step_seconds",
    "multi_turn_wait_seconds",
)
_COUNTS = ("load_failures", "leases_expired", "sends_abandoned", "multi_turn_tokens_loaded")
# Multi-turn lookups of a prefill engine's scheduler, by outcome (engine_shim.vllm.multiturn: "hit"
# or a miss reason); the scheduler role reports them (``SchedulerSide.take_stats``).
_LOOKUPS = "multi_turn_lookups"


@dataclass
class SidecarKVConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {**{key: [] for key in _LISTS}, **{key: 0 for key in _COUNTS}, _LOOKUPS: {}}

    def record_lookups(self, outcomes: dict[str, int], tokens_loaded: int, waits: Sequence[float] = ()) -> None:
        """Multi-turn lookups of the scheduler: counts by outcome, the prompt tokens loaded from
        remote holds instead of computed, and how long each decided request was held back for its
        lookup (0 when decided at once)."""
        lookups = self.data.setdefault(_LOOKUPS, {})
        for outcome, count in outcomes.items():
            lookups[outcome] = lookups.get(outcome, 0) + count
        self.data["multi_turn_tokens_loaded"] = self.data.get("multi_turn_tokens_loaded", 0) + tokens_loaded
        self.data.setdefault("multi_turn_wait_seconds", []).extend(waits)

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

    def record_stages(self, call_to_event: float, event_to_step: float) -> None:
        """The engine's part of one request's timeline: the scheduler's call -> its terminal event
        reached the worker, and that -> the vLLM step that applied it (``_WorkerSide._time_stages``)."""
        self.data["call_to_event_seconds"].append(max(0.0, call_to_event))
        self.data["event_to_step_seconds"].append(max(0.0, event_to_step))

    def take(self) -> SidecarKVConnectorStats | None:
        """This interval's stats (None if nothing happened), leaving this object empty."""
        if self.is_empty():
            return None
        taken = SidecarKVConnectorStats(data=self.data)
        self.reset()
        return taken

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in (*_LISTS, *_COUNTS, _LOOKUPS))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _LISTS:
            self.data.setdefault(key, []).extend(other.data.get(key, []))
        for key in _COUNTS:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        self.record_lookups(other.data.get(_LOOKUPS) or {}, 0)
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
        for key, label in (("call_to_event_seconds", "call->event"), ("event_to_step_seconds", "event->step")):
            if self.data.get(key):
                summary[f"Median {label} (ms)"] = round(statistics.median(self.data[key]) * 1000.0, 3)
        summary["Num load failures"] = self.data["load_failures"]
        summary["Num leases expired"] = self.data["leases_expired"]
        summary["Num sends abandoned"] = self.data["sends_abandoned"]
        lookups: dict[str, int] = self.data.get(_LOOKUPS) or {}
        if lookups:  # a prefill engine with multi-turn reuse
            summary["Num multi-turn hits"] = lookups.get("hit", 0)
            summary["Num multi-turn misses"] = sum(lookups.values()) - lookups.get("hit", 0)
            summary["Multi-turn tokens loaded"] = self.data.get("multi_turn_tokens_loaded", 0)
            waits = self.data.get("multi_turn_wait_seconds") or [0.0]
            summary["Median multi-turn wait (ms)"] = round(statistics.median(waits) * 1000.0, 3)
        return summary


def build(data: dict[str, Any] | None) -> SidecarKVConnectorStats:
    return SidecarKVConnectorStats(data=dict(data)) if data else SidecarKVConnectorStats()


_TIME_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_STAGE_BUCKETS = [0.00005, 0.0001, 0.00025, 0.0005, *_TIME_BUCKETS]
_BYTE_BUCKETS = [float(2**power) for power in range(12, 36, 2)]  # 4 KiB .. 16 GiB


class SidecarPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvsidecar_*`` metrics on vLLM's /metrics, fed from the stats' ``data``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        # vLLM types these as a union of the three metric classes.
        histogram_cls: Any = self._histogram_cls
        counter_cls: Any = self._counter_cls

        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        def histogram(name: str, documentation: str, buckets: list[float]) -> dict[int, Any]:
            return per_engine(
                histogram_cls(name=name, documentation=documentation, buckets=buckets, labelnames=labelnames)
            )

        def counter(name: str, documentation: str) -> dict[int, Any]:
            return per_engine(counter_cls(name=name, documentation=documentation, labelnames=labelnames))

        self.histograms = {
            "receive_seconds": histogram(
                "vllm:kvsidecar_receive_time_seconds",
                "Time from a request's Pull/ExpectPush to its KV having arrived, through kvsidecar.",
                _TIME_BUCKETS,
            ),
            "received_bytes": histogram(
                "vllm:kvsidecar_received_bytes", "KV bytes received per request through kvsidecar.", _BYTE_BUCKETS
            ),
            "sent_bytes": histogram(
                "vllm:kvsidecar_sent_bytes", "KV bytes sent per request through kvsidecar.", _BYTE_BUCKETS
            ),
            "call_to_event_seconds": histogram(
                "vllm:kvsidecar_call_to_event_seconds",
                "Time from the connector's request call (Pull / ExpectPush / SubmitBlocks) to its terminal "
                "event reaching the worker.",
                _STAGE_BUCKETS,
            ),
            "event_to_step_seconds": histogram(
                "vllm:kvsidecar_event_to_step_seconds",
                "Time from a terminal event reaching the worker to the vLLM step that applied it.",
                _STAGE_BUCKETS,
            ),
            "multi_turn_wait_seconds": histogram(
                "vllm:kvsidecar_multi_turn_wait_seconds",
                "Time the scheduler held a prefill request back for its multi-turn lookup (0: decided at once).",
                [0.0, *_STAGE_BUCKETS],
            ),
        }
        self.counters = {
            "load_failures": counter(
                "vllm:kvsidecar_load_failures", "Requests whose KV could not be loaded (vLLM recomputed them)."
            ),
            "leases_expired": counter(
                "vllm:kvsidecar_leases_expired",
                "Requests whose blocks this producer freed because no consumer took them in time.",
            ),
            "sends_abandoned": counter(
                "vllm:kvsidecar_sends_abandoned",
                "Requests this producer stopped offering because the sidecar went away.",
            ),
            "multi_turn_tokens_loaded": counter(
                "vllm:kvsidecar_multi_turn_tokens_loaded",
                "Prompt tokens this prefill engine loaded from an earlier turn's hold instead of computing them.",
            ),
        }
        # One child per (engine, outcome), made on first use.
        self._lookups = counter_cls(
            name="vllm:kvsidecar_multi_turn_lookups",
            documentation="Multi-turn lookups of this prefill engine, by outcome: hit, or why it computed the "
            "prompt (no_hold, prefix_mismatch, expiring, below_threshold, slower_than_compute, local_cache, timeout, "
            "query_failed, disabled).",
            labelnames=[*labelnames, "outcome"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in self.histograms.items():
            for value in transfer_stats_data.get(key, []):
                metric[engine_idx].observe(value)
        for key, metric in self.counters.items():
            count = transfer_stats_data.get(key, 0)
            if count:
                metric[engine_idx].inc(count)
        for outcome, count in (transfer_stats_data.get(_LOOKUPS) or {}).items():
            if count:
                self._lookups.labels(*self.per_engine_labelvalues[engine_idx], outcome).inc(count)
