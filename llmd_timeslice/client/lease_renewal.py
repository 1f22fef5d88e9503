"""A held lease's renewal: the heartbeat task (every ``min(ttl/3, 1 s)``), the rule for giving up, and the yield
requests its answers carry (``Lease.yield_requested``, lease.proto; issue 26). The asyncio client owns one per
held group; the sync face's run on the client loop too."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import lease_pb2

_log = logging.getLogger("llmd_timeslice.client.client")


@dataclass(frozen=True)
class YieldRequested:
    """The orchestrator asks this job to yield ``group_id`` at its next safe point (``Lease.yield_requested``,
    lease.proto): ``band`` (InferenceObjective ``spec.priority``) and ``objective`` of the held requests that ask,
    their ``pool``, the band's ``hold_deadline_s``, and ``requested_ago_s`` as of the heartbeat answer that
    carried it."""

    job_id: str
    group_id: str
    reason: str
    band: int
    objective: str
    hold_deadline_s: float
    requested_ago_s: float
    pool: str

    @classmethod
    def from_lease(cls, lease: lease_pb2.Lease) -> YieldRequested | None:
        if not lease.HasField("yield_requested"):
            return None
        y = lease.yield_requested
        return cls(lease.job_id, lease.group_id, y.reason, y.band, y.objective, y.hold_deadline_s, y.requested_ago_s, y.pool)


YieldCallback = Callable[[YieldRequested], object]
YIELD_POLL_S = 1.0
"""Longest heartbeat period (seconds): a yield request is learned within about this long (lease TTL / 3 when
shorter)."""


class _LeaseRenewal:
    """A held lease's renewal state (the heartbeat task, :class:`_AsyncHeartbeat`, runs it): the request, the period
    (ttl/3) and the rule for giving up. Only the orchestrator's refusal (its lease expired, a stale token, not the
    holder) records ``lost`` and stops renewing; ``release()`` then reports :class:`LeaseLost`. No heartbeat answered
    for longer than the TTL (the orchestrator unreachable or stalled, or this process paused: SIGSTOP, a debugger)
    records ``unconfirmed`` and renewing goes on: the next answer says whether the lease was kept (an orchestrator
    that could not run does not count that time against the holder) or reclaimed (then ``lost``)."""

    def __init__(self, job: str, group: str, token: int, ttl_s: float, callbacks: list[YieldCallback] | None = None) -> None:
        self.job, self.group, self.token, self.ttl_s = job, group, token, ttl_s
        self.period = max(0.05, min(ttl_s / 3, YIELD_POLL_S))
        self.rpc_timeout = max(0.5, self.period)
        self.lost: str | None = None
        self.unconfirmed: str | None = None
        self.last_ok = time.monotonic()
        self.yield_request: YieldRequested | None = None
        self._callbacks = callbacks if callbacks is not None else []
        self.asked = asyncio.Event()
        """Set while the orchestrator asks this job to yield (``wait_yield_requested`` waits on it)."""

    def observe(self, lease: lease_pb2.Lease) -> None:
        """Take a lease answer's yield request: set, cleared, or a new one (callbacks run once per request)."""
        req = YieldRequested.from_lease(lease)
        first = req is not None and self.yield_request is None
        self.yield_request = req
        if req is None:
            self.asked.clear()
            return
        if not first:
            return
        _log.warning(
            "job=%s group=%s the orchestrator asks to yield at the next safe point: %s", self.job, self.group, req.reason
        )
        self.asked.set()
        for cb in list(self._callbacks):
            try:
                cb(req)
            except Exception as exc:
                _log.error("job=%s group=%s on_yield_requested callback %r raised: %r", self.job, self.group, cb, exc)

    def request(self) -> lease_pb2.HeartbeatRequest:
        return lease_pb2.HeartbeatRequest(job_id=self.job, group_id=self.group, fencing_token=self.token)

    def renewed(self) -> None:
        """Record an answered heartbeat: the lease is held (again)."""
        now = time.monotonic()
        if self.unconfirmed is not None:
            _log.warning(
                "job=%s group=%s lease confirmed by the orchestrator again after %.1f s without an answer",
                self.job,
                self.group,
                now - self.last_ok,
            )
            self.unconfirmed = None
        self.last_ok = now

    def failed(self, exc: grpc.RpcError) -> bool:
        """Record a failed renewal; True when the lease is lost and renewing must stop."""
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
            self.lost = exc.details()
            _log.error("job=%s group=%s lease lost: %s", self.job, self.group, self.lost)
            return True
        silent_s = time.monotonic() - self.last_ok
        if silent_s > self.ttl_s and self.unconfirmed is None:
            self.unconfirmed = (
                f"no heartbeat answered for {silent_s:.1f} s, longer than the lease TTL ({self.ttl_s:g} s; last error "
                f"{exc.code().name}): the group may have been reclaimed; renewing until the orchestrator answers"
            )
            _log.error("job=%s group=%s lease not confirmed: %s", self.job, self.group, self.unconfirmed)
        return False

    def why_not_held(self) -> str | None:
        """Why the lease is lost, or not confirmed now (see the class), or None while it is held."""
        if self.lost is not None:
            return self.lost
        silent_s = time.monotonic() - self.last_ok
        if self.unconfirmed is None and silent_s > self.ttl_s:  # this process was paused: not renewed since
            return f"no heartbeat answered for {silent_s:.1f} s, longer than the lease TTL ({self.ttl_s:g} s)"
        return self.unconfirmed


class _AsyncHeartbeat(_LeaseRenewal):
    """An asyncio task renewing one lease every ttl/3 seconds (see :class:`_LeaseRenewal`); the sync face's
    heartbeats too (its core runs on the client loop)."""

    def __init__(self, stub, job: str, group: str, token: int, ttl_s: float, callbacks=None) -> None:
        self.first_answered = asyncio.Event()
        """Set once the first heartbeat has been answered (or refused): the orchestrator arms a lease's expiry at
        its first heartbeat, so an acquire waits for it before returning (a holder that hangs right after the
        acquire still loses the lease after its TTL)."""
        super().__init__(job, group, token, ttl_s, callbacks)
        self._stub = stub
        self._task = asyncio.get_running_loop().create_task(self._run()) if ttl_s > 0 else None

    def stop(self) -> None:
        """Stop renewing; safe from any thread (the sync face's callers are not on the task's loop)."""
        if self._task is None:
            return
        task_loop = self._task.get_loop()
        try:
            on_loop = asyncio.get_running_loop() is task_loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._task.cancel()
        elif not task_loop.is_closed() and task_loop.is_running():
            asyncio.run_coroutine_threadsafe(self._cancelled(), task_loop).result(timeout=5)  # stopped on return

    async def _cancelled(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        self.last_ok = time.monotonic()
        while True:
            try:
                lease = await self._stub.Heartbeat(self.request(), timeout=self.rpc_timeout)
                self.renewed()
                self.observe(lease)
            except grpc.RpcError as exc:
                if self.failed(exc):
                    self.first_answered.set()
                    return
            self.first_answered.set()
            await asyncio.sleep(self.period)
