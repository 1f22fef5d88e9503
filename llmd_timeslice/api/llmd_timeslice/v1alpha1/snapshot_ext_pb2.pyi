from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as _snapshot_agent_pb2
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import weights_pb2 as _weights_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OperationFault(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_FAULT_UNSPECIFIED: _ClassVar[OperationFault]
    OPERATION_FAULT_WEIGHTS_REJECTED: _ClassVar[OperationFault]
    OPERATION_FAULT_ENGINE_UNREACHABLE: _ClassVar[OperationFault]
    OPERATION_FAULT_ENGINE_FAILED: _ClassVar[OperationFault]
OPERATION_FAULT_UNSPECIFIED: OperationFault
OPERATION_FAULT_WEIGHTS_REJECTED: OperationFault
OPERATION_FAULT_ENGINE_UNREACHABLE: OperationFault
OPERATION_FAULT_ENGINE_FAILED: OperationFault

class GetServedWeightVersionRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetServedWeightVersionResponse(_message.Message):
    __slots__ = ("weight_version", "known", "sleeping", "engine_unreachable")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    known: bool
    sleeping: bool
    engine_unreachable: str
    def __init__(self, weight_version: _Optional[str] = ..., known: _Optional[bool] = ..., sleeping: _Optional[bool] = ..., engine_unreachable: _Optional[str] = ...) -> None: ...

class RestoreWithWeightsRequest(_message.Message):
    __slots__ = ("restore", "weights")
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    restore: _snapshot_agent_pb2.RestoreRequest
    weights: _weights_pb2.WeightUpdate
    def __init__(self, restore: _Optional[_Union[_snapshot_agent_pb2.RestoreRequest, _Mapping]] = ..., weights: _Optional[_Union[_weights_pb2.WeightUpdate, _Mapping]] = ...) -> None: ...

class WaitOperationRequest(_message.Message):
    __slots__ = ("operation_id", "timeout_s")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    timeout_s: float
    def __init__(self, operation_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class OperationResult(_message.Message):
    __slots__ = ("operation", "fault")
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    operation: _snapshot_agent_pb2.GetOperationResponse
    fault: OperationFault
    def __init__(self, operation: _Optional[_Union[_snapshot_agent_pb2.GetOperationResponse, _Mapping]] = ..., fault: _Optional[_Union[OperationFault, str]] = ...) -> None: ...

class OperationCommand(_message.Message):
    __slots__ = ("command_id", "snapshot", "restore", "restore_with_weights", "deadlines")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    RESTORE_WITH_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DEADLINES_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    snapshot: _snapshot_agent_pb2.SnapshotRequest
    restore: _snapshot_agent_pb2.RestoreRequest
    restore_with_weights: RestoreWithWeightsRequest
    deadlines: OperationDeadlines
    def __init__(self, command_id: _Optional[int] = ..., snapshot: _Optional[_Union[_snapshot_agent_pb2.SnapshotRequest, _Mapping]] = ..., restore: _Optional[_Union[_snapshot_agent_pb2.RestoreRequest, _Mapping]] = ..., restore_with_weights: _Optional[_Union[RestoreWithWeightsRequest, _Mapping]] = ..., deadlines: _Optional[_Union[OperationDeadlines, _Mapping]] = ...) -> None: ...

class OperationDeadlines(_message.Message):
    __slots__ = ("sleep_s", "wake_s", "reload_s")
    SLEEP_S_FIELD_NUMBER: _ClassVar[int]
    WAKE_S_FIELD_NUMBER: _ClassVar[int]
    RELOAD_S_FIELD_NUMBER: _ClassVar[int]
    sleep_s: float
    wake_s: float
    reload_s: float
    def __init__(self, sleep_s: _Optional[float] = ..., wake_s: _Optional[float] = ..., reload_s: _Optional[float] = ...) -> None: ...

class OperationRefusal(_message.Message):
    __slots__ = ("code", "details", "fenced_term")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    FENCED_TERM_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    fenced_term: int
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., fenced_term: _Optional[int] = ...) -> None: ...

class OperationEvent(_message.Message):
    __slots__ = ("command_id", "result", "refused")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    result: OperationResult
    refused: OperationRefusal
    def __init__(self, command_id: _Optional[int] = ..., result: _Optional[_Union[OperationResult, _Mapping]] = ..., refused: _Optional[_Union[OperationRefusal, _Mapping]] = ...) -> None: ...
