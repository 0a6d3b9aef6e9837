"""The connector's stats as vLLM's stat loggers see them: the engine's part of each request's
timeline (call -> event seen, event seen -> step) is kept, crosses processes as plain builtins,
aggregates across workers and reduces to medians. (vLLM is imported, no engine is started.)"""

from __future__ import annotations

import json

from engine_shim.vllm_stats import SidecarKVConnectorStats, build


def test_stage_timings_survive_take_aggregate_and_reduce() -> None:
    worker_a, worker_b = SidecarKVConnectorStats(), SidecarKVConnectorStats()
    worker_a.record("received", 4096, 12.0)
    worker_a.record_stages(0.010, 0.0005)
    worker_b.record_stages(0.030, -0.000001)  # clocks of one host never go back; clamp noise to 0
    taken_a, taken_b = worker_a.take(), worker_b.take()
    assert taken_a is not None and taken_b is not None and worker_a.is_empty()
    merged = build(json.loads(json.dumps(taken_a.data)))  # what crosses the process boundary
    merged.aggregate(taken_b)
    assert merged.data["call_to_event_seconds"] == [0.010, 0.030]
    assert merged.data["event_to_step_seconds"] == [0.0005, 0.0]
    summary = merged.reduce()
    assert summary["Median call->event (ms)"] == 20.0 and summary["Median event->step (ms)"] == 0.25
