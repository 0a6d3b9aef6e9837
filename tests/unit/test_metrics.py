"""The daemon's metrics: FastHistogram counts exactly as prometheus_client's Histogram does, and
SidecarMetrics.child is the labelled child ``labels`` gives."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram

from sidecar.metrics import FastHistogram, SidecarMetrics

BOUNDS = (0.00001, 0.0001, 0.001, 0.01, 0.1, 1.0, 10.0)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_fast_histogram_buckets_and_sums_as_prometheus_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = FastHistogram("h", "h", ["side"], buckets=BOUNDS, registry=ours).labels(side="a")
    plain = Histogram("h", "h", ["side"], buckets=BOUNDS, registry=theirs).labels(side="a")
    # Every bound itself (an observation equal to a bound counts in that bucket), between them,
    # below the first, past the last, zero, negative and infinite.
    values = [*BOUNDS, *(b * 0.999 for b in BOUNDS), *(b * 1.001 for b in BOUNDS), 0.0, -1.0, 1e9, math.inf]
    for value in values:
        fast.observe(value)
        plain.observe(value)
    assert _samples(ours) == _samples(theirs)
    fast.observe(math.nan)
    plain.observe(math.nan)
    assert _samples(ours).keys() == _samples(theirs).keys()
    with pytest.raises(ValueError):
        FastHistogram("p", "p", ["side"], registry=ours).observe(1.0)  # a parent, as prometheus says


def test_child_is_the_labelled_child() -> None:
    metrics = SidecarMetrics()
    child = metrics.child(metrics.request_duration, "pull", "consumer")
    assert child is metrics.request_duration.labels(mode="pull", side="consumer")
    assert metrics.child(metrics.request_duration, "pull", "consumer") is child
    child.observe(0.5)
    labels = {"mode": "pull", "side": "consumer"}
    assert metrics.registry.get_sample_value("kvsidecar_request_transfer_seconds_count", labels) == 1
