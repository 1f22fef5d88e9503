"""The fast path's admissions, from the ext_authz answer to the access-log entry that ends them.

The HTTP ext_authz edge (:mod:`epp_plugin.gate.ext_authz`) admits a request and hands the :class:`Admission`
to :meth:`AdmissionBook.add`, which names it: ``<boot>-<n>`` (hex; ``boot`` is random per gate process, so an
access-log entry for an earlier incarnation's admission never matches a new one). The id goes back to Envoy
in the answer header ``x-llmd-timeslice-admission``, which Envoy copies onto the request and logs. The
access-log edge (:mod:`epp_plugin.gate.access_log`) turns Envoy's entries into :meth:`served` (an upstream
stream started: the endpoint it went to) and :meth:`complete` (the downstream stream ended, whatever the
reason); both are ``PoolState`` calls, so the drain barrier stays the core's in-flight count.

**Lost completions.** Envoy drops an access-log entry when it cannot send it (the gate unreachable, its gRPC
stream above its buffer), and a dead Envoy sends none for the requests it had in flight. Such an admission
would count against its endpoints for ever, so every drain of them would run to its deadline. Two rules end
it, neither ever finishing a request Envoy may still be serving:

* **age**: an admission still open ``lost_after_s`` seconds after it was admitted is dropped. Set it above
  Envoy's route timeout (which bounds every admitted request) plus the longest request-body upload.
* **Envoy gone**: each check carries the id of the Envoy process (``x-llmd-timeslice-envoy``); an
  access-log stream is tied to that id by the first entry it delivers for one of its admissions. When every
  stream tied to an id has ended and none reconnects within ``envoy_gone_grace_s``, that Envoy's admissions
  are dropped (a live Envoy keeps its streams open; a restarted one has a new id).

Until then a drain that meets a lost completion waits to its deadline, and the orchestrator goes on as for
any late drain: the sidecar waits for the engine's own idle signal (``vllm:num_requests_running + waiting``)
and sleeps it with ``mode=wait``.

Not pure: it keeps asyncio timers (no polling: one timer at the oldest admission's age limit, one per gone
Envoy). Everything else is dictionary work.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from epp_plugin.gate.pool_state import Admission, PoolState

log = logging.getLogger(__name__)

ENVOY_GONE_GRACE_S = 2.0
"""Seconds an Envoy id may have no access-log stream before its admissions are dropped."""


@dataclass(eq=False, slots=True)
class _Record:
    pool: PoolState
    adm: Admission
    envoy: str
    at: float


class AdmissionBook:
    """Open admissions of the fast path by id; see the module docstring.

    Args:
        lost_after_s: seconds after which an admission without a completion is dropped (> Envoy's route timeout).
        envoy_gone_grace_s: seconds an Envoy id may have no access-log stream before its admissions are dropped.
        on_lost: called with ``(reason, count)`` when admissions are dropped (``"age"``, ``"envoy_gone"``, or
            ``"unread"``: Envoy reset the check as it was answered).
        clock: monotonic clock in seconds (the timers use the running loop's own clock).
    """

    def __init__(
        self,
        lost_after_s: float,
        envoy_gone_grace_s: float = ENVOY_GONE_GRACE_S,
        on_lost: Callable[[str, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lost_after_s = lost_after_s
        self.envoy_gone_grace_s = envoy_gone_grace_s
        self.boot = secrets.token_hex(4)
        self._prefix = self.boot + "-"
        self._n = 0
        self._open: dict[str, _Record] = {}  # insertion order is admission order (the age rule pops the front)
        self._streams: dict[str, int] = {}  # Envoy id -> open access-log streams tied to it
        self._gone: dict[str, asyncio.TimerHandle] = {}
        self._age_timer: asyncio.TimerHandle | None = None
        self._on_lost = on_lost
        self._clock = clock
        self.completed_total = 0
        self.lost_total = 0
        self.foreign_total = 0
        """Completions naming an admission of another gate process (an earlier incarnation, or another replica:
        then Envoy's checks and access log reach different replicas, a deployment error, see docs/gate.md)."""

    def __len__(self) -> int:
        return len(self._open)

    # ---------------------------------------------------------------- admissions
    def add(self, pool: PoolState, adm: Admission, envoy: str = "") -> str:
        """Record an admission answered to Envoy ``envoy``; returns its id (ASCII, for the answer header)."""
        self._n += 1
        aid = f"{self._prefix}{self._n:x}"
        self._open[aid] = _Record(pool, adm, envoy, self._clock())
        if self._age_timer is None:
            self._arm_age_timer()
        return aid

    def served(self, aid: str, address: str) -> None:
        """An upstream stream of ``aid`` started towards ``address`` (``ip:port``): it counts only there now."""
        rec = self._open.get(aid)
        if rec is not None:
            rec.pool.on_served(rec.adm, address)

    def complete(self, aid: str) -> bool:
        """The request ``aid`` ended (its access-log entry arrived). Returns whether it was open here."""
        rec = self._open.pop(aid, None)
        if rec is None:
            if not aid.startswith(self._prefix):
                self.foreign_total += 1
            return False
        rec.pool.finish(rec.adm)
        self.completed_total += 1
        return True

    def drop(self, aid: str) -> None:
        """Forget ``aid`` without an access-log entry: its answer never reached Envoy (reported as ``unread``)."""
        rec = self._open.pop(aid, None)
        if rec is not None:
            rec.pool.finish(rec.adm)
            self._report("unread", 1)

    def pool_of(self, aid: str) -> PoolState | None:
        rec = self._open.get(aid)
        return rec.pool if rec is not None else None

    def envoy_of(self, aid: str) -> str | None:
        rec = self._open.get(aid)
        return rec.envoy if rec is not None else None

    # ------------------------------------------------------------ access-log streams
    def stream_tied(self, envoy: str) -> None:
        """An access-log stream delivered an entry of ``envoy``'s admissions: that Envoy lives."""
        self._streams[envoy] = self._streams.get(envoy, 0) + 1
        timer = self._gone.pop(envoy, None)
        if timer is not None:
            timer.cancel()

    def stream_ended(self, envoy: str) -> None:
        """A stream tied to ``envoy`` ended; with none left, its admissions go after the grace."""
        left = self._streams.get(envoy, 0) - 1
        if left > 0:
            self._streams[envoy] = left
            return
        self._streams.pop(envoy, None)
        if envoy not in self._gone:
            self._gone[envoy] = asyncio.get_running_loop().call_later(self.envoy_gone_grace_s, self._envoy_gone, envoy)

    def _envoy_gone(self, envoy: str) -> None:
        self._gone.pop(envoy, None)
        if self._streams.get(envoy):
            return
        lost = [aid for aid, rec in self._open.items() if rec.envoy == envoy]
        for aid in lost:
            self._lose(aid)
        if lost:
            log.warning(
                "envoy %s: every access-log stream ended %.1f s ago and none came back: its %d admissions "
                "still open are dropped (their requests ended with it)",
                envoy,
                self.envoy_gone_grace_s,
                len(lost),
            )
            self._report("envoy_gone", len(lost))

    # ----------------------------------------------------------------- age rule
    def _arm_age_timer(self) -> None:
        if not self._open:
            self._age_timer = None
            return
        oldest = next(iter(self._open.values()))
        delay = max(0.0, oldest.at + self.lost_after_s - self._clock())
        self._age_timer = asyncio.get_running_loop().call_later(delay, self._age_expired)

    def _age_expired(self) -> None:
        limit = self._clock() - self.lost_after_s
        lost = 0
        while self._open:
            aid, rec = next(iter(self._open.items()))
            if rec.at > limit:
                break
            self._lose(aid)
            lost += 1
        if lost:
            log.warning(
                "%d admissions had no access-log entry %.0f s after admission: dropped as lost completions",
                lost,
                self.lost_after_s,
            )
            self._report("age", lost)
        self._arm_age_timer()

    def _lose(self, aid: str) -> None:
        rec = self._open.pop(aid)
        rec.pool.finish(rec.adm)
        self.lost_total += 1

    def _report(self, reason: str, n: int) -> None:
        if self._on_lost is not None:
            self._on_lost(reason, n)

    def close(self) -> None:
        """Cancel the timers (the gate stops)."""
        if self._age_timer is not None:
            self._age_timer.cancel()
            self._age_timer = None
        for t in self._gone.values():
            t.cancel()
        self._gone.clear()
