"""One accelerator group as an explicit state machine run by one task (the group's actor).

A group's accelerators belong to its *samplers* (vLLM servers behind the gate) unless a job
(typically a trainer) holds the group's lease. Every group is run by one task (:class:`Group`)
that takes :class:`Command` objects from a queue, one at a time: acquire, abandon, yield,
heartbeat, publish weights, lease expired, spec update (discovery), audit and repair ticks
(timers), start-up, and the results of its own steps. Nothing else edits a group: the gRPC
servicers, discovery and the timers only send commands (and read). Each change of phase is
checked against the table in :mod:`llmd_timeslice.orchestrator.phases`, which lists every legal
sequence; an illegal one raises :class:`~llmd_timeslice.orchestrator.phases.IllegalTransition`.

The slow steps (drain, sleep, wake, engine reads) run as tasks of the group that call the
:class:`~llmd_timeslice.orchestrator.switch.SwitchActions` and post their outcome back as a
command, so a group keeps taking commands (a second acquire, a waiter that gives up, a spec
update kept for later) while a switch is in flight. After each command, the group's changes are
persisted: an awaited, coalesced write off the event loop
(:class:`~llmd_timeslice.orchestrator.persistence.StatePersister`). A grant is handed out only
once saved; if the save fails, the grant is taken back and the acquire fails with
:class:`StateNotSaved`.

Timers (lease expiry, repair back-off, engine audit) come from an injectable
:class:`~llmd_timeslice.orchestrator.clock.Clock`.

Weight versions: the group's target is the latest published version unless samplers *rejected*
it (its files failed verification or it failed to load): then the target is the last version that
loaded (``last_good``) until a newer one is published, the samplers serve that, and
:attr:`Group.rejected` says which version and why (``WeightVersionStatus.rejected`` on the wire).

The actor reaches the orchestrator around it only through :class:`GroupContext` (clock, switch actions,
persister, records, the lock-order check); the lease records live in
:mod:`~llmd_timeslice.orchestrator.lease`, the weight-version records in :mod:`~llmd_timeslice.orchestrator.
weight_ledger`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from llmd_timeslice.domain.group_settings import GroupSpec, SamplerEndpoint
from llmd_timeslice.domain.switches import EngineFault, EngineReading, SwitchKind, SwitchRecord
from llmd_timeslice.domain.waiter_policy import waiter_policy
from llmd_timeslice.orchestrator.clock import Clock, TimerHandle
from llmd_timeslice.orchestrator.errors import (
    GroupFault,
    InvalidArgument,
    LockOrderViolation,
    NotHolder,
    OrchestratorError,
    StaleFencingToken,
    StaleWeightVersion,
    StateNotSaved,
    SwitchFailed,
)
from llmd_timeslice.orchestrator.lease import AcquireResult, Lease, Waiter, YieldResult
from llmd_timeslice.orchestrator.phases import (
    IGNORED,
    STABLE_PHASES,
    WIRE_STATE,
    GroupCommand,
    GroupPhase,
    GroupState,
    IllegalTransition,
    accepts,
    check,
)
from llmd_timeslice.orchestrator.sampler_fleet import SamplerFleet
from llmd_timeslice.orchestrator.sampler_fleet import judge_engines as judge_fleet
from llmd_timeslice.orchestrator.switch import SwitchActions
from llmd_timeslice.orchestrator.weight_ledger import RejectedWeights, SyncProblem
from llmd_timeslice.orchestrator.yield_desk import YieldDesk
from llmd_timeslice.orchestrator.yield_requests import (
    YieldAnswer,
    YieldAsk,
    YieldStats,
)
from llmd_timeslice.weights.update import InvalidWeightUpdate, WeightUpdate

__all__ = [
    "SAMPLERS",
    "Command",
    "Group",
    "GroupContext",
    "RestoreOutcome",
    "judge_engines",
    "pick_waiter",
]

log = logging.getLogger(__name__)

C = GroupCommand
P = GroupPhase

SAMPLERS = "<samplers>"
""":attr:`Group.loaded_job` while the samplers hold the accelerators."""

_HOLDER_COMMANDS = frozenset({C.YIELD, C.HEARTBEAT, C.PUBLISH_WEIGHTS})
_NO_REPLY = object()


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


@dataclass(eq=False)
class _Switch:
    """The switch in flight: its record, the waiter it is for (to a job), and replies due when it ends."""

    record: SwitchRecord
    waiter: Waiter | None = None
    replies: list[asyncio.Future[Any]] = field(default_factory=list)


def pick_waiter(g: Group) -> Waiter:
    """The next waiter of ``g`` by its policy, the registered waiter policy of that name (``g.waiters`` is in
    arrival order and not empty; :mod:`llmd_timeslice.orchestrator.waiter_policy`)."""
    policy = waiter_policy(str(g.spec.policy))
    return policy.pick(g.waiters, priorities=g.spec.job_priorities, last_granted=g.last_granted)


def judge_engines(g: Group, readings: dict[str, EngineReading]) -> dict[str, tuple[EngineFault, str]]:
    """Sampler address -> (fault, why) for each serving sampler of ``g`` whose engine cannot be serving what the
    group records (:func:`~llmd_timeslice.orchestrator.sampler_fleet.judge_engines`)."""
    return judge_fleet(g.spec.samplers, g.fleet, readings)


class Group:
    """One group's state and the task that runs it. Read its attributes freely; change it only by commands
    (:meth:`Orchestrator.acquire` and friends). Legal sequences: :mod:`llmd_timeslice.orchestrator.phases`."""

    def __init__(self, spec: GroupSpec, ctx: GroupContext) -> None:
        self._ctx = ctx
        self.spec = spec.copy()
        self.phase = P.SERVING if spec.samplers else P.FREE
        self.state_since = ctx.clock.wall()
        self.holder: str | None = None
        self.lease: Lease | None = None
        self.last_token = 0
        self.deferred_job: str | None = None
        self.history: deque[SwitchRecord] = deque(maxlen=50)
        self.last_error = ""
        self.expired_jobs: dict[str, str] = {}  # job -> why its lease was reclaimed
        self.grants = 0
        self.last_granted: dict[str, int] = {}  # job -> number of its last grant (round-robin)
        self.weights: WeightUpdate | None = None  # the latest published weight version
        self.weights_publisher: str | None = None
        self.publishers: set[str] = set()  # jobs that published a weight version at their last grant
        self.published_in_grant = False
        self.last_good: WeightUpdate | None = None  # the latest version that loaded and nobody rejected
        self.rejected: RejectedWeights | None = None
        self.fleet = SamplerFleet((s.address for s in spec.samplers), ctx.clock)
        self.weight_sync_errors: dict[str, list[SyncProblem]] = {}  # job -> its version's problems (next acquire)
        self.yield_desk = YieldDesk(spec.group_id, ctx.clock)
        self._waiters: deque[Waiter] = deque()
        self._epoch = 0
        self._switch: _Switch | None = None
        self._pending_spec: GroupSpec | None = None
        self._pending_replies: list[asyncio.Future[Any]] = []
        self._pending_settings: GroupSpec | None = None
        self._reading = False
        self._lease_timer: TimerHandle | None = None
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
    def yield_stats(self) -> YieldStats:
        """Counts of yield requests since the orchestrator started (:attr:`yield_desk`)."""
        return self.yield_desk.stats

    @property
    def waiters(self) -> tuple[Waiter, ...]:
        """Jobs waiting for the group, in arrival order (ones that gave up excluded)."""
        return tuple(w for w in self._waiters if not w.future.done())

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
    def serving_version(self) -> int:
        """Highest weight version any in-service sampler of the group serves (0: the initial weights)."""
        return max((v for a, v in self.sampler_versions.items() if a not in self.sampler_errors), default=0)

    @property
    def weights_can_change(self) -> bool:
        """Whether a newer weight version may reach the samplers: a job holds or waits for the group (it may publish
        one), or a published version is not served yet."""
        target = self.target_weights
        return self.holder is not None or bool(self._waiters) or (target is not None and self.serving_version < target.version)

    @property
    def target_weights(self) -> WeightUpdate | None:
        """The version every wake converges to: the latest published one, or the last good one while that is
        rejected."""
        if self.weights is not None and self.rejected is not None and self.rejected.version == self.weights.version:
            return self.last_good
        return self.weights

    async def wait_until(self, predicate: Callable[[Group], bool], timeout_s: float | None = None) -> None:
        """Return once ``predicate(self)`` holds (checked now and after every command the group handles)."""
        if predicate(self):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._watchers.append((predicate, fut))
        await asyncio.wait_for(fut, timeout_s)

    # ------------------------------------------------------------------ commands
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
                _fail(cmd.reply, exc)
            except Exception as exc:  # a bug: the group may be half-changed; put it in a safe phase and say so
                await self._recover(cmd, exc, before)
            self._notify_watchers()
            self._ctx.note_weights_final(self)

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
        _fail(cmd.reply, err)
        try:
            for t in list(self._effects):  # a step's outcome would land in a phase that no longer expects it
                t.cancel()
            self._reading = False
            lease = self.lease
            lease_kept = (
                before[0] is P.HELD
                and phase is P.HELD
                and self.holder is not None
                and self.holder == before[1]
                and lease is not None
                and lease.token == before[2]
                and lease.job_id == self.holder
            )
            sw, self._switch = self._switch, None
            if not lease_kept:  # nothing would grant them: they get the error now
                for fut in [w.future for w in self._waiters] + ([sw.waiter.future] if sw and sw.waiter else []):
                    _fail(fut, err)
                self._waiters.clear()
            for r in sw.replies if sw else []:
                _fail(r, err)
            if lease_kept:
                to = P.HELD  # the holder keeps the accelerators it was told it has; only this command failed
            elif phase in (P.FREE, P.DEFERRED) and not self.spec.samplers:
                to = phase
            else:
                asked = cmd.job_id if cmd.kind in _HOLDER_COMMANDS else None
                for job in {j for j in (self.holder, self.lease.job_id if self.lease else None, asked) if j}:
                    self.expired_jobs[job] = f"its lease was reclaimed after an {why}; acquire again"
                    log.error("group=%s job=%s lease reclaimed after the internal error", self.group_id, job)
                self.holder, self.lease = None, None
                if self._lease_timer is not None:
                    self._lease_timer.cancel()
                    self._lease_timer = None
                self.deferred_job = None
                to = P.OUT_OF_SERVICE if self.spec.samplers else P.FREE
            if to is P.OUT_OF_SERVICE:
                for smp in self.spec.samplers:
                    self.sampler_errors.setdefault(smp.address, f"state unknown after an {why}")
            self.last_error = why + ("" if to is phase else f"; the group went to {to.name}")
            self._enter(to, C.INTERNAL_ERROR)
            if to is P.OUT_OF_SERVICE and not self.fleet.repair_armed:
                self._schedule_repair()  # it was OUT_OF_SERVICE already, with its timer just fired or cancelled
            self._dirty = True
            await self._save(strict=False)
        except Exception as again:  # the recovery itself failed: say so loudly; the next command finds what is left
            log.critical("group=%s recovery after %s failed: %r", self.group_id, why, again, exc_info=again)
            self.last_error = f"{why}; recovery failed: {again!r}"

    async def _dispatch(self, cmd: Command) -> None:
        kind = cmd.kind
        if kind in (C.AUDITED, C.PROBED):
            self._reading = False
        if kind in _HOLDER_COMMANDS:
            self._check_holder(cmd)
        if not accepts(self.phase, kind):
            if (self.phase, kind) in IGNORED:
                log.debug("group=%s %s ignored in phase %s", self.group_id, kind.name, self.phase.name)
                return
            raise IllegalTransition(self.group_id, self.phase, kind)
        result = await self._handlers[kind](self, cmd)
        if self._pending_spec is not None and self.phase in STABLE_PHASES:
            spec, replies = self._pending_spec, self._pending_replies
            self._pending_spec, self._pending_replies = None, []
            await self._apply_spec(spec, replies)
        if self._pending_settings is not None and self.phase in STABLE_PHASES and self.phase is not P.HELD:
            self._apply_settings(self._pending_settings)
            self._pending_settings = None
            log.info("group=%s deferred settings applied", self.group_id)
        if self._dirty:
            await self._save(strict=False)
        if cmd.reply is not None and result is not _NO_REPLY and not cmd.reply.done():
            cmd.reply.set_result(result)

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

    def _enter(self, to: GroupPhase, kind: GroupCommand) -> None:
        """Move to ``to`` because of ``kind`` (checked against the table)."""
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
            self._cancel_repair(reset=True)
        if to is P.SERVING:
            self.unreachable_engines.clear()
        if frm is P.OUT_OF_SERVICE and to is P.REPAIRING:
            self._cancel_repair(reset=False)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run a step of this group as a task it keeps (so it cannot be collected mid-flight)."""
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.group_id}-{name}")
        self._effects.add(task)
        task.add_done_callback(self._effects.discard)

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

    # ------------------------------------------------------------------ holders
    def _check_holder(self, cmd: Command) -> None:
        job = cmd.job_id
        if self.holder != job:
            why = self.expired_jobs.get(job)
            raise NotHolder(
                f"job {job!r} does not hold group {self.group_id!r} (holder: {self.holder!r})" + (f"; {why}" if why else "")
            )
        lease = self.lease
        if cmd.token and lease is not None and cmd.token != lease.token:
            raise StaleFencingToken(
                f"fencing token {cmd.token} of job {job!r} is stale: group {self.group_id!r} is at "
                f"token {lease.token}; this holder must stop and acquire again"
            )
        if cmd.kind is not C.HEARTBEAT and not cmd.token and lease is not None and lease.expires_at is not None:
            # A holder that heartbeats knows its fencing token: a yield or publish for it without the token is
            # refused, so a caller that merely knows the job id cannot end or steer the lease.
            raise StaleFencingToken(
                f"group {self.group_id!r}: job {job!r}'s lease is kept alive by heartbeats; "
                "this call must carry its fencing token (x-llmd-timeslice-fencing-token)"
            )

    async def _grant(self, w: Waiter, kind: GroupCommand) -> None:
        """Give the lease to ``w`` (saved before the waiter learns of it)."""
        self._enter(P.HELD, kind)
        job = w.job_id
        self.grants += 1
        self.last_granted[job] = self.grants
        self.holder = job
        self.last_token += 1
        self.lease = Lease(job, self.last_token, self.spec.lease_ttl_s, granted_at=self._ctx.clock.now())
        self.expired_jobs.pop(job, None)
        self.published_in_grant = False
        self.deferred_job = None
        self.yield_desk.new_grant()
        self._dirty = True
        try:
            await self._save(strict=True)
        except StateNotSaved as exc:
            self.last_error = f"grant to job {job!r} taken back: {exc}"
            log.error("group=%s %s", self.group_id, self.last_error)
            self.holder, self.lease = None, None
            _fail(w.future, StateNotSaved(self.last_error))
            self._dequeue(w)
            await self._release(job, C.GRANT_NOT_SAVED)
            return
        if not w.future.done():
            w.future.set_result(
                AcquireResult(int((self._ctx.clock.now() - w.enqueued_at) * 1000), False, self._weight_sync_error_for(job))
            )
        if self._ctx.lease_events is not None:
            self._ctx.lease_events.granted(job, self.group_id)
        self._dequeue(w)  # only now: until it knows, an internal error still finds it in the queue and fails it

    def _dequeue(self, w: Waiter) -> None:
        if w in self._waiters:
            self._waiters.remove(w)

    def _weight_sync_error_for(self, job: str) -> str:
        """The weight-sync problems kept for ``job`` since it published (popped: told once), about the samplers still
        without that version in service now only: what a repair or a restarted engine fixed meanwhile is not told
        (logged here instead). "" when nothing is still wrong."""
        problems = self.weight_sync_errors.pop(job, [])
        texts, repaired = [], []
        for p in problems:
            still = {
                a: why for a, why in p.reasons.items() if a in self.sampler_errors or self.sampler_versions.get(a, 0) < p.version
            }
            repaired += sorted(set(p.reasons) - set(still))
            if still:
                texts.append(p.text(still))
        if repaired:
            log.info(
                "group=%s weight-version problems of job %s on %s were repaired before its next acquire: not reported",
                self.group_id,
                job,
                repaired,
            )
        return "; ".join(texts)

    async def _release(self, job: str, kind: GroupCommand) -> YieldResult:
        """The holder is gone (yield, lease expired, grant taken back): the next waiter, the samplers, or a
        deferred snapshot."""
        if not self.published_in_grant:
            self.publishers.discard(job)  # the auto sleep policy keeps level 2 for jobs that keep publishing
        self._end_yield_request(job, honoured=kind is C.YIELD)
        if self._ctx.lease_events is not None:
            self._ctx.lease_events.released(job, self.group_id, bool(self.waiters))
        self.holder, self.lease = None, None
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
        self._dirty = True
        live = self.waiters
        if live:
            await self._grant(pick_waiter(self), kind)  # job to job: the samplers stay asleep
            return YieldResult(len(live), False)
        if self.spec.samplers:
            self._start_resume(SwitchKind.TO_SAMPLERS, kind, after_job=job)
            return YieldResult(0, False)
        if kind is C.GRANT_NOT_SAVED:
            self._enter(P.FREE, kind)
            return YieldResult(0, False)
        self.deferred_job = job
        self._enter(P.DEFERRED, kind)
        return YieldResult(0, True)

    # ------------------------------------------------------------------ yield requests
    def _end_yield_request(self, job: str, honoured: bool) -> None:
        self.yield_desk.end(self.lease, job, honoured)

    async def _on_yield_request(self, cmd: Command) -> YieldAnswer:
        ask = cmd.ask
        assert ask is not None
        self._enter(self.phase, C.YIELD_REQUEST)
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
        self._enter(P.HELD, C.YIELD_DEADLINE)
        self.yield_desk.deadline(self.lease, cmd.token, self.holder)

    # ------------------------------------------------------------------ handlers
    async def _on_acquire(self, cmd: Command) -> object:
        w = cmd.waiter
        assert w is not None
        if w.future.done():  # gave up before we got to it: nothing happens
            return _NO_REPLY
        job = w.job_id
        if self.holder == job:
            raise NotHolder(f"job {job!r} already holds group {self.group_id!r}; yield before acquiring again")
        if any(x.job_id == job for x in self.waiters):
            raise NotHolder(f"job {job!r} is already waiting for group {self.group_id!r}")
        if not self.spec.samplers:
            held = self._ctx.sampler_groups_held(job)
            if held:
                raise LockOrderViolation(
                    f"lock order: job {job!r} holds or waits for sampler group(s) {held} and asks for trainer group "
                    f"{self.group_id!r}; take the trainer group first, then the sampler group (weight sync holds "
                    "both), so that no two jobs can deadlock"
                )
        self._waiters.append(w)
        if self._ctx.lease_events is not None:
            self._ctx.lease_events.acquired(job, self.group_id, w.hints)
        if self.phase in (P.FREE, P.DEFERRED):
            await self._grant(w, C.ACQUIRE)  # nothing to switch: no samplers
        elif self.phase in (P.SERVING, P.OUT_OF_SERVICE):
            self._start_drain(C.ACQUIRE)
        else:
            self._enter(self.phase, C.ACQUIRE)  # queued until the switch in flight ends or the holder yields
        return _NO_REPLY

    async def _on_abandon(self, cmd: Command) -> bool:
        w = cmd.waiter
        assert w is not None
        self._enter(self.phase, C.ABANDON)
        if w.future.done():
            return False  # granted (or failed) before it gave up
        if w in self._waiters:
            self._waiters.remove(w)
            if self._ctx.lease_events is not None:
                self._ctx.lease_events.abandoned(w.job_id, self.group_id)
        w.future.cancel()
        return True

    async def _on_yield(self, cmd: Command) -> YieldResult:
        return await self._release(cmd.job_id, C.YIELD)

    async def _on_lease_expired(self, cmd: Command) -> None:
        lease = self.lease
        now = self._ctx.clock.now()
        if (
            lease is None
            or lease.token != cmd.token
            or self.holder != lease.job_id
            or lease.expires_at is None
            or now < lease.expires_at
        ):
            self._enter(P.HELD, C.LEASE_EXPIRED)  # a heartbeat renewed it meanwhile, or another grant
            return
        # Time the orchestrator could not run does not count against the holder: its heartbeats waited in a socket.
        heard_at = lease.expires_at - lease.ttl_s - lease.stall_credit_s
        credit = self._ctx.clock.stalled_s(heard_at)
        if credit > lease.stall_credit_s + 1e-6:
            lease.stall_credit_s = credit
            lease.expires_at = heard_at + lease.ttl_s + credit
            if now < lease.expires_at:
                log.warning(
                    "group=%s job=%s lease kept %.1f s longer: this orchestrator could not run for %.1f s since the "
                    "holder's last heartbeat (a stall of its process), so it could not hear the holder meanwhile",
                    self.group_id,
                    lease.job_id,
                    lease.expires_at - now,
                    credit,
                )
                self._arm_lease_timer(lease)
                self._enter(P.HELD, C.LEASE_EXPIRED)
                return
        why = (
            f"its lease (token {lease.token}) expired: no heartbeat for {lease.ttl_s:g} s, so the group was "
            "reclaimed; restart the job from its last checkpoint and acquire again"
        )
        log.error("group=%s job=%s %s", self.group_id, lease.job_id, why)
        self.expired_jobs[lease.job_id] = why
        self.last_error = f"job {lease.job_id!r}: {why}"
        await self._release(lease.job_id, C.LEASE_EXPIRED)

    async def _on_heartbeat(self, cmd: Command) -> Lease:
        lease = self.lease
        assert lease is not None
        self._enter(P.HELD, C.HEARTBEAT)
        if lease.ttl_s > 0:
            clock = self._ctx.clock
            if lease.expires_at is None:
                self._dirty = True  # armed: persisted, so a restarted orchestrator keeps expiring it
            lease.expires_at = clock.now() + lease.ttl_s
            lease.stall_credit_s = 0.0
            self._arm_lease_timer(lease)
        return replace(lease)

    def _arm_lease_timer(self, lease: Lease) -> None:
        if self._lease_timer is not None:
            self._lease_timer.cancel()
        assert lease.expires_at is not None
        token = lease.token
        self._lease_timer = self._ctx.clock.call_at(lease.expires_at, lambda: self.post(Command(C.LEASE_EXPIRED, token=token)))

    async def _on_publish(self, cmd: Command) -> Group:
        weights = cmd.weights
        if not self.spec.samplers:
            raise InvalidArgument(f"group {self.group_id!r} has no samplers to load weights into; publish on the sampler group")
        if not isinstance(weights, WeightUpdate):
            raise InvalidArgument("weights must be a WeightUpdate")
        latest = max(self.weights.version if self.weights else 0, max(self.sampler_versions.values(), default=0))
        if weights.version <= latest:
            raise StaleWeightVersion(
                f"weight version {weights.version} is not newer than group {self.group_id!r}'s "
                f"latest ({latest}); versions must increase"
            )
        self._enter(P.HELD, C.PUBLISH_WEIGHTS)
        self.weights = weights
        self.weights_publisher = cmd.job_id
        self.publishers.add(cmd.job_id)
        self.published_in_grant = True
        self.rejected = None
        self._dirty = True
        return self

    async def _on_spec_update(self, cmd: Command) -> object:
        spec = cmd.spec
        assert spec is not None
        replies = [r for r in (cmd.reply,) if r is not None]
        if self.phase not in STABLE_PHASES:
            # Applied when the switch in flight ends (the next stable phase); a newer update replaces this one.
            self._pending_spec = spec
            self._pending_replies.extend(replies)
            self._enter(self.phase, C.SPEC_UPDATE)
            return _NO_REPLY
        replies = self._pending_replies + replies
        self._pending_spec, self._pending_replies = None, []
        await self._apply_spec(spec, replies)
        return _NO_REPLY

    def _apply_settings(self, spec: GroupSpec) -> None:
        self.spec.apply_settings(spec)

    async def _apply_spec(self, spec: GroupSpec, replies: list[asyncio.Future[Any]]) -> None:
        """Apply a discovered spec in a stable phase (module doc of ``discovery/sync.py``)."""
        kind = C.SPEC_UPDATE
        have = {s.address: s for s in self.spec.samplers}
        want = {s.address: s for s in spec.samplers}
        removed = [s for a, s in have.items() if want.get(a) != s]
        added = [s for a, s in want.items() if have.get(a) != s]
        if removed:
            self.spec.samplers = [s for s in self.spec.samplers if s not in removed]
            for s in removed:
                self.sampler_versions.pop(s.address, None)
                self.sampler_errors.pop(s.address, None)
                self.unreachable_engines.discard(s.address)
            self._dirty = True
            log.info("group=%s samplers removed %s", self.group_id, [s.address for s in removed])
            try:
                await self._ctx.actions.retire_samplers(removed)
            except Exception as exc:
                log.error("group=%s taking removed samplers out of service failed: %s", self.group_id, exc)
        if added:
            self.spec.samplers = self.spec.samplers + added
            for s in added:
                self.sampler_versions[s.address] = 0
            self._dirty = True
        if spec.settings() != self.spec.settings():
            if self.phase is P.HELD:
                log.warning("group=%s is held: settings change deferred until its samplers are back", self.group_id)
                self._pending_settings = spec
            else:
                self._apply_settings(spec)
                self._pending_settings = None
        phase = self.phase
        if phase is P.HELD:
            if added:
                log.warning(
                    "group=%s is held by %r: samplers %s join now and serve after its next wake",
                    self.group_id,
                    self.holder,
                    [s.address for s in added],
                )
            self._enter(P.HELD, kind)
        elif added:
            log.info(
                "group=%s samplers added %s; waking/verifying them before they serve", self.group_id, [s.address for s in added]
            )
            self.deferred_job = None
            self._start_resume(SwitchKind.DISCOVERED, kind, samplers=added, replies=replies)
            return
        elif not self.spec.samplers and phase in (P.SERVING, P.OUT_OF_SERVICE):
            self._enter(P.FREE, kind)
        elif phase is P.OUT_OF_SERVICE and not self.sampler_errors:
            self._enter(P.SERVING, kind)
        else:
            self._enter(phase, kind)
        for r in replies:
            if not r.done():
                r.set_result(None)

    async def _on_start(self, cmd: Command) -> object:
        if self.phase is P.HELD:
            self._enter(P.HELD, C.START)
            try:
                await self._ctx.actions.publish_asleep(self.spec.copy())
            except Exception as exc:
                log.error("group=%s publishing held samplers ASLEEP failed: %s", self.group_id, exc)
            return None
        if self.phase is P.SERVING and cmd.reconcile and self.spec.samplers:
            self._start_resume(SwitchKind.RECONCILE, C.START, replies=[r for r in (cmd.reply,) if r is not None])
            return _NO_REPLY
        self._enter(self.phase, C.START)
        return None

    # ------------------------------------------------------------------ switch to a job
    def _start_drain(self, kind: GroupCommand) -> None:
        w = pick_waiter(self)
        rec = SwitchRecord(self.group_id, SwitchKind.TO_JOB, w.job_id, self._ctx.clock.wall())
        rec.sleep_level = self.spec.sleep_level_for(w.job_id, w.job_id in self.publishers)
        rec.cause = kind.value
        self._switch = _Switch(rec, w)
        self._enter(P.DRAINING, kind)
        self._spawn(self._step(self._ctx.actions.drain_samplers, self.spec.copy(), rec, C.DRAINED, C.DRAIN_FAILED), "drain")

    async def _step(
        self,
        action: Callable[[GroupSpec, SwitchRecord], Coroutine[Any, Any, None]],
        spec: GroupSpec,
        rec: SwitchRecord,
        ok: GroupCommand,
        failed: GroupCommand,
    ) -> None:
        try:
            await action(spec, rec)
        except Exception as exc:
            self.post(Command(failed, record=rec, error=exc))
            return
        self.post(Command(ok, record=rec))

    async def _on_drained(self, cmd: Command) -> None:
        assert self._switch is not None
        self._enter(P.SUSPENDING, C.DRAINED)
        self._spawn(
            self._step(self._ctx.actions.suspend_samplers, self.spec.copy(), self._switch.record, C.SUSPENDED, C.SUSPEND_FAILED),
            "suspend",
        )

    async def _on_suspended(self, cmd: Command) -> None:
        sw = self._switch
        assert sw is not None
        self._switch = None
        self._ctx.record(self, sw.record)
        for addr, why in sw.record.unreachable.items():  # down: no accelerator memory held; asleep before it serves
            self.sampler_errors[addr] = (
                f"its engine was down at the sleep ({why}); out of service, put to sleep when it answers again"
            )
            self.unreachable_engines.add(addr)
            self._dirty = True
        w = sw.waiter
        if w is not None and not w.future.done():
            await self._grant(w, C.SUSPENDED)
        elif self.waiters:  # the waiter it was for gave up; the next one gets it
            await self._grant(pick_waiter(self), C.SUSPENDED)
        else:
            self._start_resume(SwitchKind.TO_SAMPLERS, C.SUSPENDED)

    async def _on_switch_failed(self, cmd: Command) -> None:
        sw = self._switch
        assert sw is not None
        self._switch = None
        rec = sw.record
        rec.ok, rec.error = False, str(cmd.error)
        self._ctx.record(self, rec)
        self.last_error = f"switch to job {rec.job_id!r} failed: {cmd.error}"
        log.error("group=%s %s", self.group_id, self.last_error)
        w = sw.waiter
        if w is not None:
            if w in self._waiters:
                self._waiters.remove(w)
            _fail(w.future, SwitchFailed(self.last_error + "; samplers are being woken again"))
        # Rollback. Some samplers may be asleep (and one that failed half-asleep): wake and verify every one.
        self._start_resume(SwitchKind.TO_SAMPLERS, cmd.kind, after_job=rec.job_id)

    # ------------------------------------------------------------------ switch to the samplers
    def resume_record(self, kind: SwitchKind, after_job: str = "", samplers: list[SamplerEndpoint] | None = None) -> SwitchRecord:
        """A record for waking ``samplers`` (default: all): their weight versions, and the version to load (the
        target) when any is below it (always for a reconcile or repair: an engine may have restarted meanwhile)."""
        rec = SwitchRecord(self.group_id, kind, after_job, self._ctx.clock.wall())
        for smp in self.spec.samplers if samplers is None else samplers:
            rec.sampler_versions[smp.address] = self.sampler_versions.get(smp.address, 0)
        target = self.target_weights
        if target is not None and (
            kind in (SwitchKind.RECONCILE, SwitchKind.REPAIR) or any(v < target.version for v in rec.sampler_versions.values())
        ):
            rec.weights = target
        return rec

    def _start_resume(
        self,
        kind: SwitchKind,
        cmd: GroupCommand,
        after_job: str = "",
        samplers: list[SamplerEndpoint] | None = None,
        replies: list[asyncio.Future[Any]] | None = None,
        engine_faults: dict[str, EngineFault] | None = None,
    ) -> None:
        targets = list(self.spec.samplers) if samplers is None else samplers
        rec = self.resume_record(kind, after_job, targets)
        rec.cause = cmd.value
        rec.engine_faults = dict(engine_faults or {})
        self._switch = _Switch(rec, None, list(replies or []))
        repair = kind is SwitchKind.REPAIR
        self._enter(P.REPAIRING if repair else P.RESUMING, cmd)
        spec = self.spec.copy(samplers=targets)
        done = C.REPAIRED if repair else C.RESUMED
        take_out = self._ctx.actions.take_out_of_service if engine_faults else None
        self._spawn(self._resume_step(spec, rec, done, take_out), "repair" if repair else "resume")

    async def _resume_step(
        self,
        spec: GroupSpec,
        rec: SwitchRecord,
        done: GroupCommand,
        take_out: Callable[[GroupSpec], Coroutine[Any, Any, None]] | None,
    ) -> None:
        if take_out is not None:
            try:
                await take_out(spec)
            except Exception as exc:
                log.error("group=%s taking %s out of service failed: %s", spec.group_id, [s.address for s in spec.samplers], exc)
        try:
            await self._ctx.actions.resume_samplers(spec, rec)
        except Exception as exc:
            self.post(Command(done, record=rec, error=exc))
            return
        self.post(Command(done, record=rec))

    async def _on_resumed(self, cmd: Command) -> None:
        sw = self._switch
        assert sw is not None and cmd.record is sw.record
        self._switch = None
        rec = sw.record
        if cmd.error is not None:
            rec.ok, rec.error = False, str(cmd.error)
            self.last_error = {
                SwitchKind.REPAIR: f"repair wake failed: {cmd.error}; retrying with back-off",
                SwitchKind.DISCOVERED: f"new samplers failed verification: {cmd.error}; they stay out of service",
            }.get(rec.kind, f"waking the samplers failed: {cmd.error}; they stay out of service")
            log.error("group=%s %s", self.group_id, self.last_error)
        elif rec.kind is SwitchKind.REPAIR:
            self.last_error = ""
            log.warning("group=%s repaired: %s back in service", self.group_id, sorted(rec.sampler_versions))
        self._merge_resume(rec)
        self._ctx.record(self, rec)
        if self.waiters:
            self._start_drain(cmd.kind)
        elif self.sampler_errors:
            self._enter(P.OUT_OF_SERVICE, cmd.kind)
        else:
            self._enter(P.SERVING, cmd.kind)
        for r in sw.replies:
            if not r.done():
                r.set_result(None)

    def _merge_resume(self, rec: SwitchRecord) -> None:
        """Take the outcome of a wake (versions loaded, samplers that failed or rejected the version) into the
        group; a failed or rejected load is kept for the publisher's next acquire."""
        known = {s.address for s in self.spec.samplers}
        for address, version in rec.sampler_versions.items():
            if address in known:
                self.sampler_versions[address] = version
                if address not in rec.sampler_errors:
                    self.sampler_errors.pop(address, None)
                    self.unreachable_engines.discard(address)
        self.sampler_errors.update({a: e for a, e in rec.sampler_errors.items() if a in known})
        self._dirty = True
        w = rec.weights
        if w is None:
            return
        publisher = self.weights_publisher or rec.job_id
        n = len(rec.sampler_versions)
        loaded = [a for a, v in rec.sampler_versions.items() if v == w.version and a not in rec.sampler_errors]
        problems: list[SyncProblem] = []
        if rec.weights_rejected:
            reasons = "; ".join(f"{a}: {e}" for a, e in sorted(rec.weights_rejected.items()))
            if not loaded and self.weights is not None and w.version == self.weights.version:
                # Nobody could load it: not retried until a newer version is published.
                self.rejected = RejectedWeights(w.version, reasons)
                problems.append(SyncProblem(w.version, "rejected", dict(rec.weights_rejected), n, self.serving_version))
            else:
                problems.append(SyncProblem(w.version, "refused", dict(rec.weights_rejected), n))
            log.error("group=%s %s", self.group_id, problems[-1].text(problems[-1].reasons))
        if loaded and (self.last_good is None or w.version > self.last_good.version):
            self.last_good = w
        if rec.sampler_errors:
            problems.append(SyncProblem(w.version, "not_loaded", dict(rec.sampler_errors), n))
        if problems:
            self.weight_sync_errors[publisher] = problems

    # ------------------------------------------------------------------ audit and repair
    async def _on_audit_tick(self, cmd: Command) -> None:
        self._enter(self.phase, C.AUDIT_TICK)
        actions = self._ctx.actions
        if self._reading or not actions.can_read_engines:
            return
        if self.phase is P.HELD:  # a sampler whose engine was down at the sleep: is it back (and awake)?
            samplers, done = [s for s in self.spec.samplers if s.address in self.unreachable_engines], C.PROBED
        elif self.phase is P.SERVING:
            samplers, done = list(self.spec.samplers), C.AUDITED
        else:  # OUT_OF_SERVICE: is an engine that refused connections back?
            samplers, done = [s for s in self.spec.samplers if s.address in self.sampler_errors], C.PROBED
        if not samplers:
            return
        self._reading = True
        self._spawn(self._read(self.spec.copy(samplers=samplers), done, self._epoch), "audit")

    async def _read(self, spec: GroupSpec, done: GroupCommand, epoch: int) -> None:
        try:
            readings = await self._ctx.actions.read_engines(spec)
        except Exception as exc:  # a reading is advisory: the next tick tries again
            log.warning("group=%s engine audit could not read the engines: %s", spec.group_id, exc)
            readings = {}
        self.post(Command(done, readings=readings, epoch=epoch))

    async def _on_audited(self, cmd: Command) -> None:
        faults = judge_engines(self, cmd.readings or {}) if cmd.epoch == self._epoch else {}
        if not faults:
            self._enter(P.SERVING, C.AUDITED)
            return
        for addr, (fault, why) in sorted(faults.items()):
            log.error("group=%s sampler %s: %s; taking it out of service to wake it again", self.group_id, addr, why)
            self.sampler_errors[addr] = why
            if fault is EngineFault.RESTARTED:
                self.sampler_versions[addr] = 0  # what a restarted engine serves: its initial weights
            elif fault is EngineFault.UNREACHABLE:
                self.unreachable_engines.add(addr)
        self.last_error = "; ".join(f"{a}: {why}" for a, (_, why) in sorted(faults.items()))
        bad = [s for s in self.spec.samplers if s.address in faults]
        self._start_resume(SwitchKind.REPAIR, C.AUDITED, samplers=bad, engine_faults={a: f for a, (f, _) in faults.items()})

    async def _on_probed(self, cmd: Command) -> None:
        if self.phase is P.HELD:
            self._on_probed_held(cmd)
            return
        back = False
        if cmd.epoch == self._epoch:
            for addr, r in (cmd.readings or {}).items():
                if r.unreachable:
                    self.unreachable_engines.add(addr)
                elif addr in self.unreachable_engines:
                    self.unreachable_engines.discard(addr)
                    log.warning("group=%s sampler %s: its engine answers again; repairing now", self.group_id, addr)
                    back = True
        if back:
            self._start_repair(C.PROBED)
        else:
            self._enter(P.OUT_OF_SERVICE, C.PROBED)

    def _on_probed_held(self, cmd: Command) -> None:
        """While a job holds the group: each sampler left out of the sleep that answers again is put to sleep (an
        engine back from a restart is awake and takes accelerator memory), or counted asleep if it already is."""
        back = []
        if cmd.epoch == self._epoch:
            for addr, r in sorted((cmd.readings or {}).items()):
                if r.unreachable or addr not in self.unreachable_engines:
                    continue
                if r.sleeping:
                    self._returned_asleep(addr, "it reports itself asleep")
                else:
                    back.append(addr)
        self._enter(P.HELD, C.PROBED)
        if back and not self.fleet.returning:
            samplers = [s for s in self.spec.samplers if s.address in back]
            log.warning("group=%s samplers %s answer again while the group is held: putting them to sleep", self.group_id, back)
            rec = SwitchRecord(self.group_id, SwitchKind.TO_JOB, self.holder or "", self._ctx.clock.wall())
            rec.sleep_level = self.spec.sleep_level_for(self.holder or "", (self.holder or "") in self.publishers)
            self.fleet.returning = set(back)
            spec = self.spec.copy(samplers=samplers)
            self._spawn(self._step(self._ctx.actions.suspend_samplers, spec, rec, C.RETURNED, C.RETURNED), "returned")

    def _returned_asleep(self, addr: str, how: str) -> None:
        self.unreachable_engines.discard(addr)
        self.sampler_errors.pop(addr, None)
        self._dirty = True
        log.warning(
            "group=%s sampler %s is back and asleep (%s); it serves again when the holder yields", self.group_id, addr, how
        )

    async def _on_returned(self, cmd: Command) -> None:
        rec, addrs = cmd.record, self.fleet.returning
        self.fleet.returning = set()
        if cmd.error is not None:  # those that did fall asleep report it at the next probe, the others are tried again
            log.error("group=%s putting returned samplers %s to sleep failed: %s", self.group_id, sorted(addrs), cmd.error)
        elif rec is not None:
            for addr in sorted(addrs - set(rec.unreachable)):
                self._returned_asleep(addr, "put to sleep, verified")
        self._enter(P.HELD, C.RETURNED)

    async def _on_repair_tick(self, cmd: Command) -> None:
        log.warning(
            "group=%s samplers out of service (%s); retrying the wake",
            self.group_id,
            self.last_error or ", ".join(sorted(self.sampler_errors)),
        )
        self._start_repair(C.REPAIR_TICK)

    def _start_repair(self, kind: GroupCommand) -> None:
        bad = [s for s in self.spec.samplers if s.address in self.sampler_errors]
        self._start_resume(SwitchKind.REPAIR, kind, samplers=bad)

    def _schedule_repair(self) -> None:
        self.fleet.schedule_repair(self._ctx.repair_first_s, self._ctx.repair_max_s, lambda: self.post(Command(C.REPAIR_TICK)))

    def _cancel_repair(self, reset: bool) -> None:
        self.fleet.cancel_repair(reset)

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        """What survives a restart, JSON-serialisable."""
        lease = self.lease
        return {
            "state": self.state.value,
            "phase": self.phase.value,
            "holder": self.holder,
            "loaded_job": self.deferred_job if self.phase is P.DEFERRED else self.holder,
            "last_token": self.last_token,
            "lease": None
            if lease is None
            else {"job_id": lease.job_id, "token": lease.token, "ttl_s": lease.ttl_s, "armed": lease.expires_at is not None},
            "expired_jobs": dict(self.expired_jobs),
            "weights": None if self.weights is None else self.weights.to_json(),
            "last_good": None if self.last_good is None else self.last_good.to_json(),
            "rejected": None if self.rejected is None else {"version": self.rejected.version, "error": self.rejected.error},
            "weights_publisher": self.weights_publisher,
            "sampler_versions": dict(self.sampler_versions),
            "publishers": sorted(self.publishers),
        }

    def restore(self, d: dict[str, Any] | None) -> RestoreOutcome:
        """Load a :meth:`snapshot` before the group's task runs (the phase is set directly, not by a command)."""
        if d:
            self.last_token = int(d.get("last_token", 0))
            self.expired_jobs = dict(d.get("expired_jobs") or {})
            for attr in ("weights", "last_good"):
                try:
                    setattr(self, attr, WeightUpdate.from_json(d[attr]) if d.get(attr) else None)
                except (InvalidWeightUpdate, KeyError, TypeError, ValueError) as exc:
                    log.error("group=%s persisted %s ignored: %s", self.group_id, attr, exc)
            rej = d.get("rejected")
            self.rejected = RejectedWeights(int(rej["version"]), str(rej.get("error", ""))) if rej else None
            self.weights_publisher = d.get("weights_publisher")
            known = {s.address for s in self.spec.samplers}
            self.sampler_versions.update({a: int(v) for a, v in (d.get("sampler_versions") or {}).items() if a in known})
            self.publishers = set(d.get("publishers") or [])
            lease = d.get("lease")
            if d.get("holder") and lease:
                self.holder = d["holder"]
                self.lease = Lease(lease["job_id"], int(lease["token"]), float(lease["ttl_s"]), granted_at=self._ctx.clock.now())
                self.phase = P.HELD  # restored before the task runs: no transition
                if lease.get("armed") and self.lease.ttl_s > 0:
                    self.lease.expires_at = self._ctx.clock.now() + self.lease.ttl_s
                    self._arm_lease_timer(self.lease)
            elif d.get("state") == GroupState.IDLE_YIELDED.value and not self.spec.samplers and d.get("loaded_job"):
                self.deferred_job = d["loaded_job"]
                self.phase = P.DEFERRED
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
        if self._lease_timer is not None:
            self._lease_timer.cancel()
        self.fleet.cancel_repair(reset=False)
        self.yield_desk.cancel_timer()
        tasks = [t for t in (self._task, *self._effects) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        err = SwitchFailed("orchestrator is shutting down")
        for w in self._waiters:
            _fail(w.future, err)
        while not self._queue.empty():
            cmd = self._queue.get_nowait()
            _fail(cmd.reply, err)
        for r in self._pending_replies + (self._switch.replies if self._switch else []):
            _fail(r, err)
        for _, fut in self._watchers:
            _fail(fut, err)

    _handlers: dict[GroupCommand, Callable[[Group, Command], Coroutine[Any, Any, Any]]] = {
        C.ACQUIRE: _on_acquire,
        C.ABANDON: _on_abandon,
        C.YIELD: _on_yield,
        C.HEARTBEAT: _on_heartbeat,
        C.PUBLISH_WEIGHTS: _on_publish,
        C.LEASE_EXPIRED: _on_lease_expired,
        C.SPEC_UPDATE: _on_spec_update,
        C.AUDIT_TICK: _on_audit_tick,
        C.REPAIR_TICK: _on_repair_tick,
        C.START: _on_start,
        C.DRAINED: _on_drained,
        C.DRAIN_FAILED: _on_switch_failed,
        C.SUSPENDED: _on_suspended,
        C.SUSPEND_FAILED: _on_switch_failed,
        C.RESUMED: _on_resumed,
        C.REPAIRED: _on_resumed,
        C.AUDITED: _on_audited,
        C.PROBED: _on_probed,
        C.RETURNED: _on_returned,
        C.YIELD_REQUEST: _on_yield_request,
        C.YIELD_DEADLINE: _on_yield_deadline,
    }


def _fail(fut: asyncio.Future[Any] | None, exc: BaseException) -> None:
    if fut is not None and not fut.done():
        fut.set_exception(exc)
        fut.exception()  # retrieved: nobody may be waiting any more (no "never retrieved" warning)
