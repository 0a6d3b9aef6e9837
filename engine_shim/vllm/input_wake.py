"""Waking an engine's idle workers when something reaches its EngineCore.

In a step that computes nothing while transfers are outstanding, a worker waits for the sidecar's
next event for up to ``idle_wait`` (``WorkerSide._wait_for_event``): vLLM's engine loop would
otherwise step again and again, and on a small box those empty steps take the cores the sidecars
need for the very transfer the engine waits for. A request (or an abort, a utility call, a
shutdown) that reaches the EngineCore meanwhile must not wait for that bound. So the EngineCore's
input queue is wrapped: each item put on it also sends one datagram to each local worker of the
engine, and each worker's listener thread ends its wait.

The datagrams go to abstract Unix sockets (Linux; no file to clean up, scoped to the network
namespace the engine's processes share) named after the engine id and the worker's ranks. Sending
never blocks and never fails the caller: with no listener (the worker not up yet, another OS) or a
full socket buffer the wake is lost, and the worker's wait ends at its bound as before.

Threads: in the EngineCore process, whichever thread puts on the input queue (vLLM's input thread,
its shutdown path) calls ``InputWaker.wake``. In a worker process, ``WakeListener``'s daemon thread
blocks on its socket and calls ``on_wake`` (which only puts on the worker's inbox).
"""

from __future__ import annotations

import hashlib
import queue
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, cast

from vllm.logger import init_logger

logger = init_logger("vllm.kvsidecar.input_wake")

# The kernel's limit on an abstract name, less the leading NUL.
_MAX_NAME = 107


def socket_name(engine_id: str, dp_rank: int, tp_rank: int, pp_rank: int) -> bytes:
    """The abstract socket name of one worker of one engine (pure). The data-parallel rank is part
    of it because vLLM's data-parallel engines may share one ``engine_id``."""
    ranks = f"dp{dp_rank}-pp{pp_rank}-tp{tp_rank}"
    name = f"kvsidecar-wake/{engine_id}/{ranks}".encode()
    if len(name) > _MAX_NAME:
        name = f"kvsidecar-wake/{hashlib.sha256(engine_id.encode()).hexdigest()[:32]}/{ranks}".encode()
    return b"\0" + name


class WakeListener:
    """A worker's end: calls ``on_wake`` for every datagram sent to its name, from a daemon thread."""

    def __init__(self, name: bytes, on_wake: Callable[[], None]) -> None:
        self.name = name
        self._on_wake = on_wake
        self._socket: socket.socket | None = None

    def start(self) -> bool:
        """Bind and start listening; False (and a log line) where that is not possible, e.g. the
        name is taken by another engine's worker with the same id and ranks."""
        if not sys.platform.startswith("linux"):
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(self.name)
        except OSError as exc:
            sock.close()
            logger.warning(
                "SidecarConnector: idle steps end only at idle_wait, new requests cannot wake them (%s: %s)",
                self.name[1:].decode(errors="replace"),
                exc,
            )
            return False
        self._socket = sock
        threading.Thread(target=self._listen, name="kvsidecar-shim-wake", daemon=True).start()
        logger.info("SidecarConnector: this worker's idle steps wake on input to the EngineCore")
        return True

    def _listen(self) -> None:
        sock = self._socket
        assert sock is not None
        while True:
            try:
                sock.recv(16)
            except OSError:
                return  # closed
            self._on_wake()

    def close(self) -> None:
        sock, self._socket = self._socket, None
        if sock is not None:
            # shutdown() ends the blocked recv(); close() alone would not wake it.
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class InputWaker:
    """The EngineCore's end: one datagram to each listed worker per ``wake()``."""

    def __init__(self, names: Iterable[bytes]) -> None:
        self.names = tuple(names)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)

    def wake(self) -> None:
        for name in self.names:
            try:
                self._socket.sendto(b"w", name)
            except OSError:
                pass  # no listener yet, or its buffer is full: it is already awake

    def close(self) -> None:
        self._socket.close()


class _WakingQueue(queue.Queue[Any]):
    """vLLM's EngineCore input queue, which also wakes the engine's idle workers on every put."""

    _kvsidecar_wakers: list[InputWaker]

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        for waker in self._kvsidecar_wakers:
            waker.wake()


def engine_input_queue() -> queue.Queue[Any] | None:
    """The input queue of the vLLM EngineCore being constructed on this thread's stack, if any.

    The scheduler role of a connector is built inside ``EngineCore.__init__``, after
    ``EngineCoreProc`` created its input queue; vLLM passes the connector no reference to the engine,
    so the queue is found on the caller frames. None for an in-process engine (no input queue)."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        candidate = getattr(owner, "input_queue", None)
        if isinstance(candidate, queue.Queue) and "EngineCore" in type(owner).__name__:
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None


def wake_workers_on_input(input_queue: queue.Queue[Any], waker: InputWaker) -> None:
    """Make every later put on ``input_queue`` (``put_nowait`` included) call ``waker.wake()``."""
    if type(input_queue) is queue.Queue:
        # Swapping the class of vLLM's own instance, not replacing it: its threads already hold it.
        input_queue.__class__ = _WakingQueue
        cast(_WakingQueue, input_queue)._kvsidecar_wakers = []
    if not isinstance(input_queue, _WakingQueue):
        raise TypeError(f"the engine's input queue is a {type(input_queue).__name__}, not a queue.Queue")
    input_queue._kvsidecar_wakers.append(waker)
