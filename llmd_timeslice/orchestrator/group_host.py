"""The group's actor as its procedures see it: :class:`GroupHost`.

The procedures of a group (:mod:`~llmd_timeslice.orchestrator.phase_switch`, :mod:`~llmd_timeslice.orchestrator.
repair`, :mod:`~llmd_timeslice.orchestrator.spec_updates`) run on the actor's task, called from its handler table;
they read and change the group's parts and move its phase only through this protocol, whose one implementation is
:class:`~llmd_timeslice.orchestrator.group.Group`. Declaring it here keeps the imports one way: the actor imports
its procedures, never the reverse.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

from llmd_timeslice.domain.group_settings import GroupSpec
from llmd_timeslice.domain.switches import SwitchRecord
from llmd_timeslice.orchestrator.clock import Clock
from llmd_timeslice.orchestrator.commands import Command
from llmd_timeslice.orchestrator.lease import Waiter
from llmd_timeslice.orchestrator.lease_queue import LeaseQueue
from llmd_timeslice.orchestrator.phases import GroupCommand, GroupPhase
from llmd_timeslice.orchestrator.sampler_fleet import SamplerFleet
from llmd_timeslice.orchestrator.switch import SwitchActions
from llmd_timeslice.orchestrator.weight_ledger import WeightLedger

__all__ = ["GroupHost"]


class GroupHost(Protocol):
    """One group's actor: its settings, phase and parts, and the moves only the actor makes."""

    spec: GroupSpec
    phase: GroupPhase
    last_error: str
    """One line about the group's last failure ("" when none), shown in status."""
    leases: LeaseQueue
    ledger: WeightLedger
    fleet: SamplerFleet

    @property
    def group_id(self) -> str: ...

    @property
    def epoch(self) -> int:
        """Increases with every change of phase: a step's outcome from an older epoch is stale."""
        ...

    @property
    def clock(self) -> Clock: ...

    @property
    def actions(self) -> SwitchActions:
        """What a switch does outside (drain, sleep, wake, engine reads)."""
        ...

    def enter(self, to: GroupPhase, kind: GroupCommand) -> None:
        """Move to phase ``to`` because of command ``kind`` (checked against the table; staying put included)."""

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run a step of the group as a task the group keeps (cancelled by a recovery or shutdown)."""

    def post(self, cmd: Command) -> None:
        """Queue ``cmd`` for the actor (a step's outcome)."""

    def record(self, rec: SwitchRecord) -> None:
        """Keep a finished switch (history, metrics)."""

    def mark_dirty(self) -> None:
        """The persisted record changed: saved after the command."""

    def next_waiter(self) -> Waiter:
        """The waiter the group's policy grants next (one is queued)."""

    async def grant(self, w: Waiter, kind: GroupCommand) -> None:
        """Give the lease to ``w`` because of ``kind`` (saved before ``w`` learns of it)."""
