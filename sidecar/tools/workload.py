"""A producer and a consumer engine (simulated, in this process) talking to real sidecar daemons,
for the demo and the benchmark.

``TransferPair`` starts two ``kvsidecar serve`` children on loopback (or one, for the same-node
path), registers a ``SimulatedEngine`` with each, and turns every push or pull into a blocking call
that returns the request's latency: from the producer's SubmitBlocks to the consumer's
FINISHED_RECEIVING event. Calls are thread-safe; the engines' event threads complete the waits.

Pulls are vouched as the vLLM shim vouches them (``kvsidecar.voucher``): once a ``SubmitBlocks``
answer gave the producer's key, each submission names how long its blocks stay held and the pull
carries the signed voucher, so the consumer's sidecar reads without asking the producer's first
(the default path of a real deployment). ``vouch=False`` measures the confirming path instead.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

import grpc
import numpy as np

from engine_shim.client import remote
from engine_shim.memory import KvLayout
from engine_shim.simulated import SimulatedEngine
from kvsidecar import voucher
from kvsidecar.v1 import common_pb2, engine_pb2
from sidecar.core.trace import Timeline, from_proto
from sidecar.tools.launcher import DaemonProcess

POISON = 0xA5


class Completed(NamedTuple):
    """A request that ended FINISHED_RECEIVING: seconds from the producer's SubmitBlocks
    (``latency``) and from the engine call that let the transfer start (``from_last_call``: the
    consumer's Pull, or the SubmitBlocks of a push whose consumer registered first). With vLLM a
    producer's SubmitBlocks is asynchronous and overlaps the router's hop, so a pull's critical
    path starts at the Pull."""

    request_id: str
    latency: float
    from_last_call: float


class TransferFailed(RuntimeError):
    """A request ended in LOAD_FAILED (or timed out); the message says why."""


class TransferPair:
    def __init__(
        self,
        layout: KvLayout,
        same_node: bool = False,
        sidecar_args: Sequence[str] = (),
        workdir: Path | None = None,
        request_timeout: float = 60.0,
        roles: tuple[str, str] = ("producer", "consumer"),
        consumer_layout: KvLayout | None = None,
        make_daemon: Callable[[str], DaemonProcess] | None = None,
        vouch: bool = True,
        memory: str = "shm",
    ) -> None:
        self.layout = layout
        self.memory = memory  # "cuda": both engines' KV in GPU memory (engine_shim.cuda_memory)
        self.vouch = vouch
        # The producer's voucher key and validity from its sidecar's last SubmitBlocks answer.
        self._voucher_terms: tuple[bytes, float] = (b"", 0.0)
        self.roles = roles  # ("both", "both") for multi-turn: D holds, P pulls back
        self.consumer_layout = consumer_layout or layout  # another block size or KV layout: converted
        self.same_node = same_node
        self.request_timeout = request_timeout
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
        self._sidecar_args = list(sidecar_args)
        # Builds the (unstarted) daemon called "p" or "d", e.g. on another host; default: loopback.
        self._make_daemon = make_daemon or (lambda name: DaemonProcess(self.workdir, name, list(self._sidecar_args)))
        self.daemons: list[DaemonProcess] = []
        self.producer: SimulatedEngine | None = None
        self.consumer: SimulatedEngine | None = None
        self._waiters: dict[tuple[str, str], concurrent.futures.Future[engine_pb2.Event]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        # Recent successes, for benchmarks that look a request up afterwards (``trace``).
        self.completed: collections.deque[Completed] = collections.deque(maxlen=100_000)
        # Request id -> {mark: time.time()} of what the simulated engines saw (submit, its return,
        # the Pull's return, the terminal event's arrival, the waiter's wake-up), when a timeline
        # tool asked for them (bench/control_timeline.py); None: not recorded.
        self.client_marks: dict[str, dict[str, float]] | None = None

    def __enter__(self) -> TransferPair:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> None:
        p_daemon = self._make_daemon("p").start()
        self.daemons.append(p_daemon)
        d_daemon = p_daemon
        if not self.same_node:
            d_daemon = self._make_daemon("d").start()
            self.daemons.append(d_daemon)
        self.producer = SimulatedEngine(p_daemon.socket, "bench-P", self.roles[0], self.layout, memory=self.memory)
        self.producer.start(on_event=self._route)
        self.consumer = SimulatedEngine(
            d_daemon.socket, "bench-D", self.roles[1], self.consumer_layout, memory=self.memory
        )
        self.consumer.start(on_event=self._route)

    def close(self) -> None:
        for engine in (self.producer, self.consumer):
            if engine is not None:
                engine.close()
        for daemon in self.daemons:
            try:
                daemon.terminate(timeout=15)
            except Exception:
                daemon.kill()
        self.daemons.clear()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # --- requests ------------------------------------------------------------------------------

    def _mark(self, request_id: str, mark: str) -> None:
        if self.client_marks is not None:
            self.client_marks.setdefault(request_id, {})[mark] = time.time()

    def _route(self, rank: int, event: engine_pb2.Event) -> None:
        engine = "D" if event.kind in (engine_pb2.FINISHED_RECEIVING, engine_pb2.LOAD_FAILED) else "P"
        self._mark(event.request_id, f"{engine}-engine event")
        with self._lock:
            waiter = self._waiters.pop((engine, event.request_id), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(event)

    def _expect(self, engine: str, request_id: str) -> concurrent.futures.Future[engine_pb2.Event]:
        future: concurrent.futures.Future[engine_pb2.Event] = concurrent.futures.Future()
        with self._lock:
            self._waiters[(engine, request_id)] = future
        return future

    def _finish(
        self,
        request_id: str,
        received: concurrent.futures.Future[engine_pb2.Event],
        sent: concurrent.futures.Future[engine_pb2.Event],
        started: float,
        last_call: float = 0.0,
    ) -> float:
        try:
            event = received.result(self.request_timeout)
            ended = time.perf_counter()
            latency = ended - started
            self._mark(request_id + "-d", "D-engine waiter woke")
            sent.result(self.request_timeout)  # the producer freed its blocks too
        except concurrent.futures.TimeoutError:
            raise TransferFailed(f"{request_id}: no terminal event within {self.request_timeout}s") from None
        finally:
            with self._lock:
                self._waiters.pop(("D", request_id + "-d"), None)
                self._waiters.pop(("P", request_id), None)
        if event.kind != engine_pb2.FINISHED_RECEIVING:
            raise TransferFailed(f"{request_id}: {engine_pb2.EventKind.Name(event.kind)}: {event.reason}")
        self.completed.append(Completed(request_id, latency, ended - (last_call or started)))
        return latency

    def trace(self, request_id: str) -> list[Timeline]:
        """The request's timelines on both sidecars (Trace from the consumer's sidecar); [] when it
        is no longer kept (``trace_requests``)."""
        assert self.consumer is not None
        try:
            query = common_pb2.TraceRequest(request_id=request_id + "-d")
            response = self.consumer.client.stub.Trace(query, timeout=10)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return []
            raise
        return [from_proto(line) for part in response.sidecars for line in part.requests]

    def pull(self, p_blocks: Sequence[int], d_blocks: Sequence[int], num_tokens: int = 0) -> float:
        """Producer submits, consumer pulls; returns seconds from SubmitBlocks to FINISHED_RECEIVING.
        ``num_tokens`` is required when the engines' block sizes differ."""
        assert self.producer is not None and self.consumer is not None
        request_id = f"pull-{next(self._ids)}"
        received, sent = self._expect("D", request_id + "-d"), self._expect("P", request_id)
        key, seconds = self._voucher_terms if self.vouch else (b"", 0.0)
        until_ms = int((time.time() + seconds) * 1000) if key else 0
        self._mark(request_id + "-d", "P-engine SubmitBlocks")
        started = time.perf_counter()
        submitted = self.producer.client.submit_blocks(
            self.producer.engine_id, request_id, [list(p_blocks)], num_tokens=num_tokens,
            mode=common_pb2.TRANSFER_MODE_PULL, vouched_until_ms=until_ms,
        )  # fmt: skip
        self._mark(request_id + "-d", "P-engine SubmitBlocks returned")
        if submitted.voucher_key:
            self._voucher_terms = (submitted.voucher_key, submitted.voucher_seconds)
        signed = voucher.sign(key, self.producer.engine_id, request_id, [list(p_blocks)], until_ms) if key else b""
        pulled = time.perf_counter()
        self.consumer.client.pull(
            self.consumer.engine_id, request_id + "-d", [list(d_blocks)],
            remote(
                self.producer.peer_address, self.producer.engine_id, request_id, [list(p_blocks)], 0, num_tokens,
                signed, until_ms,
            ),
        )  # fmt: skip
        self._mark(request_id + "-d", "D-engine Pull returned")
        return self._finish(request_id, received, sent, started, pulled)

    def push(self, p_blocks: Sequence[int], d_blocks: Sequence[int], num_tokens: int = 0) -> float:
        """Consumer registers, producer submits; returns seconds from SubmitBlocks to FINISHED_RECEIVING."""
        assert self.producer is not None and self.consumer is not None
        request_id = f"push-{next(self._ids)}"
        transfer_id = "t-" + request_id
        received, sent = self._expect("D", request_id + "-d"), self._expect("P", request_id)
        reply = self.consumer.client.expect_push(
            self.consumer.engine_id, request_id + "-d", [list(d_blocks)],
            remote(self.producer.peer_address, self.producer.engine_id), transfer_id=transfer_id,
        )  # fmt: skip
        if not reply.registered:
            raise TransferFailed(f"{request_id}: the producer's sidecar refused the registration")
        self._mark(request_id + "-d", "P-engine SubmitBlocks")
        started = time.perf_counter()
        self.producer.client.submit_blocks(
            self.producer.engine_id, request_id, [list(p_blocks)], transfer_id=transfer_id,
            mode=common_pb2.TRANSFER_MODE_PUSH, num_tokens=num_tokens,
        )  # fmt: skip
        self._mark(request_id + "-d", "P-engine SubmitBlocks returned")
        return self._finish(request_id, received, sent, started)

    def multiturn(self, d_blocks: Sequence[int], p_blocks: Sequence[int]) -> float:
        """Multi-turn reuse: the consumer holds a finished turn's blocks, the producer pulls them
        back; returns seconds from HoldBlocks to the producer's FINISHED_RECEIVING. Needs
        ``roles=("both", "both")``."""
        assert self.producer is not None and self.consumer is not None
        request_id = f"turn-{next(self._ids)}"
        # The producer receives here (a receiving kind routes to "D"), the consumer sends ("P").
        received, sent = self._expect("D", request_id + "-p"), self._expect("P", request_id)
        started = time.perf_counter()
        self.consumer.client.hold_blocks(self.consumer.engine_id, request_id, [list(d_blocks)], ttl_seconds=60)
        self.producer.client.pull(
            self.producer.engine_id, request_id + "-p", [list(p_blocks)],
            remote(self.consumer.peer_address, self.consumer.engine_id, request_id, [list(d_blocks)]),
        )  # fmt: skip
        try:
            event = received.result(self.request_timeout)
            latency = time.perf_counter() - started
            sent.result(self.request_timeout)
        except concurrent.futures.TimeoutError:
            raise TransferFailed(f"{request_id}: no terminal event within {self.request_timeout}s") from None
        finally:
            with self._lock:
                self._waiters.pop(("D", request_id + "-p"), None)
                self._waiters.pop(("P", request_id), None)
        if event.kind != engine_pb2.FINISHED_RECEIVING:
            raise TransferFailed(f"{request_id}: {engine_pb2.EventKind.Name(event.kind)}: {event.reason}")
        return latency

    def abort(self, mode: str, p_blocks: Sequence[int], d_blocks: Sequence[int], delay: float) -> str:
        """Start a push or pull, then the consumer releases (aborts) it after ``delay`` seconds.
        Returns the producer's terminal event kind; raises if the producer never ends it (its
        blocks would leak)."""
        assert self.producer is not None and self.consumer is not None
        request_id = f"abort-{next(self._ids)}"
        transfer_id = "t-" + request_id
        sent = self._expect("P", request_id)
        target = remote(self.producer.peer_address, self.producer.engine_id, request_id, [list(p_blocks)])
        if mode == "push":
            self.consumer.client.expect_push(
                self.consumer.engine_id, request_id + "-d", [list(d_blocks)], target, transfer_id=transfer_id
            )
        self.producer.client.submit_blocks(
            self.producer.engine_id, request_id, [list(p_blocks)], transfer_id=transfer_id,
            mode=common_pb2.TRANSFER_MODE_PUSH if mode == "push" else common_pb2.TRANSFER_MODE_PULL,
        )  # fmt: skip
        if mode == "pull":
            self.consumer.client.pull(self.consumer.engine_id, request_id + "-d", [list(d_blocks)], target)
        time.sleep(delay)
        self.consumer.client.release(self.consumer.engine_id, request_id + "-d", reason="aborted by the workload")
        try:
            event = sent.result(self.request_timeout)
        except concurrent.futures.TimeoutError:
            raise TransferFailed(f"{request_id}: the producer never ended the aborted request") from None
        finally:
            with self._lock:
                self._waiters.pop(("P", request_id), None)
        return engine_pb2.EventKind.Name(event.kind)

    def expire(self, p_blocks: Sequence[int], lease_seconds: float) -> str:
        """The producer submits and no consumer ever comes: the lease must end the request."""
        assert self.producer is not None
        request_id = f"expire-{next(self._ids)}"
        sent = self._expect("P", request_id)
        self.producer.client.submit_blocks(
            self.producer.engine_id, request_id, [list(p_blocks)], lease_seconds=lease_seconds
        )
        try:
            event = sent.result(self.request_timeout)
        except concurrent.futures.TimeoutError:
            raise TransferFailed(f"{request_id}: the lease never ended the request") from None
        finally:
            with self._lock:
                self._waiters.pop(("P", request_id), None)
        return engine_pb2.EventKind.Name(event.kind)

    # --- data ----------------------------------------------------------------------------------

    def fill_producer(self, seed: int) -> None:
        assert self.producer is not None
        self.producer.fill(range(self.layout.num_blocks), seed)

    def _views(self) -> tuple[np.ndarray, np.ndarray]:
        assert self.producer is not None and self.consumer is not None
        self.producer.download()
        self.consumer.download()
        shape = (self.layout.num_layers, self.layout.num_blocks, self.layout.block_len)
        return (
            self.producer.workers[0].buffer.array[: self.layout.total_bytes].reshape(shape),
            self.consumer.workers[0].buffer.array[: self.layout.total_bytes].reshape(shape),
        )

    def poison(self, d_blocks: Sequence[int]) -> None:
        """Overwrite the consumer's blocks so stale data cannot pass for a transfer."""
        assert self.consumer is not None
        _, target = self._views()
        target[:, list(d_blocks)] = POISON
        self.consumer.upload()

    def verify(self, p_blocks: Sequence[int], d_blocks: Sequence[int]) -> bool:
        source, target = self._views()
        tail = list(p_blocks)[len(p_blocks) - len(d_blocks) :]
        return bool(np.array_equal(source[:, tail], target[:, list(d_blocks)]))

    def request_bytes(self, blocks: int) -> int:
        return blocks * self.layout.num_layers * self.layout.block_len
