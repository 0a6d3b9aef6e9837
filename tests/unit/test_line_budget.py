"""The line budget that ``make lint`` checks (``.ci/line_budget.py``): a source file over the
budget fails the check unless the allow-list gives a reason, and the allow-list cannot go stale."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / ".ci" / "line_budget.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("line_budget", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def write(root: Path, relative: str, lines: int) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x = 1\n" * lines)


def test_a_file_over_the_budget_fails_unless_the_allow_list_gives_a_reason(tmp_path: Path) -> None:
    budget = load()
    write(tmp_path, "sidecar/small.py", 600)
    write(tmp_path, "sidecar/core/big.py", 601)
    problems = budget.check(tmp_path, "")
    assert len(problems) == 1
    assert problems[0].startswith("sidecar/core/big.py: 601 lines, over the budget of 600")

    assert budget.check(tmp_path, "sidecar/core/big.py   to be split, issue 34 item 1  # a comment\n") == []
    no_reason = budget.check(tmp_path, "sidecar/core/big.py\n")
    assert any("sidecar/core/big.py has no reason" in problem for problem in no_reason)


def test_stale_allow_list_lines_fail(tmp_path: Path) -> None:
    budget = load()
    write(tmp_path, "tests/test_x.py", 10)
    problems = budget.check(tmp_path, "tests/test_x.py  was long\nbench/gone.py  was long too\n")
    assert any("tests/test_x.py is within the budget now (10 lines): delete its line" in p for p in problems)
    assert any("bench/gone.py does not exist: delete its line" in p for p in problems)


def test_generated_protobuf_code_and_other_trees_are_not_counted(tmp_path: Path) -> None:
    budget = load()
    write(tmp_path, "kvsidecar/v1/engine_pb2.py", 5000)
    write(tmp_path, "kvsidecar/v1/engine_pb2_grpc.py", 5000)
    write(tmp_path, ".venv/lib/site.py", 5000)
    write(tmp_path, "sidecar/__pycache__/x.py", 5000)
    assert budget.check(tmp_path, "") == []
    write(tmp_path, "kvsidecar/voucher.py", 700)
    assert budget.check(tmp_path, "")[0].startswith("kvsidecar/voucher.py: 700 lines")


def test_the_command_exits_non_zero_naming_the_file(tmp_path: Path) -> None:
    write(tmp_path, "examples/long.py", 900)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "examples/long.py: 900 lines" in done.stderr
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "line_budget_allow.txt").write_text("examples/long.py  a reason\n")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
