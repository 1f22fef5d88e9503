from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EndpointState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENDPOINT_STATE_UNSPECIFIED: _ClassVar[EndpointState]
    ENDPOINT_STATE_SERVING: _ClassVar[EndpointState]
    ENDPOINT_STATE_DRAINING: _ClassVar[EndpointState]
    ENDPOINT_STATE_ASLEEP: _ClassVar[EndpointState]
    ENDPOINT_STATE_WAKING: _ClassVar[EndpointState]

class ObjectivesSourceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OBJECTIVES_SOURCE_STATE_UNSPECIFIED: _ClassVar[ObjectivesSourceState]
    OBJECTIVES_SOURCE_STATE_NOT_KUBERNETES: _ClassVar[ObjectivesSourceState]
    OBJECTIVES_SOURCE_STATE_READING: _ClassVar[ObjectivesSourceState]
    OBJECTIVES_SOURCE_STATE_NO_CRD: _ClassVar[ObjectivesSourceState]
    OBJECTIVES_SOURCE_STATE_FORBIDDEN: _ClassVar[ObjectivesSourceState]
    OBJECTIVES_SOURCE_STATE_UNREACHABLE: _ClassVar[ObjectivesSourceState]
ENDPOINT_STATE_UNSPECIFIED: EndpointState
ENDPOINT_STATE_SERVING: EndpointState
ENDPOINT_STATE_DRAINING: EndpointState
ENDPOINT_STATE_ASLEEP: EndpointState
ENDPOINT_STATE_WAKING: EndpointState
OBJECTIVES_SOURCE_STATE_UNSPECIFIED: ObjectivesSourceState
OBJECTIVES_SOURCE_STATE_NOT_KUBERNETES: ObjectivesSourceState
OBJECTIVES_SOURCE_STATE_READING: ObjectivesSourceState
OBJECTIVES_SOURCE_STATE_NO_CRD: ObjectivesSourceState
OBJECTIVES_SOURCE_STATE_FORBIDDEN: ObjectivesSourceState
OBJECTIVES_SOURCE_STATE_UNREACHABLE: ObjectivesSourceState

class EndpointUpdate(_message.Message):
    __slots__ = ("address", "state", "weight_version")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: EndpointState
    weight_version: int
    def __init__(self, address: _Optional[str] = ..., state: _Optional[_Union[EndpointState, str]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class GetPoolStatusRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class EndpointStatus(_message.Message):
    __slots__ = ("address", "state", "weight_version", "in_flight")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: EndpointState
    weight_version: int
    in_flight: int
    def __init__(self, address: _Optional[str] = ..., state: _Optional[_Union[EndpointState, str]] = ..., weight_version: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("pool", "epoch", "endpoints", "held", "admitted_total", "released_total", "refused_total", "bands")
    POOL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RELEASED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REFUSED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BANDS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    epoch: int
    endpoints: _containers.RepeatedCompositeFieldContainer[EndpointStatus]
    held: int
    admitted_total: int
    released_total: int
    refused_total: int
    bands: _containers.RepeatedCompositeFieldContainer[BandStatus]
    def __init__(self, pool: _Optional[str] = ..., epoch: _Optional[int] = ..., endpoints: _Optional[_Iterable[_Union[EndpointStatus, _Mapping]]] = ..., held: _Optional[int] = ..., admitted_total: _Optional[int] = ..., released_total: _Optional[int] = ..., refused_total: _Optional[int] = ..., bands: _Optional[_Iterable[_Union[BandStatus, _Mapping]]] = ...) -> None: ...

class BandStatus(_message.Message):
    __slots__ = ("band", "held", "max_hold_s", "hold_deadline_s", "oldest_held_s", "released_total", "refused_total", "deadline_misses_total")
    class RefusedTotalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BAND_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    MAX_HOLD_S_FIELD_NUMBER: _ClassVar[int]
    HOLD_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    OLDEST_HELD_S_FIELD_NUMBER: _ClassVar[int]
    RELEASED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REFUSED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MISSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    band: int
    held: int
    max_hold_s: float
    hold_deadline_s: float
    oldest_held_s: float
    released_total: int
    refused_total: _containers.ScalarMap[str, int]
    deadline_misses_total: int
    def __init__(self, band: _Optional[int] = ..., held: _Optional[int] = ..., max_hold_s: _Optional[float] = ..., hold_deadline_s: _Optional[float] = ..., oldest_held_s: _Optional[float] = ..., released_total: _Optional[int] = ..., refused_total: _Optional[_Mapping[str, int]] = ..., deadline_misses_total: _Optional[int] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pools: _Optional[_Iterable[str]] = ...) -> None: ...

class GetObjectivesSourceRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ObjectivesSource(_message.Message):
    __slots__ = ("state", "namespace", "group_version", "served", "objectives", "detail")
    STATE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    GROUP_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVES_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    state: ObjectivesSourceState
    namespace: str
    group_version: str
    served: _containers.RepeatedScalarFieldContainer[str]
    objectives: int
    detail: str
    def __init__(self, state: _Optional[_Union[ObjectivesSourceState, str]] = ..., namespace: _Optional[str] = ..., group_version: _Optional[str] = ..., served: _Optional[_Iterable[str]] = ..., objectives: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...
