"""Multi-turn KV reuse, the scheduler side of the SidecarConnector (vLLM's "bidirectional" flow).

In a chat, turn N's KV (system prompt, history, and the answer D generated) lives only on the
decode engine D. With ``"multi_turn": true`` in ``kv_connector_extra_config``:

- **D** keeps a finished request's blocks on its sidecar (``HoldBlocks``, with the content hashes
  of the full blocks) and returns vLLM's keys for the next turn (``do_remote_decode: true``,
  ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``/``remote_port``
  = D's sidecar, ``remote_num_tokens``, ``tp_size``, ``remote_blocks_expiry_time`` when the TTL is
  configured here). The sidecar ends the hold when a peer has read it, at its TTL, or when D's
  holds pass their share of D's blocks (oldest first); D's workers then see FINISHED_SENDING /
  LEASE_EXPIRED and vLLM frees the blocks.
- **P** (``kv_role: kv_both``: it produces for D and reads from D), for a prefill leg
  (``do_remote_decode``), asks its sidecar which held prefix matches its prompt: by the router's
  ``remote_request_id`` at ``remote_host:remote_port`` when the router passed D's keys, else by
  ``conversation_id`` on every peer sidecar P's sidecar knows, else by the prompt's block hashes
  alone on every known peer. ``get_num_new_matched_tokens`` returns ``None`` ("ask again")
  while the answer is in flight, so ``schedule()`` never waits; P computes once the wait is
  longer than computing what a hold could give takes here (``multi_turn_query_timeout`` until
  that is measured; the sidecar's fan-out gets the same bound). Only the leading blocks whose
  hashes equal P's own prompt's are used (an edited history reuses the common prefix only),
  beyond what P's prefix cache already has, and only if that is at least
  ``kv_recompute_threshold`` tokens and this engine's measured break-even (``LoadCosts``: a
  load's time against computing the tokens it saves), and the hold does not expire within
  ``multi_turn_expiry_margin`` seconds. When P's own prefix cache leaves less than that for any
  hold to give, P decides without a query (``skip_lookup``); with vLLM's prefix caching on the
  query starts only when the scheduler first asks (its ``num_computed_tokens`` says what that
  cache holds), otherwise on the request's arrival. A started lookup is one call. The load is a
  ``Pull`` from D's sidecar into P's new blocks; a hold released meanwhile fails it explicitly
  and vLLM recomputes. A router opts one request out with ``"multi_turn": false`` in its
  ``kv_transfer_params``.

Block hashes are vLLM's own prefix-cache hashes (``request.block_hashes``). With the default
``prefix_caching_hash_algo`` (sha256) they are seeded identically in every process; with a
non-cryptographic one, set the same ``PYTHONHASHSEED`` on P and D or nothing will match (never
wrong KV, only no reuse).

Pure policy (``skip_lookup``, ``plan_load``, ``LoadCosts``, ``MultiTurnConfig``, ``hold_params``) does no I/O.
``MultiTurn`` holds the per-request lookup state; vLLM's scheduler thread calls all of it; gRPC futures complete on
the client's RPC threads and are only read here (``done()``/``result()``).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine_shim.client import Future, SidecarClient, remote
from engine_shim.messages import block_ids_of
from engine_shim.vllm.load_costs import LoadCosts
from kvsidecar.v1 import engine_pb2

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvsidecar.multiturn")

BlockIds = tuple[list[int], ...]

# kv_connector_extra_config keys this module reads.
CONFIG_KEYS = frozenset(
    {
        "multi_turn",
        "kv_recompute_threshold",
        "multi_turn_expiry_margin",
        "multi_turn_query_timeout",
        "multi_turn_measure_costs",
        "hold_ttl",
    }
)
# Lookup outcomes (a hit, or why P computes the prompt itself).
HIT = "hit"
MISS_REASONS = (
    "disabled",  # the router opted the request out ("multi_turn": false)
    "no_hold",  # nothing held for this conversation / prefix
    "prefix_mismatch",  # held, but its first block differs from the prompt's
    "expiring",  # would expire within the safety margin
    "below_threshold",  # fewer new tokens than kv_recompute_threshold
    "slower_than_compute",  # fewer than this engine's measured break-even (LoadCosts)
    "local_cache",  # P's own prefix cache already has at least as much
    "timeout",  # no answer within multi_turn_query_timeout
    "query_failed",  # the sidecar refused or failed the query
)


@dataclass(frozen=True)
class MultiTurnConfig:
    enabled: bool = False
    recompute_threshold: int = 64  # kv_recompute_threshold: fewer new tokens are recomputed
    expiry_margin: float = 5.0  # a hold expiring sooner than this is not read
    query_timeout: float = 0.010  # bound on the cache query (the sidecar's fan-out to its peers)
    hold_ttl: float = 0.0  # D's hold time; 0 = the sidecar's hold_ttl_seconds
    # Load only what saves more than a load costs on this engine (LoadCosts); False: the
    # threshold alone decides (tests that must exercise the load path with a tiny, fast model).
    measure_costs: bool = True

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> MultiTurnConfig:
        config = cls(
            enabled=bool(extra.get("multi_turn", False)),
            recompute_threshold=int(extra.get("kv_recompute_threshold", 64)),
            expiry_margin=float(extra.get("multi_turn_expiry_margin", 5.0)),
            query_timeout=float(extra.get("multi_turn_query_timeout", 0.010)),
            hold_ttl=float(extra.get("hold_ttl", 0.0)),
            measure_costs=bool(extra.get("multi_turn_measure_costs", True)),
        )
        if config.recompute_threshold < 0:
            raise ValueError("kv_connector_extra_config.kv_recompute_threshold must be >= 0")
        if config.expiry_margin < 0 or config.hold_ttl < 0:
            raise ValueError("kv_connector_extra_config: multi_turn_expiry_margin and hold_ttl must be >= 0")
        if not 0 < config.query_timeout <= 60:
            raise ValueError("kv_connector_extra_config.multi_turn_query_timeout must be in (0, 60] seconds")
        return config


@dataclass(frozen=True)
class HeldPrefix:
    """One hold of a remote engine, as a cache query reported it."""

    address: str
    engine_id: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    tp_size: int
    block_hashes: tuple[bytes, ...]
    expires_in: float  # seconds, when the answer was given

    @classmethod
    def from_entry(cls, entry: engine_pb2.CacheEntry) -> HeldPrefix:
        return cls(
            address=entry.address,
            engine_id=entry.engine_id,
            request_id=entry.request_id,
            block_ids=block_ids_of(entry.block_ids),
            num_tokens=entry.num_tokens,
            tp_size=entry.tp_size,
            block_hashes=tuple(entry.block_hashes),
            expires_in=entry.expires_in_seconds,
        )


@dataclass(frozen=True)
class LoadPlan:
    """What P loads from a hold: ``tokens`` new tokens (0: compute the prompt), which are the
    remote blocks ``[local blocks, blocks)`` of ``hold``."""

    tokens: int
    reason: str
    hold: HeldPrefix | None = None
    blocks: int = 0

    def remote_block_ids(self) -> BlockIds:
        """The hold's first ``blocks`` blocks per group: the sidecar reads their tail into P's new
        blocks (as many as P allocated for the loaded tokens)."""
        assert self.hold is not None
        return tuple(list(group[: self.blocks]) for group in self.hold.block_ids)


def common_prefix(held: Sequence[bytes], prompt: Sequence[bytes]) -> int:
    count = 0
    for mine, theirs in zip(held, prompt, strict=False):
        if mine != theirs:
            break
        count += 1
    return count


def plan_load(
    holds: Sequence[HeldPrefix],
    prompt_hashes: Sequence[bytes],
    num_prompt_tokens: int,
    num_computed_tokens: int,
    block_size: int,
    config: MultiTurnConfig,
    elapsed: float = 0.0,
) -> LoadPlan:
    """The best load for a prompt from the holds a query found (pure).

    Only whole blocks whose hashes equal the prompt's are used, and never the prompt's last token
    (P computes at least one token, to sample). ``elapsed``: seconds since the query answered
    (the holds' ``expires_in`` was measured then)."""
    if not holds:
        return LoadPlan(0, "no_hold")
    limit = max(0, (num_prompt_tokens - 1) // block_size)
    reason = "prefix_mismatch"
    best: LoadPlan | None = None
    for hold in holds:
        matched = min(common_prefix(hold.block_hashes, prompt_hashes), limit, *(len(g) for g in hold.block_ids))
        if matched == 0:
            continue
        if hold.expires_in - elapsed < config.expiry_margin:
            reason = "expiring"
            continue
        tokens = matched * block_size - num_computed_tokens
        if best is None or tokens > best.tokens:
            best = LoadPlan(tokens, HIT, hold, matched)
    if best is None:
        return LoadPlan(0, reason)
    if best.tokens <= 0:
        return LoadPlan(0, "local_cache")
    if best.tokens < config.recompute_threshold:
        return LoadPlan(0, "below_threshold")
    return best


def skip_lookup(reachable: int, cached: int, threshold: int, costs: LoadCosts, decide: bool = True) -> tuple[str, bool]:
    """Whether P looks for a hold at all, decided before any query (no RPC): why not ("" if it
    does), and whether a lookup below the break-even is let through only to explore (LoadCosts).

    ``reachable``: the most any hold could give (the prompt's full blocks, never its last token);
    ``cached``: what P's own prefix cache already has of it (vLLM's ``num_computed_tokens``). A
    hold can add at most the difference; below ``kv_recompute_threshold``, or below what a load
    costs here against computing it (``LoadCosts``; a tail beyond P's cache is judged by the
    query-based prior until loads are measured), it is computed. ``decide``: the decision, which
    LoadCosts' exploration counts; else a check (no count, no exploration)."""
    floor = max(1, threshold)
    gives = reachable - cached
    if gives < floor:
        return ("local_cache" if cached and reachable >= floor else "below_threshold"), False
    tail = cached > 0
    if gives >= costs.break_even_tokens(prior=tail):
        return "", False
    if decide and not costs.gate(gives, prior=tail):
        return "", True
    return "slower_than_compute", False


def hold_params(
    engine_id: str,
    request_id: str,
    block_ids: BlockIds,
    num_tokens: int,
    host: str,
    port: int,
    tp_size: int,
    pp_size: int,
    hold_ttl: float,
    conversation_id: str = "",
) -> dict[str, Any]:
    """D's kv_transfer_params for the next turn (vLLM's bidirectional keys; remote_host/port name
    D's sidecar). ``remote_blocks_expiry_time`` is a Unix time, given only when this engine sets
    the TTL (otherwise the sidecar's default applies, which P learns from its cache query)."""
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_block_ids": [list(group) for group in block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": num_tokens,
        "tp_size": tp_size,
        "pp_size": pp_size,
        "dcp_size": 1,
        "transfer_mode": "pull",
    }
    if hold_ttl > 0:
        params["remote_blocks_expiry_time"] = time.time() + hold_ttl
    if conversation_id:
        params["conversation_id"] = conversation_id
    return params


def prompt_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """vLLM's hashes of the prompt's full blocks."""
    return list(request.block_hashes[: request.num_prompt_tokens // block_size])


@dataclass
class _Lookup:
    future: Future[engine_pb2.QueryCacheResponse]
    deadline: float
    sent: float = 0.0  # when the query went out
    done_at: float = 0.0  # when its answer came (set by the RPC thread's done-callback)
    answered: float = 0.0
    holds: list[HeldPrefix] = field(default_factory=list)
    reason: str = ""  # a miss decided before any plan (timeout, query_failed)
    plan: LoadPlan | None = None
    asked: float = 0.0  # when the scheduler first asked (what it waited for the decision runs from)
    checked: bool = False  # decided on what P's own prefix cache holds (not only prefetched)
    exploring: bool = False  # started below the break-even (LoadCosts' exploration): not gated again


class MultiTurn:
    """The scheduler side's multi-turn state (vLLM's scheduler thread only)."""

    # Requests whose lookup outcome is kept (bounded): a request asked again after a decision.
    MAX_LOOKUPS = 4096

    def __init__(
        self,
        config: MultiTurnConfig,
        client: SidecarClient,
        engine_id: str,
        block_size: int,
        clock: Callable[[], float] = time.monotonic,
        prefix_caching: bool = False,
    ) -> None:
        self.config = config
        # vLLM's prefix caching is on here: what P's own cache holds is known only when the
        # scheduler first asks (get_num_new_matched_tokens), so lookups are not started earlier.
        self.prefix_caching = prefix_caching
        self.client = client
        self.engine_id = engine_id
        self.block_size = block_size
        self._clock = clock
        self._lookups: collections.OrderedDict[str, _Lookup] = collections.OrderedDict()
        # Outcome counts and tokens loaded since start (tests, benchmarks), and since the last
        # ``take_stats`` (vLLM's stat loggers: engine_shim.vllm.stats).
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.tokens_loaded = 0
        self._new_outcomes: collections.Counter[str] = collections.Counter()
        self._new_tokens_loaded = 0
        # Seconds the scheduler held each decided request back for its lookup (0: decided at once).
        self._new_waits: list[float] = []
        # Measured load vs compute cost, and the prefill legs being measured: loads (request id ->
        # when the scheduler first asked, tokens loaded) and legs P computes (-> when decided,
        # tokens computed).
        self.costs = LoadCosts(config.measure_costs)
        self._loading: dict[str, tuple[float, int]] = {}
        self._computing: dict[str, tuple[float, int]] = {}

    # P: prefill legs ------------------------------------------------------------------------------

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens`` of a prefill leg: tokens to load from a remote hold,
        ``None`` while the query is in flight."""
        params = request.kv_transfer_params or {}
        if params.get("_multiturn_loaded"):
            return 0, False  # rescheduled (preempted) after its load: vLLM's re-entry guard
        if params.get("multi_turn") is False:
            self._count("disabled")  # the router opted this request out
            self._new_waits.append(0.0)
            self._measure_compute(request, num_computed_tokens, self._clock())
            return 0, False
        request_id = request.request_id
        lookup = self._lookups.get(request_id)
        if lookup is None:
            lookup = self._ask(request, params, num_computed_tokens)
            if lookup is None:
                self._measure_compute(request, num_computed_tokens, self._clock())
                return 0, False
        now = self._clock()
        lookup.asked = lookup.asked or now
        if not lookup.checked:
            # The query started (``prefetch``) before vLLM looked in P's own prefix cache: if what
            # that cache lacks cannot pay for a load, no answer can change the decision, so P
            # computes now instead of waiting for it.
            lookup.checked = True
            lookup.reason, lookup.exploring = self._not_worth_asking(request, num_computed_tokens)
        if lookup.plan is None and not lookup.reason:
            if not lookup.future.done():
                # Waiting longer than computing the most a hold could give would take cannot pay.
                pays_for = self.costs.compute_seconds(self._reachable(request) - num_computed_tokens)
                if pays_for is not None and now - lookup.asked >= pays_for:
                    lookup.reason = "slower_than_compute"
                elif now < lookup.deadline:
                    return None, False
                else:
                    lookup.reason = "timeout"
            else:
                exc = lookup.future.exception()
                if exc is not None:
                    lookup.reason = "query_failed"
                    logger.info("SidecarConnector: cache query for %s failed: %s", request_id, exc)
                else:
                    lookup.answered = now
                    self.costs.record_query((lookup.done_at or now) - lookup.sent)
                    lookup.holds = [HeldPrefix.from_entry(entry) for entry in lookup.future.result().entries]
        if lookup.reason:
            self._decide(request_id, lookup, LoadPlan(0, lookup.reason), now)
            self._measure_compute(request, num_computed_tokens, now)
            return 0, False
        plan = plan_load(
            lookup.holds,
            prompt_block_hashes(request, self.block_size),
            request.num_prompt_tokens,
            num_computed_tokens,
            self.block_size,
            self.config,
            now - lookup.answered,
        )
        # The measured break-even, decided once per request (asked again, the answer stands).
        gated = lookup.plan is not None and lookup.plan.reason == "slower_than_compute"
        # Before loads are measured, a tail beyond P's own prefix cache is judged by the prior.
        tail = num_computed_tokens > 0
        gate = lookup.plan is None and not lookup.exploring and self.costs.gate(plan.tokens, prior=tail)
        if plan.tokens > 0 and (gated or gate):
            plan = LoadPlan(0, "slower_than_compute")
        self._decide(request_id, lookup, plan, now)
        if plan.tokens > 0:
            return plan.tokens, True
        self._measure_compute(request, num_computed_tokens, now)
        return 0, False

    def prefetch(self, request: Request) -> None:
        """``on_new_request`` of a prefill leg: start the lookup now, so its answer is usually in by
        the time the scheduler first asks (no ``None`` round). Not with P's prefix cache on: only
        the scheduler's ask says what that cache holds, and a lookup for a tail that cannot pay
        for itself is not started at all."""
        params = request.kv_transfer_params or {}
        if self.prefix_caching:
            return
        fresh = request.request_id not in self._lookups and not params.get("_multiturn_loaded")
        if fresh and params.get("multi_turn") is not False:
            self._ask(request, params, 0, counted=False)

    def _reachable(self, request: Request) -> int:
        """The most any hold could give: the prompt's full blocks, never its last token."""
        full = len(prompt_block_hashes(request, self.block_size))
        return min(full, (request.num_prompt_tokens - 1) // self.block_size) * self.block_size

    def _not_worth_asking(self, request: Request, num_computed_tokens: int, decide: bool = True) -> tuple[str, bool]:
        """``skip_lookup`` for this prompt and what P's prefix cache holds of it."""
        threshold = self.config.recompute_threshold
        return skip_lookup(self._reachable(request), num_computed_tokens, threshold, self.costs, decide)

    def _ask(
        self, request: Request, params: Mapping[str, Any], num_computed_tokens: int, counted: bool = True
    ) -> _Lookup | None:
        skip, exploring = self._not_worth_asking(request, num_computed_tokens, decide=counted)
        if skip:
            if counted:
                self._count(skip)  # not worth a query: nothing worth loading could be found
                self._new_waits.append(0.0)
            return None
        hashes = prompt_block_hashes(request, self.block_size)[: self._reachable(request) // self.block_size]
        address, remote_request = "", ""
        host, port = params.get("remote_host"), params.get("remote_port")
        if params.get("remote_request_id") and params.get("remote_engine_id") and host and port:
            # The router passed D's keys (vLLM's multi-turn proxy): ask that sidecar for that hold.
            host = f"[{host}]" if ":" in str(host) and not str(host).startswith("[") else host  # bare IPv6
            address, remote_request = f"{host}:{int(port)}", str(params["remote_request_id"])
        conversation = "" if remote_request else str(params.get("conversation_id") or "")
        timeout = self.query_bound(self._reachable(request) - num_computed_tokens)
        sent = self._clock()
        future = self.client.query_cache_async(
            self.engine_id,
            address,
            conversation,
            remote_request,
            hashes,
            known_peers=not address,
            timeout_seconds=timeout,
        )
        # The sidecar bounds its fan-out by `timeout`; the local round trip gets query_timeout more.
        lookup = _Lookup(future, sent + timeout + self.config.query_timeout, sent, checked=counted, exploring=exploring)

        def answered(done: Future[Any]) -> None:
            lookup.done_at = self._clock()
            done.exception()  # retrieved: an answer may come too late to be read

        future.add_done_callback(answered)
        self._lookups[request.request_id] = lookup
        while len(self._lookups) > self.MAX_LOOKUPS:
            self._lookups.popitem(last=False)
        return lookup

    def query_bound(self, tokens: int) -> float:
        """How long a lookup that can give at most ``tokens`` may take: as long as computing them
        takes here (a later answer cannot pay off, whatever it finds), never less than
        ``multi_turn_query_timeout``, which alone applies until a prefill leg has been measured.
        The sidecar's fan-out to its peers gets this bound: a fixed short one made the loads that
        pay time out on a busy node (answers there take 10-300 ms, a 1k-token prefill 150-550)."""
        pays_for = self.costs.compute_seconds(tokens) or 0.0
        return min(60.0, max(self.config.query_timeout, pays_for))

    def _decide(self, request_id: str, lookup: _Lookup, plan: LoadPlan, now: float) -> None:
        first = lookup.plan is None
        lookup.plan = plan
        if first:
            self._count(plan.reason)
            waited = max(0.0, now - lookup.asked)
            self._new_waits.append(waited)
            logger.debug(
                "SidecarConnector: lookup of %s: %s, %d tokens, scheduler waited %.1f ms",
                request_id, plan.reason, plan.tokens, waited * 1000.0,
            )  # fmt: skip

    def take_load(self, request: Request, num_external_tokens: int) -> engine_pb2.RemoteBlocks | None:
        """``update_state_after_alloc``: the hold to pull the request's loaded tokens from, once
        (None if vLLM allocated nothing external, or there is no plan)."""
        lookup = self._lookups.pop(request.request_id, None)
        plan = lookup.plan if lookup is not None else None
        if plan is None or plan.hold is None or num_external_tokens <= 0:
            return None
        if request.kv_transfer_params is not None:
            request.kv_transfer_params["_multiturn_loaded"] = True
        self.tokens_loaded += num_external_tokens
        self._new_tokens_loaded += num_external_tokens
        asked = lookup.asked if lookup is not None and lookup.asked else self._clock()
        self._loading[request.request_id] = (asked, num_external_tokens)
        hold = plan.hold
        return remote(
            hold.address,
            hold.engine_id,
            hold.request_id,
            plan.remote_block_ids(),
            hold.tp_size,
            hold.num_tokens,
        )

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self._new_outcomes[outcome] += 1

    def take_stats(self) -> tuple[dict[str, int], int, list[float]]:
        """Lookup outcomes, tokens loaded, and the scheduler's wait per decided lookup since the
        last call (for vLLM's stat loggers)."""
        taken = dict(self._new_outcomes), self._new_tokens_loaded, self._new_waits
        self._new_outcomes.clear()
        self._new_tokens_loaded = 0
        self._new_waits = []
        return taken

    def _measure_compute(self, request: Request, num_computed_tokens: int, now: float) -> None:
        """A prefill leg P computes itself: timed from now to its finish (``finished``)."""
        tokens = request.num_prompt_tokens - num_computed_tokens
        if tokens >= self.block_size and request.request_id not in self._computing:
            self._computing[request.request_id] = (now, tokens)
            while len(self._computing) > self.MAX_LOOKUPS:
                self._computing.pop(next(iter(self._computing)))

    def loaded(self, request_id: str) -> None:
        """``update_connector_output``: a request's KV arrived (or failed: it is recomputed)."""
        loading = self._loading.pop(request_id, None)
        if loading is not None:
            asked, tokens = loading
            self.costs.record_load(self._clock() - asked, tokens)

    def forget(self, request_id: str) -> None:
        """The request finished (or was aborted): a lookup not taken is dropped, and a prefill
        leg P computed itself gives its compute time."""
        self._lookups.pop(request_id, None)
        self._loading.pop(request_id, None)
        computing = self._computing.pop(request_id, None)
        if computing is not None:
            started, tokens = computing
            self.costs.record_compute(tokens, self._clock() - started)

    # D: holding a finished turn ---------------------------------------------------------------

    def hold(
        self, request: Request, block_ids: BlockIds, host: str, port: int, tp_size: int, pp_size: int
    ) -> tuple[Future[engine_pb2.HoldBlocksResponse], dict[str, Any]]:
        """Keep a finished request's blocks on the sidecar for the next turn; returns the call
        and the kv_transfer_params that describe the hold."""
        params = request.kv_transfer_params or {}
        conversation = str(params.get("conversation_id") or "")
        num_tokens = request.num_computed_tokens
        full = min(num_tokens // self.block_size, len(block_ids[0]) if block_ids else 0)
        future = self.client.hold_blocks_async(
            self.engine_id,
            request.request_id,
            block_ids,
            conversation_id=conversation,
            num_tokens=num_tokens,
            ttl_seconds=self.config.hold_ttl,
            block_hashes=list(request.block_hashes[:full]),
        )
        result = hold_params(
            self.engine_id,
            request.request_id,
            block_ids,
            num_tokens,
            host,
            port,
            tp_size,
            pp_size,
            self.config.hold_ttl,
            conversation,
        )
        return future, result
