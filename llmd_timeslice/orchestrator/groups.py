"""Core of the orchestrator: accelerator groups, FIFO locks and the phase-switch sequence.

A group's accelerators belong to its *samplers* (vLLM servers behind the gate) unless a job
(typically a trainer) holds the group's lock. ``acquire`` queues the job FIFO; when it reaches
the head, the group switches: samplers drain (gate barrier), sleep (sidecars, verified), then
the lock is granted. ``yield_`` returns at once; the next waiter is granted directly, or, when
nobody waits, the samplers are woken and published SERVING again. For a group without samplers a
yield with nobody waiting defers the snapshot: the job's context stays loaded (``IDLE_YIELDED``)
and its next ``acquire`` returns at once (the upstream semantics).

The outside world (gate, sidecars) is reached only through :class:`SwitchActions`, so this module
does no I/O and is unit-tested with in-memory actions.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

SAMPLERS = "<samplers>"
"""``loaded_job`` value meaning the group's samplers hold the accelerators."""


class GroupState(enum.Enum):
    """Group states, in the llm-d orchestrator's vocabulary."""

    IDLE = "IDLE"
    IDLE_YIELDED = "IDLE_YIELDED"
    LOCKED = "LOCKED"
    SWITCHING = "SWITCHING"


class OrchestratorError(Exception):
    """Base of typed errors; the gRPC edge maps each subclass to one status code."""


class UnknownGroup(OrchestratorError):
    """The group id is not in the inventory (NOT_FOUND)."""


class InvalidArgument(OrchestratorError):
    """A request field is missing or malformed (INVALID_ARGUMENT)."""


class NotHolder(OrchestratorError):
    """The job yields a group it does not hold, or acquires one it already holds (FAILED_PRECONDITION)."""


class AcquireTimedOut(OrchestratorError):
    """The caller's deadline passed while it waited in the queue (DEADLINE_EXCEEDED)."""


class SwitchFailed(OrchestratorError):
    """A phase switch step failed; the message says which and what state the group is in (UNAVAILABLE)."""


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


@dataclass
class GroupSpec:
    """Inventory of one group (durations in seconds)."""

    group_id: str
    samplers: list[SamplerEndpoint] = field(default_factory=list)
    sleep_level: int = 1
    drain_timeout_s: float = 60.0


@dataclass
class SwitchRecord:
    """One phase switch, for status and metrics: ``phases`` maps step name -> seconds."""

    group_id: str
    kind: str  # "to_job" (samplers -> job), "to_samplers", "job_to_job"
    job_id: str
    started_at: float
    phases: dict[str, float] = field(default_factory=dict)
    ok: bool = True
    error: str = ""


class SwitchActions(Protocol):
    """What a phase switch does to the outside world (implemented over gRPC in ``actions.py``)."""

    async def suspend_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:
        """Drain (gate barrier), sleep and verify every sampler; raise on failure."""

    async def resume_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:
        """Wake and verify every sampler, then publish it SERVING; raise on failure."""


@dataclass(eq=False)
class _Waiter:
    job_id: str
    enqueued_at: float
    future: asyncio.Future


@dataclass
class AcquireResult:
    """``waited_ms``: milliseconds from the call to the grant."""

    waited_ms: int
    context_restored: bool


@dataclass
class YieldResult:
    pending_waiters: int
    snapshot_deferred: bool


class Group:
    """Runtime state of one group."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self.state = GroupState.IDLE
        self.state_since = time.time()
        self.holder: str | None = None
        self.loaded_job: str | None = SAMPLERS if spec.samplers else None
        self.waiters: deque[_Waiter] = deque()
        self.history: deque[SwitchRecord] = deque(maxlen=50)
        self.sampler_states: dict[str, str] = {s.address: "RUNNING" for s in spec.samplers}
        self.last_error = ""
        self._driver: asyncio.Task | None = None

    def set_state(self, state: GroupState) -> None:
        if state is not self.state:
            self.state = state
            self.state_since = time.time()


class Orchestrator:
    """FIFO locks and phase switches over a set of groups."""

    def __init__(self, specs: Iterable[GroupSpec], actions: SwitchActions,
                 on_switch: Callable[[SwitchRecord], None] | None = None) -> None:
        self.groups: dict[str, Group] = {s.group_id: Group(s) for s in specs}
        self._actions = actions
        self._on_switch = on_switch
        self._closing = False

    def _record(self, g: Group, record: SwitchRecord) -> None:
        g.history.append(record)
        if self._on_switch is not None:
            self._on_switch(record)

    def group(self, group_id: str) -> Group:
        """Raises :class:`UnknownGroup` with the known ids."""
        if not group_id:
            raise InvalidArgument("group_id is required")
        try:
            return self.groups[group_id]
        except KeyError:
            raise UnknownGroup(f"unknown group {group_id!r}; known groups: {sorted(self.groups)}") from None

    async def acquire(self, job_id: str, group_id: str, timeout_s: float | None = None) -> AcquireResult:
        """Block until ``job_id`` holds ``group_id`` (FIFO), or raise.

        Raises:
            InvalidArgument, UnknownGroup, NotHolder (already holds it), AcquireTimedOut,
            SwitchFailed (the switch to this job failed; the samplers were woken again).
        """
        if not job_id:
            raise InvalidArgument("job_id is required")
        if timeout_s is not None and timeout_s < 0:
            raise InvalidArgument(f"timeout must be >= 0 seconds, got {timeout_s}")
        g = self.group(group_id)
        if g.holder == job_id:
            raise NotHolder(f"job {job_id!r} already holds group {group_id!r}; yield before acquiring again")
        if any(w.job_id == job_id for w in g.waiters):
            raise NotHolder(f"job {job_id!r} is already waiting for group {group_id!r}")
        t0 = time.monotonic()
        # Deferred snapshot: the same job's context is still loaded and nobody else is queued.
        if g.state is GroupState.IDLE_YIELDED and g.loaded_job == job_id and not g.waiters:
            g.holder = job_id
            g.set_state(GroupState.LOCKED)
            return AcquireResult(0, False)
        waiter = _Waiter(job_id, t0, asyncio.get_running_loop().create_future())
        g.waiters.append(waiter)
        self._drive(g)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                return AcquireResult(int((time.monotonic() - t0) * 1000), False)
            self._abandon(g, waiter)
            raise AcquireTimedOut(
                f"job {job_id!r} waited {timeout_s:g} s for group {group_id!r} (holder {g.holder!r}, "
                f"{len(g.waiters)} waiting)"
            ) from None
        except asyncio.CancelledError:
            self._abandon(g, waiter)
            raise
        return AcquireResult(int((time.monotonic() - t0) * 1000), waiter.future.result())

    def _abandon(self, g: Group, waiter: _Waiter) -> None:
        try:
            g.waiters.remove(waiter)
        except ValueError:
            pass
        if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            # Granted as the caller gave up: release at once so the group does not stay locked.
            if g.holder == waiter.job_id:
                self._release(g, waiter.job_id)
        elif not waiter.future.done():
            waiter.future.cancel()

    def yield_(self, job_id: str, group_id: str) -> YieldResult:
        """Give the group up; returns at once (the switch back runs in the background).

        Raises:
            InvalidArgument, UnknownGroup, NotHolder (the job does not hold the group).
        """
        if not job_id:
            raise InvalidArgument("job_id is required")
        g = self.group(group_id)
        if g.holder != job_id:
            raise NotHolder(f"job {job_id!r} does not hold group {group_id!r} (holder: {g.holder!r})")
        return self._release(g, job_id)

    def _release(self, g: Group, job_id: str) -> YieldResult:
        g.holder = None
        pending = sum(1 for w in g.waiters if not w.future.done())
        deferred = not g.spec.samplers and pending == 0
        if deferred:
            g.loaded_job = job_id
            g.set_state(GroupState.IDLE_YIELDED)
        else:
            g.set_state(GroupState.SWITCHING if (pending or g.spec.samplers) else GroupState.IDLE)
            self._drive(g)
        return YieldResult(pending, deferred)

    # ------------------------------------------------------------------ driver
    def _drive(self, g: Group) -> None:
        if g._driver is None or g._driver.done():
            g._driver = asyncio.get_running_loop().create_task(self._run_group(g), name=f"group-{g.spec.group_id}")

    async def _run_group(self, g: Group) -> None:
        """Serialises every switch of one group: grants waiters FIFO, else hands back to samplers."""
        while g.holder is None and not self._closing:
            while g.waiters and g.waiters[0].future.done():
                g.waiters.popleft()  # abandoned
            if g.waiters:
                waiter = g.waiters[0]
                if g.loaded_job == SAMPLERS:
                    record = SwitchRecord(g.spec.group_id, "to_job", waiter.job_id, time.time())
                    g.set_state(GroupState.SWITCHING)
                    try:
                        await self._actions.suspend_samplers(g.spec, record)
                    except Exception as exc:
                        record.ok, record.error = False, str(exc)
                        self._record(g, record)
                        g.last_error = f"switch to job {waiter.job_id!r} failed: {exc}"
                        log.error("group=%s %s", g.spec.group_id, g.last_error)
                        g.waiters.popleft()
                        if not waiter.future.done():
                            waiter.future.set_exception(SwitchFailed(g.last_error + "; samplers are being woken again"))
                        await self._resume(g, waiter.job_id)
                        continue
                    self._record(g, record)
                    g.loaded_job = None  # samplers asleep, nobody loaded yet
                g.waiters.popleft()
                if waiter.future.done():
                    continue  # gave up during the switch; the next waiter (or the samplers) get it
                g.loaded_job = waiter.job_id
                g.holder = waiter.job_id
                g.set_state(GroupState.LOCKED)
                waiter.future.set_result(False)  # trainer state is restored by the client
                return
            # Nobody waits: the accelerators go back to the samplers.
            if g.spec.samplers and g.loaded_job != SAMPLERS:
                await self._resume(g, g.loaded_job or "")
            if g.holder is None and not g.waiters:
                g.set_state(GroupState.IDLE)
                return

    async def _resume(self, g: Group, after_job: str) -> None:
        record = SwitchRecord(g.spec.group_id, "to_samplers", after_job, time.time())
        g.set_state(GroupState.SWITCHING)
        try:
            await self._actions.resume_samplers(g.spec, record)
            g.loaded_job = SAMPLERS
        except Exception as exc:
            record.ok, record.error = False, str(exc)
            g.last_error = f"waking the samplers failed: {exc}; they stay out of service"
            log.error("group=%s %s", g.spec.group_id, g.last_error)
            g.loaded_job = None
        self._record(g, record)

    async def close(self) -> None:
        """Stop drivers; pending acquires fail with SwitchFailed."""
        self._closing = True
        for g in self.groups.values():
            for w in g.waiters:
                if not w.future.done():
                    w.future.set_exception(SwitchFailed("orchestrator is shutting down"))
            if g._driver is not None:
                g._driver.cancel()
