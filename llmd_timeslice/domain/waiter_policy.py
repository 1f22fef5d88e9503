"""Waiter policies: which of a group's waiting jobs is granted next, chosen by name (the group's
``scheduling_policy`` setting: ``fifo`` | ``priority`` | ``round_robin``, the values of
:class:`~llmd_timeslice.domain.group_settings.SchedulingPolicy`) through :data:`WAITER_POLICIES`
(:mod:`llmd_timeslice.plugins`). Used by the orchestrator's groups and by the placement planner's simulation
(:mod:`llmd_timeslice.placement.simulation`), so a predicted schedule picks waiters with the same code."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import ClassVar, Protocol, TypeVar

from llmd_timeslice.plugins import Registry


class Waiting(Protocol):
    """A job waiting for a group (what a policy reads of it)."""

    @property
    def job_id(self) -> str: ...


W = TypeVar("W", bound=Waiting)


class WaiterPolicy(abc.ABC):
    """Picks the next waiter. Stateless: what it weighs comes with each call."""

    name: ClassVar[str]

    @abc.abstractmethod
    def pick(self, waiters: Sequence[W], *, priorities: Mapping[str, int], last_granted: Mapping[str, int]) -> W:
        """One of ``waiters`` (in arrival order, not empty). ``priorities``: job -> priority (the group's
        ``job_priorities``; absent: 0); ``last_granted``: job -> number of its last grant (absent: never)."""


class Fifo(WaiterPolicy):
    """The first to arrive."""

    name = "fifo"

    def pick(self, waiters, *, priorities, last_granted):
        return waiters[0]


class Priority(WaiterPolicy):
    """The highest priority; the first to arrive among equals."""

    name = "priority"

    def pick(self, waiters, *, priorities, last_granted):
        return max(waiters, key=lambda w: priorities.get(w.job_id, 0))  # max() keeps the first among equals


class RoundRobin(WaiterPolicy):
    """The job granted least recently (never granted first); the first to arrive among equals (phase-level
    multiplexing of several RL jobs)."""

    name = "round_robin"

    def pick(self, waiters, *, priorities, last_granted):
        return min(waiters, key=lambda w: last_granted.get(w.job_id, 0))


WAITER_POLICIES: Registry[WaiterPolicy] = Registry("waiter policy")
for _cls in (Fifo, Priority, RoundRobin):
    WAITER_POLICIES.register(_cls.name, _cls)

_INSTANCES: dict[str, WaiterPolicy] = {}


def waiter_policy(name: str) -> WaiterPolicy:
    """The policy registered as ``name`` (one shared instance each). Raises
    :class:`~llmd_timeslice.plugins.UnknownPlugin`."""
    p = _INSTANCES.get(name)
    if p is None:
        p = _INSTANCES[name] = WAITER_POLICIES.create(name)
    return p
