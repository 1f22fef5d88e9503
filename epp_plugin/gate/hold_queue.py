"""The banded hold queue of one InferencePool at the gate (no I/O): requests waiting for a SERVING endpoint, one
FIFO per priority band, the bands' settings and counts, and the hold pressure the gate reports.

Priority bands (docs/gate.md, "Priority bands"; :mod:`llmd_timeslice.domain.objectives`): a request naming an
InferenceObjective is held in its objective's band, up to the objective's longest hold. A request naming none is
band 0 with the pool's ``max_hold_s`` (an undeclared band 0), exactly as before bands existed. Held requests are
released highest band first, FIFO within a band (:meth:`HoldQueue.release`); one waiting for a weight version no
endpoint serves yet keeps its place.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from llmd_timeslice.domain.objectives import Band, PoolPriorities


@dataclass(eq=False)
class Held:
    """One held request: the weight version it needs, when it was enqueued (the pool's clock, seconds), the future
    its admission awaits (set to its candidates on release), its band and objective ("" for none)."""

    min_version: int
    enqueued_at: float
    future: asyncio.Future = field(repr=False)
    band: int = 0
    objective: str = ""


@dataclass
class BandStats:
    """Counts of one band of one pool (exported at scrape time): held requests released, refused by reason, and
    deadline misses (released, or refused at their longest hold, after the band's hold deadline)."""

    released_total: int = 0
    refused_total: dict[str, int] = field(default_factory=dict)
    deadline_misses_total: int = 0


@dataclass(frozen=True, slots=True)
class BandPressure:
    """What a band with a hold deadline holds now (``GateMessage.hold_pressure``): ``oldest_held_s`` in seconds,
    ``objective`` of the oldest held request ("" for none)."""

    band: int
    objective: str
    oldest_held_s: float
    hold_deadline_s: float
    held: int


class HoldQueue:
    """Held requests of one pool per band, and the bands' settings and counts.

    Args:
        max_hold_s: the pool's longest hold, seconds (band 0 unless declared; an undeclared band).
        priorities: the pool's objectives and bands (None: objectives off).
        clock: monotonic clock in seconds, the pool's.
    """

    def __init__(
        self, max_hold_s: float, priorities: PoolPriorities | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_hold_s = max_hold_s
        self._clock = clock
        self.bands: dict[int, deque[Held]] = {}
        """Held requests per band; a band is a key only while it holds one (so ``if bands`` is "anyone held")."""
        self.priorities: PoolPriorities | None = None
        self.band0 = Band(0, max_hold_s)
        self.band_stats: dict[int, BandStats] = {}
        self.on_pressure: Callable[[], None] | None = None
        """Called when a band with a hold deadline starts or stops holding requests (the subscription sends
        HoldPressure from it)."""
        self.set_priorities(priorities)

    # ------------------------------------------------------------------ queries
    @property
    def held(self) -> int:
        """Requests held now (every band)."""
        return sum(len(q) for q in self.bands.values())

    def held_by_band(self) -> dict[int, int]:
        """Requests held now per band, highest band first (bands holding none left out)."""
        return {b: len(self.bands[b]) for b in sorted(self.bands, reverse=True)}

    def oldest_held_by_band(self) -> dict[int, float]:
        """Seconds the oldest held request of each band has waited (bands holding none left out)."""
        now = self._clock()
        return {b: now - q[0].enqueued_at for b, q in self.bands.items() if q}

    def pressure(self) -> list[BandPressure]:
        """Each band with a hold deadline that holds requests now, highest first (see :class:`BandPressure`)."""
        out = []
        now = self._clock()
        for b in sorted(self.bands, reverse=True):
            band = self.band(b)
            q = self.bands[b]
            if band.hold_deadline_s is None or not q:
                continue
            oldest = q[0]
            out.append(BandPressure(b, oldest.objective, now - oldest.enqueued_at, band.hold_deadline_s, len(q)))
        return out

    def deadline_bands(self) -> list[Band]:
        """The declared bands with a hold deadline."""
        if self.priorities is None:
            return [self.band0] if self.band0.hold_deadline_s is not None else []
        return [b for b in self.priorities.bands.values() if b.hold_deadline_s is not None]

    def set_priorities(self, priorities: PoolPriorities | None) -> None:
        """Replace the objectives and bands. Held requests keep their band and their longest hold."""
        self.priorities = priorities
        self.band0 = priorities.band(0) if priorities is not None else Band(0, self.max_hold_s)

    def band(self, priority: int) -> Band:
        """The settings of band ``priority`` (declared, else the pool's ``max_hold_s`` and no deadline)."""
        if priority == 0:
            return self.band0
        return self.priorities.band(priority) if self.priorities is not None else Band(priority, self.max_hold_s)

    def stats(self, band: int) -> BandStats:
        """The counts of ``band`` (created on first use)."""
        st = self.band_stats.get(band)
        if st is None:
            st = self.band_stats[band] = BandStats()
        return st

    # ------------------------------------------------------------------ changes
    def push(self, entry: Held, band: Band) -> None:
        """Hold ``entry`` at the end of its band's FIFO; the band's first held request with a hold deadline wakes
        the pressure reporter."""
        q = self.bands.get(band.priority)
        if q is None:
            q = self.bands[band.priority] = deque()
        q.append(entry)
        if len(q) == 1 and band.hold_deadline_s is not None and self.on_pressure is not None:
            self.on_pressure()

    def drop(self, entry: Held) -> None:
        """Take ``entry`` out of the queue (expired, cancelled, refused) and cancel its future if still pending."""
        q = self.bands.get(entry.band)
        if q is not None:
            try:
                q.remove(entry)
            except ValueError:
                pass
            if not q:
                del self.bands[entry.band]
                self._band_emptied(entry.band)
        if not entry.future.done():
            entry.future.cancel()

    def _band_emptied(self, band: int) -> None:
        if self.on_pressure is not None and self.band(band).hold_deadline_s is not None:
            self.on_pressure()

    def release(self, serving: Callable[[int], tuple[str, ...]], burst: int) -> int:
        """Release up to ``burst`` held requests, highest band first and FIFO within a band: each gets
        ``serving(min_version)`` as its candidates; one whose version no endpoint serves keeps its place. Returns
        how many were released."""
        released = 0
        for band in sorted(self.bands, reverse=True):
            q = self.bands[band]
            skipped: list[Held] = []
            from_band = 0
            while q and released < burst:
                entry = q.popleft()
                if entry.future.done():
                    continue
                candidates = serving(entry.min_version)
                if not candidates:
                    skipped.append(entry)  # waits for a newer weight version; keeps its place
                    continue
                entry.future.set_result(candidates)
                released += 1
                from_band += 1
            q.extendleft(reversed(skipped))
            if from_band:
                self.stats(band).released_total += from_band
            if not q:
                del self.bands[band]
                self._band_emptied(band)
            if released >= burst:
                break
        return released

    def fail_where(self, pred: Callable[[Held], bool], error: Callable[[Held], BaseException]) -> None:
        """Fail every pending held request for which ``pred`` holds with ``error(entry)`` and take it out now."""
        for q in list(self.bands.values()):
            for entry in [e for e in q if pred(e) and not e.future.done()]:
                entry.future.set_exception(error(entry))
                self.drop(entry)

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """Empty the queue, failing every pending held request with ``error()`` (the gate stops)."""
        queues = list(self.bands.values())
        self.bands.clear()
        for q in queues:
            for entry in q:
                if not entry.future.done():
                    entry.future.set_exception(error())
