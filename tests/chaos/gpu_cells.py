"""The chaos matrix's GPU fault cells (issue 35 item 4): faults the GPU path adds, on a real GPU.

Two sidecars (real processes) with a simulated engine on each whose KV is GPU memory exported over
CUDA IPC (``engine_shim.simulated --memory cuda``), so the sidecars map each other's engines'
memory and copy it on the device (node-local device copy), as on one GPU node. Bytes are checked
on the engines' GPUs token by token (``fill_tokens`` / ``verify_tokens``). Faults:

- ``engine_killed_while_mapped-admitted``: SIGKILL of P's engine after its SubmitBlocks, its memory
  mapped by its sidecar (and by D's, once they handshook). D learns within the bound; both
  sidecars keep serving, drop the dead engine and hold nothing; a new P engine (a new allocation,
  likely at the addresses the dead one had) moves a request intact: no stale mapping is reused.
- ``engine_killed_while_mapped-in_flight``: the same while a device copy reads P's memory (the
  copy held on the device for 2 s). As above, and D's bytes are the source's or the load failed:
  a sidecar does not crash when the exporter of memory it copies from dies.
- ``sidecar_killed_while_engine_uses-P`` / ``-D``: SIGKILL of P's (D's) sidecar while the device
  copy out of P's / into D's memory runs (held 2 s). The engine whose sidecar died lives on with
  its KV memory intact (blocks outside the request still verify, P's request blocks too), its
  event stream closes; the other side learns within the bound; after a restart the node moves a
  request intact.
- ``device_copy_never_completes``: the request's device copy is held on the device until the test
  releases it. Past the transfer deadline D has NO terminal event (the sidecar holds D's blocks
  while the copy may still write them, ``kvsidecar_device_copies_held`` > 0), both sidecars
  answer health meanwhile; once released, D gets LOAD_FAILED within the bound, reuses its blocks,
  and they stay intact; P a terminal event; the node moves a request intact afterwards.

The hold is real on the device (``tests/chaos/gpu_hold/sitecustomize.py``: a ``cuStreamWaitValue32``
enqueued before the copy on the sidecar's own stream), armed by a file once the warm-up is done.
Every wait has a bound; a cell returns a ``Verdict`` (``tests/chaos/cells.py``) that the test asserts.
Skipped without a GPU, with the reason. The CPU stand-in for the hung copy (``FakeCudaDriver.hang``)
is gpu-local's ``tests/unit/test_cuda_copy.py`` (the bound of ``wait_copy``).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.chaos.cells import SETTINGS, health, status
from tests.support.fuzzing import leftover
from tests.support.processes import REPO, EngineProcess, SidecarProcess, start_transfer

HOLD_DIR = Path(__file__).parent / "gpu_hold"
LAYERS, BLOCKS, HEADS, BLOCK_SIZE, CHUNK = 4, 64, 4, 16, 256
TOKENS = 400  # 25 blocks
P_BLOCKS = list(range(3, 3 + TOKENS // BLOCK_SIZE))
D_BLOCKS = list(range(30, 30 + TOKENS // BLOCK_SIZE))
CONTROL = list(range(56, 60))  # blocks of each engine no request touches: its KV that must survive
SEED, CONTROL_SEED, REUSE_SEED, FRESH_SEED = 5, 6, 7, 8
HELD_SECONDS = 2.0  # a slow copy: long enough to kill someone while it runs
TRANSFER_TIMEOUT = float(SETTINGS["transfer_timeout_seconds"])  # type: ignore[arg-type]
BOUND = 8.0  # as the CPU cells: the longest bound that applies plus slack for a busy machine
SETTLE = 2.0
# The integrity check hashes on the CPU and refuses GPU producers (tests/daemon/test_gpu.py): off here.
GPU_SETTINGS = {**SETTINGS, "integrity": "off"}

CELLS = (
    "engine_killed_while_mapped-admitted",
    "engine_killed_while_mapped-in_flight",
    "sidecar_killed_while_engine_uses-P",
    "sidecar_killed_while_engine_uses-D",
    "device_copy_never_completes",
)


@dataclass
class GpuVerdict:
    cell: str
    learned: str = ""  # who learned what, e.g. "D: LOAD_FAILED 4.1s"
    data: str = ""  # "correct", "failed explicitly", "WRONG: ..."
    hold: str = ""  # how the copy was held (``GpuRun.hold_mode``)
    problems: list[str] = field(default_factory=list)

    @property
    def green(self) -> bool:
        return not self.problems

    def row(self) -> str:
        verdict = "green" if self.green else "; ".join(self.problems)
        return f"| {self.cell} | {BOUND:.1f} | {self.learned} | {self.data} | {self.hold} | {verdict} |"


def sidecar_args() -> list[str]:
    return [arg for name, value in GPU_SETTINGS.items() for arg in ("--set", f"{name}={value}")]


def hold_env(workdir: Path, hold_seconds: float) -> dict[str, str]:
    """The environment that loads ``gpu_hold`` into a sidecar (armed by ``workdir/arm``)."""
    path = os.pathsep.join([str(HOLD_DIR), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {
        "PYTHONPATH": path,
        "KVSIDECAR_TEST_GPU_ARM": str(workdir / "arm"),
        "KVSIDECAR_TEST_GPU_RELEASE": str(workdir / "release"),
        "KVSIDECAR_TEST_GPU_HOLD_SECONDS": str(hold_seconds),
    }


class GpuRun:
    """One GPU cell, executed (the same shape as ``cells.Run``)."""

    def __init__(self, cell: str, sidecars: Any, engines: Any, workdir: Path) -> None:
        self.cell, self.sidecars, self.engines, self.workdir = cell, sidecars, engines, workdir
        self.verdict = GpuVerdict(cell)
        hold = 0.0 if cell == "device_copy_never_completes" else HELD_SECONDS
        env = hold_env(workdir, hold)
        self.p_side = sidecars("p", args=sidecar_args(), env=env)
        self.d_side = sidecars("d", args=sidecar_args(), env=env)
        self.p = self.engine(self.p_side, "P", "producer")
        self.d = self.engine(self.d_side, "D", "consumer")
        self.fault_at = 0.0
        # Warm-up: handshakes, mappings and the copy stream exist before the fault.
        self.move("warm", FRESH_SEED - 1, check=True)
        for engine in (self.p, self.d):
            assert engine.command("fill_tokens", blocks=CONTROL, num_tokens=len(CONTROL) * BLOCK_SIZE,
                                  seed=CONTROL_SEED)["ok"]  # fmt: skip

    def engine(self, side: SidecarProcess, name: str, role: str) -> EngineProcess:
        return self.engines(side, name, role, memory="cuda", layers=LAYERS, blocks=BLOCKS, heads=HEADS,
                            block_size=BLOCK_SIZE, kv_layout="HND", head_size=CHUNK // 4, dtype="float16",
                            block_len=BLOCK_SIZE * HEADS * CHUNK)  # fmt: skip

    def move(self, request: str, seed: int, check: bool) -> dict[str, Any]:
        assert self.p.command("fill_tokens", blocks=P_BLOCKS, num_tokens=TOKENS, seed=seed)["ok"]
        reply = start_transfer(self.p, self.d, "pull", request, P_BLOCKS, D_BLOCKS, TOKENS)
        if check:
            assert reply["ok"], reply
            events = self.d.wait_event(f"{request}-d", 30)
            assert events[0]["event"] == "FINISHED_RECEIVING", events
            checked = self.d.command("verify_tokens", blocks=D_BLOCKS, num_tokens=TOKENS, seed=seed)
            assert checked["bad_count"] == 0, checked
        return reply

    # --- the cells -------------------------------------------------------------------------------

    def execute(self) -> GpuVerdict:
        name = self.cell
        if name.startswith("engine_killed_while_mapped"):
            self.engine_killed(in_flight=name.endswith("in_flight"))
        elif name.startswith("sidecar_killed_while_engine_uses"):
            self.sidecar_killed(victim=name[-1])
        else:
            self.copy_never_completes()
        self.verdict.hold = self.hold_mode()
        if name != "engine_killed_while_mapped-admitted" and self.verdict.hold in ("not installed", "no copy was held"):
            # As a CPU cell that came too late: the fault did not meet a device copy in flight.
            self.verdict.problems.append(f"no device copy was held ({self.verdict.hold}): the phase was not hit")
        return self.verdict

    def _arm(self) -> None:
        (self.workdir / "arm").touch()

    def _kill(self, pid: int) -> None:
        self.fault_at = time.monotonic()
        os.killpg(pid, signal.SIGKILL)

    def _terminal(self, engine: EngineProcess, request: str, kinds: set[str]) -> dict[str, Any] | None:
        deadline = self.fault_at + BOUND
        while time.monotonic() < deadline:
            for event in engine.events_for(request):
                if event["event"] in kinds:
                    return event
            if any(e.get("event") == "STREAM_CLOSED" for e in list(engine.events)):
                return {"event": "STREAM_CLOSED", "received_at": time.monotonic()}
            time.sleep(0.02)
        self.verdict.problems.append(f"{engine.engine_id} learned nothing of {request} within {BOUND:.0f}s")
        return None

    def _stream_closed(self, engine: EngineProcess) -> bool:
        deadline = self.fault_at + BOUND
        while time.monotonic() < deadline:
            if any(e.get("event") == "STREAM_CLOSED" for e in list(engine.events)):
                return True
            time.sleep(0.02)
        return False

    def _dest_outcome(self, request: str) -> None:
        event = self._terminal(self.d, f"{request}-d", {"FINISHED_RECEIVING", "LOAD_FAILED"})
        if event is None:
            return
        at = event["received_at"] - self.fault_at
        self.verdict.learned = f"D: {event['event']} {at:.1f}s"
        if event["event"] == "FINISHED_RECEIVING":
            checked = self.d.command("verify_tokens", blocks=D_BLOCKS, num_tokens=TOKENS, seed=SEED)
            self.verdict.data = "correct" if checked["bad_count"] == 0 else f"WRONG: {checked['bad'][:2]}"
            if checked["bad_count"]:
                self.verdict.problems.append("bytes reported received differ from the source's")
        else:
            self.verdict.data = "failed explicitly"
            assert self.d.command("fill_tokens", blocks=D_BLOCKS, num_tokens=TOKENS, seed=REUSE_SEED)["ok"]
            self.reused = True

    reused = False

    def _control_intact(self, engine: EngineProcess, when: str) -> None:
        checked = engine.command("verify_tokens", blocks=CONTROL, num_tokens=len(CONTROL) * BLOCK_SIZE,
                                 seed=CONTROL_SEED)  # fmt: skip
        if not checked.get("ok", True) or checked.get("bad_count", 1):
            self.verdict.problems.append(f"{engine.engine_id}'s own KV changed {when}: {checked}")

    def _reuse_intact(self) -> None:
        """A destination that gave up and reused its blocks still holds its own bytes."""
        if not self.reused:
            return
        time.sleep(SETTLE)
        checked = self.d.command("verify_tokens", blocks=D_BLOCKS, num_tokens=TOKENS, seed=REUSE_SEED)
        if checked["bad_count"]:
            self.verdict.problems.append("a late device copy overwrote D's blocks after LOAD_FAILED")

    def _sidecars_clean(self, alive: list[str], sides: list[SidecarProcess]) -> None:
        for side in sides:
            if not health(side):
                self.verdict.problems.append(f"{side.name.upper()}'s sidecar is not SERVING")
                continue
            deadline = time.monotonic() + 10
            while True:
                # After a peer's sidecar died, the peer entry of a handshake is legitimate history.
                left = [item for item in leftover(status(side), alive) if not item.startswith("peers")]
                if not left or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            if left:
                self.verdict.problems.append(f"{side.name.upper()}'s sidecar kept {left}")

    def _fresh(self, seed: int = FRESH_SEED) -> None:
        """A new request moves intact (after replacing what was killed)."""
        try:
            self.move("fresh", seed, check=True)
        except (AssertionError, TimeoutError) as exc:
            self.verdict.problems.append(f"a fresh pull afterwards failed: {' '.join(str(exc).split())[:200]}")

    def engine_killed(self, in_flight: bool) -> None:
        assert self.p.command("fill_tokens", blocks=P_BLOCKS, num_tokens=TOKENS, seed=SEED)["ok"]
        remote = {"address": self.p.peer_address, "engine_id": "P", "request_id": "req",
                  "blocks": [P_BLOCKS], "num_tokens": TOKENS}  # fmt: skip
        assert self.p.command("submit", request_id="req", blocks=[P_BLOCKS], num_tokens=TOKENS)["ok"]
        if in_flight:
            self._arm()
            assert self.d.command("pull", request_id="req-d", blocks=[D_BLOCKS], remote=remote)["ok"]
            time.sleep(0.3)  # the copy is enqueued and held on the device
            self._kill(self.p.process.pid)
        else:
            self._kill(self.p.process.pid)
            refused = self.d.command("pull", request_id="req-d", blocks=[D_BLOCKS], remote=remote)
        self.p.process.wait(10)
        if not in_flight and not refused["ok"]:  # an explicit answer: P's engine is gone
            self.verdict.learned, self.verdict.data = "D: refused 0.0s", "failed explicitly"
        else:
            self._dest_outcome("req")
        self._control_intact(self.d, "after P's engine died")
        self._reuse_intact()
        self._sidecars_clean(["D"], [self.p_side, self.d_side])
        # A new engine P: a new allocation, quite likely at the addresses the dead one had.
        self.p = self.engine(self.p_side, "P", "producer")
        self._fresh()

    def sidecar_killed(self, victim: str) -> None:
        side = self.p_side if victim == "P" else self.d_side
        survivor = self.d_side if victim == "P" else self.p_side
        assert self.p.command("fill_tokens", blocks=P_BLOCKS, num_tokens=TOKENS, seed=SEED)["ok"]
        self._arm()
        reply = start_transfer(self.p, self.d, "pull", "req", P_BLOCKS, D_BLOCKS, TOKENS)
        assert reply["ok"], reply
        time.sleep(0.3)
        assert side.process is not None
        self._kill(side.process.pid)
        side.process.wait(10)
        orphan = self.p if victim == "P" else self.d
        other = self.d if victim == "P" else self.p
        if victim == "D":
            self._terminal(self.p, "req", {"FINISHED_SENDING", "LEASE_EXPIRED", "LOAD_FAILED"})
        else:
            self._dest_outcome("req")
        if not self._stream_closed(orphan):
            self.verdict.problems.append(f"{orphan.engine_id}'s event stream did not close with its sidecar")
        time.sleep(HELD_SECONDS)  # the held copy, if it outlived the sidecar, has run by now
        if orphan.process.poll() is not None:
            self.verdict.problems.append(f"{orphan.engine_id}'s engine died with its sidecar")
            return
        self._control_intact(orphan, "after its sidecar died")
        if victim == "P":
            checked = self.p.command("verify_tokens", blocks=P_BLOCKS, num_tokens=TOKENS, seed=SEED)
            if checked["bad_count"]:
                self.verdict.problems.append("P's request blocks changed after its sidecar died")
        self._reuse_intact()
        self._sidecars_clean([other.engine_id], [survivor])
        # Restart: the sidecar comes back; the orphaned engine is replaced (a real shim re-registers
        # by itself; the simulated engine does not) and the node moves a request intact.
        orphan.kill()
        (self.workdir / "arm").unlink(missing_ok=True)  # the restarted sidecar holds nothing
        side.start()
        if victim == "P":
            self.p = self.engine(self.p_side, "P", "producer")
        else:
            self.d = self.engine(self.d_side, "D", "consumer")
        self._fresh()

    def copy_never_completes(self) -> None:
        """The copy is held on the device past its deadline: D must NOT get its blocks back (no
        LOAD_FAILED: a late copy would land in blocks vLLM reused) while the copy may still run;
        once the device gets going, D gets LOAD_FAILED, reuses its blocks, and they stay intact."""
        assert self.p.command("fill_tokens", blocks=P_BLOCKS, num_tokens=TOKENS, seed=SEED)["ok"]
        self._arm()
        reply = start_transfer(self.p, self.d, "pull", "req", P_BLOCKS, D_BLOCKS, TOKENS)
        assert reply["ok"], reply
        self.fault_at = time.monotonic()  # the copy is held from now on
        time.sleep(TRANSFER_TIMEOUT + 2.0)  # past the deadline: the sidecar holds D's blocks
        early = [e for e in self.d.events_for("req-d") if e["event"] in ("FINISHED_RECEIVING", "LOAD_FAILED")]
        if early:
            self.verdict.problems.append(f"D got {early[0]['event']} while the copy could still write its blocks")
        rows = [row.state for row in status(self.d_side).requests if row.request_id == "req-d"]
        if rows != ["reading"]:  # the operator sees the request still reading (and the held-copies metric)
            self.verdict.problems.append(f"D's sidecar shows the held request as {rows}, not reading")
        for side in (self.p_side, self.d_side):  # the loop answers while the device waits
            if not health(side):
                self.verdict.problems.append(f"{side.name.upper()}'s sidecar stopped answering while the copy hung")
        (self.workdir / "release").touch()  # the device gets going again: the held copy runs now
        self.fault_at = time.monotonic()
        event = self._terminal(self.d, "req-d", {"FINISHED_RECEIVING", "LOAD_FAILED"})
        if event is not None:
            at = event["received_at"] - self.fault_at
            self.verdict.learned = f"D: {event['event']} {at:.1f}s after the release"
            if event["event"] != "LOAD_FAILED":
                self.verdict.problems.append(f"D got {event['event']} for a copy past its deadline")
            else:
                self.verdict.data = "failed explicitly, blocks held until the copy completed"
                assert self.d.command("fill_tokens", blocks=D_BLOCKS, num_tokens=TOKENS, seed=REUSE_SEED)["ok"]
                self.reused = True
        self._terminal(self.p, "req", {"FINISHED_SENDING", "LEASE_EXPIRED", "LOAD_FAILED"})
        self._reuse_intact()
        self._control_intact(self.d, "after the hung copy was released")
        self._sidecars_clean(["P", "D"], [self.p_side, self.d_side])
        self._fresh()

    def hold_mode(self) -> str:
        """How the hold ran in the copying sidecars (their stderr, in their logs)."""
        text = "".join(side.log_path.read_text(errors="replace") for side in (self.p_side, self.d_side))
        if "held on the device" in text:
            return "device"
        if "hiding the copy's completion" in text:
            return "hidden completion (stream memory operations refused)"
        return "not installed" if "not installed" in text else "no copy was held"
