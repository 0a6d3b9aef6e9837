"""Driving simulated engines (``EngineProcess``) through a pull or a push, and reading a sidecar's
trace: the steps the daemon-tier tests (and tests/multihost) share. Called from the test's thread."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine_shim.client import engine_channel
from kvsidecar.v1 import common_pb2, engine_pb2_grpc
from tests.support.processes import EngineProcess, SidecarProcess

# kv()'s default shape: the pull tests' engines (tests/daemon/test_pull.py).
LAYERS, BLOCKS, BLOCK_LEN = 3, 96, 8192
# engine_pair()'s default shape: the push tests' engines (tests/daemon/test_push.py).
PUSH_SHAPE = {"layers": 2, "blocks": 128, "block_len": 4096}
PUSH = 2  # common_pb2.TRANSFER_MODE_PUSH


def kv(path: Path, layers: int = LAYERS, blocks: int = BLOCKS, block_len: int = BLOCK_LEN) -> np.ndarray:
    """A read-only view of an engine's KV file: [layer, block, byte]."""
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(layers, blocks, block_len))


def start_pull(
    consumer: EngineProcess,
    producer: EngineProcess,
    request_id: str,
    d_blocks: list[int],
    p_request: str,
    p_blocks: list[int],
) -> dict:
    """D's Pull of P's request ``p_request`` (one KV cache group); returns the engine's reply."""
    remote = {
        "address": producer.peer_address,
        "engine_id": producer.engine_id,
        "request_id": p_request,
        "blocks": [p_blocks],
    }
    return consumer.command("pull", request_id=request_id, blocks=[d_blocks], remote=remote)


def pull_and_wait(
    producer: EngineProcess,
    consumer: EngineProcess,
    request: str,
    p_blocks: list[int],
    d_blocks: list[int],
    timeout: float = 30.0,
) -> list[dict]:
    assert producer.command("submit", request_id=request, blocks=[p_blocks])["ok"]
    reply = start_pull(consumer, producer, f"{request}-d", d_blocks, request, p_blocks)
    assert reply["ok"], reply
    return consumer.wait_event(f"{request}-d", timeout)


def engine_pair(
    sidecars, engines, same: bool = False, p_args: list[str] | None = None, d_args: list[str] | None = None, **shape
) -> tuple[EngineProcess, EngineProcess, SidecarProcess, SidecarProcess]:
    shape = {**PUSH_SHAPE, **shape}
    p_side = sidecars("p", args=p_args)
    d_side = p_side if same else sidecars("d", args=d_args)
    producer = engines(p_side, "P", "producer", **shape)
    consumer = engines(d_side, "D", "consumer", **shape)
    return producer, consumer, p_side, d_side


def expect(consumer: EngineProcess, producer: EngineProcess, request_id: str, blocks: list[int], **extra) -> dict:
    remote = {"address": producer.peer_address, "engine_id": producer.engine_id, **extra.pop("remote", {})}
    reply = consumer.command("expect_push", request_id=request_id, blocks=[blocks], remote=remote, **extra)
    assert reply["ok"], reply
    return reply


def trace_over_socket(sidecar: SidecarProcess, **query: str) -> common_pb2.TraceResponse:
    with engine_channel(sidecar.socket) as channel:
        response: common_pb2.TraceResponse = engine_pb2_grpc.EngineServiceStub(channel).Trace(
            common_pb2.TraceRequest(**query), timeout=10
        )
        return response
