"""Multi-turn conversations against real vLLM servers (the end-to-end tests of issue 16): token-id
prompts, what P's vLLM and P's sidecar counted for one turn, and the check that P loaded exactly
the previous turn's held prefix from D.

The servers use the tiny Llama of ``tests.support.tiny_models`` with 32-token blocks, 2 layers,
2 KV heads of 32 dims in fp32 (``BLOCK_BYTES`` per block and layer). Called from the test thread.
"""

from __future__ import annotations

import json
import random
import urllib.request
from dataclasses import astuple, dataclass
from typing import Any

from tests.support.processes import wait_until

BLOCK = 32
LAYERS = 2
BLOCK_BYTES = 2 * BLOCK * 64 * 4  # one block of one layer: 2 KV heads x 32 tokens x (2 x 32) x fp32
THRESHOLD = 64  # kv_recompute_threshold (the default)
# P's bound on a cache query (multi_turn_query_timeout). Generous: the test machine is shared and
# busy, and a query that times out would make P compute (a correct answer, but not what the
# multi-turn tests check).
QUERY_TIMEOUT = 10.0


def fresh_tokens(count: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(count)]


def loaded_from_d(previous_total: int, prompt_len: int) -> int:
    """Tokens P loads from D's hold of the previous turn: D computed every token of that turn but
    the last sampled one, whole blocks only, never P's last prompt token, at least THRESHOLD."""
    tokens = min((previous_total - 1) // BLOCK, (prompt_len - 1) // BLOCK) * BLOCK
    return tokens if tokens >= THRESHOLD else 0


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def post_stream(url: str, body: dict[str, Any], timeout: float = 120.0) -> list[dict[str, Any]]:
    """The ``data:`` chunks of a server-sent-events answer, ``[DONE]`` excluded."""
    request = urllib.request.Request(
        url, data=json.dumps({**body, "stream": True}).encode(), headers={"Content-Type": "application/json"}
    )
    chunks = []
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5.0) as response:
        return str(response.read().decode())


def series_sum(text: str, name: str, label: str = "") -> float:
    """Sum of a series over its label sets (those containing ``label``)."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@dataclass(frozen=True)
class Counts:
    """What P's vLLM and P's sidecar counted (running totals, or one turn's share)."""

    external: float  # P's prompt tokens loaded from outside (vllm:prompt_tokens_by_source)
    computed: float  # P's prompt tokens it computed
    read_bytes: float  # bytes P's sidecar READ (D -> P)
    hits: float  # the connector's multi-turn lookups that loaded (vllm:kvsidecar_multi_turn_lookups)
    tokens_loaded: float  # what the connector says it loaded (vllm:kvsidecar_multi_turn_tokens_loaded)

    def __sub__(self, other: Counts) -> Counts:
        return Counts(*(mine - theirs for mine, theirs in zip(astuple(self), astuple(other), strict=True)))


@dataclass
class Turn:
    prompt: list[int]
    answer: list[int]
    counts: Counts


@dataclass
class PrefillCounters:
    """P's prompt tokens by source and the connector's multi-turn lookups (P's vLLM /metrics), and
    the bytes P's sidecar READ (its Prometheus endpoint): in pull mode P->D goes through D's READs
    and in push mode through P's WRITEs, so P's READs are D->P only."""

    prefill_url: str
    sidecar_metrics_port: int

    def now(self) -> Counts:
        text = scrape(f"{self.prefill_url}/metrics")
        name = "vllm:prompt_tokens_by_source_total"  # a Prometheus counter: _total
        sidecar = scrape(f"http://127.0.0.1:{self.sidecar_metrics_port}/metrics")
        return Counts(
            series_sum(text, name, 'source="external_kv_transfer"'),
            series_sum(text, name, 'source="local_compute"'),
            series_sum(sidecar, "kvsidecar_transfer_bytes_total", "READ"),
            series_sum(text, "vllm:kvsidecar_multi_turn_lookups_total", 'outcome="hit"'),
            series_sum(text, "vllm:kvsidecar_multi_turn_tokens_loaded_total"),
        )

    def turn(self, before: Counts, prompt: list[int], answer: list[int]) -> Turn:
        """What was counted for ``prompt`` since ``before`` (waits, bounded, for P's metrics to
        catch up with the request)."""

        def counted() -> Counts | None:
            delta = self.now() - before
            caught_up = delta.external + delta.computed >= len(prompt) and delta.tokens_loaded >= delta.external
            return delta if caught_up else None

        return Turn(prompt, answer, wait_until(counted, 15.0, 0.1, "P's prompt token metrics"))


def check(turn: Turn, loaded: int, what: str) -> None:
    """P loaded ``loaded`` tokens from D (their bytes crossed P's sidecar, and the connector counted
    one hit for them on vLLM's /metrics) and computed the rest."""
    counts = turn.counts
    assert counts.external == loaded, f"{what}: {turn}"
    assert counts.computed == len(turn.prompt) - loaded, f"{what}: {turn}"
    assert counts.read_bytes == loaded // BLOCK * LAYERS * BLOCK_BYTES, f"{what}: {turn}"
    assert (counts.hits, counts.tokens_loaded) == ((1, loaded) if loaded else (0, 0)), f"{what}: {turn}"
