"""Heterogeneous engines with real processes and real NIXL: P and D differ in block size, KV layout
and TP size; the sidecars convert, in pull and in push. Every cell moves a request with a partial
last block, once whole and once onto a partial prefix hit on D, with the integrity check on, and
D's blocks must hold the request's *logical* content (layer, token, head) exactly, with nothing
written past the request's last token.

The full matrix (block size ratio P/D {1/4, 1/2, 1, 2, 4} x layout {same, NHD->HND, HND->NHD} x
mode {pull, push} x TP P:D {1:1, 1:2, 2:1}) is marked ``hetero`` (``make hetero``); a
representative subset runs in ``make test``. All cells of one run share one pair of sidecars and
one producer engine per (layout, TP).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support.processes import EngineProcess, SidecarProcess, start_transfer, wait_until

P_BLOCK_SIZE = 16
RATIOS = {"1/4": 64, "1/2": 32, "1": 16, "2": 8, "4": 4}  # P's block size / D's -> D's block size
LAYOUTS = {"same": ("HND", "HND"), "NHD->HND": ("NHD", "HND"), "HND->NHD": ("HND", "NHD")}
TPS = [(1, 1), (1, 2), (2, 1)]
MODES = ["pull", "push"]
TOTAL_HEADS, CHUNK, LAYERS, BLOCKS = 2, 64, 2, 64
TOKENS = 150  # a partial last block for every block size above
INTEGRITY = ["--integrity", "digest"]


@dataclass(frozen=True)
class Cell:
    ratio: str
    layout: str
    mode: str
    tps: tuple[int, int]

    @property
    def name(self) -> str:
        return f"{self.ratio.replace('/', 'over')}-{self.layout}-{self.mode}-tp{self.tps[0]}to{self.tps[1]}"


ALL_CELLS = [Cell(*values) for values in itertools.product(RATIOS, LAYOUTS, MODES, TPS)]
# The quick subset: every ratio, layout, mode and TP pairing appears at least once.
QUICK = {
    Cell("1/4", "NHD->HND", "pull", (1, 2)),
    Cell("4", "HND->NHD", "push", (2, 1)),
    Cell("2", "same", "pull", (2, 1)),
    Cell("1/2", "same", "push", (1, 2)),
    Cell("1", "NHD->HND", "push", (1, 1)),
    Cell("4", "NHD->HND", "pull", (1, 1)),
    Cell("1/4", "HND->NHD", "push", (1, 2)),
}


class Rig:
    """Two sidecars (integrity on), producers made on demand and kept, one consumer at a time."""

    def __init__(self, sidecars, engines) -> None:
        self.p_side: SidecarProcess = sidecars("p", args=INTEGRITY)
        self.d_side: SidecarProcess = sidecars("d", args=INTEGRITY)
        self._engines = engines
        self._producers: dict[tuple[str, int], EngineProcess] = {}
        self._consumer: tuple[tuple[int, str, int], EngineProcess] | None = None
        self._serial = itertools.count()
        self.rng = random.Random(11)

    def _engine(self, side: SidecarProcess, name: str, role: str, block_size: int, layout: str, tp: int):
        heads = TOTAL_HEADS // tp
        return self._engines(
            side, name, role, tp=tp, layers=LAYERS, blocks=BLOCKS, heads=heads, block_size=block_size,
            kv_layout=layout, block_len=block_size * heads * CHUNK, head_size=CHUNK // 4, dtype="float16",
        )  # fmt: skip

    def producer(self, layout: str, tp: int) -> EngineProcess:
        key = (layout, tp)
        if key not in self._producers:
            self._producers[key] = self._engine(self.p_side, f"P-{layout}-tp{tp}", "producer", P_BLOCK_SIZE, layout, tp)
        return self._producers[key]

    def consumer(self, block_size: int, layout: str, tp: int) -> EngineProcess:
        key = (block_size, layout, tp)
        if self._consumer is None or self._consumer[0] != key:
            if self._consumer is not None:
                self._consumer[1].stop()
            engine = self._engine(self.d_side, f"D-{block_size}-{layout}-tp{tp}", "consumer", block_size, layout, tp)
            self._consumer = (key, engine)
        return self._consumer[1]

    def run(self, cell: Cell, hit_blocks: int) -> None:
        p_layout, d_layout = LAYOUTS[cell.layout]
        d_size = RATIOS[cell.ratio]
        producer = self.producer(p_layout, cell.tps[0])
        consumer = self.consumer(d_size, d_layout, cell.tps[1])
        serial = next(self._serial)
        request, seed = f"{cell.name}-{hit_blocks}-{serial}", 1000 + serial
        p_blocks = self.rng.sample(range(BLOCKS), -(-TOKENS // P_BLOCK_SIZE))
        d_blocks = self.rng.sample(range(BLOCKS), -(-TOKENS // d_size) - hit_blocks)
        assert producer.command("fill_tokens", blocks=p_blocks, num_tokens=TOKENS, seed=seed)["ok"]
        assert consumer.command("clear")["ok"]
        reply = start_transfer(producer, consumer, cell.mode, request, p_blocks, d_blocks, TOKENS)
        assert reply["ok"], reply
        events = consumer.wait_event(f"{request}-d", 30)
        assert {e["event"] for e in events} == {"FINISHED_RECEIVING"}, (cell, events)
        assert {e["event"] for e in producer.wait_event(request, 30)} == {"FINISHED_SENDING"}
        first = hit_blocks * d_size
        check = consumer.command("verify_tokens", blocks=d_blocks, first_token=first, num_tokens=TOKENS, seed=seed)
        assert check["ok"] and check["bad_count"] == 0, (cell, hit_blocks, check)
        if cell.ratio != "1" or p_layout != d_layout:  # same shapes copy whole blocks, tails included
            assert check["tail_dirty"] == 0, (cell, hit_blocks, check)
        assert check["checked_tokens"] == (TOKENS - first) * LAYERS * cell.tps[1]


@pytest.fixture
def rig(sidecars, engines) -> Iterator[Rig]:
    yield Rig(sidecars, engines)


def _run_cells(rig: Rig, cells: list[Cell]) -> None:
    # Grouped by consumer so each consumer engine starts once.
    for cell in sorted(cells, key=lambda c: (RATIOS[c.ratio], LAYOUTS[c.layout][1], c.tps[1], c.name)):
        for hit_blocks in (0, 1):
            rig.run(cell, hit_blocks)


def test_hetero_representative_cells(rig: Rig) -> None:
    _run_cells(rig, sorted(QUICK, key=lambda c: c.name))


@pytest.mark.hetero
@pytest.mark.slow
def test_hetero_full_matrix(rig: Rig) -> None:
    _run_cells(rig, ALL_CELLS)


# --- refusals and the integrity check ------------------------------------------------------------


def _pair(sidecars, engines, p_shape: dict, d_shape: dict, integrity: bool = True):
    args = INTEGRITY if integrity else []
    p_side, d_side = sidecars("p", args=args), sidecars("d", args=args)
    base = {"layers": LAYERS, "blocks": BLOCKS, "heads": TOTAL_HEADS, "head_size": CHUNK // 4, "dtype": "float16"}
    shape_p = base | {"block_size": 16, "kv_layout": "HND", "block_len": 16 * TOTAL_HEADS * CHUNK} | p_shape
    shape_d = base | {"block_size": 16, "kv_layout": "HND", "block_len": 16 * TOTAL_HEADS * CHUNK} | d_shape
    return engines(p_side, "P", "producer", **shape_p), engines(d_side, "D", "consumer", **shape_d), p_side, d_side


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "differs,p_value,d_value", [("dtype", "float16", "bfloat16"), ("head_size", 16, 32)], ids=["dtype", "head_size"]
)
def test_what_cannot_be_converted_is_refused_naming_both_sides(sidecars, engines, mode, differs, p_value, d_value):
    """Different dtype or head size (with a different block size too): LOAD_FAILED whose reason
    names both values and both engines, on D's and on P's log; P's blocks are freed."""
    producer, consumer, p_side, d_side = _pair(
        sidecars, engines, {differs: p_value}, {differs: d_value, "block_size": 8, "block_len": 8 * TOTAL_HEADS * CHUNK}
    )
    reply = start_transfer(producer, consumer, mode, "refused", list(range(10)), list(range(19)), TOKENS)
    assert reply["ok"], reply
    events = consumer.wait_event("refused-d", 30)
    assert {e["event"] for e in events} == {"LOAD_FAILED"}, events
    reason = events[0]["reason"]
    expected = [str(p_value), str(d_value), "producer P", "consumer D"]
    assert all(text in reason for text in expected), reason
    assert sorted(events[0]["failed_block_ids"]) == list(range(19))
    assert any(all(text in e.get("reason", "") for text in expected) for e in d_side.log_events())
    # P hears why: its log names the values; in pull its blocks are freed at once. (In push D may
    # give up before P submits: then P's lease frees them.)
    if mode == "pull":
        assert producer.wait_event("refused", 30)[0]["event"] == "FINISHED_SENDING"
    released = wait_until(
        lambda: [e for e in p_side.log_events() if e.get("event") == "consumer_released"], 10, what="P's log"
    )
    assert any(all(text in e.get("reason", "") for text in expected) for e in released), released


@pytest.mark.parametrize("integrity", [True, False], ids=["digest", "off"])
def test_integrity_check_names_the_block_that_does_not_match(sidecars, engines, integrity):
    """D pulls with two of P's blocks named in the wrong order (broken kv_transfer_params: every
    block is the request's, so the producer's ownership check passes, but tokens 64..95 land in the
    wrong places). With integrity = digest the load fails naming D's block that holds the first bad
    tokens; without it the load 'succeeds' with the wrong bytes. (Block size and layout differ.)"""
    producer, consumer, _, _ = _pair(
        sidecars, engines, {"kv_layout": "NHD"}, {"block_size": 32, "block_len": 32 * TOTAL_HEADS * CHUNK},
        integrity=integrity,
    )  # fmt: skip
    p_blocks, d_blocks = list(range(10, 20)), [7, 3, 12, 40, 41]
    assert producer.command("fill_tokens", blocks=list(range(BLOCKS)), num_tokens=BLOCKS * 16, seed=4)["ok"]
    assert producer.command("submit", request_id="stale", blocks=[p_blocks], num_tokens=TOKENS)["ok"]
    told = [*p_blocks[:4], p_blocks[5], p_blocks[4], *p_blocks[6:]]  # P's own blocks, two swapped
    remote = {"address": producer.peer_address, "engine_id": "P", "request_id": "stale", "blocks": [told]}
    remote["num_tokens"] = TOKENS
    assert consumer.command("pull", request_id="stale-d", blocks=[d_blocks], remote=remote)["ok"]
    events = consumer.wait_event("stale-d", 30)
    if not integrity:
        assert {e["event"] for e in events} == {"FINISHED_RECEIVING"}, events
        return
    assert {e["event"] for e in events} == {"LOAD_FAILED"}, events
    assert "integrity check failed: block 12 (tokens 64..79)" in events[0]["reason"], events[0]["reason"]


@pytest.mark.parametrize("mode", MODES)
def test_large_staged_request_moves_in_pipelined_groups(sidecars, engines, mode):
    """A 16 MiB layout conversion (8 layers x 8 heads x 512 B x 512 tokens) is staged in four
    groups of layers, transfers overlapping permutations; every token arrives, one notification."""
    p_side, d_side = sidecars("p", args=INTEGRITY), sidecars("d", args=INTEGRITY)
    shape = {"layers": 8, "blocks": 40, "heads": 8, "block_size": 16, "block_len": 16 * 8 * 512}
    producer = engines(p_side, "P", "producer", kv_layout="NHD", **shape)
    consumer = engines(d_side, "D", "consumer", kv_layout="HND", **shape)
    p_blocks, d_blocks = list(range(32)), list(range(39, 7, -1))
    assert producer.command("fill_tokens", blocks=p_blocks, num_tokens=512, seed=9)["ok"]
    reply = start_transfer(producer, consumer, mode, "big", p_blocks, d_blocks, 512)
    assert reply["ok"], reply
    assert [e["event"] for e in consumer.wait_event("big-d", 60)] == ["FINISHED_RECEIVING"]
    assert [e["event"] for e in producer.wait_event("big", 60)] == ["FINISHED_SENDING"]
    check = consumer.command("verify_tokens", blocks=d_blocks, first_token=0, num_tokens=512, seed=9)
    assert check["bad_count"] == 0 and check["checked_tokens"] == 512 * 8, check
