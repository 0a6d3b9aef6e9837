"""The GPU path measured on a GPU: KV in CUDA memory moved through kvsidecar, against raw NIXL
VRAM -> VRAM between two processes and a device-to-device copy, in one invocation; then the
host-staging path (GPU -> host shared memory, kvsidecar between the host buffers, host -> GPU).

Requests of 1 MiB to 1 GiB (8 layers x 128 KiB blocks x 1..1024 blocks). Paths:
- ``kvsidecar-pull`` / ``kvsidecar-push``: two sidecar daemons (one per "node"), the simulated
  engines' KV in GPU memory exported over CUDA IPC; SubmitBlocks -> FINISHED_RECEIVING;
- ``kvsidecar-pull-same-node``: both engines on one sidecar (the node-local P/D case);
- ``raw-nixl-2proc``: a NIXL agent here WRITEs the producer's GPU blocks into GPU memory a second
  process allocated and registered itself (what an in-engine connector does), polling for DONE;
- ``cuda-memcpy``: ``torch`` device-to-device copy of the same blocks in this process (the GPU's
  own limit; no second process);
- ``host-staging-pull``: the producer's blocks copied GPU -> its host shared memory, a kvsidecar
  pull between the two host buffers, then host -> GPU on the consumer; the latency is the sum.

Rows: p50/p99 latency over every request, GB/s as the median over runs, the ratio to raw NIXL of
the same size, and ``verified`` (the destination was poisoned before the last run and compared
with the source after it). Run: ``python -m bench.gpu_proof --json bench/results/gpu-proof.json``
on a machine with a CUDA GPU, PyTorch with CUDA and nixl-cu13 (or cu12); see bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

KIB, MIB = 1024, 1024 * 1024
LAYERS, BLOCK_BYTES = 8, 128 * KIB  # one block of every layer: 1 MiB per block id
SIZES_IN_BLOCKS = (1, 4, 16, 64, 256, 1024)


def _cuda_copy(pair) -> Callable[[Sequence[int], Sequence[int], int], list[float]]:  # type: ignore[no-untyped-def]
    import torch

    from sidecar.tools.bench import copy_blocks, layer_major

    source = layer_major(pair.producer.workers[0].buffer.tensor, pair.layout)
    target = layer_major(pair.consumer.workers[0].buffer.tensor, pair.layout)

    def copy(src: Sequence[int], dst: Sequence[int], count: int) -> list[float]:
        started = time.perf_counter()
        copy_blocks(source, target, src, dst)
        torch.cuda.synchronize()
        return [time.perf_counter() - started]

    return copy


def _host_staging(gpu_pair, host_pair, mode: str):  # type: ignore[no-untyped-def]
    """GPU -> host shm on P, kvsidecar between the host buffers, host shm -> GPU on D."""
    import torch

    from sidecar.tools.bench import copy_blocks, kvsidecar_path, layer_major

    p_gpu = layer_major(gpu_pair.producer.workers[0].buffer.tensor, gpu_pair.layout)
    d_gpu = layer_major(gpu_pair.consumer.workers[0].buffer.tensor, gpu_pair.layout)
    p_host = layer_major(torch.from_numpy(host_pair.producer.workers[0].buffer.array), host_pair.layout)
    d_host = layer_major(torch.from_numpy(host_pair.consumer.workers[0].buffer.array), host_pair.layout)
    transfer = kvsidecar_path(host_pair, mode)

    def run(src: Sequence[int], dst: Sequence[int], count: int) -> list[float]:
        started = time.perf_counter()
        copy_blocks(p_gpu, p_host, src, src)
        transfer(src, dst, 1)
        copy_blocks(d_host, d_gpu, dst, dst)
        torch.cuda.synchronize()
        return [time.perf_counter() - started]

    return run


class _Staged:
    """The host-staging path's owner for ``measure``: poisoning reaches both of the consumer's
    copies (GPU and host), so a run whose kvsidecar hop moved nothing cannot verify."""

    def __init__(self, gpu_pair, host_pair) -> None:  # type: ignore[no-untyped-def]
        self.layout = gpu_pair.layout
        self._gpu, self._host = gpu_pair, host_pair

    def poison(self, d_blocks: Sequence[int]) -> None:
        self._gpu.poison(d_blocks)
        self._host.poison(d_blocks)

    def verify(self, p_blocks: Sequence[int], d_blocks: Sequence[int]) -> bool:
        return bool(self._gpu.verify(p_blocks, d_blocks))


def _save(json_path: Path, rows: list, failures: list[dict[str, str]]) -> None:  # type: ignore[type-arg]
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"rows": [asdict(row) for row in rows], "failures": failures}, indent=2))


def run(json_path: Path, runs: int, sizes: Sequence[int]) -> int:
    from engine_shim.cuda_memory import cuda_available
    from engine_shim.memory import KvLayout
    from sidecar.tools.bench import RawNixl, Row, Scenario, kvsidecar_path, measure, render
    from sidecar.tools.workload import TransferPair

    problem = cuda_available()
    if problem is not None:
        print(f"bench.gpu_proof needs a CUDA GPU: {problem}", file=sys.stderr)
        return 2
    import torch

    started = time.monotonic()
    layout = KvLayout(LAYERS, max(sizes) + 16, BLOCK_BYTES)
    rows: list[Row] = []
    failures: list[dict[str, str]] = []
    device = torch.cuda.get_device_name(0)

    def progress(message: str) -> None:
        print(f"  [{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    with (
        TransferPair(layout, memory="cuda") as pair,
        TransferPair(layout, memory="cuda", same_node=True) as local_pair,
        TransferPair(layout) as host_pair,
    ):
        progress("engines registered; filling the producers")
        pair.fill_producer(seed=1)
        local_pair.fill_producer(seed=2)
        paths = {
            "kvsidecar-pull": (pair, kvsidecar_path(pair, "pull")),
            "kvsidecar-push": (pair, kvsidecar_path(pair, "push")),
            "kvsidecar-pull-same-node": (local_pair, kvsidecar_path(local_pair, "pull")),
            "cuda-memcpy": (pair, _cuda_copy(pair)),
            "host-staging-pull": (_Staged(pair, host_pair), _host_staging(pair, host_pair, "pull")),
        }
        raw = None
        try:
            raw = RawNixl(pair, separate_process=True)
            paths["raw-nixl-2proc"] = (pair, raw.transfer)
        except Exception as exc:  # the other paths' figures still count
            failures.append({"scenario": "setup", "path": "raw-nixl-2proc", "error": repr(exc)})
            traceback.print_exc()
        try:
            for blocks in sizes:
                scenario = Scenario(BLOCK_BYTES * LAYERS, blocks, "adjacent", 1)
                found: dict[str, Row] = {}
                for name, (owner, path) in paths.items():
                    progress(f"{blocks} MiB {name}")
                    try:
                        check = name != "raw-nixl-2proc"  # it writes into the second process's own memory
                        found[name] = measure(owner, scenario, name, path, runs, 256 * MIB, check)
                    except Exception as exc:  # one broken path must not hide the others' figures
                        failures.append({"scenario": scenario.name, "path": name, "error": repr(exc)})
                        traceback.print_exc()
                floor = found["raw-nixl-2proc"].gbps if "raw-nixl-2proc" in found else 0.0
                for row in found.values():
                    row.ratio_vs_raw_nixl = row.gbps / floor if floor else None
                    row.extra["device"] = device
                rows.extend(found.values())
                _save(json_path, rows, failures)  # a run cut short by its time bound keeps what it measured
        finally:
            if raw is not None:
                raw.close()
    print(render(rows))
    for failure in failures:
        print(f"FAILED {failure['scenario']} {failure['path']}: {failure['error']}")
    _save(json_path, rows, failures)
    print(f"\n{len(rows)} rows, {len(failures)} failures in {time.monotonic() - started:.0f}s -> {json_path}")
    checked = [row for row in rows if "verified" not in row.extra]
    return 0 if rows and not failures and all(row.verified for row in checked) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.gpu_proof", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per size and path (median GB/s)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES_IN_BLOCKS), help="MiB per request")
    parser.add_argument("--json", type=Path, default=Path("bench/out/gpu-proof.json"))
    args = parser.parse_args(argv)
    return run(args.json, args.runs, args.sizes)


if __name__ == "__main__":
    sys.exit(main())
