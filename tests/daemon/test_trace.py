"""Per-request traces: ``Trace`` on either sidecar (engine socket or peer port) shows the request's
whole path, this sidecar's part and its peer's; retention is bounded; bad queries get a precise
status. The recorder's bounds are unit-tested alone."""

from __future__ import annotations

import grpc
import pytest

from engine_shim.client import engine_channel
from kvsidecar.v1 import common_pb2, engine_pb2, engine_pb2_grpc, peer_pb2_grpc
from sidecar.core.trace import MAX_EVENTS, TraceRecorder
from tests.support.moves import PUSH, engine_pair, expect, pull_and_wait, trace_over_socket
from tests.support.processes import SidecarProcess


def trace_over_peer_port(sidecar: SidecarProcess, **query: str) -> common_pb2.TraceResponse:
    with grpc.insecure_channel(sidecar.address) as channel:
        response: common_pb2.TraceResponse = peer_pb2_grpc.PeerServiceStub(channel).Trace(
            common_pb2.TraceRequest(**query), timeout=10
        )
        return response


def kinds(part: common_pb2.SidecarTrace, side: str) -> list[str]:
    (timeline,) = [t for t in part.requests if t.side == side]
    offsets = [event.offset_s for event in timeline.events]
    assert offsets == sorted(offsets) and offsets[0] == 0.0, offsets
    assert all(event.unix_s > 1e9 for event in timeline.events)
    return [event.kind for event in timeline.events]


def in_order(found: list[str], expected: list[str]) -> bool:
    """``expected`` occurs in ``found`` in this order (other kinds may come between)."""
    position = iter(found)
    return all(kind in position for kind in expected)


def test_pull_trace_shows_both_sidecars_from_either_end(sidecars, engines) -> None:
    p_side, d_side = sidecars("p"), sidecars("d")
    producer = engines(p_side, "P", "producer")
    consumer = engines(d_side, "D", "consumer")
    events = pull_and_wait(producer, consumer, "traced", [1, 2, 3], [4, 5, 6])
    assert events[0]["event"] == "FINISHED_RECEIVING"
    producer.wait_event("traced")

    # From the consumer's engine socket, by the consumer's request id.
    response = trace_over_socket(d_side, request_id="traced-d")
    mine, theirs = response.sidecars
    assert mine.sidecar.sidecar_id == d_side.sidecar_id and theirs.sidecar.sidecar_id == p_side.sidecar_id
    d_kinds = kinds(mine, "consumer")
    assert in_order(d_kinds, ["admitted", "confirmed", "handshake", "posted", "nixl_completion", "finished"]), d_kinds
    (d_line,) = mine.requests
    assert d_line.done and d_line.peers == [p_side.address] and "traced" in d_line.other_ids
    completion = next(e for e in d_line.events if e.kind == "nixl_completion")
    assert "READ" in completion.detail and "done" in completion.detail, completion.detail
    p_kinds = kinds(theirs, "producer")
    assert in_order(p_kinds, ["admitted", "heartbeat", "notification", "finished"]), p_kinds
    # Where the hand-offs went (bench/control_timeline.py places these): the call reaching the
    # interceptor before admission, the owner thread's part of the READ and the loop's resumption,
    # and P's owner thread seeing the READ's notification before P's loop handled it.
    handoff = {"owner_wait", "owner_post", "owner_done", "loop_resume", "nixl_post", "nixl_transfer"}
    assert handoff <= set(completion.measured_s) and min(completion.measured_s.values()) >= 0, completion
    admitted = [next(e for e in t.events if e.kind == "admitted") for t in (d_line, theirs.requests[0])]
    assert all(e.measured_s["rpc_to_admit"] >= 0 for e in admitted), admitted
    notification = next(e for e in theirs.requests[0].events if e.kind == "notification")
    assert notification.measured_s["loop_wake"] >= 0, notification

    # From the producer's peer port (what an operator reaches on another node), by P's id: the
    # producer learned the consumer's address from its handshake.
    response = trace_over_peer_port(p_side, request_id="traced")
    assert [part.sidecar.sidecar_id for part in response.sidecars] == [p_side.sidecar_id, d_side.sidecar_id]
    assert "finished" in kinds(response.sidecars[1], "consumer")


def test_push_trace_by_transfer_id_and_a_failure_names_its_reason(sidecars, engines) -> None:
    producer, consumer, p_side, d_side = engine_pair(sidecars, engines)
    expect(consumer, producer, "push-d", [7, 8], transfer_id="xfer-1")
    assert producer.command("submit", request_id="push-p", blocks=[[1, 2]], transfer_id="xfer-1", mode=PUSH)["ok"]
    assert consumer.wait_event("push-d", 20)[0]["event"] == "FINISHED_RECEIVING"
    producer.wait_event("push-p")

    response = trace_over_socket(p_side, transfer_id="xfer-1")
    mine, theirs = response.sidecars
    p_kinds = kinds(mine, "producer")
    assert in_order(p_kinds, ["admitted", "matched", "handshake", "posted", "nixl_completion", "finished"]), p_kinds
    registration = [t for t in mine.requests if t.side == "push_registration"]
    assert all(t.done and t.request_id == "push-d" for t in registration)  # it waited, then matched
    d_kinds = kinds(theirs, "consumer")
    assert in_order(d_kinds, ["admitted", "handshake", "registered", "notification", "finished"]), d_kinds

    # A failure: the consumer's timeline ends "failed" with the reason the engine got.
    wrong = engines(p_side, "P2", "producer", model="other-model")
    events = pull_and_wait(wrong, consumer, "mismatch", [1], [9])
    assert events[0]["event"] == "LOAD_FAILED"
    (timeline,) = trace_over_socket(d_side, request_id="mismatch-d").sidecars[0].requests
    last = timeline.events[-1]
    assert last.kind == "failed" and "compatibility hash mismatch" in last.detail, last


def test_bad_queries_unknown_requests_and_bounded_retention(sidecars, engines) -> None:
    p_side = sidecars("p", args=["--set", "trace_requests=2"])
    d_side = sidecars("d")
    producer = engines(p_side, "P", "producer")
    consumer = engines(d_side, "D", "consumer")
    with pytest.raises(grpc.RpcError) as empty:
        trace_over_socket(p_side)
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in str(empty.value.details())
    with pytest.raises(grpc.RpcError) as unknown:
        trace_over_peer_port(p_side, request_id="never-seen")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert "keeps the last 2 requests" in str(unknown.value.details())

    for name in ("first", "second", "third"):
        assert pull_and_wait(producer, consumer, name, [1], [2])[0]["event"] == "FINISHED_RECEIVING"
        producer.wait_event(name)
    with pytest.raises(grpc.RpcError) as evicted:
        trace_over_socket(p_side, request_id="first")
    assert evicted.value.code() == grpc.StatusCode.NOT_FOUND
    assert trace_over_socket(p_side, request_id="third").sidecars[0].requests[0].request_id == "third"
    # The consumer (default retention) still has it, and says the producer no longer does.
    response = trace_over_socket(d_side, request_id="first-d")
    assert response.sidecars[0].requests[0].done
    assert "no trace" in response.sidecars[1].error and not response.sidecars[1].requests
    # The sidecar that answered stays healthy.
    with engine_channel(p_side.socket) as channel:
        engine_pb2_grpc.EngineServiceStub(channel).GetStatus(engine_pb2.GetStatusRequest(), timeout=5)


def test_recorder_keeps_a_ring_of_requests_and_a_bounded_timeline_with_its_end() -> None:
    recorder = TraceRecorder(capacity=3)
    for index in range(5):
        recorder.event("producer", "P", f"req-{index}", "admitted")
    assert len(recorder) == 3
    assert not recorder.find({"req-0"}) and not recorder.find({"req-1"})
    for _ in range(MAX_EVENTS + 10):
        recorder.event("producer", "P", "req-4", "notification", "x")
    recorder.ended("producer", "P", "req-4", engine_pb2.FINISHED_SENDING, "", 10)
    (timeline,) = recorder.find({"req-4"})
    assert len(timeline.events) == MAX_EVENTS + 1 and timeline.dropped == 11  # 1 admitted + 63 kept
    assert timeline.events[-1].kind == "finished" and timeline.done
    # Found by an alias or by a vLLM id with another random suffix.
    recorder.event("consumer", "D", "cmpl-7-0-1a2b3c4d", "admitted", ids=("p-side-id",), transfer_id="t-1")
    assert recorder.find({"p-side-id"}) == recorder.find({"t-1"}) == recorder.find({"cmpl-7-0-9f9f9f9f"})
    off = TraceRecorder(capacity=0)
    off.event("consumer", "D", "r", "admitted")
    assert len(off) == 0


def test_find_answers_like_a_scan_of_every_kept_timeline_and_forgets_evicted_ones() -> None:
    # find() goes through an index by name; it must answer exactly what matching every kept
    # timeline would, in creation order, through evictions, aliases and changed transfer ids.
    import random

    rng = random.Random(5)
    recorder = TraceRecorder(capacity=20)
    names = [f"r{i}" for i in range(60)] + [f"t{i}" for i in range(30)] + ["cmpl-1-0-1a2b3c4d"]
    for _ in range(2000):
        recorder.event(
            rng.choice(["producer", "consumer"]),
            rng.choice(["P", "D"]),
            rng.choice(names[:60] + names[-1:]),
            "x",
            transfer_id=rng.choice(["", *names[60:90]]),
            ids=rng.sample(names, rng.randint(0, 2)),
        )
        wanted = set(rng.sample(names, 2)) | {"cmpl-1-0-ffffffff"}
        expanded = wanted | {"cmpl-1-0"}
        scanned = [t for t in recorder._timelines.values() if t.matches(expanded)]
        assert recorder.find(wanted) == scanned
    # Evicted timelines leave the index: it stays bounded by what is kept.
    assert len(recorder) == 20
    assert len(recorder._indexed) == 20
    assert len(recorder._by_name) <= sum(len(names) for names in recorder._indexed.values())
