"""One accelerator group as an explicit state machine run by one task (the group's actor).

A group's accelerators belong to its *samplers* (vLLM servers behind the gate) unless a job (typically a trainer)
holds the group's lease. Every group is run by one task (:class:`Group`) that takes
:class:`~llmd_timeslice.orchestrator.commands.Command` objects from a queue, one at a time: acquire, abandon, yield,
heartbeat, publish weights, lease expired, spec update (discovery), audit and repair ticks (timers), start-up, and
the results of its own steps. Nothing else edits a group: the gRPC servicers, discovery and the timers only send
commands (and read). Each change of phase is checked against the table in :mod:`llmd_timeslice.orchestrator.phases`,
which lists every legal sequence; an illegal one raises :class:`~llmd_timeslice.orchestrator.phases.IllegalTransition`.

The actor keeps the queue, the dispatch (:attr:`Group._handlers`: command -> handler) and the recovery after a bug;
what a group knows and does lives in its parts, one module each:

=====================  ==========================================================================================
part                   module
=====================  ==========================================================================================
the lease queue        :mod:`~llmd_timeslice.orchestrator.lease_queue` (holder, waiters, fencing tokens, expiry)
the weight ledger      :mod:`~llmd_timeslice.orchestrator.weight_ledger` (published, target, last good, rejected)
the sampler fleet      :mod:`~llmd_timeslice.orchestrator.sampler_fleet` (versions, out of service, repair timer)
the yield desk         :mod:`~llmd_timeslice.orchestrator.yield_desk` (yield requests to the holder)
the phase switch       :mod:`~llmd_timeslice.orchestrator.phase_switch` (drain, sleep, grant; wake, verify)
the repair path        :mod:`~llmd_timeslice.orchestrator.repair` (engine audit, probes, repair wakes)
discovery's updates    :mod:`~llmd_timeslice.orchestrator.spec_updates` (samplers joining or leaving, settings)
the persisted record   :mod:`~llmd_timeslice.orchestrator.group_record` (what survives a restart)
=====================  ==========================================================================================

The procedures (switch, repair, updates) see the actor through
:class:`~llmd_timeslice.orchestrator.group_host.GroupHost`; the actor sees the orchestrator around it only through
:class:`GroupContext` (clock, switch actions, persister, records, the lock-order check). After each command, the
group's changes are persisted: an awaited, coalesced write off the event loop
(:class:`~llmd_timeslice.orchestrator.persistence.StatePersister`). A grant is handed out only once saved; if the
save fails, the grant is taken back and the acquire fails with :class:`StateNotSaved`.

Weight versions: the group's target is the latest published version unless samplers *rejected* it (its files failed
verification or it failed to load): then the target is the last version that loaded until a newer one is published,
the samplers serve that, and :attr:`Group.rejected` says which version and why (``WeightVersionStatus.rejected`` on
the wire).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any, Protocol

from llmd_timeslice.domain.group_settings import GroupSpec
from llmd_timeslice.domain.switches import SwitchKind, SwitchRecord
from llmd_timeslice.orchestrator.clock import Clock
from llmd_timeslice.orchestrator.commands import GROUP_LOGGER, NO_REPLY, Command, fail
from llmd_timeslice.orchestrator.errors import (
    GroupFault,
    InvalidArgument,
    LockOrderViolation,
    OrchestratorError,
    StateNotSaved,
    SwitchFailed,
)
from llmd_timeslice.orchestrator.group_record import group_record, load_record
from llmd_timeslice.orchestrator.lease import AcquireResult, Lease, Waiter, YieldResult
from llmd_timeslice.orchestrator.lease_queue import LeaseQueue
from llmd_timeslice.orchestrator.phase_switch import PhaseSwitch
from llmd_timeslice.orchestrator.phases import (
    IGNORED,
    WIRE_STATE,
    GroupCommand,
    GroupPhase,
    GroupState,
    IllegalTransition,
    accepts,
    check,
)
from llmd_timeslice.orchestrator.repair import RepairPath
from llmd_timeslice.orchestrator.sampler_fleet import SamplerFleet
from llmd_timeslice.orchestrator.spec_updates import SpecUpdates
from llmd_timeslice.orchestrator.switch import SwitchActions
from llmd_timeslice.orchestrator.weight_ledger import RejectedWeights, WeightLedger
from llmd_timeslice.orchestrator.yield_desk import YieldDesk
from llmd_timeslice.orchestrator.yield_requests import YieldAnswer, YieldStats
from llmd_timeslice.weights.update import WeightUpdate

__all__ = ["SAMPLERS", "Command", "Group", "GroupContext", "RestoreOutcome"]

log = logging.getLogger(GROUP_LOGGER)

C = GroupCommand
P = GroupPhase

SAMPLERS = "<samplers>"
""":attr:`Group.loaded_job` while the samplers hold the accelerators."""

_HOLDER_COMMANDS = frozenset({C.YIELD, C.HEARTBEAT, C.PUBLISH_WEIGHTS})


class RestoreOutcome(enum.Enum):
    """What :meth:`~llmd_timeslice.orchestrator.groups.Orchestrator.restore` leaves each group to do at start-up."""

    HELD = "held"
    """A job holds it: its samplers stay asleep (published ASLEEP)."""
    WAKE = "wake"
    """Its samplers are woken and verified (idle, or a switch cut halfway is rolled back)."""
    NONE = "none"
    """No samplers: nothing to do."""


class GroupContext(Protocol):
    """The orchestrator as one group sees it."""

    clock: Clock
    """Time for leases, repair and audit timers."""
    actions: SwitchActions
    """What a switch does outside (drain, sleep, wake, engine reads)."""
    persister: Any
    """A :class:`~llmd_timeslice.orchestrator.persistence.StatePersister` (``await save()``), or None: not saved."""
    on_transition: Callable[[Group, GroupPhase, GroupCommand, GroupPhase], None] | None
    """Called with (group, from, command, to) for every move, staying put included (tests, tracing)."""
    repair_first_s: float
    repair_max_s: float
    lease_events: Any
    """Told of every acquire, grant, release and abandon (``acquired``, ``granted``, ``released``, ``abandoned``: the
    phase profiles of :class:`~llmd_timeslice.orchestrator.placement_watch.PlacementWatch`), or None."""

    def record(self, g: Group, record: SwitchRecord) -> None:
        """Keep a finished switch (history, metrics)."""

    def note_weights_final(self, g: Group) -> None:
        """After each command of ``g``: tell the gates whether its pools' weights can still change."""

    def sampler_groups_held(self, job_id: str) -> list[str]:
        """Ids of the groups with samplers that ``job_id`` holds or waits for (the lock-order check: a job takes
        the trainer group first, then the sampler group)."""


class Group:
    """One group's state and the task that runs it. Read its attributes freely; change it only by commands
    (:meth:`Orchestrator.acquire` and friends). Legal sequences: :mod:`llmd_timeslice.orchestrator.phases`."""

    def __init__(self, spec: GroupSpec, ctx: GroupContext) -> None:
        self._ctx = ctx
        self.spec = spec.copy()
        self.phase = P.SERVING if spec.samplers else P.FREE
        self.state_since = ctx.clock.wall()
        self.history: deque[SwitchRecord] = deque(maxlen=50)
        self.last_error = ""
        self.leases = LeaseQueue(spec.group_id, ctx.clock, lambda token: self.post(Command(C.LEASE_EXPIRED, token=token)))
        self.ledger = WeightLedger(spec.group_id)
        self.fleet = SamplerFleet((s.address for s in spec.samplers), ctx.clock)
        self.yield_desk = YieldDesk(spec.group_id, ctx.clock)
        self.switch = PhaseSwitch(self)
        self.repair = RepairPath(self, self.switch)
        self.updates = SpecUpdates(self, self.switch)
        self._epoch = 0
        self._dirty = False
        self._queue: asyncio.Queue[Command] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._effects: set[asyncio.Task[None]] = set()
        self._watchers: list[tuple[Callable[[Group], bool], asyncio.Future[None]]] = []
        self._closed = False

    # ------------------------------------------------------------------ reading
    @property
    def group_id(self) -> str:
        return self.spec.group_id

    @property
    def state(self) -> GroupState:
        """The wire projection of :attr:`phase` (IDLE, IDLE_YIELDED, LOCKED, SWITCHING)."""
        return WIRE_STATE[self.phase]

    @property
    def epoch(self) -> int:
        """Increases with every change of phase."""
        return self._epoch

    @property
    def clock(self) -> Clock:
        return self._ctx.clock

    @property
    def actions(self) -> SwitchActions:
        return self._ctx.actions

    @property
    def holder(self) -> str | None:
        """The job holding the lease (:attr:`leases`)."""
        return self.leases.holder

    @property
    def lease(self) -> Lease | None:
        return self.leases.lease

    @property
    def deferred_job(self) -> str | None:
        return self.leases.deferred_job

    @property
    def expired_jobs(self) -> dict[str, str]:
        """Job -> why its lease was reclaimed (:attr:`leases`)."""
        return self.leases.expired_jobs

    @property
    def waiters(self) -> tuple[Waiter, ...]:
        """Jobs waiting for the group, in arrival order (ones that gave up excluded)."""
        return self.leases.waiters

    @property
    def rejected(self) -> RejectedWeights | None:
        """The weight version the samplers rejected, while it is the latest published (:attr:`ledger`)."""
        return self.ledger.rejected

    @property
    def target_weights(self) -> WeightUpdate | None:
        """The version every wake converges to (:attr:`WeightLedger.target`)."""
        return self.ledger.target

    @property
    def sampler_versions(self) -> dict[str, int]:
        """Address -> the weight version it serves (:attr:`fleet`)."""
        return self.fleet.versions

    @property
    def sampler_errors(self) -> dict[str, str]:
        """Out-of-service samplers -> why (:attr:`fleet`)."""
        return self.fleet.errors

    @property
    def unreachable_engines(self) -> set[str]:
        """Out-of-service samplers whose engine refused connections (:attr:`fleet`)."""
        return self.fleet.unreachable

    @property
    def serving_version(self) -> int:
        """Highest weight version any in-service sampler of the group serves (0: the initial weights)."""
        return self.fleet.serving_version

    @property
    def yield_stats(self) -> YieldStats:
        """Counts of yield requests since the orchestrator started (:attr:`yield_desk`)."""
        return self.yield_desk.stats

    @property
    def loaded_job(self) -> str | None:
        """Whose context the accelerators hold: :data:`SAMPLERS`, the holder, the deferred job, or None."""
        if self.phase in (P.SERVING, P.OUT_OF_SERVICE, P.RESUMING, P.REPAIRING, P.DRAINING):
            return SAMPLERS
        if self.phase is P.HELD:
            return self.holder
        if self.phase is P.DEFERRED:
            return self.deferred_job
        return None

    @property
    def weights_can_change(self) -> bool:
        """Whether a newer weight version may reach the samplers: a job holds or waits for the group (it may publish
        one), or a published version is not served yet."""
        return self.holder is not None or self.leases.queued or self.ledger.ahead_of(self.serving_version)

    async def wait_until(self, predicate: Callable[[Group], bool], timeout_s: float | None = None) -> None:
        """Return once ``predicate(self)`` holds (checked now and after every command the group handles)."""
        if predicate(self):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._watchers.append((predicate, fut))
        await asyncio.wait_for(fut, timeout_s)

    # ------------------------------------------------------------------ the actor: queue, dispatch, recovery
    def post(self, cmd: Command) -> None:
        """Queue ``cmd`` for the group's task (started on first use)."""
        if self._closed:
            if cmd.reply is not None and not cmd.reply.done():
                cmd.reply.set_exception(SwitchFailed("orchestrator is shutting down"))
            return
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"group-{self.group_id}")
        self._queue.put_nowait(cmd)

    async def ask(self, cmd: Command) -> Any:
        """Post ``cmd`` and wait for its reply (raises its typed error)."""
        cmd.reply = asyncio.get_running_loop().create_future()
        self.post(cmd)
        return await cmd.reply

    async def _run(self) -> None:
        while True:
            cmd = await self._queue.get()
            before = (self.phase, self.holder, self.lease.token if self.lease else None)
            try:
                await self._dispatch(cmd)
            except OrchestratorError as exc:
                if cmd.reply is None:  # nobody to tell (a step's outcome, a timer): a bug worth a log line
                    log.error("group=%s %s", self.group_id, exc)
                fail(cmd.reply, exc)
            except Exception as exc:  # a bug: the group may be half-changed; put it in a safe phase and say so
                await self._recover(cmd, exc, before)
            self._notify_watchers()
            self._ctx.note_weights_final(self)

    async def _dispatch(self, cmd: Command) -> None:
        kind = cmd.kind
        if kind in (C.AUDITED, C.PROBED):
            self.repair.reading = False
        if kind in _HOLDER_COMMANDS:
            self.leases.check_holder(cmd.job_id, cmd.token, heartbeat=kind is C.HEARTBEAT)
        if not accepts(self.phase, kind):
            if (self.phase, kind) in IGNORED:
                log.debug("group=%s %s ignored in phase %s", self.group_id, kind.name, self.phase.name)
                return
            raise IllegalTransition(self.group_id, self.phase, kind)
        result = await self._handlers[kind](self, cmd)
        await self.updates.settle()
        if self._dirty:
            await self._save(strict=False)
        if cmd.reply is not None and result is not NO_REPLY and not cmd.reply.done():
            cmd.reply.set_result(result)

    async def _recover(self, cmd: Command, exc: Exception, before: tuple[GroupPhase, str | None, int | None]) -> None:
        """After an unexpected exception in the handler of ``cmd``: fail the caller with :class:`GroupFault`, stop
        the group's steps, and move by ``INTERNAL_ERROR`` to a safe phase (the table in ``phases.py``).

        A holder whose lease the command left as it was (``before``: phase, holder, token when the command
        began) keeps it, and its waiters stay queued. Otherwise every waiter and the switch in flight fail with
        :class:`GroupFault` (nobody hangs), a lease the command left half-granted or half-released is reclaimed
        (the reason kept for that job's next call), and samplers whose state is unknown are marked out of
        service, so the repair timer wakes and verifies them."""
        phase = self.phase
        why = f"internal error in {cmd.kind.name} during phase {phase.name}: {exc!r}"
        log.error("group=%s %s; putting the group in a safe phase", self.group_id, why, exc_info=exc)
        err = GroupFault(f"group {self.group_id!r}: {why}; the group was put in a safe phase, retry")
        fail(cmd.reply, err)
        try:
            for t in list(self._effects):  # a step's outcome would land in a phase that no longer expects it
                t.cancel()
            self.repair.reading = False
            lease_kept = before[0] is P.HELD and phase is P.HELD and self.leases.intact(before[1], before[2])
            sw = self.switch.take()
            if not lease_kept:  # nothing would grant them: they get the error now
                self.leases.fail_waiters(err)
                fail(sw.waiter.future if sw and sw.waiter else None, err)
            for r in sw.replies if sw else []:
                fail(r, err)
            if lease_kept:
                to = P.HELD  # the holder keeps the accelerators it was told it has; only this command failed
            elif phase in (P.FREE, P.DEFERRED) and not self.spec.samplers:
                to = phase
            else:
                self.leases.reclaim(why, asked=cmd.job_id if cmd.kind in _HOLDER_COMMANDS else None)
                to = P.OUT_OF_SERVICE if self.spec.samplers else P.FREE
            if to is P.OUT_OF_SERVICE:
                self.fleet.mark_unknown((s.address for s in self.spec.samplers), f"state unknown after an {why}")
            self.last_error = why + ("" if to is phase else f"; the group went to {to.name}")
            self.enter(to, C.INTERNAL_ERROR)
            if to is P.OUT_OF_SERVICE and not self.fleet.repair_armed:
                self._schedule_repair()  # it was OUT_OF_SERVICE already, with its timer just fired or cancelled
            self._dirty = True
            await self._save(strict=False)
        except Exception as again:  # the recovery itself failed: say so loudly; the next command finds what is left
            log.critical("group=%s recovery after %s failed: %r", self.group_id, why, again, exc_info=again)
            self.last_error = f"{why}; recovery failed: {again!r}"

    def _notify_watchers(self) -> None:
        keep = []
        for predicate, fut in self._watchers:
            if fut.done():
                continue
            try:
                ok = predicate(self)
            except Exception as exc:
                fut.set_exception(exc)
                continue
            if ok:
                fut.set_result(None)
            else:
                keep.append((predicate, fut))
        self._watchers = keep

    # ------------------------------------------------------------------ what the parts ask of the actor (GroupHost)
    def enter(self, to: GroupPhase, kind: GroupCommand) -> None:
        """Move to ``to`` because of ``kind`` (checked against the table). Entering OUT_OF_SERVICE arms the repair
        back-off; leaving it (except for a repair) resets it; SERVING forgets unreachable engines."""
        check(self.group_id, self.phase, kind, to)
        if self._ctx.on_transition is not None:
            self._ctx.on_transition(self, self.phase, kind, to)
        if to is self.phase:
            return
        log.info("group=%s %s -%s-> %s", self.group_id, self.phase.name, kind.value, to.name)
        frm, self.phase = self.phase, to
        self.state_since = self._ctx.clock.wall()
        self._epoch += 1
        self._dirty = True
        if to is P.OUT_OF_SERVICE:
            self._schedule_repair()
        elif to is not P.REPAIRING:
            self.fleet.cancel_repair(reset=True)
        if to is P.SERVING:
            self.fleet.unreachable.clear()
        if frm is P.OUT_OF_SERVICE and to is P.REPAIRING:
            self.fleet.cancel_repair(reset=False)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run a step of this group as a task it keeps (so it cannot be collected mid-flight)."""
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.group_id}-{name}")
        self._effects.add(task)
        task.add_done_callback(self._effects.discard)

    def record(self, rec: SwitchRecord) -> None:
        self._ctx.record(self, rec)

    def mark_dirty(self) -> None:
        self._dirty = True

    def next_waiter(self) -> Waiter:
        """The next waiter by the group's policy, the registered waiter policy of that name."""
        return self.leases.next_waiter(str(self.spec.policy), self.spec.job_priorities)

    async def grant(self, w: Waiter, kind: GroupCommand) -> None:
        """Give the lease to ``w`` (:meth:`LeaseQueue.grant`), saved before the waiter learns of it; a grant that
        cannot be saved is taken back (``w`` gets :class:`StateNotSaved`)."""
        self.enter(P.HELD, kind)
        job = w.job_id
        self.leases.grant(job, self.spec.lease_ttl_s)
        self.ledger.new_grant()
        self.yield_desk.new_grant()
        self._dirty = True
        try:
            await self._save(strict=True)
        except StateNotSaved as exc:
            self.last_error = f"grant to job {job!r} taken back: {exc}"
            log.error("group=%s %s", self.group_id, self.last_error)
            self.leases.take_back()
            fail(w.future, StateNotSaved(self.last_error))
            self.leases.remove(w)
            await self._release(job, C.GRANT_NOT_SAVED)
            return
        if not w.future.done():
            problems = self.ledger.sync_error_for(job, self.fleet.errors, self.fleet.versions)
            w.future.set_result(AcquireResult(int((self._ctx.clock.now() - w.enqueued_at) * 1000), False, problems))
        if self._ctx.lease_events is not None:
            self._ctx.lease_events.granted(job, self.group_id)
        self.leases.remove(w)  # only now: until it knows, an internal error still finds it in the queue and fails it

    def _schedule_repair(self) -> None:
        ctx = self._ctx
        self.fleet.schedule_repair(ctx.repair_first_s, ctx.repair_max_s, lambda: self.post(Command(C.REPAIR_TICK)))

    async def _save(self, strict: bool) -> None:
        self._dirty = False
        persister = self._ctx.persister
        if persister is None:
            return
        try:
            await persister.save()
        except Exception as exc:
            if strict:
                raise StateNotSaved(f"the orchestrator's state could not be saved ({exc})") from exc
            log.error("group=%s state not saved: %s", self.group_id, exc)
            self.last_error = f"state not saved: {exc}"

    # ------------------------------------------------------------------ handlers: the lease
    async def _on_acquire(self, cmd: Command) -> object:
        """Queue the waiter (:meth:`LeaseQueue.admit`, :meth:`LeaseQueue.enqueue`); grant at once without samplers,
        else drain them for it (:meth:`PhaseSwitch.start_drain`), or keep it queued behind the switch in flight or
        the holder. The waiter's future gets the grant."""
        w = cmd.waiter
        assert w is not None
        if w.future.done():  # gave up before we got to it: nothing happens
            return NO_REPLY
        job = w.job_id
        self.leases.admit(job)
        if not self.spec.samplers:
            held = self._ctx.sampler_groups_held(job)
            if held:
                raise LockOrderViolation(
                    f"lock order: job {job!r} holds or waits for sampler group(s) {held} and asks for trainer group "
                    f"{self.group_id!r}; take the trainer group first, then the sampler group (weight sync holds "
                    "both), so that no two jobs can deadlock"
                )
        self.leases.enqueue(w)
        if self._ctx.lease_events is not None:
            self._ctx.lease_events.acquired(job, self.group_id, w.hints)
        if self.phase in (P.FREE, P.DEFERRED):
            await self.grant(w, C.ACQUIRE)  # nothing to switch: no samplers
        elif self.phase in (P.SERVING, P.OUT_OF_SERVICE):
            self.switch.start_drain(C.ACQUIRE)
        else:
            self.enter(self.phase, C.ACQUIRE)  # queued until the switch in flight ends or the holder yields
        return NO_REPLY

    async def _on_abandon(self, cmd: Command) -> bool:
        w = cmd.waiter
        assert w is not None
        self.enter(self.phase, C.ABANDON)
        abandoned = self.leases.abandon(w)
        if abandoned and self._ctx.lease_events is not None:
            self._ctx.lease_events.abandoned(w.job_id, self.group_id)
        return abandoned

    async def _on_yield(self, cmd: Command) -> YieldResult:
        return await self._release(cmd.job_id, C.YIELD)

    async def _on_heartbeat(self, cmd: Command) -> Lease:
        lease = self.lease
        assert lease is not None
        self.enter(P.HELD, C.HEARTBEAT)
        if self.leases.renew():
            self._dirty = True  # armed: persisted, so a restarted orchestrator keeps expiring it
        return replace(lease)

    async def _on_lease_expired(self, cmd: Command) -> None:
        lease = self.leases.due(cmd.token)
        if lease is None:
            self.enter(P.HELD, C.LEASE_EXPIRED)  # a heartbeat renewed it meanwhile, another grant, or a stall
            return
        why = self.leases.expire(lease)
        self.last_error = f"job {lease.job_id!r}: {why}"
        await self._release(lease.job_id, C.LEASE_EXPIRED)

    async def _release(self, job: str, kind: GroupCommand) -> YieldResult:
        """The holder is gone (yield, lease expired, grant taken back): the next waiter, the samplers, or a
        deferred snapshot."""
        self.ledger.released(job)  # the auto sleep policy keeps level 2 for jobs that keep publishing
        self.yield_desk.end(self.lease, job, honoured=kind is C.YIELD)
        if self._ctx.lease_events is not None:
            self._ctx.lease_events.released(job, self.group_id, bool(self.waiters))
        self.leases.end()
        self._dirty = True
        live = self.waiters
        if live:
            await self.grant(self.next_waiter(), kind)  # job to job: the samplers stay asleep
            return YieldResult(len(live), False)
        if self.spec.samplers:
            self.switch.start_resume(SwitchKind.TO_SAMPLERS, kind, after_job=job)
            return YieldResult(0, False)
        if kind is C.GRANT_NOT_SAVED:
            self.enter(P.FREE, kind)
            return YieldResult(0, False)
        self.leases.deferred_job = job
        self.enter(P.DEFERRED, kind)
        return YieldResult(0, True)

    # ------------------------------------------------------------------ handlers: weights, yield requests, start
    async def _on_publish(self, cmd: Command) -> Group:
        if not self.spec.samplers:
            raise InvalidArgument(f"group {self.group_id!r} has no samplers to load weights into; publish on the sampler group")
        weights = self.ledger.check_publish(cmd.weights, self.sampler_versions)
        self.enter(P.HELD, C.PUBLISH_WEIGHTS)
        self.ledger.publish(cmd.job_id, weights)
        self._dirty = True
        return self

    async def _on_yield_request(self, cmd: Command) -> YieldAnswer:
        ask = cmd.ask
        assert ask is not None
        self.enter(self.phase, C.YIELD_REQUEST)
        lease, job = self.lease, self.holder
        if self.phase is not P.HELD or lease is None or job is None:
            return YieldAnswer(
                False,
                "",
                f"group {self.group_id!r} is not held (phase {self.phase.name}): nobody to ask; "
                + ("its samplers serve" if self.loaded_job == SAMPLERS else "no job holds its lease"),
            )
        return self.yield_desk.ask(lease, job, self.spec, ask, lambda token: self.post(Command(C.YIELD_DEADLINE, token=token)))

    async def _on_yield_deadline(self, cmd: Command) -> None:
        self.enter(P.HELD, C.YIELD_DEADLINE)
        self.yield_desk.deadline(self.lease, cmd.token, self.holder)

    async def _on_start(self, cmd: Command) -> object:
        if self.phase is P.HELD:
            self.enter(P.HELD, C.START)
            try:
                await self._ctx.actions.publish_asleep(self.spec.copy())
            except Exception as exc:
                log.error("group=%s publishing held samplers ASLEEP failed: %s", self.group_id, exc)
            return None
        if self.phase is P.SERVING and cmd.reconcile and self.spec.samplers:
            self.switch.start_resume(SwitchKind.RECONCILE, C.START, replies=[r for r in (cmd.reply,) if r is not None])
            return NO_REPLY
        self.enter(self.phase, C.START)
        return None

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        """What survives a restart, JSON-serialisable (:func:`~llmd_timeslice.orchestrator.group_record.group_record`)."""
        return group_record(self.state, self.phase, self.leases, self.ledger, self.fleet)

    def restore(self, d: dict[str, Any] | None) -> RestoreOutcome:
        """Load a :meth:`snapshot` before the group's task runs (the phase is set directly, not by a command)."""
        if d:
            known = {s.address for s in self.spec.samplers}
            phase = load_record(self.group_id, d, self.leases, self.ledger, self.fleet, known)
            if phase is not None:
                self.phase = phase  # restored before the task runs: no transition
        if self.holder is not None:
            return RestoreOutcome.HELD
        if self.spec.samplers:
            self.phase = P.SERVING
            return RestoreOutcome.WAKE
        return RestoreOutcome.NONE

    # ------------------------------------------------------------------ shutdown
    async def close(self) -> None:
        """Stop the task and its steps; every pending acquire and command fails with SwitchFailed."""
        self._closed = True
        self.fleet.cancel_repair(reset=False)
        self.yield_desk.cancel_timer()
        tasks = [t for t in (self._task, *self._effects) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        err = SwitchFailed("orchestrator is shutting down")
        self.leases.close(err)
        while not self._queue.empty():
            cmd = self._queue.get_nowait()
            fail(cmd.reply, err)
        sw = self.switch.in_flight
        for r in self.updates.pending_replies + (sw.replies if sw else []):
            fail(r, err)
        for _, fut in self._watchers:
            fail(fut, err)

    _handlers: dict[GroupCommand, Callable[[Group, Command], Awaitable[Any]]] = {
        # the lease (lease_queue.py)
        C.ACQUIRE: _on_acquire,
        C.ABANDON: _on_abandon,
        C.YIELD: _on_yield,
        C.HEARTBEAT: _on_heartbeat,
        C.LEASE_EXPIRED: _on_lease_expired,
        # weights (weight_ledger.py), yield requests (yield_desk.py), start-up
        C.PUBLISH_WEIGHTS: _on_publish,
        C.YIELD_REQUEST: _on_yield_request,
        C.YIELD_DEADLINE: _on_yield_deadline,
        C.START: _on_start,
        # the phase switch's steps (phase_switch.py)
        C.DRAINED: lambda g, cmd: g.switch.on_drained(cmd),
        C.DRAIN_FAILED: lambda g, cmd: g.switch.on_failed(cmd),
        C.SUSPENDED: lambda g, cmd: g.switch.on_suspended(cmd),
        C.SUSPEND_FAILED: lambda g, cmd: g.switch.on_failed(cmd),
        C.RESUMED: lambda g, cmd: g.switch.on_resumed(cmd),
        C.REPAIRED: lambda g, cmd: g.switch.on_resumed(cmd),
        # the repair path (repair.py)
        C.AUDIT_TICK: lambda g, cmd: g.repair.on_audit_tick(cmd),
        C.AUDITED: lambda g, cmd: g.repair.on_audited(cmd),
        C.PROBED: lambda g, cmd: g.repair.on_probed(cmd),
        C.RETURNED: lambda g, cmd: g.repair.on_returned(cmd),
        C.REPAIR_TICK: lambda g, cmd: g.repair.on_repair_tick(cmd),
        # discovery's updates (spec_updates.py)
        C.SPEC_UPDATE: lambda g, cmd: g.updates.on_spec_update(cmd),
    }
