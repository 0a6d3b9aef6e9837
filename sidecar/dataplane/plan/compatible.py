"""Whether two engines' KV can be exchanged byte for byte (what the compatibility hash leaves
out: TP sizes, block size, layout, regions). Pure logic; raises ``PlanError`` with the reason."""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.dataplane.plan.layout import HEAD_MAJOR_LAYOUTS, PlanError, WorkerLayout, is_head_major
from sidecar.dataplane.plan.tp import pairings


def check_compatible(
    initiator: Sequence[WorkerLayout],
    initiator_tp: int,
    target: Sequence[WorkerLayout],
    target_tp: int,
    names: tuple[str, str] = ("here", "on the peer"),
) -> None:
    """Raise PlanError unless the two engines' KV can be exchanged byte for byte.

    Checks what the compatibility hash deliberately leaves out (as vLLM does): TP sizes, block
    size, layout, region names and per-region block lengths.
    """
    mine, theirs = first_workers(initiator, target)
    here, there = names
    if initiator_tp % target_tp and target_tp % initiator_tp:
        raise PlanError(f"TP sizes {initiator_tp} and {target_tp} do not divide one another")
    check_kv_elements(mine, theirs, names)
    if mine.block_size != theirs.block_size:
        raise PlanError(
            f"block sizes differ ({mine.block_size} tokens {here} vs {theirs.block_size} {there}) and the layouts "
            f"({mine.kv_layout!r}, {theirs.kv_layout!r}) are not both convertible (HND/LBHNC, NHD/LBNHC)"
        )
    if mine.physical_per_logical != theirs.physical_per_logical:
        raise PlanError(
            f"kernel blocks per logical block differ ({mine.physical_per_logical} vs {theirs.physical_per_logical})"
        )
    if mine.kv_layout != theirs.kv_layout:
        raise PlanError(
            f"KV layouts differ ({mine.kv_layout!r} {here} vs {theirs.kv_layout!r} {there}) and are not both "
            "convertible (HND/LBHNC, NHD/LBNHC)"
        )
    if mine.is_mla != theirs.is_mla:
        raise PlanError("one engine uses MLA and the other does not")
    if initiator_tp != target_tp and not mine.is_mla:
        if not is_head_major(mine.kv_layout):
            raise PlanError(
                f"heterogeneous TP ({initiator_tp} vs {target_tp}) needs a head-major KV layout "
                f"({', '.join(sorted(HEAD_MAJOR_LAYOUTS))}), not {mine.kv_layout!r}"
            )
        for layout, tp in ((mine, initiator_tp), (theirs, target_tp)):
            if layout.num_kv_heads * tp != layout.total_num_kv_heads:
                raise PlanError(
                    f"heterogeneous TP needs KV heads split evenly: {layout.num_kv_heads} heads x TP {tp} "
                    f"!= {layout.total_num_kv_heads} (replicated heads are not supported)"
                )
    check_region_names(mine, theirs)
    for worker in initiator:
        for pairing in pairings(initiator_tp, target_tp, worker.tp_rank, mine.is_mla):
            other = next((w for w in target if w.tp_rank == pairing.target_rank and w.pp_rank == worker.pp_rank), None)
            if other is None:
                raise PlanError(f"target rank tp{pairing.target_rank}/pp{worker.pp_rank} is not registered")
            for region_a, region_b in zip(worker.regions, other.regions, strict=True):
                part_a = region_a.block_len // pairing.initiator_slice.count
                part_b = region_b.block_len // pairing.target_slice.count
                if part_a != part_b or region_a.block_len % pairing.initiator_slice.count:
                    raise PlanError(
                        f"region {region_a.name!r}: {region_a.block_len}-byte blocks (TP {initiator_tp}) do not "
                        f"map onto {region_b.block_len}-byte blocks (TP {target_tp})"
                    )


def first_workers(
    initiator: Sequence[WorkerLayout], target: Sequence[WorkerLayout]
) -> tuple[WorkerLayout, WorkerLayout]:
    """Each engine's first worker (their geometry is the engine's); PlanError if one has none."""
    if not initiator or not target:
        raise PlanError("an engine has no registered workers")
    return initiator[0], target[0]


def check_kv_elements(mine: WorkerLayout, theirs: WorkerLayout, names: tuple[str, str]) -> None:
    """What no plan converts: the KV element type and the head size (each side's name in ``names``)."""
    here, there = names
    for what, a, b in (("dtype", mine.dtype, theirs.dtype), ("head size", mine.head_size, theirs.head_size)):
        if a and b and a != b:
            raise PlanError(f"KV {what} differs: {a} {here} vs {b} {there}; it cannot be converted")


def check_region_names(mine: WorkerLayout, theirs: WorkerLayout) -> None:
    """Both engines name the same KV regions in the same order (region i moves to region i)."""
    names_mine = [region.name for region in mine.regions]
    names_theirs = [region.name for region in theirs.regions]
    if names_mine != names_theirs:
        raise PlanError(
            f"the engines name different KV regions ({len(names_mine)} vs {len(names_theirs)}; first: "
            f"{names_mine[:1]} vs {names_theirs[:1]})"
        )
