"""One candidate co-execution group, predicted by simulating its schedule (no I/O).

A :class:`Candidate` is a set of jobs that take turns on accelerators, with a *layout* and a waiter *policy*:

* ``colocated``: one lease group holds every accelerator phase of its jobs (rollouts and training on the same
  accelerators: this project's main topology, the trainer on its samplers' accelerators). One job alone this way is
  time-sliced with itself.
* ``disaggregated``: two lease groups, one for the jobs' rollouts and one for their training (RollMux's
  co-execution group). One job alone this way is *dedicated*: nothing ever switches.
* ``one_lease``: every job keeps its own accelerators but all take turns under one lease (the ``naive``
  alternative: one group named for every job; never chosen by the search).

:func:`evaluate` runs :func:`~llmd_timeslice.placement.simulation.simulate_schedule` for a candidate: every job's
iterations drawn from its profile's samples (the same draws for a job in every candidate, so candidates compare on
equal terms), handovers costed by :class:`SwitchCosts`, the group's policy picking waiters with the orchestrator's
own code. It returns a :class:`CandidateResult`: per lease group its accelerators and busy accelerator-seconds per
second, per job its period against its period alone (the slowdown; mean and spread over the steady iterations).

Window: a candidate runs for :data:`HORIZON_PERIODS` of its longest alone period; the first
:data:`WARMUP_PERIODS` are left out of every figure.
"""

from __future__ import annotations

import enum
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from llmd_timeslice.placement import simulation as sim
from llmd_timeslice.placement.profile import ACCELERATOR_PHASES, ROLE_OF, JobProfile, PhaseKind

HORIZON_PERIODS = 12
"""A candidate's simulated time, in periods of its longest job alone."""
WARMUP_PERIODS = 2
"""Left out of every figure at the start, in the same unit."""
SAMPLERS: sim.Worker = ("", "samplers")
"""The idle holder of a group whose samplers serve between holders (SwitchCosts.served)."""


class Layout(enum.StrEnum):
    """How a candidate's jobs share accelerators (module docstring)."""

    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"
    ONE_LEASE = "one_lease"
    """Every job keeps its own accelerators (rollout and training on them) but all take turns under one lease: what
    naming one group for every job amounts to (the alternative ``naive``; never chosen by the search)."""


POLICIES = ("fifo", "priority", "round_robin")
"""The intra-group policies the planner chooses from (the orchestrator's waiter policies)."""


class SwitchCosts(BaseModel):
    """Seconds a lease group spends between holders, not busy.

    ``grant_s``: the control of one handover from a job to the next (release + grant). ``rollout_switch_s`` /
    ``train_switch_s``: putting a job's samplers (sleep and wake, verified) / its trainer's state (offload and
    restore, verified) aside and back, for a job whose profile does not give its own ``switch_s``; half is paid when
    the worker leaves the accelerators, half when it comes back. ``served``: each group also has samplers of its own
    that serve whenever nobody holds it (the orchestrator wakes them when a release finds nobody waiting, and puts
    them to sleep again before the next grant): ``wake_s`` and ``sleep_s`` are then paid on the group each time."""

    model_config = ConfigDict(extra="forbid")

    grant_s: float = Field(0.0, ge=0)
    rollout_switch_s: float = Field(0.0, ge=0)
    train_switch_s: float = Field(0.0, ge=0)
    served: bool = False
    sleep_s: float = Field(0.0, ge=0)
    wake_s: float = Field(0.0, ge=0)

    def job_switch_s(self, profile: JobProfile, kind: PhaseKind) -> float:
        """Seconds to put ``profile``'s worker of ``kind`` aside and back: its own where given, else these defaults."""
        if kind in profile.switch_s:
            return profile.switch_s[kind]
        return self.rollout_switch_s if kind is PhaseKind.ROLLOUT else self.train_switch_s


@dataclass(frozen=True)
class Candidate:
    """Jobs (ids, sorted), layout and policy."""

    jobs: tuple[str, ...]
    layout: Layout
    policy: str = sim.DEFAULT_POLICY


@dataclass(frozen=True)
class GroupOutcome:
    """One lease group of a candidate: its name suffix (``all``, ``rollout``, ``train``), accelerators, members
    (``(job, phase)``), busy accelerator-seconds per second of the window and duty cycle."""

    part: str
    accelerators: int
    members: tuple[tuple[str, PhaseKind], ...]
    busy_rate: float
    duty_cycle: float
    host_bytes: int


@dataclass(frozen=True)
class JobOutcome:
    """One job in a candidate: mean period and period alone (seconds), slowdown (mean period / mean period alone
    - 1) with the 5th and 95th percentiles of the per-iteration slowdowns, iterations counted, budget."""

    job_id: str
    period_s: float
    alone_period_s: float
    slowdown: float
    slowdown_p05: float
    slowdown_p95: float
    iterations: int
    slowdown_budget: float

    @property
    def within_budget(self) -> bool:
        return self.slowdown <= self.slowdown_budget + 1e-9


@dataclass
class CandidateResult:
    """A candidate's prediction (see the module docstring); ``trace`` and ``window_s`` kept for the timeline."""

    candidate: Candidate
    groups: list[GroupOutcome]
    jobs: dict[str, JobOutcome]
    window_s: tuple[float, float]
    trace: sim.Trace | None = field(default=None, repr=False)

    @property
    def busy_rate(self) -> float:
        """Useful accelerator-seconds per second, all its groups."""
        return sum(g.busy_rate for g in self.groups)

    @property
    def accelerators(self) -> int:
        return sum(g.accelerators for g in self.groups)

    @property
    def duty_cycle(self) -> float:
        return self.busy_rate / self.accelerators if self.accelerators else 0.0

    @property
    def feasible(self) -> bool:
        """Every job within its slowdown budget."""
        return all(j.within_budget for j in self.jobs.values())

    @property
    def worst_excess(self) -> float:
        """The largest slowdown beyond a budget (0 when every job is within)."""
        return max((max(0.0, j.slowdown - j.slowdown_budget) for j in self.jobs.values()), default=0.0)


def priorities_for(profiles: Sequence[JobProfile]) -> dict[str, int]:
    """The ``priority`` policy's order: a job's own priority where any is set; otherwise the tightest budget first,
    then the shortest period (higher number first)."""
    if any(p.priority for p in profiles):
        return {p.job_id: p.priority for p in profiles}
    order = sorted(profiles, key=lambda p: (p.slowdown_budget, p.alone_period_s, p.job_id))
    return {p.job_id: len(order) - i for i, p in enumerate(order)}


def group_parts(layout: Layout) -> dict[PhaseKind, str]:
    """Accelerator phase -> the lease group part it holds in ``layout``."""
    if layout is not Layout.DISAGGREGATED:
        return {PhaseKind.ROLLOUT: "all", PhaseKind.TRAIN: "all"}
    return {PhaseKind.ROLLOUT: "rollout", PhaseKind.TRAIN: "train"}


class Draws:
    """Each job's phase durations per iteration, drawn once from its samples (seeded by the job id) and reused by
    every candidate. ``of(job, i)`` -> seconds per phase kind."""

    def __init__(self, profiles: Sequence[JobProfile], seed: int = 0) -> None:
        self.profiles = {p.job_id: p for p in profiles}
        self.seed = seed
        self._draws: dict[str, np.ndarray] = {}

    def of(self, job: str, iteration: int) -> np.ndarray:
        arr = self._draws.get(job)
        if arr is None or iteration >= len(arr):
            arr = self._draw(job, max(64, 2 * (iteration + 1)))
        return arr[iteration]

    def _draw(self, job: str, n: int) -> np.ndarray:
        p = self.profiles[job]
        rng = np.random.default_rng([self.seed, zlib.crc32(job.encode())])
        cols = []
        for k in PhaseKind:
            xs = p.phase(k).samples_s or [0.0]
            cols.append(np.asarray(xs, dtype=float)[rng.integers(0, len(xs), n)] if len(xs) > 1 else np.full(n, xs[0]))
        self._draws[job] = arr = np.stack(cols, axis=1)
        return arr


KINDS = tuple(PhaseKind)


def evaluate(
    cand: Candidate,
    profiles: dict[str, JobProfile],
    draws: Draws,
    costs: SwitchCosts,
    keep_trace: bool = False,
) -> CandidateResult:
    """Simulate ``cand`` and return its :class:`CandidateResult` (see the module docstring).

    Raises:
        KeyError: a job of the candidate without a profile.
    """
    members = [profiles[j] for j in cand.jobs]
    parts = group_parts(cand.layout)
    prio = priorities_for(members) if cand.policy == "priority" else {}
    accel: dict[str, int] = {}
    host: dict[str, int] = {}
    workers: dict[str, set[tuple[str, PhaseKind]]] = {}
    for p in members:
        for k in ACCELERATOR_PHASES:
            part = parts[k]
            accel[part] = max(accel.get(part, 0), p.accelerators_of(k))
            host[part] = host.get(part, 0) + p.state_bytes_of(k)
            workers.setdefault(part, set()).add((p.job_id, k))
    if cand.layout is Layout.ONE_LEASE:  # each job brings its own accelerators
        accel = {"all": sum(max(p.accelerators_of(k) for k in ACCELERATOR_PHASES) for p in members)}
    idle = SAMPLERS if costs.served else None
    groups = [sim.GroupSim(part, accel[part], cand.policy, prio, idle) for part in accel]
    placement = {(p.job_id, ROLE_OF[k]): parts[k] for p in members for k in ACCELERATOR_PHASES}
    half = {(p.job_id, ROLE_OF[k]): costs.job_switch_s(p, k) / 2 for p in members for k in ACCELERATOR_PHASES}
    acc_of = {(p.job_id, ROLE_OF[k]): p.accelerators_of(k) for p in members for k in ACCELERATOR_PHASES}

    def switch(group: str, resident: sim.Worker | None, incoming: sim.Worker) -> tuple[float, str]:
        if incoming == SAMPLERS:
            return (half.get(resident, 0.0) if resident else 0.0) + costs.wake_s, "wake"
        out = half[incoming]
        if resident == SAMPLERS:
            return out + costs.sleep_s, "sleep"
        if resident is not None:
            out += half[resident] + costs.grant_s
        return out, "handover"

    def script(job: str, it: int) -> list[sim.Use | sim.Idle]:
        d = draws.of(job, it)
        return [
            sim.Use("sampler", float(d[0]), "rollout", acc_of[(job, "sampler")]),
            sim.Idle(float(d[1]), "cpu_gap"),
            sim.Use("trainer", float(d[2]), "train", acc_of[(job, "trainer")]),
            sim.Idle(float(d[3]), "weight_sync"),
        ]

    longest = max(p.alone_period_s for p in members)
    until = HORIZON_PERIODS * longest
    warm = WARMUP_PERIODS * longest
    trace = sim.simulate_schedule(list(cand.jobs), placement, groups, script, switch, until_s=until)
    window = (warm, until)
    outcomes = []
    for part, g in trace.groups.items():
        rate = sim.busy_accelerator_seconds(trace, warm, until, [part]) / (until - warm)
        # a group with one worker never puts it aside: nothing of it waits in host memory
        resident = host[part] if len(workers[part]) > 1 else 0
        outcomes.append(GroupOutcome(part, g.accelerators, tuple(sorted(workers[part])), rate, rate / g.accelerators, resident))
    jobs = {p.job_id: _job_outcome(p, trace.iteration_starts[p.job_id], draws, warm, until) for p in members}
    return CandidateResult(cand, outcomes, jobs, window, trace if keep_trace else None)


def _job_outcome(p: JobProfile, starts: list[float], draws: Draws, warm: float, until: float) -> JobOutcome:
    idx = [i for i in range(len(starts) - 1) if warm <= starts[i] < until]
    if not idx:  # a job slowed so much that no iteration started in the window: all of them
        idx = list(range(len(starts) - 1))
    periods = np.array([starts[i + 1] - starts[i] for i in idx])
    alone = np.array([float(draws.of(p.job_id, i).sum()) for i in idx])
    ratio = periods / np.maximum(alone, 1e-12) - 1
    slowdown = float(periods.sum() / max(alone.sum(), 1e-12) - 1)
    return JobOutcome(
        p.job_id,
        float(periods.mean()),
        float(alone.mean()),
        slowdown,
        float(np.percentile(ratio, 5)),
        float(np.percentile(ratio, 95)),
        len(idx),
        p.slowdown_budget,
    )


def load_bound(profiles: Sequence[JobProfile], layout: Layout, costs: SwitchCosts) -> float:
    """The share of its time the busiest lease group of a candidate would have to be held if every job kept its
    alone period (holds, plus one handover per hold): above 1, no schedule keeps every job at its alone period."""
    parts = group_parts(layout)
    demand: dict[str, float] = {}
    handover = max(costs.grant_s, costs.sleep_s + costs.wake_s if costs.served else 0.0)
    for p in profiles:
        period = p.alone_period_s
        if period <= 0:
            return math.inf
        for k in ACCELERATOR_PHASES:
            hold = p.mean_s(k) + costs.job_switch_s(p, k) + handover
            demand[parts[k]] = demand.get(parts[k], 0.0) + hold / period
    return max(demand.values(), default=0.0)
