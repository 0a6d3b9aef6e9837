"""Validation of incoming requests. Every problem raises ``InvalidArgument`` naming the field, so
callers get INVALID_ARGUMENT with a precise message and nothing half-applied. Pure logic.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvsidecar.block_ids import block_ids_of
from kvsidecar.v1 import common_pb2, engine_pb2
from sidecar import PROTOCOL_VERSION
from sidecar.dataplane.memory import ExportSpec
from sidecar.dataplane.plan.layout import BlockIds
from sidecar.errors import InvalidArgument

_ID_PATTERN = re.compile(r"^[\x21-\x7e]{1,256}$")  # printable ASCII without spaces
MAX_REGIONS = 4096
MAX_EXPORTS = 1024
MAX_GROUPS = 64

_KINDS = {common_pb2.MEMORY_KIND_DRAM: "DRAM", common_pb2.MEMORY_KIND_VRAM: "VRAM"}


def identifier(value: str, field: str, required: bool = True) -> str:
    if not value:
        if required:
            raise InvalidArgument(field, "is required")
        return value
    if not _ID_PATTERN.match(value):
        raise InvalidArgument(field, "must be 1-256 printable ASCII characters without spaces")
    return value


def block_ids(message: common_pb2.GroupedBlockIds, field: str, max_blocks: int, required: bool = True) -> BlockIds:
    if required and not message.groups:
        raise InvalidArgument(field, "needs at least one KV cache group (an empty list per group is allowed)")
    if len(message.groups) > MAX_GROUPS:
        raise InvalidArgument(field, f"has {len(message.groups)} groups, at most {MAX_GROUPS} are allowed")
    total = sum(len(group.ids) for group in message.groups)
    if total > max_blocks:
        raise InvalidArgument(field, f"lists {total} blocks, more than the limit of {max_blocks}")
    blocks = block_ids_of(message)
    for index, ids in enumerate(blocks):
        repeated = first_repeat(ids)
        if repeated is not None:
            raise InvalidArgument(field, f"group {index}: block id {repeated} is listed twice")
    return blocks


def first_repeat(ids: tuple[int, ...]) -> int | None:
    """The first id listed twice in ``ids``, or None. Two names for one block would make one
    transfer write (or read) a block twice and leave another untouched."""
    if len(set(ids)) == len(ids):
        return None
    seen: set[int] = set()
    for block in ids:
        if block in seen:
            return block
        seen.add(block)
    return None


# A DNS name (RFC 1123 labels) or an IPv4 address; IPv6 goes in brackets.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")


@functools.lru_cache(maxsize=1024)
def address_problem(value: str) -> str | None:
    """Why ``value`` is not a peer address ``HOST:PORT`` (``[v6]:PORT``), or None (cached: the same
    few peer addresses come in every request)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        return f"must be HOST:PORT, got {value!r}"
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"port must be 1-65535, got {value!r}"
    if host.startswith("["):
        if not host.endswith("]"):
            return f"an IPv6 host must be in brackets, got {value!r}"
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host} is not an IPv6 address"
        return None
    if ":" in host:
        return f"an IPv6 host must be in brackets ([v6]:PORT), got {value!r}"
    if not _HOSTNAME.match(host):
        return f"host {host!r} is not a host name or IPv4 address"
    return None


def address(value: str, field: str, required: bool = True) -> str:
    """A peer sidecar's ``HOST:PORT``; empty means this sidecar unless ``required``."""
    if not value:
        if required:
            raise InvalidArgument(field, "is required")
        return value
    problem = address_problem(value)
    if problem:
        raise InvalidArgument(field, problem)
    return value


# A block hash is a digest (vLLM: 32-byte sha256, or 8-16 bytes for xxhash/cbor variants).
MAX_BLOCK_HASH_BYTES = 64


def block_hashes(values: Sequence[bytes], field: str, max_count: int) -> tuple[bytes, ...]:
    """Content hashes of leading blocks: at most ``max_count``, each 1-64 bytes."""
    if len(values) > max_count:
        raise InvalidArgument(field, f"lists {len(values)} hashes, more than the {max_count} blocks it describes")
    for index, value in enumerate(values):
        if not 0 < len(value) <= MAX_BLOCK_HASH_BYTES:
            raise InvalidArgument(f"{field}[{index}]", f"must be 1-{MAX_BLOCK_HASH_BYTES} bytes, not {len(value)}")
    return tuple(values)


def duration(value: float, field: str, default: float, maximum: float = 86400.0) -> float:
    if value != value or value < 0:  # NaN or negative
        raise InvalidArgument(field, f"must be a non-negative number of seconds, got {value}")
    if value > maximum:
        raise InvalidArgument(field, f"must be at most {maximum} seconds, got {value}")
    return value or default


def compatibility_hash(factors: Mapping[str, str]) -> str:
    """Hex SHA-256 over the sorted factors and the wire protocol revision."""
    canonical = json.dumps({"protocol": PROTOCOL_VERSION, "factors": dict(sorted(factors.items()))}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class RegionSpec:
    name: str
    export_index: int
    offset: int
    block_len: int
    block_stride: int
    group_id: int


@dataclass(frozen=True)
class WorkerSpec:
    engine_id: str
    role: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    geometry: common_pb2.KvGeometry
    exports: tuple[ExportSpec, ...]
    regions: tuple[RegionSpec, ...]
    compatibility_hash: str
    engine_version: str
    pid: int
    fingerprint: bytes


def register_worker(request: engine_pb2.RegisterWorkerRequest) -> WorkerSpec:
    engine_id = identifier(request.engine_id, "engine_id")
    if request.role not in (
        common_pb2.ENGINE_ROLE_PRODUCER,
        common_pb2.ENGINE_ROLE_CONSUMER,
        common_pb2.ENGINE_ROLE_BOTH,
    ):
        raise InvalidArgument("role", "must be ENGINE_ROLE_PRODUCER, ENGINE_ROLE_CONSUMER or ENGINE_ROLE_BOTH")
    if not 1 <= request.tp_size <= 1024:
        raise InvalidArgument("tp_size", f"must be in 1..1024, got {request.tp_size}")
    if request.tp_rank >= request.tp_size:
        raise InvalidArgument("tp_rank", f"{request.tp_rank} is not below tp_size {request.tp_size}")
    pp_size = request.pp_size or 1
    if pp_size > 256:
        raise InvalidArgument("pp_size", f"must be at most 256, got {pp_size}")
    if request.pp_rank >= pp_size:
        raise InvalidArgument("pp_rank", f"{request.pp_rank} is not below pp_size {pp_size}")
    geometry = request.geometry
    if not request.HasField("geometry"):
        raise InvalidArgument("geometry", "is required")
    if geometry.block_size == 0:
        raise InvalidArgument("geometry.block_size", "must be > 0")
    if geometry.num_blocks == 0:
        raise InvalidArgument("geometry.num_blocks", "must be > 0")
    ratio = geometry.physical_blocks_per_logical or 1
    if geometry.num_blocks % ratio:
        raise InvalidArgument(
            "geometry.num_blocks", f"{geometry.num_blocks} is not a multiple of physical_blocks_per_logical {ratio}"
        )
    if geometry.total_num_kv_heads and geometry.num_kv_heads > geometry.total_num_kv_heads:
        raise InvalidArgument("geometry.num_kv_heads", "exceeds total_num_kv_heads")
    if not request.exports:
        raise InvalidArgument("exports", "at least one memory export is required")
    if len(request.exports) > MAX_EXPORTS:
        raise InvalidArgument("exports", f"at most {MAX_EXPORTS} exports are allowed")
    exports = []
    kinds = set()
    for index, export in enumerate(request.exports):
        field = f"exports[{index}]"
        kind = _KINDS.get(export.kind)
        if kind is None:
            raise InvalidArgument(f"{field}.kind", "must be MEMORY_KIND_DRAM or MEMORY_KIND_VRAM")
        handle = export.WhichOneof("handle")
        if kind == "DRAM" and handle != "shm_path":
            raise InvalidArgument(f"{field}.shm_path", "is required for DRAM exports")
        if kind == "VRAM" and handle != "cuda_ipc_handle":
            raise InvalidArgument(f"{field}.cuda_ipc_handle", "is required for VRAM exports")
        if export.length == 0:
            raise InvalidArgument(f"{field}.length", "must be > 0")
        kinds.add(kind)
        exports.append(
            ExportSpec(
                kind,
                export.shm_path,
                export.cuda_ipc_handle,
                export.offset,
                export.length,
                export.device_id,
                owner_locked=export.owner_locked and kind == "DRAM",
            )
        )
    if len(kinds) > 1:
        raise InvalidArgument("exports", "all exports of one worker must be of the same memory kind")
    if not request.regions:
        raise InvalidArgument("regions", "at least one KV region is required")
    if len(request.regions) > MAX_REGIONS:
        raise InvalidArgument("regions", f"at most {MAX_REGIONS} regions are allowed")
    regions = []
    for index, region in enumerate(request.regions):
        field = f"regions[{index}]"
        if not region.name:
            raise InvalidArgument(f"{field}.name", "is required")
        if region.export_index >= len(exports):
            raise InvalidArgument(f"{field}.export_index", f"{region.export_index} is not an index of exports")
        if region.block_len == 0:
            raise InvalidArgument(f"{field}.block_len", "must be > 0")
        stride = region.block_stride or region.block_len
        if stride < region.block_len:
            raise InvalidArgument(f"{field}.block_stride", f"{stride} is smaller than block_len {region.block_len}")
        if region.group_id >= MAX_GROUPS:
            raise InvalidArgument(f"{field}.group_id", f"must be below {MAX_GROUPS}")
        end = region.offset + (geometry.num_blocks - 1) * stride + region.block_len
        if end > exports[region.export_index].length:
            raise InvalidArgument(
                f"{field}",
                f"{geometry.num_blocks} blocks of {region.block_len} bytes every {stride} bytes from offset "
                f"{region.offset} end at byte {end}, past the export's {exports[region.export_index].length} bytes",
            )
        regions.append(
            RegionSpec(region.name, region.export_index, region.offset, region.block_len, stride, region.group_id)
        )
    names = [region.name for region in regions]
    if len(set(names)) != len(names):
        raise InvalidArgument("regions", "region names must be unique")
    groups = sorted({region.group_id for region in regions})
    if groups != list(range(len(groups))):
        raise InvalidArgument("regions", f"group ids must be 0..n-1 without gaps, got {groups}")
    for key in request.compat_factors:
        if len(key) > 256 or len(request.compat_factors[key]) > 4096:
            raise InvalidArgument("compat_factors", "keys are limited to 256 and values to 4096 characters")
    return WorkerSpec(
        engine_id=engine_id,
        role=request.role,
        tp_rank=request.tp_rank,
        tp_size=request.tp_size,
        pp_rank=request.pp_rank,
        pp_size=pp_size,
        geometry=geometry,
        exports=tuple(exports),
        regions=tuple(regions),
        compatibility_hash=compatibility_hash(request.compat_factors),
        engine_version=request.engine_version[:256],
        pid=request.pid,
        fingerprint=request.SerializeToString(deterministic=True),
    )


def remote_blocks(remote: engine_pb2.RemoteBlocks, field: str, max_blocks: int, require_blocks: bool) -> BlockIds:
    """Check a RemoteBlocks; returns its block ids."""
    identifier(remote.engine_id, f"{field}.engine_id")
    address(remote.address, f"{field}.address", required=False)
    if remote.request_id:
        identifier(remote.request_id, f"{field}.request_id")
    return block_ids(remote.block_ids, f"{field}.block_ids", max_blocks, required=require_blocks)
