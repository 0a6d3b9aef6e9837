"""The chaos matrix's GPU fault cells (issue 35 item 4; ``tests/chaos/gpu_cells.py`` says what each
does and asserts): an engine killed while the sidecars map its GPU memory, a sidecar killed while
a device copy into or out of an engine's memory runs, and a device copy that never completes.
They run where PyTorch sees a CUDA GPU (``bench/gpu_run.sh`` runs them) and are skipped with the
reason elsewhere. The hung copy's bound is also covered without a GPU, on ``FakeCudaDriver``
(``tests/unit/test_cuda_copy.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine_shim.cuda_memory import cuda_available
from tests.chaos.gpu_cells import CELLS, GpuRun, GpuVerdict
from tests.chaos.test_matrix import keep_logs

NO_GPU = cuda_available()
pytestmark = [pytest.mark.chaos, pytest.mark.skipif(NO_GPU is not None, reason=f"needs a CUDA GPU: {NO_GPU}")]
RESULTS: list[GpuVerdict] = []


@pytest.fixture(scope="module", autouse=True)
def print_cells() -> Iterator[None]:
    yield
    if RESULTS:
        header = "| cell | bound s | who learned what, when | D's data | copy held | verdict |\n" + "|---" * 6 + "|"
        print("\n\nGPU fault cells\n" + header + "\n" + "\n".join(v.row() for v in RESULTS))


@pytest.mark.parametrize("cell", CELLS)
def test_gpu_fault_cell(cell: str, sidecars: Any, engines: Any, workdir: Path) -> None:
    run: GpuRun | None = None
    try:
        run = GpuRun(cell, sidecars, engines, workdir)
        verdict = run.execute()
    except (AssertionError, TimeoutError, RuntimeError) as exc:  # a step of the cell itself went wrong
        verdict = run.verdict if run is not None else GpuVerdict(cell)
        verdict.problems.append(f"the cell could not run: {' '.join(str(exc).split())[:300]}")
    RESULTS.append(verdict)
    kept = "" if verdict.green else f"; logs kept in {keep_logs(SimpleNamespace(id=cell), workdir)}"  # type: ignore[arg-type]
    assert verdict.green, f"{cell}: {verdict.row()}{kept}"
