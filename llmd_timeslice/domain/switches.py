"""The record of one phase switch and the typed outcomes of its steps, shared by the orchestrator's group machine,
its gRPC actions, status and metrics (no I/O here)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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
    ENGINE_FAILED = "engine_failed"
    """The sidecar marked the engine failed: its wake failed the same way several times in a row (not worth retrying
    until the engine restarts; snapshot_ext.proto, ``OPERATION_FAULT_ENGINE_FAILED``)."""
    LABEL = "label"
    """The serving label could not be written (label fallback)."""
    ENGINE_UNREACHABLE = "engine_unreachable"
    """Nothing answers at the engine's address, or its engine core is dead: it holds no accelerator memory."""


class SamplerStepFailed(RuntimeError):
    """One sampler's step failed; ``fault`` says which kind of failure (never parsed from the message)."""

    def __init__(self, address: str, step: str, fault: StepFault, message: str) -> None:
        super().__init__(message)
        self.address, self.step, self.fault = address, step, fault


@dataclass
class SwitchRecord:
    """One phase switch, for status and metrics. ``phases``: step name -> seconds (``drained_in_time``: 1.0
    or 0.0). The actions fill in the per-sampler outcome of a wake."""

    group_id: str
    kind: SwitchKind
    job_id: str
    started_at: float
    phases: dict[str, float] = field(default_factory=dict)
    cause: str = ""
    """The group command that started it (``acquire``, ``yield``, ``lease_expired``, ``abandon``, ``audit_tick``,
    ...): a lease expiry told apart from a yield."""
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
    unreachable: dict[str, str] = field(default_factory=dict)
    """to_job: samplers left out of the sleep because their engine was down (address -> why); they hold no
    accelerator memory, stay out of service, and are put to sleep when they answer again (issue 38 §5)."""


@dataclass(frozen=True)
class EngineReading:
    """What an engine reports about itself: its weight version label (None: it has none) and whether it sleeps;
    or, in ``unreachable``, why it could not be read because it refused the connection."""

    weight_version: str | None
    sleeping: bool
    unreachable: str = ""
