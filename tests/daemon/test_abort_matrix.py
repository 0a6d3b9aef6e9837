"""An engine aborts (releases) a request at every point of its life: the matrix.

Guards what users of prefill/decode disaggregation depend on when either engine gives up on a
request, in pull (confirmed), pull on a voucher, and push mode, whichever engine releases and
whenever it does (README, "Failure bounds"):

1. both engines get a terminal event for it, and promptly: the consumer (D) FINISHED_RECEIVING or
   LOAD_FAILED, the producer (P) FINISHED_SENDING, within ``BOUND`` seconds, far inside the
   producer's 60 s lease (a request held until its lease ends fails here) and inside the bounds
   the README gives (a voucher's 4 s here, ``producer_unknown_grace_seconds``, a heartbeat, set
   to 1 s so that what waits for the next heartbeat is not mistaken for a hold until the lease);
2. once D has its terminal event, nothing is written into D's blocks any more: the test writes a
   marker into them at once, as an engine that reuses them would, and checks it is intact a
   while later (a late READ or WRITE into handed-back blocks corrupts another request);
3. what D reports received (FINISHED_RECEIVING) is byte for byte P's, and each engine gets one
   terminal event, not two.

Each cell starts two sidecars and two simulated engines (real NIXL, shared memory); transfers
move 2048 scattered blocks of 32 layers (65k descriptors, a few hundred ms here). When the engine
releases:

- ``before_peer``: before the other engine's first call (D releases its Pull or ExpectPush, and
  its sidecar tells P's, before P's SubmitBlocks; P releases its submitted request before D's
  call);
- ``at_once``: right after both calls, before any transfer. Where D releases a pull, its
  sidecar's first handshake with P's is held open for it (P's sidecar stopped for a moment, see
  ``keep_alive_then_stall_handshake``): left to chance that window is a few ms wide;
- ``in_transfer``: once the transferring sidecar reports a NIXL transfer in flight (a race the
  matrix does not control: each passing cell prints the phase it saw, ``-rP``);
- ``after_d_done``: after D's FINISHED_RECEIVING (P's FINISHED_SENDING usually came with it);
- push only, P's prefill failing before any SubmitBlocks (a Release with the transfer id, as the
  vLLM shim sends): after D's ExpectPush, or before it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest

from engine_shim.client import SidecarClient
from engine_shim.client import remote as client_remote
from kvsidecar import voucher
from kvsidecar.v1 import common_pb2
from tests.support.processes import EngineProcess, SidecarProcess, wait_until

LAYERS, BLOCKS, BLOCK_LEN = 32, 4096, 512
P_BLOCKS = list(range(0, BLOCKS, 2))  # scattered on both sides: one descriptor per block and layer
D_BLOCKS = list(range(1, BLOCKS, 2))
PULL, PUSH = 1, 2  # common_pb2.TRANSFER_MODE_*
LEASE = 60.0
BOUND = 6.0  # seconds each engine may wait for its terminal event after the abort
VOUCHER_SECONDS = 4.0  # a vouched request is held this long (+ the 0.5 s skew) even if released
QUIET = 1.0  # how long D's handed-back blocks are watched for a late write
SIDECAR_ARGS = ["--lease-seconds", str(LEASE), "--set", "heartbeat_interval_seconds=1"]
TERMINAL_D = {"FINISHED_RECEIVING", "LOAD_FAILED"}


@dataclass
class Pair:
    producer: EngineProcess
    consumer: EngineProcess
    p_side: SidecarProcess
    d_side: SidecarProcess
    p_client: SidecarClient
    d_client: SidecarClient
    p_kv: np.ndarray
    d_kv: np.ndarray


def _in_parallel(*starts: Callable[[], Any], hold: threading.Event | None = None) -> list[Any]:
    """Run ``starts`` at once, each in a thread; their results once all have returned. With
    ``hold``, each thread then waits for it before it ends: a sidecar asks for SIGTERM when the
    thread that started it ends (prctl's parent-death signal is per thread)."""
    results: list[Any] = [None] * len(starts)
    errors: list[BaseException] = []
    done = [threading.Event() for _ in starts]

    def run(index: int, start: Callable[[], Any]) -> None:
        try:
            results[index] = start()
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)
        finally:
            done[index].set()
        if hold is not None:
            hold.wait()

    for index, start in enumerate(starts):
        threading.Thread(target=run, args=(index, start), daemon=True).start()
    for event in done:
        event.wait()
    if errors:
        raise errors[0]
    return results


def _writable_kv(engine: EngineProcess) -> np.ndarray:
    """The engine's KV file, [layer, block, byte], writable: shared memory, so writing it here is
    writing the engine's own memory."""
    return np.memmap(engine.buffers[0], dtype=np.uint8, mode="r+", shape=(LAYERS, BLOCKS, BLOCK_LEN))


@pytest.fixture
def pair(sidecars: Callable[..., SidecarProcess], engines: Callable[..., EngineProcess]) -> Iterator[Pair]:
    hold = threading.Event()
    try:
        p_side, d_side = _in_parallel(
            lambda: sidecars("p", args=SIDECAR_ARGS), lambda: sidecars("d", args=SIDECAR_ARGS), hold=hold
        )
        shape = {"layers": LAYERS, "blocks": BLOCKS, "block_len": BLOCK_LEN}
        producer, consumer = _in_parallel(
            lambda: engines(p_side, "P", "producer", **shape), lambda: engines(d_side, "D", "consumer", **shape)
        )
        p_kv, d_kv = _writable_kv(producer), _writable_kv(consumer)
        p_kv[:, P_BLOCKS] = np.random.default_rng(7).integers(1, 256, p_kv[:, P_BLOCKS].shape, dtype=np.uint8)
        with SidecarClient(p_side.socket) as p_client, SidecarClient(d_side.socket) as d_client:
            yield Pair(producer, consumer, p_side, d_side, p_client, d_client, p_kv, d_kv)
    finally:
        hold.set()


@dataclass
class Cell:
    """One run: the calls made, what was seen, and every broken property (reported together)."""

    pair: Pair
    mode: str
    aborter: str
    when: str
    p_id: str = ""
    d_id: str = ""
    transfer_id: str = ""
    voucher_key: bytes = b""
    until_ms: int = 0
    p_submitted: bool = False
    stalled: bool = False
    phase_at_release: str = ""
    problems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        tag = f"{self.mode}-{self.aborter}-{self.when}".replace("_", "")
        self.p_id, self.d_id, self.transfer_id = f"{tag}-p", f"{tag}-d", f"t-{tag}"

    # --- the engines' calls -----------------------------------------------------------------

    def prepare(self) -> None:
        if self.mode == "vouched_pull":
            # As the vLLM shim does: the voucher key comes with a first SubmitBlocks' answer.
            producer = self.pair.producer
            reply = producer.command("submit", request_id="key-probe", blocks=[[0]], mode=PULL)
            assert reply["ok"], reply
            self.voucher_key = bytes.fromhex(reply["voucher_key"])
            assert producer.command("release", request_id="key-probe")["ok"]
            self.until_ms = int((time.time() + VOUCHER_SECONDS) * 1000)

    def p_submit(self) -> None:
        fields: dict[str, Any] = {"transfer_id": self.transfer_id, "num_tokens": len(P_BLOCKS) * 16}
        if self.mode == "push":
            fields["mode"] = PUSH
        else:
            fields["mode"] = PULL
            if self.mode == "vouched_pull":
                fields["vouched_until_ms"] = self.until_ms
        reply = self.pair.producer.command("submit", request_id=self.p_id, blocks=[P_BLOCKS], **fields)
        assert reply["ok"], reply
        self.p_submitted = True

    def d_call(self) -> None:
        producer = self.pair.producer
        remote: dict[str, Any] = {"address": producer.peer_address, "engine_id": producer.engine_id}
        if self.mode == "push":
            # Both legs dispatched at once: D knows the transfer id, not P's request id.
            op = "expect_push"
        else:
            op = "pull"
            remote |= {"request_id": self.p_id, "blocks": [P_BLOCKS], "num_tokens": len(P_BLOCKS) * 16}
            if self.mode == "vouched_pull":
                signed = voucher.sign(self.voucher_key, producer.engine_id, self.p_id, [P_BLOCKS], self.until_ms)
                remote |= {"voucher": signed.hex(), "vouched_until_ms": self.until_ms}
        reply = self.pair.consumer.command(
            op, request_id=self.d_id, blocks=[D_BLOCKS], remote=remote, transfer_id=self.transfer_id
        )
        assert reply["ok"], reply

    def both_calls(self) -> None:
        if self.mode == "push":
            self.d_call()  # D registers while P's prefill runs
            self.p_submit()
        else:
            self.p_submit()  # D pulls what P offered
            self.d_call()

    def release(self, who: str) -> None:
        """The engine's Release as the vLLM shim sends it: with the router's transfer id."""
        if who == "consumer":
            client, engine, request_id = self.pair.d_client, "D", self.d_id
        else:
            client, engine, request_id = self.pair.p_client, "P", self.p_id
        self.phase_at_release = self.phase_at_release or self.phase()
        client.release(engine, request_id, self.transfer_id, reason=f"{who} engine aborted ({self.when})")

    def phase(self) -> str:
        """What the transferring sidecar reports now: a NIXL transfer in flight, or the states."""
        initiator = self.pair.p_client if self.mode == "push" else self.pair.d_client
        status = initiator.status(include_requests=True)
        states = [f"{r.side}:{r.state}" for r in status.requests if r.request_id in (self.p_id, self.d_id)]
        return f"in_flight={status.transfers_in_flight} {','.join(states) or 'no request'}"

    def keep_alive_then_stall_handshake(self) -> None:
        """Hold D's first handshake with P's sidecar open, D's confirmation done before it. D's
        engine keeps the request alive first (a KeepAlive, as the vLLM shim sends while a request
        waits in its queue): D's sidecar confirms that P holds the blocks, so the Pull will not ask
        again before reading. Then P's sidecar is stopped (SIGSTOP, as a slow link would be), D's
        next periodic heartbeat, which names the kept-alive request, waits there, and the Pull
        comes: its handshake waits there too, behind that heartbeat. ``resume`` lets P's sidecar
        go on, after D's release (whose notice to P's sidecar waits there as well).

        A vouched pull then reads as soon as its handshake is answered. A confirmed pull is safe
        unless the answer to that heartbeat ("P holds it") comes in after D's release and before
        the handshake's: gRPC does not promise the order, so that cell fails only some runs."""
        pair = self.pair
        remote = client_remote(
            pair.producer.peer_address, pair.producer.engine_id, self.p_id, [P_BLOCKS], num_tokens=len(P_BLOCKS) * 16
        )
        self.p_submit()
        assert pair.d_client.keep_alive("D", self.d_id, remote, transfer_id=self.transfer_id).producer_holds
        wait_until(lambda: "heartbeat" in self._p_steps(), 5, what="the keep-alive's heartbeat at P's sidecar")
        assert pair.p_side.process is not None
        os.kill(pair.p_side.process.pid, signal.SIGSTOP)
        self.stalled = True
        time.sleep(1.2)  # > the 1 s heartbeat period (all of it well inside the 5 s peer call deadline)
        self.d_call()
        time.sleep(0.1)  # the Pull's handshake is on its way
        self.phase_at_release = "D's heartbeat, then its handshake, wait at P's stopped sidecar"

    def resume(self) -> None:
        if self.stalled and self.pair.p_side.process is not None:
            os.kill(self.pair.p_side.process.pid, signal.SIGCONT)
            self.stalled = False

    def p_side_heard_release(self) -> bool:
        return any(
            entry.get("event") == "consumer_released" and entry.get("consumer_request_id") == self.d_id
            for entry in self.pair.p_side.log_events()
        )

    def _p_steps(self) -> list[str]:
        request = common_pb2.TraceRequest(request_id=self.p_id, local_only=True)
        try:
            trace = self.pair.p_client.stub.Trace(request, timeout=5)
        except grpc.RpcError:
            return []
        return [e.kind for part in trace.sidecars for t in part.requests if t.side == "producer" for e in t.events]

    def await_transfer(self, timeout: float = 5.0) -> None:
        """Until the transferring sidecar has a NIXL transfer in flight (or, if it is already
        over, any sign of it having started), then record the phase."""
        initiator = self.pair.p_client if self.mode == "push" else self.pair.d_client
        state = "writing" if self.mode == "push" else "reading"
        deadline = time.monotonic() + timeout
        seen_state = False
        while time.monotonic() < deadline:
            status = initiator.status(include_requests=True)
            if status.transfers_in_flight:
                self.phase_at_release = f"NIXL transfer in flight (in_flight={status.transfers_in_flight})"
                return
            mine = [r for r in status.requests if r.request_id in (self.p_id, self.d_id) and r.state == state]
            if mine:
                seen_state = True
            elif seen_state or self.pair.consumer.events_for(self.d_id):
                self.phase_at_release = "missed: the transfer was over before a status call saw it in flight"
                return
        self.phase_at_release = "missed: no transfer seen within 5 s"

    # --- what must hold ---------------------------------------------------------------------

    def check(self, started: float, d_untouched: bool = False) -> None:
        pair = self.pair
        deadline = started + BOUND
        d_events = _wait(pair.consumer, self.d_id, deadline)
        before = marker = None
        marked_at = 0.0
        if not d_events:
            self.problems.append(f"D got no terminal event within {BOUND:g} s of the abort")
        else:
            # D's engine takes its blocks back now: write a marker, as reusing them would.
            before = np.array(pair.d_kv[:, D_BLOCKS])
            marker = np.random.default_rng(99).integers(1, 256, before.shape, dtype=np.uint8)
            pair.d_kv[:, D_BLOCKS] = marker
            marked_at = time.monotonic()
        self.resume()  # a stalled P's sidecar goes on only now, after D's engine took its blocks back
        if d_events and before is not None:
            kind = d_events[0]["event"]
            if kind not in TERMINAL_D:
                self.problems.append(f"D's terminal event is {kind}, not one of {sorted(TERMINAL_D)}")
            if kind == "FINISHED_RECEIVING" and not np.array_equal(before, pair.p_kv[:, P_BLOCKS]):
                self.problems.append("D reported FINISHED_RECEIVING but its blocks are not P's")
            if d_untouched and before.any():
                self.problems.append("D's blocks were written although D released before P's blocks came")
        if self.p_submitted:
            p_events = _wait(pair.producer, self.p_id, deadline)
            if not p_events:
                self.problems.append(f"P got no terminal event within {BOUND:g} s of the abort (lease {LEASE:g} s)")
            elif p_events[0]["event"] != "FINISHED_SENDING":
                self.problems.append(f"P's terminal event is {p_events[0]['event']}, not FINISHED_SENDING")
        if marker is not None:
            time.sleep(max(0.0, marked_at + QUIET - time.monotonic()))
            changed = int((np.asarray(pair.d_kv[:, D_BLOCKS]) != marker).any(axis=2).sum())
            if changed:
                self.problems.append(
                    f"{changed} (layer, block) pairs of D's blocks were written after D's terminal event"
                )
        for engine, request_id in ((pair.consumer, self.d_id), (pair.producer, self.p_id)):
            events = engine.events_for(request_id)
            if len(events) > 1:
                self.problems.append(f"{engine.engine_id} got {len(events)} terminal events for {request_id}")
        if not self.p_submitted and pair.producer.events_for(self.p_id):
            self.problems.append("P got an event for a request it never submitted")
        assert not self.problems, self.evidence()

    def evidence(self) -> str:
        pair = self.pair
        lines = [f"cell {self.mode} / {self.aborter} aborts / {self.when}: " + "; ".join(self.problems)]
        lines.append(f"  phase when released: {self.phase_at_release or '-'}")
        for engine, request_id in ((pair.consumer, self.d_id), (pair.producer, self.p_id)):
            seen = [{k: e.get(k) for k in ("event", "reason")} for e in engine.events_for(request_id)]
            lines.append(f"  {engine.engine_id} events for {request_id}: {seen}")
        ids = {self.p_id, self.d_id, self.transfer_id}
        for side in (pair.p_side, pair.d_side):
            for entry in side.log_events():
                if entry.get("level") in ("warning", "error", "info") and ids & set(map(str, entry.values())):
                    brief = {k: v for k, v in entry.items() if k not in ("timestamp", "logger", "level")}
                    lines.append(f"  {side.name} log: {json.dumps(brief)[:400]}")
        try:
            trace = pair.d_client.stub.Trace(common_pb2.TraceRequest(transfer_id=self.transfer_id), timeout=5)
            for part in trace.sidecars:
                for timeline in part.requests:
                    steps = ", ".join(f"{e.offset_s:.3f} {e.kind}" for e in timeline.events)
                    lines.append(f"  trace {timeline.side} {timeline.request_id} done={timeline.done}: {steps}")
        except Exception as exc:  # evidence only
            lines.append(f"  trace unavailable: {exc}")
        return "\n".join(lines)


def _wait(engine: EngineProcess, request_id: str, deadline: float) -> list[dict]:
    try:
        return engine.wait_event(request_id, max(0.01, deadline - time.monotonic()))
    except TimeoutError:
        return []


# --- the matrix -------------------------------------------------------------------------------

MODES = ["pull", "vouched_pull", "push"]
ABORTERS = ["consumer", "producer"]
WHENS = ["before_peer", "at_once", "in_transfer", "after_d_done"]
NO_WINDOW = (
    "in a pull P's FINISHED_SENDING comes with D's READ notification, as D's FINISHED_RECEIVING "
    "does: there is no window between them for P to abort in"
)
CELLS = [
    pytest.param(mode, aborter, when, id=f"{mode}-{aborter}-{when}")
    for mode in MODES
    for aborter in ABORTERS
    for when in WHENS
] + [
    # A prefill that fails before its SubmitBlocks (push: both legs dispatched at once).
    pytest.param("push", "producer", "prefill_failed_after_d", id="push-producer-prefill_failed_after_d"),
    pytest.param("push", "producer", "prefill_failed_before_d", id="push-producer-prefill_failed_before_d"),
]


@pytest.mark.parametrize(("mode", "aborter", "when"), CELLS)
def test_an_abort_ends_both_sides_promptly_and_nothing_lands_late(
    pair: Pair, mode: str, aborter: str, when: str
) -> None:
    if mode != "push" and aborter == "producer" and when == "after_d_done":
        pytest.skip(NO_WINDOW)
    cell = Cell(pair, mode, aborter, when)
    try:
        cell.prepare()
        started, d_untouched = _abort(cell, pair, mode, aborter, when)
        cell.check(started, d_untouched=d_untouched)
    finally:
        cell.resume()
    print(f"released: {cell.phase_at_release}")  # shown with -rP


def _abort(cell: Cell, pair: Pair, mode: str, aborter: str, when: str) -> tuple[float, bool]:
    """Make the calls of ``when`` and the release; returns when the release was made and whether
    D's blocks must be untouched."""
    if when == "before_peer":
        # The aborting engine releases before the other engine's first call for the request.
        if aborter == "consumer":
            cell.d_call()
            started = time.monotonic()
            cell.release("consumer")
            # Its notice reaches P's sidecar first (else the release comes after P's blocks there,
            # and a WRITE or READ already under way may complete: README, "Failure bounds").
            wait_until(cell.p_side_heard_release, 5, what="D's release at P's sidecar")
            cell.p_submit()
            return started, True
        cell.p_submit()
        started = time.monotonic()
        cell.release("producer")
        cell.d_call()
        return started, False
    if when == "at_once" and mode != "push" and aborter == "consumer":
        # Both calls made, D's sidecar not reading yet: its first handshake with P's runs. Left to
        # chance that window is a few ms wide here, so it is held open (see the method).
        cell.keep_alive_then_stall_handshake()
    elif when in ("at_once", "in_transfer", "after_d_done"):
        cell.both_calls()
        if when == "in_transfer":
            cell.await_transfer()
        elif when == "after_d_done":
            event = pair.consumer.wait_event(cell.d_id, 15)[0]
            assert event["event"] == "FINISHED_RECEIVING", event
            p_seen = [e["event"] for e in pair.producer.events_for(cell.p_id)]
            cell.phase_at_release = f"after D's FINISHED_RECEIVING; P's events then: {p_seen or 'none'}"
    elif when == "prefill_failed_after_d":
        cell.d_call()  # and P's SubmitBlocks never comes
    else:  # prefill_failed_before_d: P's prefill failed before D's ExpectPush came
        started = time.monotonic()
        cell.release("producer")
        cell.d_call()
        return started, False
    started = time.monotonic()
    cell.release(aborter)
    return started, False
