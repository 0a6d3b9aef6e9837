"""The GPU path on a real GPU: simulated engines in their own processes keep their KV in CUDA
memory and export it over CUDA IPC as a GPU shim would (``engine_shim.cuda_memory``); sidecar
daemons open the handles; pulls and pushes move it, and every token is checked on the receiving
GPU. Node-local VRAM (both engines on one sidecar, or a peer sidecar's VRAM engine on this node)
moves by one batched device copy per request, never through NIXL: each such case checks the
transfer's trace says ``path=device_copy`` (``sidecar/dataplane/device_copy.py``).

Skipped, with the reason, where PyTorch sees no CUDA GPU (this project's CI machine). Runs on a GPU
machine with ``pytest tests/daemon/test_gpu.py`` (``bench/README.md``, "The GPU path", has the command
used and its results).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from engine_shim.client import SidecarClient, engine_channel
from engine_shim.cuda_memory import CudaBuffer, cuda_available
from engine_shim.memory import KvLayout, kv_registration
from kvsidecar.v1 import common_pb2, engine_pb2_grpc
from tests.support.processes import EngineProcess, SidecarProcess, start_transfer

NO_GPU = cuda_available()
pytestmark = pytest.mark.skipif(NO_GPU is not None, reason=f"needs a CUDA GPU: {NO_GPU}")

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, CHUNK = 4, 64, 4, 16, 256
TOKENS = 600  # 38 blocks, the last one partial


def _engine(engines, side: SidecarProcess, name: str, role: str, memory: str, **shape) -> EngineProcess:
    options = {"layers": LAYERS, "blocks": BLOCKS, "heads": HEADS, "block_size": BLOCK_SIZE, "kv_layout": "HND"}
    options |= shape
    heads = options["heads"]
    options.setdefault("block_len", BLOCK_SIZE * heads * CHUNK)
    return engines(side, name, role, memory=memory, head_size=CHUNK // 4, dtype="float16", **options)


def _completions(socket: Path, request: str) -> list[str]:
    """The detail of every transfer completion of ``request`` in the trace (both sidecars),
    asked of the sidecar listening on ``socket``."""
    with engine_channel(socket) as channel:
        response = engine_pb2_grpc.EngineServiceStub(channel).Trace(
            common_pb2.TraceRequest(request_id=request), timeout=10
        )
    return [
        event.detail
        for part in response.sidecars
        for timeline in part.requests
        for event in timeline.events
        if event.kind == "nixl_completion"
    ]


def _paths(socket: Path, request: str) -> set[str]:
    """The ``path=`` of every transfer completion of ``request`` (``_completions``)."""
    details = _completions(socket, request)
    return {word.split("=", 1)[1] for detail in details for word in detail.split() if word.startswith("path=")}


def _node_local(topology: str, p_memory: str, d_memory: str, mode: str) -> bool:
    """Whether the initiator has both sides' memory mapped (or can map it): one sidecar, or the
    other side in VRAM on this node (a peer's DRAM is not opened here)."""
    if topology == "one-sidecar":
        return "cuda" in (p_memory, d_memory)
    target = p_memory if mode == "pull" else d_memory
    return target == "cuda"


def _move(
    producer: EngineProcess,
    consumer: EngineProcess,
    mode: str,
    request: str,
    seed: int,
    device_copy: SidecarProcess | None = None,
) -> None:
    """One request of TOKENS tokens from producer to consumer; every token checked on arrival;
    with ``device_copy`` (the consumer's sidecar), the transfer must have been a device copy."""
    p_blocks = list(range(3, 3 + -(-TOKENS // BLOCK_SIZE)))
    d_blocks = list(reversed(range(BLOCKS - len(p_blocks), BLOCKS)))
    assert producer.command("fill_tokens", blocks=p_blocks, num_tokens=TOKENS, seed=seed)["ok"]
    assert consumer.command("clear")["ok"]
    reply = start_transfer(producer, consumer, mode, request, p_blocks, d_blocks, TOKENS)
    assert reply["ok"], reply
    received = consumer.wait_event(f"{request}-d", 60)
    assert [e["event"] for e in received] == ["FINISHED_RECEIVING"] * len(received), received
    assert {e["event"] for e in producer.wait_event(request, 60)} == {"FINISHED_SENDING"}
    check = consumer.command("verify_tokens", blocks=d_blocks, first_token=0, num_tokens=TOKENS, seed=seed)
    assert check["ok"] and check["bad_count"] == 0, check
    assert check["checked_tokens"] == TOKENS * LAYERS * consumer.tp, check
    if device_copy is not None:
        assert _paths(device_copy.socket, f"{request}-d") == {"device_copy"}


# (topology, P's memory, D's memory): GPU to GPU on both topologies; GPU to host and back between nodes.
CASES = [
    ("two-sidecars", "cuda", "cuda"),
    ("one-sidecar", "cuda", "cuda"),
    ("two-sidecars", "cuda", "shm"),
    ("two-sidecars", "shm", "cuda"),
]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("topology", "p_memory", "d_memory"), CASES, ids=["-".join(case) for case in CASES])
def test_kv_in_gpu_memory_moves_intact(
    sidecars, engines, topology: str, p_memory: str, d_memory: str, mode: str
) -> None:
    p_side = sidecars("p")
    d_side = p_side if topology == "one-sidecar" else sidecars("d")
    producer = _engine(engines, p_side, "P", "producer", p_memory)
    consumer = _engine(engines, d_side, "D", "consumer", d_memory)
    local = _node_local(topology, p_memory, d_memory, mode)
    for serial in range(3):  # the first request handshakes and wires up; later ones reuse it
        checked = d_side if local else None
        _move(producer, consumer, mode, f"{mode}-{serial}", seed=100 + serial, device_copy=checked)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_gpu_engines_of_different_tp_and_layout_convert(sidecars, engines, mode: str) -> None:
    """P at TP 2 with token-major blocks, D at TP 1 head-major: heads are gathered from two GPU
    buffers and tokens re-laid-out, with no staging through the CPU."""
    p_side, d_side = sidecars("p"), sidecars("d")
    producer = _engine(engines, p_side, "P", "producer", "cuda", tp=2, heads=HEADS // 2, kv_layout="NHD")
    consumer = _engine(engines, d_side, "D", "consumer", "cuda")
    _move(producer, consumer, mode, f"convert-{mode}", seed=7, device_copy=d_side)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_consumer_checking_integrity_fails_a_gpu_producers_request_with_the_reason(
    sidecars, engines, mode: str
) -> None:
    """Digests are hashed from the CPU: the GPU producer's sidecar refuses them instead of reading
    device memory (which would crash it), and D's load fails saying why; P's blocks are freed."""
    p_side, d_side = sidecars("p"), sidecars("d", args=["--integrity", "digest"])
    producer = _engine(engines, p_side, "P", "producer", "cuda")
    consumer = _engine(engines, d_side, "D", "consumer", "shm")
    p_blocks, d_blocks = list(range(4)), list(range(8, 12))
    reply = start_transfer(producer, consumer, mode, "checked", p_blocks, d_blocks, 4 * BLOCK_SIZE)
    assert reply["ok"], reply
    events = consumer.wait_event("checked-d", 60)
    assert [e["event"] for e in events] == ["LOAD_FAILED"], events
    assert "GPU memory" in events[0]["reason"] and "integrity=off" in events[0]["reason"], events
    assert {e["event"] for e in producer.wait_event("checked", 60)} == {"FINISHED_SENDING"}


def test_a_vram_export_past_its_allocation_is_invalid_argument(sidecars) -> None:
    side = sidecars()
    layout = KvLayout(LAYERS, BLOCKS, BLOCK_SIZE * HEADS * CHUNK)
    with SidecarClient(side.socket) as client, CudaBuffer(layout.total_bytes) as buffer:
        export = buffer.export()
        assert export.kind == common_pb2.MEMORY_KIND_VRAM and len(export.cuda_ipc_handle) == 64
        export.length += 1 << 30  # a range the allocation does not have
        with pytest.raises(grpc.RpcError) as error:
            client.register_worker(kv_registration("E", common_pb2.ENGINE_ROLE_PRODUCER, layout, [export]))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exceeds the exported allocation" in error.value.details()
        # The real export registers, and unregisters cleanly.
        client.register_worker(kv_registration("E", common_pb2.ENGINE_ROLE_PRODUCER, layout, [buffer.export()]))
        client.unregister_worker("E", 0)


def test_gpu_kv_outlives_a_killed_sidecar_and_registers_again_with_the_restarted_one(sidecars) -> None:
    """The engine owns its GPU memory; the sidecar only opened a handle to it. A sidecar killed
    with SIGKILL frees none of it (every byte still there on the engine's GPU), and the same
    export registers with the restarted sidecar, which is what the vLLM shim's supervisor thread
    sends on its own once its event stream closes (test_vllm_e2e.py,
    test_consumer_sidecar_restart_fails_inflight_request_to_recompute, checks that on CPU)."""
    side = sidecars()
    layout = KvLayout(LAYERS, BLOCKS, BLOCK_SIZE * HEADS * CHUNK)
    with CudaBuffer(layout.total_bytes) as buffer:
        buffer.array[:] = np.random.default_rng(3).integers(0, 256, layout.total_bytes, dtype=np.uint8)
        expected = buffer.array.copy()
        buffer.upload()
        registration = kv_registration("E", common_pb2.ENGINE_ROLE_PRODUCER, layout, [buffer.export()])
        with SidecarClient(side.socket) as client:
            client.register_worker(registration)
        side.kill()
        buffer.array[:] = 0
        buffer.download()
        assert np.array_equal(buffer.array, expected), "the sidecar's death touched the engine's GPU memory"
        side.restart()
        with SidecarClient(side.socket) as client:
            client.register_worker(registration)
            client.unregister_worker("E", 0)


# (mode, P's memory, D's memory): the initiator's engine on the GPU (D pulls, P pushes), the target's
# in host memory (the staged path end to end) or on the GPU: then staged on both ends, a pull from
# it (the producer's sidecar copies each chunk into its own pinned pool, target_staging.py) and a
# push into it (the producer WRITEs into slots of the consumer sidecar's pool, which copies each
# into its engine: staged_push.py, core/push_staging.py), never NIXL on imported GPU memory.
STAGED = [("pull", "shm", "cuda"), ("push", "cuda", "shm"), ("pull", "cuda", "cuda"), ("push", "cuda", "cuda")]


@pytest.mark.parametrize(("mode", "p_memory", "d_memory"), STAGED, ids=["-".join(case) for case in STAGED])
def test_gpu_kv_across_nodes_goes_through_the_sidecars_pinned_host_staging(
    sidecars, engines, mode: str, p_memory: str, d_memory: str
) -> None:
    """The cross-node path, forced between two sidecars of this node (``host_staging.mode=always``):
    the initiator copies its engine's GPU blocks to or from its own pinned pool, one batched copy
    per chunk, while NIXL moves the pool. Every token checked at the destination; the initiator's
    trace says the path."""
    staged = ["--set", "host_staging.mode=always"]
    p_side, d_side = sidecars("p", args=staged), sidecars("d", args=staged)
    producer = _engine(engines, p_side, "P", "producer", p_memory)
    consumer = _engine(engines, d_side, "D", "consumer", d_memory)
    for serial in range(2):
        _move(producer, consumer, mode, f"staged-{mode}-{serial}", seed=40 + serial)
    initiator, request_id = (d_side, f"staged-{mode}-1-d") if mode == "pull" else (p_side, f"staged-{mode}-1")
    assert _paths(initiator.socket, request_id) == {"host_staging"}
    if p_memory == d_memory == "cuda":  # both ends staged: no byte moved by NIXL from/to imported GPU memory
        details = _completions(initiator.socket, request_id)
        assert details and all("staged_by_peer=yes" in detail for detail in details), details
