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
import dataclasses
import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from llmd_timeslice.weights.update import InvalidWeightUpdate, WeightUpdate

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
    """A phase switch step failed; the message says which and what state the group is in (ABORTED)."""


class LockOrderViolation(OrchestratorError):
    """A job holding (or waiting for) a sampler group asks for a trainer group (FAILED_PRECONDITION)."""


class StaleWeightVersion(OrchestratorError):
    """A published weight version is not newer than the group's latest one (FAILED_PRECONDITION)."""


class StaleFencingToken(OrchestratorError):
    """A call carries a fencing token that is not the group's current one (FAILED_PRECONDITION)."""


@dataclass
class Lease:
    """The current grant of a group: ``token`` increases with every grant; ``expires_at`` is a
    monotonic time once armed by a heartbeat (None before: the holder is never expired)."""

    job_id: str
    token: int
    ttl_s: float
    expires_at: float | None = None


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
    lease_ttl_s: float = 30.0
    policy: str = "fifo"
    """Scheduling policy of the waiters: ``fifo``, ``priority`` (highest ``job_priorities`` first, FIFO
    among equals) or ``round_robin`` (the job granted least recently first: phase-level multiplexing of
    several RL jobs on one set of accelerators)."""
    job_priorities: dict[str, int] = field(default_factory=dict)
    sleep_level_policy: str = "fixed"
    """``fixed``: samplers sleep at ``sleep_level`` for every job. ``auto``: level 2 (discard: no host copy of
    weights about to be replaced) for a job that published a weight version at its previous grant of this
    group, ``sleep_level`` otherwise. ``job_sleep_levels`` overrides both per job."""
    job_sleep_levels: dict[str, int] = field(default_factory=dict)

    def sleep_level_for(self, job_id: str, publishes_weights: bool) -> int:
        """The sleep level the samplers take when ``job_id`` acquires the group."""
        if job_id in self.job_sleep_levels:
            return self.job_sleep_levels[job_id]
        if self.sleep_level_policy == "auto" and publishes_weights:
            return 2
        return self.sleep_level


@dataclass
class SwitchRecord:
    """One phase switch, for status and metrics: ``phases`` maps step name -> seconds."""

    group_id: str
    kind: str  # "to_job" (samplers -> job), "to_samplers", "job_to_job", "repair", "reconcile"
    job_id: str
    started_at: float
    phases: dict[str, float] = field(default_factory=dict)
    ok: bool = True
    error: str = ""
    sleep_level: int = 0
    """to_job: the level the samplers sleep at (0: the group's ``sleep_level``)."""
    weights: WeightUpdate | None = None
    """to_samplers: the weight version to load while waking (None: wake with the weights they have)."""
    sampler_versions: dict[str, int] = field(default_factory=dict)
    """to_samplers: address -> weight version; the actions update it for each sampler woken (and loaded)."""
    sampler_errors: dict[str, str] = field(default_factory=dict)
    """to_samplers: address -> why its wake (or weight load) failed; it stays out of service."""
    engine_faults: dict[str, str] = field(default_factory=dict)
    """repair after an engine audit: address -> what the audit found ("restarted", "asleep", "unreachable")."""
    drain_cut: list[str] = field(default_factory=list)
    """to_job: requests the gates answered 503 drain_deadline at the drain deadline (x-request-id each)."""
    parked_requests: dict[str, str] = field(default_factory=dict)
    """to_job: address -> requests found inside its engine after it slept and what was done ("2 aborted")."""


class SwitchActions(Protocol):
    """What a phase switch does to the outside world (implemented over gRPC in ``actions.py``)."""

    async def suspend_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:
        """Drain (gate barrier), sleep and verify every sampler; raise on failure."""

    async def resume_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:
        """Wake and verify every sampler, then publish it SERVING; raise on failure."""


class EngineAuditActions(Protocol):
    """Optional part of :class:`SwitchActions`: read the engines themselves, so that an engine that restarted
    on its own (initial weights again) or sleeps while it should serve is caught between switches."""

    async def read_engines(self, spec: GroupSpec) -> dict[str, EngineReading]:
        """Sampler address -> what its engine reports now (samplers that could not be read are left out)."""

    async def take_out_of_service(self, spec: GroupSpec) -> None:
        """Stop the gates from steering new requests to ``spec.samplers`` (published DRAINING)."""


@dataclass(frozen=True)
class EngineReading:
    """What an engine reports about itself: its weight version label (None: it has none) and whether it sleeps;
    or, in ``unreachable``, why it could not be read because it refused the connection."""

    weight_version: str | None
    sleeping: bool
    unreachable: str = ""


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
    weight_sync_error: str = ""
    """Why the weight version this job published last could not be loaded into every sampler ("" if it was)."""


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
        self.lease: Lease | None = None
        self.last_token = 0
        self.expired_jobs: dict[str, str] = {}  # job -> why its lease was reclaimed
        self.grants = 0
        self.last_granted: dict[str, int] = {}  # job -> number of its last grant (round-robin)
        self._driver: asyncio.Task | None = None
        self._lease_timer: asyncio.TimerHandle | None = None
        self.on_change: Callable[[Group], None] | None = None
        self.weights: WeightUpdate | None = None  # the latest published weight version (the samplers' target)
        self.sampler_versions: dict[str, int] = {s.address: 0 for s in spec.samplers}
        self.sampler_errors: dict[str, str] = {}
        self.unreachable_engines: set[str] = set()  # out-of-service samplers whose engine refused connections
        self.publishers: set[str] = set()  # jobs that published a weight version at their last grant
        self.published_in_grant = False
        self.weights_publisher: str | None = None
        self.weight_sync_errors: dict[str, str] = {}  # job -> why its version failed to load (told at next acquire)

    @property
    def serving_version(self) -> int:
        """Highest weight version any sampler of the group serves (0: the initial weights)."""
        return max((v for a, v in self.sampler_versions.items() if a not in self.sampler_errors), default=0)

    def set_state(self, state: GroupState) -> None:
        if state is not self.state:
            self.state = state
            self.state_since = time.time()
            if self.on_change is not None:
                self.on_change(self)


POLICIES = ("fifo", "priority", "round_robin")


def pick_waiter(g: Group) -> _Waiter:
    """The next waiter of ``g`` by its policy (``g.waiters`` is in arrival order and not empty)."""
    policy = g.spec.policy
    if policy == "priority":
        prio = g.spec.job_priorities
        return max(g.waiters, key=lambda w: prio.get(w.job_id, 0))  # max() keeps the first (FIFO) among equals
    if policy == "round_robin":
        return min(g.waiters, key=lambda w: g.last_granted.get(w.job_id, 0))
    return g.waiters[0]


class Orchestrator:
    """FIFO locks and phase switches over a set of groups."""

    def __init__(self, specs: Iterable[GroupSpec], actions: SwitchActions,
                 on_switch: Callable[[SwitchRecord], None] | None = None) -> None:
        self.groups: dict[str, Group] = {s.group_id: Group(s) for s in specs}
        self._actions = actions
        self._on_switch = on_switch
        self._closing = False
        self._repair: asyncio.Task | None = None

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
        if not g.spec.samplers:
            held = [o.spec.group_id for o in self.groups.values() if o.spec.samplers and
                    (o.holder == job_id or any(w.job_id == job_id for w in o.waiters))]
            if held:
                raise LockOrderViolation(
                    f"lock order: job {job_id!r} holds or waits for sampler group(s) {held} and asks for trainer group "
                    f"{group_id!r}; take the trainer group first, then the sampler group (weight sync holds both), "
                    "so that no two jobs can deadlock")
        t0 = time.monotonic()
        # Deferred snapshot: the same job's context is still loaded and nobody else is queued.
        if g.state is GroupState.IDLE_YIELDED and g.loaded_job == job_id and not g.waiters:
            self._grant(g, job_id)
            return AcquireResult(0, False, g.weight_sync_errors.pop(job_id, ""))
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
        return AcquireResult(int((time.monotonic() - t0) * 1000), waiter.future.result(),
                             g.weight_sync_errors.pop(job_id, ""))

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

    def yield_(self, job_id: str, group_id: str, fencing_token: int | None = None) -> YieldResult:
        """Give the group up; returns at once (the switch back runs in the background).

        Raises:
            InvalidArgument, UnknownGroup, NotHolder (the job does not hold the group; the message
            says when its lease was reclaimed), StaleFencingToken.
        """
        g = self._holder_group(job_id, group_id, fencing_token)
        self._require_token_if_armed(g, job_id, fencing_token)
        return self._release(g, job_id)

    def publish_weights(self, job_id: str, group_id: str, weights: WeightUpdate,
                        fencing_token: int | None = None) -> Group:
        """Record ``weights`` as the group's next weight version; the samplers load it when they wake.

        Raises:
            InvalidArgument (a group without samplers, or a malformed update), UnknownGroup,
            NotHolder, StaleFencingToken, StaleWeightVersion (not newer than the latest one).
        """
        g = self._holder_group(job_id, group_id, fencing_token)
        self._require_token_if_armed(g, job_id, fencing_token)
        if not g.spec.samplers:
            raise InvalidArgument(f"group {group_id!r} has no samplers to load weights into; publish on the "
                                  "sampler group")
        if not isinstance(weights, WeightUpdate):
            raise InvalidArgument("weights must be a WeightUpdate")
        latest = max(g.weights.version if g.weights else 0, max(g.sampler_versions.values(), default=0))
        if weights.version <= latest:
            raise StaleWeightVersion(f"weight version {weights.version} is not newer than group {group_id!r}'s "
                                     f"latest ({latest}); versions must increase")
        g.weights = weights
        g.weights_publisher = job_id
        g.publishers.add(job_id)
        g.published_in_grant = True
        if g.on_change is not None:
            g.on_change(g)
        return g

    # ------------------------------------------------------------------ leases
    def _holder_group(self, job_id: str, group_id: str, fencing_token: int | None) -> Group:
        if not job_id:
            raise InvalidArgument("job_id is required")
        g = self.group(group_id)
        if g.holder != job_id:
            why = g.expired_jobs.get(job_id)
            raise NotHolder(f"job {job_id!r} does not hold group {group_id!r} (holder: {g.holder!r})"
                            + (f"; {why}" if why else ""))
        if fencing_token and g.lease is not None and fencing_token != g.lease.token:
            raise StaleFencingToken(f"fencing token {fencing_token} of job {job_id!r} is stale: group {group_id!r} "
                                    f"is at token {g.lease.token}; this holder must stop and acquire again")
        return g

    @staticmethod
    def _require_token_if_armed(g: Group, job_id: str, fencing_token: int | None) -> None:
        """A holder that heartbeats (armed lease) knows its fencing token: a yield or publish for it without the
        token is refused, so a caller that merely knows the job id cannot end or steer the lease."""
        if not fencing_token and g.lease is not None and g.lease.expires_at is not None:
            raise StaleFencingToken(f"group {g.spec.group_id!r}: job {job_id!r}'s lease is kept alive by heartbeats; "
                                    "this call must carry its fencing token (x-llmd-timeslice-fencing-token)")

    def _grant(self, g: Group, job_id: str) -> None:
        g.published_in_grant = False
        g.grants += 1
        g.last_granted[job_id] = g.grants
        g.holder = job_id
        g.last_token += 1
        g.lease = Lease(job_id, g.last_token, g.spec.lease_ttl_s)
        g.expired_jobs.pop(job_id, None)
        g.set_state(GroupState.LOCKED)
        if g.on_change is not None:
            g.on_change(g)  # a new token even if the state did not change

    def lease(self, job_id: str, group_id: str) -> Lease:
        """The holder's current lease. Raises InvalidArgument, UnknownGroup, NotHolder."""
        return self._holder_group(job_id, group_id, None).lease  # type: ignore[return-value]

    def heartbeat(self, job_id: str, group_id: str, fencing_token: int) -> Lease:
        """Renew (and arm) the holder's lease for ``lease_ttl_s`` seconds.

        Raises:
            InvalidArgument, UnknownGroup, NotHolder (lease reclaimed or never held), StaleFencingToken.
        """
        if fencing_token <= 0:
            raise InvalidArgument(f"fencing_token must be a positive integer from GetLease, got {fencing_token}")
        g = self._holder_group(job_id, group_id, fencing_token)
        lease = g.lease
        assert lease is not None
        if lease.ttl_s > 0:
            loop = asyncio.get_running_loop()
            first = lease.expires_at is None
            lease.expires_at = loop.time() + lease.ttl_s
            if first and g.on_change is not None:
                g.on_change(g)  # armed: persisted, so a restarted orchestrator keeps expiring it
            if g._lease_timer is not None:
                g._lease_timer.cancel()
            g._lease_timer = loop.call_at(lease.expires_at, self._expire, g, lease.token)
        return lease

    def _expire(self, g: Group, token: int) -> None:
        lease = g.lease
        if lease is None or lease.token != token or g.holder != lease.job_id:
            return
        why = (f"its lease (token {token}) expired: no heartbeat for {lease.ttl_s:g} s, so the group was reclaimed; "
               "restart the job from its last checkpoint and acquire again")
        log.error("group=%s job=%s %s", g.spec.group_id, lease.job_id, why)
        g.expired_jobs[lease.job_id] = why
        g.last_error = f"job {lease.job_id!r}: {why}"
        self._release(g, lease.job_id)

    def _release(self, g: Group, job_id: str) -> YieldResult:
        if not g.published_in_grant:
            g.publishers.discard(job_id)  # the auto sleep policy keeps level 2 for jobs that keep publishing
        g.holder = None
        g.lease = None
        if g._lease_timer is not None:
            g._lease_timer.cancel()
            g._lease_timer = None
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
        """Serialises every switch of one group: grants waiters (by the group's scheduling policy), else
        hands back to samplers."""
        while g.holder is None and not self._closing:
            for w in [w for w in g.waiters if w.future.done()]:
                g.waiters.remove(w)  # abandoned
            if g.waiters:
                waiter = pick_waiter(g)
                if g.loaded_job == SAMPLERS:
                    record = SwitchRecord(g.spec.group_id, "to_job", waiter.job_id, time.time())
                    record.sleep_level = g.spec.sleep_level_for(waiter.job_id, waiter.job_id in g.publishers)
                    g.set_state(GroupState.SWITCHING)
                    try:
                        await self._actions.suspend_samplers(g.spec, record)
                    except Exception as exc:
                        record.ok, record.error = False, str(exc)
                        self._record(g, record)
                        g.last_error = f"switch to job {waiter.job_id!r} failed: {exc}"
                        log.error("group=%s %s", g.spec.group_id, g.last_error)
                        g.waiters.remove(waiter)
                        if not waiter.future.done():
                            waiter.future.set_exception(SwitchFailed(g.last_error + "; samplers are being woken again"))
                        await self._resume(g, waiter.job_id)
                        continue
                    self._record(g, record)
                    g.loaded_job = None  # samplers asleep, nobody loaded yet
                if waiter in g.waiters:
                    g.waiters.remove(waiter)
                if waiter.future.done():
                    continue  # gave up during the switch; the next waiter (or the samplers) get it
                g.loaded_job = waiter.job_id
                self._grant(g, waiter.job_id)
                waiter.future.set_result(False)  # trainer state is restored by the client
                return
            # Nobody waits: the accelerators go back to the samplers.
            if g.spec.samplers and g.loaded_job != SAMPLERS:
                await self._resume(g, g.loaded_job or "")
            if g.holder is None and not g.waiters:
                g.set_state(GroupState.IDLE)
                return

    async def _resume(self, g: Group, after_job: str) -> None:
        record = self.resume_record(g.spec.group_id, "to_samplers", after_job)
        g.set_state(GroupState.SWITCHING)
        try:
            await self._actions.resume_samplers(g.spec, record)
            g.loaded_job = SAMPLERS
        except Exception as exc:
            record.ok, record.error = False, str(exc)
            g.last_error = f"waking the samplers failed: {exc}; they stay out of service"
            log.error("group=%s %s", g.spec.group_id, g.last_error)
            # Some samplers may be awake (and any that failed may be half-awake): the next grant must put every
            # one to sleep again, verified, before anyone else gets the accelerators.
            g.loaded_job = SAMPLERS
        finally:
            self.merge_resume(record)
        self._record(g, record)

    def resume_record(self, group_id: str, kind: str = "to_samplers", after_job: str = "") -> SwitchRecord:
        """A record for waking ``group_id``'s samplers: their weight versions, and the version to load
        (the latest published) when any sampler is below it."""
        g = self.groups[group_id]
        record = SwitchRecord(group_id, kind, after_job, time.time())
        for smp in g.spec.samplers:
            record.sampler_versions[smp.address] = g.sampler_versions.get(smp.address, 0)
        target = g.weights
        if target is not None and (kind in ("reconcile", "repair")
                                   or any(v < target.version for v in record.sampler_versions.values())):
            # At start-up the versions are from the persisted state, not from the engines, and a repaired sampler's
            # engine may have restarted meanwhile (initial weights again): load the target version before
            # publishing it.
            record.weights = target
        return record

    def merge_resume(self, record: SwitchRecord) -> None:
        """Take the outcome of a wake (versions loaded, samplers that failed) into the group's state;
        a failed load is kept for the publisher's next acquire."""
        g = self.groups.get(record.group_id)
        if g is None:
            return
        g.sampler_versions.update(record.sampler_versions)
        for address in record.sampler_versions:
            if address not in record.sampler_errors:
                g.sampler_errors.pop(address, None)
        g.sampler_errors.update(record.sampler_errors)
        if record.weights is not None and record.sampler_errors:
            g.weight_sync_errors[g.weights_publisher or record.job_id] = (
                f"weight version {record.weights.version} did not load on {len(record.sampler_errors)} of "
                f"{len(g.spec.samplers)} sampler(s), which stay out of service at their old version: "
                + "; ".join(f"{a}: {e}" for a, e in sorted(record.sampler_errors.items())))
        if g.on_change is not None:
            g.on_change(g)  # versions are persisted

    # ------------------------------------------------------------- persistence
    def snapshot(self) -> dict:
        """What survives a restart, JSON-serialisable: per group holder, lease, loaded job, state."""
        out = {}
        for gid, g in self.groups.items():
            lease = g.lease
            out[gid] = {
                "state": g.state.value, "holder": g.holder, "loaded_job": g.loaded_job, "last_token": g.last_token,
                "lease": None if lease is None else {"job_id": lease.job_id, "token": lease.token, "ttl_s": lease.ttl_s,
                                                    "armed": lease.expires_at is not None},
                "expired_jobs": dict(g.expired_jobs),
                "weights": None if g.weights is None else g.weights.to_json(),
                "sampler_versions": dict(g.sampler_versions), "publishers": sorted(g.publishers),
            }
        return {"version": 1, "groups": out}

    def restore(self, data: dict) -> dict[str, str]:
        """Load a :meth:`snapshot`; returns group id -> what the caller must reconcile:
        ``"held"`` (a job holds it: samplers stay asleep), ``"wake"`` (samplers must be woken and
        published: idle, or a switch was cut halfway and is rolled back) or ``"none"`` (no samplers).
        Groups unknown to the inventory are ignored. Armed leases restart their TTL now."""
        todo: dict[str, str] = {}
        loop = asyncio.get_running_loop()
        for gid, g in self.groups.items():
            d = (data.get("groups") or {}).get(gid)
            g.on_change, notify = None, g.on_change
            if d:
                g.last_token = int(d.get("last_token", 0))
                g.expired_jobs = dict(d.get("expired_jobs") or {})
                try:
                    g.weights = WeightUpdate.from_json(d["weights"]) if d.get("weights") else None
                except (InvalidWeightUpdate, KeyError, TypeError, ValueError) as exc:
                    log.error("group=%s persisted weight version ignored: %s", gid, exc)
                known = {s.address for s in g.spec.samplers}
                g.sampler_versions.update({a: int(v) for a, v in (d.get("sampler_versions") or {}).items() if a in known})
                g.publishers = set(d.get("publishers") or [])
                lease = d.get("lease")
                if d.get("holder") and lease:
                    g.holder = d["holder"]
                    g.lease = Lease(lease["job_id"], int(lease["token"]), float(lease["ttl_s"]))
                    g.loaded_job = d["holder"]
                    g.set_state(GroupState.LOCKED)
                    if lease.get("armed") and g.lease.ttl_s > 0:
                        g.lease.expires_at = loop.time() + g.lease.ttl_s
                        g._lease_timer = loop.call_at(g.lease.expires_at, self._expire, g, g.lease.token)
                elif d.get("state") == GroupState.IDLE_YIELDED.value and not g.spec.samplers and d.get("loaded_job"):
                    g.loaded_job = d["loaded_job"]
                    g.set_state(GroupState.IDLE_YIELDED)
            if g.holder is not None:
                todo[gid] = "held"
            elif g.spec.samplers:
                g.loaded_job = SAMPLERS
                g.set_state(GroupState.IDLE)
                todo[gid] = "wake"
            else:
                todo[gid] = "none"
            g.on_change = notify
        return todo

    def start_repair(self, first_s: float = 2.0, max_s: float = 60.0, audit_interval_s: float = 0.0) -> None:
        """Retry, with back-off (``first_s`` doubling to ``max_s`` seconds), the wake of groups whose samplers
        are out of service after a failed wake (dead engine or sidecar, failed weight load) while nobody
        holds or waits for the group: recovery without a human once the part is back.

        ``audit_interval_s`` > 0 (and actions that can read engines, :class:`EngineAuditActions`): every that many
        seconds, each quiet group's serving samplers are read; one whose engine reports another weight version
        than the one recorded (it restarted on its own and serves its initial weights) or sleeps is taken out of
        service and woken again at the group's weight version, as a repair."""
        if self._repair is None:
            self._repair = asyncio.get_running_loop().create_task(
                self._repair_loop(first_s, max_s, audit_interval_s), name="repair")

    def needs_repair(self, g: Group) -> bool:
        return (bool(g.spec.samplers) and g.holder is None and not g.waiters and g.state is GroupState.IDLE
                and (g.loaded_job != SAMPLERS or bool(g.sampler_errors)))

    async def _repair_loop(self, first_s: float, max_s: float, audit_interval_s: float = 0.0) -> None:
        delay: dict[str, float] = {}
        due: dict[str, float] = {}
        loop = asyncio.get_running_loop()
        probing: set[str] = set()
        can_audit = audit_interval_s > 0 and hasattr(self._actions, "read_engines")
        audit_due = loop.time() + audit_interval_s
        while not self._closing:
            await asyncio.sleep(0.5)
            audit = can_audit and loop.time() >= audit_due
            if audit:
                audit_due = loop.time() + audit_interval_s
            for gid, g in self.groups.items():
                if not self.needs_repair(g):
                    delay.pop(gid, None)
                    due.pop(gid, None)
                    if self._quiet(g) and not g.sampler_errors:
                        g.unreachable_engines.clear()
                    if audit and self._quiet(g) and (g._driver is None or g._driver.done()):
                        g._driver = loop.create_task(self._audit_group(g), name=f"audit-{gid}")
                    continue
                if gid not in due:
                    delay[gid] = first_s
                    due[gid] = loop.time() + first_s
                if audit and gid not in probing:
                    # An engine seen down that answers again is repaired now, not at the end of its back-off.
                    probing.add(gid)
                    task = loop.create_task(self._engine_back(g), name=f"probe-{gid}")

                    def probed(t: asyncio.Task, gid: str = gid) -> None:
                        probing.discard(gid)
                        if not t.cancelled() and t.result() and gid in due:
                            due[gid] = loop.time()  # repaired at the next tick

                    task.add_done_callback(probed)
                if loop.time() >= due[gid] and (g._driver is None or g._driver.done()):
                    log.warning("group=%s samplers out of service (%s); retrying the wake", gid,
                                g.last_error or ", ".join(sorted(g.sampler_errors)))
                    g._driver = loop.create_task(self._repair_group(g), name=f"repair-{gid}")
                    delay[gid] = min(delay[gid] * 2, max_s)
                    due[gid] = loop.time() + delay[gid]

    async def _engine_back(self, g: Group) -> bool:
        """Read the engines of out-of-service samplers; True when one that refused connections answers again."""
        down = [smp for smp in g.spec.samplers if smp.address in g.sampler_errors or g.loaded_job != SAMPLERS]
        try:
            readings = await self._actions.read_engines(dataclasses.replace(g.spec, samplers=down))  # type: ignore[attr-defined]
        except Exception:
            return False
        back = False
        for addr, r in readings.items():
            if r.unreachable:
                g.unreachable_engines.add(addr)
            elif addr in g.unreachable_engines:
                g.unreachable_engines.discard(addr)
                log.warning("group=%s sampler %s: its engine answers again; repairing now", g.spec.group_id, addr)
                back = True
        return back

    @staticmethod
    def _quiet(g: Group) -> bool:
        """Samplers serving, nobody holding, waiting or switching."""
        return (bool(g.spec.samplers) and g.holder is None and not g.waiters and g.state is GroupState.IDLE
                and g.loaded_job == SAMPLERS)

    def engine_faults(self, g: Group, readings: dict[str, EngineReading]) -> dict[str, str]:
        """Sampler address -> why its engine cannot be serving what the group records (none: all good).
        Only samplers in service are judged; an engine without a weight version label is judged by sleep only."""
        faults = {}
        for smp in g.spec.samplers:
            r = readings.get(smp.address)
            if r is None or smp.address in g.sampler_errors:
                continue
            want = g.sampler_versions.get(smp.address, 0)
            if r.unreachable:
                faults[smp.address] = f"its engine refuses connections (down or restarting): {r.unreachable}"
            elif r.sleeping:
                faults[smp.address] = "its engine sleeps while it should serve"
            elif want > 0 and r.weight_version is not None and r.weight_version != str(want):
                faults[smp.address] = (f"its engine reports weight version {r.weight_version!r}, not {want} (it "
                                       "restarted on its own and serves its initial weights)")
        return faults

    async def _audit_group(self, g: Group) -> None:
        """Read the engines of a quiet group; take any that cannot be serving what is recorded out of service
        and wake it again (at the group's weight version). Runs as the group's driver: an acquire waits."""
        try:
            readings = await self._actions.read_engines(g.spec)  # type: ignore[attr-defined]
        except Exception as exc:  # a reading is advisory: the next audit tries again
            log.warning("group=%s engine audit could not read the engines: %s", g.spec.group_id, exc)
            readings = {}
        faults = self.engine_faults(g, readings) if self._quiet(g) else {}
        if faults:
            bad = [smp for smp in g.spec.samplers if smp.address in faults]
            for addr, why in faults.items():
                log.error("group=%s sampler %s: %s; taking it out of service to wake it again", g.spec.group_id,
                          addr, why)
                g.sampler_errors[addr] = why
                if "weight version" in why:
                    g.sampler_versions[addr] = 0  # what a restarted engine serves: its initial weights
                if "refuses" in why:
                    g.unreachable_engines.add(addr)
            g.last_error = "; ".join(f"{a}: {w}" for a, w in sorted(faults.items()))
            g.set_state(GroupState.SWITCHING)
            try:
                await self._actions.take_out_of_service(  # type: ignore[attr-defined]
                    dataclasses.replace(g.spec, samplers=bad))
            except Exception as exc:
                log.error("group=%s taking %s out of service failed: %s", g.spec.group_id, sorted(faults), exc)
            finally:
                g.set_state(GroupState.IDLE)
            reasons = {a: "unreachable" if "refuses" in w else "asleep" if "sleeps" in w else "restarted"
                       for a, w in faults.items()}
            await self._repair_group(g, reasons)
            return
        if g.waiters:
            g._driver = None
            self._drive(g)

    async def _repair_group(self, g: Group, engine_faults: dict[str, str] | None = None) -> None:
        """Wake the samplers that are out of service (all of them if the whole wake failed); runs as the
        group's driver, so an acquire arriving meanwhile waits for it."""
        if g.loaded_job == SAMPLERS:
            samplers = [smp for smp in g.spec.samplers if smp.address in g.sampler_errors]
        else:
            samplers = list(g.spec.samplers)
        record = self.resume_record(g.spec.group_id, "repair")
        record.engine_faults = dict(engine_faults or {})
        g.set_state(GroupState.SWITCHING)
        try:
            await self._actions.resume_samplers(dataclasses.replace(g.spec, samplers=samplers), record)
            g.loaded_job = SAMPLERS
            g.last_error = ""
            log.warning("group=%s repaired: %s back in service", g.spec.group_id, [smp.address for smp in samplers])
        except Exception as exc:
            record.ok, record.error = False, str(exc)
            g.last_error = f"repair wake failed: {exc}; retrying with back-off"
        finally:
            self.merge_resume(record)
            self._record(g, record)
            g.set_state(GroupState.IDLE)
        if g.waiters:
            g._driver = None
            self._drive(g)

    async def close(self) -> None:
        """Stop drivers; pending acquires fail with SwitchFailed."""
        self._closing = True
        if self._repair is not None:
            self._repair.cancel()
        for g in self.groups.values():
            for w in g.waiters:
                if not w.future.done():
                    w.future.set_exception(SwitchFailed("orchestrator is shutting down"))
            if g._driver is not None:
                g._driver.cancel()
