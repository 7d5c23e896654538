from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOIN_CODE_UNSPECIFIED: _ClassVar[JoinCode]
    ACCEPTED: _ClassVar[JoinCode]
    GROUP_ASSEMBLED: _ClassVar[JoinCode]
    NOT_LOOKING: _ClassVar[JoinCode]
    WRONG_KEY: _ClassVar[JoinCode]
    GROUP_FULL: _ClassVar[JoinCode]
    NOT_A_LEADER: _ClassVar[JoinCode]
    DUPLICATE_PEER: _ClassVar[JoinCode]
    BAD_SCHEMA: _ClassVar[JoinCode]
    DISBANDED: _ClassVar[JoinCode]
    BAD_REQUEST: _ClassVar[JoinCode]
    PROTOCOL_MISMATCH: _ClassVar[JoinCode]
    UNAUTHENTICATED: _ClassVar[JoinCode]
JOIN_CODE_UNSPECIFIED: JoinCode
ACCEPTED: JoinCode
GROUP_ASSEMBLED: JoinCode
NOT_LOOKING: JoinCode
WRONG_KEY: JoinCode
GROUP_FULL: JoinCode
NOT_A_LEADER: JoinCode
DUPLICATE_PEER: JoinCode
BAD_SCHEMA: JoinCode
DISBANDED: JoinCode
BAD_REQUEST: JoinCode
PROTOCOL_MISMATCH: JoinCode
UNAUTHENTICATED: JoinCode

class JoinRequest(_message.Message):
    __slots__ = ("group_key", "peer_id", "endpoint", "schema_hash", "weight", "client_mode", "protocol_version", "data_endpoint", "bandwidth", "codec", "public_key", "timestamp_ms", "nonce", "signature", "declaration", "declaration_version", "declaration_ttl", "declaration_signature")
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_HASH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_MODE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    DECLARATION_FIELD_NUMBER: _ClassVar[int]
    DECLARATION_VERSION_FIELD_NUMBER: _ClassVar[int]
    DECLARATION_TTL_FIELD_NUMBER: _ClassVar[int]
    DECLARATION_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    group_key: str
    peer_id: bytes
    endpoint: str
    schema_hash: bytes
    weight: float
    client_mode: bool
    protocol_version: int
    data_endpoint: str
    bandwidth: float
    codec: str
    public_key: bytes
    timestamp_ms: int
    nonce: bytes
    signature: bytes
    declaration: bytes
    declaration_version: int
    declaration_ttl: float
    declaration_signature: bytes
    def __init__(self, group_key: _Optional[str] = ..., peer_id: _Optional[bytes] = ..., endpoint: _Optional[str] = ..., schema_hash: _Optional[bytes] = ..., weight: _Optional[float] = ..., client_mode: _Optional[bool] = ..., protocol_version: _Optional[int] = ..., data_endpoint: _Optional[str] = ..., bandwidth: _Optional[float] = ..., codec: _Optional[str] = ..., public_key: _Optional[bytes] = ..., timestamp_ms: _Optional[int] = ..., nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., declaration: _Optional[bytes] = ..., declaration_version: _Optional[int] = ..., declaration_ttl: _Optional[float] = ..., declaration_signature: _Optional[bytes] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("code", "message", "suggested_leader", "suggested_leader_id", "group_info", "public_key", "probe_signature")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SUGGESTED_LEADER_FIELD_NUMBER: _ClassVar[int]
    SUGGESTED_LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_INFO_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    PROBE_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    code: JoinCode
    message: str
    suggested_leader: str
    suggested_leader_id: bytes
    group_info: GroupInfo
    public_key: bytes
    probe_signature: bytes
    def __init__(self, code: _Optional[_Union[JoinCode, str]] = ..., message: _Optional[str] = ..., suggested_leader: _Optional[str] = ..., suggested_leader_id: _Optional[bytes] = ..., group_info: _Optional[_Union[GroupInfo, _Mapping]] = ..., public_key: _Optional[bytes] = ..., probe_signature: _Optional[bytes] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("peer_id", "endpoint", "weight", "client_mode", "bandwidth", "data_endpoint")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_MODE_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    peer_id: bytes
    endpoint: str
    weight: float
    client_mode: bool
    bandwidth: float
    data_endpoint: str
    def __init__(self, peer_id: _Optional[bytes] = ..., endpoint: _Optional[str] = ..., weight: _Optional[float] = ..., client_mode: _Optional[bool] = ..., bandwidth: _Optional[float] = ..., data_endpoint: _Optional[str] = ...) -> None: ...

class GroupInfo(_message.Message):
    __slots__ = ("group_id", "group_key", "round", "schema_hash", "members", "codec", "leader_public_key", "signature", "admissions")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_HASH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    LEADER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    group_key: str
    round: int
    schema_hash: bytes
    members: _containers.RepeatedCompositeFieldContainer[Member]
    codec: str
    leader_public_key: bytes
    signature: bytes
    admissions: _containers.RepeatedCompositeFieldContainer[Admission]
    def __init__(self, group_id: _Optional[bytes] = ..., group_key: _Optional[str] = ..., round: _Optional[int] = ..., schema_hash: _Optional[bytes] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., codec: _Optional[str] = ..., leader_public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., admissions: _Optional[_Iterable[_Union[Admission, _Mapping]]] = ...) -> None: ...

class Admission(_message.Message):
    __slots__ = ("join", "tls_binding")
    JOIN_FIELD_NUMBER: _ClassVar[int]
    TLS_BINDING_FIELD_NUMBER: _ClassVar[int]
    join: JoinRequest
    tls_binding: bytes
    def __init__(self, join: _Optional[_Union[JoinRequest, _Mapping]] = ..., tls_binding: _Optional[bytes] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("key", "offset", "length", "version")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    length: int
    version: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("offset", "data", "total", "version", "header")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    total: int
    version: int
    header: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total: _Optional[int] = ..., version: _Optional[int] = ..., header: _Optional[bytes] = ...) -> None: ...
