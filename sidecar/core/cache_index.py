"""Blocks that engines hold after a finished request so a peer can reuse them (multi-turn, D->P).
Pure logic. Expiry is the producer lease's job (a held request is a producer request with the
hold TTL as its lease); this index answers "what is held for this conversation, this request or
this prompt prefix", and "which holds of an engine go first when its share of blocks is used up"
(oldest first).

A hold carries the content hashes of its leading full blocks (vLLM's prefix-cache block hashes);
a query by prefix counts how many leading blocks of the asker's prompt have the same hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from sidecar.dataplane.plan.layout import BlockIds

HeldKey = tuple[str, str]  # (engine_id, request_id)
_Name = TypeVar("_Name", str, bytes)


@dataclass(frozen=True)
class HeldBlocks:
    engine_id: str
    request_id: str
    conversation_id: str
    block_ids: BlockIds
    num_tokens: int
    created: float
    block_hashes: tuple[bytes, ...] = ()

    @property
    def num_blocks(self) -> int:
        return sum(len(group) for group in self.block_ids)


def matched_prefix(held: Sequence[bytes], asked: Sequence[bytes]) -> int:
    """How many leading hashes two sequences share."""
    count = 0
    for mine, theirs in zip(held, asked, strict=False):
        if mine != theirs:
            break
        count += 1
    return count


@dataclass(frozen=True)
class Match:
    entry: HeldBlocks
    matched_blocks: int


class CacheIndex:
    """Held blocks by (engine, request), by conversation and by first block hash."""

    def __init__(self) -> None:
        self._entries: dict[HeldKey, HeldBlocks] = {}  # insertion order = age
        self._by_conversation: dict[str, list[HeldKey]] = {}
        self._by_first_hash: dict[bytes, list[HeldKey]] = {}
        self._blocks_of_engine: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_blocks(self) -> int:
        return sum(self._blocks_of_engine.values())

    def blocks_of_engine(self, engine_id: str) -> int:
        return self._blocks_of_engine.get(engine_id, 0)

    def hold(self, entry: HeldBlocks) -> None:
        key = (entry.engine_id, entry.request_id)
        self.remove(key)
        self._entries[key] = entry
        self._blocks_of_engine[entry.engine_id] = self.blocks_of_engine(entry.engine_id) + entry.num_blocks
        if entry.conversation_id:
            self._by_conversation.setdefault(entry.conversation_id, []).append(key)
        if entry.block_hashes:
            self._by_first_hash.setdefault(entry.block_hashes[0], []).append(key)

    def get(self, key: HeldKey) -> HeldBlocks | None:
        return self._entries.get(key)

    def remove(self, key: HeldKey) -> HeldBlocks | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        left = self.blocks_of_engine(entry.engine_id) - entry.num_blocks
        if left > 0:
            self._blocks_of_engine[entry.engine_id] = left
        else:
            self._blocks_of_engine.pop(entry.engine_id, None)
        if entry.conversation_id:
            _unlist(self._by_conversation, entry.conversation_id, key)
        if entry.block_hashes:
            _unlist(self._by_first_hash, entry.block_hashes[0], key)
        return entry

    def query(
        self,
        conversation_id: str = "",
        request_id: str = "",
        engine_id: str = "",
        block_hashes: Sequence[bytes] = (),
    ) -> list[Match]:
        """Entries for a conversation, else a request id, else a prompt prefix (``block_hashes``
        alone: only entries whose first block matches). Each says how many leading blocks match
        ``block_hashes``; most matched first, then newest first."""
        if conversation_id:
            keys = list(self._by_conversation.get(conversation_id, []))
        elif request_id:
            keys = [key for key in self._entries if key[1] == request_id]
        elif block_hashes:
            keys = list(self._by_first_hash.get(block_hashes[0], []))
        else:
            keys = []
        found = [
            Match(entry, matched_prefix(entry.block_hashes, block_hashes))
            for entry in (self._entries[key] for key in keys if not engine_id or key[0] == engine_id)
        ]
        return sorted(found, key=lambda match: (match.matched_blocks, match.entry.created), reverse=True)

    def oldest_of_engine(self, engine_id: str) -> list[HeldBlocks]:
        """The engine's holds, oldest first (the order in which a full share releases them)."""
        return [entry for key, entry in self._entries.items() if key[0] == engine_id]

    def keys_of_engine(self, engine_id: str) -> list[HeldKey]:
        return [key for key in self._entries if key[0] == engine_id]


def _unlist(index: dict[_Name, list[HeldKey]], name: _Name, key: HeldKey) -> None:
    keys = index.get(name, [])
    if key in keys:
        keys.remove(key)
    if not keys:
        index.pop(name, None)
