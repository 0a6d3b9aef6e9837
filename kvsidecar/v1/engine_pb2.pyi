from kvsidecar.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    WATCH_STARTED: _ClassVar[EventKind]
    FINISHED_SENDING: _ClassVar[EventKind]
    FINISHED_RECEIVING: _ClassVar[EventKind]
    LOAD_FAILED: _ClassVar[EventKind]
    LEASE_EXPIRED: _ClassVar[EventKind]
EVENT_KIND_UNSPECIFIED: EventKind
WATCH_STARTED: EventKind
FINISHED_SENDING: EventKind
FINISHED_RECEIVING: EventKind
LOAD_FAILED: EventKind
LEASE_EXPIRED: EventKind

class MemoryExport(_message.Message):
    __slots__ = ("kind", "shm_path", "cuda_ipc_handle", "offset", "length", "device_id", "owner_locked")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_LOCKED_FIELD_NUMBER: _ClassVar[int]
    kind: _common_pb2.MemoryKind
    shm_path: str
    cuda_ipc_handle: bytes
    offset: int
    length: int
    device_id: int
    owner_locked: bool
    def __init__(self, kind: _Optional[_Union[_common_pb2.MemoryKind, str]] = ..., shm_path: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., device_id: _Optional[int] = ..., owner_locked: _Optional[bool] = ...) -> None: ...

class KvRegion(_message.Message):
    __slots__ = ("name", "export_index", "offset", "block_len", "block_stride", "group_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EXPORT_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    export_index: int
    offset: int
    block_len: int
    block_stride: int
    group_id: int
    def __init__(self, name: _Optional[str] = ..., export_index: _Optional[int] = ..., offset: _Optional[int] = ..., block_len: _Optional[int] = ..., block_stride: _Optional[int] = ..., group_id: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("engine_id", "role", "tp_rank", "tp_size", "pp_rank", "pp_size", "geometry", "exports", "regions", "compat_factors", "engine_version", "pid")
    class CompatFactorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    EXPORTS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FACTORS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: _common_pb2.EngineRole
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    geometry: _common_pb2.KvGeometry
    exports: _containers.RepeatedCompositeFieldContainer[MemoryExport]
    regions: _containers.RepeatedCompositeFieldContainer[KvRegion]
    compat_factors: _containers.ScalarMap[str, str]
    engine_version: str
    pid: int
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.EngineRole, str]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., geometry: _Optional[_Union[_common_pb2.KvGeometry, _Mapping]] = ..., exports: _Optional[_Iterable[_Union[MemoryExport, _Mapping]]] = ..., regions: _Optional[_Iterable[_Union[KvRegion, _Mapping]]] = ..., compat_factors: _Optional[_Mapping[str, str]] = ..., engine_version: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "agent_name", "peer_address", "sidecar_id", "compatibility_hash", "registered_bytes", "engine_complete")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    agent_name: str
    peer_address: str
    sidecar_id: str
    compatibility_hash: str
    registered_bytes: int
    engine_complete: bool
    def __init__(self, worker_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., peer_address: _Optional[str] = ..., sidecar_id: _Optional[str] = ..., compatibility_hash: _Optional[str] = ..., registered_bytes: _Optional[int] = ..., engine_complete: _Optional[bool] = ...) -> None: ...

class UnregisterWorkerRequest(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "pp_rank")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    pp_rank: int
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ...) -> None: ...

class UnregisterWorkerResponse(_message.Message):
    __slots__ = ("requests_released",)
    REQUESTS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    requests_released: int
    def __init__(self, requests_released: _Optional[int] = ...) -> None: ...

class SubmitBlocksRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "transfer_id", "block_ids", "num_tokens", "lease_seconds", "mode", "vouched_until_ms")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    VOUCHED_UNTIL_MS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    transfer_id: str
    block_ids: _common_pb2.GroupedBlockIds
    num_tokens: int
    lease_seconds: float
    mode: _common_pb2.TransferMode
    vouched_until_ms: int
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., block_ids: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ..., num_tokens: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., mode: _Optional[_Union[_common_pb2.TransferMode, str]] = ..., vouched_until_ms: _Optional[int] = ...) -> None: ...

class SubmitBlocksResponse(_message.Message):
    __slots__ = ("lease_seconds", "push_matched", "voucher_key", "voucher_seconds", "voucher_clock_skew_seconds")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_MATCHED_FIELD_NUMBER: _ClassVar[int]
    VOUCHER_KEY_FIELD_NUMBER: _ClassVar[int]
    VOUCHER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VOUCHER_CLOCK_SKEW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    push_matched: bool
    voucher_key: bytes
    voucher_seconds: float
    voucher_clock_skew_seconds: float
    def __init__(self, lease_seconds: _Optional[float] = ..., push_matched: _Optional[bool] = ..., voucher_key: _Optional[bytes] = ..., voucher_seconds: _Optional[float] = ..., voucher_clock_skew_seconds: _Optional[float] = ...) -> None: ...

class RemoteBlocks(_message.Message):
    __slots__ = ("address", "engine_id", "request_id", "block_ids", "tp_size", "num_tokens", "voucher", "vouched_until_ms")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOUCHER_FIELD_NUMBER: _ClassVar[int]
    VOUCHED_UNTIL_MS_FIELD_NUMBER: _ClassVar[int]
    address: str
    engine_id: str
    request_id: str
    block_ids: _common_pb2.GroupedBlockIds
    tp_size: int
    num_tokens: int
    voucher: bytes
    vouched_until_ms: int
    def __init__(self, address: _Optional[str] = ..., engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ..., tp_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., voucher: _Optional[bytes] = ..., vouched_until_ms: _Optional[int] = ...) -> None: ...

class ExpectPushRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "transfer_id", "block_ids", "remote", "timeout_seconds")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    transfer_id: str
    block_ids: _common_pb2.GroupedBlockIds
    remote: RemoteBlocks
    timeout_seconds: float
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., block_ids: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ..., remote: _Optional[_Union[RemoteBlocks, _Mapping]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class ExpectPushResponse(_message.Message):
    __slots__ = ("registered", "matched")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    registered: bool
    matched: bool
    def __init__(self, registered: _Optional[bool] = ..., matched: _Optional[bool] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "transfer_id", "remote", "timeout_seconds")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    transfer_id: str
    remote: RemoteBlocks
    timeout_seconds: float
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., remote: _Optional[_Union[RemoteBlocks, _Mapping]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("producer_holds",)
    PRODUCER_HOLDS_FIELD_NUMBER: _ClassVar[int]
    producer_holds: bool
    def __init__(self, producer_holds: _Optional[bool] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "transfer_id", "local_block_ids", "remote", "timeout_seconds")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    transfer_id: str
    local_block_ids: _common_pb2.GroupedBlockIds
    remote: RemoteBlocks
    timeout_seconds: float
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., local_block_ids: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ..., remote: _Optional[_Union[RemoteBlocks, _Mapping]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class HoldBlocksRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "conversation_id", "block_ids", "num_tokens", "ttl_seconds", "block_hashes")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    conversation_id: str
    block_ids: _common_pb2.GroupedBlockIds
    num_tokens: int
    ttl_seconds: float
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., block_ids: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ..., num_tokens: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class HoldBlocksResponse(_message.Message):
    __slots__ = ("ttl_seconds", "released_holds")
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_HOLDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    released_holds: int
    def __init__(self, ttl_seconds: _Optional[float] = ..., released_holds: _Optional[int] = ...) -> None: ...

class QueryCacheRequest(_message.Message):
    __slots__ = ("engine_id", "address", "conversation_id", "request_id", "block_hashes", "known_peers", "timeout_seconds")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KNOWN_PEERS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    address: str
    conversation_id: str
    request_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    known_peers: bool
    timeout_seconds: float
    def __init__(self, engine_id: _Optional[str] = ..., address: _Optional[str] = ..., conversation_id: _Optional[str] = ..., request_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., known_peers: _Optional[bool] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class CacheEntry(_message.Message):
    __slots__ = ("engine_id", "request_id", "conversation_id", "block_ids", "num_tokens", "expires_in_seconds", "address", "tp_size", "block_hashes", "matched_blocks", "engine_generation")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    conversation_id: str
    block_ids: _common_pb2.GroupedBlockIds
    num_tokens: int
    expires_in_seconds: float
    address: str
    tp_size: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    matched_blocks: int
    engine_generation: str
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., block_ids: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ..., num_tokens: _Optional[int] = ..., expires_in_seconds: _Optional[float] = ..., address: _Optional[str] = ..., tp_size: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., matched_blocks: _Optional[int] = ..., engine_generation: _Optional[str] = ...) -> None: ...

class QueryCacheResponse(_message.Message):
    __slots__ = ("entries", "unreachable")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[CacheEntry]
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, entries: _Optional[_Iterable[_Union[CacheEntry, _Mapping]]] = ..., unreachable: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "transfer_id", "reason")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    transfer_id: str
    reason: str
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("found", "peer_notified")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    PEER_NOTIFIED_FIELD_NUMBER: _ClassVar[int]
    found: bool
    peer_notified: bool
    def __init__(self, found: _Optional[bool] = ..., peer_notified: _Optional[bool] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "pp_rank")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    pp_rank: int
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("kind", "request_id", "transfer_id", "failed_block_ids", "reason", "bytes", "duration_ms", "sidecar_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    request_id: str
    transfer_id: str
    failed_block_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    bytes: int
    duration_ms: float
    sidecar_id: str
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., failed_block_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ..., bytes: _Optional[int] = ..., duration_ms: _Optional[float] = ..., sidecar_id: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("include_requests",)
    INCLUDE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    include_requests: bool
    def __init__(self, include_requests: _Optional[bool] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "tp_rank", "pp_rank", "agent_name", "registered_bytes", "num_regions", "watching", "pid")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_REGIONS_FIELD_NUMBER: _ClassVar[int]
    WATCHING_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    tp_rank: int
    pp_rank: int
    agent_name: str
    registered_bytes: int
    num_regions: int
    watching: bool
    pid: int
    def __init__(self, worker_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., agent_name: _Optional[str] = ..., registered_bytes: _Optional[int] = ..., num_regions: _Optional[int] = ..., watching: _Optional[bool] = ..., pid: _Optional[int] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("engine_id", "role", "tp_size", "pp_size", "complete", "compatibility_hash", "workers", "geometry")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: _common_pb2.EngineRole
    tp_size: int
    pp_size: int
    complete: bool
    compatibility_hash: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    geometry: _common_pb2.KvGeometry
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.EngineRole, str]] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., complete: _Optional[bool] = ..., compatibility_hash: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., geometry: _Optional[_Union[_common_pb2.KvGeometry, _Mapping]] = ...) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("address", "sidecar_id", "engine_ids", "last_seen_seconds_ago", "handshake_ms", "clock_offset_ms", "consecutive_failures", "versions")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_MS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_OFFSET_MS_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    address: str
    sidecar_id: str
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    last_seen_seconds_ago: float
    handshake_ms: float
    clock_offset_ms: float
    consecutive_failures: int
    versions: _common_pb2.VersionInfo
    def __init__(self, address: _Optional[str] = ..., sidecar_id: _Optional[str] = ..., engine_ids: _Optional[_Iterable[str]] = ..., last_seen_seconds_ago: _Optional[float] = ..., handshake_ms: _Optional[float] = ..., clock_offset_ms: _Optional[float] = ..., consecutive_failures: _Optional[int] = ..., versions: _Optional[_Union[_common_pb2.VersionInfo, _Mapping]] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("engine_id", "request_id", "transfer_id", "side", "mode", "state", "deadline_in_seconds", "num_blocks")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    transfer_id: str
    side: str
    mode: _common_pb2.TransferMode
    state: str
    deadline_in_seconds: float
    num_blocks: int
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., side: _Optional[str] = ..., mode: _Optional[_Union[_common_pb2.TransferMode, str]] = ..., state: _Optional[str] = ..., deadline_in_seconds: _Optional[float] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("sidecar", "uptime_seconds", "engines", "peers", "leases", "transfers_in_flight", "pending_push_registrations", "unmatched_submissions", "pending_receives", "held_requests", "requests", "draining", "held_blocks", "admission")
    SIDECAR_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PENDING_PUSH_REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    UNMATCHED_SUBMISSIONS_FIELD_NUMBER: _ClassVar[int]
    PENDING_RECEIVES_FIELD_NUMBER: _ClassVar[int]
    HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    sidecar: _common_pb2.SidecarInfo
    uptime_seconds: float
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    leases: int
    transfers_in_flight: int
    pending_push_registrations: int
    unmatched_submissions: int
    pending_receives: int
    held_requests: int
    requests: _containers.RepeatedCompositeFieldContainer[RequestStatus]
    draining: bool
    held_blocks: int
    admission: AdmissionStatus
    def __init__(self, sidecar: _Optional[_Union[_common_pb2.SidecarInfo, _Mapping]] = ..., uptime_seconds: _Optional[float] = ..., engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., leases: _Optional[int] = ..., transfers_in_flight: _Optional[int] = ..., pending_push_registrations: _Optional[int] = ..., unmatched_submissions: _Optional[int] = ..., pending_receives: _Optional[int] = ..., held_requests: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RequestStatus, _Mapping]]] = ..., draining: _Optional[bool] = ..., held_blocks: _Optional[int] = ..., admission: _Optional[_Union[AdmissionStatus, _Mapping]] = ...) -> None: ...

class AdmissionStatus(_message.Message):
    __slots__ = ("in_flight", "peak_in_flight", "throughput_per_second", "solo_ms", "queue_delay_ms", "bound_ms", "admitted", "refused")
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PEAK_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SOLO_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    BOUND_MS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    peak_in_flight: int
    throughput_per_second: float
    solo_ms: float
    queue_delay_ms: float
    bound_ms: float
    admitted: int
    refused: int
    def __init__(self, in_flight: _Optional[int] = ..., peak_in_flight: _Optional[int] = ..., throughput_per_second: _Optional[float] = ..., solo_ms: _Optional[float] = ..., queue_delay_ms: _Optional[float] = ..., bound_ms: _Optional[float] = ..., admitted: _Optional[int] = ..., refused: _Optional[int] = ...) -> None: ...

class SessionCall(_message.Message):
    __slots__ = ("call_id", "method", "request", "timeout_seconds", "cancel")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    method: str
    request: bytes
    timeout_seconds: float
    cancel: bool
    def __init__(self, call_id: _Optional[int] = ..., method: _Optional[str] = ..., request: _Optional[bytes] = ..., timeout_seconds: _Optional[float] = ..., cancel: _Optional[bool] = ...) -> None: ...

class SessionCalls(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[SessionCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[SessionCall, _Mapping]]] = ...) -> None: ...

class SessionAnswer(_message.Message):
    __slots__ = ("call_id", "code", "message", "response")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    code: int
    message: str
    response: bytes
    def __init__(self, call_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., response: _Optional[bytes] = ...) -> None: ...

class SessionEvents(_message.Message):
    __slots__ = ("call_id", "events")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, call_id: _Optional[int] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class SessionAnswers(_message.Message):
    __slots__ = ("answers", "events", "end")
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[SessionAnswer]
    events: _containers.RepeatedCompositeFieldContainer[SessionEvents]
    end: SessionEnd
    def __init__(self, answers: _Optional[_Iterable[_Union[SessionAnswer, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[SessionEvents, _Mapping]]] = ..., end: _Optional[_Union[SessionEnd, _Mapping]] = ...) -> None: ...

class SessionEnd(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
