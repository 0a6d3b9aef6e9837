"""Tensor-parallel mapping: which target ranks an initiator rank exchanges with, which block
slices, and how many notifications each target rank counts. Pure logic."""

from __future__ import annotations

from sidecar.dataplane.plan.layout import WHOLE, Pairing, Slice


def pairings(initiator_tp: int, target_tp: int, initiator_rank: int, is_mla: bool = False) -> list[Pairing]:
    """Which target ranks one initiator rank exchanges with, and which block slices.

    Equal TP sizes pair rank r with rank r. With head-split KV and different TP sizes, the side
    with the larger TP holds 1/k of the heads of the other side's block: it moves its whole block
    to or from slice j of k of the other side's block. MLA KV is replicated on every rank, so the
    initiator exchanges whole blocks with one target rank.
    """
    if initiator_tp == target_tp:
        return [Pairing(initiator_rank, WHOLE, WHOLE)]
    if initiator_tp > target_tp:
        ratio = initiator_tp // target_tp
        target = initiator_rank // ratio
        if is_mla:
            return [Pairing(target, WHOLE, WHOLE)]
        return [Pairing(target, WHOLE, Slice(initiator_rank % ratio, ratio))]
    ratio = target_tp // initiator_tp
    if is_mla:
        return [Pairing(initiator_rank * ratio, WHOLE, WHOLE)]
    return [Pairing(initiator_rank * ratio + j, Slice(j, ratio), WHOLE) for j in range(ratio)]


def expected_notifications(initiator_tp: int, target_tp: int, target_rank: int, is_mla: bool = False) -> int:
    """How many transfers (each with one notification) reach ``target_rank`` for one request.

    MLA with a larger target TP leaves some target ranks without a transfer; the initiator sends
    them a bare notification so they count one as well.
    """
    if initiator_tp == target_tp:
        return 1  # rank r pairs with rank r (the common case: no per-request scan)
    count = sum(
        1
        for rank in range(initiator_tp)
        for pairing in pairings(initiator_tp, target_tp, rank, is_mla)
        if pairing.target_rank == target_rank
    )
    return max(count, 1)


def unpaired_targets(initiator_tp: int, target_tp: int, is_mla: bool) -> list[int]:
    """Target ranks no initiator transfers to (they get a bare notification from rank 0)."""
    if initiator_tp == target_tp:
        return []
    reached = {
        pairing.target_rank
        for rank in range(initiator_tp)
        for pairing in pairings(initiator_tp, target_tp, rank, is_mla)
    }
    return [rank for rank in range(target_tp) if rank not in reached]
