from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_ROLE_UNSPECIFIED: _ClassVar[EngineRole]
    ENGINE_ROLE_PRODUCER: _ClassVar[EngineRole]
    ENGINE_ROLE_CONSUMER: _ClassVar[EngineRole]
    ENGINE_ROLE_BOTH: _ClassVar[EngineRole]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_DRAM: _ClassVar[MemoryKind]
    MEMORY_KIND_VRAM: _ClassVar[MemoryKind]

class TransferMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_MODE_UNSPECIFIED: _ClassVar[TransferMode]
    TRANSFER_MODE_PULL: _ClassVar[TransferMode]
    TRANSFER_MODE_PUSH: _ClassVar[TransferMode]
ENGINE_ROLE_UNSPECIFIED: EngineRole
ENGINE_ROLE_PRODUCER: EngineRole
ENGINE_ROLE_CONSUMER: EngineRole
ENGINE_ROLE_BOTH: EngineRole
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_DRAM: MemoryKind
MEMORY_KIND_VRAM: MemoryKind
TRANSFER_MODE_UNSPECIFIED: TransferMode
TRANSFER_MODE_PULL: TransferMode
TRANSFER_MODE_PUSH: TransferMode

class BlockIdList(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GroupedBlockIds(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[BlockIdList]
    def __init__(self, groups: _Optional[_Iterable[_Union[BlockIdList, _Mapping]]] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("kvsidecar", "nixl", "vllm", "grpc", "protocol", "features")
    KVSIDECAR_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    VLLM_FIELD_NUMBER: _ClassVar[int]
    GRPC_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    kvsidecar: str
    nixl: str
    vllm: str
    grpc: str
    protocol: int
    features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kvsidecar: _Optional[str] = ..., nixl: _Optional[str] = ..., vllm: _Optional[str] = ..., grpc: _Optional[str] = ..., protocol: _Optional[int] = ..., features: _Optional[_Iterable[str]] = ...) -> None: ...

class SidecarInfo(_message.Message):
    __slots__ = ("sidecar_id", "address", "versions", "clock_unix_s", "hostname")
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    sidecar_id: str
    address: str
    versions: VersionInfo
    clock_unix_s: float
    hostname: str
    def __init__(self, sidecar_id: _Optional[str] = ..., address: _Optional[str] = ..., versions: _Optional[_Union[VersionInfo, _Mapping]] = ..., clock_unix_s: _Optional[float] = ..., hostname: _Optional[str] = ...) -> None: ...

class KvGeometry(_message.Message):
    __slots__ = ("block_size", "physical_blocks_per_logical", "kv_layout", "num_blocks", "num_kv_heads", "total_num_kv_heads", "is_mla", "head_size", "dtype")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_BLOCKS_PER_LOGICAL_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    IS_MLA_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    physical_blocks_per_logical: int
    kv_layout: str
    num_blocks: int
    num_kv_heads: int
    total_num_kv_heads: int
    is_mla: bool
    head_size: int
    dtype: str
    def __init__(self, block_size: _Optional[int] = ..., physical_blocks_per_logical: _Optional[int] = ..., kv_layout: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., total_num_kv_heads: _Optional[int] = ..., is_mla: _Optional[bool] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class TraceRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "local_only", "also_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    ALSO_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    local_only: bool
    also_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., local_only: _Optional[bool] = ..., also_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class TraceEvent(_message.Message):
    __slots__ = ("kind", "unix_s", "offset_s", "detail", "measured_s")
    class MeasuredSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    UNIX_S_FIELD_NUMBER: _ClassVar[int]
    OFFSET_S_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    MEASURED_S_FIELD_NUMBER: _ClassVar[int]
    kind: str
    unix_s: float
    offset_s: float
    detail: str
    measured_s: _containers.ScalarMap[str, float]
    def __init__(self, kind: _Optional[str] = ..., unix_s: _Optional[float] = ..., offset_s: _Optional[float] = ..., detail: _Optional[str] = ..., measured_s: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RequestTimeline(_message.Message):
    __slots__ = ("engine_id", "request_id", "transfer_id", "side", "done", "events", "dropped_events", "peers", "other_ids")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    OTHER_IDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    transfer_id: str
    side: str
    done: bool
    events: _containers.RepeatedCompositeFieldContainer[TraceEvent]
    dropped_events: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    other_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., side: _Optional[str] = ..., done: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[TraceEvent, _Mapping]]] = ..., dropped_events: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., other_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SidecarTrace(_message.Message):
    __slots__ = ("sidecar", "requests", "error", "clock_offset_ms")
    SIDECAR_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CLOCK_OFFSET_MS_FIELD_NUMBER: _ClassVar[int]
    sidecar: SidecarInfo
    requests: _containers.RepeatedCompositeFieldContainer[RequestTimeline]
    error: str
    clock_offset_ms: float
    def __init__(self, sidecar: _Optional[_Union[SidecarInfo, _Mapping]] = ..., requests: _Optional[_Iterable[_Union[RequestTimeline, _Mapping]]] = ..., error: _Optional[str] = ..., clock_offset_ms: _Optional[float] = ...) -> None: ...

class TraceResponse(_message.Message):
    __slots__ = ("sidecars",)
    SIDECARS_FIELD_NUMBER: _ClassVar[int]
    sidecars: _containers.RepeatedCompositeFieldContainer[SidecarTrace]
    def __init__(self, sidecars: _Optional[_Iterable[_Union[SidecarTrace, _Mapping]]] = ...) -> None: ...
