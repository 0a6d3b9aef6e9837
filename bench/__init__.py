"""The benchmarks: each module is a tool run as ``python -m bench.<name>`` from the repository root.

What each measures, its command and the latest figures: ``bench/README.md``; the dated history of
every run: ``docs/bench-history.md``. Benchmarks import the shared harness (``tests.support``) and
the daemon; tests never import ``bench`` (an import contract in ``pyproject.toml``).
"""
