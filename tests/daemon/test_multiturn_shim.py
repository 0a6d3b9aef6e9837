"""The connector's multi-turn policy (engine_shim.vllm.multiturn): which prefix P loads from a hold, and
the scheduler-side lookup against a real sidecar with vLLM's own ``Request`` and block hashes (no
vLLM engine: see tests/vllm/test_vllm_multiturn.py for that)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from engine_shim.client import SidecarClient
from engine_shim.vllm.load_costs import LoadCosts
from engine_shim.vllm.multiturn import HeldPrefix, LoadPlan, MultiTurn, MultiTurnConfig, plan_load
from tests.support.processes import stopped, wait_until

BS = 32
CONFIG = MultiTurnConfig(enabled=True, recompute_threshold=64, expiry_margin=5.0)


def held(hashes: list[bytes], blocks: int | None = None, expires_in: float = 100.0) -> HeldPrefix:
    count = len(hashes) if blocks is None else blocks
    return HeldPrefix(
        "127.0.0.1:1", "D", "turn1", (tuple(range(10, 10 + count)),), count * BS, 1, tuple(hashes), expires_in
    )


H = [bytes([i]) * 32 for i in range(10)]


def test_plan_loads_the_matched_prefix_beyond_the_local_cache() -> None:
    plan = plan_load([held(H[:6])], H[:8], 8 * BS + 5, 0, BS, CONFIG)
    assert (plan.tokens, plan.reason, plan.blocks) == (6 * BS, "hit", 6)
    assert plan.remote_block_ids() == ([10, 11, 12, 13, 14, 15],)
    # P's own prefix cache already has two blocks: only the four after them are loaded.
    assert plan_load([held(H[:6])], H[:8], 8 * BS + 5, 2 * BS, BS, CONFIG).tokens == 4 * BS


def test_an_edited_history_loads_only_the_common_prefix() -> None:
    edited = [*H[:3], b"x" * 32, *H[4:8]]
    plan = plan_load([held(H[:6])], edited, 8 * BS, 0, BS, CONFIG)
    assert (plan.tokens, plan.blocks) == (3 * BS, 3)
    assert plan_load([held(H[:6])], [b"y" * 32, *H[1:8]], 8 * BS, 0, BS, CONFIG) == LoadPlan(0, "prefix_mismatch")


def test_p_always_computes_its_last_prompt_token() -> None:
    # The hold covers the whole prompt (4 full blocks): P loads 3 and computes the last block.
    assert plan_load([held(H[:5])], H[:4], 4 * BS, 0, BS, CONFIG).tokens == 3 * BS


def test_misses_say_why() -> None:
    assert plan_load([], H[:8], 8 * BS, 0, BS, CONFIG).reason == "no_hold"
    assert plan_load([held(H[:1])], H[:8], 8 * BS, 0, BS, CONFIG).reason == "below_threshold"  # 32 < 64
    assert plan_load([held(H[:6])], H[:8], 8 * BS, 6 * BS, BS, CONFIG).reason == "local_cache"
    assert plan_load([held(H[:6], expires_in=4.0)], H[:8], 8 * BS, 0, BS, CONFIG).reason == "expiring"
    # The answer was measured 96 s ago: a hold that had 100 s left now has 4.
    assert plan_load([held(H[:6])], H[:8], 8 * BS, 0, BS, CONFIG, elapsed=96.0).reason == "expiring"
    no_threshold = MultiTurnConfig(enabled=True, recompute_threshold=0)
    assert plan_load([held(H[:1])], H[:8], 8 * BS, 0, BS, no_threshold).tokens == BS


def test_the_best_of_several_holds_wins() -> None:
    older = held(H[:3])
    newer = held(H[:5])
    assert plan_load([older, newer], H[:8], 8 * BS, 0, BS, CONFIG).hold is newer


def test_config_from_kv_connector_extra_config() -> None:
    assert not MultiTurnConfig.from_extra({}).enabled
    config = MultiTurnConfig.from_extra({"multi_turn": True, "kv_recompute_threshold": 0, "hold_ttl": 60})
    assert config.enabled and config.recompute_threshold == 0 and config.hold_ttl == 60.0
    with pytest.raises(ValueError, match="kv_recompute_threshold"):
        MultiTurnConfig.from_extra({"kv_recompute_threshold": -1})
    with pytest.raises(ValueError, match="multi_turn_query_timeout"):
        MultiTurnConfig.from_extra({"multi_turn_query_timeout": 0})


def measured(break_even: int) -> LoadCosts:
    """Costs as an engine would have measured them: loads hold a request back 50 ms, computing
    costs 50 ms / ``break_even`` per token."""
    costs = LoadCosts()
    for _ in range(LoadCosts.MIN_SAMPLES):
        costs.record_load(0.050)
        costs.record_compute(break_even, 0.050)
    return costs


def test_a_load_must_save_more_than_it_costs_here() -> None:
    costs = LoadCosts()
    costs.record_load(0.050)
    costs.record_compute(200, 0.100)
    assert costs.break_even_tokens() == 0 and not costs.gate(1)  # too few samples: the threshold alone
    costs = measured(100)
    assert costs.break_even_tokens() == 100
    assert MultiTurnConfig.from_extra({"multi_turn_measure_costs": False}).measure_costs is False
    unmeasured = LoadCosts(enabled=False)
    for _ in range(LoadCosts.MIN_SAMPLES):
        unmeasured.record_load(0.050)
        unmeasured.record_compute(100, 0.050)
    assert unmeasured.break_even_tokens() == 0 and not unmeasured.gate(1)
    assert not costs.gate(100) and not costs.gate(4000)
    gated = [costs.gate(96) for _ in range(LoadCosts.EXPLORE_EVERY)]
    assert gated == [True] * (LoadCosts.EXPLORE_EVERY - 1) + [False]  # one in EXPLORE_EVERY still loads


# --- against a real sidecar, with vLLM's Request and its block hashes ---------------------------------


def vllm_request(request_id: str, tokens: list[int], params: dict[str, Any]) -> Any:
    """A vLLM ``Request`` as the scheduler sees it, hashed as vLLM hashes it (sha256: the same
    seed in every process)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
    return Request(request_id, tokens, sampling, None, block_hasher=get_request_block_hasher(BS, sha256))


def test_d_holds_a_finished_turn_and_p_loads_it_without_blocking_the_scheduler(sidecars, engines) -> None:
    side = sidecars("s")
    engines(side, "D", "both")  # registered engines: the holder and the asker
    engines(side, "P", "both")
    history = list(range(100, 100 + 4 * BS + 7))  # D's turn 1: 4 full blocks computed, and 7 tokens
    with SidecarClient(side.socket, timeout=5.0) as client:
        decode = MultiTurn(CONFIG, client, "D", BS)
        finished = vllm_request("turn1", history, {"conversation_id": "conv"})
        finished.num_computed_tokens = len(history)
        call, params = decode.hold(finished, ([10, 11, 12, 13, 14],), "127.0.0.1", 4242, 1, 1)
        assert call.result(timeout=10).ttl_seconds > 0
        assert params["do_remote_decode"] and not params["do_remote_prefill"]
        assert params["remote_block_ids"] == [[10, 11, 12, 13, 14]] and params["remote_engine_id"] == "D"
        assert params["remote_request_id"] == "turn1" and params["remote_num_tokens"] == len(history)
        assert (params["remote_host"], params["remote_port"], params["conversation_id"]) == ("127.0.0.1", 4242, "conv")
        [entry] = client.query_cache("P", conversation_id="conv").entries
        assert list(entry.block_hashes) == finished.block_hashes[:4]  # vLLM's own hashes, full blocks only

        # Turn 2 on P: the history plus new tokens; the sidecar stopped, so the query is in flight.
        prefill = MultiTurn(MultiTurnConfig(enabled=True, query_timeout=5.0), client, "P", BS)
        turn2 = vllm_request(
            "turn2", [*history, *range(500, 540)], {"do_remote_decode": True, "conversation_id": "conv"}
        )
        with stopped(side):
            assert prefill.matched_tokens(turn2, 0) == (None, False)  # ask again; never blocks

        def answered() -> tuple[int | None, bool] | None:
            result = prefill.matched_tokens(turn2, 0)
            return result if result[0] is not None else None

        assert wait_until(answered, 10.0, 0.01, "the lookup") == (4 * BS, True)
        assert prefill.outcomes["hit"] == 1
        target = prefill.take_load(turn2, 4 * BS)
        assert target is not None and target.engine_id == "D" and target.request_id == "turn1"
        assert [list(group.ids) for group in target.block_ids.groups] == [[10, 11, 12, 13]]
        assert turn2.kv_transfer_params["_multiturn_loaded"]
        outcomes, loaded, [waited] = prefill.take_stats()  # vLLM's stat loggers get them once
        assert (outcomes, loaded) == ({"hit": 1}, 4 * BS) and waited > 0  # held back while stopped
        assert prefill.take_stats() == ({}, 0, [])
        assert prefill.matched_tokens(turn2, 0) == (0, False)  # rescheduled after its load: no second load

        # Asked on arrival (on_new_request), the answer is in before the scheduler first asks.
        again = vllm_request(
            "turn2b", [*history, *range(500, 540)], {"do_remote_decode": True, "conversation_id": "conv"}
        )
        prefill.prefetch(again)
        wait_until(lambda: prefill._lookups["turn2b"].future.done(), 10.0, 0.01, "the prefetched lookup")
        assert prefill.matched_tokens(again, 0) == (4 * BS, True)

        # A router that passes D's own keys (vLLM's multi-turn proxy) gets the hold they name, still
        # verified by hashes: here P's sidecar asks the named sidecar for that request id.
        host, port = side.address.rsplit(":", 1)
        keys = {
            **params,
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_host": host,
            "remote_port": port,
        }
        keys.pop("conversation_id")
        named = vllm_request("turn2c", [*history, *range(500, 540)], keys)
        prefill.prefetch(named)
        wait_until(lambda: prefill._lookups["turn2c"].future.done(), 10.0, 0.01, "the lookup by D's keys")
        assert prefill.matched_tokens(named, 0) == (4 * BS, True)
        assert prefill.take_load(named, 4 * BS).request_id == "turn1"


def test_a_lookup_that_outlives_its_bound_lets_p_compute(sidecars, engines) -> None:
    side = sidecars("s")
    engines(side, "P", "both")
    with SidecarClient(side.socket, timeout=5.0) as client:
        prefill = MultiTurn(MultiTurnConfig(enabled=True, query_timeout=0.05), client, "P", BS)
        request = vllm_request("late", list(range(300, 300 + 5 * BS)), {"do_remote_decode": True})
        with stopped(side):
            assert prefill.matched_tokens(request, 0) == (None, False)
            time.sleep(0.15)  # past twice the bound
            assert prefill.matched_tokens(request, 0) == (0, False)
        assert prefill.outcomes["timeout"] == 1
        assert prefill.take_load(request, 0) is None
        # A request the router opted out is not asked about either.
        opted_out = vllm_request("out", list(range(300, 300 + 5 * BS)), {"do_remote_decode": True, "multi_turn": False})
        assert prefill.matched_tokens(opted_out, 0) == (0, False) and prefill.outcomes["disabled"] == 1
        # A prompt too short to be worth asking about is not asked about.
        short = vllm_request("short", list(range(10, 10 + 2 * BS)), {"do_remote_decode": True})
        assert prefill.matched_tokens(short, 0) == (0, False) and prefill.outcomes["below_threshold"] == 1


def test_p_s_own_prefix_cache_decides_without_waiting_for_the_lookup(sidecars, engines) -> None:
    """The query goes out when the request arrives, before vLLM looks in P's prefix cache: when that
    cache leaves less than the threshold for a hold to give, P computes at once instead of waiting
    for the answer (which could not change the decision)."""
    side = sidecars("s")
    engines(side, "P", "both")
    with SidecarClient(side.socket, timeout=5.0) as client:
        prefill = MultiTurn(MultiTurnConfig(enabled=True, query_timeout=5.0), client, "P", BS)
        tokens = list(range(300, 300 + 6 * BS + 10))
        cached = vllm_request("cached", tokens, {"do_remote_decode": True})
        wanted = vllm_request("wanted", tokens, {"do_remote_decode": True})
        with stopped(side):  # both queries stay in flight
            prefill.prefetch(cached)
            prefill.prefetch(wanted)
            # P's cache has 5 of the 6 blocks a hold could give: 32 tokens < 64.
            assert prefill.matched_tokens(cached, 5 * BS) == (0, False)
            assert prefill.outcomes["local_cache"] == 1
            # Two cached blocks leave 128 tokens worth a load: P waits for the answer.
            assert prefill.matched_tokens(wanted, 2 * BS) == (None, False)
        assert prefill.take_stats() == ({"local_cache": 1}, 0, [0.0])  # decided without waiting


def test_p_computes_a_tail_that_would_load_slower_than_it_computes(sidecars, engines) -> None:
    """With P's measured costs, a hold whose new tokens save less than a load costs on this node is
    not read: decided before the query when no hold could be worth it, else on the answer."""
    side = sidecars("s")
    engines(side, "D", "both")
    engines(side, "P", "both")
    history = list(range(100, 100 + 4 * BS + 7))  # D holds 4 full blocks: P could load 128 tokens
    with SidecarClient(side.socket, timeout=5.0) as client:
        decode = MultiTurn(CONFIG, client, "D", BS)
        finished = vllm_request("turn1", history, {"conversation_id": "conv"})
        finished.num_computed_tokens = len(history)
        decode.hold(finished, ([10, 11, 12, 13, 14],), "127.0.0.1", 4242, 1, 1)[0].result(timeout=10)
        turn2 = [*history, *range(500, 540)]  # 5 full blocks: at most 160 tokens from any hold
        params = {"do_remote_decode": True, "conversation_id": "conv"}
        prefill = MultiTurn(MultiTurnConfig(enabled=True, query_timeout=5.0), client, "P", BS)

        prefill.costs = measured(200)  # no hold could save 200 tokens: not even asked
        with stopped(side):
            assert prefill.matched_tokens(vllm_request("a", turn2, params), 0) == (0, False)
        assert prefill.take_stats() == ({"slower_than_compute": 1}, 0, [0.0])

        prefill.costs = measured(150)  # one could: asked, but this one saves 128 < 150
        request = vllm_request("b", turn2, params)

        def decided() -> tuple[int | None, bool] | None:
            result = prefill.matched_tokens(request, 0)
            return result if result[0] is not None else None

        assert wait_until(decided, 10.0, 0.01, "the lookup") == (0, False)
        assert prefill.outcomes["slower_than_compute"] == 2
        assert prefill.matched_tokens(request, 0) == (0, False)  # asked again, the decision stands

        # Worth asking (160 >= 150), but an answer later than computing 160 tokens takes (here
        # 50 ms / 150 per token: 53 ms) could not pay off: P stops waiting and computes.
        late = vllm_request("late", turn2, params)
        with stopped(side):
            assert prefill.matched_tokens(late, 0) == (None, False)
            time.sleep(0.06)
            assert prefill.matched_tokens(late, 0) == (0, False)
        assert prefill.outcomes["slower_than_compute"] == 3 and not prefill.outcomes["timeout"]

        prefill.costs = measured(100)  # 128 >= 100: loaded
        loading = vllm_request("c", turn2, params)
        assert wait_until(lambda: prefill.matched_tokens(loading, 0)[0], 10.0, 0.01, "the lookup") == 4 * BS
