"""A/B, not shipped: a sidecar process with a shorter GIL switch interval.

``bench/vllm_pd.py`` puts this directory first on the PYTHONPATH of the ``kvsidecar-*-switch``
configurations' sidecars. Why: in a sidecar, a thread that wakes and needs the GIL (the NIXL owner
thread handed a post, gRPC's threads with a message) waits until the thread holding it blocks or
for Python's switch interval (5 ms by default). Under vLLM the hand-off of a post to the owner
thread measured 0.85-0.95 ms (``nixl_handoff``, bench/README.md), against 0.11-0.13 ms with no
engine running. ``KVBENCH_SWITCH_INTERVAL_S`` sets it (default 0.0005 s); one
``kvbench-switch-interval:`` line in the sidecar's log says it was applied.
"""

from __future__ import annotations

import os
import sys

sys.setswitchinterval(float(os.environ.get("KVBENCH_SWITCH_INTERVAL_S", "0.0005")))
sys.stderr.write(f"kvbench-switch-interval: {sys.getswitchinterval()}\n")
