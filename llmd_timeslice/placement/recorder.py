"""Per-job phase profiles from what the orchestrator sees: acquires, grants and yields (no I/O).

The orchestrator's groups call :meth:`ProfileRecorder.acquired` when a job asks for a group, :meth:`granted` when it
gets it and :meth:`released` when it gives it up (a yield, an expired lease, a grant taken back), with wall-clock
unix seconds; and :meth:`switched` with each finished switch. From these the recorder keeps, per job:

* a **hold** (grant to release) is an accelerator phase: the phase the client named on its acquire (``rollout`` or
  ``train``, :data:`~llmd_timeslice.protocol`'s phase metadata), else ``train`` (in this project's main topology the
  lease holder is the trainer, and rollouts go through the router while nobody holds the group);
* the **gap** from a release to the same job's next acquire is off the accelerators: after a ``rollout`` hold it is
  the ``cpu_gap`` (reward, buffers); after a ``train`` hold, ``weight_sync`` when the next hold is a rollout, or
  ``rollout`` when it is another train (router mode: the group's samplers served this job's rollouts meanwhile; the
  orchestrator sees no boundary inside it, so a reward computation on CPU is counted in it; a hand profile can split
  it). A gap longer than :data:`MAX_GAP_S` is a pause of the job, not a phase: it is not recorded and the next
  iteration starts a new period;
* an **iteration** starts at the acquire of the job's first phase kind of a period (its rollout where the job names
  rollouts, else its train); the **period** is the time from one iteration's start to the next.

Each group's switch costs are kept too (:class:`SwitchCostStats`): the samplers put to sleep before a grant, woken
after a release nobody waited for, and the handover from a release to the next waiter's grant.

:meth:`snapshot` / :meth:`restore` give the JSON the orchestrator persists with its state, so profiles survive a
restart and a leader change (the transient times are unix seconds, meaningful to the next leader).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmd_timeslice.placement.profile import JobProfile, PhaseKind, PhaseStats

MAX_GAP_S = 3600.0
"""A gap longer than this (seconds) between a job's release and its next acquire is a pause, not a phase."""
MAX_JOBS = 512
"""Profiles kept (the least recently updated are dropped beyond it), to bound the persisted state."""


@dataclass(frozen=True)
class Hints:
    """What a client says of itself on its acquire (all optional): the phase it acquires for, the accelerators and
    the host bytes of that phase's worker, its slowdown budget."""

    phase: PhaseKind | None = None
    accelerators: int | None = None
    state_bytes: int | None = None
    slowdown_budget: float | None = None


@dataclass
class SwitchCostStats:
    """Measured switch costs: ``sleep`` (a grant from served samplers), ``wake`` (a release nobody waited for),
    ``handover`` (a release to the next waiter's grant), seconds; ``served``: some group has samplers."""

    sleep: PhaseStats = field(default_factory=PhaseStats)
    wake: PhaseStats = field(default_factory=PhaseStats)
    handover: PhaseStats = field(default_factory=PhaseStats)
    served: bool = False


@dataclass
class _Live:
    """A job's transient state: its hold in progress, its last release, the start of its iteration."""

    holding: tuple[str, PhaseKind, float] | None = None  # group, kind, grant time
    asked: dict[str, tuple[float, PhaseKind]] = field(default_factory=dict)  # group -> acquire time, kind
    released_at: float | None = None
    last_kind: PhaseKind | None = None
    iteration_at: float | None = None
    names_rollouts: bool = False


class ProfileRecorder:
    """Profiles of every job seen (module docstring). ``clock`` gives unix seconds (default ``time.time``)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._profiles: dict[str, JobProfile] = {}
        self._live: dict[str, _Live] = {}
        self._released: dict[str, float] = {}  # group -> when its last holder released it (while waiters queued)
        self.costs = SwitchCostStats()
        self.busy_accelerator_s: dict[str, float] = {}
        """Group -> useful accelerator-seconds so far (each hold times its phase's accelerators), monotonic."""

    # ------------------------------------------------------------------ events
    def acquired(self, job: str, group: str, hints: Hints | None = None, at: float | None = None) -> None:
        """``job`` asks for ``group`` (``hints``: what the client said of itself)."""
        t = self.clock() if at is None else at
        h = hints or Hints()
        p = self._profile(job, t)
        live = self._live.setdefault(job, _Live())
        kind = h.phase or PhaseKind.TRAIN
        live.names_rollouts = live.names_rollouts or kind is PhaseKind.ROLLOUT
        live.asked[group] = (t, kind)
        if h.accelerators is not None:
            p.accelerators[kind] = max(1, int(h.accelerators))
        if h.state_bytes is not None:
            p.state_bytes[kind] = max(0, int(h.state_bytes))  # type: ignore[assignment]
        if h.slowdown_budget is not None:
            p.slowdown_budget = h.slowdown_budget
        if live.released_at is not None and live.last_kind is not None:
            gap = t - live.released_at
            if gap > MAX_GAP_S:
                live.iteration_at = None  # a pause: the next iteration starts a new period
            elif live.last_kind is PhaseKind.ROLLOUT:
                p.phases.setdefault(PhaseKind.CPU_GAP, PhaseStats()).add(gap)
            elif kind is PhaseKind.ROLLOUT:
                p.phases.setdefault(PhaseKind.WEIGHT_SYNC, PhaseStats()).add(gap)
            elif not live.names_rollouts:
                p.phases.setdefault(PhaseKind.ROLLOUT, PhaseStats()).add(gap)
            live.released_at = None
        first = PhaseKind.ROLLOUT if live.names_rollouts else PhaseKind.TRAIN
        if kind is first:
            if live.iteration_at is not None and t - live.iteration_at <= MAX_GAP_S:
                p.periods.add(t - live.iteration_at)
            live.iteration_at = t

    def granted(self, job: str, group: str, at: float | None = None) -> None:
        """``job`` got ``group``."""
        t = self.clock() if at is None else at
        live = self._live.setdefault(job, _Live())
        _, kind = live.asked.pop(group, (t, PhaseKind.TRAIN))
        live.holding = (group, kind, t)
        released = self._released.pop(group, None)
        if released is not None:
            self.costs.handover.add(t - released)
        p = self._profile(job, t)
        if group not in p.groups:
            p.groups.append(group)

    def released(self, job: str, group: str, waiters: bool, at: float | None = None) -> None:
        """``job`` gave ``group`` up (``waiters``: someone waits for it: the grant that follows is a handover)."""
        t = self.clock() if at is None else at
        live = self._live.get(job)
        if live is None or live.holding is None or live.holding[0] != group:
            return
        _, kind, start = live.holding
        live.holding = None
        p = self._profile(job, t)
        p.phases.setdefault(kind, PhaseStats()).add(t - start)
        self.busy_accelerator_s[group] = self.busy_accelerator_s.get(group, 0.0) + max(0.0, t - start) * p.accelerators_of(kind)
        live.released_at, live.last_kind = t, kind
        if waiters:
            self._released[group] = t
        else:
            self._released.pop(group, None)

    def abandoned(self, job: str, group: str) -> None:
        """``job`` stopped waiting for ``group`` (nothing recorded)."""
        live = self._live.get(job)
        if live is not None:
            live.asked.pop(group, None)

    def switched(self, kind: str, seconds: float, served: bool = True) -> None:
        """A finished switch of ``kind`` (``to_job``: samplers put to sleep; ``to_samplers``: woken), ``seconds``
        long."""
        if kind == "to_job":
            self.costs.sleep.add(seconds)
        elif kind == "to_samplers":
            self.costs.wake.add(seconds)
        self.costs.served = self.costs.served or served

    # ------------------------------------------------------------------ reading
    def profiles(self) -> list[JobProfile]:
        """Every job's profile (copies), by job id."""
        return [self._profiles[j].model_copy(deep=True) for j in sorted(self._profiles)]

    def profile(self, job: str) -> JobProfile | None:
        p = self._profiles.get(job)
        return None if p is None else p.model_copy(deep=True)

    def _profile(self, job: str, t: float) -> JobProfile:
        p = self._profiles.get(job)
        if p is None:
            if len(self._profiles) >= MAX_JOBS:
                oldest = min(self._profiles.values(), key=lambda x: x.updated_unix_s)
                del self._profiles[oldest.job_id]
                self._live.pop(oldest.job_id, None)
            p = self._profiles[job] = JobProfile(job_id=job, source="measured")
        p.updated_unix_s = t
        return p

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        """JSON-able state: profiles, each job's transient times, switch costs."""
        return {
            "profiles": [p.model_dump(mode="json") for p in self._profiles.values()],
            "live": {
                j: {
                    "released_at": v.released_at,
                    "last_kind": str(v.last_kind) if v.last_kind else None,
                    "iteration_at": v.iteration_at,
                    "names_rollouts": v.names_rollouts,
                }
                for j, v in self._live.items()
            },
            "busy_accelerator_s": dict(self.busy_accelerator_s),
            "costs": {
                "sleep": self.costs.sleep.model_dump(),
                "wake": self.costs.wake.model_dump(),
                "handover": self.costs.handover.model_dump(),
                "served": self.costs.served,
            },
        }

    def restore(self, data: Mapping[str, Any] | None) -> int:
        """Take the state of :meth:`snapshot` (None or malformed parts are skipped); returns the profiles restored.
        A hold in progress is not restored: the holder's release after the restart records no phase."""
        if not data:
            return 0
        for raw in data.get("profiles") or []:
            try:
                p = JobProfile.model_validate(raw)
            except ValueError:
                continue
            self._profiles[p.job_id] = p
        for job, raw in (data.get("live") or {}).items():
            if job in self._profiles and isinstance(raw, Mapping):
                kind = str(raw.get("last_kind"))
                self._live[job] = _Live(
                    released_at=raw.get("released_at"),
                    last_kind=PhaseKind(kind) if kind in PhaseKind._value2member_map_ else None,
                    iteration_at=raw.get("iteration_at"),
                    names_rollouts=bool(raw.get("names_rollouts")),
                )
        for group, value in (data.get("busy_accelerator_s") or {}).items():
            if isinstance(value, int | float):
                self.busy_accelerator_s[str(group)] = float(value)
        costs = data.get("costs") or {}
        try:
            self.costs = SwitchCostStats(
                PhaseStats.model_validate(costs.get("sleep") or {}),
                PhaseStats.model_validate(costs.get("wake") or {}),
                PhaseStats.model_validate(costs.get("handover") or {}),
                bool(costs.get("served")),
            )
        except ValueError:
            pass
        return len(self._profiles)
