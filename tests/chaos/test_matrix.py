"""The chaos matrix: SIGKILL, or SIGSTOP past the lease then SIGCONT, of P's engine, D's engine,
P's sidecar or D's sidecar, at each phase of a pull, a push and a multi-turn pull-back, with real
sidecars, real NIXL and simulated engines that verify bytes (tests/chaos/cells.py says how).

Every cell asserts: the waiting side learns within the cell's bound; D's data is correct or the
request failed explicitly; afterwards the surviving sidecars hold no leases, holds, registrations
or transfers, no orphaned shm file is left, their fds are back to baseline, and they still serve
(a fresh transfer, after replacing what was killed, is intact).

``make test`` runs the cells in SUBSET (about a minute); ``make chaos`` (``KVSIDECAR_CHAOS=full``)
runs all 96 and prints the table kept in tests/chaos/README.md.
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.cells import FAULTS, MODES, PHASES, VICTIMS, Cell, Run, Verdict, table
from tests.support.processes import REPO

pytestmark = pytest.mark.chaos
FULL = os.environ.get("KVSIDECAR_CHAOS") == "full"
# Deterministic phases only (an in_flight cell can miss its phase: README), each guarding a bug it
# caught: issue 17 items 8a and 2b, the late READ of a pull that gave up, a stale handshake cached
# from a push registration (issue 12 chaos bug 1) and the first pull after a producer sidecar
# restart on a backing-off channel (chaos bug 2).
SUBSET = {
    Cell("pull", "admitted", "P_engine", "kill"),
    Cell("push", "registration_waiting", "P_sidecar", "stop"),
    Cell("multiturn", "registration_waiting", "D_engine", "stop"),
    Cell("pull", "admitted", "D_sidecar", "kill"),
    Cell("push", "admitted", "P_engine", "kill"),
    Cell("pull", "registration_waiting", "P_sidecar", "kill"),
}
CELLS = [Cell(*values) for values in itertools.product(MODES, PHASES, VICTIMS, FAULTS)]
RESULTS: list[Verdict] = []
# Where a cell that is not green leaves its processes' logs (the test's temporary directory goes
# with the test): the sidecars' JSON logs and the engines' stderr, one folder per cell and run.
LOGS = Path(os.environ.get("KVSIDECAR_CHAOS_LOGS", REPO / "bench" / "out" / "chaos-logs"))


def keep_logs(cell: Cell, workdir: Path) -> Path:
    """Copy the cell's logs (``*.log`` of its work directory) where they outlive the test."""
    target = LOGS / f"{cell.id}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
    target.mkdir(parents=True, exist_ok=True)
    for log in sorted(workdir.glob("*.log")):
        shutil.copy2(log, target / log.name)
    return target


@pytest.fixture(scope="module", autouse=True)
def print_matrix() -> Iterator[None]:
    yield
    if RESULTS:
        print("\n\nchaos matrix\n" + table(RESULTS))


@pytest.mark.parametrize(
    "cell",
    [
        pytest.param(cell, id=cell.id, marks=[] if FULL or cell in SUBSET else [pytest.mark.skip("make chaos")])
        for cell in CELLS
    ],
)
def test_cell(cell: Cell, sidecars: Any, engines: Any, workdir: Path) -> None:
    run: Run | None = None
    try:
        run = Run(cell, sidecars, engines)
        verdict = run.execute()
        run.recover_and_transfer()
    except (AssertionError, TimeoutError, RuntimeError) as exc:  # a step of the cell itself went wrong
        verdict = run.verdict if run is not None else Verdict(cell)
        verdict.problems.append(f"the cell could not run: {' '.join(str(exc).split())[:300]}")
    RESULTS.append(verdict)
    kept = "" if verdict.green else f"; logs kept in {keep_logs(cell, workdir)}"
    if kept:
        print(f"\n{cell.id}: not green{kept}")
    assert verdict.green, f"{cell.id}: {verdict.row()}{kept}"
