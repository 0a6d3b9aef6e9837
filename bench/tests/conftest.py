"""The benchmarks' own tests (their parsing and dry runs) live beside them, so that `tests/` never
imports `bench` (an import contract); they share the suite's shared-memory leak check."""

from tests.conftest import no_leaked_shm  # noqa: F401  (an autouse fixture, re-registered here)
