"""A simulated engine: plain Python owning KV blocks in shared memory and talking to the sidecar
through ``SidecarClient``, standing in for vLLM's workers in the demo, the benchmark and tests.

Each worker owns one ``SharedBuffer`` (or, with ``memory="cuda"``, a ``CudaBuffer``: GPU memory
exported over CUDA IPC) laid out as ``KvLayout`` (layer-major), registers it, and drains its
WatchEvents stream. Block contents are a deterministic pattern of (seed, rank, layer,
block), so a receiver can check every byte without seeing the sender. For engines that differ in
block size, layout or TP, ``fill_tokens`` / ``verify_tokens`` write and check *logical* content
instead: a pattern of (seed, layer, token, global head) placed by the engine's own layout
(``HND``/``LBHNC``: heads x tokens x chunk per block; ``NHD``/``LBNHC``: tokens x heads x chunk),
computed here independently of the sidecar's planning code.

Run as a process (``python -m engine_shim.simulated ...``) it is driven by JSON lines on stdin and
reports events as JSON lines on stdout; see ``main``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine_shim.client import EventWatcher, SidecarClient, remote
from engine_shim.cuda_memory import CudaBuffer
from engine_shim.memory import KvLayout, SharedBuffer, kv_registration
from engine_shim.messages import block_ids_of
from kvsidecar.v1 import common_pb2, engine_pb2

ROLES = {
    "producer": common_pb2.ENGINE_ROLE_PRODUCER,
    "consumer": common_pb2.ENGINE_ROLE_CONSUMER,
    "both": common_pb2.ENGINE_ROLE_BOTH,
}


def pattern(seed: int, rank: int, layer: int, block: int, length: int) -> np.ndarray:
    """Deterministic, block-distinct bytes."""
    rng = np.random.default_rng([seed, rank, layer, block])
    return rng.integers(0, 256, size=length, dtype=np.uint8)


def logical_content(seed: int, layer: int, num_tokens: int, heads: int, chunk: int) -> np.ndarray:
    """(tokens, heads, chunk) bytes of one layer of a request: the same whatever the engine's
    block size, layout or TP size (token t's content does not depend on num_tokens)."""
    rng = np.random.default_rng([seed, layer])
    return rng.integers(0, 256, size=(num_tokens, heads, chunk), dtype=np.uint8)


HEAD_MAJOR_NAMES = frozenset({"HND", "LBHNC"})


KvBuffer = SharedBuffer | CudaBuffer
MEMORY_KINDS = ("shm", "cuda")


def make_buffer(memory: str, size: int, populate: bool, cuda_device: int) -> KvBuffer:
    """A worker's KV buffer: shared memory (DRAM), or GPU memory exported over CUDA IPC."""
    if memory == "cuda":
        return CudaBuffer(size, cuda_device)
    if memory == "shm":
        return SharedBuffer(size, populate=populate)
    raise ValueError(f"unknown memory kind {memory!r} (one of {', '.join(MEMORY_KINDS)})")


@dataclass
class SimulatedWorker:
    rank: int
    buffer: KvBuffer
    client: SidecarClient
    watcher: EventWatcher | None = None
    registration: engine_pb2.RegisterWorkerResponse | None = None


@dataclass
class SimulatedEngine:
    """An engine with ``tp_size`` workers, each with its own KV buffer and event stream. With
    ``memory="cuda"`` the buffers are GPU memory: the content methods below work on each buffer's
    host mirror and move it to or from the device around their work."""

    socket_path: Path
    engine_id: str
    role: str
    layout: KvLayout
    tp_size: int = 1
    compat_factors: dict[str, str] = field(default_factory=lambda: {"model": "simulated"})
    memory: str = "shm"
    cuda_device: int = 0
    workers: list[SimulatedWorker] = field(default_factory=list)

    def start(
        self,
        timeout: float = 10.0,
        populate: bool = True,
        on_event: Callable[[int, engine_pb2.Event], None] | None = None,
        on_closed: Callable[[int, str], None] | None = None,
    ) -> None:
        """Register every worker and open its event stream. With ``on_event`` events go to the
        callback (with the worker's rank) instead of the watcher's queue."""
        per_rank = self.layout
        for rank in range(self.tp_size):
            buffer = make_buffer(self.memory, per_rank.total_bytes, populate, self.cuda_device)
            client = SidecarClient(self.socket_path, timeout=timeout)
            worker = SimulatedWorker(rank, buffer, client)
            self.workers.append(worker)
            worker.registration = client.register_worker(
                kv_registration(
                    self.engine_id,
                    ROLES[self.role],
                    per_rank,
                    [buffer.export()],
                    tp_rank=rank,
                    tp_size=self.tp_size,
                    compat_factors=self.compat_factors,
                )
            )
            worker.watcher = EventWatcher(
                client,
                self.engine_id,
                rank,
                on_closed=None if on_closed is None else functools.partial(on_closed, rank),
                on_event=None if on_event is None else functools.partial(on_event, rank),
            )
            worker.watcher.wait_connected(timeout)

    @property
    def client(self) -> SidecarClient:
        return self.workers[0].client

    @property
    def peer_address(self) -> str:
        registration = self.workers[0].registration
        assert registration is not None
        return registration.peer_address

    def block(self, rank: int, layer: int, block: int) -> np.ndarray:
        return self.workers[rank].buffer.array[self.layout.block_slice(layer, block)]

    def download(self) -> None:
        """Bring every worker's host mirror up to date (no-op for shared memory)."""
        for worker in self.workers:
            worker.buffer.download()

    def upload(self) -> None:
        """Send every worker's host mirror to its device (no-op for shared memory)."""
        for worker in self.workers:
            worker.buffer.upload()

    def fill(self, block_ids: Sequence[int], seed: int) -> None:
        self.download()
        for worker in self.workers:
            for layer in range(self.layout.num_layers):
                for block in block_ids:
                    self.block(worker.rank, layer, block)[:] = pattern(
                        seed, worker.rank, layer, block, self.layout.block_len
                    )
        self.upload()

    @property
    def chunk(self) -> int:
        """Bytes of one token of one head (K and V)."""
        return self.layout.block_len // (self.layout.block_size * self.layout.num_kv_heads)

    def _token_major(self, rank: int, layer: int, block: int) -> np.ndarray:
        """Block ``block`` of ``layer`` on ``rank`` as a (tokens, heads, chunk) view."""
        size, heads = self.layout.block_size, self.layout.num_kv_heads
        raw = self.block(rank, layer, block)
        if self.layout.kv_layout in HEAD_MAJOR_NAMES:
            return raw.reshape(heads, size, self.chunk).transpose(1, 0, 2)
        return raw.reshape(size, heads, self.chunk)

    def _token_blocks(self, block_ids: Sequence[int], first_token: int, num_tokens: int) -> list[tuple[int, int, int]]:
        """(block, first token, tokens) of each listed block holding part of [first_token, num_tokens)."""
        size = self.layout.block_size
        out = []
        for index, block in enumerate(block_ids):
            start = first_token + index * size
            if start < num_tokens:
                out.append((block, start, min(size, num_tokens - start)))
        return out

    def fill_tokens(self, block_ids: Sequence[int], num_tokens: int, seed: int) -> None:
        """Write tokens [0, num_tokens) of a request into ``block_ids`` (logical content)."""
        heads = self.layout.num_kv_heads
        self.download()
        for layer in range(self.layout.num_layers):
            content = logical_content(seed, layer, num_tokens, heads * self.tp_size, self.chunk)
            for worker in self.workers:
                mine = content[:, worker.rank * heads : (worker.rank + 1) * heads]
                for block, start, count in self._token_blocks(block_ids, 0, num_tokens):
                    self._token_major(worker.rank, layer, block)[:count] = mine[start : start + count]
        self.upload()

    def verify_tokens(self, block_ids: Sequence[int], first_token: int, num_tokens: int, seed: int) -> dict[str, Any]:
        """Check tokens [first_token, num_tokens) in ``block_ids`` (the first block starts at
        ``first_token``) against the logical content, and that the last block's slots past
        ``num_tokens`` are still zero (nothing was written beyond the request)."""
        heads = self.layout.num_kv_heads
        self.download()
        bad: list[list[int]] = []
        tail_dirty = 0
        checked = 0
        for layer in range(self.layout.num_layers):
            content = logical_content(seed, layer, num_tokens, heads * self.tp_size, self.chunk)
            for worker in self.workers:
                mine = content[:, worker.rank * heads : (worker.rank + 1) * heads]
                for block, start, count in self._token_blocks(block_ids, first_token, num_tokens):
                    view = self._token_major(worker.rank, layer, block)
                    wrong = np.flatnonzero((view[:count] != mine[start : start + count]).any(axis=(1, 2)))
                    checked += count
                    if wrong.size:
                        bad.append([worker.rank, layer, start + int(wrong[0]), int(wrong.size)])
                    tail_dirty += int(view[count:].any())
        return {"checked_tokens": checked, "bad": bad[:8], "bad_count": len(bad), "tail_dirty": tail_dirty}

    def clear(self) -> None:
        for worker in self.workers:
            worker.buffer.array[:] = 0
        self.upload()

    def close(self) -> None:
        for worker in self.workers:
            try:
                worker.client.unregister_worker(self.engine_id, worker.rank)
            except Exception:
                pass
            if worker.watcher is not None:
                worker.watcher.cancel()
            worker.client.close()
            worker.buffer.close()
        self.workers.clear()


# --- process mode -----------------------------------------------------------------------------


def _blocks(value: Any) -> list[list[int]]:
    return [list(group) for group in value]


def main(argv: list[str] | None = None) -> int:
    """Run a simulated engine as a process.

    stdin, one JSON object per line: {"op": "fill", "blocks": [..], "seed": n} |
    {"op": "fill_tokens", "blocks": [..], "num_tokens", "seed"} | {"op": "clear"} |
    {"op": "verify_tokens", "blocks": [..], "first_token", "num_tokens", "seed"} (replies
    checked_tokens, bad_count, bad: [[rank, layer, first bad token, count]], tail_dirty) |
    {"op": "submit", "request_id", "blocks": [[..]], "num_tokens"?, "transfer_id"?, "lease_seconds"?, "mode"?,
     "vouched_until_ms"?} (replies push_matched, voucher_key (hex), voucher_seconds) |
    {"op": "pull", "request_id", "blocks": [[..]], "remote": {address, engine_id, request_id, blocks, voucher?
     (hex), vouched_until_ms?}} |
    {"op": "expect_push", "request_id", "blocks": [[..]], "remote": {...}, "timeout_seconds"?} |
    {"op": "hold", "request_id", "blocks": [[..]], "conversation_id"?, "ttl_seconds"?, "block_hashes"?: [hex]} |
    {"op": "query", "address"?, "conversation_id"?, "request_id"?, "block_hashes"?: [hex], "known_peers"?,
     "timeout_seconds"?} |
    {"op": "release", "request_id"} | {"op": "exit"}.
    stdout: {"ready": {...}} once registered, then {"event": KIND, "request_id", "rank", ...} per
    event and {"reply": op, "ok": bool, ...} per command.
    """
    parser = argparse.ArgumentParser(prog="engine_shim.simulated")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--role", choices=sorted(ROLES), required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=1, help="KV heads per worker")
    parser.add_argument("--model", default="simulated", help="compat factor 'model'")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--kv-layout", default="LBHNC", help="HND/LBHNC, NHD/LBNHC, or any opaque name")
    parser.add_argument("--head-size", type=int, default=0, help="stated head size (0: not stated)")
    parser.add_argument("--dtype", default="", help="stated KV dtype ('': not stated)")
    parser.add_argument(
        "--memory", choices=MEMORY_KINDS, default="shm", help="where the KV lives: shared memory, or a GPU (CUDA IPC)"
    )
    parser.add_argument("--cuda-device", type=int, default=0, help="the GPU of --memory cuda")
    args = parser.parse_args(argv)

    lock = threading.Lock()

    def emit(payload: dict[str, Any]) -> None:
        with lock:
            sys.stdout.write(json.dumps(payload) + "\n")
            sys.stdout.flush()

    layout = KvLayout(
        args.layers,
        args.blocks,
        args.block_len,
        block_size=args.block_size,
        kv_layout=args.kv_layout,
        num_kv_heads=args.heads,
        total_num_kv_heads=args.heads * args.tp,
        head_size=args.head_size,
        dtype=args.dtype,
    )

    def forward(rank: int, event: engine_pb2.Event) -> None:
        emit(
            {
                "event": engine_pb2.EventKind.Name(event.kind),
                "request_id": event.request_id,
                "rank": rank,
                "reason": event.reason,
                "failed_block_ids": list(event.failed_block_ids),
                "bytes": event.bytes,
            }
        )

    def closed(rank: int, reason: str) -> None:
        emit({"event": "STREAM_CLOSED", "rank": rank, "reason": reason})

    engine = SimulatedEngine(
        args.socket, args.engine_id, args.role, layout, args.tp, {"model": args.model}, args.memory, args.cuda_device
    )
    engine.start(on_event=forward, on_closed=closed)
    emit(
        {
            "ready": {
                "peer_address": engine.peer_address,
                "buffers": [str(w.buffer.path) for w in engine.workers if isinstance(w.buffer, SharedBuffer)],
                "pid": os.getpid(),
            }
        }
    )
    client = engine.client
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            command = json.loads(line)
            op = command.get("op")
            try:
                if op == "exit":
                    break
                if op == "fill":
                    engine.fill(command["blocks"], command["seed"])
                    result: dict[str, Any] = {}
                elif op == "fill_tokens":
                    engine.fill_tokens(command["blocks"], command["num_tokens"], command["seed"])
                    result = {}
                elif op == "verify_tokens":
                    result = engine.verify_tokens(
                        command["blocks"], command.get("first_token", 0), command["num_tokens"], command["seed"]
                    )
                elif op == "clear":
                    engine.clear()
                    result = {}
                elif op == "submit":
                    response = client.submit_blocks(
                        engine.engine_id,
                        command["request_id"],
                        _blocks(command["blocks"]),
                        num_tokens=command.get("num_tokens", 0),
                        transfer_id=command.get("transfer_id", ""),
                        lease_seconds=command.get("lease_seconds", 0.0),
                        mode=command.get("mode", 0),
                        vouched_until_ms=command.get("vouched_until_ms", 0),
                    )
                    result = {
                        "push_matched": response.push_matched,
                        "voucher_key": response.voucher_key.hex(),
                        "voucher_seconds": response.voucher_seconds,
                    }
                elif op in ("pull", "expect_push"):
                    spec = command["remote"]
                    target = remote(
                        spec.get("address", ""),
                        spec["engine_id"],
                        spec.get("request_id", ""),
                        _blocks(spec.get("blocks", [])),
                        spec.get("tp_size", 0),
                        spec.get("num_tokens", 0),
                        bytes.fromhex(spec.get("voucher", "")),
                        spec.get("vouched_until_ms", 0),
                    )
                    if op == "pull":
                        client.pull(
                            engine.engine_id,
                            command["request_id"],
                            _blocks(command["blocks"]),
                            target,
                            transfer_id=command.get("transfer_id", ""),
                        )
                        result = {}
                    else:
                        reply = client.expect_push(
                            engine.engine_id,
                            command["request_id"],
                            _blocks(command["blocks"]),
                            target,
                            transfer_id=command.get("transfer_id", ""),
                            timeout_seconds=command.get("timeout_seconds", 0.0),
                        )
                        result = {"registered": reply.registered, "matched": reply.matched}
                elif op == "hold":
                    reply_hold = client.hold_blocks(
                        engine.engine_id, command["request_id"], _blocks(command["blocks"]),
                        conversation_id=command.get("conversation_id", ""), num_tokens=command.get("num_tokens", 0),
                        ttl_seconds=command.get("ttl_seconds", 0.0),
                        block_hashes=[bytes.fromhex(h) for h in command.get("block_hashes", [])],
                    )  # fmt: skip
                    result = {"ttl_seconds": reply_hold.ttl_seconds, "released_holds": reply_hold.released_holds}
                elif op == "query":
                    found = client.query_cache(
                        engine.engine_id, command.get("address", ""), command.get("conversation_id", ""),
                        command.get("request_id", ""), [bytes.fromhex(h) for h in command.get("block_hashes", [])],
                        command.get("known_peers", False), command.get("timeout_seconds", 0.0),
                    )  # fmt: skip
                    result = {
                        "entries": [
                            {"engine_id": e.engine_id, "request_id": e.request_id, "address": e.address,
                             "blocks": block_ids_of(e.block_ids), "num_tokens": e.num_tokens,
                             "expires_in_seconds": e.expires_in_seconds, "matched_blocks": e.matched_blocks,
                             "block_hashes": [h.hex() for h in e.block_hashes]}
                            for e in found.entries
                        ],
                        "unreachable": list(found.unreachable),
                    }  # fmt: skip
                elif op == "release":
                    client.release(engine.engine_id, command["request_id"], reason=command.get("reason", ""))
                    result = {}
                else:
                    raise ValueError(f"unknown op {op!r}")
                emit({"reply": op, "ok": True, "id": command.get("id"), **result})
            except Exception as exc:
                emit({"reply": op, "ok": False, "id": command.get("id"), "error": str(exc)})
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
