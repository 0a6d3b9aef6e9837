"""Blocks that engines hold after a finished request so a peer can reuse them (multi-turn, D->P).
Pure logic. Expiry is the producer lease's job (a held request is a producer request with the
hold TTL as its lease); this index only answers "what is held for this conversation".
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.dataplane.plan.layout import BlockIds

HeldKey = tuple[str, str]  # (engine_id, request_id)


@dataclass(frozen=True)
class HeldBlocks:
    engine_id: str
    request_id: str
    conversation_id: str
    block_ids: BlockIds
    num_tokens: int
    created: float


class CacheIndex:
    """Held blocks by (engine, request) and by conversation."""

    def __init__(self) -> None:
        self._entries: dict[HeldKey, HeldBlocks] = {}
        self._by_conversation: dict[str, list[HeldKey]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def hold(self, entry: HeldBlocks) -> None:
        key = (entry.engine_id, entry.request_id)
        self.remove(key)
        self._entries[key] = entry
        if entry.conversation_id:
            self._by_conversation.setdefault(entry.conversation_id, []).append(key)

    def get(self, key: HeldKey) -> HeldBlocks | None:
        return self._entries.get(key)

    def remove(self, key: HeldKey) -> HeldBlocks | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        if entry.conversation_id:
            keys = self._by_conversation.get(entry.conversation_id, [])
            if key in keys:
                keys.remove(key)
            if not keys:
                self._by_conversation.pop(entry.conversation_id, None)
        return entry

    def query(self, conversation_id: str = "", request_id: str = "", engine_id: str = "") -> list[HeldBlocks]:
        """Entries for a conversation (or, without one, a request id), newest first."""
        if conversation_id:
            keys = list(self._by_conversation.get(conversation_id, []))
        else:
            keys = [key for key in self._entries if key[1] == request_id]
        found = [self._entries[key] for key in keys if not engine_id or key[0] == engine_id]
        return sorted(found, key=lambda entry: entry.created, reverse=True)

    def keys_of_engine(self, engine_id: str) -> list[HeldKey]:
        return [key for key in self._entries if key[0] == engine_id]
