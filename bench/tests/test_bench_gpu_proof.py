"""``bench.gpu_proof --cpu-dry-run``: the GPU proof's whole harness on a machine without a GPU
(engines' KV in shared memory, floors as CPU copies), as a subprocess: every row measured and
verified, each row's protocol parsed from what UCX really printed (daemons and the benchmark's own
process), the transfer's own rate read from the sidecars' traces, targets judged, JSON written.
Its figures are not the GPU path's; ``bench/gpu_run.sh`` runs the real thing on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_proof import segment_pairs
from tests.support.processes import REPO, python_env


def test_block_lists_coalesce_into_runs_contiguous_on_both_sides() -> None:
    assert segment_pairs([1, 2, 3, 7], [5, 6, 9, 10]) == [(1, 5, 2), (3, 9, 1), (7, 10, 1)]


@pytest.mark.slow
def test_the_dry_run_measures_verifies_and_attributes_every_row(tmp_path: Path) -> None:
    out = tmp_path / "gpu-proof.json"
    command = [sys.executable, "-m", "bench.gpu_proof", "--cpu-dry-run", "--sizes", "1", "--runs", "1",
               "--json", str(out)]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=240)
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {row["path"]: row for row in report["rows"]}
    expected = {"kvsidecar-pull", "kvsidecar-push", "kvsidecar-pull-same-node", "kvsidecar-push-same-node",
                "batched-d2d-copy", "pinned-d2h-copy", "raw-nixl-2proc"}  # fmt: skip
    assert expected <= rows.keys(), report["failures"]
    for name, row in rows.items():
        assert row["verified"] or not row["checked"], row
        assert "emulation" not in row["ucx_protocol"], row
        if name.startswith("kvsidecar") or name == "raw-nixl-2proc":
            # What UCX chose for host memory, parsed from the tables it printed.
            assert row["ucx_protocol"] and not row["ucx_protocol"].startswith("unknown"), row
        if name.startswith("kvsidecar"):
            assert row["trace_path"] == "nixl" and row["nixl_transfer_gbps"] > 0, row
    assert report["summary"][-1].startswith("targets:")
    assert "targets:" in result.stdout and "x floor" in result.stdout
