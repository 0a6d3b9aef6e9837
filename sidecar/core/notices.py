"""Counting a request's NIXL completion notifications per local worker.

A transfer between TP groups sends each local worker one notification per peer worker that moved
its blocks; the sender says how many to expect in every notification. A request is complete when
every local worker of its engine has heard all it expects. Pure bookkeeping, no I/O; used by the
producer (pull: the consumer's READs ended) and the consumer (push: the producer's WRITEs ended)
on the event loop thread; ``side_for`` says which of the two a notification is for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from kvsidecar.v1 import common_pb2

Side = Literal["producer", "consumer"]


def side_for(mode: int, holds_push: bool) -> Side:
    """The one side of this sidecar a notification is for, from what it names (``TransferNotice.
    mode``): PULL, a consumer's READ from our engine ended -> the producer; PUSH, a producer's
    WRITE into it ended -> the consumer. An older sidecar's notice names no mode: the consumer if
    it holds a push for the request (``holds_push``), else the producer (their READs)."""
    if mode == common_pb2.TRANSFER_MODE_PULL:
        return "producer"
    if mode == common_pb2.TRANSFER_MODE_PUSH:
        return "consumer"
    return "consumer" if holds_push else "producer"


@dataclass
class NoticeTally:
    counted: dict[str, int] = field(default_factory=dict)  # agent name -> notifications counted
    expected: dict[str, int] = field(default_factory=dict)  # agent name -> notifications expected

    def record(self, agent_name: str, expected: int) -> None:
        self.counted[agent_name] = self.counted.get(agent_name, 0) + 1
        self.expected[agent_name] = max(1, expected)

    def complete(self, agent_names: Iterable[str]) -> bool:
        """Whether each of ``agent_names`` (the engine's local workers) heard all it expects."""
        return all(self.counted.get(name, 0) >= self.expected.get(name, 1) for name in agent_names)

    @property
    def total(self) -> int:
        return sum(self.counted.values())
