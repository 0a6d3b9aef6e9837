"""Runs one measurement in several checkouts of this project, alternating, for before/after tables.

``alternate`` runs ``measure(checkout, round)`` for round 1..N and, within each round, every
checkout in turn (A, B, A, B, ...), so a slow minute of a shared machine hits every side rather
than one; ``in_checkout`` runs a command with that checkout's code (its directory as cwd and
PYTHONPATH), which is how a commit an issue measured runs against today's
(``git worktree add DIR COMMIT``). Used by ``ab_control.py`` and ``control_cpu.py``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

Result = TypeVar("Result")


def in_checkout(checkout: Path, command: list[str], timeout: float = 900.0) -> subprocess.CompletedProcess[str]:
    """Run ``command`` from ``checkout`` with its code first on the path; exits with its stderr on
    failure (a benchmark whose side failed has nothing to compare)."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return done


def alternate(checkouts: list[Path], rounds: int, measure: Callable[[Path, int], Result]) -> dict[Path, list[Result]]:
    """Each checkout's results (keyed by its resolved path), in round order (rounds count from 1)."""
    resolved = [checkout.resolve() for checkout in checkouts]
    if len(set(resolved)) != len(resolved):
        raise SystemExit(f"the same checkout twice: {checkouts}")
    found: dict[Path, list[Result]] = {checkout: [] for checkout in resolved}
    for index in range(1, rounds + 1):
        for checkout in resolved:
            found[checkout].append(measure(checkout, index))
    return found
