from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as _gate_control_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EndpointFailure(_message.Message):
    __slots__ = ("gate_id", "pool", "address", "reason")
    GATE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    gate_id: str
    pool: str
    address: str
    reason: str
    def __init__(self, gate_id: _Optional[str] = ..., pool: _Optional[str] = ..., address: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class EndpointFailureAck(_message.Message):
    __slots__ = ("audited",)
    AUDITED_FIELD_NUMBER: _ClassVar[int]
    audited: bool
    def __init__(self, audited: _Optional[bool] = ...) -> None: ...

class GateHello(_message.Message):
    __slots__ = ("gate_id", "pools", "stale_after_s")
    GATE_ID_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    STALE_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    gate_id: str
    pools: _containers.RepeatedScalarFieldContainer[str]
    stale_after_s: float
    def __init__(self, gate_id: _Optional[str] = ..., pools: _Optional[_Iterable[str]] = ..., stale_after_s: _Optional[float] = ...) -> None: ...

class EpochAck(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class DrainResult(_message.Message):
    __slots__ = ("query_id", "drained", "in_flight", "cut")
    class InFlightEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    drained: bool
    in_flight: _containers.ScalarMap[str, int]
    cut: _containers.RepeatedCompositeFieldContainer[CutRequest]
    def __init__(self, query_id: _Optional[str] = ..., drained: _Optional[bool] = ..., in_flight: _Optional[_Mapping[str, int]] = ..., cut: _Optional[_Iterable[_Union[CutRequest, _Mapping]]] = ...) -> None: ...

class CutRequest(_message.Message):
    __slots__ = ("request_id", "addresses")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class GateMessage(_message.Message):
    __slots__ = ("hello", "ack", "drain_result", "keepalive", "fenced", "hold_pressure")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    DRAIN_RESULT_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    HOLD_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    hello: GateHello
    ack: EpochAck
    drain_result: DrainResult
    keepalive: KeepAlive
    fenced: FencedRefusal
    hold_pressure: HoldPressure
    def __init__(self, hello: _Optional[_Union[GateHello, _Mapping]] = ..., ack: _Optional[_Union[EpochAck, _Mapping]] = ..., drain_result: _Optional[_Union[DrainResult, _Mapping]] = ..., keepalive: _Optional[_Union[KeepAlive, _Mapping]] = ..., fenced: _Optional[_Union[FencedRefusal, _Mapping]] = ..., hold_pressure: _Optional[_Union[HoldPressure, _Mapping]] = ...) -> None: ...

class HoldPressure(_message.Message):
    __slots__ = ("pool", "band", "objective", "oldest_held_s", "hold_deadline_s", "held")
    POOL_FIELD_NUMBER: _ClassVar[int]
    BAND_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    OLDEST_HELD_S_FIELD_NUMBER: _ClassVar[int]
    HOLD_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    pool: str
    band: int
    objective: str
    oldest_held_s: float
    hold_deadline_s: float
    held: int
    def __init__(self, pool: _Optional[str] = ..., band: _Optional[int] = ..., objective: _Optional[str] = ..., oldest_held_s: _Optional[float] = ..., hold_deadline_s: _Optional[float] = ..., held: _Optional[int] = ...) -> None: ...

class FencedRefusal(_message.Message):
    __slots__ = ("refused_term", "highest_term")
    REFUSED_TERM_FIELD_NUMBER: _ClassVar[int]
    HIGHEST_TERM_FIELD_NUMBER: _ClassVar[int]
    refused_term: int
    highest_term: int
    def __init__(self, refused_term: _Optional[int] = ..., highest_term: _Optional[int] = ...) -> None: ...

class KeepAlive(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolEndpoints(_message.Message):
    __slots__ = ("pool", "endpoints", "weights_final")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINAL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    endpoints: _containers.RepeatedCompositeFieldContainer[_gate_control_pb2.EndpointUpdate]
    weights_final: bool
    def __init__(self, pool: _Optional[str] = ..., endpoints: _Optional[_Iterable[_Union[_gate_control_pb2.EndpointUpdate, _Mapping]]] = ..., weights_final: _Optional[bool] = ...) -> None: ...

class StateUpdate(_message.Message):
    __slots__ = ("epoch", "full_snapshot", "pools")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FULL_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    full_snapshot: bool
    pools: _containers.RepeatedCompositeFieldContainer[PoolEndpoints]
    def __init__(self, epoch: _Optional[int] = ..., full_snapshot: _Optional[bool] = ..., pools: _Optional[_Iterable[_Union[PoolEndpoints, _Mapping]]] = ...) -> None: ...

class DrainQuery(_message.Message):
    __slots__ = ("query_id", "pool", "addresses", "timeout_s")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    query_id: str
    pool: str
    addresses: _containers.RepeatedScalarFieldContainer[str]
    timeout_s: float
    def __init__(self, query_id: _Optional[str] = ..., pool: _Optional[str] = ..., addresses: _Optional[_Iterable[str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class GateCommand(_message.Message):
    __slots__ = ("state", "drain", "keepalive", "leader_term")
    STATE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    LEADER_TERM_FIELD_NUMBER: _ClassVar[int]
    state: StateUpdate
    drain: DrainQuery
    keepalive: KeepAlive
    leader_term: int
    def __init__(self, state: _Optional[_Union[StateUpdate, _Mapping]] = ..., drain: _Optional[_Union[DrainQuery, _Mapping]] = ..., keepalive: _Optional[_Union[KeepAlive, _Mapping]] = ..., leader_term: _Optional[int] = ...) -> None: ...
