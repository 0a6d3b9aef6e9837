"""Integrity digests (sidecar.dataplane.integrity) over real memory: engines that differ in block size,
layout and TP size but hold the same logical KV digest equally; one changed byte changes exactly
the digest of its granule; opaque layouts digest whole blocks, TP slices in rank order."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.dataplane.integrity import DigestSpan, check_span, digests, first_mismatch, granule
from sidecar.dataplane.plan.layout import RegionLayout, WorkerLayout

LAYERS, HEADS, CHUNK, BLOCKS, TOKENS = 2, 4, 8, 16, 45


class Engine:
    """``tp`` workers over one real numpy buffer (addresses are real: digests read memory)."""

    def __init__(self, tp: int, block_size: int, layout: str) -> None:
        heads = HEADS // tp
        block_len = block_size * heads * CHUNK
        self.memory = np.zeros(tp * LAYERS * BLOCKS * block_len, dtype=np.uint8)
        self.workers = [self._worker(rank, heads, block_size, layout, block_len) for rank in range(tp)]

    def _worker(self, rank: int, heads: int, block_size: int, layout: str, block_len: int) -> WorkerLayout:
        base = self.memory.ctypes.data + rank * LAYERS * BLOCKS * block_len
        regions = tuple(
            RegionLayout(f"l{layer}", base + layer * BLOCKS * block_len, block_len, block_len, 0)
            for layer in range(LAYERS)
        )
        return WorkerLayout(rank, 0, regions, BLOCKS, 1, block_size, layout, heads, HEADS, False)

    def offset(self, address: int) -> int:
        return address - self.memory.ctypes.data

    def store(self, blocks: list[int], first: int, content: list[np.ndarray]) -> None:
        """Write logical ``content`` (per layer: tokens x all heads x chunk) from token ``first``."""
        for worker in self.workers:
            heads, size = worker.num_kv_heads, worker.block_size
            for layer, region in enumerate(worker.regions):
                for token in range(first, TOKENS):
                    block, within = divmod(token - first, size)
                    for local in range(heads):
                        inner = (
                            local * size + within if worker.kv_layout in ("HND", "LBHNC") else within * heads + local
                        )
                        at = self.offset(region.base) + blocks[block] * region.block_len + inner * CHUNK
                        self.memory[at : at + CHUNK] = content[layer][token, worker.tp_rank * heads + local]


def content() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, size=(TOKENS, HEADS, CHUNK), dtype=np.uint8) for _ in range(LAYERS)]


@pytest.mark.parametrize("other", [(2, 8, "NHD"), (1, 32, "HND"), (4, 16, "LBNHC")], ids=str)
def test_equal_logical_content_gives_equal_digests(other) -> None:
    source, dest = Engine(1, 16, "LBHNC"), Engine(*other)
    data = content()
    src_blocks, dest_blocks = [9, 2, 5], [3, 11, 0, 7, 14, 1][: -(-TOKENS // other[1])]
    span = DigestSpan(0, TOKENS, granule(source.workers[0], dest.workers[0]))
    source.store(src_blocks, 0, data)
    dest.store(dest_blocks, 0, data)
    assert digests(source.workers, src_blocks, 0, span) == digests(dest.workers, dest_blocks, 0, span)
    # A partial prefix hit: the consumer's list starts at a later token.
    tail = DigestSpan(other[1], TOKENS, span.granule)
    assert digests(source.workers, src_blocks, 0, tail) == digests(dest.workers, dest_blocks[1:], other[1], tail)


def test_one_changed_byte_changes_only_its_granule() -> None:
    engine = Engine(2, 8, "NHD")
    blocks = [4, 6, 8, 10, 12, 14]
    engine.store(blocks, 0, content())
    span = DigestSpan(0, TOKENS, 8)
    before = digests(engine.workers, blocks, 0, span)
    worker = engine.workers[1]
    region = worker.regions[1]  # layer 1 of rank 1: block 10 holds tokens 24..31
    engine.memory[engine.offset(region.base) + 10 * region.block_len + 5] ^= 0xFF
    after = digests(engine.workers, blocks, 0, span)
    assert first_mismatch(after, before) == 3
    assert [a == b for a, b in zip(before, after, strict=True)] == [True, True, True, False, True, True]
    assert first_mismatch(before, before[:-1]) == 5


def test_opaque_layouts_digest_whole_blocks_with_tp_slices_in_rank_order() -> None:
    whole, split = Engine(1, 16, "CPU_LBHNC"), Engine(2, 16, "CPU_LBHNC")
    for layer in range(LAYERS):  # head-major bytes: rank r holds the r-th half of each block
        for block in range(BLOCKS):
            data = np.random.default_rng([layer, block]).integers(0, 256, 16 * HEADS * CHUNK, dtype=np.uint8)
            region = whole.workers[0].regions[layer]
            start = whole.offset(region.base) + block * region.block_len
            whole.memory[start : start + region.block_len] = data
            for rank, worker in enumerate(split.workers):
                part = worker.regions[layer]
                at = split.offset(part.base) + block * part.block_len
                split.memory[at : at + part.block_len] = data[rank * part.block_len : (rank + 1) * part.block_len]
    span = DigestSpan(0, 48, granule(whole.workers[0], split.workers[0]))
    assert span.granule == 16
    assert digests(whole.workers, [1, 2, 3], 0, span) == digests(split.workers, [1, 2, 3], 0, span)
    assert digests(whole.workers, [1, 2, 3], 0, span) != digests(split.workers, [1, 2, 4], 0, span)


def test_spans_outside_the_request_are_refused() -> None:
    assert check_span(DigestSpan(0, 45, 8), 48) is None
    assert "granule_tokens" in str(check_span(DigestSpan(0, 45, 0), 48))
    assert "not inside" in str(check_span(DigestSpan(0, 60, 8), 48))
    assert "not inside" in str(check_span(DigestSpan(20, 20, 8), 48))
