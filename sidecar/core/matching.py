"""Push-mode matching of a producer's finished blocks with a consumer's registration, in either
arrival order. Pure logic: no I/O.

Match keys, in order (vLLM NixlPushConnector semantics, reference vllm_nixl.md section 4.4):
1. the router's ``transfer_id`` when both sides carry one;
2. the producer's exact request id, when the consumer knew it;
3. vLLM's *base* request id: the id with its trailing random ``-xxxxxxxx`` suffix removed. The
   proxy sends the same X-Request-Id to both legs and each engine appends its own suffix.
A registration and a submission only match within the same producer engine.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Generic, TypeVar

_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


_TOKEN_PRIORITY = {"tid": 0, "rid": 1, "base": 2}

# What the consumer's registration carries for the side that starts the push (the producer: the
# PushReg request and its destination blocks); matching never looks inside it.
Order = TypeVar("Order")


@functools.lru_cache(maxsize=8192)
def base_request_id(request_id: str) -> str:
    """vLLM's request id without its trailing random 8-hex suffix (cached: one request's id is
    asked for several times, by matching and by the trace index)."""
    return _RANDOM_SUFFIX.sub("", request_id)


@dataclass
class Submission:
    """Producer side: a finished request's blocks, waiting for a registration."""

    engine_id: str
    request_id: str
    transfer_id: str

    @property
    def key(self) -> tuple[str, str]:
        """The producer request: (engine_id, request_id)."""
        return (self.engine_id, self.request_id)


@dataclass
class Registration(Generic[Order]):
    """Consumer side: blocks registered for a producer's request, waiting for the blocks."""

    engine_id: str  # the producer engine the consumer addressed
    decode_engine_id: str
    request_id: str  # the consumer's request id
    transfer_id: str
    prefill_request_id: str  # empty when the consumer does not know it
    order: Order = field(compare=False)
    identity: str = field(default="", compare=False)  # the registering peer's certificate (mTLS)

    @property
    def key(self) -> tuple[str, str]:
        return (self.decode_engine_id, self.request_id)


def _matches(sub: Submission, reg: Registration[Order]) -> bool:
    if sub.engine_id != reg.engine_id:
        return False
    if sub.transfer_id and reg.transfer_id:
        return sub.transfer_id == reg.transfer_id
    if reg.prefill_request_id:
        return reg.prefill_request_id == sub.request_id
    return base_request_id(sub.request_id) == base_request_id(reg.request_id)


class PushMatcher(Generic[Order]):
    """Holds unmatched submissions and registrations; adding one side returns its match."""

    def __init__(self) -> None:
        self._submissions: dict[tuple[str, str], Submission] = {}
        self._registrations: dict[tuple[str, str], Registration[Order]] = {}
        # Candidate indexes: (producer engine, match token) -> keys. A token is a transfer id,
        # a producer request id, or a base request id; _matches() makes the final decision.
        self._sub_index: dict[tuple[str, str], set[tuple[str, str]]] = {}
        self._reg_index: dict[tuple[str, str], set[tuple[str, str]]] = {}

    @property
    def pending_registrations(self) -> int:
        return len(self._registrations)

    @property
    def unmatched_submissions(self) -> int:
        return len(self._submissions)

    def registrations(self) -> list[Registration[Order]]:
        return list(self._registrations.values())

    def registration_matching(self, sub: Submission) -> Registration[Order] | None:
        """The stored registration ``sub`` would match, left in place."""
        for reg_key in self._candidates(self._reg_index, sub.engine_id, self._sub_tokens(sub)):
            reg = self._registrations[reg_key]
            if _matches(sub, reg):
                return reg
        return None

    def submission_matching(self, reg: Registration[Order]) -> Submission | None:
        """The stored submission ``reg`` would match, left in place."""
        for sub_key in self._candidates(self._sub_index, reg.engine_id, self._reg_tokens(reg)):
            sub = self._submissions[sub_key]
            if _matches(sub, reg):
                return sub
        return None

    def add_submission(self, sub: Submission) -> Registration[Order] | None:
        """Offer a producer's blocks; returns the registration they match (removed), or stores them."""
        reg = self.registration_matching(sub)
        if reg is not None:
            self.remove_registration(reg.key)
            return reg
        key = (sub.engine_id, sub.request_id)
        self.remove_submission(*key)
        self._submissions[key] = sub
        for token in self._sub_tokens(sub):
            self._sub_index.setdefault((sub.engine_id, token), set()).add(key)
        return None

    def add_registration(self, reg: Registration[Order]) -> Submission | None:
        """Offer a consumer's registration; returns the submission it matches (removed), or stores it.

        A repeated registration (same consumer engine and request id) replaces the stored one, so
        duplicates are idempotent.
        """
        sub = self.submission_matching(reg)
        if sub is not None:
            self.remove_submission(sub.engine_id, sub.request_id)
            return sub
        self.remove_registration(reg.key)
        self._registrations[reg.key] = reg
        for token in self._reg_tokens(reg):
            self._reg_index.setdefault((reg.engine_id, token), set()).add(reg.key)
        return None

    def find_registration(self, key: tuple[str, str]) -> Registration[Order] | None:
        return self._registrations.get(key)

    def find_registration_for(self, engine_id: str, transfer_id: str, request_id: str) -> Registration[Order] | None:
        """A stored registration addressed to ``engine_id`` by transfer id or consumer request id."""
        for reg in self._registrations.values():
            if reg.engine_id != engine_id:
                continue
            if (transfer_id and reg.transfer_id == transfer_id) or (request_id and reg.request_id == request_id):
                return reg
        return None

    def remove_registration(self, key: tuple[str, str]) -> Registration[Order] | None:
        reg = self._registrations.pop(key, None)
        if reg is not None:
            for token in self._reg_tokens(reg):
                self._discard(self._reg_index, (reg.engine_id, token), key)
        return reg

    def remove_submission(self, engine_id: str, request_id: str) -> Submission | None:
        key = (engine_id, request_id)
        sub = self._submissions.pop(key, None)
        if sub is not None:
            for token in self._sub_tokens(sub):
                self._discard(self._sub_index, (engine_id, token), key)
        return sub

    @staticmethod
    def _sub_tokens(sub: Submission) -> set[str]:
        tokens = {"rid:" + sub.request_id, "base:" + base_request_id(sub.request_id)}
        if sub.transfer_id:
            tokens.add("tid:" + sub.transfer_id)
        return tokens

    @staticmethod
    def _reg_tokens(reg: Registration[Order]) -> set[str]:
        tokens = {"base:" + base_request_id(reg.request_id)}
        if reg.transfer_id:
            tokens.add("tid:" + reg.transfer_id)
        if reg.prefill_request_id:
            tokens.add("rid:" + reg.prefill_request_id)
        return tokens

    @staticmethod
    def _candidates(
        index: dict[tuple[str, str], set[tuple[str, str]]], engine_id: str, tokens: set[str]
    ) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        if not index:
            return found  # nothing waits on that side (one side usually comes first)
        # Transfer ids first, then exact producer ids, then base ids.
        for token in sorted(tokens, key=lambda token: _TOKEN_PRIORITY[token.split(":", 1)[0]]):
            found.extend(sorted(index.get((engine_id, token), ())))
        return found

    @staticmethod
    def _discard(
        index: dict[tuple[str, str], set[tuple[str, str]]], slot: tuple[str, str], key: tuple[str, str]
    ) -> None:
        keys = index.get(slot)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del index[slot]
