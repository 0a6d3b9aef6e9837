"""The GPU path measured on one GPU: KV in CUDA memory moved through kvsidecar (two sidecars, one
sidecar, host staging), against raw NIXL between two processes, a batched device-to-device copy
and a pinned device-to-host copy, in one invocation; every row judged against issue 33's targets.

Requests of 1 MiB to 1 GiB (8 layers x 128 KiB blocks x 1..1024 blocks). Paths:
- ``kvsidecar-pull`` / ``kvsidecar-push``: two sidecar daemons (one per "node"), the simulated
  engines' KV in GPU memory exported over CUDA IPC; SubmitBlocks -> FINISHED_RECEIVING;
- ``kvsidecar-pull-same-node`` / ``-push-same-node``: both engines on one sidecar;
- ``host-staging-pull`` / ``-push``: two sidecars made to stage through their own pinned host
  buffers (``STAGING_ARGS``: the cross-node path, proven on one machine);
- floors: ``raw-nixl-2proc`` (a NIXL agent here WRITEs the producer's GPU blocks into GPU memory a
  second process allocated and registered itself, what an in-engine connector does),
  ``batched-d2d-copy`` (``torch._foreach_copy_`` over the request's coalesced runs: one batched
  launch per request, the device's own limit) and ``pinned-d2h-copy`` (the same blocks into a
  pinned host tensor, PCIe's limit).

Every row carries ``ucx_protocol`` (what UCX chose for GPU memory, parsed from the
``UCX_PROTO_INFO=y`` tables the sidecar daemons and this process printed; ``device_copy`` or
``host_staging`` where the sidecar's trace says the bytes did not go through UCX's GPU transports)
and ``nixl_transfer_gbps`` (the request's bytes / its transfers' own post -> done time, from the
sidecar's Trace RPC; for a floor, its own rate). Rows are verified byte for byte (the destination
is poisoned before the last run and compared after it). The targets (``bench.gpu_proof_parts``)
are judged per row; a row whose bytes went by UCX's "software emulation" fails the run loudly.

Run: ``python -m bench.gpu_proof --json bench/out/gpu-proof.json`` on a machine with a CUDA GPU,
PyTorch with CUDA and nixl-cu13 (or cu12); ``bench/gpu_run.sh`` does it with the GPU tests.
Exit status: 0 all rows measured and verified, none emulated; 1 otherwise; 3 with ``--strict``
when a target was missed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.gpu_proof_parts import (
    BATCHED_D2D,
    PINNED_D2H,
    RAW_NIXL,
    emulated,
    emulation_rows,
    judge_all,
    parse_proto_info,
    protocol_for,
    summary,
    timelines_transfer,
)

KIB, MIB = 1024, 1024 * 1024
LAYERS, BLOCK_BYTES = 8, 128 * KIB  # one block of every layer: 1 MiB per block id
SIZES_IN_BLOCKS = (1, 4, 16, 64, 256, 1024)
TRACE_SAMPLE = 8  # requests per row whose traces give nixl_transfer_gbps
# Makes two sidecars on one node move GPU KV through their own pinned host buffers, as between
# nodes (gpu-staging's setting, COORD.md: "always" stages even where a device copy could run).
STAGING_ARGS = ("--set", "host_staging.mode=always")
Transfer = Callable[[Sequence[int], Sequence[int], int], list[float]]


def segment_pairs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src first, dst first, count) runs that are consecutive on both sides (pure)."""
    pairs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if pairs and s == pairs[-1][0] + pairs[-1][2] and d == pairs[-1][1] + pairs[-1][2]:
            pairs[-1] = (pairs[-1][0], pairs[-1][1], pairs[-1][2] + 1)
        else:
            pairs.append((s, d, 1))
    return pairs


class _Views:
    """(destination views, source views) of a request's coalesced runs in every layer, made once
    per block lists: the timed copy does no per-block Python work."""

    def __init__(self, source: Any, target: Any) -> None:
        self.source, self.target = source, target
        self._cache: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[list[Any], list[Any]]] = {}

    def get(self, src: Sequence[int], dst: Sequence[int]) -> tuple[list[Any], list[Any]]:
        key = (tuple(src), tuple(dst))
        if key not in self._cache:
            targets, sources = [], []
            for s, d, n in segment_pairs(src, dst):
                for layer in range(self.source.shape[0]):
                    targets.append(self.target[layer, d : d + n])
                    sources.append(self.source[layer, s : s + n])
            self._cache[key] = (targets, sources)
        return self._cache[key]


def _tensor(buffer: Any) -> Any:
    """A worker buffer's bytes as a torch tensor: the GPU tensor, or (CPU dry run) the shm array."""
    import torch

    return buffer.tensor if hasattr(buffer, "tensor") else torch.from_numpy(buffer.array)


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _batched_copy(pair) -> Transfer:  # type: ignore[no-untyped-def]
    import torch

    from sidecar.tools.bench import layer_major

    views = _Views(
        layer_major(_tensor(pair.producer.workers[0].buffer), pair.layout),
        layer_major(_tensor(pair.consumer.workers[0].buffer), pair.layout),
    )
    foreach = getattr(torch, "_foreach_copy_", None)

    def copy(src: Sequence[int], dst: Sequence[int], count: int) -> list[float]:
        targets, sources = views.get(src, dst)
        started = time.perf_counter()
        if foreach is not None:
            foreach(targets, sources)  # one batched launch (multi-tensor apply) per request
        else:
            for target, source in zip(targets, sources, strict=True):
                target.copy_(source, non_blocking=True)
        _synchronize()
        return [time.perf_counter() - started]

    return copy


class _PinnedTarget:
    """The pinned device-to-host floor: the producer's GPU blocks into a pinned host tensor of its
    own, with the poison / verify ``measure`` expects of a pair."""

    def __init__(self, pair) -> None:  # type: ignore[no-untyped-def]
        import torch

        from sidecar.tools.bench import layer_major

        self.layout = pair.layout
        self._torch = torch
        self.source = layer_major(_tensor(pair.producer.workers[0].buffer), pair.layout)
        pinned = torch.cuda.is_available()  # the CPU dry run has nothing to pin for
        self.host = torch.empty(tuple(self.source.shape), dtype=torch.uint8, pin_memory=pinned)
        self._views = _Views(self.source, self.host)

    def poison(self, d_blocks: Sequence[int]) -> None:
        self.host[:, list(d_blocks)] = 0xA5

    def verify(self, p_blocks: Sequence[int], d_blocks: Sequence[int]) -> bool:
        expected = self.source[:, list(p_blocks)].cpu()
        return bool(self._torch.equal(expected, self.host[:, list(d_blocks)]))

    def copy(self, src: Sequence[int], dst: Sequence[int], count: int) -> list[float]:
        targets, sources = self._views.get(src, dst)
        started = time.perf_counter()
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source, non_blocking=True)
        _synchronize()
        return [time.perf_counter() - started]


class _TimeUp(Exception):
    """SIGTERM (``timeout`` in gpu_run.sh): stop measuring, report what was measured."""


_time_up = threading.Event()


def _on_sigterm(signum: int, frame: Any) -> None:
    if not _time_up.is_set():  # once: the shutdown that follows must not be interrupted again
        _time_up.set()
        raise _TimeUp


@contextmanager
def _stdout_to(path: Path) -> Iterator[None]:
    """Send this process's file descriptor 1 (where UCX prints its protocol tables) to ``path``
    for the block, Python's own prints going to the real stdout meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    capture = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(capture, 1)
    os.close(capture)
    real = sys.stdout
    sys.stdout = open(saved, "w", buffering=1, closefd=False)  # noqa: SIM115 (closed below)
    try:
        yield
    finally:
        ctypes.CDLL(None).fflush(None)  # UCX writes through C stdio: flush what it buffered
        sys.stdout.flush()
        sys.stdout.close()
        sys.stdout = real
        os.dup2(saved, 1)
        os.close(saved)


def _trace_rate(pair, since: int, request_bytes: int) -> tuple[str, float | None]:  # type: ignore[no-untyped-def]
    """(path, GB/s) from the traces of the last TRACE_SAMPLE requests completed since ``since``."""
    done = list(pair.completed)[since:][-TRACE_SAMPLE:]
    paths: collections.Counter[str] = collections.Counter()
    rates = []
    for completed in done:
        path, seconds = timelines_transfer(pair.trace(completed.request_id))
        if path:
            paths[path] += 1
        if seconds > 0:
            rates.append(request_bytes / seconds / 1e9)
    path = paths.most_common(1)[0][0] if paths else ""
    return path, statistics.median(rates) if rates else None


def _row_dict(row) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    return {**asdict(row), **row.extra, "checked": "verified" not in row.extra}


def render(rows: Sequence[Any]) -> str:
    headers = ["path", "MiB", "p50 ms", "p99 ms", "GB/s", "transfer GB/s", "ucx_protocol", "x floor", "target", "ok"]
    table = [headers]
    for row in rows:
        extra = row.extra
        rate = extra.get("nixl_transfer_gbps")
        ratio = extra.get("ratio_vs_floor")
        met = extra.get("target_met")
        table.append([
            row.path, str(row.bytes // MIB), f"{row.p50_ms:.3f}", f"{row.p99_ms:.3f}", f"{row.gbps:.2f}",
            f"{rate:.2f}" if rate is not None else "-", str(extra.get("ucx_protocol", "")),
            f"{ratio:.2f}" if ratio is not None else "-", "-" if met is None else "met" if met else "MISSED",
            "yes" if row.verified else "-" if "verified" in extra else "NO",
        ])  # fmt: skip
    widths = [max(len(line[i]) for line in table) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _save(json_path: Path, rows: list[Any], failures: list[dict[str, str]], notes: list[str]) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"rows": [_row_dict(row) for row in rows], "failures": failures, "summary": notes}
    json_path.write_text(json.dumps(payload, indent=2, default=str))


def run(json_path: Path, runs: int, sizes: Sequence[int], strict: bool = False, cpu_dry_run: bool = False) -> int:
    from engine_shim.cuda_memory import cuda_available

    problem = cuda_available()
    if problem is not None and not cpu_dry_run:
        print(f"bench.gpu_proof needs a CUDA GPU: {problem}", file=sys.stderr)
        return 2
    out = json_path.parent
    out.mkdir(parents=True, exist_ok=True)
    os.environ["UCX_PROTO_INFO"] = "y"  # this process, the raw floor's child and every sidecar daemon
    workroot = Path(tempfile.mkdtemp(prefix="kvs-gpu-", dir="/tmp"))
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with _stdout_to(out / "ucx-proto-bench.log"):
            rows, failures, pairs_of = _measure_all(workroot, runs, sizes, "shm" if cpu_dry_run else "cuda")
        _attribute_protocols(rows, pairs_of, workroot, out, "host" if cpu_dry_run else "cuda")
    finally:
        for log in workroot.glob("*/*.log"):
            shutil.copy2(log, out / f"sidecar-{log.parent.name}-{log.name}")
        shutil.rmtree(workroot, ignore_errors=True)
    judgements = judge_all([_row_dict(row) for row in rows])
    for row, verdict in zip(rows, judgements, strict=True):
        row.extra.update(target=verdict.target, ratio_vs_floor=verdict.ratio, target_met=verdict.met,
                         target_problems=verdict.problems)  # fmt: skip
    notes = summary(judgements)
    print(render(rows))
    for failure in failures:
        print(f"FAILED {failure['scenario']} {failure['path']}: {failure['error']}")
    print("\n" + "\n".join(notes))
    emulated_rows = emulation_rows([_row_dict(row) for row in rows])
    if emulated_rows:
        notes.append(f"FAIL: software emulation in {len(emulated_rows)} rows: {', '.join(emulated_rows)}")
        print("\n" + "!" * 72 + f"\n{notes[-1]}\n" + "!" * 72, file=sys.stderr)
    unverified = [
        f"{row.path} {row.bytes // MIB} MiB" for row in rows if "verified" not in row.extra and not row.verified
    ]
    if unverified:
        notes.append(f"FAIL: not verified byte for byte: {', '.join(unverified)}")
        print(notes[-1], file=sys.stderr)
    _save(json_path, rows, failures, notes)
    print(f"\n{len(rows)} rows, {len(failures)} failures -> {json_path}")
    if not rows or failures or emulated_rows or unverified:
        return 1
    return 3 if strict and any(verdict.met is False for verdict in judgements) else 0


def _measure_all(
    workroot: Path, runs: int, sizes: Sequence[int], memory: str = "cuda"
) -> tuple[list[Any], list[dict[str, str]], dict[str, str]]:
    """Every path at every size; returns (rows, failures, {path: the pair label whose logs say
    what UCX chose for it})."""
    import torch

    from engine_shim.memory import KvLayout
    from sidecar.tools.bench import RawNixl, Row, Scenario, kvsidecar_path, measure
    from sidecar.tools.launcher import DaemonProcess
    from sidecar.tools.workload import TransferPair

    started = time.monotonic()
    layout = KvLayout(LAYERS, max(sizes) + 16, BLOCK_BYTES)
    rows: list[Row] = []
    failures: list[dict[str, str]] = []
    device = torch.cuda.get_device_name(0) if memory == "cuda" else "CPU dry run (shared memory)"

    def progress(message: str) -> None:
        print(f"  [{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    def pair(label: str, args: Sequence[str], same_node: bool) -> TransferPair:
        folder = workroot / label
        return TransferPair(layout, memory=memory, same_node=same_node, workdir=folder,
                            make_daemon=lambda name: DaemonProcess(folder, name, list(args)))  # fmt: skip

    with contextlib.ExitStack() as stack:
        started_pairs: dict[str, TransferPair] = {}
        for label, args, same_node in (("two", (), False), ("one", (), True), ("staging", STAGING_ARGS, False)):
            try:
                started_pairs[label] = stack.enter_context(pair(label, args, same_node))
            except Exception as exc:  # e.g. a sidecar without the staging setting: the rest still run
                failures.append({"scenario": "setup", "path": f"{label} pair", "error": repr(exc)})
                traceback.print_exc()
        if "two" not in started_pairs:
            return rows, failures, {}
        progress("engines registered; filling the producers")
        for seed, each in enumerate(started_pairs.values(), start=1):
            each.fill_producer(seed=seed)
        two = started_pairs["two"]
        pinned = _PinnedTarget(two)
        # path -> (owner for poison/verify, the transfer, the pair whose trace and logs it has)
        paths: dict[str, tuple[Any, Transfer, Any]] = {}
        for label, prefix in (("two", "kvsidecar-"), ("one", "kvsidecar-"), ("staging", "host-staging-")):
            if label in started_pairs:
                each = started_pairs[label]
                suffix = "-same-node" if label == "one" else ""
                for mode in ("pull", "push"):
                    paths[f"{prefix}{mode}{suffix}"] = (each, kvsidecar_path(each, mode), each)
        paths[BATCHED_D2D] = (two, _batched_copy(two), None)
        paths[PINNED_D2H] = (pinned, pinned.copy, None)
        labels = {id(each): label for label, each in started_pairs.items()}
        pairs_of = {name: labels[id(traced)] for name, (_, _, traced) in paths.items() if traced is not None}
        raw = None
        try:
            # The target child prints its address on stdout first: UCX's tables must not go there.
            raw = RawNixl(two, separate_process=True, target_wrapper=["env", "-u", "UCX_PROTO_INFO"])
            paths[RAW_NIXL] = (two, raw.transfer, None)
            pairs_of[RAW_NIXL] = "bench"
        except Exception as exc:  # the other paths' figures still count
            failures.append({"scenario": "setup", "path": RAW_NIXL, "error": repr(exc)})
            traceback.print_exc()
        try:
            for blocks in sizes:
                if _time_up.is_set():
                    failures.append({"scenario": f"{blocks} MiB and larger", "path": "all", "error": "time bound"})
                    break
                scenario = Scenario(BLOCK_BYTES * LAYERS, blocks, "adjacent", 1)
                for name, (owner, transfer, traced) in paths.items():
                    progress(f"{blocks} MiB {name}")
                    since = len(traced.completed) if traced is not None else 0
                    try:
                        check = name != RAW_NIXL  # it writes into the second process's own memory
                        row = measure(owner, scenario, name, transfer, runs, 256 * MIB, check)
                    except _TimeUp:
                        failures.append({"scenario": scenario.name, "path": name, "error": "time bound (SIGTERM)"})
                        break
                    except Exception as exc:  # one broken path must not hide the others' figures
                        failures.append({"scenario": scenario.name, "path": name, "error": repr(exc)})
                        traceback.print_exc()
                        continue
                    row.extra["device"] = device
                    if traced is not None:
                        path, rate = _trace_rate(traced, since, scenario.request_bytes)
                        row.extra.update(trace_path=path, nixl_transfer_gbps=rate)
                    else:
                        row.extra.update(nixl_transfer_gbps=row.gbps)
                        if name != RAW_NIXL:
                            row.extra["ucx_protocol"] = "n/a: a torch copy in this process"
                    rows.append(row)
        finally:
            if raw is not None:
                raw.close()
    return rows, failures, pairs_of


def _attribute_protocols(
    rows: list[Any], pairs_of: dict[str, str], workroot: Path, out: Path, memory: str = "cuda"
) -> None:
    """Fill each row's ``ucx_protocol``: the trace's path where the bytes bypassed UCX's GPU
    transports, else what UCX chose for the row's operation on GPU memory in the logs of the
    processes that moved it (read once the daemons exited: UCX's stdio output is flushed then)."""
    logs: dict[str, str] = {"bench": (out / "ucx-proto-bench.log").read_text(errors="replace")}
    for folder in workroot.iterdir():
        logs[folder.name] = "\n".join(log.read_text(errors="replace") for log in sorted(folder.glob("*.log")))
    choices = {label: parse_proto_info(text) for label, text in logs.items()}
    for row in rows:
        if "ucx_protocol" in row.extra:
            continue
        label = pairs_of.get(row.path, "")
        path = row.extra.get("trace_path", "")
        op = "READ" if row.path.endswith(("pull", "pull-same-node")) else "WRITE"
        mine = choices.get(label, [])
        if path == "device_copy":
            row.extra["ucx_protocol"] = path
            continue
        if path == "host_staging":
            # The staged bytes still cross UCX between host memory and the peer's memory. A pull
            # from a GPU producer is staged on both ends (target_staging: host -> host); a push
            # into a GPU consumer is not staged on its side yet and is reached by emulation,
            # and the row must say so.
            staged = [c for c in mine if c.op == op and "host" in (c.src, c.dst)]
            texts = list(dict.fromkeys(f"{c.text} ({c.src}->{c.dst})" for c in staged))
            row.extra["ucx_protocol"] = f"host_staging; UCX: {'; '.join(texts)}" if texts else "host_staging"
            continue
        found = protocol_for(mine, op, memory, memory)
        fallback = [c.text for c in emulated(mine, memory)]
        row.extra["ucx_protocol"] = found or (fallback[0] if fallback else f"unknown: no UCX table for {memory} {op}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.gpu_proof", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per size and path (median GB/s)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES_IN_BLOCKS), help="MiB per request")
    parser.add_argument("--json", type=Path, default=Path("bench/out/gpu-proof.json"))
    parser.add_argument("--strict", action="store_true", help="exit 3 when a target is missed")
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="engines' KV in shared memory, no GPU: checks the harness (rows, protocols, targets), not the GPU path",
    )
    args = parser.parse_args(argv)
    return run(args.json, args.runs, args.sizes, args.strict, args.cpu_dry_run)


if __name__ == "__main__":
    sys.exit(main())
