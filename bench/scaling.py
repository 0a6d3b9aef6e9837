"""What one sidecar pays per peer it knows: connections, handshake bytes and time, first-contact
and warm latency, memory. Hosts are network namespaces on one bridge (tests/multihost/netns.py,
UCX restricted to TCP); needs root. `python -m bench.scaling [--peers 8] [--json OUT]`.

One consumer host ``d0`` and N producer hosts ``p0..``, one sidecar and one simulated engine each
(TP 1). D pulls one request from P1, then P2, ... (first contact: handshake, NIXL metadata load,
UCX wire-up), then a second request from the same producer (warm: everything cached). After each
new peer it records, for D's sidecar process: established TCP connections (gRPC to peers' port
50151, and the rest: UCX), resident memory (VmRSS), handshakes done per peer (must stay 1), and
the size of the peer's HandshakeResponse (what a first contact downloads). Results go to JSON and
a table; docs/scaling.md models 64 and 512 nodes from them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_shim.client import engine_channel
from kvsidecar.v1 import common_pb2, peer_pb2, peer_pb2_grpc

PEER_PORT = 50151
SHAPE = {"layers": 2, "blocks": 64, "block_len": 65536}  # 8 MiB of KV per engine, 2 regions


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def connections(host: Any, pid: int) -> tuple[int, int]:
    """(gRPC, other) established TCP connections of ``pid`` on ``host``, loopback excluded."""
    listing = host.run("ss", "-tnpH", "state", "established").stdout.splitlines()
    grpc_count = other = 0
    for line in listing:
        if f"pid={pid}," not in line:
            continue
        fields = line.split()
        local, peer = fields[2], fields[3]
        if local.startswith("127.") or peer.startswith("127."):
            continue
        if peer.endswith(f":{PEER_PORT}") or local.endswith(f":{PEER_PORT}"):
            grpc_count += 1
        else:
            other += 1
    return grpc_count, other


def handshake_size(socket: Path, engine_id: str) -> tuple[int, int, int]:
    """(request bytes, response bytes, NIXL agent metadata bytes) of a handshake for ``engine_id``,
    asked over the producer sidecar's Unix socket (which also serves PeerService)."""
    request = peer_pb2.HandshakeRequest(
        caller=common_pb2.SidecarInfo(sidecar_id="0" * 32, address=f"d0.kvs.test:{PEER_PORT}"), engine_id=engine_id
    )
    with engine_channel(socket) as channel:
        response = peer_pb2_grpc.PeerServiceStub(channel).Handshake(request, timeout=10)
    metadata = sum(len(worker.agent_metadata) for worker in response.engine.workers)
    return request.ByteSize(), response.ByteSize(), metadata


def pull_once(producer: Any, consumer: Any, name: str, block: int) -> float:
    started = time.perf_counter()
    assert producer.command("submit", request_id=name, blocks=[[block]])["ok"]
    remote = {
        "address": producer.peer_address,
        "engine_id": producer.engine_id,
        "request_id": name,
        "blocks": [[block]],
    }
    assert consumer.command("pull", request_id=f"{name}-d", blocks=[[block]], remote=remote)["ok"]
    event = consumer.wait_event(f"{name}-d", 60)[0]
    if event["event"] != "FINISHED_RECEIVING":
        raise RuntimeError(f"{name}: {event}")
    return time.perf_counter() - started


def run(peers: int) -> dict[str, Any]:
    from tests.multihost.conftest import Cluster
    from tests.multihost.netns import Network

    hosts = ["d0"] + [f"p{i}" for i in range(peers)]
    workdir = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    network = Network(hosts)
    cluster = Cluster(network, workdir)
    rows: list[dict[str, Any]] = []
    try:
        network.open()
        d_side = cluster.sidecar("d0")
        consumer = cluster.engine("d0", "D0", "consumer", **SHAPE)
        producers = []
        for index in range(peers):
            cluster.sidecar(f"p{index}")
            producers.append(cluster.engine(f"p{index}", f"P{index}", "producer", **SHAPE))
        assert d_side.process is not None
        pid = d_side.process.pid
        time.sleep(1.0)
        baseline = {"peers": 0, "rss_kib": rss_kib(pid), "grpc_connections": 0, "other_connections": 0}
        baseline["grpc_connections"], baseline["other_connections"] = connections(network["d0"], pid)
        rows.append(baseline)
        for index, producer in enumerate(producers):
            first = pull_once(producer, consumer, f"first-{index}", 1 + index)
            warm = [pull_once(producer, consumer, f"warm-{index}-{k}", 1 + index) for k in range(3)]
            done = [e for e in d_side.log_events() if e.get("event") == "handshake_done"]
            per_peer = {e["peer"]: sum(1 for x in done if x["peer"] == e["peer"]) for e in done}
            handshake_ms = next(e["ms"] for e in done if e["engine_id"] == producer.engine_id)
            socket = cluster.sidecars[f"p{index}"].socket
            request_bytes, response_bytes, metadata_bytes = handshake_size(socket, producer.engine_id)
            grpc_count, other = connections(network["d0"], pid)
            rows.append(
                {
                    "peers": index + 1,
                    "first_contact_ms": first * 1000,
                    "warm_ms": statistics.median(warm) * 1000,
                    "handshake_ms": handshake_ms,
                    "handshakes_per_peer": sorted(set(per_peer.values())),
                    "handshake_request_bytes": request_bytes,
                    "handshake_response_bytes": response_bytes,
                    "agent_metadata_bytes": metadata_bytes,
                    "rss_kib": rss_kib(pid),
                    "grpc_connections": grpc_count,
                    "other_connections": other,
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        cluster.close()
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
    per_peer_kib = (rows[-1]["rss_kib"] - rows[1]["rss_kib"]) / max(1, peers - 1)
    return {"rows": rows, "rss_kib_per_additional_peer": per_peer_kib, "shape": SHAPE}


def render(result: dict[str, Any]) -> str:
    headers = [
        "peers",
        "first ms",
        "warm ms",
        "handshake ms",
        "resp B",
        "metadata B",
        "RSS MiB",
        "gRPC conns",
        "UCX conns",
    ]
    lines = ["  ".join(headers)]
    for row in result["rows"]:
        lines.append(
            "  ".join(
                [
                    str(row["peers"]),
                    f"{row.get('first_contact_ms', 0):.1f}",
                    f"{row.get('warm_ms', 0):.1f}",
                    f"{row.get('handshake_ms', 0):.2f}",
                    str(row.get("handshake_response_bytes", "-")),
                    str(row.get("agent_metadata_bytes", "-")),
                    f"{row['rss_kib'] / 1024:.1f}",
                    str(row["grpc_connections"]),
                    str(row["other_connections"]),
                ]
            )
        )
    lines.append(f"RSS per additional peer: {result['rss_kib_per_additional_peer']:.0f} KiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tests.multihost.netns import unavailable

    parser = argparse.ArgumentParser(prog="bench.scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--json", type=Path, default=Path("bench/out/scaling.json"))
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"bench.scaling needs network namespaces: {reason}", file=sys.stderr)
        return 2
    result = run(args.peers)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
