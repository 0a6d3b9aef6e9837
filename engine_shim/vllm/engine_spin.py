"""How long this engine process's shared-memory queue readers busy-loop before they sleep.

vLLM's multiprocess executor passes every step between the EngineCore and its workers through
shared-memory ring buffers (``vllm.distributed.device_communicators.shm_broadcast``). A reader with
nothing to read spins on ``sched_yield`` for ``SpinCondition.busy_loop_s`` (1 s, not configurable)
after its last read, and only then sleeps on the writer's zmq notification. While D waits for KV its
engine steps every few milliseconds, so both the EngineCore (waiting for the worker's output) and
the worker (waiting for the next step) stay in that spin for as long as the wait lasts, and P's
worker spins for a second after the prefill that produced the KV. On a node without spare cores
those spinners take the cores that the node's sidecar needs to move the KV: the sidecar's NIXL
thread was measured waiting 78-240 ms on the run queue per transfer at 8k tokens (docs/bench-history.md).
vLLM's in-process NIXL does not pay this, because its copy runs inside the worker that would spin.

``cap_busy_loop(limit)`` wraps ``SpinCondition.wait`` once per process so every reader of the
process, those built before and after, spins at most ``limit`` seconds past its last read and then
sleeps until the writer's notification (about 0.1 ms to wake). The connector calls it from its
constructor (both roles: the scheduler role runs in the EngineCore, the worker role in each worker)
with ``kv_connector_extra_config["engine_busy_loop"]``.

A sleeping reader also rechecks the ring buffer every ``IDLE_RECHECK_S`` on its own. The
writer's notification can be lost (its zmq PUB socket drops above one undelivered message,
``SNDHWM=1``, and the reader's SUB socket conflates; which race loses it was not pinned down),
and vLLM rechecks only every 5 s (``SHM_READER_RECHECK_INTERVAL_MS``): with a 0.2 ms cap, 6 of 28
requests of ``bench/vllm_pd.py`` stalled for 5.05-5.09 s with the data already in the buffer.
vLLM's 1 s spin hides this by rarely sleeping at all; a reader that sleeps after a millisecond
must not depend on the notification alone.
An idle reader wakes 20 times a second for it (microseconds each).

Threads: called from whichever thread vLLM builds the connector on; the wrapper runs on the
readers' threads and only compares and lowers one float attribute of the reader.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.logger import init_logger

logger = init_logger("vllm.kvsidecar.engine_spin")

_PATCHED_ATTRIBUTE = "_kvsidecar_busy_loop_cap"
# How long a sleeping reader trusts the writer's notification before it looks for itself: the
# bound on a stall from a lost notification (vLLM's own: 5 s).
IDLE_RECHECK_S = 0.05
_IDLE_RECHECK_MS = int(IDLE_RECHECK_S * 1000)  # zmq's poll takes milliseconds


def cap_busy_loop(limit: float) -> bool:
    """Caps the busy loop of every shm queue reader in this process at ``limit`` seconds (a negative
    ``limit`` leaves vLLM's). Returns whether a cap is in force; a vLLM without the hook logs why."""
    if limit < 0:
        return False
    try:
        from vllm.distributed.device_communicators import shm_broadcast
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError as error:
        logger.warning("SidecarConnector: engine_busy_loop not applied: %s", error)
        return False
    if getattr(shm_broadcast, "SPINLOOP_EXT_ENABLED", False):
        # Its compiled loop spins (up to 0.1 s per wait) before SpinCondition.wait is reached.
        logger.warning("SidecarConnector: VLLM_USE_SPINLOOP_EXT=1 spins before engine_busy_loop applies; unset it")
    if not callable(getattr(SpinCondition, "wait", None)):
        logger.warning("SidecarConnector: engine_busy_loop not applied: SpinCondition has no wait()")
        return False
    current = getattr(SpinCondition, _PATCHED_ATTRIBUTE, None)
    if current is not None:
        # Two connectors in one process (rare: a test's in-process engine): the lower cap wins.
        setattr(SpinCondition, _PATCHED_ATTRIBUTE, min(current, limit))
        return True
    setattr(SpinCondition, _PATCHED_ATTRIBUTE, limit)
    original = SpinCondition.wait

    @functools.wraps(original)
    def wait(self: Any, timeout_ms: int | None = None) -> None:
        cap = getattr(SpinCondition, _PATCHED_ATTRIBUTE)
        if getattr(self, "busy_loop_s", 0) > cap:
            self.busy_loop_s = cap
        if timeout_ms is None or timeout_ms > _IDLE_RECHECK_MS:
            timeout_ms = _IDLE_RECHECK_MS  # vLLM's read loop checks the buffer and waits again
        original(self, timeout_ms)

    SpinCondition.wait = wait  # type: ignore[method-assign]
    logger.info("SidecarConnector: engine shm queue readers busy-loop at most %.4f s (vLLM: 1 s)", limit)
    return True
