"""Block-id lists: validating them against an engine, and trimming to a consumer's tail. Pure logic."""

from __future__ import annotations

from sidecar.dataplane.plan.layout import BlockIds, PlanError


def trim_to_tail(source: BlockIds, destination: BlockIds) -> BlockIds:
    """The tail of ``source`` matching ``destination``'s length, per group.

    A consumer with a partial prefix-cache hit allocates blocks only for the uncomputed tail, so
    only the producer's last blocks move (vLLM's _apply_prefix_caching). A destination longer
    than its source is an error.
    """
    if len(source) != len(destination):
        raise PlanError(f"the two sides list {len(source)} and {len(destination)} KV cache groups")
    trimmed = []
    for group, (src, dst) in enumerate(zip(source, destination, strict=True)):
        if len(dst) > len(src):
            raise PlanError(f"group {group}: {len(dst)} destination blocks but only {len(src)} source blocks")
        trimmed.append(tuple(src[len(src) - len(dst) :]) if dst else ())
    return tuple(trimmed)


def check_block_ids(block_ids: BlockIds, num_groups: int, num_blocks: int, physical_per_logical: int) -> str | None:
    """A problem with ``block_ids`` for an engine, or None. Used to validate requests."""
    if len(block_ids) > num_groups:
        return f"{len(block_ids)} KV cache groups given, the engine has {num_groups}"
    limit = num_blocks // max(physical_per_logical, 1)
    for group, ids in enumerate(block_ids):
        for block in ids:
            if block >= limit:
                return f"group {group}: block id {block} is out of range (the engine has {limit} blocks)"
        if len(set(ids)) != len(ids):
            return f"group {group}: block ids repeat"
    return None


def foreign_block_ids(named: BlockIds, submitted: BlockIds) -> str | None:
    """Why ``named`` (a consumer's idea of a producer request's blocks) is not a subset of the
    blocks the producer ``submitted`` for it, group by group, or None."""
    if len(named) > len(submitted):
        return f"{len(named)} KV cache groups named, {len(submitted)} submitted"
    for group, (ids, mine) in enumerate(zip(named, submitted, strict=False)):
        outside = set(ids).difference(mine)
        if outside:
            return f"group {group}: block {min(outside)} was not submitted for this request"
    return None
