"""engine_shim.vllm.input_wake: the names, the EngineCore's queue found and wrapped, datagrams that
reach a listener (real abstract Unix sockets) and never fail the sender."""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest

from engine_shim.vllm.input_wake import (
    InputWaker,
    WakeListener,
    engine_input_queue,
    socket_name,
    wake_workers_on_input,
)


def test_names_differ_per_engine_and_rank_and_fit_the_kernel_limit() -> None:
    names = {socket_name(e, dp, tp, pp) for e in ("P", "D") for dp in (0, 1) for tp in (0, 1) for pp in (0, 1)}
    assert len(names) == 16
    assert all(name.startswith(b"\0") for name in names)
    long_a, long_b = socket_name("a" * 300, 0, 0, 0), socket_name("b" * 300, 0, 0, 0)
    assert long_a != long_b and len(long_a) <= 108 and len(long_b) <= 108


def test_a_put_on_the_wrapped_queue_wakes_every_listener_of_the_engine() -> None:
    woken = [threading.Event(), threading.Event()]
    listeners = [WakeListener(socket_name("wake-test", 0, tp, 0), woken[tp].set) for tp in (0, 1)]
    assert all(listener.start() for listener in listeners)
    try:
        input_queue: queue.Queue[Any] = queue.Queue()
        waker = InputWaker(socket_name("wake-test", 0, tp, 0) for tp in (0, 1))
        wake_workers_on_input(input_queue, waker)
        input_queue.put_nowait("request")
        assert all(event.wait(10.0) for event in woken)
        assert input_queue.get_nowait() == "request"
        waker.close()
    finally:
        for listener in listeners:
            listener.close()


def test_a_second_worker_with_the_same_name_is_refused_and_says_so() -> None:
    first = WakeListener(socket_name("wake-dup", 0, 0, 0), lambda: None)
    second = WakeListener(socket_name("wake-dup", 0, 0, 0), lambda: None)
    try:
        assert first.start()
        assert not second.start()  # falls back to the idle_wait bound, never raises
    finally:
        first.close()
        second.close()


def test_waking_nobody_never_fails_the_engine_core() -> None:
    waker = InputWaker([socket_name("nobody-listens", 0, 0, 0)])
    input_queue: queue.Queue[Any] = queue.Queue()
    wake_workers_on_input(input_queue, waker)
    input_queue.put("request")  # no listener: the datagram is dropped
    waker.close()
    input_queue.put("after close")  # a closed waker is ignored too
    assert input_queue.qsize() == 2


def test_only_a_plain_queue_is_wrapped() -> None:
    with pytest.raises(TypeError, match="PriorityQueue"):
        wake_workers_on_input(queue.PriorityQueue(), InputWaker([]))


class EngineCoreProcStandIn:
    """Shaped as vLLM's EngineCoreProc where it matters: it creates its input queue, then builds
    the scheduler (and so the connector) from its constructor."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.found = _build_scheduler()


def _build_scheduler() -> queue.Queue[Any] | None:
    return engine_input_queue()


def test_the_engine_core_input_queue_is_found_from_the_connector_constructor() -> None:
    engine = EngineCoreProcStandIn()
    assert engine.found is engine.input_queue
    assert _build_scheduler() is None  # no EngineCore on the stack: an in-process engine
