"""A simulated engine: plain Python owning KV blocks in shared memory and talking to the sidecar
through ``SidecarClient``, standing in for vLLM's workers in the demo, the benchmark and tests.

Each worker owns one ``SharedBuffer`` laid out as ``KvLayout`` (layer-major), registers it, and
drains its WatchEvents stream. Block contents are a deterministic pattern of (seed, rank, layer,
block), so a receiver can check every byte without seeing the sender.

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
from engine_shim.memory import KvLayout, SharedBuffer, kv_registration
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


@dataclass
class SimulatedWorker:
    rank: int
    buffer: SharedBuffer
    client: SidecarClient
    watcher: EventWatcher | None = None
    registration: engine_pb2.RegisterWorkerResponse | None = None


@dataclass
class SimulatedEngine:
    """An engine with ``tp_size`` workers, each with its own shared buffer and event stream."""

    socket_path: Path
    engine_id: str
    role: str
    layout: KvLayout
    tp_size: int = 1
    compat_factors: dict[str, str] = field(default_factory=lambda: {"model": "simulated"})
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
            buffer = SharedBuffer(per_rank.total_bytes, populate=populate)
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

    def fill(self, block_ids: Sequence[int], seed: int) -> None:
        for worker in self.workers:
            for layer in range(self.layout.num_layers):
                for block in block_ids:
                    self.block(worker.rank, layer, block)[:] = pattern(
                        seed, worker.rank, layer, block, self.layout.block_len
                    )

    def clear(self) -> None:
        for worker in self.workers:
            worker.buffer.array[:] = 0

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
    {"op": "submit", "request_id", "blocks": [[..]], "transfer_id"?, "lease_seconds"?, "mode"?} |
    {"op": "pull", "request_id", "blocks": [[..]], "remote": {address, engine_id, request_id, blocks}} |
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
    args = parser.parse_args(argv)

    lock = threading.Lock()

    def emit(payload: dict[str, Any]) -> None:
        with lock:
            sys.stdout.write(json.dumps(payload) + "\n")
            sys.stdout.flush()

    layout = KvLayout(
        args.layers, args.blocks, args.block_len, num_kv_heads=args.heads, total_num_kv_heads=args.heads * args.tp
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

    engine = SimulatedEngine(args.socket, args.engine_id, args.role, layout, args.tp, {"model": args.model})
    engine.start(on_event=forward, on_closed=closed)
    emit(
        {
            "ready": {
                "peer_address": engine.peer_address,
                "buffers": [str(worker.buffer.path) for worker in engine.workers],
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
                elif op == "submit":
                    response = client.submit_blocks(
                        engine.engine_id,
                        command["request_id"],
                        _blocks(command["blocks"]),
                        transfer_id=command.get("transfer_id", ""),
                        lease_seconds=command.get("lease_seconds", 0.0),
                        mode=command.get("mode", 0),
                    )
                    result = {"push_matched": response.push_matched}
                elif op in ("pull", "expect_push"):
                    spec = command["remote"]
                    target = remote(
                        spec.get("address", ""),
                        spec["engine_id"],
                        spec.get("request_id", ""),
                        _blocks(spec.get("blocks", [])),
                        spec.get("tp_size", 0),
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
                             "blocks": [list(g.ids) for g in e.block_ids.groups], "num_tokens": e.num_tokens,
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
