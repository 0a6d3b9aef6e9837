"""`kvsidecar demo` and `kvsidecar bench`: what a newcomer runs first, and what the numbers stand on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from sidecar.tools.launcher import DaemonProcess
from tests.support.processes import python_env, wait_until

ROW_FIELDS = {"scenario": str, "path": str, "bytes": int, "p50_ms": float, "p99_ms": float, "gbps": float}


def test_demo_moves_and_verifies_every_byte_in_push_and_pull() -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.app.cli", "demo"], capture_output=True, text=True, timeout=180, env=python_env()
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: every byte arrived intact." in result.stdout
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.startswith(("push ", "pull "))}
    assert set(rows) == {"push", "pull"}
    for row in rows.values():
        assert row[1] == "200" and row[-1] == "yes"
        assert float(row[2]) > 0.5  # GiB moved: 200 requests of 8-256 blocks of 64 KiB
    assert time.monotonic() - started < 120


def _sidecars_of(pid: int) -> list[int] | None:
    """The pids of the demo's two ``kvsidecar serve`` children once both run, else None."""
    try:
        found = [child.pid for child in psutil.Process(pid).children(recursive=True) if "serve" in child.cmdline()]
    except psutil.Error:
        return None
    return found if len(found) >= 2 else None


def test_demo_stops_cleanly_on_ctrl_c() -> None:
    # Started as a shell's background job would be: with SIGINT ignored (inherited across exec).
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        demo = subprocess.Popen(
            [sys.executable, "-m", "sidecar.app.cli", "demo", "--requests", "100000", "--concurrency", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env(), start_new_session=True,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        # Both sidecars started (the demo listens for SIGINT before it starts them), then a moment
        # for requests to flow. Waited for, not slept: on a loaded machine the start takes seconds.
        children = wait_until(lambda: _sidecars_of(demo.pid), 60.0, 0.1, "the demo's two sidecars")
        time.sleep(1.0)
        demo.send_signal(signal.SIGINT)
        _, stderr = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    assert demo.returncode == 130, stderr
    assert "interrupted" in stderr
    for pid in children:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"child {pid} left"
    # The demo's engines run in the demo's process and name their files after it.
    left = sorted(Path("/dev/shm").glob(f"kvsidecar-{demo.pid}-*"))
    assert not left, f"shared memory left behind: {left}"


def test_a_daemon_start_interrupted_before_it_is_ready_leaves_no_daemon(workdir: Path) -> None:
    """Ctrl-C while the demo (or a benchmark) waits for a sidecar to come up: the caller never got
    the daemon to stop it, so the start itself must."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    daemon = DaemonProcess(workdir, "interrupted")
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.1)  # the daemon is still importing (a second or more)
    try:
        with pytest.raises(KeyboardInterrupt):
            daemon.start()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert daemon.process is not None, "interrupted before the daemon was even started"
    assert daemon.process.poll() is not None, "the daemon outlived the interrupted start"


def test_bench_runs_only_the_scenarios_it_is_given(tmp_path: Path) -> None:
    """``--scenarios``: an issue's rows in one invocation, every path of each; an unknown name is
    refused before anything starts."""
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "sidecar.app.cli", "bench", "--quick", "--only", "transfers", "--json", str(out)]
    result = subprocess.run(
        [*command, "--scenarios", "64KiBx1-adjacent-c1"], capture_output=True, text=True, timeout=300, env=python_env()
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {row["scenario"] for row in rows} == {"64KiBx1-adjacent-c1"}
    assert {"kvsidecar-push", "kvsidecar-pull", "raw-nixl", "raw-nixl-2proc", "memcpy"} <= {row["path"] for row in rows}
    assert all(row["verified"] for row in rows)
    refused = subprocess.run(
        [*command, "--scenarios", "3KiBx7-adjacent-c1"], capture_output=True, text=True, timeout=60, env=python_env()
    )
    assert refused.returncode == 2 and "unknown scenario(s) 3KiBx7-adjacent-c1" in refused.stdout


def test_bench_quick_writes_rows_for_every_path_and_verifies_their_bytes(tmp_path: Path) -> None:
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.app.cli", "bench", "--quick", "--json", str(out), "--png", str(plot)],
        capture_output=True, text=True, timeout=300, env=python_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    paths = {row["path"] for row in rows}
    assert {"kvsidecar-push", "kvsidecar-pull", "raw-nixl", "raw-nixl-2proc", "memcpy"} <= paths
    for row in rows:
        for name, kind in ROW_FIELDS.items():
            assert isinstance(row[name], kind), (name, row)
        assert "ratio_vs_raw_nixl" in row
        assert row["verified"] is True, row
        assert row["bytes"] == row["block_bytes"] * row["blocks"]
        assert row["gbps"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["requests"] >= 1
    transfer_rows = [row for row in rows if not row["scenario"].startswith(("control-plane", "mixed-"))]
    raw = {row["scenario"]: row["gbps"] for row in transfer_rows if row["path"] == "raw-nixl"}
    for row in transfer_rows:
        assert abs(row["ratio_vs_raw_nixl"] - row["gbps"] / raw[row["scenario"]]) < 1e-9
    # Small requests behind large ones, with NIXL posts split (the default) and one post each.
    mixed = [row for row in rows if row["scenario"].startswith("mixed-")]
    assert {(row["extra"]["split"], row["path"]) for row in mixed} == {
        (label, f"kvsidecar-{mode}") for label in ("split", "one-post") for mode in ("push", "pull")
    }
    assert all(row["extra"]["large_requests"] >= 1 for row in mixed)
    control = [row for row in rows if row["scenario"].startswith("control-plane")]
    assert {row["extra"]["target_rps"] for row in control} == {1.0, 100.0, 1000.0}
    # The control path (latency minus NIXL's own transfer time) of every traced request, and the
    # per-stage means from the sidecars' traces.
    for row in control:
        extra = row["extra"]
        assert extra["control_path_requests"] >= 1 and 0 < extra["control_p50_ms"] <= extra["control_p99_ms"]
        assert extra["control_p50_ms"] <= row["p50_ms"] + 1e-6, row  # a part of each latency, never more
        # From the call that let the transfer start: a pull's Pull (after its SubmitBlocks
        # returned), so less than the whole; a push's SubmitBlocks, the whole.
        since_call = extra["control_from_last_call_p50_ms"]
        if row["path"] == "kvsidecar-pull":
            assert 0 < since_call < extra["control_p50_ms"], row
        else:
            assert since_call == extra["control_p50_ms"], row
        assert extra["stages_mean_ms"]["consumer/total"] > 0
        nixl_side = "consumer" if row["path"] == "kvsidecar-pull" else "producer"
        # NIXL's time is split into the post call and the rest after it; on one host the CMA copy
        # happens inside the post, so the rest alone may well be 0 for a small transfer.
        stages = extra["stages_mean_ms"]
        assert stages[f"{nixl_side}/nixl_post"] + stages[f"{nixl_side}/nixl_transfer"] > 0, row
