"""Token-level plans across block sizes, layouts and TP sizes (pure), checked against an oracle:
engines' memories are numpy buffers holding logical content (layer, token, head), the plan is
applied by copying bytes, and the destination is read back with an independent offset formula."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from sidecar.dataplane.plan.convert import (
    Side,
    block_shape,
    check_convertible,
    copy_tokens,
    logical_tokens,
    predicted_run_bytes,
    run_descriptors,
    shared_heads,
    transfer_span,
)
from sidecar.dataplane.plan.layout import PlanError, RegionLayout, WorkerLayout
from sidecar.dataplane.plan.tp import pairings

CHUNK = 8  # bytes per (token, head): four uint16 (layer, token, head, marker)
LAYERS = 2
TOTAL_HEADS = 4
BLOCKS = 12  # physical blocks per region
POISON = 0xEE


class Engine:
    """``tp`` workers, each with LAYERS regions at known offsets of one flat buffer."""

    def __init__(self, memory: np.ndarray, offset: int, tp: int, block_size: int, layout: str, ppl: int = 1) -> None:
        self.tp, self.block_size, self.layout, self.ppl = tp, block_size, layout, ppl
        self.heads = TOTAL_HEADS // tp
        self.tokens = block_size // ppl
        self.block_len = self.tokens * self.heads * CHUNK
        self.stride = self.block_len + 16  # a gap between blocks: runs must not cross it
        self.workers = []
        for rank in range(tp):
            regions = []
            for layer in range(LAYERS):
                regions.append(RegionLayout(f"layer{layer}", offset, self.block_len, self.stride, 0))
                offset += self.stride * BLOCKS * ppl
            self.workers.append(
                WorkerLayout(
                    tp_rank=rank, pp_rank=0, regions=tuple(regions), num_blocks=BLOCKS * ppl, physical_per_logical=ppl,
                    block_size=block_size, kv_layout=layout, num_kv_heads=self.heads,
                    total_num_kv_heads=TOTAL_HEADS, is_mla=False,
                )
            )  # fmt: skip
        self.end = offset
        self.memory = memory

    def address(self, rank: int, layer: int, blocks: list[int], first_token: int, token: int, head: int) -> int:
        """Independent of the module under test: where (token, global head) lives."""
        logical_index, within_logical = divmod(token - first_token, self.block_size)
        sub, within = divmod(within_logical, self.tokens)
        physical = blocks[logical_index] * self.ppl + sub
        local = head - rank * self.heads
        if self.layout in ("HND", "LBHNC"):
            inner = (local * self.tokens + within) * CHUNK
        else:
            inner = (within * self.heads + local) * CHUNK
        return self.workers[rank].regions[layer].base + physical * self.stride + inner


def content(layer: int, token: int, head: int) -> np.ndarray:
    return np.array([layer + 1, token + 1, head + 1, 0xC0DE], dtype=np.uint16).view(np.uint8)


def fill(engine: Engine, blocks: list[int], tokens: int) -> None:
    for rank, layer, token in itertools.product(range(engine.tp), range(LAYERS), range(tokens)):
        for head in range(rank * engine.heads, (rank + 1) * engine.heads):
            at = engine.address(rank, layer, blocks, 0, token, head)
            engine.memory[at : at + CHUNK] = content(layer, token, head)


def plan(
    src: Engine, src_blocks: list[int], dst: Engine, dst_blocks: list[int], first: int, end: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for rank in range(src.tp):
        for pairing in pairings(src.tp, dst.tp, rank):
            source = Side(src.workers[rank], src_blocks, 0)
            dest = Side(dst.workers[pairing.target_rank], dst_blocks, first)
            out.append(run_descriptors(source, dest, first, end))
    return out


def apply(memory: np.ndarray, descriptors: list[tuple[np.ndarray, np.ndarray]]) -> int:
    count = 0
    for src, dst in descriptors:
        assert src.shape == dst.shape
        assert (src[:, 1] == dst[:, 1]).all()
        for (s, n, _), (d, _, _) in zip(src.tolist(), dst.tolist(), strict=True):
            memory[d : d + n] = memory[s : s + n]
        count += len(src)
    return count


def check(dst: Engine, dst_blocks: list[int], first: int, end: int) -> None:
    """Every destination token of [first, end) holds its logical content; every other byte of
    the destination (the last block's tail, unlisted blocks, the gaps) is untouched."""
    touched = np.zeros(dst.memory.size, dtype=bool)
    for rank, layer, token in itertools.product(range(dst.tp), range(LAYERS), range(first, end)):
        for head in range(rank * dst.heads, (rank + 1) * dst.heads):
            at = dst.address(rank, layer, dst_blocks, first, token, head)
            got = dst.memory[at : at + CHUNK]
            assert (got == content(layer, token, head)).all(), (rank, layer, token, head, got.view(np.uint16))
            touched[at : at + CHUNK] = True
    region = dst.memory[dst.workers[0].regions[0].base : dst.end]
    assert (region[~touched[dst.workers[0].regions[0].base : dst.end]] == POISON).all()


RATIOS = [(8, 32), (8, 16), (16, 16), (16, 8), (32, 8)]  # source / destination block size: 1/4 .. 4
LAYOUT_PAIRS = [("LBHNC", "LBHNC"), ("NHD", "NHD"), ("NHD", "HND"), ("LBHNC", "LBNHC")]
TPS = [(1, 1), (1, 2), (2, 1), (2, 4)]


def _case(
    src_size: int,
    dst_size: int,
    src_layout: str,
    dst_layout: str,
    src_tp: int,
    dst_tp: int,
    tokens: int,
    hit_blocks: int,
    ppl: int = 1,
):
    memory = np.full(1 << 20, POISON, dtype=np.uint8)
    src = Engine(memory, 0, src_tp, src_size, src_layout, ppl)
    dst = Engine(memory, src.end, dst_tp, dst_size, dst_layout)
    src_count = -(-tokens // src_size)
    dst_count = -(-tokens // dst_size) - hit_blocks
    src_blocks = [7, 2, 9, 0, 5, 11, 3, 1, 10][:src_count]
    dst_blocks = [4, 10, 1, 8, 6, 0, 3, 2, 9, 5, 7, 11][:dst_count]
    assert len(src_blocks) == src_count and len(dst_blocks) == dst_count
    return memory, src, dst, src_blocks, dst_blocks


@pytest.mark.parametrize("sizes", RATIOS, ids=lambda s: f"{s[0]}to{s[1]}")
@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda s: f"{s[0]}-{s[1]}")
@pytest.mark.parametrize("tps", TPS, ids=lambda s: f"tp{s[0]}to{s[1]}")
@pytest.mark.parametrize("tokens,hit", [(64, 0), (45, 0), (45, 1)], ids=["full", "partial-last", "prefix-hit"])
def test_plan_moves_every_token_and_head_and_nothing_else(sizes, layouts, tps, tokens, hit) -> None:
    memory, src, dst, src_blocks, dst_blocks = _case(*sizes, *layouts, *tps, tokens, hit)
    fill(src, src_blocks, tokens)
    first, end = transfer_span(tokens, len(src_blocks), src.block_size, len(dst_blocks), dst.block_size)
    assert first == hit * dst.block_size and end == tokens
    apply(memory, plan(src, src_blocks, dst, dst_blocks, first, end))
    check(dst, dst_blocks, first, end)


def test_logical_tokens_reads_content_whatever_the_layout() -> None:
    memory, src, _, src_blocks, _ = _case(16, 8, "NHD", "HND", 2, 1, 45, 0)
    fill(src, src_blocks, 45)
    worker = src.workers[1]
    region = worker.regions[1]
    values = logical_tokens(
        memory[region.base :], region, block_shape(worker, region), BLOCKS, Side(worker, src_blocks, 0), 8, 45
    )
    assert values.shape == (37, 2, CHUNK)
    assert (values[3, 1] == content(1, 11, 3)).all()


def test_kernel_blocks_per_logical_block_are_expanded() -> None:
    memory, src, dst, src_blocks, dst_blocks = _case(32, 8, "HND", "NHD", 1, 2, 45, 1, ppl=2)
    fill(src, src_blocks, 45)
    first, end = transfer_span(45, len(src_blocks), 32, len(dst_blocks), 8)
    apply(memory, plan(src, src_blocks, dst, dst_blocks, first, end))
    check(dst, dst_blocks, first, end)


def _count(src_size, dst_size, src_layout, dst_layout, tokens=64) -> int:
    _, src, dst, src_blocks, dst_blocks = _case(src_size, dst_size, src_layout, dst_layout, 1, 1, tokens, 0)
    first, end = transfer_span(tokens, len(src_blocks), src_size, len(dst_blocks), dst_size)
    return sum(len(s) for s, _ in plan(src, src_blocks, dst, dst_blocks, first, end))


def test_descriptor_runs_are_as_long_as_both_layouts_allow() -> None:
    # Same shape: one descriptor per block and layer (the blocks are not adjacent).
    assert _count(16, 16, "HND", "HND") == LAYERS * 4
    # Token-major, size change: one run per small block.
    assert _count(32, 8, "NHD", "NHD") == LAYERS * 8
    assert _count(8, 32, "NHD", "NHD") == LAYERS * 8
    # Head-major, size change: one run per small block and head.
    assert _count(32, 8, "HND", "HND") == LAYERS * 8 * TOTAL_HEADS
    # Layout change: one chunk per descriptor.
    assert _count(16, 16, "HND", "NHD") == LAYERS * 64 * TOTAL_HEADS


def test_transfer_span_aligns_the_destination_tail() -> None:
    assert transfer_span(100, 2, 64, 7, 16) == (0, 100)
    assert transfer_span(100, 2, 64, 5, 16) == (32, 100)
    assert transfer_span(100, 7, 16, 1, 64) == (64, 100)
    assert transfer_span(0, 4, 16, 2, 16) == (32, 64)  # equal sizes: the source capacity will do
    with pytest.raises(PlanError, match="token count"):
        transfer_span(0, 2, 64, 7, 16)
    with pytest.raises(PlanError, match="at most 7"):
        transfer_span(100, 2, 64, 8, 16)
    with pytest.raises(PlanError, match="do not fit"):
        transfer_span(200, 2, 64, 4, 64)


def test_unknown_layouts_and_uneven_blocks_are_refused() -> None:
    memory = np.zeros(1 << 16, dtype=np.uint8)
    engine = Engine(memory, 0, 1, 16, "XYZ")
    with pytest.raises(PlanError, match="'XYZ' cannot be converted"):
        block_shape(engine.workers[0], engine.workers[0].regions[0])
    odd = WorkerLayout(0, 0, (RegionLayout("l", 0, 100, 100, 0),), 4, 1, 16, "HND", 4, 4, False)
    with pytest.raises(PlanError, match="do not hold 16 tokens x 4 heads"):
        block_shape(odd, odd.regions[0])


def test_conversion_refuses_engines_that_name_different_regions() -> None:
    memory = np.zeros(1 << 16, dtype=np.uint8)
    small, large = Engine(memory, 0, 1, 16, "HND"), Engine(memory, 0, 1, 32, "HND")
    check_convertible(small.workers, 1, large.workers, 1)
    worker = large.workers[0]
    renamed = replace(worker, regions=(replace(worker.regions[0], name="other"), *worker.regions[1:]))
    with pytest.raises(PlanError, match="different KV regions"):
        check_convertible(small.workers, 1, [renamed], 1)
    with pytest.raises(PlanError, match="different KV regions"):
        check_convertible(small.workers, 1, [replace(worker, regions=worker.regions[:1])], 1)


@pytest.mark.parametrize("sizes", RATIOS, ids=lambda s: f"{s[0]}to{s[1]}")
@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda s: f"{s[0]}-{s[1]}")
@pytest.mark.parametrize("tps", TPS, ids=lambda s: f"tp{s[0]}to{s[1]}")
def test_copy_tokens_in_one_pass_matches_the_oracle(sizes, layouts, tps) -> None:
    memory, src, dst, src_blocks, dst_blocks = _case(*sizes, *layouts, *tps, 45, 1)
    fill(src, src_blocks, 45)
    first, end = transfer_span(45, len(src_blocks), src.block_size, len(dst_blocks), dst.block_size)
    for rank in range(src.tp):
        for pairing in pairings(src.tp, dst.tp, rank):
            source = Side(src.workers[rank], src_blocks, 0)
            dest = Side(dst.workers[pairing.target_rank], dst_blocks, first)
            for src_region, dst_region in zip(source.worker.regions, dest.worker.regions, strict=True):
                head_first, head_end = shared_heads(
                    block_shape(source.worker, src_region), block_shape(dest.worker, dst_region)
                )
                copy_tokens(
                    source, memory[src_region.base :], src_region, dest, memory[dst_region.base :], dst_region,
                    first, end, head_first, head_end - head_first,
                )  # fmt: skip
    check(dst, dst_blocks, first, end)


@pytest.mark.parametrize("sizes", RATIOS, ids=lambda s: f"{s[0]}to{s[1]}")
@pytest.mark.parametrize("layouts", LAYOUT_PAIRS, ids=lambda s: f"{s[0]}-{s[1]}")
@pytest.mark.parametrize("tps", TPS, ids=lambda s: f"tp{s[0]}to{s[1]}")
def test_predicted_run_bytes_is_the_plans_typical_run(sizes, layouts, tps) -> None:
    """The staging decision uses the prediction instead of building the plan; it must be the
    plan's most common run length (blocks are not adjacent here, so nothing merges across them)."""
    _, src, dst, src_blocks, dst_blocks = _case(*sizes, *layouts, *tps, 64, 0)
    source, dest = Side(src.workers[0], src_blocks, 0), Side(dst.workers[0], dst_blocks, 0)
    shapes = [block_shape(side.worker, side.worker.regions[0]) for side in (source, dest)]
    src_descs, _ = run_descriptors(source, dest, 0, 64)
    lengths, counts = np.unique(src_descs[:, 1], return_counts=True)
    assert predicted_run_bytes(*shapes) == int(lengths[np.argmax(counts)])


# --- vLLM's CPU layout ("vec" ISA): K transposed inside each head --------------------------------

HEAD_SIZE, ELEMENT = 2, 2  # CHUNK = 2 * HEAD_SIZE * ELEMENT = 8 bytes (K row, V row)


def cpu_engine(memory: np.ndarray, offset: int, tp: int, block_size: int) -> Engine:
    engine = Engine(memory, offset, tp, block_size, "CPU_VEC_LBHNC")
    engine.workers = [replace(worker, head_size=HEAD_SIZE) for worker in engine.workers]
    return engine


def cpu_element(
    engine: Engine, rank: int, layer: int, blocks: list[int], first: int, token: int, head: int, plane: int, dim: int
) -> int:
    """Independent of the module: where element ``dim`` of K (plane 0) or V (plane 1) lives."""
    index, within = divmod(token - first, engine.block_size)
    n = engine.block_size
    head_base = (head - rank * engine.heads) * 2 * n * HEAD_SIZE * ELEMENT
    inner = dim * n + within if plane == 0 else n * HEAD_SIZE + within * HEAD_SIZE + dim
    block = engine.workers[rank].regions[layer].base + blocks[index] * engine.stride
    return block + head_base + inner * ELEMENT


def cpu_value(layer: int, token: int, head: int, plane: int, dim: int) -> np.ndarray:
    return np.array([(layer * 4096 + token * 16 + head * 4 + plane * 2 + dim) & 0xFFFF], dtype=np.uint16).view(np.uint8)


def cpu_cells(engine: Engine, tokens: range):
    for rank, layer, token in itertools.product(range(engine.tp), range(LAYERS), tokens):
        for head in range(rank * engine.heads, (rank + 1) * engine.heads):
            for plane, dim in itertools.product(range(2), range(HEAD_SIZE)):
                yield rank, layer, token, head, plane, dim


@pytest.mark.parametrize("sizes", [(16, 8), (8, 32), (16, 16)], ids=str)
@pytest.mark.parametrize("tps", [(1, 1), (1, 2), (2, 1)], ids=str)
def test_cpu_vec_layout_converts_block_sizes_element_by_element(sizes, tps) -> None:
    memory = np.full(1 << 20, POISON, dtype=np.uint8)
    src = cpu_engine(memory, 0, tps[0], sizes[0])
    dst = cpu_engine(memory, src.end, tps[1], sizes[1])
    tokens, hit = 45, 1
    src_blocks = [7, 2, 9, 0, 5, 11][: -(-tokens // sizes[0])]
    dst_blocks = [4, 10, 1, 8, 6, 0, 3][: -(-tokens // sizes[1]) - hit]
    for rank, layer, token, head, plane, dim in cpu_cells(src, range(tokens)):
        at = cpu_element(src, rank, layer, src_blocks, 0, token, head, plane, dim)
        memory[at : at + ELEMENT] = cpu_value(layer, token, head, plane, dim)
    first, end = transfer_span(tokens, len(src_blocks), sizes[0], len(dst_blocks), sizes[1])
    for rank in range(src.tp):
        for pairing in pairings(src.tp, dst.tp, rank):
            source = Side(src.workers[rank], src_blocks, 0)
            dest = Side(dst.workers[pairing.target_rank], dst_blocks, first)
            for src_region, dst_region in zip(source.worker.regions, dest.worker.regions, strict=True):
                src_shape, dst_shape = block_shape(source.worker, src_region), block_shape(dest.worker, dst_region)
                head_first, head_end = shared_heads(src_shape, dst_shape)
                copy_tokens(
                    source, memory[src_region.base :], src_region, dest, memory[dst_region.base :], dst_region,
                    first, end, head_first, head_end - head_first,
                )  # fmt: skip
                if src_region.name == "layer0":
                    values = logical_tokens(
                        memory[src_region.base :], src_region, src_shape, BLOCKS, source, first, end
                    )
                    assert values.shape == (end - first, src_shape.heads, CHUNK)
                    k_then_v = [cpu_value(0, first, src_shape.first_head, p, d) for p in range(2) for d in range(2)]
                    assert (values[0, 0] == np.concatenate(k_then_v)).all()
    for rank, layer, token, head, plane, dim in cpu_cells(dst, range(first, end)):
        at = cpu_element(dst, rank, layer, dst_blocks, first, token, head, plane, dim)
        assert (memory[at : at + ELEMENT] == cpu_value(layer, token, head, plane, dim)).all(), (token, head, plane, dim)


def test_cpu_vec_blocks_move_whole_between_equal_shapes_only() -> None:
    memory = np.zeros(1 << 20, dtype=np.uint8)
    a, b = cpu_engine(memory, 0, 1, 16), cpu_engine(memory, 1 << 19, 1, 16)
    src, dst = run_descriptors(Side(a.workers[0], [3, 5], 0), Side(b.workers[0], [1, 2], 0), 0, 20)
    assert src[:, 1].tolist() == [a.block_len] * 2 * LAYERS and dst[:, 1].tolist() == src[:, 1].tolist()
    c = cpu_engine(memory, 1 << 19, 1, 8)
    with pytest.raises(PlanError, match="only whole"):
        run_descriptors(Side(a.workers[0], [3, 5], 0), Side(c.workers[0], [1, 2, 4], 0), 0, 20)
    with pytest.raises(PlanError, match="needs the head size"):
        block_shape(replace(a.workers[0], head_size=0), a.workers[0].regions[0])
