"""How long one sidecar operation may take, and which of its steps runs now (issue 38 §2).

An operation has a deadline apart from each engine call's HTTP timeout (``--request-timeout-s`` of the backend):
a sleep has ``sleep_s``, a wake ``wake_s``, and each weight reload inside a wake its own ``reload_s`` on top
(docs/group-settings.md: ``sleep_deadline_s``, ``wake_deadline_s``, ``reload_deadline_s``). The orchestrator sends
the group's deadlines with each command (``OperationCommand.deadlines``, snapshot_ext.proto); a command without
them (the upstream unary calls) gets the sidecar's ``--operation-timeout-s`` for the sleep or the wake and the
default reload deadline (:func:`~llmd_timeslice.domain.group_settings.reload_deadline_for`).

The sidecar runs each operation inside ``asyncio.timeout`` and hands it to the backend as an :class:`OperationClock`
(a context variable, so backends keep their signatures): a backend names each step (:func:`note_step`) and brackets a
reload with :meth:`OperationClock.reloading`, which moves the operation's deadline out by the reload's own deadline
and back to what was left of the wake's when the reload ends. When the deadline passes, the operation fails with
:meth:`OperationClock.expired_reason`: the deadline that ran out (sleep, wake or reload), its length, and the step.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from llmd_timeslice.domain.group_settings import reload_deadline_for


@dataclass(frozen=True)
class OperationDeadlines:
    """Seconds each part may take (None: the sidecar's default). ``reload_s`` None: by the version's bytes."""

    sleep_s: float | None = None
    wake_s: float | None = None
    reload_s: float | None = None

    @classmethod
    def from_pb(cls, msg) -> OperationDeadlines:
        """From ``OperationDeadlines`` (snapshot_ext.proto; 0 or negative: unset)."""

        def pos(v: float) -> float | None:
            return v if v > 0 else None

        return cls(pos(msg.sleep_s), pos(msg.wake_s), pos(msg.reload_s))


class OperationClock:
    """The deadline of the operation running in this task and the step it is at.

    Args:
        kind: ``"sleep"`` or ``"wake"`` (the deadline the operation starts with).
        limit_s: that deadline, seconds.
        reload_s: the reload deadline (None: by the version's bytes, :func:`reload_deadline_for`).
        timeout: the operation's ``asyncio.timeout`` context (None: nothing to move, e.g. in a test).
    """

    def __init__(self, kind: str, limit_s: float, reload_s: float | None, timeout: asyncio.Timeout | None = None) -> None:
        self.kind, self.limit_s, self.reload_s = kind, limit_s, reload_s
        self.step = "start"
        self.running = kind  # the deadline counting now: "sleep", "wake" or "reload"
        self.running_limit_s = limit_s
        self._timeout = timeout

    def reload_limit_s(self, nbytes: int | None) -> float:
        """The reload deadline for a version of ``nbytes`` bytes (None: unknown)."""
        return reload_deadline_for(self.reload_s, nbytes)

    @contextlib.contextmanager
    def reloading(self, nbytes: int | None, step: str) -> Iterator[float]:
        """Inside: the reload's own deadline counts (``reload_limit_s(nbytes)`` from now; yields it); after: what was
        left of the wake's deadline when the reload began."""
        limit = self.reload_limit_s(nbytes)
        loop = asyncio.get_running_loop()
        left = None
        if self._timeout is not None and (when := self._timeout.when()) is not None:
            left = max(0.0, when - loop.time())
            self._timeout.reschedule(loop.time() + limit)
        outer = self.running, self.running_limit_s
        self.running, self.running_limit_s, self.step = "reload", limit, step
        try:
            yield limit
        finally:
            if not self._expired():  # the reload ended inside its deadline: the wake's counts again
                self.running, self.running_limit_s = outer
                if self._timeout is not None and left is not None:
                    self._timeout.reschedule(loop.time() + left)

    def _expired(self) -> bool:
        return self._timeout is not None and self._timeout.expired()

    def expired_reason(self, what: str) -> str:
        """The failure of an operation whose deadline passed: which deadline, how long, the step it was at."""
        reason = (
            f"{what} ran out of its {self.running} deadline ({self.running_limit_s:g} s) at step {self.step}; "
            "the engine is left out of service"
        )
        if self.running == "reload":
            reason += (
                ": the reload goes on inside the engine, and the next restore waits for it instead of starting "
                "another (raise the group's reload_deadline_s for weights this large, docs/group-settings.md)"
            )
        else:
            reason += f": check its logs (raise the group's {self.running}_deadline_s if the engine is just slow)"
        return reason


CURRENT: contextvars.ContextVar[OperationClock | None] = contextvars.ContextVar("llmd_timeslice_operation", default=None)
"""The clock of the operation this task runs (None outside an operation)."""


def note_step(step: str) -> None:
    """Record the step the running operation is at (no-op outside an operation)."""
    clock = CURRENT.get()
    if clock is not None:
        clock.step = step


def current() -> OperationClock:
    """The running operation's clock, or one with the defaults (no deadline to move) outside an operation."""
    return CURRENT.get() or OperationClock("wake", float("inf"), None)


@contextlib.asynccontextmanager
async def operation_clock(kind: str, limit_s: float, reload_s: float | None) -> AsyncIterator[OperationClock]:
    """Run the body under ``limit_s`` seconds (``asyncio.timeout``; TimeoutError when it passes) with its
    :class:`OperationClock` set for the backends it calls."""
    async with asyncio.timeout(limit_s) as timeout:
        clock = OperationClock(kind, limit_s, reload_s, timeout)
        token = CURRENT.set(clock)
        try:
            yield clock
        finally:
            CURRENT.reset(token)
