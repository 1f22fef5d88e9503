"""The messages of a group's actor: :class:`Command` (one message to the group's task, with the future its sender
waits on), and what the actor and its parts share about them: the logger of a group's lines and how a reply
future fails.

The actor is :class:`~llmd_timeslice.orchestrator.group.Group`; its parts (the phase switch, the repair path,
discovery's updates) post commands back to it, so they import this module, never the actor's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from llmd_timeslice.domain.group_settings import GroupSpec
from llmd_timeslice.domain.switches import EngineReading, SwitchRecord
from llmd_timeslice.orchestrator.lease import Waiter
from llmd_timeslice.orchestrator.phases import GroupCommand
from llmd_timeslice.orchestrator.yield_requests import YieldAsk
from llmd_timeslice.weights.update import WeightUpdate

__all__ = ["GROUP_LOGGER", "NO_REPLY", "Command", "fail"]

GROUP_LOGGER = "llmd_timeslice.orchestrator.group"
"""The logger of every line about one group, whichever of its modules writes it (the actor or a part), so one
logger name selects a group's story."""

NO_REPLY: Any = object()
"""A handler's result meaning "the reply is given later" (by a grant, or when a switch ends)."""


@dataclass(eq=False)
class Command:
    """One message to a group's task. ``reply`` (if any) gets the result or the typed error."""

    kind: GroupCommand
    job_id: str = ""
    token: int | None = None
    waiter: Waiter | None = None
    weights: WeightUpdate | None = None
    spec: GroupSpec | None = None
    record: SwitchRecord | None = None
    error: BaseException | None = None
    readings: dict[str, EngineReading] | None = None
    reconcile: bool = False
    epoch: int = 0
    ask: YieldAsk | None = None
    reply: asyncio.Future[Any] | None = None


def fail(fut: asyncio.Future[Any] | None, exc: BaseException) -> None:
    """Fail ``fut`` with ``exc`` unless it is done; the exception counts as retrieved (nobody may wait any more)."""
    if fut is not None and not fut.done():
        fut.set_exception(exc)
        fut.exception()  # retrieved: no "never retrieved" warning
