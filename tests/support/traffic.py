"""A stream of requests between simulated engines that react to their sidecar as the vLLM shim
does, and the accounting of every request's outcome: for the restart and overload tests and
``bench.overload``.

``ShimEngine`` is a simulated engine (``engine_shim.simulated``: one worker, KV in shared memory,
registered with a real sidecar) in this process. Like ``engine_shim/vllm/worker.py`` it fails
every request it waits on when its event stream closes (vLLM recomputes them) and a supervisor
thread registers it again, with backoff, until a sidecar serves the socket; like
``engine_shim/vllm/scheduler.py`` it fails a request at once when a call is refused.

``move`` runs one request (pull, push, or a multi-turn hold read back) and returns its
``Outcome``; a request is

- ``moved``: the KV arrived and every byte equals the sender's;
- ``refused``: a call was answered with an error status (the engine recomputes);
- ``failed``: the request was accepted and later reported failed (LOAD_FAILED, or the event
  stream closed: the engine recomputes);
- ``corrupt``: reported FINISHED_RECEIVING with bytes that differ from the sender's;
- ``lost``: an engine waited on an answer that never came within the bound.

A graceful restart or an overload may refuse or fail requests; it may never lose or corrupt one.
Each request uses its own ``Slot`` of blocks on each engine; the sender's slot holds fixed content,
the receiver's is zeroed before the request, so a request that did not move reads as ``corrupt``.

Threads: each caller of ``move`` drives its own slot; event streams and the supervisor run on
their own threads and only resolve ``_Waiter``s under a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from engine_shim.client import EventWatcher, SidecarClient, remote
from engine_shim.memory import KvLayout, SharedBuffer, kv_registration
from engine_shim.simulated import ROLES
from kvsidecar.v1 import common_pb2, engine_pb2

TERMINAL = {
    engine_pb2.FINISHED_SENDING: "FINISHED_SENDING",
    engine_pb2.FINISHED_RECEIVING: "FINISHED_RECEIVING",
    engine_pb2.LOAD_FAILED: "LOAD_FAILED",
    engine_pb2.LEASE_EXPIRED: "LEASE_EXPIRED",
}
STREAM_CLOSED = "STREAM_CLOSED"


class _Waiter:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.kind = ""
        self.reason = ""
        self.sidecar_s = 0.0  # the sidecar's own account: its call -> this event (Event.duration_ms)

    def resolve(self, kind: str, reason: str, sidecar_s: float = 0.0) -> None:
        if not self.done.is_set():
            self.kind, self.reason, self.sidecar_s = kind, reason, sidecar_s
            self.done.set()


class ShimEngine:
    """One simulated engine worker that reconnects to a restarted sidecar (see the module doc)."""

    def __init__(
        self,
        socket: Path,
        engine_id: str,
        role: str = "both",
        *,
        layers: int = 2,
        blocks: int = 64,
        block_len: int = 4096,
        timeout: float = 10.0,
    ) -> None:
        self.engine_id = engine_id
        self.role = role
        self.layout = KvLayout(layers, blocks, block_len, block_size=16, kv_layout="LBHNC", num_kv_heads=1)
        self.buffer = SharedBuffer(self.layout.total_bytes, populate=True)
        self.client = SidecarClient(socket, timeout=timeout)
        self._socket = socket
        self._lock = threading.Lock()
        self._waiting: dict[str, _Waiter] = {}
        self._watcher: EventWatcher | None = None
        self.generation = 0
        self.peer_address = ""
        self.connected = threading.Event()
        self.connected_at: list[float] = []  # monotonic time of each registration
        self.stream_losses = 0
        self._stopping = threading.Event()
        self._need_connect = threading.Event()
        try:
            self._connect(timeout)
        except BaseException:
            self.buffer.close()
            raise
        self._supervisor = threading.Thread(target=self._supervise, name=f"shim-{engine_id}", daemon=True)
        self._supervisor.start()

    # --- connection (constructor, then the supervisor thread) ---------------------------------

    def _connect(self, timeout: float) -> None:
        response = self.client.register_worker(
            kv_registration(self.engine_id, ROLES[self.role], self.layout, [self.buffer.export()])
        )
        with self._lock:
            generation = self.generation + 1
        watcher = EventWatcher(
            self.client,
            self.engine_id,
            on_closed=lambda reason: self._closed(generation, reason),
            on_event=self._event,
        )
        try:
            watcher.wait_connected(timeout)
        except BaseException:
            watcher.cancel()
            raise
        with self._lock:
            old, self._watcher, self.generation = self._watcher, watcher, generation
        if old is not None:
            old.cancel()
        self.peer_address = response.peer_address
        self.connected_at.append(time.monotonic())
        self.connected.set()

    def _closed(self, generation: int, reason: str) -> None:  # watcher thread
        with self._lock:
            if self._stopping.is_set() or generation != self.generation:
                return
            waiting, self._waiting = self._waiting, {}
            self.stream_losses += 1
            self.connected.clear()
        # As vLLM's worker does: every request it waits on fails (and is recomputed).
        for waiter in waiting.values():
            waiter.resolve(STREAM_CLOSED, reason)
        self._need_connect.set()

    def _supervise(self) -> None:
        # The vLLM worker's supervisor, with its backoff (engine_shim/vllm/worker.py _supervise).
        backoff = 0.2
        while not self._stopping.is_set():
            if not self._need_connect.wait(timeout=1.0):
                continue
            self._need_connect.clear()
            try:
                if not self._socket.exists():
                    raise ConnectionError(f"no sidecar socket at {self._socket}")
                self.client.wait_ready(5.0)
                self._connect(5.0)
            except Exception:
                self._need_connect.set()
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.2

    def _event(self, event: engine_pb2.Event) -> None:  # watcher thread
        kind = TERMINAL.get(event.kind)
        if kind is None:
            return
        with self._lock:
            waiter = self._waiting.pop(event.request_id, None)
        if waiter is not None:
            waiter.resolve(kind, event.reason, event.duration_ms / 1000.0)

    # --- requests (the caller's thread) --------------------------------------------------------

    def expect(self, request_id: str) -> _Waiter:
        """Register interest in ``request_id``'s terminal event before the call that starts it."""
        waiter = _Waiter()
        with self._lock:
            if not self.connected.is_set():
                waiter.resolve(STREAM_CLOSED, "not connected")
            else:
                self._waiting[request_id] = waiter
        return waiter

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._waiting.pop(request_id, None)

    def blocks(self, block_ids: list[int]) -> np.ndarray:
        """A copy of the listed blocks of every layer."""
        return np.stack(
            [
                self.buffer.array[self.layout.block_slice(layer, b)]
                for layer in range(self.layout.num_layers)
                for b in block_ids
            ]
        )

    def write(self, block_ids: list[int], content: np.ndarray | None) -> None:
        """Set the listed blocks to ``content`` (as returned by ``blocks``), or zero them."""
        index = 0
        for layer in range(self.layout.num_layers):
            for block in block_ids:
                view = self.buffer.array[self.layout.block_slice(layer, block)]
                view[:] = 0 if content is None else content[index]
                index += 1

    def release(self, request_id: str, reason: str) -> None:
        """Best effort (the sidecar may be gone: then the stream's loss ends the request)."""
        try:
            self.client.release(self.engine_id, request_id, reason=reason)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._stopping.set()
        self._supervisor.join(timeout=5.0)
        with self._lock:
            watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
        try:
            self.client.unregister_worker(self.engine_id, 0)
        except grpc.RpcError:
            pass
        self.client.close()
        self.buffer.close()


@dataclass
class Slot:
    """The blocks one request uses on each engine, and the sender's content."""

    src_blocks: list[int]
    dst_blocks: list[int]
    content: np.ndarray | None = None


@dataclass
class Outcome:
    request_id: str
    kind: str  # moved | refused | failed | corrupt | lost
    detail: str = ""
    code: str = ""  # the status code of a refusal
    started: float = 0.0
    ended: float = 0.0
    sidecar_s: float = 0.0  # D's sidecar: its Pull/ExpectPush -> the terminal event

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def _code(exc: grpc.RpcError) -> str:
    code = exc.code()
    return code.name if code is not None else "UNKNOWN"


def _wait(waiter: _Waiter, timeout: float) -> tuple[str, str] | None:
    if not waiter.done.wait(timeout):
        return None
    return waiter.kind, waiter.reason


def _end(request_id: str, kind: str, detail: str, code: str, started: float) -> Outcome:
    return Outcome(request_id, kind, detail, code, started, time.monotonic())


def move(
    src: ShimEngine,
    dst: ShimEngine,
    mode: str,
    request_id: str,
    slot: Slot,
    wait_s: float = 30.0,
    on_refused: Callable[[str], None] | None = None,
) -> Outcome:
    """One request from ``src`` (P) to ``dst`` (D), ``mode`` "pull" or "push"; both engines'
    outcomes are waited for (bounded by ``wait_s`` each). See the module doc for the kinds."""
    if slot.content is None:
        shape = (src.layout.num_layers * len(slot.src_blocks), src.layout.block_len)
        src.write(slot.src_blocks, np.random.default_rng(abs(hash(request_id))).integers(0, 256, shape, np.uint8))
        slot.content = src.blocks(slot.src_blocks)
    dst.write(slot.dst_blocks, None)
    started = time.monotonic()
    d_id, num_tokens = f"{request_id}-d", len(slot.src_blocks) * 16
    if mode == "push":
        d_wait = dst.expect(d_id)
        try:
            target = remote(src.peer_address, src.engine_id, request_id)
            dst.client.expect_push(dst.engine_id, d_id, [slot.dst_blocks], target, transfer_id=request_id)
        except grpc.RpcError as exc:
            dst.forget(d_id)
            return _end(request_id, "refused", f"D ExpectPush: {exc.details()}", _code(exc), started)
        p_wait = src.expect(request_id)
        try:
            src.client.submit_blocks(src.engine_id, request_id, [slot.src_blocks], transfer_id=request_id,
                                     num_tokens=num_tokens, mode=common_pb2.TRANSFER_MODE_PUSH)  # fmt: skip
        except grpc.RpcError as exc:
            src.forget(request_id)
            dst.release(d_id, "the producer refused the request")
            if _wait(d_wait, wait_s) is None:
                return _end(request_id, "lost", "D was never told after its release", _code(exc), started)
            return _end(request_id, "refused", f"P SubmitBlocks: {exc.details()}", _code(exc), started)
    else:
        p_wait = src.expect(request_id)
        try:
            src.client.submit_blocks(src.engine_id, request_id, [slot.src_blocks], num_tokens=num_tokens)
        except grpc.RpcError as exc:
            src.forget(request_id)
            return _end(request_id, "refused", f"P SubmitBlocks: {exc.details()}", _code(exc), started)
        d_wait = dst.expect(d_id)
        try:
            target = remote(src.peer_address, src.engine_id, request_id, [slot.src_blocks], num_tokens=num_tokens)
            dst.client.pull(dst.engine_id, d_id, [slot.dst_blocks], target)
        except grpc.RpcError as exc:
            dst.forget(d_id)
            # What a proxy that saw D's refusal does; without it P holds the blocks for its lease.
            src.release(request_id, "the consumer refused the request")
            if on_refused is not None:
                on_refused(request_id)
            if _wait(p_wait, wait_s) is None:
                return _end(request_id, "lost", "P was never told after its release", _code(exc), started)
            return _end(request_id, "refused", f"D Pull: {exc.details()}", _code(exc), started)
    return _finish(src, dst, request_id, d_id, slot, p_wait, d_wait, wait_s, started)


def _finish(
    src: ShimEngine,
    dst: ShimEngine,
    request_id: str,
    d_id: str,
    slot: Slot,
    p_wait: _Waiter,
    d_wait: _Waiter,
    wait_s: float,
    started: float,
) -> Outcome:
    d_result = _wait(d_wait, wait_s)
    ended = time.monotonic()
    if d_result is None:
        dst.forget(d_id)
        return Outcome(request_id, "lost", f"D had no answer within {wait_s}s", "", started, ended)
    kind, reason = d_result
    if kind == "FINISHED_RECEIVING":
        assert slot.content is not None
        good = np.array_equal(dst.blocks(slot.dst_blocks), slot.content)
        outcome = Outcome(request_id, "moved" if good else "corrupt", reason, "", started, ended, d_wait.sidecar_s)
    else:
        outcome = Outcome(request_id, "failed", f"D {kind}: {reason}", "", started, ended)
        src.release(request_id, "the consumer failed the request")
    if _wait(p_wait, wait_s) is None:
        src.forget(request_id)
        return Outcome(
            request_id, "lost", f"P had no answer within {wait_s}s ({outcome.kind} at D)", "", started, ended
        )
    return outcome


def hold_and_read_back(
    p: ShimEngine, d: ShimEngine, request_id: str, slot: Slot, back: list[int], wait_s: float = 30.0
) -> Outcome:
    """Multi-turn: turn 1 moves P -> D (pull), D holds its blocks for the conversation, P finds
    them with a cache query and pulls them back into ``back`` (turn 2). A hold that is gone is a
    recompute of turn 2 (``refused`` with the reason)."""
    first = move(p, d, "pull", request_id, slot, wait_s)
    if first.kind != "moved":
        return first
    started = first.started
    hold_id, t2 = f"{request_id}-h", f"{request_id}-t2"
    h_wait = d.expect(hold_id)
    try:
        d.client.hold_blocks(d.engine_id, hold_id, [slot.dst_blocks], conversation_id=request_id,
                             num_tokens=len(slot.dst_blocks) * 16, ttl_seconds=wait_s)  # fmt: skip
    except grpc.RpcError as exc:
        d.forget(hold_id)
        return _end(request_id, "refused", f"D HoldBlocks: {exc.details()}", _code(exc), started)
    p.write(back, None)
    try:
        found = p.client.query_cache(p.engine_id, d.peer_address, conversation_id=request_id, timeout_seconds=2.0)
        entries = list(found.entries)
    except grpc.RpcError as exc:
        entries, detail, code = [], f"P QueryCache: {exc.details()}", _code(exc)
    else:
        detail, code = "P QueryCache: no entry", ""
    if not entries:
        d.release(hold_id, "turn 2 recomputed")
        if _wait(h_wait, wait_s) is None:
            return _end(request_id, "lost", "D's hold was never ended", code, started)
        return _end(request_id, "refused", detail, code, started)
    entry = entries[0]
    p_wait = p.expect(t2)
    try:
        target = remote(entry.address, entry.engine_id, entry.request_id, [list(g.ids) for g in entry.block_ids.groups],
                        num_tokens=entry.num_tokens)  # fmt: skip
        p.client.pull(p.engine_id, t2, [back], target)
    except grpc.RpcError as exc:
        p.forget(t2)
        d.release(hold_id, "turn 2 refused")
        if _wait(h_wait, wait_s) is None:
            return _end(request_id, "lost", "D's hold was never ended", _code(exc), started)
        return _end(request_id, "refused", f"P Pull: {exc.details()}", _code(exc), started)
    # Turn 2 is P reading D's hold: D is the producer now.
    return _finish(d, p, hold_id, t2, Slot(slot.dst_blocks, back, slot.content), h_wait, p_wait, wait_s, started)


@dataclass
class Tally:
    """Outcomes collected from many threads."""

    outcomes: list[Outcome] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)

    def count(self, kind: str, since: float = 0.0) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.kind == kind and o.started >= since)

    def of(self, *kinds: str) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.kind in kinds]

    def summary(self) -> dict[str, int]:
        with self._lock:
            counts: dict[str, int] = {}
            for o in self.outcomes:
                counts[o.kind] = counts.get(o.kind, 0) + 1
            return counts


class Lanes:
    """``count`` threads, each running requests one after another on its own slot until stopped
    (a steady stream): ``mode`` "pull", "push" or "hold" (multi-turn, ``hold_and_read_back``)."""

    def __init__(
        self,
        p: ShimEngine,
        d: ShimEngine,
        mode: str,
        count: int = 3,
        blocks_per_request: int = 2,
        pause: float = 0.02,
        wait_s: float = 30.0,
    ) -> None:
        self.p, self.d, self.mode, self.pause, self.wait_s = p, d, mode, pause, wait_s
        self.tally = Tally()
        self._stop = threading.Event()
        n = blocks_per_request
        self._slots = [Slot(list(range(i * n, (i + 1) * n)), list(range(i * n, (i + 1) * n))) for i in range(count)]
        # Turn 2 of a hold reads back into P's blocks past every slot.
        self._back = [list(range((count + i) * n, (count + i + 1) * n)) for i in range(count)]
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"lane-{mode}-{i}", daemon=True) for i in range(count)
        ]

    def start(self) -> Lanes:
        for thread in self._threads:
            thread.start()
        return self

    def _run(self, lane: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            request_id = f"{self.mode}-{lane}-{n}"
            slot = self._slots[lane]
            slot.content = None  # fresh content per request
            if self.mode == "hold":
                outcome = hold_and_read_back(self.p, self.d, request_id, slot, self._back[lane], self.wait_s)
            else:
                outcome = move(self.p, self.d, self.mode, request_id, slot, self.wait_s)
            self.tally.add(outcome)
            if outcome.kind in ("refused", "failed"):
                self._stop.wait(0.05)  # an engine would recompute meanwhile
            self._stop.wait(self.pause)

    def stop(self, timeout: float) -> None:
        """Stop issuing and wait for every request in flight (each is bounded by ``wait_s``)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        alive = [thread.name for thread in self._threads if thread.is_alive()]
        if alive:
            raise TimeoutError(f"lanes still running after {timeout}s: {alive}")
