"""Descriptor math and TP mapping (pure)."""

import numpy as np
import pytest

from sidecar.dataplane.plan.blocks import check_block_ids, trim_to_tail
from sidecar.dataplane.plan.compatible import check_compatible
from sidecar.dataplane.plan.descriptors import descriptor_indices, physical_block_ids, view_descriptors
from sidecar.dataplane.plan.layout import PlanError, RegionLayout, Slice, WorkerLayout
from sidecar.dataplane.plan.tp import expected_notifications, pairings


def layout(
    tp_rank: int = 0,
    block_len: int = 1024,
    heads: int = 2,
    total: int = 2,
    num_blocks: int = 8,
    regions: int = 2,
    kv_layout: str = "LBHNC",
    ratio: int = 1,
    block_size: int = 16,
) -> WorkerLayout:
    return WorkerLayout(
        tp_rank=tp_rank,
        pp_rank=0,
        regions=tuple(RegionLayout(f"layer{r}", 1_000_000 * (r + 1), block_len, block_len, 0) for r in range(regions)),
        num_blocks=num_blocks,
        physical_per_logical=ratio,
        block_size=block_size,
        kv_layout=kv_layout,
        num_kv_heads=heads,
        total_num_kv_heads=total,
        is_mla=False,
    )


def test_view_descriptors_cover_every_block_region_major() -> None:
    worker = layout()
    whole = view_descriptors(worker, Slice())
    assert whole.shape == (16, 3)
    assert whole[0].tolist() == [1_000_000, 1024, 0]
    assert whole[9].tolist() == [2_000_000 + 1024, 1024, 0]
    half = view_descriptors(worker, Slice(1, 2))
    assert half[3].tolist() == [1_000_000 + 3 * 1024 + 512, 512, 0]


def test_descriptor_indices_select_blocks_in_every_region() -> None:
    worker = layout()
    indices = descriptor_indices(worker, ((1, 5, 2),))
    assert indices.tolist() == [1, 5, 2, 9, 13, 10]
    assert indices.dtype == np.int32


def test_logical_ids_expand_to_physical_ids() -> None:
    assert physical_block_ids([2, 0], 2).tolist() == [4, 5, 0, 1]
    worker = layout(ratio=2)
    assert descriptor_indices(worker, ((3,),)).tolist() == [6, 7, 14, 15]


def test_trim_to_tail_keeps_the_producers_last_blocks() -> None:
    assert trim_to_tail(((10, 11, 12, 13, 14),), ((500, 501),)) == ((13, 14),)
    assert trim_to_tail(((10, 11),), ((1, 2),)) == ((10, 11),)
    assert trim_to_tail(((10, 11),), ((),)) == ((),)
    with pytest.raises(PlanError, match="destination blocks"):
        trim_to_tail(((10,),), ((1, 2),))


def test_pairings_for_equal_and_heterogeneous_tp() -> None:
    assert pairings(2, 2, 1) == [pairings(2, 2, 1)[0]]
    assert pairings(2, 2, 1)[0].target_rank == 1
    # Initiator TP 2 reading a TP 1 target: each rank takes half of the target's block.
    first, second = pairings(2, 1, 0)[0], pairings(2, 1, 1)[0]
    assert (first.target_rank, first.target_slice) == (0, Slice(0, 2))
    assert (second.target_rank, second.target_slice) == (0, Slice(1, 2))
    # Initiator TP 1 and target TP 2: the whole block is assembled from both targets.
    both = pairings(1, 2, 0)
    assert [(p.target_rank, p.initiator_slice) for p in both] == [(0, Slice(0, 2)), (1, Slice(1, 2))]
    assert expected_notifications(2, 1, 0) == 2
    assert expected_notifications(1, 2, 1) == 1


def test_compatible_engines_pass_and_mismatches_say_why() -> None:
    check_compatible([layout()], 1, [layout()], 1)
    # TP 1 (2 heads, 1024-byte blocks) with TP 2 (1 head each, 512-byte blocks).
    check_compatible([layout(block_len=1024)], 1, [layout(0, 512, 1), layout(1, 512, 1)], 2)
    with pytest.raises(PlanError, match="block sizes differ"):
        check_compatible([layout()], 1, [layout(block_size=32)], 1)
    with pytest.raises(PlanError, match="KV layouts differ"):
        check_compatible([layout()], 1, [layout(kv_layout="NHD")], 1)
    with pytest.raises(PlanError, match="head-major"):
        check_compatible(
            [layout(kv_layout="NHD")], 1, [layout(0, 512, 1, kv_layout="NHD"), layout(1, 512, 1, kv_layout="NHD")], 2
        )
    with pytest.raises(PlanError, match="do not map"):
        check_compatible([layout(block_len=1024)], 1, [layout(0, 256, 1), layout(1, 256, 1)], 2)
    with pytest.raises(PlanError, match="different KV regions"):
        check_compatible([layout(regions=2)], 1, [layout(regions=3)], 1)


def test_block_id_checks() -> None:
    assert check_block_ids(((1, 2),), 1, 8, 1) is None
    assert "out of range" in (check_block_ids(((8,),), 1, 8, 1) or "")
    assert "repeat" in (check_block_ids(((1, 1),), 1, 8, 1) or "")
    assert "groups" in (check_block_ids(((1,), (2,)), 1, 8, 1) or "")


def _indices_region_by_region(worker: WorkerLayout, block_ids: tuple[tuple[int, ...], ...]) -> list[int]:
    """The rule spelled out: region after region, its group's (physical) ids + region * num_blocks."""
    per_group = [physical_block_ids(ids, worker.physical_per_logical).tolist() for ids in block_ids]
    found: list[int] = []
    for index, region in enumerate(worker.regions):
        if region.group_id < len(per_group):
            found.extend(block + index * worker.num_blocks for block in per_group[region.group_id])
    return found


def test_descriptor_indices_follow_the_region_rule_for_every_group_shape() -> None:
    """Hybrid models: regions of several KV cache groups, interleaved, requests naming fewer
    groups than the worker has, groups of different lengths, empty groups, 2 physical per logical."""
    rng = np.random.default_rng(7)
    for groups_of_regions in ([0] * 56, [0, 1] * 6, [0, 0, 1, 2, 1, 0], [1, 0]):
        for ratio in (1, 2):
            regions = tuple(RegionLayout(f"r{i}", 1 << 20, 64, 64, g) for i, g in enumerate(groups_of_regions))
            worker = WorkerLayout(0, 0, regions, 64 * ratio, ratio, 16, "NHD", 1, 1, False)
            num_groups = max(groups_of_regions) + 1
            for named in range(1, num_groups + 1):
                for lengths in ([3] * named, [0, *[2] * (named - 1)], list(range(1, named + 1))):
                    ids = tuple(tuple(int(b) for b in rng.permutation(64)[:n]) for n in lengths)
                    assert descriptor_indices(worker, ids).tolist() == _indices_region_by_region(worker, ids)


def test_equal_tp_sizes_notify_each_target_once_and_leave_none_unpaired() -> None:
    from sidecar.dataplane.plan.tp import unpaired_targets

    for tp in (1, 2, 4, 8):
        for is_mla in (False, True):
            counted = [
                sum(1 for rank in range(tp) for p in pairings(tp, tp, rank, is_mla) if p.target_rank == target)
                for target in range(tp)
            ]
            assert [expected_notifications(tp, tp, target, is_mla) for target in range(tp)] == counted == [1] * tp
            assert unpaired_targets(tp, tp, is_mla) == []


def test_descriptor_indices_refuse_bad_ids_alike_in_short_and_long_lists() -> None:
    """Short lists are checked in Python, long ones (a request of many blocks) in bulk: the same
    indices and the same refusals, naming the largest id out of range."""
    worker = layout(num_blocks=4096, regions=3)
    for count in (3, 63, 64, 1024):
        ids = tuple(range(10, 10 + count))
        assert descriptor_indices(worker, (ids,)).tolist() == _indices_region_by_region(worker, (ids,))
        past = 4096 + count
        with pytest.raises(PlanError, match=rf"^group 0: block id {past} is out of range \(the engine has 4096"):
            descriptor_indices(worker, ((*ids, past),))
        with pytest.raises(PlanError, match=r"^group 0: block ids repeat$"):
            descriptor_indices(worker, ((*ids, ids[-1]),))
