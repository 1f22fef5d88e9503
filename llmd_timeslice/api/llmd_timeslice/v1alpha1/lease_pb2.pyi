from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetLeaseRequest(_message.Message):
    __slots__ = ("job_id", "group_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "fencing_token")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    fencing_token: int
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("job_id", "group_id", "fencing_token", "ttl_s", "expires_in_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    fencing_token: int
    ttl_s: float
    expires_in_s: float
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., ttl_s: _Optional[float] = ..., expires_in_s: _Optional[float] = ...) -> None: ...
