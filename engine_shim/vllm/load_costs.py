"""Whether a multi-turn load is worth it on this engine: its measured cost against computing the
tokens it saves, and how long a lookup may hold a request back (pure: no I/O; vLLM's scheduler
thread calls it, through ``multiturn.MultiTurn``).

P's scheduler records how long each load held a request back (from the scheduler's first ask to
the KV's arrival: the cache query and the Pull) with the tokens it loaded, how long its cache
queries took to answer, and, for prefill legs P computed itself, the time per prompt token (from
the decision to the leg's finish). Loading ``n`` tokens pays when computing them takes longer than
the load: ``load(n) = overhead + n * per_token`` (fitted on the recent loads), ``compute(n) = n *
seconds per token``.
"""

from __future__ import annotations

import collections
import itertools
import math
import statistics


class LoadCosts:
    """What a load costs this engine against computing, from its own recent prefill legs (pure).

    A load holds the request back from the scheduler's first ask to the KV's arrival (the query,
    the Pull, the step that reports it): a fixed part and a part per token (the bytes), fitted on
    the last ``SAMPLES`` loads (Theil-Sen: the median of the pairwise slopes, robust to the odd
    slow load; with loads of one size, all of it is taken as the fixed part). Computing costs
    seconds per prompt token. Below ``break_even_tokens`` a load is slower than computing the
    tokens it saves (a node where both sidecars and engines share few cores, a small model, a
    short tail beyond P's prefix cache). Until ``MIN_SAMPLES`` loads are measured, only
    ``kv_recompute_threshold`` applies, except to a tail beyond P's own prefix cache (``prior``):
    there a load is assumed to cost ``PRIOR_ROUND_TRIPS`` cache-query answers (a load is a query,
    a Pull through the same sidecars, the READ's completion and the step that reports it), so
    that a short tail is not loaded just to find out. Once loads (or lookups) stop because of the
    break-even, one in ``EXPLORE_EVERY`` is let through anyway so a node that got faster is
    noticed."""

    SAMPLES = 16
    MIN_SAMPLES = 3
    EXPLORE_EVERY = 16
    PRIOR_ROUND_TRIPS = 4
    # Loads whose sizes differ by less than this fraction of the largest give no slope.
    SLOPE_SPREAD = 0.25

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._loads: collections.deque[tuple[int, float]] = collections.deque(maxlen=self.SAMPLES)
        self._query_seconds: collections.deque[float] = collections.deque(maxlen=self.SAMPLES)
        self._token_seconds: collections.deque[float] = collections.deque(maxlen=self.SAMPLES)
        self._gated = 0

    def record_load(self, seconds: float, tokens: int = 0) -> None:
        self._loads.append((max(0, tokens), max(0.0, seconds)))

    def record_query(self, seconds: float) -> None:
        """A cache query answered after ``seconds`` (the prior of a load's fixed cost)."""
        self._query_seconds.append(max(0.0, seconds))

    def record_compute(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._token_seconds.append(max(0.0, seconds) / tokens)

    def _fit(self, prior: bool) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of a load here (None: not known yet); ``prior``:
        before loads are measured, the fixed part from the cache queries' answers."""
        if len(self._loads) >= self.MIN_SAMPLES:
            largest = max(tokens for tokens, _ in self._loads)
            slopes = [
                (s2 - s1) / (n2 - n1)
                for (n1, s1), (n2, s2) in itertools.combinations(self._loads, 2)
                if abs(n2 - n1) > self.SLOPE_SPREAD * largest
            ]
            per_token = max(0.0, statistics.median(slopes)) if slopes else 0.0
            fixed = statistics.median(seconds - per_token * tokens for tokens, seconds in self._loads)
            return max(0.0, fixed), per_token
        if prior and self._query_seconds:
            return self.PRIOR_ROUND_TRIPS * statistics.median(self._query_seconds), 0.0
        return None

    def break_even_tokens(self, prior: bool = False) -> int:
        """Tokens a load must save to be faster than computing them (0: not known yet). ``prior``:
        use the query-based prior until loads are measured (for a tail beyond P's own prefix
        cache: computing it is the safe side; a whole history is loaded to be measured)."""
        fit = self._fit(prior) if self.enabled and self._token_seconds else None
        if fit is None:
            return 0
        fixed, per_token_load = fit
        per_token = statistics.median(self._token_seconds)
        if per_token <= 0:
            return 0
        if per_token <= per_token_load:
            return 1 << 62  # every token loads slower than it computes: no load pays
        return math.ceil(fixed / (per_token - per_token_load))

    def compute_seconds(self, tokens: int) -> float | None:
        """What computing ``tokens`` costs here (None: not known yet; one prefill leg suffices).
        A lookup that has held a request back that long can no longer pay off, whatever it finds."""
        if not self.enabled or not self._token_seconds:
            return None
        return tokens * statistics.median(self._token_seconds)

    def gate(self, tokens: int, prior: bool = False) -> bool:
        """Whether a load (or a lookup) of at most ``tokens`` is not worth it (counted, with the
        exploration)."""
        if tokens >= self.break_even_tokens(prior):
            return False
        self._gated += 1
        return self._gated % self.EXPLORE_EVERY != 0
