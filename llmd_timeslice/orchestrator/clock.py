"""Time for the orchestrator's timers (lease expiry, repair back-off, engine audit), injectable.

The core never calls ``time`` or ``asyncio.sleep`` for these: it asks a :class:`Clock` for the
current time and for a callback at a later time. :class:`LoopClock` is the event loop's monotonic
clock (production); :class:`ManualClock` moves only when a test calls :meth:`ManualClock.advance`,
so a test of a 30 s lease or a 60 s back-off runs in microseconds and never sleeps.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    """A scheduled callback; ``cancel()`` is idempotent."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic seconds and one-shot callbacks (both in the loop's thread)."""

    def now(self) -> float:
        """Monotonic seconds (only differences mean anything)."""
        ...

    def wall(self) -> float:
        """Unix seconds, for timestamps shown to people (status, records)."""
        ...

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        """Run ``callback()`` once ``now() >= when`` (in the event loop)."""
        ...

    def stalled_s(self, since: float) -> float:
        """Seconds of ``[since, now()]`` during which this process could not run its event loop (frozen by SIGSTOP,
        throttled, paused), as far as measured; 0.0 when it ran throughout."""
        ...


STALL_PROBE_S = 0.1
"""Period of :class:`LoopClock`'s stall probe, in seconds."""
STALL_MIN_S = 0.5
"""A probe that wakes this much later than due counts as a stall of the loop (seconds)."""


class LoopClock:
    """The running event loop's clock (``loop.time()``, ``loop.call_at``), with a stall probe.

    The probe (:meth:`start_stall_probe`) wakes every :data:`STALL_PROBE_S`; when it wakes at least
    :data:`STALL_MIN_S` late, the process could not run meanwhile, and no peer could be heard either (a holder's
    heartbeats waited in a socket). :meth:`stalled_s` also counts a stall that is ending now, before the probe has
    run again: after a SIGCONT the timers that fell due meanwhile may run before the probe's own wake-up.
    """

    def __init__(self) -> None:
        self._stalls: deque[tuple[float, float]] = deque(maxlen=256)
        self._probe_at: float | None = None  # when the probe last ran (loop time)
        self._probe: asyncio.Task | None = None

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def wall(self) -> float:
        return time.time()

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        return asyncio.get_running_loop().call_at(when, callback)

    def start_stall_probe(self) -> None:
        """Start measuring stalls in the running loop (idempotent; :meth:`stop_stall_probe` ends it)."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._run_probe())

    def stop_stall_probe(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        self._probe_at = None

    async def _run_probe(self) -> None:
        loop = asyncio.get_running_loop()
        self._probe_at = loop.time()
        while True:
            await asyncio.sleep(STALL_PROBE_S)
            now = loop.time()
            due = self._probe_at + STALL_PROBE_S
            if now - due >= STALL_MIN_S:
                self._stalls.append((due, now))
            self._probe_at = now

    def stalled_s(self, since: float) -> float:
        now = self.now()
        spans = list(self._stalls)
        if self._probe_at is not None and now - (self._probe_at + STALL_PROBE_S) >= STALL_MIN_S:
            spans.append((self._probe_at + STALL_PROBE_S, now))  # ending now: the probe has not run yet
        return _overlap(spans, since, now)


def _overlap(spans: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


class _ManualTimer:
    def __init__(self, when: float, seq: int, callback: Callable[[], None]) -> None:
        self.when, self.seq, self.callback = when, seq, callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __lt__(self, other: _ManualTimer) -> bool:
        return (self.when, self.seq) < (other.when, other.seq)


class ManualClock:
    """A clock that moves only on :meth:`advance` (tests).

    Args:
        start: the initial monotonic reading, in seconds.
        wall_start: the initial Unix time, in seconds.
    """

    def __init__(self, start: float = 1000.0, wall_start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._wall0 = wall_start - start
        self._timers: list[_ManualTimer] = []
        self._seq = itertools.count()
        self._stalls: list[tuple[float, float]] = []

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._wall0 + self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        timer = _ManualTimer(when, next(self._seq), callback)
        heapq.heappush(self._timers, timer)
        return timer

    def stalled_s(self, since: float) -> float:
        return _overlap(self._stalls, since, self._now)

    def stall(self, seconds: float) -> int:
        """Move time forward by ``seconds`` as a stall of the process (SIGSTOP, then SIGCONT): counted by
        :meth:`stalled_s`, then the callbacks that fell due run, as :meth:`advance` runs them. Returns how many ran."""
        self._stalls.append((self._now, self._now + seconds))
        return self.advance(seconds)

    def pending(self) -> list[float]:
        """Due times of the callbacks not yet run nor cancelled, soonest first."""
        return sorted(t.when for t in self._timers if not t.cancelled)

    def advance(self, seconds: float) -> int:
        """Move time forward by ``seconds`` (>= 0), running every callback that falls due, in time order.
        Returns how many ran. Callbacks post commands; the caller then lets the loop run them."""
        if seconds < 0:
            raise ValueError(f"a clock only moves forward; got {seconds} s")
        until = self._now + seconds
        ran = 0
        while self._timers and self._timers[0].when <= until:
            timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, timer.when)
            timer.callback()
            ran += 1
        self._now = until
        return ran
