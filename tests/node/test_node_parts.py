"""The node's parts (registration, producer, consumer, holds) built and driven in-process, without
NIXL: ``tests/support/fake_transport.py`` stands in for the transport (it moves bytes between the
real shared-memory mappings the node makes), everything else is the production code.

One node serves a producer engine P and a consumer engine D (the same-node path: peer calls go
through the node's own routing table), each a worker with real KV memory in a ``SharedBuffer``.
The real-NIXL, multi-process versions of these flows are in test_pull.py and test_push.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_shim.client import SidecarClient, grouped, remote
from engine_shim.memory import KvLayout, SharedBuffer, kv_registration
from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from sidecar.config import Settings
from sidecar.core.consumer import ConsumerRequest
from sidecar.core.node import Node
from sidecar.core.registry import StreamClosed
from sidecar.core.trace import TraceRecorder
from sidecar.errors import DeadlineExceeded, FailedPrecondition, NotFound, Unavailable
from tests.support.fake_transport import FakeFabric

LAYOUT = KvLayout(num_layers=2, num_blocks=16, block_len=256)
ADDRESS = "127.0.0.1:59999"  # the node's own advertised address: peer calls stay in the process
P, D = "prefill-0", "decode-0"


@dataclass
class Engine:
    engine_id: str
    buffer: SharedBuffer

    def fill(self, blocks: list[int], seed: int) -> None:
        rng = np.random.default_rng(seed)
        for layer in range(LAYOUT.num_layers):
            for block in blocks:
                self.buffer.array[LAYOUT.block_slice(layer, block)] = rng.integers(0, 256, LAYOUT.block_len)

    def blocks(self, blocks: list[int]) -> bytes:
        return b"".join(
            self.buffer.array[LAYOUT.block_slice(layer, block)].tobytes()
            for layer in range(LAYOUT.num_layers)
            for block in blocks
        )


@dataclass
class Harness:
    node: Node
    fabric: FakeFabric
    p: Engine
    d: Engine

    async def next_event(self, engine_id: str, timeout: float = 5.0) -> engine_pb2.Event:
        worker = self.node.registry.worker(engine_id, 0, 0)
        assert worker is not None
        item = await asyncio.wait_for(worker.events.get(), timeout)
        assert not isinstance(item, StreamClosed), item.reason
        return item


def settings(tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "engine_socket": tmp_path / "engine.sock",
        "peer_listen": ADDRESS,
        "metrics_listen": "off",
        "shm_dirs": [Path("/dev/shm")],
        "lease_seconds": 30,
    }
    values.update(overrides)
    return Settings(**values)


@asynccontextmanager
async def harness(tmp_path: Path, **overrides: Any) -> AsyncIterator[Harness]:
    fabric = FakeFabric()
    node = Node(settings(tmp_path, **overrides), transport_factory=fabric.transport)
    await node.start(ADDRESS, [])
    buffers = [SharedBuffer(LAYOUT.total_bytes), SharedBuffer(LAYOUT.total_bytes)]
    try:
        engines = []
        for engine_id, role, buffer in (
            (P, common_pb2.ENGINE_ROLE_PRODUCER, buffers[0]),
            (D, common_pb2.ENGINE_ROLE_CONSUMER, buffers[1]),
        ):
            await node.registrations.register_worker(
                kv_registration(engine_id, role, LAYOUT, [buffer.export()], engine_version="test")
            )
            engines.append(Engine(engine_id, buffer))
        yield Harness(node, fabric, engines[0], engines[1])
    finally:
        await node.stop()
        for buffer in buffers:
            buffer.close()


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


def test_pull_moves_the_producers_blocks_and_frees_them(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with harness(tmp_path) as h:
            h.p.fill([3, 4, 5], seed=1)
            await h.node.producer.submit(SidecarClient.submit_request(P, "req-1", [[3, 4, 5]]))
            assert h.node.producer.leases.deadline((P, "req-1")) is not None
            pull = SidecarClient.pull_request(D, "req-1-d", [[7, 8, 9]], remote(ADDRESS, P, "req-1", [[3, 4, 5]]))
            await h.node.consumer.pull(pull)
            received = await h.next_event(D)
            assert received.kind == engine_pb2.FINISHED_RECEIVING and received.request_id == "req-1-d"
            assert h.d.blocks([7, 8, 9]) == h.p.blocks([3, 4, 5]), "the pulled bytes differ"
            sent = await h.next_event(P)
            assert sent.kind == engine_pb2.FINISHED_SENDING and sent.request_id == "req-1"
            assert not h.node.producer.requests and not h.node.consumer.requests
            assert [spec.op for spec in h.fabric.transfers] == ["READ"]

    run(scenario)


def test_a_notification_goes_to_the_side_it_names(tmp_path: Path) -> None:
    """A notice naming a push (a producer's WRITE ended) is the consumer side's alone: it does not
    end a pull the producer side holds under the same key; one naming a pull does, and so does an
    older sidecar's, which names no mode."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:
            worker = h.node.registry.worker(P, 0, 0)
            assert worker is not None

            def notify(request_id: str, mode: int) -> None:
                notice = peer_pb2.TransferNotice(engine_id=P, request_id=request_id, expected=1, mode=mode)
                h.node._on_notifications([(worker.agent_name, notice.SerializeToString())])

            for request_id, mode in (("req-1", common_pb2.TRANSFER_MODE_PULL), ("req-2", 0)):
                await h.node.producer.submit(SidecarClient.submit_request(P, request_id, [[3, 4]]))
                notify(request_id, common_pb2.TRANSFER_MODE_PUSH)
                assert (P, request_id) in h.node.producer.requests, "a WRITE's notice ended a pull"
                notify(request_id, mode)
                sent = await h.next_event(P)
                assert sent.kind == engine_pb2.FINISHED_SENDING and sent.request_id == request_id

    run(scenario)


def test_push_writes_into_the_consumers_blocks_whichever_side_comes_first(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with harness(tmp_path) as h:
            h.p.fill([0, 1], seed=2)
            # The consumer registers first; the producer's submission then starts the WRITE.
            expect = SidecarClient.expect_push_request(D, "req-2-d", [[10, 11]], remote(ADDRESS, P, "req-2"))
            await h.node.consumer.expect_push(expect)
            assert h.node.producer.push.matcher.pending_registrations == 1
            push = common_pb2.TRANSFER_MODE_PUSH
            response = await h.node.producer.submit(SidecarClient.submit_request(P, "req-2", [[0, 1]], mode=push))
            assert response.push_matched
            received = await h.next_event(D)
            assert received.kind == engine_pb2.FINISHED_RECEIVING
            assert h.d.blocks([10, 11]) == h.p.blocks([0, 1]), "the pushed bytes differ"
            sent = await h.next_event(P)
            assert sent.kind == engine_pb2.FINISHED_SENDING
            assert [spec.op for spec in h.fabric.transfers] == ["WRITE"]

    run(scenario)


def test_a_failed_write_fails_the_consumer_and_frees_the_producer(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with harness(tmp_path) as h:
            h.fabric.fail_with = "the NIC caught fire"
            push = common_pb2.TRANSFER_MODE_PUSH
            await h.node.producer.submit(SidecarClient.submit_request(P, "req-3", [[0, 1]], mode=push))
            expect = SidecarClient.expect_push_request(D, "req-3-d", [[5, 6]], remote(ADDRESS, P, "req-3"))
            await h.node.consumer.expect_push(expect)
            failed = await h.next_event(D)
            assert failed.kind == engine_pb2.LOAD_FAILED and "NIC caught fire" in failed.reason
            assert list(failed.failed_block_ids) == [5, 6]
            freed = await h.next_event(P)
            assert freed.kind == engine_pb2.FINISHED_SENDING and not h.node.producer.requests

    run(scenario)


def test_an_expired_lease_frees_the_blocks_but_only_after_the_write_in_flight(tmp_path: Path) -> None:
    """The lease ends while a WRITE is in flight: the blocks stay taken until it is terminal."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:
            h.fabric.gate = asyncio.Event()  # hold every transfer "in flight"
            push = common_pb2.TRANSFER_MODE_PUSH
            submit = SidecarClient.submit_request(P, "req-4", [[0, 1]], mode=push, lease_seconds=0.2)
            await h.node.producer.submit(submit)
            expect = SidecarClient.expect_push_request(D, "req-4-d", [[5, 6]], remote(ADDRESS, P, "req-4"))
            await h.node.consumer.expect_push(expect)
            await asyncio.sleep(0.6)  # the lease ran out meanwhile
            worker = h.node.registry.worker(P, 0, 0)
            assert worker is not None and worker.events.empty(), "blocks handed back while a WRITE may still write"
            assert (P, "req-4") in h.node.producer.requests
            h.fabric.gate.set()
            event = await h.next_event(P)
            assert event.kind in (engine_pb2.FINISHED_SENDING, engine_pb2.LEASE_EXPIRED)
            assert not h.node.producer.requests

    run(scenario)


def test_a_lease_nobody_takes_expires_and_is_counted(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with harness(tmp_path) as h:
            await h.node.producer.submit(SidecarClient.submit_request(P, "req-5", [[2]], lease_seconds=0.2))
            event = await h.next_event(P)
            assert event.kind == engine_pb2.LEASE_EXPIRED and event.request_id == "req-5"
            assert not h.node.producer.requests
            assert h.node.metrics.leases_expired._value.get() == 1

    run(scenario)


def test_release_ends_the_request_on_both_sides(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with harness(tmp_path) as h:
            await h.node.producer.submit(SidecarClient.submit_request(P, "req-6", [[1, 2]]))
            response = await h.node.release(engine_pb2.ReleaseRequest(engine_id=P, request_id="req-6", reason="abort"))
            assert response.found
            event = await h.next_event(P)
            assert event.kind == engine_pb2.FINISHED_SENDING and not h.node.producer.requests
            with pytest.raises(NotFound):
                await h.node.release(engine_pb2.ReleaseRequest(engine_id="nobody", request_id="x"))

    run(scenario)


def test_held_blocks_answer_cache_queries_then_expire(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with harness(tmp_path) as h:
            hold = engine_pb2.HoldBlocksRequest(
                engine_id=D, request_id="turn-1", conversation_id="chat-9", block_ids=grouped([[4, 5]]), ttl_seconds=0.5
            )
            await h.node.producer.hold(hold)
            query = engine_pb2.QueryCacheRequest(engine_id=P, address=ADDRESS, conversation_id="chat-9")
            (entry,) = (await h.node.holds.query_cache(query)).entries
            assert (entry.engine_id, entry.request_id, list(entry.block_ids.groups[0].ids)) == (D, "turn-1", [4, 5])
            assert 0 < entry.expires_in_seconds <= 0.5 and entry.address == ADDRESS
            event = await h.next_event(D)
            assert event.kind == engine_pb2.LEASE_EXPIRED
            assert not (await h.node.holds.query_cache(query)).entries and len(h.node.holds) == 0

    run(scenario)


def test_unregistering_a_worker_ends_its_requests_and_drops_its_agent(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with harness(tmp_path) as h:
            await h.node.producer.submit(SidecarClient.submit_request(P, "req-7", [[1]]))
            worker = h.node.registry.worker(P, 0, 0)
            assert worker is not None and worker.agent_name in h.fabric.agents
            response = await h.node.registrations.unregister_worker(
                engine_pb2.UnregisterWorkerRequest(engine_id=P, tp_rank=0, pp_rank=0)
            )
            assert response.requests_released == 1
            assert worker.agent_name not in h.fabric.agents and P not in h.node.registry.engines
            assert not h.node.producer.requests

    run(scenario)


def test_other_rpcs_are_served_while_a_registration_prefaults_its_memory(tmp_path: Path) -> None:
    """Mapping (with pre-faulting) a large engine's KV cache takes seconds; it must not stall the
    event loop. The importer's map is held until the test lets it go (as a slow pre-fault would
    be), and a status call and a cache query are answered meanwhile."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:
            importer = h.node.registrations.memory
            real_map = importer.map
            entered, release = threading.Event(), threading.Event()

            def slow_map(*args: Any, **kwargs: Any) -> Any:
                entered.set()
                release.wait(timeout=10)  # bounded: a loop-blocking map would otherwise hang the test
                return real_map(*args, **kwargs)

            importer.map = slow_map  # type: ignore[method-assign]
            served_while_mapping: list[bool] = []
            buffer = SharedBuffer(LAYOUT.total_bytes)
            try:
                registration = kv_registration("big-0", common_pb2.ENGINE_ROLE_PRODUCER, LAYOUT, [buffer.export()])
                task = asyncio.ensure_future(h.node.registrations.register_worker(registration))
                await asyncio.to_thread(entered.wait, 5)
                status = h.node.status(engine_pb2.GetStatusRequest())
                query = engine_pb2.QueryCacheRequest(engine_id=P, address=ADDRESS, request_id="none")
                await h.node.holds.query_cache(query)
                served_while_mapping.append(not task.done())
                release.set()
                response = await asyncio.wait_for(task, 10)
                assert served_while_mapping == [True], "other calls waited for the registration's mapping"
                assert response.registered_bytes == LAYOUT.total_bytes
                assert {engine.engine_id for engine in status.engines} == {P, D}
            finally:
                release.set()
                buffer.close()

    run(scenario)


def test_a_producer_works_without_a_node(tmp_path: Path) -> None:
    """No hub: the producer, its holds and registration are built from a NodeContext alone (what a
    part may use is what the context holds), and a submitted request's lease still ends in
    LEASE_EXPIRED on the engine's event queue."""
    from sidecar.core.context import Identity, NodeContext, Tasks
    from sidecar.core.events import WorkerEvents
    from sidecar.core.holds import Holds
    from sidecar.core.producer import ProducerSide
    from sidecar.core.registration import Registrations
    from sidecar.core.registry import Registry
    from sidecar.dataplane.memory import MemoryImporter
    from sidecar.dataplane.plane import DataPlane
    from sidecar.metrics import SidecarMetrics
    from sidecar.peers.client import PeerClient

    async def scenario() -> None:
        config = settings(tmp_path)
        transport = FakeFabric().transport(config.nixl, lambda batch, seen_at: None, lambda op, result: None)
        transport.start(asyncio.get_running_loop())
        metrics = SidecarMetrics(transport.nixl_version)
        registry = Registry()
        identity = Identity(config, transport.nixl_version, registry)

        async def unload(address: str, names: list[str]) -> None:
            return None

        ctx = NodeContext(
            settings=config,
            identity=identity,
            registry=registry,
            peers=PeerClient(config, identity.info, unload, metrics),
            dataplane=DataPlane(transport, identity.sidecar_id),
            transport=transport,
            metrics=metrics,
            events=WorkerEvents(config, registry, metrics, identity.sidecar_id),
            tasks=Tasks(config),
            trace=TraceRecorder(0),
        )
        registrations = Registrations(ctx, MemoryImporter(config.shm_dirs, populate=False))
        producer = ProducerSide(ctx, Holds(ctx))
        with SharedBuffer(LAYOUT.total_bytes) as buffer:
            await registrations.register_worker(
                kv_registration(P, common_pb2.ENGINE_ROLE_PRODUCER, LAYOUT, [buffer.export()])
            )
            await producer.submit(SidecarClient.submit_request(P, "solo", [[1, 2]], lease_seconds=0.2))
            worker = registry.worker(P, 0, 0)
            assert worker is not None
            event = await asyncio.wait_for(worker.events.get(), 5)
            assert isinstance(event, engine_pb2.Event) and event.kind == engine_pb2.LEASE_EXPIRED
            assert not producer.requests
            await registrations.remove_worker(worker, "test over")
            producer.leases.close()

    run(scenario)


def test_a_registration_whose_caller_left_while_its_agent_was_made_leaves_no_agent(tmp_path: Path) -> None:
    """RegisterWorker past its deadline (a busy sidecar: the agent is made on the NIXL owner thread,
    behind its other commands): the owner thread still makes the agent after the call is gone, so
    the sidecar drops it once made and only then revokes the mapping; nothing stays registered."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:
            transport = h.node.transport
            real_create = transport.create_agent
            gate = asyncio.Event()

            async def owner_thread_create(*args: Any) -> bytes:
                async def later() -> bytes:  # the owner thread runs the queued command whatever the caller does
                    await gate.wait()
                    return await real_create(*args)

                return await asyncio.shield(asyncio.ensure_future(later()))

            transport.create_agent = owner_thread_create  # type: ignore[method-assign]
            buffer = SharedBuffer(LAYOUT.total_bytes)
            try:
                registration = kv_registration("late-0", common_pb2.ENGINE_ROLE_PRODUCER, LAYOUT, [buffer.export()])
                call = asyncio.ensure_future(h.node.registrations.register_worker(registration))
                await asyncio.sleep(0.2)  # mapped; the agent is queued
                tombstoned = h.node.registrations.memory.tombstoned_bytes
                call.cancel()  # the client's deadline passed
                with pytest.raises(asyncio.CancelledError):
                    await call
                gate.set()  # the owner thread gets to it
                for _ in range(100):
                    await asyncio.sleep(0.02)
                    if h.node.registrations.memory.tombstoned_bytes > tombstoned:
                        break
                assert not [name for name in h.fabric.agents if "late-0" in name], "an abandoned agent stayed"
                assert h.node.registrations.memory.tombstoned_bytes > tombstoned  # its mapping was revoked
                assert "late-0" not in h.node.registry.engines
            finally:
                gate.set()
                buffer.close()

    run(scenario)


def test_a_pull_whose_engine_dies_while_its_read_runs_ends_when_the_read_does(tmp_path: Path) -> None:
    """D's engine dies while its READ is in flight (found by chaos cell pull in_flight D_engine kill):
    the request is left to the READ's end, and with integrity=digest the digest check then finds the
    engine gone. It must end the request there, not raise in the background and keep the request
    (GetStatus showed pending_receives=1 forever)."""

    async def scenario() -> None:
        async with harness(tmp_path, integrity="digest") as h:
            h.p.fill([3, 4, 5], seed=2)
            await h.node.producer.submit(SidecarClient.submit_request(P, "req-9", [[3, 4, 5]]))
            h.fabric.gate = asyncio.Event()  # the READ stays in flight
            pull = SidecarClient.pull_request(D, "req-9-d", [[7, 8, 9]], remote(ADDRESS, P, "req-9", [[3, 4, 5]]))
            await h.node.consumer.pull(pull)
            for _ in range(100):
                if h.fabric.transfers:
                    break
                await asyncio.sleep(0.02)
            assert h.fabric.transfers, "the READ never started"
            worker = h.node.registry.worker(D, 0, 0)
            assert worker is not None
            gone = asyncio.ensure_future(h.node.registrations.remove_worker(worker, "event stream closed"))
            await asyncio.sleep(0.1)  # its requests were asked to end; the READ still runs
            h.fabric.gate.set()
            await asyncio.wait_for(gone, 10)
            for _ in range(100):
                if not h.node.consumer.requests:
                    break
                await asyncio.sleep(0.02)
            assert not h.node.consumer.requests, "the pull of a dead engine was kept"

    run(scenario)


def test_a_gpu_producer_refuses_digests_and_the_checking_consumers_load_fails_saying_why(tmp_path: Path) -> None:
    """Digests are hashed by reading KV from the CPU; a GPU engine's sidecar must refuse them, not
    read device pointers (it would crash). Stand-in: P's worker is *marked* as GPU memory, the flag
    the refusal reads, while its bytes stay in shared memory (no GPU here; tests/daemon/test_gpu.py runs
    the real thing)."""

    async def scenario() -> None:
        async with harness(tmp_path, integrity="digest") as h:
            worker = h.node.registry.worker(P, 0, 0)
            assert worker is not None
            worker.mem_type = "VRAM"
            await h.node.producer.submit(SidecarClient.submit_request(P, "req-g", [[3, 4, 5]]))
            pull = SidecarClient.pull_request(D, "req-g-d", [[7, 8, 9]], remote(ADDRESS, P, "req-g", [[3, 4, 5]]))
            await h.node.consumer.pull(pull)
            failed = await h.next_event(D)
            assert failed.kind == engine_pb2.LOAD_FAILED, failed
            assert "KV is in GPU memory" in failed.reason and "integrity=off" in failed.reason, failed.reason
            assert not h.fabric.transfers, "nothing may be read without its digests"
            freed = await h.next_event(P)
            assert freed.kind == engine_pb2.FINISHED_SENDING and freed.request_id == "req-g"

    run(scenario)


def _mark_gpu(h: Harness, gpu: bool) -> None:
    """Stand-in for GPU KV (no GPU here): D's worker and its mappings are *marked* as GPU memory,
    the flags the consumer and the fences read, while the bytes stay in shared memory. Set back
    before teardown so it unmaps them."""
    worker = h.node.registry.worker(D, 0, 0)
    assert worker is not None
    worker.mem_type = "VRAM" if gpu else "DRAM"
    for memory in worker.memories:
        memory.kind = worker.mem_type


@contextmanager
def _peer_that(behaviour: str) -> Iterator[str]:
    """A loopback address whose "peer" is real but never answers a call: ``"refuses"`` (nothing
    listens: connection refused, a dead sidecar), ``"hangs"`` (the kernel accepts, nobody reads:
    what a SIGSTOPped sidecar looks like) or ``"drops"`` (each connection is accepted and closed at
    once, like a server going away)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    stop = threading.Event()
    dropper = None
    if behaviour == "refuses":
        listener.close()
    else:
        listener.listen(16)
        if behaviour == "drops":
            listener.settimeout(0.05)

            def drop() -> None:
                while not stop.is_set():
                    try:
                        connection, _ = listener.accept()
                    except TimeoutError:
                        continue
                    connection.close()

            dropper = threading.Thread(target=drop, daemon=True)
            dropper.start()
    try:
        yield address
    finally:
        stop.set()
        if dropper is not None:
            dropper.join(5)
        listener.close()


async def _heartbeat_times_out(*args: Any, **kwargs: Any) -> None:
    """Stand-in for a producer that does not answer its heartbeats (SIGSTOPped)."""
    raise DeadlineExceeded("heartbeat: the producer did not answer")


async def _push_given_up(h: Harness, request_id: str, timeout: float) -> ConsumerRequest:
    """D registers a push from P (which never submits); returns the consumer's request."""
    expect = SidecarClient.expect_push_request(
        D, request_id, [[5, 6]], remote(ADDRESS, P, "never-submitted"), timeout_seconds=timeout
    )
    await h.node.consumer.expect_push(expect)
    return h.node.consumer.requests[(D, request_id)]


def test_a_gpu_consumer_holds_its_blocks_until_the_producer_can_no_longer_write(tmp_path: Path) -> None:
    """A push given up while the producer cannot answer (it may be hung, and resume): shared memory
    is fenced (mprotect); GPU memory cannot be, so the engine must not get the blocks back (a
    recompute would be overwritten) until the producer's WRITEs are surely over: its promise in the
    PushReg answer (posting ends by the registration's time, each WRITE has the transfer timeout).
    The hold does not count against the pending-request limit."""

    async def scenario() -> None:
        fast = {
            "heartbeat_interval_seconds": 0.05,
            "transfer_timeout_seconds": 0.2,
            "peer_call_timeout_seconds": 0.2,
            "voucher_clock_skew_seconds": 0.1,
            "max_pending_requests": 1,
        }
        async with harness(tmp_path, **fast) as h:
            _mark_gpu(h, True)
            pending = await _push_given_up(h, "req-h-d", timeout=0.4)
            quiet_at = pending.writes_quiet_at
            assert quiet_at is not None, "the producer's PushReg answer must promise an end to its WRITEs"

            with _peer_that("hangs") as hung:
                # From here the producer is a sidecar that accepts connections and never answers
                # (SIGSTOPped): the engine's release asks it, in vain, and its heartbeats time out.
                pending.remote.address = hung
                assert h.node.consumer.release(D, "req-h-d", "the client went away") is pending
                while not pending.held:
                    await asyncio.sleep(0.01)
                worker = h.node.registry.worker(D, 0, 0)
                assert worker is not None
                assert worker.events.empty(), "GPU blocks went back while the producer could still write"
                # Held, it leaves room for another request (the limit here is 1): admission passes.
                h.node.consumer.table.require_engine(D, "req-other-d", ((7,),), "block_ids")
                failed = await h.next_event(D)
                seen_at = time.monotonic()
            _mark_gpu(h, False)
            assert failed.kind == engine_pb2.LOAD_FAILED and failed.request_id == "req-h-d", failed
            assert seen_at >= quiet_at, f"LOAD_FAILED {quiet_at - seen_at:.3f} s before the producer went quiet"
            assert "GPU memory: blocks held until the producer's WRITEs were over by its promise" in failed.reason
            assert "released: the client went away; the producer did not answer" in failed.reason, failed.reason
            assert sorted(failed.failed_block_ids) == [5, 6]
            assert (D, "req-h-d") not in h.node.consumer.requests

    run(scenario)


def test_a_held_gpu_push_outlasts_the_promise_while_the_producer_says_a_write_is_in_flight(tmp_path: Path) -> None:
    """A producer that answers "a WRITE is in flight" is alive and its WRITE not over: the hold
    waits for its next answer, not for the promise's time."""

    async def scenario() -> None:
        fast = {"heartbeat_interval_seconds": 0.05, "transfer_timeout_seconds": 0.2, "voucher_clock_skew_seconds": 0.1}
        async with harness(tmp_path, **fast) as h:
            _mark_gpu(h, True)
            pending = await _push_given_up(h, "req-b-d", timeout=0.4)
            quiet_at = pending.writes_quiet_at
            assert quiet_at is not None
            in_flight = [True]

            async def answer(*args: Any, **kwargs: Any) -> bool:
                return in_flight[0]

            h.node.consumer.table.ask_producer = answer  # type: ignore[method-assign]
            h.node.peers.heartbeat = _heartbeat_times_out  # type: ignore[method-assign]
            h.node.consumer.fences.fail_fenced(pending, "the producer did not answer", "released")
            await asyncio.sleep(max(0.0, quiet_at - time.monotonic()) + 0.3)
            worker = h.node.registry.worker(D, 0, 0)
            assert worker is not None
            assert worker.events.empty(), "GPU blocks went back while the producer said a WRITE was in flight"
            in_flight[0] = False
            failed = await h.next_event(D)
            _mark_gpu(h, False)
            assert failed.kind == engine_pb2.LOAD_FAILED, failed
            assert "held until the producer answered that no WRITE is in flight" in failed.reason, failed.reason

    run(scenario)


def test_only_a_refused_connection_counts_as_a_producer_that_cannot_write(tmp_path: Path) -> None:
    """A fence or hold ends early when nothing listens at the producer's address. A producer that
    accepts and never answers (stopped), or whose connections drop (a server going away, its
    WRITEs possibly draining), is no answer, not "gone". Real gRPC calls to real sockets."""

    async def scenario() -> None:
        async with harness(tmp_path, peer_call_timeout_seconds=0.3) as h:
            pending = await _push_given_up(h, "req-r-d", timeout=60.0)
            outcomes = {}
            for behaviour in ("refuses", "hangs", "drops"):
                with _peer_that(behaviour) as address:
                    pending.remote.address = address
                    outcomes[behaviour] = await h.node.consumer.table.ask_producer(
                        pending, consumed=False, reason="test", wait_for_ready=False
                    )
            assert outcomes == {"refuses": False, "hangs": None, "drops": None}

    run(scenario)


def test_a_push_whose_handshake_timed_out_fails_at_once_without_a_hold(tmp_path: Path) -> None:
    """No PushReg left (the handshake timed out), so the producer cannot know the registration:
    nothing can be written, and even a GPU consumer answers at once."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:
            _mark_gpu(h, True)

            async def handshake_times_out(*args: Any, **kwargs: Any) -> None:
                raise DeadlineExceeded("handshake: the producer did not answer")

            h.node.peers.engine = handshake_times_out  # type: ignore[method-assign]
            expect = SidecarClient.expect_push_request(D, "req-t-d", [[5, 6]], remote(ADDRESS, P, "req-t"))
            answer = await h.node.consumer.expect_push(expect)
            assert not answer.registered, answer
            failed = await h.next_event(D, timeout=1.0)
            _mark_gpu(h, False)
            assert failed.kind == engine_pb2.LOAD_FAILED, failed
            assert "held" not in failed.reason and "fenced" not in failed.reason, failed.reason
            assert not h.node.consumer.fences.fenced

    run(scenario)


def test_a_held_gpu_push_ends_as_soon_as_the_producer_answers(tmp_path: Path) -> None:
    """The hold ends early when the producer answers that no WRITE is in flight (here P's sidecar
    drops the registration it was waiting on), long before its registration's timeout."""

    async def scenario() -> None:
        async with harness(tmp_path, heartbeat_interval_seconds=0.05) as h:
            _mark_gpu(h, True)
            pending = await _push_given_up(h, "req-a-d", timeout=60.0)
            h.node.consumer.fences.fail_fenced(pending, "the producer did not answer", "released")
            failed = await h.next_event(D, timeout=5.0)
            _mark_gpu(h, False)
            assert failed.kind == engine_pb2.LOAD_FAILED, failed
            assert "held until the producer answered that no WRITE is in flight" in failed.reason, failed.reason
            assert not h.node.producer.push.matcher.pending_registrations, "the producer still waits to write"

    run(scenario)


def test_a_gpu_consumer_whose_producer_promised_nothing_says_it_is_unfenced(tmp_path: Path) -> None:
    """A producer that promised no end to its WRITEs (``writes_end_within_seconds`` 0, an older
    sidecar): holding could last forever, so the LOAD_FAILED goes out and says the blocks are
    not protected."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:
            _mark_gpu(h, True)
            pending = await _push_given_up(h, "req-u-d", timeout=60.0)
            pending.writes_quiet_at = None  # what an answer without the promise leaves
            h.node.consumer.fences.fail_fenced(pending, "the producer did not answer", "released")
            _mark_gpu(h, False)
            failed = await h.next_event(D)
            assert failed.kind == engine_pb2.LOAD_FAILED, failed
            assert "GPU memory: not fenced against a late WRITE" in failed.reason, failed.reason

    run(scenario)


def test_a_push_registration_handled_after_its_write_by_is_refused(tmp_path: Path) -> None:
    """A PushReg the producer only gets to after the consumer's write_by (less the clock allowance)
    must not register: the consumer has given up and may have handed its blocks back. The answer
    says why, and no registration is left to match a later SubmitBlocks."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:
            late = peer_pb2.PushRegRequest(
                caller=h.node.identity.info(),
                prefill_engine_id=P,
                decode_engine_id=D,
                request_id="req-w-d",
                block_ids=grouped([[5, 6]]),
                timeout_seconds=60.0,
                write_by_unix_ms=int((time.time() - 1.0) * 1000),
            )
            with pytest.raises(FailedPrecondition, match=r"write_by_unix_ms.*the consumer has given up"):
                await h.node.producer.push.handle_push_reg(late)
            assert not h.node.producer.push.matcher.pending_registrations
            in_time = peer_pb2.PushRegRequest()
            in_time.CopyFrom(late)
            in_time.write_by_unix_ms = int((time.time() + 2.0) * 1000)
            answer = await h.node.producer.push.handle_push_reg(in_time)
            # Posting ends 2 s less the 0.5 s clock allowance from now, not after the 60 s timeout;
            # the last WRITE posted then has the transfer timeout to end.
            posting = answer.writes_end_within_seconds - h.node.settings.transfer_timeout_seconds
            assert 1.0 < posting <= 1.5, answer

    run(scenario)


def test_a_producer_posts_no_write_after_the_push_registration_timed_out(tmp_path: Path) -> None:
    """The producer's half of the promise: a WRITE whose posting comes later than the PushReg's
    timeout after it arrived (here the producer's handshake of the consumer is slow) is not posted,
    and the consumer's blocks stay as they were."""

    async def scenario() -> None:
        async with harness(tmp_path, voucher_clock_skew_seconds=0.05) as h:
            h.p.fill([3, 4], seed=7)
            before = h.d.blocks([5, 6])
            await h.node.producer.submit(SidecarClient.submit_request(P, "req-late", [[3, 4]]))
            engine_view = h.node.peers.engine

            async def slow_view(address: str, engine_id: str, *args: Any) -> Any:
                if engine_id == D:  # only the producer's view of the consumer (a slow peer)
                    await asyncio.sleep(0.6)
                return await engine_view(address, engine_id, *args)

            h.node.peers.engine = slow_view  # type: ignore[method-assign]
            expect = SidecarClient.expect_push_request(
                D, "req-late-d", [[5, 6]], remote(ADDRESS, P, "req-late"), timeout_seconds=0.3
            )
            answer = await h.node.consumer.expect_push(expect)
            assert answer.matched, answer
            failed = await h.next_event(D)
            assert failed.kind == engine_pb2.LOAD_FAILED, failed
            sent = await h.next_event(P)
            assert sent.request_id == "req-late", sent
            assert h.d.blocks([5, 6]) == before, "a WRITE landed after the consumer's registration timed out"
            assert h.fabric.transfers and all(
                spec.not_after is not None and spec.not_after <= time.monotonic() for spec in h.fabric.transfers
            )

    run(scenario)


def test_the_ranks_of_a_new_engine_registering_at_once_all_join_it(tmp_path: Path) -> None:
    """vLLM's TP workers are processes of their own and register at the same moment: each rank
    must join the one engine, not make its own (the last one added would replace the others and
    leave the engine incomplete, refusing every request). Two calls for the same rank at once
    (a worker's retry) leave one worker and one NIXL agent."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:
            buffers = [SharedBuffer(LAYOUT.total_bytes) for _ in range(2)]
            try:
                calls = [
                    kv_registration("tp2-0", common_pb2.ENGINE_ROLE_PRODUCER, LAYOUT, [b.export()], rank, 2)
                    for rank, b in enumerate(buffers)
                ]
                calls.append(calls[1])  # rank 1 twice, at once
                agents_before = set(h.fabric.agents)
                await asyncio.gather(*(h.node.registrations.register_worker(call) for call in calls))
                engine = h.node.registry.engines["tp2-0"]
                assert engine.complete, f"workers registered: {sorted(engine.workers)}"
                assert sorted(engine.workers) == [(0, 0), (0, 1)]
                # The duplicate's agent is dropped once made (a task of its own).
                for _ in range(100):
                    if len(set(h.fabric.agents) - agents_before) == 2:
                        break
                    await asyncio.sleep(0.01)
                assert set(h.fabric.agents) - agents_before == {w.agent_name for w in engine.workers.values()}
                await h.node.producer.submit(SidecarClient.submit_request("tp2-0", "req-tp2", [[1, 2]]))
            finally:
                for rank in (0, 1):
                    with contextlib.suppress(NotFound):
                        await h.node.registrations.unregister_worker(
                            engine_pb2.UnregisterWorkerRequest(engine_id="tp2-0", tp_rank=rank, pp_rank=0)
                        )
                for buffer in buffers:
                    buffer.close()

    run(scenario)


def test_a_consumer_engine_that_goes_lets_go_of_what_its_queued_requests_kept_alive(tmp_path: Path) -> None:
    """Requests waiting in D's queue keep their producer's lease alive (KeepAlive, heartbeats).
    When D's engine goes, no Pull will come: the producer gets its blocks back at once, not when
    the keep-alive's timeout (minutes) ends, and nothing of the requests stays behind on D. A
    keep-alive its engine released leaves nothing behind either."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:
            consumer = h.node.consumer
            for name in ("req-q", "req-r"):
                await h.node.producer.submit(SidecarClient.submit_request(P, name, [[1, 2]]))
                keep = engine_pb2.KeepAliveRequest(
                    engine_id=D, request_id=f"{name}-d", remote=remote(ADDRESS, P, name, [[1, 2]])
                )
                assert (await consumer.keep_alive(keep)).producer_holds
            await consumer.heartbeat_once()
            assert (D, "req-q-d") in consumer.keepalive.confirmed and (D, "req-r-d") in consumer.keepalive.verified

            # The engine releases one while it waits (the shim's fetch-nothing path).
            assert consumer.release(D, "req-r-d", "aborted while queued") is None
            keep = consumer.keepalive
            checks = (keep.confirmed, keep.readable, keep.verified, keep.first_unknown)
            assert all((D, "req-r-d") not in table for table in checks), "a released keep-alive left its checks"

            await h.node.registrations.unregister_worker(
                engine_pb2.UnregisterWorkerRequest(engine_id=D, tp_rank=0, pp_rank=0)
            )
            sent = await h.next_event(P, timeout=2.0)
            assert sent.kind == engine_pb2.FINISHED_SENDING and sent.request_id == "req-q", sent
            assert "released by consumer" in sent.reason, sent.reason
            assert (P, "req-q") not in h.node.producer.requests
            assert not consumer.kept and not consumer.keepalive.lost
            assert all(key[0] != D for table in checks for key in table), "the gone engine's checks stayed"

    run(scenario)


def test_a_push_its_producer_forgot_after_writing_is_not_failed_before_its_notification(tmp_path: Path) -> None:
    """A producer forgets a push the moment its WRITEs are done; the consumer learns they were
    from the notification, which the NIXL owner thread hands over a little later. A heartbeat
    answered in between ("unknown") must not fail a push whose bytes have landed: for a push,
    "unknown" counts as lost only after producer_unknown_grace_seconds, as for one never seen."""

    async def scenario() -> None:
        async with harness(tmp_path, producer_unknown_grace_seconds=0.3) as h:
            consumer = h.node.consumer
            expect = SidecarClient.expect_push_request(D, "req-f-d", [[10, 11]], remote(ADDRESS, P, "req-f"))
            await consumer.expect_push(expect)
            await consumer.heartbeat_once()
            assert (D, "req-f-d") in consumer.keepalive.confirmed, "the waiting registration was not confirmed"
            # As after its WRITEs ended: the producer no longer knows the request.
            registration = h.node.producer.push.matcher.registrations()[0]
            h.node.producer.push.matcher.remove_registration(registration.key)
            await consumer.heartbeat_once()
            worker = h.node.registry.worker(D, 0, 0)
            assert worker is not None and worker.events.empty(), "failed before its notification could come"
            assert (D, "req-f-d") in consumer.requests
            # A push that is really gone still fails, once the grace is over.
            await asyncio.sleep(0.35)
            await consumer.heartbeat_once()
            failed = await h.next_event(D)
            assert failed.kind == engine_pb2.LOAD_FAILED and "no longer holds the request" in failed.reason, failed

    run(scenario)


def test_a_push_that_crashes_still_ends_on_both_sides(tmp_path: Path) -> None:
    """An error nothing expected inside the producer's push (a bug, a value no check caught) must
    not leave the request "writing" for ever: P's engine gets its blocks back, D its LOAD_FAILED
    with the error, and a Release from D is not told that WRITEs are in flight."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:

            def broken(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError("unexpected descriptor shape")

            h.node.context.dataplane.check = broken  # type: ignore[method-assign]
            expect = SidecarClient.expect_push_request(D, "req-c-d", [[10, 11]], remote(ADDRESS, P, "req-c"))
            await h.node.consumer.expect_push(expect)
            push = common_pb2.TRANSFER_MODE_PUSH
            await h.node.producer.submit(SidecarClient.submit_request(P, "req-c", [[0, 1]], mode=push))
            sent = await h.next_event(P)
            assert sent.kind == engine_pb2.FINISHED_SENDING and "unexpected descriptor shape" in sent.reason, sent
            failed = await h.next_event(D)
            assert failed.kind == engine_pb2.LOAD_FAILED and "unexpected descriptor shape" in failed.reason, failed
            assert not h.node.producer.requests and not h.node.producer.push.writing_for("req-c-d")

    run(scenario)


def test_a_held_gpu_push_ends_within_a_writes_bound_after_a_busy_producer_stops_answering(tmp_path: Path) -> None:
    """A producer that said a WRITE is in flight and then stopped answering (its host went away, or
    it hangs): each WRITE ends within the transfer timeout, so the hold ends that long after its
    last answer, not never (the engine would keep the blocks until it is gone)."""

    async def scenario() -> None:
        fast = {"heartbeat_interval_seconds": 0.05, "transfer_timeout_seconds": 0.2, "voucher_clock_skew_seconds": 0.1}
        async with harness(tmp_path, **fast) as h:
            _mark_gpu(h, True)
            pending = await _push_given_up(h, "req-s-d", timeout=0.4)
            answers = [True]

            async def answer(*args: Any, **kwargs: Any) -> bool | None:
                return answers.pop(0) if answers else None  # busy once, then silent

            h.node.consumer.table.ask_producer = answer  # type: ignore[method-assign]
            h.node.peers.heartbeat = _heartbeat_times_out  # type: ignore[method-assign]
            h.node.consumer.fences.fail_fenced(pending, "the producer did not answer", "released")
            failed = await h.next_event(D, timeout=5.0)
            _mark_gpu(h, False)
            assert not answers, "the producer was never asked"
            assert failed.kind == engine_pb2.LOAD_FAILED, failed
            assert "the producer's WRITEs were over by its promise" in failed.reason, failed.reason

    run(scenario)


def test_a_producer_engine_that_goes_fails_the_push_registrations_waiting_for_it(tmp_path: Path) -> None:
    """D registered for a push from P's engine, which then goes (its worker unregisters, as when
    vLLM exits): D's engine learns it at once, with the reason, not at a heartbeat's grace or at
    the registration's watchdog."""

    async def scenario() -> None:
        async with harness(tmp_path) as h:
            expect = SidecarClient.expect_push_request(D, "req-g-d", [[10, 11]], remote(ADDRESS, P, "req-g"))
            await h.node.consumer.expect_push(expect)
            assert h.node.producer.push.matcher.pending_registrations == 1
            await h.node.registrations.unregister_worker(
                engine_pb2.UnregisterWorkerRequest(engine_id=P, tp_rank=0, pp_rank=0)
            )
            failed = await h.next_event(D, timeout=1.5)
            assert failed.kind == engine_pb2.LOAD_FAILED and "producer engine gone" in failed.reason, failed
            assert h.node.producer.push.matcher.pending_registrations == 0
            assert (D, "req-g-d") not in h.node.consumer.requests

    run(scenario)


def test_a_push_registration_whose_answer_was_lost_is_fenced_and_withdrawn(tmp_path: Path) -> None:
    """The PushReg reached the producer, and the connection dropped before its answer came back
    (UNAVAILABLE, not a timeout). The producer holds a registration the consumer gave up on: its
    WRITE must not land in blocks D's engine already got back with LOAD_FAILED. So, as after a
    timeout, the blocks are fenced and the fence's checks withdraw the registration; the
    producer's later SubmitBlocks writes nothing."""

    async def scenario() -> None:
        async with harness(tmp_path, heartbeat_interval_seconds=0.05) as h:
            real_push_reg = h.node.peers.push_reg

            async def answer_lost(*args: Any, **kwargs: Any) -> None:
                await real_push_reg(*args, **kwargs)  # delivered and registered
                raise Unavailable("PushReg: connection reset by peer")

            h.node.peers.push_reg = answer_lost  # type: ignore[method-assign]
            expect = SidecarClient.expect_push_request(D, "req-u-d", [[10, 11]], remote(ADDRESS, P, "req-u"))
            answer = await h.node.consumer.expect_push(expect)
            assert not answer.registered
            failed = await h.next_event(D)
            assert failed.kind == engine_pb2.LOAD_FAILED, failed
            # D's engine reuses its blocks at once.
            h.d.fill([10, 11], seed=9)
            reused = h.d.blocks([10, 11])
            for _ in range(200):  # the fence's checks ask the producer to drop the registration
                if not h.node.consumer.fences.fenced:
                    break
                await asyncio.sleep(0.01)
            assert not h.node.consumer.fences.fenced, "the fence never ended"
            assert not h.node.producer.push.matcher.pending_registrations, "the producer still waits to write"
            h.p.fill([0, 1], seed=3)
            push = common_pb2.TRANSFER_MODE_PUSH
            await h.node.producer.submit(SidecarClient.submit_request(P, "req-u", [[0, 1]], mode=push))
            await asyncio.sleep(0.1)
            assert not h.fabric.transfers, "the producer wrote for a registration its consumer gave up on"
            assert h.d.blocks([10, 11]) == reused, "D's reused blocks were overwritten"
            assert "fenced against late WRITEs" in failed.reason, failed.reason

    run(scenario)
