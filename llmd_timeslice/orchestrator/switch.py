"""What a phase switch does to the outside world, as the core sees it: the :class:`SwitchActions` ABC,
the record of one switch, and the typed outcomes of its steps (no I/O here).

The group machine (:mod:`llmd_timeslice.orchestrator.groups`) calls, per switch:

* to a job: :meth:`SwitchActions.drain_samplers` (phase DRAINING), then
  :meth:`SwitchActions.suspend_samplers` (SUSPENDING);
* back to the samplers, a repair, a start-up reconcile or new samplers from discovery:
  :meth:`SwitchActions.resume_samplers` (RESUMING / REPAIRING);
* between switches (engine audit): :meth:`SwitchActions.read_engines`, and on a fault
  :meth:`SwitchActions.take_out_of_service` before the repair;
* samplers that left the group (discovery): :meth:`SwitchActions.retire_samplers`; groups still
  held at start-up: :meth:`SwitchActions.publish_asleep`.

Only ``suspend_samplers`` and ``resume_samplers`` are abstract; the rest are no-ops by default and
:attr:`SwitchActions.can_read_engines` says whether the engine audit can run (no ``hasattr`` probing).
The gRPC implementation is :class:`~llmd_timeslice.orchestrator.actions.GrpcSwitchActions`.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from llmd_timeslice.weights.update import WeightUpdate


class SwitchKind(enum.StrEnum):
    """What a switch does (``SwitchInfo.kind`` on the wire is the value; compares equal to it)."""

    TO_JOB = "to_job"
    """Samplers drained and put to sleep, then the lease granted."""
    TO_SAMPLERS = "to_samplers"
    """Samplers woken (loading the group's weight version) after the last holder yielded."""
    REPAIR = "repair"
    """Out-of-service samplers woken again (repair back-off, or an engine audit fault)."""
    RECONCILE = "reconcile"
    """Start-up: every sampler of a free group woken (a no-op on an awake engine) and verified."""
    DISCOVERED = "discovered"
    """Samplers that discovery added to an idle group, woken and verified before they serve."""


class JobState(enum.Enum):
    """A sampler job's state, in the Snapshot Agent's vocabulary (``SnapshotAgentJobState.State``)."""

    IDLE = "IDLE"
    RUNNING = "RUNNING"
    TRANSITIONING = "TRANSITIONING"
    SAVED = "SAVED"
    FAULTED = "FAULTED"


class EngineFault(enum.StrEnum):
    """What the engine audit found wrong with a serving sampler's engine (metric label: the value)."""

    RESTARTED = "restarted"
    """It reports another weight version than the one recorded: it restarted on its own."""
    ASLEEP = "asleep"
    """It sleeps while it should serve."""
    UNREACHABLE = "unreachable"
    """It refuses connections (down, or restarting)."""


class StepFault(enum.Enum):
    """Why one sampler's sleep or wake failed."""

    SIDECAR = "sidecar"
    """The sidecar could not be reached or refused the call (gRPC error)."""
    ENGINE = "engine"
    """The sidecar ran the operation and it failed (the engine refused, or verification did not hold)."""
    WEIGHTS_REJECTED = "weights_rejected"
    """The weight version failed verification or loading; the engine can still serve its last good version."""
    LABEL = "label"
    """The serving label could not be written (label fallback)."""


class SamplerStepFailed(RuntimeError):
    """One sampler's step failed; ``fault`` says which kind of failure (never parsed from the message)."""

    def __init__(self, address: str, step: str, fault: StepFault, message: str) -> None:
        super().__init__(message)
        self.address, self.step, self.fault = address, step, fault


@dataclass(frozen=True)
class SamplerEndpoint:
    """One sampler: a vLLM server behind the gate and its snapshot sidecar.

    ``address`` is the ``ip:port`` the EPP routes to (the gate's endpoint name); ``sidecar`` the
    ``host:port`` of its SnapshotAgentService; ``job_id`` the sampler job the sidecar serves.
    """

    pool: str
    address: str
    sidecar: str
    job_id: str


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


@dataclass
class GroupSpec:
    """Settings and samplers of one group (durations in seconds). ``job_sleep_levels`` overrides the
    sleep-level policy per job."""

    group_id: str
    samplers: list[SamplerEndpoint] = field(default_factory=list)
    sleep_level: int = 1
    drain_timeout_s: float = 60.0
    lease_ttl_s: float = 30.0
    policy: SchedulingPolicy = SchedulingPolicy.FIFO
    job_priorities: dict[str, int] = field(default_factory=dict)
    sleep_level_policy: SleepLevelPolicy = SleepLevelPolicy.FIXED
    job_sleep_levels: dict[str, int] = field(default_factory=dict)
    # temporary: replaced by the domain model (llmd_timeslice/domain/group_settings.py, GroupSettings)
    yield_request_bands: list[int] | None = None
    yield_request_fraction: float = 0.5
    min_training_s: float = 10.0
    job_yield_opt_out: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Accept the wire/config spelling ("fifo", "auto"); keep the enums inside.
        self.policy = SchedulingPolicy(self.policy)
        self.sleep_level_policy = SleepLevelPolicy(self.sleep_level_policy)

    def sleep_level_for(self, job_id: str, publishes_weights: bool) -> int:
        """The sleep level the samplers take when ``job_id`` acquires the group."""
        if job_id in self.job_sleep_levels:
            return self.job_sleep_levels[job_id]
        if self.sleep_level_policy is SleepLevelPolicy.AUTO and publishes_weights:
            return 2
        return self.sleep_level

    def settings(self) -> tuple:
        """Everything but the samplers (compared to decide whether a spec update changes settings)."""
        return (
            self.sleep_level,
            self.drain_timeout_s,
            self.lease_ttl_s,
            self.policy,
            tuple(sorted(self.job_priorities.items())),
            self.sleep_level_policy,
            tuple(sorted(self.job_sleep_levels.items())),
            None if self.yield_request_bands is None else tuple(self.yield_request_bands),
            self.yield_request_fraction,
            self.min_training_s,
            tuple(self.job_yield_opt_out),
        )

    def copy(self, samplers: list[SamplerEndpoint] | None = None) -> GroupSpec:
        """A copy (its own lists and maps), optionally with other samplers."""
        return GroupSpec(
            self.group_id,
            list(self.samplers if samplers is None else samplers),
            self.sleep_level,
            self.drain_timeout_s,
            self.lease_ttl_s,
            self.policy,
            dict(self.job_priorities),
            self.sleep_level_policy,
            dict(self.job_sleep_levels),
            None if self.yield_request_bands is None else list(self.yield_request_bands),
            self.yield_request_fraction,
            self.min_training_s,
            list(self.job_yield_opt_out),
        )


@dataclass
class SwitchRecord:
    """One phase switch, for status and metrics. ``phases``: step name -> seconds (``drained_in_time``: 1.0
    or 0.0). The actions fill in the per-sampler outcome of a wake."""

    group_id: str
    kind: SwitchKind
    job_id: str
    started_at: float
    phases: dict[str, float] = field(default_factory=dict)
    ok: bool = True
    error: str = ""
    sleep_level: int = 0
    """to a job: the level the samplers sleep at (0: the group's ``sleep_level``)."""
    weights: WeightUpdate | None = None
    """A wake: the weight version to load while waking (None: wake with the weights they have)."""
    sampler_versions: dict[str, int] = field(default_factory=dict)
    """A wake: address -> weight version; updated for each sampler woken (and loaded)."""
    sampler_errors: dict[str, str] = field(default_factory=dict)
    """A wake: address -> why it failed; that sampler stays out of service."""
    weights_rejected: dict[str, str] = field(default_factory=dict)
    """A wake with ``weights``: address -> why that sampler refused the version; it was woken with its last
    good version instead (and serves it unless it is also in ``sampler_errors``)."""
    engine_faults: dict[str, EngineFault] = field(default_factory=dict)
    """A repair after an engine audit: address -> what the audit found."""
    drain_cut: list[str] = field(default_factory=list)
    """To a job: requests the gates answered 503 ``drain_deadline`` at the drain deadline (x-request-id each)."""
    parked_requests: dict[str, str] = field(default_factory=dict)
    """To a job: address -> requests found inside its engine after it slept and what was done ("2 aborted")."""


@dataclass(frozen=True)
class EngineReading:
    """What an engine reports about itself: its weight version label (None: it has none) and whether it sleeps;
    or, in ``unreachable``, why it could not be read because it refused the connection."""

    weight_version: str | None
    sleeping: bool
    unreachable: str = ""


class SwitchActions(abc.ABC):
    """The outside world of a phase switch. Each method raises on failure (a :class:`SamplerStepFailed` where
    one sampler's step failed); the group machine decides what happens next."""

    can_read_engines: ClassVar[bool] = False
    """Whether :meth:`read_engines` reads the engines (the engine audit runs only then)."""

    async def drain_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:  # noqa: B027 (no-op default)
        """Stop the gates from steering new requests to ``spec.samplers`` and wait for the drain barrier
        (bounded by ``spec.drain_timeout_s``). Default: nothing to drain."""

    @abc.abstractmethod
    async def suspend_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:
        """Put every sampler's engine to sleep at ``record.sleep_level`` (0: ``spec.sleep_level``), verified."""

    @abc.abstractmethod
    async def resume_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:
        """Wake every sampler (loading ``record.weights`` if set), verify it and publish it SERVING; fill in
        ``record.sampler_versions`` / ``sampler_errors`` / ``weights_rejected``; raise if any failed."""

    async def read_engines(self, spec: GroupSpec) -> dict[str, EngineReading]:
        """Sampler address -> what its engine reports now (samplers that could not be read are left out)."""
        return {}

    async def take_out_of_service(self, spec: GroupSpec) -> None:  # noqa: B027
        """Stop the gates from steering new requests to ``spec.samplers`` (a fault found between switches)."""

    async def retire_samplers(self, samplers: list[SamplerEndpoint]) -> None:  # noqa: B027
        """``samplers`` left their group (discovery): out of service at the gates for good."""

    async def publish_asleep(self, spec: GroupSpec) -> None:  # noqa: B027
        """At start-up, for a group a job still holds: its samplers stay asleep and out of service."""

    def job_states(self) -> Mapping[str, JobState]:
        """Sampler address -> its job's last known state (for ``GetGroupStatus``)."""
        return {}

    async def close(self) -> None:  # noqa: B027
        """Release connections."""
