"""The pure parts of ``bench.gpu_proof``: what UCX chose (its ``UCX_PROTO_INFO=y`` tables), the
transfer's own time from a request's trace, and issue 33's targets judged per row.

Nothing here needs a GPU, PyTorch or NIXL, so ``bench/tests/test_gpu_proof_parts.py`` checks it on any
machine; ``bench.gpu_proof`` (GPU only) measures and hands its rows here. Called from the
benchmark's one thread.

UCX prints one table per (endpoint configuration, operation, memory types) the first time it
selects a protocol for it, through its logger (stdout unless ``UCX_LOG_FILE``), e.g.::

    [1795896921.640336] [vm:3943 :0]   | remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[1] |
    [1795896921.640336] [vm:3943 :0]   +--------+-------------+---------------+
    [1795896921.640336] [vm:3943 :0]   | 0..inf | zero-copy   | cuda_ipc/cuda |

A header names the operation and where the bytes go; each row below it says, for a size range,
the protocol and the lanes (transports). ``software emulation`` means UCX found no transport that
can touch that memory remotely and moves it through active messages (tcp/lo on one host): the
slow path issue 33 measured.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MIB = 1024 * 1024

# Paths (row names) and the floors the targets compare them with.
RAW_NIXL = "raw-nixl-2proc"
BATCHED_D2D = "batched-d2d-copy"
PINNED_D2H = "pinned-d2h-copy"
FLOORS = (RAW_NIXL, BATCHED_D2D, PINNED_D2H)
TWO_SIDECARS = ("kvsidecar-pull", "kvsidecar-push")
ONE_SIDECAR = ("kvsidecar-pull-same-node", "kvsidecar-push-same-node")
HOST_STAGING = ("host-staging-pull", "host-staging-push")

# What a sidecar's trace calls the path a transfer took (COORD.md: ``path=<name>`` in the detail
# of its completion event); "nixl" is the path every transfer took before issue 33.
TRACE_PATHS = ("nixl", "device_copy", "host_staging")
# Seconds from post to completion of one transfer, by the names the data plane records them under
# (``measured_s`` of a completion event): NIXL's own, and a device copy's or a staged transfer's.
TRANSFER_KEYS = ("nixl_transfer", "copy_transfer")
COMPLETION_KINDS = ("nixl_completion", "copy_completion")

EMULATION = "software emulation"

_PREFIX = re.compile(r"^\[(?P<time>[0-9.]+)\]\s+\[(?P<host>[^:\]]+):\s*(?P<pid>\d+)\s*:\s*\d+\]\s*")
_RANGE = re.compile(r"^\d+(\.\d+)?[KMGT]?B?(\s*\.\.\s*(\d+(\.\d+)?[KMGT]?B?|inf))?$", re.IGNORECASE)
_OPERATION = re.compile(
    r"remote memory (?P<kind>read|write) by (?P<call>\S+)"
    r"(?: (?:from (?P<src>.+?) to (?P<dst>.+)|into (?P<into>.+?) from (?P<from>.+)))?$"
)


@dataclass(frozen=True)
class ProtoChoice:
    """One row of a UCX_PROTO_INFO table: for ``size_range`` of ``operation``, ``protocol`` over
    ``lanes``. ``op`` is READ (ucp_get) or WRITE (ucp_put), "" for other operations; ``src`` and
    ``dst`` the memory types ("host", "cuda", ...) the bytes come from and go to."""

    pid: str
    operation: str
    op: str
    src: str
    dst: str
    size_range: str
    protocol: str
    lanes: str

    @property
    def text(self) -> str:
        return f"{self.protocol} | {self.lanes}" if self.lanes else self.protocol


def memory_type(text: str) -> str:
    """``cuda/GPU0`` -> ``cuda``, ``host memory`` -> ``host`` (pure)."""
    text = text.strip()
    if text.startswith("host"):
        return "host"
    return text.split("/", 1)[0].split()[0] if text else ""


def _operation(header: str) -> tuple[str, str, str]:
    """(op, src, dst) of a table header; ("", "", "") for what is not a remote memory access."""
    match = _OPERATION.search(header)
    if match is None:
        return "", "", ""
    op = "READ" if match["kind"] == "read" else "WRITE"
    if match["src"] is not None:
        return op, memory_type(match["src"]), memory_type(match["dst"])
    if match["into"] is not None:  # a get: into <local> from <remote>
        return op, memory_type(match["from"]), memory_type(match["into"])
    return op, "", ""


def parse_proto_info(text: str) -> list[ProtoChoice]:
    """Every protocol choice in ``text`` (a process's output with ``UCX_PROTO_INFO=y``, other lines
    ignored), in the order printed. Tables of several processes may be interleaved: a header
    applies to the rows of the same process id that follow it."""
    choices: list[ProtoChoice] = []
    current: dict[str, str] = {}  # pid -> the last table header seen from it
    for raw in text.splitlines():
        prefix = _PREFIX.match(raw)
        pid = prefix["pid"] if prefix else ""
        line = raw[prefix.end() :] if prefix else raw.strip()
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        cells = [cell for cell in cells if cell]
        if not cells:
            continue
        headers = [cell for cell in cells if " by " in cell]
        if headers:
            current[pid] = headers[-1]
            continue
        if not _RANGE.match(cells[0]) or len(cells) < 2 or pid not in current:
            continue
        header = current[pid]
        op, src, dst = _operation(header)
        choices.append(ProtoChoice(pid, header, op, src, dst, cells[0], cells[1], " | ".join(cells[2:])))
    return choices


def protocol_for(choices: Iterable[ProtoChoice], op: str, src: str = "cuda", dst: str = "cuda") -> str:
    """What UCX chose for ``op`` from ``src`` to ``dst`` memory: the distinct choices joined by
    "; " (in the order first printed), or "" when no table covers it."""
    seen: list[str] = []
    for choice in choices:
        if choice.op == op and choice.src == src and choice.dst == dst and choice.text not in seen:
            seen.append(choice.text)
    return "; ".join(seen)


def emulated(choices: Iterable[ProtoChoice], memory: str = "cuda") -> list[ProtoChoice]:
    """The remote memory accesses that touch ``memory`` and fell back to software emulation."""
    return [c for c in choices if c.op and EMULATION in c.protocol and memory in (c.src, c.dst)]


# --- the transfer's own time, from a request's trace --------------------------------------------


@dataclass(frozen=True)
class TraceEvent:
    """The parts of a trace event this module reads (``sidecar.core.trace._Event`` has them)."""

    kind: str
    monotonic: float
    detail: str = ""
    measured: Mapping[str, float] = field(default_factory=dict)


_PATH_TOKEN = re.compile(r"\bpath=(?P<path>[a-z_]+)")


def transfer_path(events: Iterable[Any]) -> str:
    """The path the request's transfers took, from ``path=<name>`` in their completion events'
    detail: one name, several joined by "+", or "nixl" when no event names one (pre-issue-33)."""
    paths: list[str] = []
    completions = 0
    for event in events:
        if event.kind not in COMPLETION_KINDS and not any(key in event.measured for key in TRANSFER_KEYS):
            continue
        completions += 1
        match = _PATH_TOKEN.search(event.detail or "")
        if match and match["path"] not in paths:
            paths.append(match["path"])
    if not paths:
        return "nixl" if completions else ""
    return "+".join(paths)


def transfer_seconds(events: Sequence[Any]) -> float:
    """Seconds the request's transfers took, post to completion, as the sidecar measured them: the
    union of the intervals [done - transfer, done] of its completion events (overlapping ranks'
    or chunks' transfers count once). ``done`` is when the event was recorded, less the time the
    loop took to resume after the completion was seen (``loop_resume``). 0.0: no transfer traced."""
    intervals: list[tuple[float, float]] = []
    for event in events:
        seconds = next((event.measured[key] for key in TRANSFER_KEYS if key in event.measured), None)
        if seconds is None or seconds <= 0:
            continue
        end = event.monotonic - float(event.measured.get("loop_resume", 0.0))
        intervals.append((end - float(seconds), end))
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def timelines_transfer(timelines: Iterable[Any]) -> tuple[str, float]:
    """(path, seconds) over a request's timelines on every sidecar: the timeline that ran the
    transfers has the completion events (D's for a pull, P's for a push); each timeline has its
    own time axis, so the longest one's union counts."""
    best_path, best_seconds = "", 0.0
    for timeline in timelines:
        seconds = transfer_seconds(timeline.events)
        path = transfer_path(timeline.events)
        if seconds > best_seconds:
            best_path, best_seconds = path, seconds
        elif path and not best_path:
            best_path = path
    return best_path, best_seconds


# --- rows and issue 33's targets ---------------------------------------------------------------

P50_SLACK_MS = 1.5  # two sidecars: p50 <= raw NIXL's p50 + this, at every size
RAW_SHARE = 0.8  # two sidecars: the transfer's own GB/s >= this x raw NIXL's, from 16 MiB
D2D_SHARE = 0.8  # one sidecar: the transfer's own GB/s >= this x a batched device copy's, from 16 MiB
D2H_SHARE = 0.5  # host staging: end to end GB/s >= this x a pinned device->host copy's, from 64 MiB
RATE_FROM_BYTES = 16 * MIB
STAGING_FROM_BYTES = 64 * MIB


def zero_copy(protocol: str) -> bool:
    """A protocol that moves GPU memory without emulation: a device copy by the sidecar, or UCX's
    zero-copy over cuda_ipc."""
    if protocol == "device_copy":
        return True
    return bool(protocol) and EMULATION not in protocol and "zero-copy" in protocol and "cuda_ipc" in protocol


@dataclass
class Judgement:
    """A row judged against its targets: ``met`` None where none applies at its size."""

    path: str
    bytes: int
    target: str = ""
    ratio: float | None = None
    met: bool | None = None
    problems: list[str] = field(default_factory=list)


def _floor(rows: Sequence[Mapping[str, Any]], path: str, size: int) -> Mapping[str, Any] | None:
    return next((row for row in rows if row["path"] == path and row["bytes"] == size), None)


def judge(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> Judgement:
    """One row (a dict with path, bytes, p50_ms, gbps, nixl_transfer_gbps, ucx_protocol, verified,
    checked) against issue 33's targets, the floors taken from ``rows`` at the same size."""
    path, size = str(row["path"]), int(row["bytes"])
    verdict = Judgement(path, size)
    protocol = str(row.get("ucx_protocol", ""))
    if EMULATION in protocol:
        verdict.problems.append(f"UCX moved it by {EMULATION} ({protocol})")
    if row.get("checked", True) and not row.get("verified", False):
        verdict.problems.append("not verified byte for byte")
    parts: list[str] = []
    ratios: list[float] = []
    rate = row.get("nixl_transfer_gbps")
    if path in TWO_SIDECARS + ONE_SIDECAR:
        parts.append("zero-copy or device_copy")
        if not zero_copy(protocol):
            verdict.problems.append(f"protocol {protocol or 'unknown'} is neither cuda_ipc zero-copy nor device_copy")
    if path in TWO_SIDECARS:
        raw = _floor(rows, RAW_NIXL, size)
        parts.append(f"p50 <= raw p50 + {P50_SLACK_MS} ms")
        if raw is None:
            verdict.problems.append("no raw NIXL row at this size to compare with")
        else:
            if row["p50_ms"] > raw["p50_ms"] + P50_SLACK_MS:
                verdict.problems.append(f"p50 {row['p50_ms']:.3f} ms > raw {raw['p50_ms']:.3f} + {P50_SLACK_MS} ms")
            if size >= RATE_FROM_BYTES:
                parts.append(f"transfer GB/s >= {RAW_SHARE} x raw")
                ratio = (rate or 0.0) / raw["gbps"] if raw["gbps"] else 0.0
                ratios.append(ratio)
                if ratio < RAW_SHARE:
                    verdict.problems.append(f"transfer {rate or 0:.2f} GB/s = {ratio:.2f} x raw {raw['gbps']:.2f}")
    if path in ONE_SIDECAR and size >= RATE_FROM_BYTES:
        d2d = _floor(rows, BATCHED_D2D, size)
        parts.append(f"transfer GB/s >= {D2D_SHARE} x batched device copy")
        if d2d is None:
            verdict.problems.append("no batched device copy row at this size")
        else:
            ratio = (rate or 0.0) / d2d["gbps"] if d2d["gbps"] else 0.0
            ratios.append(ratio)
            if ratio < D2D_SHARE:
                verdict.problems.append(f"transfer {rate or 0:.2f} GB/s = {ratio:.2f} x device copy {d2d['gbps']:.2f}")
    if path in HOST_STAGING and size >= STAGING_FROM_BYTES:
        d2h = _floor(rows, PINNED_D2H, size)
        parts.append(f"end to end GB/s >= {D2H_SHARE} x pinned D2H copy")
        if d2h is None:
            verdict.problems.append("no pinned device-to-host copy row at this size")
        else:
            ratio = row["gbps"] / d2h["gbps"] if d2h["gbps"] else 0.0
            ratios.append(ratio)
            if ratio < D2H_SHARE:
                verdict.problems.append(f"{row['gbps']:.2f} GB/s = {ratio:.2f} x pinned copy {d2h['gbps']:.2f}")
    verdict.target = "; ".join(parts)
    verdict.ratio = min(ratios) if ratios else None
    if parts or verdict.problems:
        verdict.met = not verdict.problems
    return verdict


def judge_all(rows: Sequence[Mapping[str, Any]]) -> list[Judgement]:
    return [judge(row, rows) for row in rows]


def summary(judgements: Sequence[Judgement]) -> list[str]:
    """The met/missed lines printed under the table (the last one: the count)."""
    lines = []
    for item in judgements:
        if item.met is False:
            lines.append(f"MISSED {item.path} {item.bytes // MIB} MiB: {'; '.join(item.problems)}")
    judged = [item for item in judgements if item.met is not None]
    met = sum(1 for item in judged if item.met)
    lines.append(f"targets: {met} of {len(judged)} rows met, {len(judged) - met} missed")
    return lines


def emulation_rows(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Rows whose bytes went by software emulation (the proof fails loudly on any)."""
    return [
        f"{row['path']} {int(row['bytes']) // MIB} MiB" for row in rows if EMULATION in str(row.get("ucx_protocol", ""))
    ]
