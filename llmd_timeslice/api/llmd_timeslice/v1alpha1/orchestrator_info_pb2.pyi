from llmd_timeslice.api.llmd_timeslice.v1alpha1 import lease_pb2 as _lease_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListSwitchesRequest(_message.Message):
    __slots__ = ("group_id", "limit")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    limit: int
    def __init__(self, group_id: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class SwitchInfo(_message.Message):
    __slots__ = ("group_id", "kind", "job_id", "started_at_unix_s", "ok", "error", "phase_seconds", "drain_cut_request_ids", "parked_requests", "cause")
    class PhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ParkedRequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_CUT_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    PARKED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    kind: str
    job_id: str
    started_at_unix_s: float
    ok: bool
    error: str
    phase_seconds: _containers.ScalarMap[str, float]
    drain_cut_request_ids: _containers.RepeatedScalarFieldContainer[str]
    parked_requests: _containers.ScalarMap[str, str]
    cause: str
    def __init__(self, group_id: _Optional[str] = ..., kind: _Optional[str] = ..., job_id: _Optional[str] = ..., started_at_unix_s: _Optional[float] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., phase_seconds: _Optional[_Mapping[str, float]] = ..., drain_cut_request_ids: _Optional[_Iterable[str]] = ..., parked_requests: _Optional[_Mapping[str, str]] = ..., cause: _Optional[str] = ...) -> None: ...

class ListSwitchesResponse(_message.Message):
    __slots__ = ("switches",)
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    switches: _containers.RepeatedCompositeFieldContainer[SwitchInfo]
    def __init__(self, switches: _Optional[_Iterable[_Union[SwitchInfo, _Mapping]]] = ...) -> None: ...

class ListYieldRequestsRequest(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class GroupYieldRequests(_message.Message):
    __slots__ = ("group_id", "sent", "honoured", "ignored", "suppressed", "holder", "current")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    HONOURED_FIELD_NUMBER: _ClassVar[int]
    IGNORED_FIELD_NUMBER: _ClassVar[int]
    SUPPRESSED_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    sent: int
    honoured: int
    ignored: int
    suppressed: int
    holder: str
    current: _lease_pb2.YieldRequested
    def __init__(self, group_id: _Optional[str] = ..., sent: _Optional[int] = ..., honoured: _Optional[int] = ..., ignored: _Optional[int] = ..., suppressed: _Optional[int] = ..., holder: _Optional[str] = ..., current: _Optional[_Union[_lease_pb2.YieldRequested, _Mapping]] = ...) -> None: ...

class ListYieldRequestsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupYieldRequests]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupYieldRequests, _Mapping]]] = ...) -> None: ...

class ListGroupDeadlinesRequest(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class GroupDeadlines(_message.Message):
    __slots__ = ("group_id", "sleep_s", "wake_s", "reload_s", "reload_rule")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SLEEP_S_FIELD_NUMBER: _ClassVar[int]
    WAKE_S_FIELD_NUMBER: _ClassVar[int]
    RELOAD_S_FIELD_NUMBER: _ClassVar[int]
    RELOAD_RULE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    sleep_s: float
    wake_s: float
    reload_s: float
    reload_rule: str
    def __init__(self, group_id: _Optional[str] = ..., sleep_s: _Optional[float] = ..., wake_s: _Optional[float] = ..., reload_s: _Optional[float] = ..., reload_rule: _Optional[str] = ...) -> None: ...

class ListGroupDeadlinesResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupDeadlines]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupDeadlines, _Mapping]]] = ...) -> None: ...

class ListProfilesRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class PhaseDurations(_message.Message):
    __slots__ = ("kind", "count", "samples_s")
    KIND_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_S_FIELD_NUMBER: _ClassVar[int]
    kind: str
    count: int
    samples_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, kind: _Optional[str] = ..., count: _Optional[int] = ..., samples_s: _Optional[_Iterable[float]] = ...) -> None: ...

class JobPhaseProfile(_message.Message):
    __slots__ = ("job_id", "phases", "periods", "accelerators", "state_bytes", "slowdown_budget", "groups", "updated_unix_s")
    class AcceleratorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class StateBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    PERIODS_FIELD_NUMBER: _ClassVar[int]
    ACCELERATORS_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    phases: _containers.RepeatedCompositeFieldContainer[PhaseDurations]
    periods: PhaseDurations
    accelerators: _containers.ScalarMap[str, int]
    state_bytes: _containers.ScalarMap[str, int]
    slowdown_budget: float
    groups: _containers.RepeatedScalarFieldContainer[str]
    updated_unix_s: float
    def __init__(self, job_id: _Optional[str] = ..., phases: _Optional[_Iterable[_Union[PhaseDurations, _Mapping]]] = ..., periods: _Optional[_Union[PhaseDurations, _Mapping]] = ..., accelerators: _Optional[_Mapping[str, int]] = ..., state_bytes: _Optional[_Mapping[str, int]] = ..., slowdown_budget: _Optional[float] = ..., groups: _Optional[_Iterable[str]] = ..., updated_unix_s: _Optional[float] = ...) -> None: ...

class SwitchCosts(_message.Message):
    __slots__ = ("sleep", "wake", "handover", "served")
    SLEEP_FIELD_NUMBER: _ClassVar[int]
    WAKE_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    sleep: PhaseDurations
    wake: PhaseDurations
    handover: PhaseDurations
    served: bool
    def __init__(self, sleep: _Optional[_Union[PhaseDurations, _Mapping]] = ..., wake: _Optional[_Union[PhaseDurations, _Mapping]] = ..., handover: _Optional[_Union[PhaseDurations, _Mapping]] = ..., served: _Optional[bool] = ...) -> None: ...

class PlacementCheck(_message.Message):
    __slots__ = ("plan", "checked_unix_s", "predicted_duty_cycle", "measured_duty_cycle", "duty_cycle_gap", "replan_duty_cycle", "replan_gain", "replan_advised", "changes", "detail", "measured_slowdowns", "predicted_slowdowns", "applied")
    class MeasuredSlowdownsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PredictedSlowdownsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PLAN_FIELD_NUMBER: _ClassVar[int]
    CHECKED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_DUTY_CYCLE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_DUTY_CYCLE_FIELD_NUMBER: _ClassVar[int]
    DUTY_CYCLE_GAP_FIELD_NUMBER: _ClassVar[int]
    REPLAN_DUTY_CYCLE_FIELD_NUMBER: _ClassVar[int]
    REPLAN_GAIN_FIELD_NUMBER: _ClassVar[int]
    REPLAN_ADVISED_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SLOWDOWNS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SLOWDOWNS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    plan: str
    checked_unix_s: float
    predicted_duty_cycle: float
    measured_duty_cycle: float
    duty_cycle_gap: float
    replan_duty_cycle: float
    replan_gain: float
    replan_advised: bool
    changes: _containers.RepeatedScalarFieldContainer[str]
    detail: str
    measured_slowdowns: _containers.ScalarMap[str, float]
    predicted_slowdowns: _containers.ScalarMap[str, float]
    applied: bool
    def __init__(self, plan: _Optional[str] = ..., checked_unix_s: _Optional[float] = ..., predicted_duty_cycle: _Optional[float] = ..., measured_duty_cycle: _Optional[float] = ..., duty_cycle_gap: _Optional[float] = ..., replan_duty_cycle: _Optional[float] = ..., replan_gain: _Optional[float] = ..., replan_advised: _Optional[bool] = ..., changes: _Optional[_Iterable[str]] = ..., detail: _Optional[str] = ..., measured_slowdowns: _Optional[_Mapping[str, float]] = ..., predicted_slowdowns: _Optional[_Mapping[str, float]] = ..., applied: _Optional[bool] = ...) -> None: ...

class ListProfilesResponse(_message.Message):
    __slots__ = ("profiles", "switch_costs", "placement")
    PROFILES_FIELD_NUMBER: _ClassVar[int]
    SWITCH_COSTS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    profiles: _containers.RepeatedCompositeFieldContainer[JobPhaseProfile]
    switch_costs: SwitchCosts
    placement: PlacementCheck
    def __init__(self, profiles: _Optional[_Iterable[_Union[JobPhaseProfile, _Mapping]]] = ..., switch_costs: _Optional[_Union[SwitchCosts, _Mapping]] = ..., placement: _Optional[_Union[PlacementCheck, _Mapping]] = ...) -> None: ...
