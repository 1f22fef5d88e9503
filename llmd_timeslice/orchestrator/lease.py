"""The lease of a group and the jobs queued for it: what a grant is (:class:`Lease`), a job waiting for one
(:class:`Waiter`), and what ``Acquire``/``Yield`` answer (:class:`AcquireResult`, :class:`YieldResult`).

The rules over these records (admission, grants, fencing checks, expiry) are the group's lease queue
(:mod:`~llmd_timeslice.orchestrator.lease_queue`); the waiter order is the group's waiter policy
(:mod:`llmd_timeslice.orchestrator.waiter_policy`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from llmd_timeslice.orchestrator.yield_requests import YieldRequest

__all__ = ["AcquireResult", "Lease", "Waiter", "YieldResult"]


@dataclass
class Lease:
    """The current grant of a group: ``token`` increases with every grant; ``expires_at`` is a clock
    reading (monotonic seconds) once armed by a heartbeat (None before: the holder is never expired)."""

    job_id: str
    token: int
    ttl_s: float
    expires_at: float | None = None
    stall_credit_s: float = 0.0
    """Seconds added to ``expires_at`` since the last heartbeat because the orchestrator itself could not run
    (a stall: it could not hear the holder meanwhile); reset by each heartbeat."""
    granted_at: float = 0.0
    """Clock reading of the grant (after a restart: of the restore); ``min_training_s`` counts from it."""
    yield_request: YieldRequest | None = None
    """Set while the orchestrator asks the holder to yield (``Lease.yield_requested`` on the wire); a new grant
    starts without one. Not persisted: after a restart the gates' next hold pressure asks again."""


@dataclass
class AcquireResult:
    """``waited_ms``: milliseconds from the call to the grant."""

    waited_ms: int
    context_restored: bool
    weight_sync_error: str = ""
    """Why the weight version this job published last did not load on every sampler ("" if it did)."""


@dataclass
class YieldResult:
    """``pending_waiters``: jobs still queued after the release; ``snapshot_deferred``: the samplers stay asleep
    (the job's context kept loaded)."""

    pending_waiters: int
    snapshot_deferred: bool


@dataclass(eq=False)
class Waiter:
    """A job queued for the group: ``enqueued_at`` is a clock reading (monotonic seconds); ``future`` gets the
    grant or the typed error."""

    job_id: str
    enqueued_at: float
    future: asyncio.Future[AcquireResult]
    hints: Any = None
    """What the client said of itself on its acquire (:class:`~llmd_timeslice.placement.recorder.Hints`), for its
    phase profile."""
