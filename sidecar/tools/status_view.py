"""``kvsidecar status``: fetch GetStatus over the engine socket and render it for people (tables)
or machines (JSON)."""

from __future__ import annotations

from pathlib import Path

import grpc
from google.protobuf import json_format

from engine_shim.client import engine_channel
from kvsidecar.v1 import common_pb2, engine_pb2, engine_pb2_grpc


def fetch_status(socket_path: Path | None, include_requests: bool, timeout: float) -> engine_pb2.GetStatusResponse:
    if socket_path is None:
        from sidecar.config import load_settings

        socket_path = load_settings().engine_socket
    with engine_channel(socket_path) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        try:
            response: engine_pb2.GetStatusResponse = stub.GetStatus(
                engine_pb2.GetStatusRequest(include_requests=include_requests), timeout=timeout
            )
            return response
        except grpc.RpcError as exc:
            raise ConnectionError(f"no sidecar answered on {socket_path}: {exc.code().name}: {exc.details()}") from None


def render_json(response: engine_pb2.GetStatusResponse) -> str:
    return json_format.MessageToJson(
        response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip()
        for row in [headers, *rows]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def _admission(admission: engine_pb2.AdmissionStatus) -> str:
    bound = f"{admission.bound_ms:.0f} ms" if admission.bound_ms else "off"
    return (
        f"admission: estimated wait {admission.queue_delay_ms:.1f} ms (bound {bound})  transfers in flight "
        f"{admission.in_flight} (most {admission.peak_in_flight}) at {admission.throughput_per_second:.0f}/s, "
        f"{admission.solo_ms:.1f} ms alone  admitted {admission.admitted}  refused {admission.refused}"
    )


def render_tables(response: engine_pb2.GetStatusResponse) -> str:
    sidecar = response.sidecar
    out = [
        f"kvsidecar {sidecar.versions.kvsidecar}  id {sidecar.sidecar_id[:12]}  peers reach it at {sidecar.address}",
        f"uptime {response.uptime_seconds:.0f}s  {sidecar.versions.nixl}  grpc {sidecar.versions.grpc}"
        + ("  DRAINING" if response.draining else ""),
        "",
        f"leases {response.leases}  transfers in flight {response.transfers_in_flight}  "
        f"pending receives {response.pending_receives}  "
        f"push registrations waiting {response.pending_push_registrations}  "
        f"unmatched submissions {response.unmatched_submissions}  held {response.held_requests}",
        _admission(response.admission),
        "",
    ]
    rows = []
    for engine in response.engines:
        for worker in engine.workers:
            rows.append(
                [
                    engine.engine_id,
                    common_pb2.EngineRole.Name(engine.role).removeprefix("ENGINE_ROLE_").lower(),
                    f"tp{worker.tp_rank}/{engine.tp_size} pp{worker.pp_rank}/{engine.pp_size}",
                    "yes" if engine.complete else "no",
                    _bytes(worker.registered_bytes),
                    str(worker.num_regions),
                    "yes" if worker.watching else "no",
                    str(worker.pid or ""),
                    worker.agent_name,
                ]
            )
    out.append("ENGINES")
    out.append(
        _table(["engine", "role", "rank", "complete", "registered", "regions", "watching", "pid", "agent"], rows)
        if rows
        else "  (none registered)"
    )
    out.append("")
    peer_rows = [
        [
            peer.address,
            peer.sidecar_id[:12],
            peer.versions.kvsidecar or "-",
            ",".join(peer.engine_ids) or "-",
            f"{peer.last_seen_seconds_ago:.1f}s" if peer.last_seen_seconds_ago >= 0 else "-",
            f"{peer.handshake_ms:.1f}",
            str(peer.consecutive_failures),
        ]
        for peer in response.peers
    ]
    out.append("PEERS")
    out.append(
        _table(["address", "sidecar", "version", "engines", "last seen", "handshake ms", "failures"], peer_rows)
        if peer_rows
        else "  (none)"
    )
    if response.requests:
        out.append("")
        out.append("REQUESTS")
        out.append(
            _table(
                ["engine", "request", "transfer", "side", "mode", "state", "deadline", "blocks"],
                [
                    [
                        r.engine_id,
                        r.request_id,
                        r.transfer_id or "-",
                        r.side,
                        common_pb2.TransferMode.Name(r.mode).removeprefix("TRANSFER_MODE_").lower(),
                        r.state,
                        f"{r.deadline_in_seconds:.1f}s" if r.deadline_in_seconds >= 0 else "-",
                        str(r.num_blocks),
                    ]
                    for r in response.requests
                ],
            )
        )
    return "\n".join(out)
