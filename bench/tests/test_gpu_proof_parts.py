"""bench.gpu_proof's pure parts, without a GPU: UCX_PROTO_INFO parsing (on the tables the H200 run
of 2026-11-28 printed), the transfer's own time from a trace, and issue 33's targets per row."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.gpu_proof_parts import (
    BATCHED_D2D,
    PINNED_D2H,
    RAW_NIXL,
    TraceEvent,
    emulated,
    emulation_rows,
    judge,
    judge_all,
    parse_proto_info,
    protocol_for,
    summary,
    timelines_transfer,
    transfer_path,
    transfer_seconds,
)

MIB = 1024 * 1024

# As the sidecar daemons printed them on the H200 (../shared/reference/gpu-h200-2026-11-28/), two
# processes interleaved, with a context header in the older layout and the rows' borders.
SIDECAR_LOG = """\
{"event": "worker_registered", "engine_id": "bench-P"}
[1795896913.268508] [vm:4022 :0]   +---------------------+-------------------------------------------------------+
[1795896913.268508] [vm:4022 :0]   | ucp_context_0 cfg#4 | remote memory write by ucp_put* from host memory to cuda |
[1795896913.268508] [vm:4022 :0]   +--------+--------------------+--------+
[1795896913.268508] [vm:4022 :0]   | 0..inf | software emulation | tcp/lo |
[1795896913.269567] [vm:4022 :0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda |
[1795896915.129582] [vm:3967 :0]   | remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda |
[1795896913.269567] [vm:4022 :0]   +--------+--------------------+--------+
[1795896913.269567] [vm:4022 :0]   | 0..inf | software emulation | tcp/lo |
[1795896915.130608] [vm:3967 :0]   | 0..inf | software emulation | tcp/lo |
"""
RAW_LOG = """\
[1795896921.640336] [vm:3943 :0]   | remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[1] |
[1795896921.640336] [vm:3943 :0]   +--------+-------------+---------------+
[1795896921.640336] [vm:3943 :0]   | 0..8184 | short      | cuda_ipc/cuda |
[1795896921.640336] [vm:3943 :0]   | 8185..inf | zero-copy | cuda_ipc/cuda |
"""


def test_the_h200_sidecar_tables_say_software_emulation_for_gpu_reads_and_writes() -> None:
    choices = parse_proto_info(SIDECAR_LOG)
    assert [(c.pid, c.op, c.src, c.dst) for c in choices] == [
        ("4022", "WRITE", "host", "cuda"),
        ("4022", "READ", "cuda", "cuda"),
        ("3967", "WRITE", "cuda", "cuda"),
    ]
    assert protocol_for(choices, "READ") == "software emulation | tcp/lo"
    assert protocol_for(choices, "WRITE") == "software emulation | tcp/lo"
    assert protocol_for(choices, "WRITE", "host", "host") == ""
    assert len(emulated(choices)) == 3


def test_the_raw_two_process_table_is_zero_copy_over_cuda_ipc() -> None:
    choices = parse_proto_info(RAW_LOG)
    assert protocol_for(choices, "WRITE") == "short | cuda_ipc/cuda; zero-copy | cuda_ipc/cuda"
    assert emulated(choices) == []
    assert protocol_for(choices, "READ") == ""


def _event(kind: str, at: float, transfer: float = 0.0, detail: str = "", **measured: float) -> TraceEvent:
    values = {"nixl_transfer": transfer, **measured} if transfer else dict(measured)
    return TraceEvent(kind, at, detail, values)


def test_the_transfer_time_counts_overlapping_transfers_once() -> None:
    events = [
        _event("admitted", 0.0),
        # Two ranks' transfers overlap from 0.010 to 0.030, a third chunk runs 0.040-0.050; the
        # loop resumed 1 ms after the last completion was seen.
        _event("nixl_completion", 0.030, 0.020),
        _event("nixl_completion", 0.025, 0.010),
        _event("nixl_completion", 0.051, 0.010, loop_resume=0.001),
        _event("FINISHED_RECEIVING", 0.060),
    ]
    assert transfer_seconds(events) == pytest.approx(0.030)
    assert transfer_path(events) == "nixl"
    assert transfer_seconds([_event("admitted", 0.0)]) == 0.0
    assert transfer_path([_event("admitted", 0.0)]) == ""


def test_the_path_comes_from_the_completion_events_detail() -> None:
    copy = [TraceEvent("copy_completion", 0.01, "READ 64 segments path=device_copy", {"copy_transfer": 0.002})]
    assert transfer_path(copy) == "device_copy"
    assert transfer_seconds(copy) == pytest.approx(0.002)
    mixed = [*copy, _event("nixl_completion", 0.02, 0.001, detail="WRITE path=host_staging")]
    assert transfer_path(mixed) == "device_copy+host_staging"


def test_the_timeline_that_ran_the_transfer_gives_path_and_time() -> None:
    class Line:
        def __init__(self, events: list[TraceEvent]) -> None:
            self.events = events

    producer = Line([_event("admitted", 0.0), _event("released", 0.5)])
    consumer = Line([_event("admitted", 0.0), _event("nixl_completion", 0.2, 0.004, detail="path=device_copy")])
    assert timelines_transfer([producer, consumer]) == ("device_copy", pytest.approx(0.004))


def _row(path: str, size_mib: int, gbps: float, p50_ms: float, **extra: Any) -> dict[str, Any]:
    return {"path": path, "bytes": size_mib * MIB, "gbps": gbps, "p50_ms": p50_ms, "verified": True, **extra}


def _floors(size_mib: int) -> list[dict[str, Any]]:
    return [
        _row(RAW_NIXL, size_mib, 100.0, 0.2, checked=False, ucx_protocol="zero-copy | cuda_ipc/cuda"),
        _row(BATCHED_D2D, size_mib, 400.0, 0.05),
        _row(PINNED_D2H, size_mib, 50.0, 1.0),
    ]


def test_two_sidecars_meet_their_targets_only_with_zero_copy_rate_and_latency() -> None:
    rows = _floors(16)
    good = _row("kvsidecar-pull", 16, 10.0, 1.6, nixl_transfer_gbps=85.0, ucx_protocol="zero-copy | cuda_ipc/cuda")
    verdict = judge(good, [*rows, good])
    assert verdict.met is True and verdict.ratio == pytest.approx(0.85), verdict
    slow = dict(good, nixl_transfer_gbps=70.0)
    assert judge(slow, rows).met is False
    late = dict(good, p50_ms=1.8)
    assert "p50" in judge(late, rows).problems[0]
    emulation = dict(good, ucx_protocol="software emulation | tcp/lo")
    problems = judge(emulation, rows).problems
    assert any("software emulation" in p for p in problems) and judge(emulation, rows).met is False
    # Below 16 MiB only the protocol and the latency count.
    small = _row("kvsidecar-push", 1, 0.5, 1.0, nixl_transfer_gbps=0.1, ucx_protocol="device_copy")
    assert judge(small, _floors(1)).met is True


def test_one_sidecar_and_host_staging_are_judged_against_their_own_floors() -> None:
    rows = _floors(64)
    local = _row("kvsidecar-pull-same-node", 64, 5.0, 3.0, nixl_transfer_gbps=330.0, ucx_protocol="device_copy")
    assert judge(local, rows).met is True
    assert judge(dict(local, nixl_transfer_gbps=300.0), rows).met is False  # 0.75 x 400
    staged = _row("host-staging-pull", 64, 26.0, 3.0, ucx_protocol="host_staging")
    assert judge(staged, rows).met is True and judge(staged, rows).ratio == pytest.approx(0.52)
    assert judge(dict(staged, gbps=20.0), rows).met is False
    # Host staging below 64 MiB has no rate target; it still must be verified.
    assert judge(_row("host-staging-pull", 16, 1.0, 3.0, ucx_protocol="host_staging"), _floors(16)).met is None
    unverified = _row("host-staging-pull", 16, 1.0, 3.0, ucx_protocol="host_staging", verified=False)
    assert judge(unverified, _floors(16)).met is False


def test_a_missing_floor_is_a_missed_target_not_a_pass() -> None:
    row = _row("kvsidecar-pull", 16, 10.0, 1.0, nixl_transfer_gbps=85.0, ucx_protocol="device_copy")
    verdict = judge(row, [row])
    assert verdict.met is False and "no raw NIXL row" in verdict.problems[0]


def test_the_summary_counts_and_names_the_missed_rows() -> None:
    rows = [
        *_floors(16),
        _row("kvsidecar-pull", 16, 10.0, 1.0, nixl_transfer_gbps=90.0, ucx_protocol="device_copy"),
        _row("kvsidecar-push", 16, 10.0, 1.0, nixl_transfer_gbps=9.0, ucx_protocol="software emulation | tcp/lo"),
    ]
    lines = summary(judge_all(rows))
    assert lines[-1] == "targets: 1 of 2 rows met, 1 missed"  # the floors have no target
    assert any(line.startswith("MISSED kvsidecar-push 16 MiB") for line in lines)
    assert emulation_rows(rows) == ["kvsidecar-push 16 MiB"]


def test_each_row_gets_the_protocol_of_the_processes_that_moved_it(tmp_path: Path) -> None:
    """bench.gpu_proof._attribute_protocols on logs as the daemons and the benchmark leave them."""
    from bench.gpu_proof import _attribute_protocols

    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "d.log").write_text(SIDECAR_LOG)
    (tmp_path / "staging").mkdir()
    (tmp_path / "staging" / "d.log").write_text(
        "[1.0] [vm:77 :0]   | remote memory read by ucp_get*(multi) into host memory from cuda |\n"
        "[1.0] [vm:77 :0]   | 0..inf | software emulation | tcp/lo |\n"
    )
    (tmp_path / "one").mkdir()
    (tmp_path / "ucx-proto-bench.log").write_text(RAW_LOG)
    rows = [
        SimpleNamespace(path="kvsidecar-pull", extra={"trace_path": "nixl"}),
        SimpleNamespace(path="kvsidecar-pull-same-node", extra={"trace_path": "device_copy"}),
        SimpleNamespace(path="host-staging-pull", extra={"trace_path": "host_staging"}),
        SimpleNamespace(path=RAW_NIXL, extra={}),
        SimpleNamespace(path=BATCHED_D2D, extra={"ucx_protocol": "n/a: a torch copy in this process"}),
    ]
    pairs = {"kvsidecar-pull": "two", "kvsidecar-pull-same-node": "one", "host-staging-pull": "staging"}
    _attribute_protocols(rows, {**pairs, RAW_NIXL: "bench"}, tmp_path, tmp_path)
    protocols = [row.extra["ucx_protocol"] for row in rows]
    assert protocols == [
        "software emulation | tcp/lo",
        "device_copy",
        "host_staging; UCX: software emulation | tcp/lo (cuda->host)",  # no target-side staging: flagged
        "short | cuda_ipc/cuda; zero-copy | cuda_ipc/cuda",
        "n/a: a torch copy in this process",
    ]
    assert emulation_rows([{"path": r.path, "bytes": MIB, **r.extra} for r in rows]) == [
        "kvsidecar-pull 1 MiB",
        "host-staging-pull 1 MiB",
    ]


# As the nixl-cu12 1.5.1 wheel's UCX printed them on this CPU machine (bench.gpu_proof
# --cpu-dry-run): the context on its own line, a header row, a single-size range.
REAL_LAYOUT = """\
[1795904723.002428] [vm:11983:0]   +--------+-------------+-----------------------------------+
[1795904723.002428] [vm:11983:0]   | bench-raw-writer-14068548421128 self cfg#0               |
[1795904723.002428] [vm:11983:0]   | remote memory write by ucp_put* from host memory to host |
[1795904723.002428] [vm:11983:0]   +--------+-------------+-----------------------------------+
[1795904723.002428] [vm:11983:0]   | Range  | Description |              Config               |
[1795904723.002428] [vm:11983:0]   +--------+-------------+-----------------------------------+
[1795904723.002428] [vm:11983:0]   | 0..inf | zero-copy   | cma/memory                        |
[1795904723.002428] [vm:11983:0]   +--------+-------------+-----------------------------------+
[1795904723.003320] [vm:11983:0]   | bench-raw-writer-14068548421128 self cfg#0      |
[1795904723.003320] [vm:11983:0]   | active message by ucp_am_send* from host memory |
[1795904723.003320] [vm:11983:0]   |   Range    |    Description     |    Config     |
[1795904723.003320] [vm:11983:0]   |          0 | short              | tcp/lo        |
[1795904723.003320] [vm:11983:0]   |   1..16515 | zero-copy          | tcp/lo        |
"""


def test_the_layout_ucx_prints_today_parses_with_its_context_line_and_header() -> None:
    choices = parse_proto_info(REAL_LAYOUT)
    assert [(c.op, c.src, c.dst, c.size_range, c.text) for c in choices] == [
        ("WRITE", "host", "host", "0..inf", "zero-copy | cma/memory"),
        ("", "", "", "0", "short | tcp/lo"),
        ("", "", "", "1..16515", "zero-copy | tcp/lo"),
    ]
    assert protocol_for(choices, "WRITE", "host", "host") == "zero-copy | cma/memory"
    assert protocol_for(choices, "WRITE") == ""  # no GPU memory in these tables
