"""A group's settings and its samplers: the one model every source parses into (no I/O here).

The static inventory (``orchestrator --inventory``), the stack file of ``llmd-timeslice up`` and Kubernetes pod
annotations (``--discovery kubernetes``) all produce a :class:`GroupSpec`: its :class:`GroupSettings` fields
with their defaults, ranges and descriptions are defined here once. Adding a setting is one field here (with
``json_schema_extra={"annotation": ...}`` naming its pod annotation) plus its row in docs/group-settings.md
(``tests/domain/test_group_settings.py`` checks the table against the fields).

Each field's ``json_schema_extra`` says where Kubernetes discovery reads it:

* ``annotation``: the pod annotation;
* ``scope``: ``"group"`` (any member pod of the group) or ``"job"`` (a job's own, non-sampler pods: the field
  is then a map or list keyed by job id, and the annotation carries that job's value).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

from llmd_timeslice.addresses import check_host_port


class SchedulingPolicy(enum.StrEnum):
    """Order in which waiters are granted."""

    FIFO = "fifo"
    PRIORITY = "priority"
    """Highest ``job_priorities`` first, FIFO among equals."""
    ROUND_ROBIN = "round_robin"
    """The job granted least recently first (phase-level multiplexing of several RL jobs)."""


class SleepLevelPolicy(enum.StrEnum):
    """How the samplers' sleep level is chosen at each switch to a job."""

    FIXED = "fixed"
    """``sleep_level`` for every job."""
    AUTO = "auto"
    """Level 2 (discard: no host copy of weights about to be replaced) for a job that published a weight
    version at its previous grant of this group, ``sleep_level`` otherwise."""


SleepLevel = Annotated[int, Field(ge=1, le=2)]
"""vLLM's sleep levels (``POST /sleep?level=N``): 1 offloads the weights to host memory, 2 discards them."""


MAX_DEADLINE_S = 86400.0
"""The longest a sleep, wake or reload deadline may be set to, seconds (a day)."""


def _k8s(annotation: str, scope: Literal["group", "job"] = "group") -> dict[str, Any]:
    return {"annotation": annotation, "scope": scope}


class GroupSettings(BaseModel):
    """Everything about a group but its id and samplers (durations in seconds). Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")

    sleep_level: SleepLevel = Field(
        1,
        description="Sleep level of the samplers: 1 offloads weights to host memory, 2 discards them.",
        json_schema_extra=_k8s("timeslice.io/sleep-level"),
    )
    drain_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Drain deadline: longest wait for in-flight requests before the samplers sleep.",
        json_schema_extra=_k8s("timeslice.io/drain-timeout-s"),
    )
    sleep_deadline_s: float = Field(
        300.0,
        gt=0,
        le=MAX_DEADLINE_S,
        description="Longest one sampler's sleep may take (waiting for idle, the sleep, its verification), apart "
        "from each engine call's own HTTP timeout.",
        json_schema_extra=_k8s("timeslice.io/sleep-deadline-s"),
    )
    wake_deadline_s: float = Field(
        300.0,
        gt=0,
        le=MAX_DEADLINE_S,
        description="Longest one sampler's wake may take, its weight reload not included (that has reload_deadline_s).",
        json_schema_extra=_k8s("timeslice.io/wake-deadline-s"),
    )
    reload_deadline_s: float | None = Field(
        None,
        gt=0,
        le=MAX_DEADLINE_S,
        description="Longest one weight reload may take (a weight version's load, or the last good version's reload "
        "after a level-2 sleep). None: grows with the version's bytes, RELOAD_BASE_S + bytes / "
        "RELOAD_FLOOR_BYTES_PER_S (300 s + bytes at 200 MiB/s).",
        json_schema_extra=_k8s("timeslice.io/reload-deadline-s"),
    )
    lease_ttl_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="Lease TTL once the holder heartbeats (0: never expires).",
        json_schema_extra=_k8s("timeslice.io/lease-ttl-s"),
    )
    policy: SchedulingPolicy = Field(
        SchedulingPolicy.FIFO,
        description="Scheduling policy of the waiters.",
        json_schema_extra=_k8s("timeslice.io/scheduling-policy"),
    )
    sleep_level_policy: SleepLevelPolicy = Field(
        SleepLevelPolicy.FIXED,
        description="fixed: sleep_level for every job; auto: level 2 (discard) for a job that published a weight "
        "version at its previous grant (the weights will be replaced anyway), else sleep_level.",
        json_schema_extra=_k8s("timeslice.io/sleep-level-policy"),
    )
    job_priorities: dict[str, int] = Field(
        default_factory=dict,
        description="Per-job priority (`priority` policy): higher first, FIFO among equals.",
        json_schema_extra=_k8s("timeslice.io/job-priority", "job"),
    )
    job_sleep_levels: dict[str, SleepLevel] = Field(
        default_factory=dict,
        description="Per-job sleep level of the samplers when that job acquires (overrides the policy).",
        json_schema_extra=_k8s("timeslice.io/job-sleep-level", "job"),
    )
    yield_request_bands: list[int] | None = Field(
        None,
        description="Priority bands of held traffic that may ask the holder to yield (None: every band that "
        "declares a hold deadline; []: none).",
        json_schema_extra=_k8s("timeslice.io/yield-request-bands"),
    )
    yield_request_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Ask the holder to yield when a band's oldest held request reached this fraction of its hold deadline.",
        json_schema_extra=_k8s("timeslice.io/yield-request-fraction"),
    )
    min_training_s: float = Field(
        10.0,
        ge=0,
        le=86400,
        description="Least time a holder keeps the group after its grant (or after a yield request it honoured) "
        "before it can be asked to yield again.",
        json_schema_extra=_k8s("timeslice.io/min-training-s"),
    )
    job_yield_opt_out: list[str] = Field(
        default_factory=list,
        description='Jobs never asked to yield (on a job\'s own pods: the annotation `"true"`).',
        json_schema_extra=_k8s("timeslice.io/yield-opt-out", "job"),
    )

    replan_apply: bool = Field(
        False,
        description="Let the orchestrator apply a re-plan's policy and job priorities to this group itself when its "
        "placement check advises one (docs/placement.md); moving jobs between groups always stays `plan --apply`.",
        json_schema_extra=_k8s("timeslice.io/replan-apply"),
    )

    residual_budget_bytes: dict[SleepLevel, ByteSize] = Field(
        default_factory=dict,
        description="Per sleep level, the most device memory a sampler's engine may still hold once a sleep settled "
        '(bytes, or a size such as `4GiB`; annotation `"1=4GiB,2=1GiB"`); over it the sleep is not verified. A '
        "level not listed: the residual of the engine's first verified sleep at that level plus the sidecar's margin.",
        json_schema_extra=_k8s("timeslice.io/residual-budget"),
    )

    @field_validator("residual_budget_bytes", mode="before")
    @classmethod
    def _budgets_from_text(cls, v: Any) -> Any:
        # A pod annotation spells the map "1=4GiB,2=1GiB" (or "" for none).
        if isinstance(v, str):
            pairs = [p.split("=", 1) for p in v.replace(" ", "").split(",") if p]
            if any(len(p) != 2 for p in pairs):
                raise ValueError(f"expected LEVEL=SIZE pairs such as 1=4GiB,2=1GiB, got {v!r}")
            return dict(pairs)
        return v

    def residual_budget_for(self, level: int) -> int:
        """The group's residual budget of a sleep at ``level`` in bytes (0: none, the sidecar's default applies)."""
        return int(self.residual_budget_bytes.get(level, 0))

    @field_validator("yield_request_bands", mode="before")
    @classmethod
    def _bands_from_text(cls, v: Any) -> Any:
        # A pod annotation spells the list "10,20" (or "" for none).
        if isinstance(v, str):
            return [b for b in v.replace(" ", "").split(",") if b]
        return v

    def sleep_level_for(self, job_id: str, publishes_weights: bool) -> int:
        """The sleep level the samplers take when ``job_id`` acquires the group."""
        if job_id in self.job_sleep_levels:
            return self.job_sleep_levels[job_id]
        if self.sleep_level_policy is SleepLevelPolicy.AUTO and publishes_weights:
            return 2
        return self.sleep_level

    def settings(self) -> GroupSettings:
        """The settings alone, as their own copy (compared to decide whether a spec update changes settings)."""
        return GroupSettings.model_construct(**{name: _copied(getattr(self, name)) for name in SETTINGS_FIELDS})


RELOAD_BASE_S = 300.0
"""The default reload deadline's fixed part, seconds (an engine's own start-up work around the bytes)."""
RELOAD_FLOOR_BYTES_PER_S = 200 * 2**20
"""The assumed floor of the bandwidth a reload reads weights at, bytes per second (200 MiB/s: a network volume or a
slow local disk; a reload faster than this finishes well inside the default)."""


def reload_deadline_for(setting_s: float | None, nbytes: int | None) -> float:
    """The reload deadline, seconds: ``setting_s`` (the group's ``reload_deadline_s``) where set; else
    ``RELOAD_BASE_S + nbytes / RELOAD_FLOOR_BYTES_PER_S`` (``nbytes`` None or 0: the base alone)."""
    if setting_s is not None:
        return setting_s
    return RELOAD_BASE_S + (nbytes or 0) / RELOAD_FLOOR_BYTES_PER_S


SETTINGS_FIELDS: tuple[str, ...] = tuple(GroupSettings.model_fields)
"""The settings' field names, in declaration order."""


def _copied(value: Any) -> Any:
    """Its own copy of a mutable container (maps and lists of plain values); other values as they are."""
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    return value


class SamplerEndpoint(BaseModel):
    """One sampler: a vLLM server behind the gate and its snapshot sidecar (hashable, immutable).

    ``address`` is the ``ip:port`` the EPP routes to (the gate's endpoint name); ``sidecar`` the ``host:port``
    of its SnapshotAgentService; ``job_id`` the sampler job the sidecar serves. Positional construction
    (``SamplerEndpoint(pool, address, sidecar, job_id)``) or by keyword.

    Raises:
        pydantic.ValidationError: ``address`` or ``sidecar`` is not ``host:port``, a key is unknown.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    pool: str = Field("default", min_length=1, description="InferencePool the sampler serves.")
    address: str = Field(description="ip:port the EPP routes to (vLLM's OpenAI server).")
    sidecar: str = Field(description="host:port of the sampler's snapshot sidecar.")
    job_id: str = Field(min_length=1, description="Sampler job id the sidecar serves.")

    def __init__(self, *args: str, **data: Any) -> None:
        data.update(zip(("pool", "address", "sidecar", "job_id"), args, strict=False))
        super().__init__(**data)

    _check = field_validator("address", "sidecar")(classmethod(lambda cls, v: check_host_port(v)))


class GroupSpec(GroupSettings):
    """One group: its id, samplers and settings. ``GroupSpec(group_id, samplers, **settings)``."""

    group_id: str = Field(min_length=1, description="The accelerator group (the upstream `timeslice.io/group`).")
    samplers: list[SamplerEndpoint] = Field(default_factory=list, description="The group's samplers.")

    def __init__(self, group_id: str | None = None, samplers: Iterable[SamplerEndpoint] | None = None, /, **data: Any) -> None:
        if group_id is not None:
            data["group_id"] = group_id
        if samplers is not None:
            data["samplers"] = list(samplers)
        super().__init__(**data)

    def copy(self, samplers: list[SamplerEndpoint] | None = None) -> GroupSpec:  # type: ignore[override]
        """A copy (its own lists and maps), optionally with other samplers. Not validated again."""
        values = {name: _copied(getattr(self, name)) for name in SETTINGS_FIELDS}
        return GroupSpec.model_construct(
            group_id=self.group_id, samplers=list(self.samplers if samplers is None else samplers), **values
        )

    def apply_settings(self, settings: GroupSettings) -> None:
        """Take every setting of ``settings`` (its own copies), keeping the id and samplers."""
        for name in SETTINGS_FIELDS:
            setattr(self, name, _copied(getattr(settings, name)))
