from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as _snapshot_agent_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WaitOperationRequest(_message.Message):
    __slots__ = ("operation_id", "timeout_s")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    timeout_s: float
    def __init__(self, operation_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...
