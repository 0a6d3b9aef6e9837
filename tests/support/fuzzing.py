"""Hostile input for a live sidecar: hypothesis strategies for every request of EngineService and
PeerService, a caller that sends them (or raw bytes) over real gRPC and checks each answer, and
the check that nothing was left behind.

Addresses generated here are only ever loopback (127.0.0.0/8 or [::1], any port, plus malformed
strings whose host part is loopback or empty): nothing else is ever named, so nothing else can be
dialled.
"""

from __future__ import annotations

import collections
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import strategies as st

from engine_shim.client import engine_channel
from engine_shim.messages import grouped
from kvsidecar.v1 import common_pb2, engine_pb2, peer_pb2
from tests.support.processes import SidecarProcess

KNOWN_ENGINE = "E"
KNOWN_BLOCKS = 64
ENGINE_SERVICE = "kvsidecar.v1.EngineService"
PEER_SERVICE = "kvsidecar.v1.PeerService"
# Never acceptable as an answer to any input: a bug in the daemon. A DEADLINE_EXCEEDED the client
# raised itself (details exactly "Deadline Exceeded") is a hang and counts too; one the daemon
# sends (a peer call that timed out, naming the peer) is an answer.
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
CLIENT_DEADLINE = "Deadline Exceeded"
CALL_TIMEOUT = 20.0

U32 = 2**32 - 1
ODD_IDS = ["", " ", "a/b", "../..", "\x00", "id\nwith\nlines", "é\u202e\U0001f600", "x" * 5000, "E ", "e", "%s%n"]


# --- strategies ------------------------------------------------------------------------------


def idents(known: str = KNOWN_ENGINE) -> st.SearchStrategy[str]:
    return st.one_of(st.just(known), st.sampled_from(ODD_IDS), st.text(max_size=64))


def request_ids() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(["r1", "r2", "r3"]), st.sampled_from(ODD_IDS), st.text(max_size=40))


def u32() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([0, 1, 2, 63, 64, 65, 1000, 2**31, U32]), st.integers(0, U32))


def u64() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([0, 1, 4096, 2**40, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))


def seconds() -> st.SearchStrategy[float]:
    """Durations: negative, zero, tiny, huge, NaN and infinities included."""
    return st.one_of(st.sampled_from([0.0, -1.0, 0.001, 1.0, 1e9, -1e308]), st.floats(allow_nan=True))


def block_lists() -> st.SearchStrategy[list[int]]:
    hostile = st.sampled_from([0, 1, 5, 63, 64, 65, 1000, U32])
    return st.one_of(
        st.lists(st.one_of(hostile, st.integers(0, KNOWN_BLOCKS - 1)), max_size=24),
        st.just([5, 5]),
        st.builds(lambda n: list(range(n)), st.sampled_from([0, 64, 300_000])),  # empty, all, huge
    )


def block_id_groups() -> st.SearchStrategy[common_pb2.GroupedBlockIds]:
    return st.builds(grouped, st.lists(block_lists(), max_size=4))


def loopback_addresses(own: str) -> st.SearchStrategy[str]:
    """Loopback only: 127.0.0.0/8 or [::1] with any port (in range or not), this sidecar's own
    address, and malformed strings whose host is loopback or empty."""
    port = st.one_of(st.sampled_from([0, 1, 65535, 65536, 99999]), st.integers(0, 70000))
    v4 = st.builds(lambda b, c, d, p: f"127.{b}.{c}.{d}:{p}", st.integers(0, 255), st.integers(0, 255),
                   st.integers(0, 255), port)  # fmt: skip
    v6 = st.builds(lambda p: f"[::1]:{p}", port)
    malformed = st.sampled_from(
        ["", ":", "127.0.0.1", "127.0.0.1:", "127.0.0.1:-1", "127.0.0.1:port", "127.0.0.1:1:2", "::1:80", "[::1]",
         "[::1:80", ":80", "127.0.0.1:80\x00", "127.0.0.1 :80", "[127.0.0.1]:80"]
    )  # fmt: skip
    return st.one_of(st.just(own), v4, v6, malformed)


def sidecar_infos(own: str) -> st.SearchStrategy[common_pb2.SidecarInfo]:
    return st.builds(
        common_pb2.SidecarInfo,
        sidecar_id=idents(),
        address=loopback_addresses(own),
        versions=st.builds(common_pb2.VersionInfo, protocol=st.sampled_from([0, 1, 2, 99, U32])),
        clock_unix_s=seconds(),
        hostname=st.text(max_size=20),
    )


def remotes(own: str) -> st.SearchStrategy[engine_pb2.RemoteBlocks]:
    return st.builds(
        engine_pb2.RemoteBlocks,
        address=loopback_addresses(own),
        engine_id=idents(),
        request_id=request_ids(),
        block_ids=block_id_groups(),
        tp_size=u32(),
        num_tokens=u32(),
    )


def registrations(decoy: Path) -> st.SearchStrategy[engine_pb2.RegisterWorkerRequest]:
    paths = st.sampled_from([str(decoy), "/dev/shm/does-not-exist", "/etc/passwd", "relative", "/dev/shm/../etc/x",
                             "", "/dev/shm/" + "x" * 300, "/dev/zero"])  # fmt: skip
    export = st.builds(
        engine_pb2.MemoryExport,
        kind=st.sampled_from([0, 1, 2, 77]),
        shm_path=paths,
        offset=u64(),
        length=st.one_of(st.just(decoy.stat().st_size), u64()),
        device_id=st.integers(-(2**31), 2**31 - 1),
        owner_locked=st.booleans(),
    )
    region = st.builds(
        engine_pb2.KvRegion,
        name=st.text(max_size=10),
        export_index=st.sampled_from([0, 1, U32]),
        offset=u64(),
        block_len=st.one_of(st.sampled_from([0, 1, 4096]), u64()),
        block_stride=st.one_of(st.sampled_from([0, 4096, 8192]), u64()),
        group_id=st.sampled_from([0, 1, U32]),
    )
    geometry = st.builds(
        common_pb2.KvGeometry,
        block_size=u32(),
        physical_blocks_per_logical=u32(),
        kv_layout=st.sampled_from(["", "NHD", "HND", "LBHNC", "??"]),
        num_blocks=u32(),
        num_kv_heads=u32(),
        total_num_kv_heads=u32(),
        is_mla=st.booleans(),
    )
    return st.builds(
        engine_pb2.RegisterWorkerRequest,
        engine_id=st.one_of(st.just("F"), idents()),
        role=st.sampled_from([0, 1, 2, 3, 99]),
        tp_rank=u32(),
        tp_size=u32(),
        pp_rank=u32(),
        pp_size=u32(),
        geometry=geometry,
        exports=st.lists(export, max_size=3),
        regions=st.lists(region, max_size=4),
        compat_factors=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
        engine_version=st.text(max_size=10),
        pid=u32(),
    )


def engine_calls(own: str, decoy: Path) -> st.SearchStrategy[tuple[str, Any]]:
    """(method, request) for every EngineService RPC. UnregisterWorker and WatchEvents never name
    the known engine: that would legitimately take the worker the test relies on away."""
    others = idents().filter(lambda value: value != KNOWN_ENGINE)
    calls: dict[str, st.SearchStrategy[Any]] = {
        "RegisterWorker": registrations(decoy),
        "UnregisterWorker": st.builds(engine_pb2.UnregisterWorkerRequest, engine_id=others, tp_rank=u32(),
                                      pp_rank=u32()),
        "SubmitBlocks": st.builds(engine_pb2.SubmitBlocksRequest, engine_id=idents(), request_id=request_ids(),
                                  transfer_id=request_ids(), block_ids=block_id_groups(), num_tokens=u32(),
                                  lease_seconds=seconds(), mode=st.sampled_from([0, 1, 2, 9])),
        "ExpectPush": st.builds(engine_pb2.ExpectPushRequest, engine_id=idents(), request_id=request_ids(),
                                transfer_id=request_ids(), block_ids=block_id_groups(), remote=remotes(own),
                                timeout_seconds=seconds()),
        "KeepAlive": st.builds(engine_pb2.KeepAliveRequest, engine_id=idents(), request_id=request_ids(),
                               transfer_id=request_ids(), remote=remotes(own), timeout_seconds=seconds()),
        "Pull": st.builds(engine_pb2.PullRequest, engine_id=idents(), request_id=request_ids(),
                          transfer_id=request_ids(), local_block_ids=block_id_groups(), remote=remotes(own),
                          timeout_seconds=seconds()),
        "HoldBlocks": st.builds(engine_pb2.HoldBlocksRequest, engine_id=idents(), request_id=request_ids(),
                                conversation_id=request_ids(), block_ids=block_id_groups(), num_tokens=u32(),
                                ttl_seconds=seconds()),
        "QueryCache": st.builds(engine_pb2.QueryCacheRequest, engine_id=idents(), address=loopback_addresses(own),
                                conversation_id=request_ids(), request_id=request_ids()),
        "Release": st.builds(engine_pb2.ReleaseRequest, engine_id=idents(), request_id=request_ids(),
                             transfer_id=request_ids(), reason=st.text(max_size=30)),
        "WatchEvents": st.builds(engine_pb2.WatchEventsRequest, engine_id=others, tp_rank=u32(), pp_rank=u32()),
        "GetStatus": st.builds(engine_pb2.GetStatusRequest, include_requests=st.booleans()),
    }  # fmt: skip
    return st.one_of(*(st.tuples(st.just(name), strategy) for name, strategy in calls.items()))


def peer_calls(own: str) -> st.SearchStrategy[tuple[str, Any]]:
    keys = st.builds(peer_pb2.RequestKey, request_id=request_ids(), transfer_id=request_ids(),
                     consumer_request_id=request_ids())  # fmt: skip
    calls: dict[str, st.SearchStrategy[Any]] = {
        "Handshake": st.builds(peer_pb2.HandshakeRequest, caller=sidecar_infos(own), engine_id=idents(),
                               compatibility_hash=st.one_of(st.just(""), st.text(max_size=70))),
        "PushReg": st.builds(peer_pb2.PushRegRequest, caller=sidecar_infos(own), prefill_engine_id=idents(),
                             prefill_request_id=request_ids(), transfer_id=request_ids(),
                             decode_engine_id=idents(), request_id=request_ids(), block_ids=block_id_groups(),
                             decode_tp_size=u32(), compatibility_hash=st.text(max_size=70),
                             timeout_seconds=seconds(), decode_generation=st.text(max_size=20)),
        "Heartbeat": st.builds(peer_pb2.HeartbeatRequest, caller_sidecar_id=idents(), engine_id=idents(),
                               requests=st.lists(keys, max_size=8)),
        "QueryCache": st.builds(peer_pb2.PeerQueryCacheRequest, caller_sidecar_id=idents(), engine_id=idents(),
                                conversation_id=request_ids(), request_id=request_ids()),
        "TransferFailed": st.builds(peer_pb2.TransferFailedRequest, caller_sidecar_id=idents(), engine_id=idents(),
                                    request_id=request_ids(), transfer_id=request_ids(),
                                    reason=st.text(max_size=30)),
        "Release": st.builds(peer_pb2.PeerReleaseRequest, caller_sidecar_id=idents(), engine_id=idents(),
                             request_id=request_ids(), transfer_id=request_ids(),
                             consumer_request_id=request_ids(), consumed=st.booleans(),
                             reason=st.text(max_size=30)),
    }  # fmt: skip
    return st.one_of(*(st.tuples(st.just(name), strategy) for name, strategy in calls.items()))


ENGINE_METHODS = ["RegisterWorker", "UnregisterWorker", "SubmitBlocks", "ExpectPush", "KeepAlive", "Pull",
                  "HoldBlocks", "QueryCache", "Release", "GetStatus"]  # fmt: skip
PEER_METHODS = ["Handshake", "PushReg", "Heartbeat", "QueryCache", "TransferFailed", "Release"]


# --- the caller ------------------------------------------------------------------------------


def process_usage(pid: int) -> dict[str, int]:
    """RSS (KiB), open fds and threads of a live process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
    }


@dataclass
class FuzzTarget:
    """One live sidecar under fire: sends messages, checks every answer, tallies status codes, and
    remembers the request ids that named the known engine so they can be released at the end."""

    sidecar: SidecarProcess
    tally: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
    touched: set[str] = field(default_factory=set)
    sent: int = 0
    # (method, status, details up to the first digit) -> one request that got it
    violations: dict[tuple[str, str, str], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.unix = engine_channel(self.sidecar.socket)
        self.tcp = grpc.insecure_channel(self.sidecar.address)

    def close(self) -> None:
        self.unix.close()
        self.tcp.close()

    def _channel(self, service: str) -> grpc.Channel:
        return self.unix if service == ENGINE_SERVICE else self.tcp

    def send(self, service: str, method: str, request: Any) -> grpc.StatusCode:
        """Send a message (or raw bytes) and return its status. A forbidden status is recorded
        (``violations``: the campaign goes on, to find every kind); a dead daemon fails at once."""
        self._remember(request)
        raw = isinstance(request, bytes)
        payload = request if raw else request.SerializeToString()
        path = f"/{service}/{method}"
        channel = self._channel(service)
        code = grpc.StatusCode.OK
        details = ""
        try:
            if method == "WatchEvents":
                stream = channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT)
                for _ in stream:
                    break  # a stream that opened is an answer; close it at once
                stream.cancel()
            else:
                channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code == grpc.StatusCode.CANCELLED and method == "WatchEvents":
                code = grpc.StatusCode.OK
        self.sent += 1
        short = service.rsplit(".", 1)[-1]
        self.tally[(short + ("/raw" if raw else ""), method, code.name)] += 1
        assert self.sidecar.process is not None and self.sidecar.process.poll() is None, (
            f"sidecar died on {method}: {request!r:.300}\n{self.sidecar.log_tail()}"
        )
        if code in FORBIDDEN or (code == grpc.StatusCode.DEADLINE_EXCEEDED and details == CLIENT_DEADLINE):
            shape = re.split(r"[0-9'\"]", details, maxsplit=1)[0][:80]
            self.violations.setdefault((method, code.name, shape), f"{details[:300]} <- {request!r:.400}")
        return code

    def _remember(self, request: Any) -> None:
        if isinstance(request, bytes):
            return
        names = [getattr(request, name, "") for name in ("engine_id", "prefill_engine_id", "decode_engine_id")]
        if KNOWN_ENGINE in names:
            for name in ("request_id", "prefill_request_id", "transfer_id"):
                value = getattr(request, name, "")
                if value:
                    self.touched.add(value)

    def serving(self) -> bool:
        for channel in (self.unix, self.tcp):
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return False
        return True

    def status(self) -> engine_pb2.GetStatusResponse:
        from kvsidecar.v1 import engine_pb2_grpc

        response: engine_pb2.GetStatusResponse = engine_pb2_grpc.EngineServiceStub(self.unix).GetStatus(
            engine_pb2.GetStatusRequest(include_requests=True), timeout=5
        )
        return response

    def release_touched(self) -> None:
        """Release every request a fuzzed message may legitimately have started for the known
        engine (a valid SubmitBlocks holds a lease until released: that is not a leak)."""
        from kvsidecar.v1 import engine_pb2_grpc

        stub = engine_pb2_grpc.EngineServiceStub(self.unix)
        for request_id in sorted(self.touched):
            try:
                stub.Release(engine_pb2.ReleaseRequest(engine_id=KNOWN_ENGINE, request_id=request_id), timeout=5)
            except grpc.RpcError as exc:
                assert exc.code() not in FORBIDDEN, exc

    def table(self) -> str:
        rows = sorted(self.tally.items())
        width = max((len(f"{s} {m}") for (s, m, _), _ in rows), default=10)
        lines = [f"{'service method':<{width}}  {'status':<20} count", "-" * (width + 28)]
        lines += [f"{s + ' ' + m:<{width}}  {c:<20} {n}" for (s, m, c), n in rows]
        return "\n".join(lines)


def leftover(status: engine_pb2.GetStatusResponse, engines: Iterable[str]) -> list[str]:
    """What a sidecar still holds beyond the given registered engines: [] when clean."""
    found = []
    for name in ("leases", "transfers_in_flight", "pending_push_registrations", "unmatched_submissions",
                 "pending_receives", "held_requests"):  # fmt: skip
        if getattr(status, name):
            found.append(f"{name}={getattr(status, name)}")
    extra = sorted({e.engine_id for e in status.engines} - set(engines))
    if extra:
        found.append(f"engines {extra!r}")
    strangers = [p.address for p in status.peers if not p.sidecar_id]
    if strangers:
        found.append(f"peers that never handshook {strangers[:10]!r} ({len(strangers)})")
    if status.requests:
        found.append(f"{len(status.requests)} requests, e.g. {status.requests[0]}")
    return found


def wait_clean(target: FuzzTarget, engines: Iterable[str], timeout: float) -> list[str]:
    """Wait (bounded) until nothing is left; returns what is left at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        left = leftover(target.status(), engines)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
