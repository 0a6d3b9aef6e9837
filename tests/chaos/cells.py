"""One cell of the chaos matrix: a transfer between two sidecars with simulated engines, a fault
(SIGKILL, or SIGSTOP held past the lease then SIGCONT) of one process at one phase, and the
verdict.

Roles: the *source* holds the bytes (P in pull and push; D in multi-turn, where P pulls D's held
turn back), the *destination* waits for them. Every block's bytes are a known pattern
(``engine_shim.simulated.pattern``), so the destination's bytes are checked against what they must
be, without the source. A side that gets a terminal event reuses its blocks at once (fills them
with a new pattern), as vLLM would: a late WRITE into a destination that gave up, or a READ of a
source that was handed back, shows up as wrong bytes.

Every wait is bounded; what a cell saw is returned as a ``Verdict`` (the table row), and the test
asserts it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_shim.client import engine_channel
from engine_shim.simulated import pattern
from kvsidecar.v1 import engine_pb2, engine_pb2_grpc
from tests.support.fuzzing import leftover, process_usage
from tests.support.processes import EngineProcess, SidecarProcess

MODES = ("pull", "push", "multiturn")
PHASES = ("admitted", "registration_waiting", "in_flight", "done")
VICTIMS = ("P_engine", "D_engine", "P_sidecar", "D_sidecar")
FAULTS = ("kill", "stop")

LAYERS, BLOCKS, BLOCK_LEN = 2, 1024, 65536
# 400 non-adjacent blocks per layer (NIXL cannot merge them), 50 MiB in all: on this machine a
# transfer stays in flight for ~30-60 ms after the Pull/SubmitBlocks call returns, and the fault
# follows the call at once. A cell records when the transfer had already ended (it is not green
# then: the phase was not hit).
SOURCE_BLOCKS = list(range(0, 800, 2))
DEST_BLOCKS = list(range(1, 801, 2))
SEED, STALE_SEED, REUSE_SEED = 11, 22, 33

LEASE = 2.0
STOP_SECONDS = LEASE + 1.5  # held stopped for longer than the lease
SETTINGS = {
    "lease_seconds": LEASE,  # heartbeats every lease / 6
    # Short, so that a call to a stopped peer ends within the cell's bound.
    "peer_call_timeout_seconds": 3.0,
    "transfer_timeout_seconds": 4.0,
    "producer_unknown_grace_seconds": 2.0,
    "push_registration_timeout_seconds": 5.0,
    "worker_attach_timeout_seconds": 5.0,
    "shutdown_grace_seconds": 2.0,
    # End-to-end digests (issue 11): a consumer that received wrong bytes fails the load. The
    # cells still check every byte themselves.
    "integrity": "digest",
    # The multi-turn cells hold a large transfer's blocks (400 of the engine's 1024): above the
    # default hold cap (a quarter of the engine's blocks), which issue 16 added.
    "hold_max_share": 1.0,
}
# The waiting side learns within this many seconds of the fault (plus STOP_SECONDS for a stop):
# the longest of the bounds that apply (transfer timeout 4, push registration 5, lease 2 plus a
# heartbeat round, unknown-producer grace 2 + call 1) and 3 s of slack for a busy 2-core machine.
BOUND = 8.0
SETTLE = 2.0  # after both sides ended, how long a late transfer has to show itself


def sidecar_args() -> list[str]:
    return [arg for name, value in SETTINGS.items() for arg in ("--set", f"{name}={value}")]


@dataclass(frozen=True)
class Cell:
    mode: str
    phase: str
    victim: str
    fault: str

    @property
    def id(self) -> str:
        return f"{self.mode}-{self.phase}-{self.victim}-{self.fault}"

    def bound(self) -> float:
        return BOUND + (STOP_SECONDS if self.fault == "stop" else 0.0)


@dataclass
class Verdict:
    cell: Cell
    learned: str = ""  # who learned what, e.g. "D: LOAD_FAILED 2.1s"
    data: str = ""  # "correct", "failed explicitly", "n/a", or "WRONG: ..."
    problems: list[str] = field(default_factory=list)

    @property
    def green(self) -> bool:
        return not self.problems

    def row(self) -> list[str]:
        c = self.cell
        return [c.mode, c.phase, c.victim, c.fault, f"{c.bound():.1f}", self.learned, self.data,
                "green" if self.green else "; ".join(self.problems)]  # fmt: skip


def expected(blocks: list[int], seed: int) -> np.ndarray:
    return np.stack([np.stack([pattern(seed, 0, layer, b, BLOCK_LEN) for b in blocks]) for layer in range(LAYERS)])


def view(engine: EngineProcess, blocks: list[int]) -> np.ndarray:
    data = np.memmap(engine.buffers[0], dtype=np.uint8, mode="r", shape=(LAYERS, BLOCKS, BLOCK_LEN))
    return np.array(data[:, blocks])


def health(sidecar: SidecarProcess) -> bool:
    try:
        with grpc.insecure_channel(f"unix:{sidecar.socket}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def status(sidecar: SidecarProcess) -> engine_pb2.GetStatusResponse:
    with engine_channel(sidecar.socket) as channel:
        response: engine_pb2.GetStatusResponse = engine_pb2_grpc.EngineServiceStub(channel).GetStatus(
            engine_pb2.GetStatusRequest(include_requests=True), timeout=5
        )
        return response


TERMINAL_SOURCE = {"FINISHED_SENDING", "LEASE_EXPIRED", "LOAD_FAILED"}
TERMINAL_DEST = {"FINISHED_RECEIVING", "LOAD_FAILED"}


class Run:
    """One cell, executed."""

    def __init__(self, cell: Cell, sidecars: Any, engines: Any) -> None:
        self.cell = cell
        self.sidecars, self.engines = sidecars, engines
        self.p_side = sidecars("p", args=sidecar_args())
        self.d_side = sidecars("d", args=sidecar_args())
        role_p, role_d = ("both", "both") if cell.mode == "multiturn" else ("producer", "consumer")
        self.p = engines(self.p_side, "P", role_p, layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN)
        self.d = engines(self.d_side, "D", role_d, layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN)
        if cell.mode == "multiturn":
            self.source, self.dest = self.d, self.p
            self.source_side, self.dest_side = self.d_side, self.p_side
        else:
            self.source, self.dest = self.p, self.d
            self.source_side, self.dest_side = self.p_side, self.d_side
        self.verdict = Verdict(cell)
        self.killed: set[str] = set()
        self.fault_at = 0.0
        self.source_started = False
        self.dest_started = False
        # One small request of the same mode first: the peer channels and NIXL connections it
        # opens stay (they are not leaks), so the fd baseline is taken after it.
        self.source_request, self.dest_request = "warm", "warm-d"
        self.source_offer(SOURCE_BLOCKS[:1])
        self.dest_ask([1001])
        assert self.dest.wait_event("warm-d", 20)[0]["event"] == "FINISHED_RECEIVING"
        assert self.source.wait_event("warm", 20)[0]["event"] == "FINISHED_SENDING"
        self.baseline = {side.name: process_usage(self._pid(side)) for side in (self.p_side, self.d_side)}
        self.source_request = "req"  # the source engine's request id
        self.dest_request = "req-d"
        self.source_started = self.dest_started = False

    @staticmethod
    def _pid(side: SidecarProcess) -> int:
        assert side.process is not None
        return side.process.pid

    # --- processes ---------------------------------------------------------------------------

    def _victim_pid(self) -> int:
        victim = self.cell.victim
        if victim == "P_engine":
            return self.p.process.pid
        if victim == "D_engine":
            return self.d.process.pid
        return self._pid(self.p_side if victim == "P_sidecar" else self.d_side)

    def fault(self) -> None:
        pid = self._victim_pid()
        if self.cell.phase == "in_flight":
            self.asked_at = getattr(self, "asked_at", time.monotonic())
            if self._terminal(self.dest, self.dest_request, TERMINAL_DEST) or self._terminal(
                self.source, self.source_request, TERMINAL_SOURCE
            ):
                self.verdict.problems.append("the transfer was no longer in flight at the fault (too fast)")
        self.fault_at = time.monotonic()
        if self.cell.fault == "kill":
            os.killpg(pid, signal.SIGKILL)
            self.killed.add(self.cell.victim)
            if self.cell.victim.endswith("engine"):
                (self.p if self.cell.victim == "P_engine" else self.d).process.wait(10)
            else:
                side = self.p_side if self.cell.victim == "P_sidecar" else self.d_side
                assert side.process is not None
                side.process.wait(10)
        else:
            os.killpg(pid, signal.SIGSTOP)
            time.sleep(STOP_SECONDS)
            os.killpg(pid, signal.SIGCONT)

    def dead(self, who: str) -> bool:
        return who in self.killed

    def connected(self, engine: EngineProcess) -> bool:
        """The engine and its sidecar are both alive (it can act and learn)."""
        name = "P" if engine is self.p else "D"
        return not self.dead(f"{name}_engine") and not self.dead(f"{name}_sidecar")

    # --- the flow ----------------------------------------------------------------------------

    def source_offer(self, blocks: list[int] = SOURCE_BLOCKS) -> None:
        """The source makes its blocks available: SubmitBlocks (P) or HoldBlocks (multi-turn D)."""
        if not self.connected(self.source):
            return
        if self.cell.mode == "multiturn":
            reply = self.source.command("hold", request_id=self.source_request, blocks=[blocks],
                                        conversation_id="conv", ttl_seconds=LEASE)  # fmt: skip
        else:
            mode = 2 if self.cell.mode == "push" else 1
            reply = self.source.command("submit", request_id=self.source_request, blocks=[blocks],
                                        transfer_id="t-" + self.source_request, mode=mode)  # fmt: skip
        assert reply["ok"], reply
        self.source_started = True

    def dest_ask(self, blocks: list[int] = DEST_BLOCKS) -> None:
        """The destination asks for the blocks: Pull (pull, multi-turn) or ExpectPush (push)."""
        if not self.connected(self.dest):
            return
        remote = {"address": self.source_side.address, "engine_id": self.source.engine_id,
                  "request_id": self.source_request, "blocks": [SOURCE_BLOCKS[: len(blocks)]]}  # fmt: skip
        op = "expect_push" if self.cell.mode == "push" else "pull"
        reply = self.dest.command(op, request_id=self.dest_request, blocks=[blocks], remote=remote,
                                  transfer_id="t-" + self.source_request)  # fmt: skip
        # A refusal is an explicit failure (e.g. the producer's sidecar is gone): that is an answer.
        self.dest_started = bool(reply["ok"])
        if not reply["ok"]:
            self.dest_refused = str(reply.get("error", ""))

    dest_refused = ""

    def execute(self) -> Verdict:
        self.source.command("fill", blocks=SOURCE_BLOCKS, seed=SEED)
        self.dest.command("fill", blocks=DEST_BLOCKS, seed=STALE_SEED)
        phase = self.cell.phase
        if phase == "admitted":
            self.source_offer()
            self.fault()
            self.dest_ask()
        elif phase == "registration_waiting":
            self.dest_ask()
            self.fault()
            self.source_offer()
        elif phase == "in_flight":
            if self.cell.mode == "push":
                self.dest_ask()
                self.source_offer()
            else:
                self.source_offer()
                self.dest_ask()
            self.fault()
        else:  # done: the destination has its bytes; nothing released yet
            self.source_offer()
            self.dest_ask()
            events = self.dest.wait_event(self.dest_request, 20)
            assert events[0]["event"] == "FINISHED_RECEIVING", events
            self.fault()
        self.observe()
        self.check_after()
        return self.verdict

    # --- what the sides saw --------------------------------------------------------------------

    def _terminal(self, engine: EngineProcess, request: str, kinds: set[str]) -> dict[str, Any] | None:
        for event in engine.events_for(request):
            if event["event"] in kinds:
                return event
        return None

    def _stream_closed(self, engine: EngineProcess) -> bool:
        return any(e.get("event") == "STREAM_CLOSED" for e in list(engine.events))

    def observe(self) -> None:
        """Wait (bounded) for the terminal events each live side must get; reuse blocks at once."""
        verdict, cell = self.verdict, self.cell
        deadline = self.fault_at + cell.bound()
        waits: dict[str, tuple[EngineProcess, str, set[str], list[int]]] = {}
        if self.dest_started and not self.dead(f"{self._name(self.dest)}_engine"):
            waits["dest"] = (self.dest, self.dest_request, TERMINAL_DEST, DEST_BLOCKS)
        if self.source_started and not self.dead(f"{self._name(self.source)}_engine"):
            waits["source"] = (self.source, self.source_request, TERMINAL_SOURCE, SOURCE_BLOCKS)
        got: dict[str, tuple[str, float]] = {}
        while waits.keys() - got.keys():
            for role, (engine, request, kinds, blocks) in waits.items():
                if role in got:
                    continue
                event = self._terminal(engine, request, kinds)
                if event is not None:
                    got[role] = (event["event"], event["received_at"] - self.fault_at)
                    if event["event"] != "FINISHED_RECEIVING":  # the engine reuses its blocks at once
                        assert engine.command("fill", blocks=blocks, seed=REUSE_SEED)["ok"]
                    elif role == "dest":
                        self.received = view(engine, blocks)
                elif self._stream_closed(engine):
                    closed = next(e for e in list(engine.events) if e.get("event") == "STREAM_CLOSED")
                    got[role] = ("STREAM_CLOSED", closed["received_at"] - self.fault_at)
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        for role in waits.keys() - got.keys():
            verdict.problems.append(f"{role} ({self._name(waits[role][0])}) learned nothing within {cell.bound():.0f}s")
        if self.dest_refused:
            got.setdefault("dest", ("refused", 0.0))
        verdict.learned = ", ".join(
            f"{self._name(self.dest if role == 'dest' else self.source)}: {kind} {at:.1f}s"
            for role, (kind, at) in sorted(got.items())
        )
        self.got = got

    received: np.ndarray | None = None

    def _name(self, engine: EngineProcess) -> str:
        return "P" if engine is self.p else "D"

    def check_after(self) -> None:
        verdict = self.verdict
        time.sleep(SETTLE)
        # Data: bytes reported received are the source's; a destination that gave up and reused
        # its blocks still holds its own bytes (no late WRITE landed).
        dest_kind = self.got.get("dest", ("", 0.0))[0]
        if dest_kind == "FINISHED_RECEIVING":
            assert self.received is not None
            if np.array_equal(self.received, expected(SOURCE_BLOCKS, SEED)):
                verdict.data = "correct"
            else:
                verdict.data = "WRONG: bytes reported received differ from the source's"
                verdict.problems.append(verdict.data)
        elif dest_kind in ("LOAD_FAILED", "refused", "STREAM_CLOSED"):
            verdict.data = "failed explicitly"
        else:
            verdict.data = "n/a (destination gone)" if not self.connected(self.dest) else "no answer"
        live = self.connected(self.dest)
        if (
            dest_kind == "LOAD_FAILED"
            and live
            and not np.array_equal(view(self.dest, DEST_BLOCKS), expected(DEST_BLOCKS, REUSE_SEED))
        ):
            failure = self._terminal(self.dest, self.dest_request, {"LOAD_FAILED"}) or {}
            verdict.problems.append(
                f"a late transfer overwrote the destination's reused blocks (it had failed: {failure.get('reason')})"
            )
        # A destination that reported success must not have been overwritten afterwards either.
        if (
            dest_kind == "FINISHED_RECEIVING"
            and live
            and not np.array_equal(view(self.dest, DEST_BLOCKS), self.received)
        ):
            verdict.problems.append("the destination's blocks changed after FINISHED_RECEIVING")
        for side in (self.p_side, self.d_side):
            if self.dead(f"{side.name.upper()}_sidecar"):
                continue
            self._check_sidecar(side)

    def _check_sidecar(self, side: SidecarProcess) -> None:
        verdict = self.verdict
        name = side.name.upper()
        if not health(side):
            verdict.problems.append(f"{name}'s sidecar is not SERVING")
            return
        alive = [e.engine_id for e in (self.p, self.d) if not self.dead(f"{e.engine_id}_engine")]
        deadline = time.monotonic() + 10
        while True:
            left = leftover(status(side), alive)
            # After a peer's sidecar died, the peer entry of a handshake is legitimate history.
            left = [item for item in left if not item.startswith("peers")]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if left:
            verdict.problems.append(f"{name}'s sidecar kept {left}")
        engine = self.p if name == "P" else self.d
        if self.dead(f"{name}_engine"):
            orphans = list(Path("/dev/shm").glob(f"kvsidecar-{engine.process.pid}-*"))
            if orphans:
                verdict.problems.append(f"orphaned shm files of the killed engine: {[p.name for p in orphans]}")
        usage = process_usage(self._pid(side))
        if usage["fds"] > self.baseline[side.name]["fds"] + 2:
            verdict.problems.append(f"{name}'s sidecar fds {self.baseline[side.name]['fds']} -> {usage['fds']}")

    # --- still serves ------------------------------------------------------------------------------

    def recover_and_transfer(self) -> None:
        """Replace what was killed (a new engine, or a new sidecar with a new engine) and move a
        fresh request P -> D with intact bytes: the survivors still serve, restarted peers too."""
        victim = self.cell.victim
        if "P_sidecar" in self.killed:
            self.p.kill()
            self.p_side.start()
        if "D_sidecar" in self.killed:
            self.d.kill()
            self.d_side.start()
        role_p, role_d = ("both", "both") if self.cell.mode == "multiturn" else ("producer", "consumer")
        if victim.startswith("P") and self.killed:
            self.p = self.engines(self.p_side, "P", role_p, layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN)
        if victim.startswith("D") and self.killed:
            self.d = self.engines(self.d_side, "D", role_d, layers=LAYERS, blocks=BLOCKS, block_len=BLOCK_LEN)
        blocks = [5, 6, 7]
        assert self.p.command("fill", blocks=blocks, seed=44)["ok"]
        assert self.p.command("submit", request_id="after", blocks=[blocks])["ok"]
        remote = {"address": self.p_side.address, "engine_id": "P", "request_id": "after", "blocks": [blocks]}
        reply = self.d.command("pull", request_id="after-d", blocks=[[900, 901, 902]], remote=remote)
        assert reply["ok"], reply
        events = self.d.wait_event("after-d", 20)
        if events[0]["event"] != "FINISHED_RECEIVING":
            self.verdict.problems.append(f"a fresh pull afterwards failed: {events[0].get('reason')}")
        elif not np.array_equal(view(self.d, [900, 901, 902]), expected(blocks, 44)):
            self.verdict.problems.append("a fresh pull afterwards delivered wrong bytes")


def table(verdicts: list[Verdict]) -> str:
    headers = ["mode", "phase", "victim", "fault", "bound s", "who learned what, when", "D's data", "verdict"]
    rows = [v.row() for v in verdicts]
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)) + " |"
             for row in [headers, *rows]]  # fmt: skip
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
