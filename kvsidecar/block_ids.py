"""Block ids between vLLM's form (one sequence of ids per KV cache group) and the proto's
``GroupedBlockIds``: the one converter each way, shared by the shim and the sidecar. Pure: no
I/O, any thread."""

from __future__ import annotations

from collections.abc import Sequence

from kvsidecar.v1 import common_pb2

BlockIdsLike = Sequence[Sequence[int]]


def grouped(block_ids: BlockIdsLike | None) -> common_pb2.GroupedBlockIds:
    """vLLM-style block ids as the proto message (``block_ids_of`` is its inverse)."""
    message = common_pb2.GroupedBlockIds()
    if block_ids is not None:
        for group in block_ids:
            # Filled in place: a BlockIdList built first would be copied into the message again.
            message.groups.add().ids.extend(group)
    return message


def block_ids_of(message: common_pb2.GroupedBlockIds) -> tuple[tuple[int, ...], ...]:
    """The proto message as vLLM-style block ids, one tuple per KV cache group (``grouped``'s
    inverse). ``ids[:]`` is one copy in C: ``tuple()`` over the repeated field iterates in Python."""
    return tuple(tuple(group.ids[:]) for group in message.groups)
