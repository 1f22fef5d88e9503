"""Discrete-event simulation (simpy) of RL jobs taking turns on lease groups: the core of the duty-cycle model of
``benchmarks/rl_model/`` and of the placement planner's predictions (no I/O).

The model
    A *job* repeats iterations; each iteration is a list of steps (:data:`Script`): a :class:`Use` holds one lease
    group for ``seconds`` of useful work (a rollout on the samplers' accelerators, a training step), an
    :class:`Idle` keeps the job off every accelerator (reward on CPU, weight sync). A job's *workers* are its roles
    (``sampler``, ``trainer``): ``placement`` maps each worker to the group it holds for its phases.

    A group (:class:`GroupSim`) has one holder at a time, like the orchestrator's lease. A release hands the group
    to the next waiter, picked by the group's waiter policy (the orchestrator's own code,
    :mod:`llmd_timeslice.domain.waiter_policy`: ``fifo``, ``priority``, ``round_robin``). Before a worker's phase
    starts, the group pays a handover when its *resident* (the worker whose state is on the accelerators) is another
    one: ``switch(group, resident, incoming)`` seconds, not busy. A group with an ``idle_holder`` (served samplers)
    hands itself to that pseudo-worker when a release finds nobody waiting, as the orchestrator wakes the samplers
    then: the wake occupies the group, and the next acquire pays for putting them aside again.

What it returns
    A :class:`Trace`: per group the busy intervals (``(start_s, end_s, kind, job, accelerators)``: a phase's own
    accelerators, which may be fewer than the group's) and the handovers; per job the start of each iteration and
    each :class:`UseRecord` (asked, started, ended). :func:`busy_accelerator_seconds` and :func:`duty_cycle` count
    over a window (docs/benchmarks.md's definition: useful accelerator-seconds / (accelerators provisioned x wall
    time)).

Errors: ``ValueError`` for a worker without a group, a group named twice, an unknown waiter policy (from the
registry: :class:`~llmd_timeslice.plugins.UnknownPlugin`) or negative durations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy

from llmd_timeslice.domain.group_settings import GroupSettings
from llmd_timeslice.domain.waiter_policy import waiter_policy

DEFAULT_POLICY = str(GroupSettings.model_fields["policy"].default)
"""A group's waiter policy unless said otherwise: the group settings' default."""

Worker = tuple[str, str]
"""``(job_id, role)``: the part of a job that holds a group for some of its phases (``sampler``, ``trainer``)."""


@dataclass(frozen=True)
class Use:
    """A phase on accelerators: the ``role``'s group held for ``seconds`` of useful work on ``accelerators`` of it
    (0: the whole group)."""

    role: str
    seconds: float
    kind: str
    accelerators: int = 0


@dataclass(frozen=True)
class Idle:
    """A phase off every accelerator (``kind``: ``cpu_gap``, ``weight_sync``), ``seconds`` long."""

    seconds: float
    kind: str


Script = Callable[[str, int], Sequence[Use | Idle]]
"""``(job_id, iteration) -> steps``: one iteration of a job (durations may differ from one iteration to the next)."""

SwitchCost = Callable[[str, Worker | None, Worker], tuple[float, Any]]
"""``(group, resident or None, incoming) -> (seconds, detail)``: the handover a group pays before ``incoming`` works
on it (``detail`` is kept in the trace, e.g. the cost's components)."""


@dataclass(frozen=True)
class GroupSim:
    """One lease group: its name, accelerators, waiter policy (a registered name), priorities (job -> priority, for
    ``priority``) and ``idle_holder``: the pseudo-worker that takes the group when a release finds nobody waiting
    (the group's served samplers, woken; None: the last holder stays resident until the next one arrives)."""

    name: str
    accelerators: int
    policy: str = DEFAULT_POLICY
    priorities: Mapping[str, int] = field(default_factory=dict)
    idle_holder: Worker | None = None


@dataclass(frozen=True)
class UseRecord:
    """One :class:`Use` as it ran: its iteration, role, kind, when it was asked for, started (after the wait and
    the handover) and ended, seconds from the simulation's start."""

    iteration: int
    role: str
    kind: str
    asked_s: float
    start_s: float
    end_s: float


@dataclass
class GroupTrace:
    """What one group did: busy intervals ``(start_s, end_s, kind, job, accelerators)`` and handovers
    ``(start_s, end_s, detail, incoming_role)``."""

    name: str
    accelerators: int
    busy: list[tuple[float, float, str, str, int]] = field(default_factory=list)
    switches: list[tuple[float, float, Any, str]] = field(default_factory=list)


@dataclass
class Trace:
    """A finished simulation: per group its :class:`GroupTrace`; per job the start of each iteration (and the end of
    the last one, as its final entry) and its :class:`UseRecord` list; ``end_s`` the time the last job finished."""

    groups: dict[str, GroupTrace]
    iteration_starts: dict[str, list[float]]
    uses: dict[str, list[UseRecord]]
    end_s: float


@dataclass
class _Waiter:
    job_id: str
    worker: Worker
    event: simpy.Event


class _Lease:
    """One group's holder, resident and waiters (the orchestrator's lease, as a simpy resource)."""

    def __init__(self, env: simpy.Environment, spec: GroupSim, switch: SwitchCost, trace: GroupTrace) -> None:
        self.env, self.spec, self.switch, self.trace = env, spec, switch, trace
        self.policy = waiter_policy(spec.policy)
        self.held = False
        self.resident: Worker | None = spec.idle_holder
        self.waiters: list[_Waiter] = []
        self.last_granted: dict[str, int] = {}
        self.grants = 0

    def request(self, worker: Worker) -> simpy.Event:
        ev = self.env.event()
        w = _Waiter(worker[0], worker, ev)
        if self.held:
            self.waiters.append(w)
        else:
            self._grant(w)
        return ev

    def _grant(self, w: _Waiter) -> None:
        self.held = True
        self.grants += 1
        self.last_granted[w.job_id] = self.grants
        w.event.succeed()

    def handover(self, incoming: Worker):
        """Pay the handover to ``incoming`` if another worker is resident (a simpy process step)."""
        if self.resident != incoming:
            seconds, detail = self.switch(self.spec.name, self.resident, incoming)
            if seconds < 0:
                raise ValueError(f"group {self.spec.name}: negative switch cost {seconds}")
            self.trace.switches.append((self.env.now, self.env.now + seconds, detail, incoming[1]))
            if seconds > 0:
                yield self.env.timeout(seconds)
            self.resident = incoming

    def release(self) -> None:
        self.held = False
        if self.waiters:
            self._grant(self._pick())
        elif self.spec.idle_holder is not None and self.resident != self.spec.idle_holder:
            self.held = True
            self.env.process(self._to_idle_holder())

    def _pick(self) -> _Waiter:
        w = self.policy.pick(self.waiters, priorities=self.spec.priorities, last_granted=self.last_granted)
        self.waiters.remove(w)
        return w

    def _to_idle_holder(self):
        assert self.spec.idle_holder is not None
        yield from self.handover(self.spec.idle_holder)
        self.held = False
        if self.waiters:
            self._grant(self._pick())


def simulate_schedule(
    jobs: Sequence[str],
    placement: Mapping[Worker, str],
    groups: Sequence[GroupSim],
    script: Script,
    switch: SwitchCost,
    iterations: int | Mapping[str, int] | None = None,
    until_s: float | None = None,
) -> Trace:
    """Run ``jobs`` (each started at time 0) on ``groups`` until each finished its iterations.

    Args:
        jobs: the job ids.
        placement: worker -> the name of the group it holds.
        groups: every group (names unique).
        script: each iteration's steps (:data:`Script`).
        switch: the handover cost (:data:`SwitchCost`).
        iterations: iterations per job (one number for all, or per job); None: until ``until_s``.
        until_s: with ``iterations`` None, a job starts no iteration at or after this time (seconds).

    Raises:
        ValueError: a group named twice, a worker of a script without a group, neither bound given, a negative
            duration.
    """
    if iterations is None and until_s is None:
        raise ValueError("simulate_schedule needs iterations or until_s")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"group named twice: {sorted({n for n in names if names.count(n) > 1})}")
    env = simpy.Environment()
    traces = {g.name: GroupTrace(g.name, g.accelerators) for g in groups}
    leases = {g.name: _Lease(env, g, switch, traces[g.name]) for g in groups}
    starts: dict[str, list[float]] = {j: [] for j in jobs}
    uses: dict[str, list[UseRecord]] = {j: [] for j in jobs}

    def n_iterations(job: str) -> int | None:
        if iterations is None:
            return None
        return iterations if isinstance(iterations, int) else iterations[job]

    def use(job: str, it: int, step: Use):
        worker = (job, step.role)
        if worker not in placement:
            raise ValueError(f"worker {worker} has no group in the placement")
        lease = leases[placement[worker]]
        asked = env.now
        yield lease.request(worker)
        yield from lease.handover(worker)
        start = env.now
        yield env.timeout(step.seconds)
        lease.trace.busy.append((start, env.now, step.kind, job, step.accelerators or lease.spec.accelerators))
        uses[job].append(UseRecord(it, step.role, step.kind, asked, start, env.now))
        lease.release()

    def run(job: str):
        bound = n_iterations(job)
        it = 0
        while (bound is not None and it < bound) or (bound is None and until_s is not None and env.now < until_s):
            starts[job].append(env.now)
            for step in script(job, it):
                if step.seconds < 0:
                    raise ValueError(f"job {job} iteration {it}: negative {step.kind} duration {step.seconds}")
                if isinstance(step, Use):
                    yield from use(job, it, step)
                elif step.seconds > 0:
                    yield env.timeout(step.seconds)
            it += 1
        starts[job].append(env.now)

    for j in jobs:
        env.process(run(j))
    env.run()
    return Trace(traces, starts, uses, env.now)


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    """Length of the overlap of ``[a0, a1]`` and ``[b0, b1]`` (0 when disjoint)."""
    return max(0.0, min(a1, b1) - max(a0, b0))


def busy_accelerator_seconds(trace: Trace, start_s: float, end_s: float, groups: Sequence[str] | None = None) -> float:
    """Accelerator-seconds of useful work inside ``[start_s, end_s]`` (each busy interval times its phase's
    accelerators), over ``groups`` (None: all)."""
    names = trace.groups if groups is None else groups
    return sum(acc * overlap(s, e, start_s, end_s) for n in names for s, e, _, _, acc in trace.groups[n].busy)


def duty_cycle(trace: Trace, start_s: float, end_s: float, groups: Sequence[str] | None = None) -> float:
    """Useful accelerator-seconds / (the groups' accelerators x ``end_s - start_s``), over ``groups`` (None: all).

    Raises:
        ValueError: an empty window or no accelerators.
    """
    names = list(trace.groups if groups is None else groups)
    provisioned = sum(trace.groups[n].accelerators for n in names)
    if end_s <= start_s or provisioned <= 0:
        raise ValueError(f"duty cycle over an empty window [{start_s}, {end_s}] or no accelerators ({provisioned})")
    return busy_accelerator_seconds(trace, start_s, end_s, names) / (provisioned * (end_s - start_s))
