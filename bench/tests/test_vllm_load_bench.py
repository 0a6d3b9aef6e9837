"""``bench.vllm_load``'s pure parts: ``ttft_parts`` (where a load cell's mean TTFT went, from both
engines' own vLLM histograms between two metric snapshots, for kvsidecar setups and vLLM's own
connectors alike) and ``cycling_prompts`` (the fragmented layout cycles every block of the cache)."""

from __future__ import annotations

from bench.vllm_load import CYCLE_PROMPT_TOKENS, KV_BYTES_PER_TOKEN, MAX_MODEL_LEN, cycling_prompts, ttft_parts

_LABELS = '{engine="0",model_name="tiny"}'


def _engine(queue_s: float, prefill_s: float, requests: int) -> dict[str, float]:
    """vLLM's /metrics as ``bench.vllm_pd.scrape`` parses it: two histograms' sums and counts."""
    return {
        f"vllm:request_queue_time_seconds_sum{_LABELS}": queue_s,
        f"vllm:request_queue_time_seconds_count{_LABELS}": requests,
        f"vllm:request_prefill_time_seconds_sum{_LABELS}": prefill_s,
        f"vllm:request_prefill_time_seconds_count{_LABELS}": requests,
    }


def test_parts_are_the_means_of_the_cell_alone_and_the_rest_closes_the_client_ttft() -> None:
    # Two warm-up requests before the cell; the cell adds 4 requests on each engine.
    before = {"P": _engine(0.1, 0.2, 2), "D": _engine(0.02, 0.01, 2)}
    after = {"P": _engine(0.1 + 4 * 0.900, 0.2 + 4 * 0.300, 6), "D": _engine(0.02 + 4 * 0.040, 0.01 + 4 * 0.008, 6)}

    parts = ttft_parts(before, after, mean_ttft_ms=1260.0)

    assert parts == {
        "P queue": 900.0,
        "P prefill": 300.0,
        "D queue + KV wait": 40.0,
        "D first step": 8.0,
        "rest": 12.0,
    }


def test_a_kvsidecar_setup_reads_the_engines_metrics_not_the_sidecars() -> None:
    sidecar = {"kvsidecar_requests_total": 9.0}
    before = {"P": sidecar, "D": sidecar, "P vLLM": _engine(0, 0, 0), "D vLLM": _engine(0, 0, 0)}
    after = {"P": sidecar, "D": sidecar, "P vLLM": _engine(2.0, 1.0, 2), "D vLLM": _engine(0.1, 0.02, 2)}

    parts = ttft_parts(before, after, mean_ttft_ms=None)

    assert parts == {"P queue": 1000.0, "P prefill": 500.0, "D queue + KV wait": 50.0, "D first step": 10.0}


def test_an_engine_without_samples_gives_no_parts_and_no_rest() -> None:
    before = {"P": _engine(0, 0, 0), "D": {}}
    after = {"P": _engine(1.0, 1.0, 1), "D": {}}

    assert ttft_parts(before, after, mean_ttft_ms=3000.0) == {"P queue": 1000.0, "P prefill": 1000.0}


def test_the_fragmented_layout_allocates_more_than_the_whole_cache_in_prompts_the_model_takes() -> None:
    assert CYCLE_PROMPT_TOKENS < MAX_MODEL_LEN
    for gib in (1, 2, 0.5):
        cache_tokens = int(gib * 2**30) // KV_BYTES_PER_TOKEN
        prompts = cycling_prompts(gib)
        # Every block is handed out at least once (the free list's fresh head is used up) ...
        assert prompts * CYCLE_PROMPT_TOKENS > cache_tokens
        # ... without cycling it needlessly twice.
        assert (prompts - 2) * CYCLE_PROMPT_TOKENS < cache_tokens
