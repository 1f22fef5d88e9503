"""A job's phase profile: what the placement planner knows of one RL job (no I/O).

An RL job repeats *iterations* of four phases (:class:`PhaseKind`): ``rollout`` (its samplers generate, on
accelerators), ``cpu_gap`` (reward and buffer processing on CPU: off every accelerator), ``train`` (its trainer, on
accelerators) and ``weight_sync`` (the new weights reach the samplers: off the shared accelerators). A
:class:`JobProfile` keeps, per phase, the distribution of its durations (:class:`PhaseStats`: recent samples in
seconds, count, mean, percentiles), the *period* (one iteration, seconds), the accelerators each accelerator phase
needs, the bytes the job keeps in host memory while another job holds its accelerators (``state_bytes``, per
accelerator phase's role) and its slowdown budget (the longest period it accepts, relative to running alone:
0.05 = 5 % longer).

Two sources produce one: the orchestrator, from the acquires, holds and yields it sees
(:mod:`llmd_timeslice.placement.recorder`), and a person, in a YAML file of phase durations
(:func:`load_profiles`; shape in :func:`hand_profile`). :meth:`JobProfile.check_complete` says in one line why a
profile cannot be planned (no complete period).

Errors: :class:`ProfileError` (a file or entry that cannot be read: one line per problem, ``where: what``) and
:class:`IncompleteProfile` (a profile without a complete period).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from llmd_timeslice import yaml_files

MAX_SAMPLES = 64
"""Durations kept per phase (the most recent): enough for a p95, small enough to persist every profile in the
orchestrator's state (a ConfigMap holds 1 MiB)."""

DEFAULT_SLOWDOWN_BUDGET = 0.05
"""A job's default slowdown budget: its period may be at most 5 % longer than alone."""
DEFAULT_GAP = 0.10
"""Re-plan when the measured duty cycle is this much off the prediction (relative), or a job is over budget."""
DEFAULT_GAIN = 0.10
"""Advise a re-plan when it would raise the predicted duty cycle by more than this (relative)."""


class PhaseKind(enum.StrEnum):
    """The four phases of an RL iteration, in order."""

    ROLLOUT = "rollout"
    CPU_GAP = "cpu_gap"
    TRAIN = "train"
    WEIGHT_SYNC = "weight_sync"


ACCELERATOR_PHASES = (PhaseKind.ROLLOUT, PhaseKind.TRAIN)
"""The phases that hold accelerators (a lease group)."""

ROLE_OF: dict[PhaseKind, str] = {PhaseKind.ROLLOUT: "sampler", PhaseKind.TRAIN: "trainer"}
"""Accelerator phase -> the job's worker that runs it (the simulation's role)."""


class ProfileError(ValueError):
    """A profile file or entry that cannot be used; ``errors`` holds one line per problem (``where: what``)."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


class IncompleteProfile(ProfileError):
    """A profile without a complete period (``job_id`` names the job)."""

    def __init__(self, job_id: str, why: str) -> None:
        super().__init__([f"job {job_id}: no complete period ({why})"])
        self.job_id = job_id


class PhaseStats(BaseModel):
    """Durations of one phase: ``count`` observed in all, the most recent ``samples_s`` (at most
    :data:`MAX_SAMPLES`, oldest first), seconds."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(0, ge=0)
    samples_s: list[float] = Field(default_factory=list)

    @field_validator("samples_s")
    @classmethod
    def _non_negative(cls, v: list[float]) -> list[float]:
        bad = [x for x in v if not (x >= 0 and math.isfinite(x))]
        if bad:
            raise ValueError(f"durations must be finite and >= 0 seconds, got {bad[:3]}")
        return v[-MAX_SAMPLES:]

    def add(self, seconds: float) -> None:
        """Record one duration (seconds; a negative clock step is recorded as 0)."""
        self.count += 1
        self.samples_s.append(max(0.0, seconds))
        del self.samples_s[:-MAX_SAMPLES]

    @property
    def mean_s(self) -> float:
        """Mean of the kept samples (0 without any)."""
        return sum(self.samples_s) / len(self.samples_s) if self.samples_s else 0.0

    def quantile_s(self, q: float) -> float:
        """The ``q`` quantile (0..1) of the kept samples, linear between order statistics (0 without any)."""
        if not self.samples_s:
            return 0.0
        xs = sorted(self.samples_s)
        pos = q * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    @classmethod
    def of(cls, samples: Iterable[float]) -> PhaseStats:
        """Stats of ``samples`` (seconds)."""
        xs = [float(x) for x in samples]
        return cls(count=len(xs), samples_s=xs)


class JobProfile(BaseModel):
    """One RL job's phase profile (see the module docstring). Durations in seconds, bytes in bytes."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(min_length=1)
    phases: dict[PhaseKind, PhaseStats] = Field(default_factory=dict, description="Durations per phase.")
    periods: PhaseStats = Field(default_factory=PhaseStats, description="Iteration periods measured (start to start).")
    accelerators: dict[PhaseKind, int] = Field(
        default_factory=dict, description="Accelerators each accelerator phase needs (rollout, train); absent: 1."
    )
    state_bytes: dict[PhaseKind, ByteSize] = Field(
        default_factory=dict,
        description="Bytes in host memory while the phase's worker is put aside (train: the trainer's state; "
        "rollout: the samplers' weights at sleep level 1).",
    )
    switch_s: dict[PhaseKind, float] = Field(
        default_factory=dict,
        description="Seconds to put the phase's worker aside and bring it back on shared accelerators, beyond what "
        "its holds already include (the group's sampler sleep and wake are the group's switch costs).",
    )
    slowdown_budget: float = Field(DEFAULT_SLOWDOWN_BUDGET, ge=0, le=100, description="Longest period accepted, relative.")
    priority: int = Field(0, description="The job's priority where its group's policy is `priority` (higher first).")
    source: str = Field("hand", description="`measured` (by the orchestrator) or `hand` (a file).")
    groups: list[str] = Field(default_factory=list, description="Lease groups the job was seen holding.")
    updated_unix_s: float = Field(0.0, description="Last change (unix seconds; 0: never recorded).")

    def phase(self, kind: PhaseKind) -> PhaseStats:
        """The stats of ``kind`` (empty when never seen)."""
        return self.phases.get(kind) or PhaseStats()

    def mean_s(self, kind: PhaseKind) -> float:
        return self.phase(kind).mean_s

    def accelerators_of(self, kind: PhaseKind) -> int:
        """Accelerators ``kind`` needs (1 when not given)."""
        return int(self.accelerators.get(kind, 1))

    def state_bytes_of(self, kind: PhaseKind) -> int:
        return int(self.state_bytes.get(kind, 0))

    @property
    def state_bytes_total(self) -> int:
        """Host bytes of both accelerator phases' workers (what a group that time-slices the job keeps aside)."""
        return sum(self.state_bytes_of(k) for k in ACCELERATOR_PHASES)

    @property
    def alone_period_s(self) -> float:
        """The period alone, each phase at its mean, back to back (the slowdown's reference)."""
        return sum(self.mean_s(k) for k in PhaseKind)

    @property
    def period_s(self) -> float:
        """The measured mean period where there is one, else :attr:`alone_period_s`."""
        return self.periods.mean_s if self.periods.samples_s else self.alone_period_s

    @property
    def busy_accelerator_s(self) -> float:
        """Useful accelerator-seconds of one mean iteration (each accelerator phase times its accelerators)."""
        return sum(self.mean_s(k) * self.accelerators_of(k) for k in ACCELERATOR_PHASES)

    def check_complete(self) -> None:
        """Raise :class:`IncompleteProfile` unless the profile has a complete period: both accelerator phases seen
        (a measured profile: also one period, from the start of one iteration to the next)."""
        missing = [str(k) for k in ACCELERATOR_PHASES if not self.phase(k).samples_s]
        seen = ", ".join(f"{k} x{self.phase(k).count}" for k in PhaseKind if self.phase(k).count) or "no phase"
        if missing:
            raise IncompleteProfile(self.job_id, f"saw {seen}; a period needs a rollout and a train phase")
        if self.source == "measured" and not self.periods.samples_s:
            raise IncompleteProfile(self.job_id, f"saw {seen} but not yet the start of a next iteration")
        if self.alone_period_s <= 0:
            raise IncompleteProfile(self.job_id, "every phase lasted 0 s")

    def summary(self) -> dict[str, Any]:
        """Means, p95s, counts, period and accelerators as plain numbers (status, metrics, the plan's text)."""
        return {
            "job_id": self.job_id,
            "source": self.source,
            "period_s": round(self.period_s, 3),
            "periods": self.periods.count,
            **{f"{k}_s": round(self.mean_s(k), 3) for k in PhaseKind},
            **{f"{k}_p95_s": round(self.phase(k).quantile_s(0.95), 3) for k in PhaseKind},
            **{f"{k}_count": self.phase(k).count for k in PhaseKind},
            "accelerators": {str(k): self.accelerators_of(k) for k in ACCELERATOR_PHASES},
            "state_bytes": self.state_bytes_total,
            "slowdown_budget": self.slowdown_budget,
            "groups": list(self.groups),
        }


class HandProfile(BaseModel):
    """A job described by hand (one entry of a profiles file). A duration is seconds: one number, or a list of
    observed values (the distribution the planner samples from)."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(min_length=1)
    rollout_s: float | list[float]
    train_s: float | list[float]
    cpu_gap_s: float | list[float] = 0.0
    weight_sync_s: float | list[float] = 0.0
    accelerators: int | dict[PhaseKind, int] = Field(1, description="One number for both phases, or per phase.")
    state_bytes: ByteSize | dict[PhaseKind, ByteSize] = Field(
        ByteSize(0), description="Host bytes while put aside: one size (the trainer's state) or per phase."
    )
    switch_s: float | dict[PhaseKind, float] | None = Field(
        None, description="Seconds to put a worker aside and back, per phase (None: the planner's switch costs)."
    )
    slowdown_budget: float = Field(DEFAULT_SLOWDOWN_BUDGET, ge=0, le=100)
    priority: int = 0

    # One line per bad value: without these, pydantic answers a value of a union type once per member it tried
    # (`rollout_s.float: ...` and `rollout_s.list[float]: ...`).
    @field_validator("rollout_s", "train_s", "cpu_gap_s", "weight_sync_s", mode="before")
    @classmethod
    def _duration_shape(cls, v: Any) -> Any:
        if _fits(_FLOAT, v) or (isinstance(v, list) and v and all(_fits(_FLOAT, x) for x in v)):
            return v
        raise ValueError(f"expected seconds: a number or a non-empty list of numbers, got {v!r}")

    @field_validator("accelerators", mode="before")
    @classmethod
    def _accelerators_shape(cls, v: Any) -> Any:
        return _one_or_per_phase(v, _INT, "a whole number of accelerators")

    @field_validator("state_bytes", mode="before")
    @classmethod
    def _state_bytes_shape(cls, v: Any) -> Any:
        return _one_or_per_phase(v, _BYTES, "a size (bytes, or 80GiB)")

    @field_validator("switch_s", mode="before")
    @classmethod
    def _switch_shape(cls, v: Any) -> Any:
        return v if v is None else _one_or_per_phase(v, _FLOAT, "seconds")

    @field_validator("rollout_s", "train_s", "cpu_gap_s", "weight_sync_s")
    @classmethod
    def _durations(cls, v: float | list[float]) -> float | list[float]:
        xs = v if isinstance(v, list) else [v]
        if not xs or any(not (x >= 0 and math.isfinite(x)) for x in xs):
            raise ValueError(f"durations must be finite and >= 0 seconds (one number or a non-empty list), got {v}")
        return v

    def profile(self) -> JobProfile:
        def stats(v: float | list[float]) -> PhaseStats:
            return PhaseStats.of(v if isinstance(v, list) else [v])

        def per_phase(v: Any, single: PhaseKind | None) -> dict[PhaseKind, Any]:
            if isinstance(v, dict):
                return dict(v)
            return {k: v for k in ACCELERATOR_PHASES} if single is None else {single: v}

        return JobProfile(
            job_id=self.job_id,
            phases={
                PhaseKind.ROLLOUT: stats(self.rollout_s),
                PhaseKind.CPU_GAP: stats(self.cpu_gap_s),
                PhaseKind.TRAIN: stats(self.train_s),
                PhaseKind.WEIGHT_SYNC: stats(self.weight_sync_s),
            },
            accelerators=per_phase(self.accelerators, None),
            state_bytes=per_phase(self.state_bytes, PhaseKind.TRAIN),
            switch_s={} if self.switch_s is None else per_phase(self.switch_s, None),
            slowdown_budget=self.slowdown_budget,
            priority=self.priority,
            source="hand",
        )


_FLOAT: TypeAdapter = TypeAdapter(float)
_INT: TypeAdapter = TypeAdapter(int)
_BYTES: TypeAdapter = TypeAdapter(ByteSize)


def _fits(adapter: TypeAdapter, v: Any) -> bool:
    """Whether ``v`` validates as ``adapter``'s type (pydantic's own rules), booleans refused."""
    if isinstance(v, bool):
        return False
    try:
        adapter.validate_python(v)
    except ValidationError:
        return False
    return True


def _one_or_per_phase(v: Any, adapter: TypeAdapter, what: str) -> Any:
    """``v`` when it is one value of ``adapter``'s type or a mapping of phase name to one; else ValueError, one
    line saying ``what`` was expected."""
    if isinstance(v, Mapping):
        unknown = [k for k in v if k not in set(PhaseKind)]
        if unknown:
            raise ValueError(f"unknown phase {unknown[0]!r}; phases: {', '.join(PhaseKind)}")
        bad = {k: x for k, x in v.items() if not _fits(adapter, x)}
        if bad:
            k, x = next(iter(bad.items()))
            raise ValueError(f"phase {k}: expected {what}, got {x!r}")
        return v
    if _fits(adapter, v):
        return v
    raise ValueError(f"expected {what}, or a mapping of phase to it, got {v!r}")


def hand_profile(**entry: Any) -> JobProfile:
    """A :class:`JobProfile` from one hand entry, e.g. ``hand_profile(job_id="grpo-7b", rollout_s=60, train_s=60,
    cpu_gap_s=3, weight_sync_s=2.8, accelerators=4, state_bytes="28GiB")``.

    Raises:
        ProfileError: an unknown key, a missing duration, a negative value.
    """
    try:
        return HandProfile(**entry).profile()
    except ValidationError as exc:
        raise ProfileError(yaml_files.validation_lines(exc, HandProfile)) from None


def profiles_from_data(data: Any, where: str = "profiles") -> list[JobProfile]:
    """Profiles from parsed YAML/JSON: a list, or a mapping with ``profiles:`` (or ``jobs:``), whose entries are hand
    entries (:class:`HandProfile`) or whole profiles as the orchestrator serves them (with ``phases:``).

    Raises:
        ProfileError: one line per bad entry (``where[i].key: what``), or a job id given twice.
    """
    if isinstance(data, Mapping):
        data = data.get("profiles", data.get("jobs"))
    if not isinstance(data, list):
        raise ProfileError([f"{where}: expected a list of jobs (or a mapping with `profiles:`)"])
    out: list[JobProfile] = []
    errors: list[str] = []
    for i, entry in enumerate(data):
        job = entry.get("job_id") if isinstance(entry, Mapping) else None
        at = f"{where}[{i}]" + (f" (job {job})" if isinstance(job, str) and job else "")
        if not isinstance(entry, Mapping):
            errors.append(f"{at}: expected a mapping with job_id and phase durations")
            continue
        try:
            if "phases" in entry:
                out.append(JobProfile.model_validate(entry))
            else:
                out.append(HandProfile.model_validate(entry).profile())
        except ValidationError as exc:
            root = JobProfile if "phases" in entry else HandProfile
            errors.extend(f"{at}.{line}" for line in yaml_files.validation_lines(exc, root))
    ids = [p.job_id for p in out]
    errors.extend(f"{where}: job {j} given twice" for j in sorted({j for j in ids if ids.count(j) > 1}))
    if errors:
        raise ProfileError(errors)
    return out


def load_profiles(paths: Iterable[str | Path]) -> list[JobProfile]:
    """Every profile of the YAML (or JSON) files ``paths``, in order.

    Raises:
        ProfileError: a file that cannot be read or parsed, a bad entry, a job id given twice across files.
    """
    out: list[JobProfile] = []
    for path in paths:
        try:
            data = yaml_files.load(Path(path).read_text())
        except OSError as exc:
            raise ProfileError([f"{path}: {exc.strerror or exc}"]) from None
        except yaml.YAMLError as exc:
            raise ProfileError([f"{path}: {yaml_files.error_text(exc)}"]) from None
        out.extend(profiles_from_data(data, str(path)))
    ids = [p.job_id for p in out]
    dup = sorted({j for j in ids if ids.count(j) > 1})
    if dup:
        raise ProfileError([f"job {j} given twice" for j in dup])
    return out
