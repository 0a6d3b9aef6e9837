"""Which multi-turn lookups P starts and how long it waits for them (issue 36, item 5): a lookup
that cannot pay for itself is never sent (P's prefix cache on), and a load that pays is not lost
to a lookup bound shorter than a busy node's answers (P's prefix cache off). Pure decisions first,
then P's scheduler side against real sidecars (vLLM's ``Request`` and hashes, no vLLM engine)."""

from __future__ import annotations

import re
import time
import urllib.request

from engine_shim.client import SidecarClient
from engine_shim.vllm.load_costs import LoadCosts
from engine_shim.vllm.multiturn import MultiTurn, MultiTurnConfig, skip_lookup
from tests.daemon.test_multiturn_shim import BS, vllm_request
from tests.support.processes import stopped, wait_until
from tests.support.vllm_engine import free_port

PER_TOKEN = 0.00015  # 0.15 ms per prompt token: what a 1k-token prefill costs P on this node's CPU


def computed(costs: LoadCosts, legs: int = 1) -> LoadCosts:
    for _ in range(legs):
        costs.record_compute(1000, 1000 * PER_TOKEN)
    return costs


# --- pure decisions -----------------------------------------------------------------------------------


def test_a_tail_beyond_p_s_own_cache_is_not_looked_up_when_a_load_would_cost_more() -> None:
    """Before any load is measured, a load is taken to cost PRIOR_ROUND_TRIPS query answers: a
    160-token tail (24 ms to compute) is not worth 4 x 10 ms, a whole history is always asked for."""
    costs = computed(LoadCosts())
    costs.record_query(0.010)
    assert costs.break_even_tokens() == 0  # no load measured: nothing gates a whole history
    assert costs.break_even_tokens(prior=True) == 267  # 40 ms / 0.15 ms
    assert skip_lookup(reachable=1056, cached=896, threshold=64, costs=costs) == ("slower_than_compute", False)
    assert skip_lookup(reachable=1056, cached=0, threshold=64, costs=costs) == ("", False)
    assert skip_lookup(reachable=1056, cached=512, threshold=64, costs=costs) == ("", False)  # 544 tokens
    assert skip_lookup(reachable=1056, cached=1024, threshold=64, costs=costs) == ("local_cache", False)
    # A check (the prefetch) neither counts nor explores; the decision lets one in 16 through.
    fresh = computed(LoadCosts())
    fresh.record_query(0.010)
    assert skip_lookup(1056, 896, 64, fresh, decide=False) == ("slower_than_compute", False)
    decisions = [skip_lookup(1056, 896, 64, fresh) for _ in range(LoadCosts.EXPLORE_EVERY)]
    assert decisions[-1] == ("", True) and set(decisions[:-1]) == {("slower_than_compute", False)}
    # Nothing measured yet: the threshold alone.
    assert skip_lookup(1056, 896, 64, LoadCosts()) == ("", False)


def test_a_load_s_cost_grows_with_its_tokens() -> None:
    """Recent large loads must not make a smaller one look too slow: the fixed part and the part
    per token are fitted (with one median over sizes, 8k loads at 300 ms put the break-even at
    2,000 tokens and a 1.2k-token history that loads in ~50 ms was computed instead)."""
    costs = computed(LoadCosts(), legs=3)
    costs.record_load(0.300, 8192)
    costs.record_load(0.290, 8192)
    costs.record_load(0.130, 4096)
    costs.record_load(0.050, 1024)
    assert costs.break_even_tokens() < 300
    assert not costs.gate(1200)
    # Loads of one size give no slope: all of the load counts as its fixed part.
    same = computed(LoadCosts(), legs=3)
    for seconds in (0.040, 0.050, 0.060):
        same.record_load(seconds, 1200)
    assert same.break_even_tokens() == 334  # 50 ms / 0.15 ms
    # A node where a token loads slower than it computes never loads.
    slow = computed(LoadCosts(), legs=3)
    for tokens in (1000, 2000, 3000):
        slow.record_load(tokens * 2 * PER_TOKEN, tokens)
    assert slow.gate(100_000)


def test_the_lookup_bound_is_what_computing_the_tokens_would_take() -> None:
    config = MultiTurnConfig(enabled=True)  # multi_turn_query_timeout: the default 10 ms
    turns = MultiTurn(config, client=None, engine_id="P", block_size=BS)  # type: ignore[arg-type]
    assert turns.query_bound(1200) == config.query_timeout  # no prefill measured yet
    computed(turns.costs)
    assert abs(turns.query_bound(1200) - 1200 * PER_TOKEN) < 1e-9  # 180 ms
    assert turns.query_bound(32) == config.query_timeout  # never below the configured bound


# --- against real sidecars ------------------------------------------------------------------------------


def _lookups(port: int) -> float:
    """Cache queries P's sidecar answered (kvsidecar_cache_lookups_total, every outcome)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(r"^kvsidecar_cache_lookups_total\{[^}]*\} (\S+)$", body, re.M))


def test_with_p_s_prefix_cache_on_a_lookup_that_cannot_pay_is_never_sent(sidecars, engines) -> None:
    """vLLM's prefix caching on: nothing is asked on arrival; at the scheduler's ask, a tail beyond
    what P's cache holds that cannot pay for a load costs no RPC; one that can costs exactly one."""
    port = free_port()
    side = sidecars("p", args=["--metrics-listen", f"127.0.0.1:{port}"])
    engines(side, "P", "both")
    with SidecarClient(side.socket, timeout=5.0) as client:
        prefill = MultiTurn(MultiTurnConfig(enabled=True), client, "P", BS, prefix_caching=True)
        # A slow node: a token computes in 5 ms, a query answers in 1 s (a load: ~4 s, 800 tokens).
        prefill.costs.record_compute(1000, 5.0)
        prefill.costs.record_query(1.0)
        params = {"do_remote_decode": True, "conversation_id": "conv"}
        tail = vllm_request("tail", list(range(100, 100 + 10 * BS + 10)), params)
        prefill.prefetch(tail)  # on arrival: P's cache is not known yet, nothing is sent
        assert prefill.matched_tokens(tail, 5 * BS) == (0, False)  # 160 tokens beyond P's cache
        assert prefill.take_stats() == ({"slower_than_compute": 1}, 0, [0.0])
        assert not prefill._lookups
        time.sleep(0.3)
        assert _lookups(port) == 0

        # P's cache lacks the history: one query, however often the scheduler asks meanwhile.
        history = vllm_request("history", list(range(100, 100 + 10 * BS + 10)), params)
        prefill.prefetch(history)
        with stopped(side):
            for _ in range(3):
                assert prefill.matched_tokens(history, 0) == (None, False)
        wait_until(lambda: prefill.matched_tokens(history, 0)[0] is not None, 10.0, 0.01, "the lookup")
        assert prefill.outcomes["no_hold"] == 1
        wait_until(lambda: _lookups(port) == 1, 5.0, 0.05, "the one query counted")
        time.sleep(0.3)
        assert _lookups(port) == 1


def test_a_load_that_pays_waits_for_a_peer_slower_than_multi_turn_query_timeout(sidecars, engines) -> None:
    """P's prefix cache off, default ``multi_turn_query_timeout`` (10 ms), D's sidecar answering
    after ~200 ms (a busy node): P still loads the 4-block history, since computing it would take
    longer than that here. With the fixed bound the peer call ended at 10 ms and P computed."""
    p_side, d_side = sidecars("p"), sidecars("d")
    engines(p_side, "P", "both")
    engines(d_side, "D", "both")
    history = list(range(100, 100 + 4 * BS + 7))
    with SidecarClient(d_side.socket, timeout=5.0) as d_client, SidecarClient(p_side.socket, timeout=5.0) as client:
        decode = MultiTurn(MultiTurnConfig(enabled=True), d_client, "D", BS)
        finished = vllm_request("turn1", history, {})
        finished.num_computed_tokens = len(history)
        call, keys = decode.hold(finished, ([10, 11, 12, 13, 14],), *d_side.address.rsplit(":", 1), 1, 1)
        call.result(timeout=10)
        keys["remote_port"] = int(keys["remote_port"])

        prefill = MultiTurn(MultiTurnConfig(enabled=True), client, "P", BS)
        prefill.costs.record_compute(1000, 5.0)  # a slow node: 5 ms per prompt token
        turn2 = vllm_request("turn2", [*history, *range(500, 540)], keys)  # D's keys, as vLLM's proxy
        with stopped(d_side):
            prefill.prefetch(turn2)
            assert prefill.matched_tokens(turn2, 0) == (None, False)
            time.sleep(0.2)  # 20x multi_turn_query_timeout
            assert prefill.matched_tokens(turn2, 0) == (None, False)  # computing 160 tokens: 800 ms
        assert wait_until(lambda: prefill.matched_tokens(turn2, 0)[0], 10.0, 0.01, "the lookup") == 4 * BS
        assert prefill.outcomes == {"hit": 1}
        target = prefill.take_load(turn2, 4 * BS)
        assert target is not None and target.request_id == "turn1" and target.address == d_side.address
