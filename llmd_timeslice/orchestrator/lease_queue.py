"""The lease queue of one group: who holds the group's lease, the jobs waiting for it, the fencing tokens, the
lease's expiry, and why a job lost its lease (told at its next call).

An acquire reaches it from :meth:`Orchestrator.acquire <llmd_timeslice.orchestrator.groups.Orchestrator.acquire>`
through the group's actor (:class:`~llmd_timeslice.orchestrator.group.Group`, its ``ACQUIRE`` handler): the waiter
is checked and queued here (:meth:`LeaseQueue.admit`, :meth:`LeaseQueue.enqueue`), the next one is chosen by the
group's waiter policy (:meth:`LeaseQueue.next_waiter`), and a grant (:meth:`LeaseQueue.grant`) hands out the next
fencing token. The actor decides *when* (after the drain and the sleep, once the grant is saved); this module keeps
*what*: the records (:mod:`~llmd_timeslice.orchestrator.lease`) and their rules. It runs on the actor's task.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping

from llmd_timeslice.domain.waiter_policy import waiter_policy
from llmd_timeslice.orchestrator.clock import Clock, TimerHandle
from llmd_timeslice.orchestrator.commands import GROUP_LOGGER, fail
from llmd_timeslice.orchestrator.errors import NotHolder, StaleFencingToken
from llmd_timeslice.orchestrator.lease import Lease, Waiter

__all__ = ["LeaseQueue"]

log = logging.getLogger(GROUP_LOGGER)


class LeaseQueue:
    """The lease of group ``group_id`` and its waiters. ``clock`` gives readings (monotonic seconds) and arms the
    expiry timer; ``on_expiry(token)`` is called by it once the lease granted with ``token`` is due."""

    def __init__(self, group_id: str, clock: Clock, on_expiry: Callable[[int], None]) -> None:
        self.group_id = group_id
        self._clock = clock
        self._on_expiry = on_expiry
        self.holder: str | None = None
        self.lease: Lease | None = None
        self.last_token = 0
        """The fencing token of the latest grant (the next grant gets one more)."""
        self.deferred_job: str | None = None
        """In DEFERRED: the last holder, whose context the accelerators keep (its next acquire returns at once)."""
        self.expired_jobs: dict[str, str] = {}
        """Job -> why its lease was reclaimed (said at its next call, until it is granted again)."""
        self.grants = 0
        self.last_granted: dict[str, int] = {}
        """Job -> number of its last grant (the round-robin policy)."""
        self._queue: deque[Waiter] = deque()
        self._timer: TimerHandle | None = None

    # ------------------------------------------------------------------ reading
    @property
    def waiters(self) -> tuple[Waiter, ...]:
        """Jobs waiting, in arrival order (ones that gave up excluded)."""
        return tuple(w for w in self._queue if not w.future.done())

    @property
    def queued(self) -> bool:
        """Whether any waiter is queued (one that gave up but is not removed yet included)."""
        return bool(self._queue)

    def intact(self, holder: str | None, token: int | None) -> bool:
        """Whether ``holder`` still holds the lease it held with fencing ``token`` (nothing granted or released
        since)."""
        lease = self.lease
        return (
            self.holder is not None
            and self.holder == holder
            and lease is not None
            and lease.token == token
            and lease.job_id == self.holder
        )

    # ------------------------------------------------------------------ checks
    def check_holder(self, job: str, token: int | None, heartbeat: bool) -> None:
        """Refuse a holder's call (yield, heartbeat, publish) from ``job`` with fencing ``token`` (None or 0: not
        given) unless it holds the lease. A call other than a ``heartbeat`` must carry the token once the lease is
        kept alive by heartbeats, so a caller that merely knows the job id cannot end or steer the lease.

        Raises:
            NotHolder (saying why the lease was reclaimed, if it was), StaleFencingToken.
        """
        if self.holder != job:
            why = self.expired_jobs.get(job)
            raise NotHolder(
                f"job {job!r} does not hold group {self.group_id!r} (holder: {self.holder!r})" + (f"; {why}" if why else "")
            )
        lease = self.lease
        if token and lease is not None and token != lease.token:
            raise StaleFencingToken(
                f"fencing token {token} of job {job!r} is stale: group {self.group_id!r} is at "
                f"token {lease.token}; this holder must stop and acquire again"
            )
        if not heartbeat and not token and lease is not None and lease.expires_at is not None:
            raise StaleFencingToken(
                f"group {self.group_id!r}: job {job!r}'s lease is kept alive by heartbeats; "
                "this call must carry its fencing token (x-llmd-timeslice-fencing-token)"
            )

    def admit(self, job: str) -> None:
        """Refuse an acquire of ``job`` that holds the group or waits for it already. Raises NotHolder."""
        if self.holder == job:
            raise NotHolder(f"job {job!r} already holds group {self.group_id!r}; yield before acquiring again")
        if any(x.job_id == job for x in self.waiters):
            raise NotHolder(f"job {job!r} is already waiting for group {self.group_id!r}")

    # ------------------------------------------------------------------ waiters
    def enqueue(self, w: Waiter) -> None:
        """Queue ``w`` (after :meth:`admit`)."""
        self._queue.append(w)

    def remove(self, w: Waiter) -> None:
        """Take ``w`` off the queue, if it is there."""
        if w in self._queue:
            self._queue.remove(w)

    def abandon(self, w: Waiter) -> bool:
        """``w`` gives up: it leaves the queue and its future is cancelled. False if it was granted (or failed)
        before."""
        if w.future.done():
            return False
        self.remove(w)
        w.future.cancel()
        return True

    def next_waiter(self, policy: str, priorities: Mapping[str, int]) -> Waiter:
        """The waiter the registered waiter policy ``policy`` picks (there is one:
        :mod:`llmd_timeslice.orchestrator.waiter_policy`); ``priorities``: job -> priority."""
        return waiter_policy(policy).pick(self.waiters, priorities=priorities, last_granted=self.last_granted)

    def fail_waiters(self, err: BaseException) -> None:
        """Every queued waiter gets ``err`` and leaves the queue."""
        for w in self._queue:
            fail(w.future, err)
        self._queue.clear()

    # ------------------------------------------------------------------ the lease
    def grant(self, job: str, ttl_s: float) -> Lease:
        """``job`` holds the lease now, under the next fencing token; ``ttl_s`` (0: never expires) counts from its
        first heartbeat. What it was told of a reclaimed lease is forgotten."""
        self.grants += 1
        self.last_granted[job] = self.grants
        self.holder = job
        self.last_token += 1
        self.lease = Lease(job, self.last_token, ttl_s, granted_at=self._clock.now())
        self.expired_jobs.pop(job, None)
        self.deferred_job = None
        return self.lease

    def restore_holder(self, holder: str, job_id: str, token: int, ttl_s: float, armed: bool) -> None:
        """A holder read back from the persisted record: its lease (of ``job_id``, fencing ``token``) is granted
        now; ``armed`` (heartbeats had armed it): it expires ``ttl_s`` seconds from now."""
        self.holder = holder
        self.lease = Lease(job_id, token, ttl_s, granted_at=self._clock.now())
        if armed and ttl_s > 0:
            self.lease.expires_at = self._clock.now() + ttl_s
            self.arm_timer()

    def take_back(self) -> None:
        """A grant that could not be saved: nobody holds the lease (its token stays used)."""
        self.holder, self.lease = None, None

    def end(self) -> None:
        """The holder is gone (yield, expiry, grant taken back): nobody holds the lease; its timer is disarmed."""
        self.holder, self.lease = None, None
        self._cancel_timer()

    def renew(self) -> bool:
        """A heartbeat of the holder: the lease runs ``ttl_s`` seconds from now (none for a TTL of 0). Returns
        whether this armed its expiry for the first time (worth saving: a restarted orchestrator keeps expiring it)."""
        lease = self.lease
        assert lease is not None
        if lease.ttl_s <= 0:
            return False
        armed_now = lease.expires_at is None
        lease.expires_at = self._clock.now() + lease.ttl_s
        lease.stall_credit_s = 0.0
        self.arm_timer()
        return armed_now

    def arm_timer(self) -> None:
        """Arm the expiry timer at the lease's ``expires_at``."""
        self._cancel_timer()
        lease = self.lease
        assert lease is not None and lease.expires_at is not None
        token = lease.token
        self._timer = self._clock.call_at(lease.expires_at, lambda: self._on_expiry(token))

    def due(self, token: int | None) -> Lease | None:
        """The expiry timer of the lease granted with ``token`` fired: the lease, if its holder's time is up; None
        if it stands (renewed meanwhile, granted again, or extended for a stall and re-armed).

        Time the orchestrator could not run does not count against the holder (its heartbeats waited in a socket):
        the stall since the last heartbeat (:meth:`Clock.stalled_s`) is added to the lease once."""
        lease = self.lease
        now = self._clock.now()
        if (
            lease is None
            or lease.token != token
            or self.holder != lease.job_id
            or lease.expires_at is None
            or now < lease.expires_at
        ):
            return None
        heard_at = lease.expires_at - lease.ttl_s - lease.stall_credit_s
        credit = self._clock.stalled_s(heard_at)
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
                self.arm_timer()
                return None
        return lease

    def expire(self, lease: Lease) -> str:
        """``lease`` ran out (:meth:`due`): why, kept for its job's next call (the holder is ended by the caller)."""
        why = (
            f"its lease (token {lease.token}) expired: no heartbeat for {lease.ttl_s:g} s, so the group was "
            "reclaimed; restart the job from its last checkpoint and acquire again"
        )
        log.error("group=%s job=%s %s", self.group_id, lease.job_id, why)
        self.expired_jobs[lease.job_id] = why
        return why

    def reclaim(self, why: str, asked: str | None = None) -> None:
        """After an internal error (``why``): the holder, the lease's job and ``asked`` (the job whose call failed)
        lose the lease, each told so at its next call; no job's context stays deferred."""
        for job in {j for j in (self.holder, self.lease.job_id if self.lease else None, asked) if j}:
            self.expired_jobs[job] = f"its lease was reclaimed after an {why}; acquire again"
            log.error("group=%s job=%s lease reclaimed after the internal error", self.group_id, job)
        self.end()
        self.deferred_job = None

    def close(self, err: BaseException) -> None:
        """Shut down: the timer is disarmed and every waiter gets ``err``."""
        self._cancel_timer()
        for w in self._queue:
            fail(w.future, err)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
