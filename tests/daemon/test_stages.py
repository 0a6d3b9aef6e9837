"""Per-request stage durations: the sidecar derives them from each request's trace timeline when it
ends and exports ``kvsidecar_request_stage_seconds{side,mode,stage}``; the stages of a request sum
to its total on that sidecar, NIXL's own times are split out, and no request id reaches a label."""

from __future__ import annotations

import re
import socket
import time
import urllib.request

import pytest

from sidecar.core.stages import stage_durations, stage_means
from sidecar.core.trace import Timeline, _Event
from tests.support.moves import PUSH, expect, pull_and_wait, trace_over_socket


def _free_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = int(probe.getsockname()[1])
    probe.close()
    return port


def _scrape(port: int) -> dict[tuple[str, str, str, str], float]:
    """(series suffix, side, mode, stage) -> value of the stage histogram's _count and _sum."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "request_id" not in body
    found = {}
    pattern = r'kvsidecar_request_stage_seconds_(count|sum)\{mode="(\w+)",side="(\w+)",stage="(\w+)"\} (\S+)'
    for suffix, mode, side, stage, value in re.findall(pattern, body):
        found[(suffix, side, mode, stage)] = float(value)
    return found


def _pull_timeline(post: float, transfer: float) -> Timeline:
    line = Timeline("consumer", "D", "r", mode="pull")
    at = [0.0, 0.002, 0.0021, 0.0022, 0.0122, 0.0125]  # posted -> nixl_completion: 10 ms
    kinds = ["admitted", "confirmed", "handshake", "posted", "nixl_completion", "finished"]
    for when, kind in zip(at, kinds, strict=True):
        measured = {"nixl_post": post, "nixl_transfer": transfer} if kind == "nixl_completion" else {}
        line.events.append(_Event(kind, 0.0, 100.0 + when, "", measured))
    return line


def test_stage_durations_sum_to_the_total_and_split_out_nixl_times() -> None:
    # NIXL's transfer time (8 ms) starts at its post, so it includes the 1 ms post.
    stages = stage_durations(_pull_timeline(post=0.001, transfer=0.008))
    assert stages["peer_hop"] == pytest.approx(0.002)
    assert stages["nixl_post"] == pytest.approx(0.001) and stages["nixl_transfer"] == pytest.approx(0.007)
    assert stages["nixl_handoff"] == pytest.approx(0.002)
    assert stages["complete"] == pytest.approx(0.0003)
    parts = sum(v for k, v in stages.items() if k not in ("total", "control"))
    assert parts == pytest.approx(stages["total"]) and stages["total"] == pytest.approx(0.0125)
    assert stages["control"] == pytest.approx(0.0125 - 0.008)


def test_a_copy_inside_the_post_counts_as_nixl_time_not_as_control_path() -> None:
    """On one host UCX copies inside the post: NIXL measured a 9 ms transfer of which 8.5 ms in
    the post. All 9 ms are NIXL's; only the remaining 1 ms of the 10 ms gap is hand-off. (Read
    as post + transfer, 8.5 + 9 overflowed the gap: the transfer was cut to 1.5 ms and 7.5 ms of
    copy were counted as control path.)"""
    stages = stage_durations(_pull_timeline(post=0.0085, transfer=0.009))
    assert stages["nixl_post"] == pytest.approx(0.0085) and stages["nixl_transfer"] == pytest.approx(0.0005)
    assert stages["nixl_handoff"] == pytest.approx(0.001)
    assert stages["control"] == pytest.approx(0.0125 - 0.009)


def test_pull_and_push_export_stage_histograms_per_side_and_mode(sidecars, engines) -> None:
    ports = {"p": _free_port(), "d": _free_port()}
    p_side = sidecars("p", args=["--metrics-listen", f"127.0.0.1:{ports['p']}"])
    d_side = sidecars("d", args=["--metrics-listen", f"127.0.0.1:{ports['d']}"])
    producer = engines(p_side, "P", "producer")
    consumer = engines(d_side, "D", "consumer")
    assert pull_and_wait(producer, consumer, "staged", [1, 2, 3], [4, 5, 6])[0]["event"] == "FINISHED_RECEIVING"
    producer.wait_event("staged")
    expect(consumer, producer, "pushed-d", [7, 8], transfer_id="xfer-stages")
    assert producer.command("submit", request_id="pushed", blocks=[[1, 2]], transfer_id="xfer-stages", mode=PUSH)["ok"]
    assert consumer.wait_event("pushed-d", 20)[0]["event"] == "FINISHED_RECEIVING"
    producer.wait_event("pushed")

    # A request's stages are observed in a loop callback after its event went out (off the
    # event's latency), so the engine can have the event a moment before the scrape shows it.
    deadline = time.monotonic() + 5.0
    while True:
        d_found, p_found = _scrape(ports["d"]), _scrape(ports["p"])
        ended = [("count", "consumer", mode, "total") in d_found for mode in ("pull", "push")]
        ended += [("count", "producer", mode, "total") in p_found for mode in ("pull", "push")]
        if all(ended) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    for found, side, mode, ran_nixl in (
        (d_found, "consumer", "pull", True),
        (d_found, "consumer", "push", False),
        (p_found, "producer", "pull", False),
        (p_found, "producer", "push", True),
    ):
        assert found[("count", side, mode, "total")] == 1, (side, mode, found)
        parts = sum(
            v
            for (s, sd, m, st), v in found.items()
            if (s, sd, m) == ("sum", side, mode) and st not in ("total", "control")
        )
        assert parts == pytest.approx(found[("sum", side, mode, "total")], rel=1e-6, abs=1e-9)
        assert (("count", side, mode, "nixl_transfer") in found) == ran_nixl, (side, mode)
        assert (("count", side, mode, "control") in found) == ran_nixl, (side, mode)
    assert d_found[("count", "consumer", "pull", "peer_hop")] == 1
    # The Trace query carries NIXL's own times too (the benchmark's control path uses them).
    (mine, *_) = trace_over_socket(d_side, request_id="staged-d").sidecars
    completion = next(e for line in mine.requests for e in line.events if e.kind == "nixl_completion")
    assert completion.measured_s["nixl_transfer"] > 0 and "nixl_post" in completion.measured_s
    assert d_found[("count", "consumer", "push", "wait_notification")] == 1
    assert p_found[("count", "producer", "push", "wait_match")] == 1


def test_stage_means_between_two_scrapes() -> None:
    before = {
        'kvsidecar_request_stage_seconds_sum{side="consumer",mode="pull",stage="peer_hop"}': 1.0,
        'kvsidecar_request_stage_seconds_count{side="consumer",mode="pull",stage="peer_hop"}': 10.0,
    }
    after = {
        'kvsidecar_request_stage_seconds_sum{side="consumer",mode="pull",stage="peer_hop"}': 1.004,
        'kvsidecar_request_stage_seconds_count{side="consumer",mode="pull",stage="peer_hop"}': 12.0,
        'kvsidecar_request_stage_seconds_count{side="consumer",mode="pull",stage="handshake"}': 0.0,
        'vllm:kvsidecar_event_to_step_seconds_sum{engine="0",model_name="m"}': 0.003,
        'vllm:kvsidecar_event_to_step_seconds_count{engine="0",model_name="m"}': 2.0,
    }
    assert stage_means(before, after) == {"consumer/pull/peer_hop": 2.0, "engine/event_to_step": 1.5}
