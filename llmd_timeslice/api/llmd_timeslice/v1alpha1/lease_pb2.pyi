from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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
    __slots__ = ("job_id", "group_id", "fencing_token", "ttl_s", "expires_in_s", "yield_requested")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    YIELD_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    fencing_token: int
    ttl_s: float
    expires_in_s: float
    yield_requested: YieldRequested
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., ttl_s: _Optional[float] = ..., expires_in_s: _Optional[float] = ..., yield_requested: _Optional[_Union[YieldRequested, _Mapping]] = ...) -> None: ...

class YieldRequested(_message.Message):
    __slots__ = ("reason", "band", "objective", "hold_deadline_s", "requested_ago_s", "pool")
    REASON_FIELD_NUMBER: _ClassVar[int]
    BAND_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    HOLD_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_AGO_S_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    reason: str
    band: int
    objective: str
    hold_deadline_s: float
    requested_ago_s: float
    pool: str
    def __init__(self, reason: _Optional[str] = ..., band: _Optional[int] = ..., objective: _Optional[str] = ..., hold_deadline_s: _Optional[float] = ..., requested_ago_s: _Optional[float] = ..., pool: _Optional[str] = ...) -> None: ...

class RequestYieldRequest(_message.Message):
    __slots__ = ("group_id", "reason", "band", "hold_deadline_s")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BAND_FIELD_NUMBER: _ClassVar[int]
    HOLD_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    reason: str
    band: int
    hold_deadline_s: float
    def __init__(self, group_id: _Optional[str] = ..., reason: _Optional[str] = ..., band: _Optional[int] = ..., hold_deadline_s: _Optional[float] = ...) -> None: ...

class RequestYieldResponse(_message.Message):
    __slots__ = ("requested", "holder", "detail")
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    requested: bool
    holder: str
    detail: str
    def __init__(self, requested: _Optional[bool] = ..., holder: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...
