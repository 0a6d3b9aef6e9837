from kvsidecar.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenTestEngineRequest(_message.Message):
    __slots__ = ("layers", "blocks", "block_len", "block_size", "ttl_seconds")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    layers: int
    blocks: int
    block_len: int
    block_size: int
    ttl_seconds: float
    def __init__(self, layers: _Optional[int] = ..., blocks: _Optional[int] = ..., block_len: _Optional[int] = ..., block_size: _Optional[int] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class OpenTestEngineResponse(_message.Message):
    __slots__ = ("session_id", "engine_id", "peer_address", "sidecar", "ucx_env")
    class UcxEnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_FIELD_NUMBER: _ClassVar[int]
    UCX_ENV_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    engine_id: str
    peer_address: str
    sidecar: _common_pb2.SidecarInfo
    ucx_env: _containers.ScalarMap[str, str]
    def __init__(self, session_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., sidecar: _Optional[_Union[_common_pb2.SidecarInfo, _Mapping]] = ..., ucx_env: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DriveTestEngineRequest(_message.Message):
    __slots__ = ("session_id", "command_json")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_JSON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    command_json: str
    def __init__(self, session_id: _Optional[str] = ..., command_json: _Optional[str] = ...) -> None: ...

class DriveTestEngineResponse(_message.Message):
    __slots__ = ("reply_json",)
    REPLY_JSON_FIELD_NUMBER: _ClassVar[int]
    reply_json: str
    def __init__(self, reply_json: _Optional[str] = ...) -> None: ...

class CloseTestEngineRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseTestEngineResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
