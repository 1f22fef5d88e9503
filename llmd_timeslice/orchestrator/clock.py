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


class LoopClock:
    """The running event loop's clock (``loop.time()``, ``loop.call_at``)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def wall(self) -> float:
        return time.time()

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        return asyncio.get_running_loop().call_at(when, callback)


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

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._wall0 + self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        timer = _ManualTimer(when, next(self._seq), callback)
        heapq.heappush(self._timers, timer)
        return timer

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
