"""The orchestrator: leases and phase switches over a set of accelerator groups, one actor each
(:class:`~llmd_timeslice.orchestrator.group.Group`). Its calls (:meth:`Orchestrator.acquire`, ``yield_``,
``publish_weights``, ``heartbeat``, ``request_yield``, ``update_spec``) check their arguments and post a command to the
group's actor; the group's parts live in their own modules: :mod:`~llmd_timeslice.orchestrator.group` (the actor,
with the table of its parts), :mod:`~llmd_timeslice.orchestrator.lease_queue`, :mod:`~llmd_timeslice.orchestrator.
weight_ledger`, :mod:`~llmd_timeslice.orchestrator.sampler_fleet`, :mod:`~llmd_timeslice.orchestrator.yield_desk`,
:mod:`~llmd_timeslice.orchestrator.phase_switch`, :mod:`~llmd_timeslice.orchestrator.repair`,
:mod:`~llmd_timeslice.orchestrator.spec_updates`, :mod:`~llmd_timeslice.orchestrator.phases` (the table).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from llmd_timeslice.domain.group_settings import GroupSpec
from llmd_timeslice.domain.switches import EngineReading, SwitchRecord
from llmd_timeslice.orchestrator.clock import Clock, LoopClock, TimerHandle
from llmd_timeslice.orchestrator.commands import Command
from llmd_timeslice.orchestrator.errors import AcquireTimedOut, InvalidArgument, NotHolder, UnknownGroup
from llmd_timeslice.orchestrator.group import SAMPLERS, Group, RestoreOutcome
from llmd_timeslice.orchestrator.lease import AcquireResult, Lease, Waiter, YieldResult
from llmd_timeslice.orchestrator.phases import GroupCommand, GroupPhase
from llmd_timeslice.orchestrator.sampler_fleet import judge_engines
from llmd_timeslice.orchestrator.switch import SwitchActions
from llmd_timeslice.orchestrator.weight_ledger import RejectedWeights
from llmd_timeslice.orchestrator.yield_requests import HoldPressure, YieldAnswer, YieldAsk, YieldRequest, check_ask
from llmd_timeslice.weights.update import WeightUpdate

__all__ = [
    "SAMPLERS",
    "AcquireResult",
    "Command",
    "Group",
    "Lease",
    "Orchestrator",
    "RejectedWeights",
    "RestoreOutcome",
    "YieldAnswer",
    "YieldAsk",
    "YieldRequest",
    "YieldResult",
]

log = logging.getLogger(__name__)

C = GroupCommand

_Waiter = Waiter  # the name tests used before the lease records had their own module


class Orchestrator:
    """Leases and phase switches over a set of groups (one :class:`Group` task each).

    Args:
        specs: the groups.
        actions: what a switch does outside (:class:`~llmd_timeslice.orchestrator.switch.SwitchActions`).
        on_switch: called with every finished :class:`SwitchRecord` (metrics).
        clock: time for leases, repair and audit (default: the event loop's).
    """

    def __init__(
        self,
        specs: Iterable[GroupSpec],
        actions: SwitchActions,
        on_switch: Callable[[SwitchRecord], None] | None = None,
        clock: Clock | None = None,
    ) -> None:
        if not isinstance(actions, SwitchActions):
            raise TypeError(f"actions must be a SwitchActions subclass, got {type(actions).__name__}")
        self.clock: Clock = clock or LoopClock()
        self.actions = actions
        self.groups: dict[str, Group] = {}
        for s in specs:
            self.groups[s.group_id] = Group(s, self)
        self._on_switch = on_switch
        self.on_transition: Callable[[Group, GroupPhase, GroupCommand, GroupPhase], None] | None = None
        self.on_weights_final: Callable[[str, bool], None] | None = None
        """Called with (pool, whether no newer weight version can come for it) after each command of a group serving
        that pool (the gate hub sends the changes: issue 38 §5)."""
        """Called with (group, from, command, to) for every move, staying put included (tests, tracing)."""
        self.persister: Any = None  # a StatePersister (persistence.py) once the server wires one
        self.repair_first_s = 2.0
        self.repair_max_s = 60.0
        self.audit_interval_s = 0.0
        self._audit_timer: TimerHandle | None = None
        self.lease_events: Any = None
        """A :class:`~llmd_timeslice.orchestrator.placement_watch.PlacementWatch` once the server wires one: told of
        every acquire, grant, release, abandon and switch (the jobs' phase profiles)."""

    def record(self, g: Group, record: SwitchRecord) -> None:
        g.history.append(record)
        if self._on_switch is not None:
            self._on_switch(record)
        if self.lease_events is not None and record.ok:
            steps = ("publish_draining", "drain", "sleep") if record.kind == "to_job" else ("wake",)
            self.lease_events.switched(str(record.kind), sum(record.phases.get(s, 0.0) for s in steps), bool(g.spec.samplers))

    def sampler_groups_held(self, job_id: str) -> list[str]:
        """Ids of the groups with samplers that ``job_id`` holds or waits for (the lock-order check)."""
        return [
            o.group_id
            for o in self.groups.values()
            if o.spec.samplers and (o.holder == job_id or any(x.job_id == job_id for x in o.waiters))
        ]

    @staticmethod
    def engine_faults(g: Group, readings: dict[str, EngineReading]) -> dict[str, str]:
        """Sampler address -> why its engine cannot be serving what ``g`` records (see :func:`judge_engines`)."""
        return {a: why for a, (_, why) in judge_engines(g.spec.samplers, g.fleet, readings).items()}

    def group(self, group_id: str) -> Group:
        """Raises :class:`InvalidArgument` (empty id) or :class:`UnknownGroup` with the known ids."""
        if not group_id:
            raise InvalidArgument("group_id is required")
        try:
            return self.groups[group_id]
        except KeyError:
            raise UnknownGroup(f"unknown group {group_id!r}; known groups: {sorted(self.groups)}") from None

    # ------------------------------------------------------------------ jobs
    async def acquire(self, job_id: str, group_id: str, timeout_s: float | None = None, hints: Any = None) -> AcquireResult:
        """Block until ``job_id`` holds ``group_id`` (by the group's scheduling policy), or raise.

        The group's actor takes the ``ACQUIRE`` command (:meth:`Group._on_acquire
        <llmd_timeslice.orchestrator.group.Group._on_acquire>`); the waiter (:class:`~llmd_timeslice.orchestrator.lease.
        Waiter`) is admitted and queued by the group's lease queue (:class:`~llmd_timeslice.orchestrator.lease_queue.
        LeaseQueue`), then granted at once (``Group.grant``, :meth:`LeaseQueue.grant`) or the phase switch drains the
        samplers for it (:meth:`PhaseSwitch.start_drain <llmd_timeslice.orchestrator.phase_switch.PhaseSwitch.
        start_drain>`); the switch's steps post ``DRAINED``, ``SUSPENDED`` back to the same actor.

        Raises:
            InvalidArgument, UnknownGroup, NotHolder (already holds it or waits for it), LockOrderViolation,
            AcquireTimedOut, SwitchFailed (the switch to this job failed; the samplers were woken again),
            StateNotSaved (the grant could not be saved).

        ``hints``: what the client said of itself (its phase profile's phase, accelerators, state bytes).
        """
        if not job_id:
            raise InvalidArgument("job_id is required")
        if timeout_s is not None and timeout_s < 0:
            raise InvalidArgument(f"timeout must be >= 0 seconds, got {timeout_s}")
        g = self.group(group_id)
        w = Waiter(job_id, self.clock.now(), asyncio.get_running_loop().create_future(), hints)
        g.post(Command(C.ACQUIRE, job_id=job_id, waiter=w, reply=w.future))
        try:
            return await asyncio.wait_for(asyncio.shield(w.future), timeout_s)
        except TimeoutError:
            await g.ask(Command(C.ABANDON, waiter=w))
            if w.future.done() and not w.future.cancelled():
                return w.future.result()  # granted (or failed) just before it gave up
            raise AcquireTimedOut(
                f"job {job_id!r} waited {timeout_s:g} s for group {group_id!r} (holder {g.holder!r}, {len(g.waiters)} waiting)"
            ) from None
        except asyncio.CancelledError:
            g.post(Command(C.ABANDON, waiter=w))
            raise

    async def yield_(self, job_id: str, group_id: str, fencing_token: int | None = None) -> YieldResult:
        """Release ``group_id`` (returns once the release is recorded; the wake runs on).

        Raises:
            InvalidArgument, UnknownGroup, NotHolder (also after the lease expired: the message says so),
            StaleFencingToken.
        """
        if not job_id:
            raise InvalidArgument("job_id is required")
        result: YieldResult = await self.group(group_id).ask(Command(C.YIELD, job_id=job_id, token=fencing_token))
        return result

    async def publish_weights(self, job_id: str, group_id: str, weights: WeightUpdate, fencing_token: int | None = None) -> Group:
        """Record ``weights`` as the group's next weight version; the samplers load it when they wake.

        Raises:
            InvalidArgument (a group without samplers, or a malformed update), UnknownGroup,
            NotHolder, StaleFencingToken, StaleWeightVersion (not newer than the latest one).
        """
        if not job_id:
            raise InvalidArgument("job_id is required")
        g: Group = await self.group(group_id).ask(Command(C.PUBLISH_WEIGHTS, job_id=job_id, token=fencing_token, weights=weights))
        return g

    async def request_yield(self, group_id: str, reason: str = "", band: int = 0, hold_deadline_s: float = 0.0) -> YieldAnswer:
        """Ask the holder of ``group_id`` to yield at its next safe point (``LeaseService.RequestYield``): the
        group's policy applies (docs/group-settings.md) except ``yield_request_fraction`` (there is no held request
        to measure). ``hold_deadline_s`` > 0: the request counts ``ignored`` once that many seconds pass with the
        holder keeping the group. A group nobody holds answers ``requested=False`` saying so.

        Raises:
            InvalidArgument (empty group id, a negative or non-finite deadline, a band outside int32),
            UnknownGroup (naming it and the known groups).
        """
        g = self.group(group_id)
        bad = check_ask(band, hold_deadline_s)
        if bad is not None:
            raise InvalidArgument(bad)
        ask = YieldAsk(reason or "requested by an operator (RequestYield)", band, hold_deadline_s, source="operator")
        answer: YieldAnswer = await g.ask(Command(C.YIELD_REQUEST, ask=ask))
        return answer

    def hold_pressure(self, pressure: HoldPressure) -> None:
        """Held requests of one band of ``pressure.pool`` (from the gates, :class:`~llmd_timeslice.orchestrator.
        gate_hub.GateHub`): posted to every group whose samplers serve that pool; a group a job holds applies its
        yield-request policy. Returns at once."""
        ask = YieldAsk.from_pressure(pressure)
        for g in self.groups.values():
            if any(s.pool == pressure.pool for s in g.spec.samplers):
                g.post(Command(C.YIELD_REQUEST, ask=ask))

    def lease(self, job_id: str, group_id: str) -> Lease:
        """The holder's current lease. Raises InvalidArgument, UnknownGroup, NotHolder."""
        if not job_id:
            raise InvalidArgument("job_id is required")
        g = self.group(group_id)
        if g.holder != job_id or g.lease is None:
            why = g.expired_jobs.get(job_id)
            raise NotHolder(
                f"job {job_id!r} does not hold group {group_id!r} (holder: {g.holder!r})" + (f"; {why}" if why else "")
            )
        return replace(g.lease)

    async def heartbeat(self, job_id: str, group_id: str, fencing_token: int) -> Lease:
        """Renew (and arm) the holder's lease for ``lease_ttl_s`` seconds.

        Raises:
            InvalidArgument, UnknownGroup, NotHolder (lease reclaimed or never held), StaleFencingToken.
        """
        if fencing_token <= 0:
            raise InvalidArgument(f"fencing_token must be a positive integer from GetLease, got {fencing_token}")
        if not job_id:
            raise InvalidArgument("job_id is required")
        lease: Lease = await self.group(group_id).ask(Command(C.HEARTBEAT, job_id=job_id, token=fencing_token))
        return lease

    # ------------------------------------------------------------------ discovery
    async def update_spec(self, spec: GroupSpec) -> None:
        """Bring group ``spec.group_id`` to ``spec`` (creating it if new); returns once applied, including the
        wake of samplers it adds to an idle group, or, while a switch is in flight, once that switch ended."""
        g = self.groups.get(spec.group_id)
        if g is None:
            g = self.groups[spec.group_id] = Group(spec.copy(samplers=[]), self)
            log.info("group %s: discovered", spec.group_id)
        await g.ask(Command(C.SPEC_UPDATE, spec=spec.copy()))

    # ------------------------------------------------------------------ start, timers, shutdown
    def restore(self, data: dict[str, Any]) -> dict[str, RestoreOutcome]:
        """Load a :meth:`snapshot` (before :meth:`start`); returns group id -> what start-up does with it.
        Groups unknown to the inventory are ignored. Armed leases restart their TTL now."""
        saved = data.get("groups") or {}
        return {gid: g.restore(saved.get(gid)) for gid, g in self.groups.items()}

    async def start(self, reconcile: bool = True) -> None:
        """Start every group: a held group publishes its samplers ASLEEP; with ``reconcile``, a free group's
        samplers are woken and verified (a no-op on an awake engine) before this returns."""
        if isinstance(self.clock, LoopClock):
            self.clock.start_stall_probe()
        await asyncio.gather(*(g.ask(Command(C.START, reconcile=reconcile)) for g in self.groups.values()))

    def start_repair(self, first_s: float = 2.0, max_s: float = 60.0, audit_interval_s: float = 0.0) -> None:
        """Repair back-off and engine audit (may be called again to change them).

        A group whose samplers are out of service after a failed wake (dead engine or sidecar, failed load) is
        woken again after ``first_s`` seconds, doubling to ``max_s`` while it keeps failing: recovery without a
        human once the part is back. ``audit_interval_s`` > 0 (and actions that can read engines): every that
        many seconds each serving group's engines are read; one that reports another weight version than the
        one recorded (it restarted on its own) or sleeps is taken out of service and woken again at the group's
        weight version, and an out-of-service engine that refused connections and answers again is repaired at
        once."""
        self.repair_first_s, self.repair_max_s, self.audit_interval_s = first_s, max_s, audit_interval_s
        if self._audit_timer is not None:
            self._audit_timer.cancel()
            self._audit_timer = None
        if audit_interval_s > 0 and self.actions.can_read_engines:
            self._arm_audit()

    def audit_endpoint(self, address: str, why: str = "") -> bool:
        """Audit now (instead of at the next tick) every group with a sampler at ``address`` (``ip:port``): a gate
        saw Envoy fail to connect to it (``why``). The audit reads the engines and repairs a dead one as at a tick
        (:meth:`RepairPath.on_audit_tick <llmd_timeslice.orchestrator.repair.RepairPath.on_audit_tick>`). Returns
        whether a group serves that address and engines can be read."""
        if not self.actions.can_read_engines:
            return False
        found = False
        for g in self.groups.values():
            if any(s.address == address for s in g.spec.samplers):
                log.warning("group=%s sampler %s: %s; auditing its engines now", g.group_id, address, why or "reported")
                g.post(Command(C.AUDIT_TICK))
                found = True
        return found

    def weights_final(self, pool: str) -> bool:
        """True when no newer weight version can come for ``pool``: groups serve it and none of them can change
        its weights now (:attr:`Group.weights_can_change`)."""
        groups = [g for g in self.groups.values() if any(s.pool == pool for s in g.spec.samplers)]
        return bool(groups) and not any(g.weights_can_change for g in groups)

    def note_weights_final(self, g: Group) -> None:
        """After a command of ``g``: tell :attr:`on_weights_final` about each pool ``g`` serves."""
        if self.on_weights_final is None:
            return
        for pool in sorted({s.pool for s in g.spec.samplers}):
            self.on_weights_final(pool, self.weights_final(pool))

    def _arm_audit(self) -> None:
        self._audit_timer = self.clock.call_at(self.clock.now() + self.audit_interval_s, self._audit)

    def _audit(self) -> None:
        for g in self.groups.values():
            g.post(Command(C.AUDIT_TICK))
        self._arm_audit()

    def snapshot(self) -> dict[str, Any]:
        """What survives a restart, JSON-serialisable: per group holder, lease, phase, weight versions."""
        return {"version": 1, "groups": {gid: g.snapshot() for gid, g in self.groups.items()}}

    async def close(self) -> None:
        """Stop every group's task; pending acquires fail with SwitchFailed."""
        if isinstance(self.clock, LoopClock):
            self.clock.stop_stall_probe()
        if self._audit_timer is not None:
            self._audit_timer.cancel()
            self._audit_timer = None
        await asyncio.gather(*(g.close() for g in self.groups.values()))
