"""The line budget: no Python source file over ``BUDGET`` lines without a reason on record.

    python .ci/line_budget.py [--root DIR]      (run by ``make lint``)

Counts the lines of every ``*.py`` file under the source roots (generated protobuf code,
``kvsidecar/v1/*_pb2*.py``, aside) and fails, naming each file and what to do, when:
- a file is over the budget and not in the allow-list;
- an allow-list entry gives no reason;
- an allow-list entry names a file that is gone or back within the budget (so the list only ever
  holds the files that are over it today: delete the line).

The allow-list (``.ci/line_budget_allow.txt``) has one file per line: its path, whitespace, a
one-line reason. ``#`` starts a comment. Why a budget: a file past ~600 lines usually does more
than one job (issue 34); the reason says which cut is planned or why there is none.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

BUDGET = 600
ROOTS = ("sidecar", "engine_shim", "kvsidecar", "tests", "bench", "examples", ".ci")
GENERATED = ("kvsidecar/v1/*_pb2*.py",)
ALLOW_LIST = Path(".ci/line_budget_allow.txt")


@dataclass(frozen=True)
class Entry:
    path: str
    reason: str
    line: int


def parse_allow_list(text: str) -> tuple[dict[str, Entry], list[str]]:
    """The entries by path, and the problems of the file itself (a path without a reason, twice)."""
    entries: dict[str, Entry] = {}
    problems: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        path, _, reason = line.partition(" ")
        reason = reason.strip()
        if not reason:
            problems.append(f"{ALLOW_LIST}:{number}: {path} has no reason: add one line saying why it is over")
        elif path in entries:
            problems.append(f"{ALLOW_LIST}:{number}: {path} is listed twice")
        else:
            entries[path] = Entry(path, reason, number)
    return entries, problems


def source_files(root: Path) -> Iterable[Path]:
    for top in ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if "__pycache__" in path.parts or any(fnmatch.fnmatch(relative, g) for g in GENERATED):
                continue
            yield path


def count_lines(path: Path) -> int:
    with path.open("rb") as handle:
        return sum(1 for _ in handle)


def check(root: Path, allow_text: str, budget: int = BUDGET) -> list[str]:
    """Every problem found, as a message naming the file; empty when the tree keeps the budget."""
    entries, problems = parse_allow_list(allow_text)
    seen: set[str] = set()
    for path in source_files(root):
        relative = path.relative_to(root).as_posix()
        lines = count_lines(path)
        if lines <= budget:
            continue
        seen.add(relative)
        if relative not in entries:
            problems.append(
                f"{relative}: {lines} lines, over the budget of {budget}: split it, or add it to "
                f"{ALLOW_LIST} with a one-line reason"
            )
    for listed, entry in entries.items():
        if listed in seen:
            continue
        where = f"{ALLOW_LIST}:{entry.line}: {listed}"
        if not (root / listed).is_file():
            problems.append(f"{where} does not exist: delete its line")
        else:
            problems.append(f"{where} is within the budget now ({count_lines(root / listed)} lines): delete its line")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The line budget of every Python source file.")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    allow = args.root / ALLOW_LIST
    problems = check(args.root, allow.read_text() if allow.is_file() else "")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
