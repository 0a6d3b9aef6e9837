from kvsidecar.v1 import common_pb2 as _common_pb2
from kvsidecar.v1 import engine_pb2 as _engine_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvDigests(_message.Message):
    __slots__ = ("first_token", "end_token", "granule_tokens", "values")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_FIELD_NUMBER: _ClassVar[int]
    GRANULE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    end_token: int
    granule_tokens: int
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, first_token: _Optional[int] = ..., end_token: _Optional[int] = ..., granule_tokens: _Optional[int] = ..., values: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetDigestsRequest(_message.Message):
    __slots__ = ("caller_sidecar_id", "engine_id", "request_id", "transfer_id", "span")
    CALLER_SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SPAN_FIELD_NUMBER: _ClassVar[int]
    caller_sidecar_id: str
    engine_id: str
    request_id: str
    transfer_id: str
    span: KvDigests
    def __init__(self, caller_sidecar_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., span: _Optional[_Union[KvDigests, _Mapping]] = ...) -> None: ...

class GetDigestsResponse(_message.Message):
    __slots__ = ("sidecar_id", "digests")
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    sidecar_id: str
    digests: KvDigests
    def __init__(self, sidecar_id: _Optional[str] = ..., digests: _Optional[_Union[KvDigests, _Mapping]] = ...) -> None: ...

class RemoteRegion(_message.Message):
    __slots__ = ("name", "base_address", "block_len", "block_stride", "group_id", "kind", "device_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_address: int
    block_len: int
    block_stride: int
    group_id: int
    kind: _common_pb2.MemoryKind
    device_id: int
    def __init__(self, name: _Optional[str] = ..., base_address: _Optional[int] = ..., block_len: _Optional[int] = ..., block_stride: _Optional[int] = ..., group_id: _Optional[int] = ..., kind: _Optional[_Union[_common_pb2.MemoryKind, str]] = ..., device_id: _Optional[int] = ...) -> None: ...

class WorkerDescriptor(_message.Message):
    __slots__ = ("tp_rank", "pp_rank", "agent_name", "agent_metadata", "regions", "geometry", "node_local_exports", "staging_pool")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NODE_LOCAL_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    STAGING_POOL_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    pp_rank: int
    agent_name: str
    agent_metadata: bytes
    regions: _containers.RepeatedCompositeFieldContainer[RemoteRegion]
    geometry: _common_pb2.KvGeometry
    node_local_exports: _containers.RepeatedCompositeFieldContainer[NodeLocalExport]
    staging_pool: StagingPool
    def __init__(self, tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., regions: _Optional[_Iterable[_Union[RemoteRegion, _Mapping]]] = ..., geometry: _Optional[_Union[_common_pb2.KvGeometry, _Mapping]] = ..., node_local_exports: _Optional[_Iterable[_Union[NodeLocalExport, _Mapping]]] = ..., staging_pool: _Optional[_Union[StagingPool, _Mapping]] = ...) -> None: ...

class StagingPool(_message.Message):
    __slots__ = ("address", "length", "chunk_bytes", "accepts_push")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_PUSH_FIELD_NUMBER: _ClassVar[int]
    address: int
    length: int
    chunk_bytes: int
    accepts_push: bool
    def __init__(self, address: _Optional[int] = ..., length: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., accepts_push: _Optional[bool] = ...) -> None: ...

class StageRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "transfer_id", "agent_name", "rows", "timeout_seconds", "done_slots", "inbound", "landed_slot", "lend")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DONE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    INBOUND_FIELD_NUMBER: _ClassVar[int]
    LANDED_SLOT_FIELD_NUMBER: _ClassVar[int]
    LEND_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    transfer_id: str
    agent_name: str
    rows: bytes
    timeout_seconds: float
    done_slots: _containers.RepeatedScalarFieldContainer[int]
    inbound: bool
    landed_slot: int
    lend: bool
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., rows: _Optional[bytes] = ..., timeout_seconds: _Optional[float] = ..., done_slots: _Optional[_Iterable[int]] = ..., inbound: _Optional[bool] = ..., landed_slot: _Optional[int] = ..., lend: _Optional[bool] = ...) -> None: ...

class StageResponse(_message.Message):
    __slots__ = ("slot", "address")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    address: int
    def __init__(self, slot: _Optional[int] = ..., address: _Optional[int] = ...) -> None: ...

class NodeLocalExport(_message.Message):
    __slots__ = ("cuda_ipc_handle", "offset", "length", "address", "gpu_uuid", "node_id")
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    cuda_ipc_handle: bytes
    offset: int
    length: int
    address: int
    gpu_uuid: str
    node_id: str
    def __init__(self, cuda_ipc_handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., address: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class EngineDescriptor(_message.Message):
    __slots__ = ("engine_id", "role", "tp_size", "pp_size", "compatibility_hash", "engine_version", "workers", "generation", "voucher_key")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    VOUCHER_KEY_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: _common_pb2.EngineRole
    tp_size: int
    pp_size: int
    compatibility_hash: str
    engine_version: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerDescriptor]
    generation: str
    voucher_key: bytes
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.EngineRole, str]] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., compatibility_hash: _Optional[str] = ..., engine_version: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerDescriptor, _Mapping]]] = ..., generation: _Optional[str] = ..., voucher_key: _Optional[bytes] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("caller", "engine_id", "compatibility_hash")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    caller: _common_pb2.SidecarInfo
    engine_id: str
    compatibility_hash: str
    def __init__(self, caller: _Optional[_Union[_common_pb2.SidecarInfo, _Mapping]] = ..., engine_id: _Optional[str] = ..., compatibility_hash: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("sidecar", "engine")
    SIDECAR_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    sidecar: _common_pb2.SidecarInfo
    engine: EngineDescriptor
    def __init__(self, sidecar: _Optional[_Union[_common_pb2.SidecarInfo, _Mapping]] = ..., engine: _Optional[_Union[EngineDescriptor, _Mapping]] = ...) -> None: ...

class PushRegRequest(_message.Message):
    __slots__ = ("caller", "prefill_engine_id", "prefill_request_id", "transfer_id", "decode_engine_id", "request_id", "block_ids", "decode_tp_size", "compatibility_hash", "timeout_seconds", "decode_generation", "want_digests", "write_by_unix_ms")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    WANT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    WRITE_BY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    caller: _common_pb2.SidecarInfo
    prefill_engine_id: str
    prefill_request_id: str
    transfer_id: str
    decode_engine_id: str
    request_id: str
    block_ids: _common_pb2.GroupedBlockIds
    decode_tp_size: int
    compatibility_hash: str
    timeout_seconds: float
    decode_generation: str
    want_digests: bool
    write_by_unix_ms: int
    def __init__(self, caller: _Optional[_Union[_common_pb2.SidecarInfo, _Mapping]] = ..., prefill_engine_id: _Optional[str] = ..., prefill_request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., decode_engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ..., decode_tp_size: _Optional[int] = ..., compatibility_hash: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., decode_generation: _Optional[str] = ..., want_digests: _Optional[bool] = ..., write_by_unix_ms: _Optional[int] = ...) -> None: ...

class PushRegResponse(_message.Message):
    __slots__ = ("sidecar_id", "matched", "writes_end_within_seconds")
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    WRITES_END_WITHIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sidecar_id: str
    matched: bool
    writes_end_within_seconds: float
    def __init__(self, sidecar_id: _Optional[str] = ..., matched: _Optional[bool] = ..., writes_end_within_seconds: _Optional[float] = ...) -> None: ...

class RequestKey(_message.Message):
    __slots__ = ("request_id", "transfer_id", "consumer_request_id", "block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    consumer_request_id: str
    block_ids: _common_pb2.GroupedBlockIds
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., consumer_request_id: _Optional[str] = ..., block_ids: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("caller_sidecar_id", "engine_id", "requests")
    CALLER_SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    caller_sidecar_id: str
    engine_id: str
    requests: _containers.RepeatedCompositeFieldContainer[RequestKey]
    def __init__(self, caller_sidecar_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., requests: _Optional[_Iterable[_Union[RequestKey, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("sidecar_id", "unknown", "lease_seconds", "foreign_blocks", "engine_generation")
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FOREIGN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    sidecar_id: str
    unknown: _containers.RepeatedCompositeFieldContainer[RequestKey]
    lease_seconds: float
    foreign_blocks: _containers.RepeatedCompositeFieldContainer[RequestKey]
    engine_generation: str
    def __init__(self, sidecar_id: _Optional[str] = ..., unknown: _Optional[_Iterable[_Union[RequestKey, _Mapping]]] = ..., lease_seconds: _Optional[float] = ..., foreign_blocks: _Optional[_Iterable[_Union[RequestKey, _Mapping]]] = ..., engine_generation: _Optional[str] = ...) -> None: ...

class PeerQueryCacheRequest(_message.Message):
    __slots__ = ("caller_sidecar_id", "engine_id", "conversation_id", "request_id", "block_hashes")
    CALLER_SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    caller_sidecar_id: str
    engine_id: str
    conversation_id: str
    request_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, caller_sidecar_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., request_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PeerQueryCacheResponse(_message.Message):
    __slots__ = ("sidecar_id", "entries")
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    sidecar_id: str
    entries: _containers.RepeatedCompositeFieldContainer[_engine_pb2.CacheEntry]
    def __init__(self, sidecar_id: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[_engine_pb2.CacheEntry, _Mapping]]] = ...) -> None: ...

class TransferFailedRequest(_message.Message):
    __slots__ = ("caller_sidecar_id", "engine_id", "request_id", "transfer_id", "reason")
    CALLER_SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    caller_sidecar_id: str
    engine_id: str
    request_id: str
    transfer_id: str
    reason: str
    def __init__(self, caller_sidecar_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class TransferFailedResponse(_message.Message):
    __slots__ = ("sidecar_id", "found")
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    sidecar_id: str
    found: bool
    def __init__(self, sidecar_id: _Optional[str] = ..., found: _Optional[bool] = ...) -> None: ...

class PeerReleaseRequest(_message.Message):
    __slots__ = ("caller_sidecar_id", "engine_id", "request_id", "transfer_id", "consumer_request_id", "consumed", "reason")
    CALLER_SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    caller_sidecar_id: str
    engine_id: str
    request_id: str
    transfer_id: str
    consumer_request_id: str
    consumed: bool
    reason: str
    def __init__(self, caller_sidecar_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., consumer_request_id: _Optional[str] = ..., consumed: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class PeerReleaseResponse(_message.Message):
    __slots__ = ("sidecar_id", "found", "in_flight")
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    sidecar_id: str
    found: bool
    in_flight: bool
    def __init__(self, sidecar_id: _Optional[str] = ..., found: _Optional[bool] = ..., in_flight: _Optional[bool] = ...) -> None: ...

class TransferNotice(_message.Message):
    __slots__ = ("engine_id", "request_id", "expected", "sender_sidecar_id", "transfer_id", "digests", "mode")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    SENDER_SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    expected: int
    sender_sidecar_id: str
    transfer_id: str
    digests: KvDigests
    mode: _common_pb2.TransferMode
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., expected: _Optional[int] = ..., sender_sidecar_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., digests: _Optional[_Union[KvDigests, _Mapping]] = ..., mode: _Optional[_Union[_common_pb2.TransferMode, str]] = ...) -> None: ...
