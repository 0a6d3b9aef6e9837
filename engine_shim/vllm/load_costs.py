"""Whether a multi-turn load is worth it on this engine: its measured cost against computing the
tokens it saves (pure: no I/O; vLLM's scheduler thread calls it, through ``multiturn.MultiTurn``).

P's scheduler records how long each load held a request back (from the scheduler's first ask to
the KV's arrival: the cache query and the Pull) and, for prefill legs P computed itself, the time
per prompt token (from the decision to the leg's finish). Loading ``n`` tokens pays when ``n`` times
the compute time per token exceeds the load time.
"""

from __future__ import annotations

import collections
import math
import statistics


class LoadCosts:
    """What a load costs this engine against computing, from its own recent prefill legs (pure).

    A load holds the request back from the scheduler's first ask to the KV's arrival (the query,
    the Pull); computing costs seconds per prompt token. Below ``break_even_tokens`` a load is
    slower than computing the tokens it saves (a node where both sidecars and engines share few
    cores, a small model, a short tail beyond P's prefix cache). Until both sides have
    ``MIN_SAMPLES`` the break-even is 0 (only ``kv_recompute_threshold`` applies); once loads stop
    because of it, one in ``EXPLORE_EVERY`` is let through anyway so a node that got faster is noticed."""

    SAMPLES = 16
    MIN_SAMPLES = 3
    EXPLORE_EVERY = 16

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._load_seconds: collections.deque[float] = collections.deque(maxlen=self.SAMPLES)
        self._token_seconds: collections.deque[float] = collections.deque(maxlen=self.SAMPLES)
        self._gated = 0

    def record_load(self, seconds: float) -> None:
        self._load_seconds.append(max(0.0, seconds))

    def record_compute(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._token_seconds.append(max(0.0, seconds) / tokens)

    def break_even_tokens(self) -> int:
        """Tokens a load must save to be faster than computing them (0: not known yet)."""
        if not self.enabled or min(len(self._load_seconds), len(self._token_seconds)) < self.MIN_SAMPLES:
            return 0
        per_token = statistics.median(self._token_seconds)
        if per_token <= 0:
            return 0
        return math.ceil(statistics.median(self._load_seconds) / per_token)

    def compute_seconds(self, tokens: int) -> float | None:
        """What computing ``tokens`` costs here (None: not known yet). A lookup that has held a
        request back that long can no longer pay off, whatever it finds."""
        if not self.enabled or len(self._token_seconds) < self.MIN_SAMPLES:
            return None
        return tokens * statistics.median(self._token_seconds)

    def gate(self, tokens: int) -> bool:
        """Whether a load of ``tokens`` is not worth it (counted, with the exploration)."""
        if tokens >= self.break_even_tokens():
            return False
        self._gated += 1
        return self._gated % self.EXPLORE_EVERY != 0
