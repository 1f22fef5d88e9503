from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightUpdate(_message.Message):
    __slots__ = ("version", "source", "location", "update_info_json")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    version: int
    source: str
    location: str
    update_info_json: str
    def __init__(self, version: _Optional[int] = ..., source: _Optional[str] = ..., location: _Optional[str] = ..., update_info_json: _Optional[str] = ...) -> None: ...

class PublishWeightVersionRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "fencing_token", "weights")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    fencing_token: int
    weights: WeightUpdate
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., weights: _Optional[_Union[WeightUpdate, _Mapping]] = ...) -> None: ...

class GetWeightVersionRequest(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class SamplerWeightVersion(_message.Message):
    __slots__ = ("address", "version", "in_service", "error")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_SERVICE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    address: str
    version: int
    in_service: bool
    error: str
    def __init__(self, address: _Optional[str] = ..., version: _Optional[int] = ..., in_service: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class WeightVersionStatus(_message.Message):
    __slots__ = ("group_id", "serving_version", "pending", "samplers", "last_error", "rejected")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SERVING_VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    serving_version: int
    pending: WeightUpdate
    samplers: _containers.RepeatedCompositeFieldContainer[SamplerWeightVersion]
    last_error: str
    rejected: RejectedWeightVersion
    def __init__(self, group_id: _Optional[str] = ..., serving_version: _Optional[int] = ..., pending: _Optional[_Union[WeightUpdate, _Mapping]] = ..., samplers: _Optional[_Iterable[_Union[SamplerWeightVersion, _Mapping]]] = ..., last_error: _Optional[str] = ..., rejected: _Optional[_Union[RejectedWeightVersion, _Mapping]] = ...) -> None: ...

class RejectedWeightVersion(_message.Message):
    __slots__ = ("version", "error")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    version: int
    error: str
    def __init__(self, version: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...
