"""The NIXL owner thread's OS-level identity and scheduling: its thread name, and a real-time
priority for the duration of each post.

Between two processes on one host UCX copies by CMA (``process_vm_readv``/``writev``) inside NIXL's
post, on the owner thread. Next to vLLM on a small box every core runs vLLM's busy loops (the
workers' shared-memory queue spins with ``sched_yield``, the EngineCores spin on their workers'
answers), and the owner thread then spends most of a large post runnable but waiting for a CPU:
measured, 80-90 % of a 128 MiB post in the run queue (``/proc/TID/schedstat``; docs/bench-history.md,
"The copy waits for a CPU"). Fair-share scheduling does not give it the CPU back: with autogroups
(every session its own group, the default on many kernels) a thread's nice value counts only
against threads of its own session. A ``SCHED_FIFO`` thread runs before every normal thread, so the
copy gets its CPU time in one go. The thread is raised from a post until it next sleeps (the post
copies and never waits for another process); it sleeps, and wakes for commands and polls, as a
normal thread.

Off by default (``nixl.post_priority=0``): with it on, end-to-end runs next to vLLM cut the copy
8-10x but also showed rare multi-second outliers not yet explained (docs/bench-history.md).

It needs ``CAP_SYS_NICE`` or an ``RLIMIT_RTPRIO`` of at least the priority (systemd:
``LimitRTPRIO=``, and no ``RestrictRealtime=yes``). Without it the first post logs
``nixl_post_priority_not_permitted`` once and every post runs as before.

Every call affects the calling thread only: the owner thread calls ``name_thread`` once,
``PostPriority.raise_`` before each post and ``PostPriority.lower`` before each sleep.
"""

from __future__ import annotations

import ctypes
import os

from sidecar.logs import get_logger

log = get_logger("kvsidecar.transport")

_PR_SET_NAME = 15
_REALTIME = (getattr(os, "SCHED_FIFO", -1), getattr(os, "SCHED_RR", -1))


def name_thread(name: str) -> None:
    """Give the calling thread a kernel-visible name (``/proc/PID/task/TID/comm``, ``top -H``,
    ``perf``), truncated to 15 bytes. Python does not set it from ``threading.Thread(name=...)``."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


class PostPriority:
    """``SCHED_FIFO`` at ``priority`` (1-99) for the calling thread from ``raise_()`` until
    ``lower()``; 0 = off. Both are idempotent, so the owner thread raises itself before each post
    and lowers itself only before it sleeps: back-to-back posts (a split transfer's chunks) and the
    polls between them stay raised, and a lowered thread does not queue for a CPU again between
    two chunks of one copy."""

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self._enabled = priority > 0 and hasattr(os, "sched_setscheduler")
        self._normal: tuple[int, os.sched_param] | None = None
        self._raised = False

    @property
    def enabled(self) -> bool:
        """Whether posts are raised (false when off, not permitted, or the thread is already real-time)."""
        return self._enabled

    def raise_(self) -> None:
        if self._raised or not self._enabled:
            return
        if self._normal is None:
            policy = os.sched_getscheduler(0)
            # The operator made the thread real-time already: leave it so.
            if policy & ~getattr(os, "SCHED_RESET_ON_FORK", 0) in _REALTIME:
                self._enabled = False
                log.info("nixl_post_priority_skipped", reason="the owner thread is already real-time")
                return
            self._normal = (policy, os.sched_getparam(0))
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(self.priority))
        except OSError as exc:
            self._enabled = False
            log.warning(
                "nixl_post_priority_not_permitted",
                priority=self.priority,
                error=exc.strerror or str(exc),
                hint="posts (the copy between processes on one host) run at normal priority; grant "
                "CAP_SYS_NICE or an RLIMIT_RTPRIO >= nixl.post_priority (systemd: LimitRTPRIO=), "
                "or set nixl.post_priority=0 to silence this",
            )
            return
        self._raised = True

    def lower(self) -> None:
        if not self._raised:
            return
        assert self._normal is not None
        policy, param = self._normal
        os.sched_setscheduler(0, policy, param)  # lowering is always permitted
        self._raised = False
