"""The yield desk of one group: asks to its lease holder to yield (``Lease.yield_requested`` on the wire), their
counts and the hold-deadline timer. The policy itself (which ask is due, which knob refuses it) is in
:mod:`llmd_timeslice.orchestrator.yield_requests`; the desk keeps what a group remembers between asks.

The group's actor (:class:`~llmd_timeslice.orchestrator.group.Group`) calls it from its yield-request, yield-deadline,
grant and release handlers, so the desk, like the rest of the group, runs on one task.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from llmd_timeslice.domain.group_settings import GroupSpec
from llmd_timeslice.orchestrator.clock import Clock, TimerHandle
from llmd_timeslice.orchestrator.lease import Lease
from llmd_timeslice.orchestrator.yield_requests import (
    YIELD_REQUEST_SECONDS,
    YIELD_REQUESTS,
    YieldAnswer,
    YieldAsk,
    YieldRequest,
    YieldStats,
    refusal,
)

__all__ = ["YieldDesk"]

log = logging.getLogger(__name__)


class YieldDesk:
    """Yield requests of group ``group_id`` (log lines and metric labels name it); ``clock`` gives readings in
    monotonic seconds and arms the hold-deadline timer."""

    def __init__(self, group_id: str, clock: Clock) -> None:
        self.group_id = group_id
        self._clock = clock
        self.stats = YieldStats()
        self.last_honoured: dict[str, float] = {}
        """Job -> clock reading of its last yield after a yield request (``min_training_s`` counts from it)."""
        self._suppressed: set[tuple[int, int, str]] = set()  # (lease token, band, knob) counted for the gates' asks
        self._timer: TimerHandle | None = None

    def count(self, band: int, outcome: str) -> None:
        """One more ``outcome`` (``sent``, ``honoured``, ``ignored``, ``suppressed``) for ``band``: stats and metric."""
        setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
        YIELD_REQUESTS.labels(group=self.group_id, band=str(band), outcome=outcome).inc()

    def new_grant(self) -> None:
        """A new lease: suppressed asks count again (once per grant, band and knob)."""
        self._suppressed.clear()

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def end(self, lease: Lease | None, job: str, honoured: bool) -> None:
        """The holder ``job`` gives the group up (yield, lease expired, grant taken back): a request ``lease`` carried
        ends; a yield (``honoured``) counts ``honoured`` and its delay goes into the histogram."""
        self.cancel_timer()
        req = lease.yield_request if lease is not None else None
        if req is None or not honoured:
            return
        now = self._clock.now()
        self.count(req.band, "honoured")
        YIELD_REQUEST_SECONDS.labels(group=self.group_id).observe(now - req.requested_at)
        self.last_honoured[job] = now
        log.info(
            "group=%s job=%s yielded %.2f s after a yield request (%s)", self.group_id, job, now - req.requested_at, req.reason
        )

    def ask(self, lease: Lease, job: str, spec: GroupSpec, ask: YieldAsk, on_deadline: Callable[[int], None]) -> YieldAnswer:
        """Apply ``ask`` to ``job``, which holds ``lease`` of a group with settings ``spec``: set, keep, withdraw or
        refuse ``lease.yield_request``. ``on_deadline(token)`` is called (by the clock) once the band's hold deadline
        passes with the request still set."""
        now = self._clock.now()
        req = lease.yield_request
        if ask.source == "gate" and ask.held <= 0:  # the band holds nothing any more: nothing to yield for
            if req is not None and req.source == "gate" and (req.pool, req.band) == (ask.pool, ask.band) and not req.ignored:
                lease.yield_request = None
                self.cancel_timer()
                log.info(
                    "group=%s job=%s yield request withdrawn: band %d of pool %s holds nothing now",
                    self.group_id,
                    job,
                    ask.band,
                    ask.pool,
                )
            return YieldAnswer(False, job, f"band {ask.band} of pool {ask.pool} holds no request")
        if req is not None:
            return YieldAnswer(True, job, f"already requested {now - req.requested_at:.1f} s ago: {req.reason}")
        if not ask.due(spec.yield_request_fraction):
            return YieldAnswer(
                False,
                job,
                f"not yet: the oldest held request waited {ask.oldest_held_s:.2f} s, below yield_request_fraction "
                f"{spec.yield_request_fraction:g} of the {ask.hold_deadline_s:g} s hold deadline",
            )
        trained_s = now - max(lease.granted_at, self.last_honoured.get(job, -math.inf))
        why = refusal(spec, ask, job, trained_s)
        if why is not None:
            knob, detail = why
            key = (lease.token, ask.band, knob)
            if ask.source == "operator" or key not in self._suppressed:
                self._suppressed.add(key)
                self.count(ask.band, "suppressed")
                log.info("group=%s job=%s yield request suppressed: %s", self.group_id, job, detail)
            return YieldAnswer(False, job, f"policy: {detail}")
        deadline_in = ask.deadline_in_s()
        lease.yield_request = YieldRequest(
            ask.reason, ask.band, ask.objective, ask.hold_deadline_s, ask.pool, ask.source, now,
            None if deadline_in is None else now + deadline_in,
        )  # fmt: skip
        self.count(ask.band, "sent")
        log.warning("group=%s job=%s asked to yield at its next safe point: %s", self.group_id, job, ask.reason)
        if deadline_in is not None:
            token = lease.token
            self._timer = self._clock.call_at(now + deadline_in, lambda: on_deadline(token))
        return YieldAnswer(True, job)

    def deadline(self, lease: Lease | None, token: int | None, holder: str | None) -> None:
        """The hold deadline of the request set under lease ``token`` passed: it counts ``ignored`` once, unless it
        was withdrawn or another grant came meanwhile."""
        self._timer = None
        req = lease.yield_request if lease is not None and lease.token == token else None
        if req is None or req.ignored:
            return
        req.ignored = True
        self.count(req.band, "ignored")
        log.warning(
            "group=%s job=%s kept the group past band %d's %g s hold deadline after a yield request (%s)",
            self.group_id,
            holder,
            req.band,
            req.hold_deadline_s,
            req.reason,
        )
