"""Core of the time-slice gate: one InferencePool's admission, composed of three parts (no I/O in any of them):

* the endpoint table (:mod:`epp_plugin.gate.endpoints`): endpoint states and weight versions with their checked
  transition table, failure marks, the view's freshness, the SERVING lookup;
* the banded hold queue (:mod:`epp_plugin.gate.hold_queue`): requests waiting for a SERVING endpoint per priority
  band, the bands' settings and counts, the hold pressure;
* the drain accounting (:mod:`epp_plugin.gate.drain`): live admissions, their in-flight counts, the drain barrier
  and its deadline.

:class:`PoolState` holds the policy that spans them (admit or hold, release on a change, refuse) and is what the edges
call. Two edges turn Envoy messages into calls on it: the fast path (``try_admit``/``admit`` on an ext_authz check,
``on_served`` and ``finish`` from access-log entries) and ext_proc (``admit`` on request headers, ``on_served`` on
response headers, ``finish`` on stream end); the state subscription, the one writer of its endpoint states
(docs/decisions/one-writer-of-gate-state.md), turns the orchestrator's commands into ``set_states`` /
``replace_states`` and ``drain``.

Invariants held here (docs/architecture.md, "Invariants"):
1. a request is admitted only with a non-empty list of SERVING endpoints (its *candidates*),
   which becomes the subset hint; with none SERVING it waits in the hold queue of its priority band;
3. held requests are released highest band first, FIFO within a band, only to SERVING endpoints at the
   required weight version;
4. a held request that is cancelled leaves the queue at once;
5. the queue length and hold time are bounded; beyond them admission raises a typed error
   (:mod:`epp_plugin.gate.refusals`).

Priority bands (docs/gate.md, "Priority bands"): a request naming an InferenceObjective (:meth:`PoolState.objective`)
is held in its objective's band, up to the objective's longest hold; a sheddable one (priority < 0) is refused at
once (:class:`SheddableWhileAsleep`) while the pool has no SERVING endpoint. The admission of a request that needs no
wait does no band work at all.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable

from epp_plugin.gate.drain import Admission, DrainAccounting, DrainOutcome
from epp_plugin.gate.endpoints import Endpoint, EndpointState, EndpointTable
from epp_plugin.gate.hold_queue import BandPressure, BandStats, Held, HoldQueue
from epp_plugin.gate.refusals import (
    AdmissionRefused,
    DrainDeadline,
    GateShuttingDown,
    HoldExpired,
    QueueFull,
    SheddableWhileAsleep,
    UnknownObjective,
    UnknownPool,
    WeightVersionUnavailable,
)
from llmd_timeslice.domain.objectives import Band, ObjectiveClass, PoolPriorities
from llmd_timeslice.protocol import MIN_WEIGHT_VERSION_HEADER

__all__ = [
    "Admission",
    "AdmissionRefused",
    "BandPressure",
    "BandStats",
    "DrainDeadline",
    "DrainOutcome",
    "Endpoint",
    "EndpointState",
    "GateShuttingDown",
    "HoldExpired",
    "PoolState",
    "QueueFull",
    "SheddableWhileAsleep",
    "UnknownObjective",
    "UnknownPool",
    "WeightVersionUnavailable",
]


class PoolState:
    """Endpoints, hold queue and live admissions of one InferencePool.

    Args:
        name: pool name (the value Envoy sends in the pool metadata key).
        max_held: most requests held at once; one more raises :class:`QueueFull`.
        max_hold_s: most seconds a request is held before :class:`HoldExpired`.
        release_rate_per_s: held requests released per second when an endpoint turns SERVING
            (0 = no bound); releases go in bursts of ``release_burst``.
        priorities: the pool's objectives and bands (None: objectives off, the objective header is ignored).
        clock: monotonic clock in seconds (injectable for tests).
    """

    def __init__(
        self,
        name: str,
        *,
        max_held: int = 10_000,
        max_hold_s: float = 600.0,
        release_rate_per_s: float = 5_000.0,
        release_burst: int = 64,
        priorities: PoolPriorities | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.max_held = max_held
        self.max_hold_s = max_hold_s
        self.release_rate_per_s = release_rate_per_s
        self.release_burst = max(1, release_burst)
        self._clock = clock
        self.table = EndpointTable(name, clock, on_unfailed=self._release_if_serving)
        self.queue = HoldQueue(max_hold_s, priorities, clock)
        self.drains = DrainAccounting(name, self.table)
        # The parts' containers, by name here too (the same objects, never replaced): the data path reads them.
        self.endpoints: dict[str, Endpoint] = self.table.endpoints
        self.failed = self.table.failed
        self.band_stats: dict[int, BandStats] = self.queue.band_stats
        self._held = self.queue.bands
        self._serving_of = self.table.serving
        self.last_changed: list[str] = []
        """Addresses the last :meth:`set_states` (or :meth:`replace_states`) changed, for its log line."""
        self._releaser: asyncio.Task | None = None
        self.admitted_total = 0
        self.released_total = 0
        self.refused_total = 0
        self.closed = False
        self.weights_final = False  # the orchestrator says no newer weight version can come now (set_weights_final)
        self.on_change: Callable[[], None] | None = None
        """Called after every change of the endpoint list or states (the EDS directory refreshes from it)."""

    # ------------------------------------------------------------------ the parts' figures
    @property
    def epoch(self) -> int:
        """The state epoch: one more at every update that changed something."""
        return self.table.epoch

    @property
    def stale(self) -> bool:
        """True while no endpoint is steerable because the orchestrator's view is lost (see ``EndpointTable.stale``)."""
        return self.table.stale

    @property
    def fresh_until(self) -> float:
        """Monotonic deadline of the orchestrator's view (see ``EndpointTable.fresh_until``)."""
        return self.table.fresh_until

    @property
    def priorities(self) -> PoolPriorities | None:
        return self.queue.priorities

    @property
    def on_pressure(self) -> Callable[[], None] | None:
        """Called when a band with a hold deadline starts or stops holding requests (the subscription sends
        HoldPressure from it)."""
        return self.queue.on_pressure

    @on_pressure.setter
    def on_pressure(self, callback: Callable[[], None] | None) -> None:
        self.queue.on_pressure = callback

    @property
    def forgotten_at_sleep_total(self) -> int:
        """Admissions ended because their endpoint was verified asleep (``DrainAccounting.forget_at``)."""
        return self.drains.forgotten_at_sleep_total

    @property
    def live(self) -> int:
        """Admitted requests whose stream has not ended."""
        return len(self.drains.live)

    @property
    def held(self) -> int:
        """Requests waiting in the hold queue now (every band)."""
        return self.queue.held

    def held_by_band(self) -> dict[int, int]:
        """Requests held now per band, highest band first (bands holding none left out)."""
        return self.queue.held_by_band()

    def oldest_held_by_band(self) -> dict[int, float]:
        """Seconds the oldest held request of each band has waited (bands holding none left out)."""
        return self.queue.oldest_held_by_band()

    def pressure(self) -> list[BandPressure]:
        """Each band with a hold deadline that holds requests now, highest first."""
        return self.queue.pressure()

    def deadline_bands(self) -> list[Band]:
        """The declared bands with a hold deadline."""
        return self.queue.deadline_bands()

    def band(self, priority: int) -> Band:
        """The settings of band ``priority`` (declared, else the pool's ``max_hold_s`` and no deadline)."""
        return self.queue.band(priority)

    def set_priorities(self, priorities: PoolPriorities | None) -> None:
        """Replace the pool's objectives and bands (file reload, a change of the InferenceObjective objects). Held
        requests keep their band and their longest hold."""
        self.queue.set_priorities(priorities)

    def serving(self, min_version: int = 0) -> tuple[str, ...]:
        """Addresses that are SERVING at ``weight_version >= min_version``, in insertion order (none while stale)."""
        return self._serving_of(min_version)

    def newest_version(self) -> int:
        """The highest weight version any endpoint of the pool has (whatever its state; 0: the initial weights)."""
        return self.table.newest_version()

    def in_flight(self, addresses: Iterable[str]) -> dict[str, int]:
        """Live requests that may still reach each address."""
        return self.table.in_flight(addresses)

    def objective(self, name: str) -> ObjectiveClass | None:
        """The objective a request names (the ``x-gateway-inference-objective`` header's value); None when the pool
        has no objectives configured (the header is then ignored, as before objectives existed).

        Raises:
            UnknownObjective: objectives are configured and none has this name (the message lists the known ones).
        """
        pp = self.queue.priorities
        if pp is None:
            return None
        obj = pp.objectives.get(name)
        if obj is None:
            self.refused_total += 1
            known = sorted(pp.objectives)
            shown = ", ".join(known[:20]) + (f" and {len(known) - 20} more" if len(known) > 20 else "")
            raise UnknownObjective(
                f"unknown InferenceObjective {name[:253]!r} for pool {self.name!r} "
                f"(header x-gateway-inference-objective); known: {shown or 'none'}"
            )
        return obj

    def _refused(self, band: int, reason: str) -> None:
        self.refused_total += 1
        refused = self.queue.stats(band).refused_total
        refused[reason] = refused.get(reason, 0) + 1

    # ---------------------------------------------------------------- data path
    def try_admit(self, min_version: int = 0, objective: ObjectiveClass | None = None) -> Admission | None:
        """Admit one request at once if that needs no wait (an eligible endpoint serves and nobody is held).

        Returns None when the request would have to wait: then ``await admit()`` holds it. Lets an edge
        answer the common case without a task per request. ``objective``: from :meth:`objective` (None: band 0).

        Raises:
            GateShuttingDown: the gate is stopping.
            SheddableWhileAsleep: ``objective`` is sheddable and no endpoint of the pool serves.
        """
        if self.closed:
            self.refused_total += 1
            raise GateShuttingDown(f"gate is shutting down; pool {self.name!r} admits nothing")
        if min_version and self.weights_final:
            self._check_version_can_come(min_version, objective)
        if not self._held:
            candidates = self._serving_of(min_version)
            if candidates:
                return self._start(candidates, 0.0)
        if objective is not None:
            self._shed(objective)
        return None

    def _unavailable(self, min_version: int) -> WeightVersionUnavailable:
        return WeightVersionUnavailable(
            f"pool {self.name!r} has no weight version >= {min_version} (header "
            f"{MIN_WEIGHT_VERSION_HEADER}): the newest there is is {self.newest_version()}, and none newer can come "
            "now (no trainer holds or waits for the pool's group, none is pending)"
        )

    def _check_version_can_come(self, min_version: int, objective: ObjectiveClass | None) -> None:
        """Refuse at once a request for a version above the newest while none newer can come."""
        if min_version > self.newest_version():
            self._refused(objective.band.priority if objective is not None else 0, WeightVersionUnavailable.reason)
            raise self._unavailable(min_version)

    def set_weights_final(self, final: bool) -> None:
        """The orchestrator says whether a newer weight version can come (``weights_final``, gate_state.proto). When
        none can, held requests asking for a version above the newest are refused now (:class:`WeightVersionUnavailable`)
        instead of at their longest hold."""
        was, self.weights_final = self.weights_final, final
        if not final or was:
            return
        newest = self.newest_version()
        # admit() counts each refusal; the entry leaves the queue now
        self.queue.fail_where(lambda e: e.min_version > newest, lambda e: self._unavailable(e.min_version))

    def _shed(self, objective: ObjectiveClass | None) -> None:
        """The request must wait: refuse it now when it is sheddable and the pool has no SERVING endpoint."""
        if objective is not None and objective.band.sheddable and not self.serving():
            self._refused(objective.band.priority, SheddableWhileAsleep.reason)
            raise SheddableWhileAsleep(
                f"pool {self.name!r} has no serving endpoint (its engines sleep while a trainer holds the "
                f"accelerators) and objective {objective.name!r} is sheddable (priority {objective.band.priority} < 0): "
                "refused rather than held; retry later"
            )

    async def admit(self, min_version: int = 0, objective: ObjectiveClass | None = None) -> Admission:
        """Admit one request: return at once when an endpoint serves, else hold it in its band (FIFO within it;
        ``objective`` None: band 0 with the pool's ``max_hold_s``).

        Raises:
            QueueFull: ``max_held`` requests are already held (all bands together).
            HoldExpired: no eligible endpoint turned SERVING within the longest hold (the objective's, else its
                band's, else ``max_hold_s``) seconds.
            SheddableWhileAsleep: ``objective`` is sheddable and no endpoint of the pool serves.
            GateShuttingDown: the gate stopped while the request was held.
            asyncio.CancelledError: the caller (Envoy stream) went away; the entry is removed.
        """
        adm = self.try_admit(min_version, objective)
        if adm is not None:
            return adm
        candidates = self.serving(min_version)
        queue = self.queue
        if objective is None:  # band 0: the pool's max_hold_s unless band 0 is declared
            band, name = queue.band0, ""
            hold_s = band.max_hold_s if queue.priorities is not None and 0 in queue.priorities.bands else self.max_hold_s
        else:
            band, hold_s, name = objective.band, objective.max_hold_s, objective.name
        held = queue.held
        if held >= self.max_held:
            self._refused(band.priority, QueueFull.reason)
            raise QueueFull(f"pool {self.name!r} already holds {held} requests (max_held)")
        entry = Held(min_version, self._clock(), asyncio.get_running_loop().create_future(), band.priority, name)
        queue.push(entry, band)
        if candidates:
            self._kick_releaser()
        try:
            candidates = await asyncio.wait_for(entry.future, hold_s)
        except TimeoutError:
            queue.drop(entry)
            self._refused(band.priority, HoldExpired.reason)
            if band.hold_deadline_s is not None and hold_s > band.hold_deadline_s:
                queue.stats(band.priority).deadline_misses_total += 1
            what = f"objective {name!r} (band {band.priority})" if name else f"band {band.priority}"
            raise HoldExpired(
                f"no endpoint of pool {self.name!r} at weight version >= {min_version} "
                f"turned SERVING within {hold_s:g} s, the longest hold of {what}"
            ) from None
        except asyncio.CancelledError:
            queue.drop(entry)
            raise
        except AdmissionRefused as err:
            self._refused(band.priority, err.reason)
            raise
        waited = self._clock() - entry.enqueued_at
        if band.hold_deadline_s is not None and waited > band.hold_deadline_s:
            queue.stats(band.priority).deadline_misses_total += 1
        adm = self._start(candidates, waited)
        adm.band = band.priority
        return adm

    def _start(self, candidates: tuple[str, ...], hold_s: float) -> Admission:
        self.admitted_total += 1
        return self.drains.start(Admission(self.name, candidates, self.table.epoch, hold_s))

    def on_served(self, adm: Admission, address: str) -> int | None:
        """The response path names the endpoint that served ``adm``; it alone stays counted.

        Returns the served endpoint's weight version (None if the endpoint is unknown to the pool)."""
        return self.drains.on_served(adm, address)

    def narrow(self, adm: Admission, addresses: tuple[str, ...]) -> None:
        """``adm`` may reach only ``addresses`` (a subset of its candidates) from now on: the others stop counting."""
        self.drains.narrow(adm, addresses)

    def finish(self, adm: Admission) -> None:
        """The request's stream ended (complete, reset or client gone). Idempotent."""
        self.drains.finish(adm)

    # ------------------------------------------------------------- control path
    def set_states(self, updates: Iterable[tuple[str, EndpointState, int | None]], resync: bool = False) -> int:
        """Apply ``(address, state, weight_version or None)`` updates; return the new epoch.

        Endpoints not named keep their state. A change that makes an endpoint SERVING starts the
        release of held requests. Each move is checked against the endpoint table's transitions unless ``resync``
        (a full snapshot; :mod:`epp_plugin.gate.endpoints`). An endpoint verified ASLEEP stops counting the
        admissions still counted against it (``DrainAccounting.forget_at``).
        """
        table, endpoints = self.table, self.endpoints
        changed: list[str] = []
        for address, state, version in updates:
            ep = endpoints.get(address)
            if ep is not None and state is EndpointState.ASLEEP and ep.state is not EndpointState.ASLEEP and ep.in_flight > 0:
                self.drains.forget_at(address)
            if table.update(address, state, version, resync):
                changed.append(address)
        self.last_changed = changed
        if changed:
            table.states_changed()
            table.epoch += 1
            if self._held and self.serving():
                self._kick_releaser()
            self.drains.notify()
            if self.on_change is not None:
                self.on_change()
        return table.epoch

    def replace_states(self, items: Iterable[tuple[str, EndpointState, int | None]]) -> int:
        """Make ``items`` the whole endpoint list (a full snapshot); returns the new epoch.

        Endpoints not listed are removed when nothing is in flight to them, else set DRAINING
        (never a target again; removed on a later snapshot).
        """
        items = list(items)
        listed = {a for a, _, _ in items}
        for addr in [a for a in self.endpoints if a not in listed]:
            if self.endpoints[addr].in_flight == 0:
                self.table.remove(addr)
                if self.on_change is not None:
                    self.on_change()
            else:
                items.append((addr, EndpointState.DRAINING, None))
        return self.set_states(items, resync=True)

    def mark_failed(self, address: str, hold_s: float) -> bool:
        """Envoy could not connect to ``address``: steer no new request to it until the orchestrator publishes a new
        state for it, or for ``hold_s`` seconds (then it is tried again; 0: until a new state). Requests already
        admitted keep counting. Returns whether it was a SERVING endpoint not marked yet (first failure)."""
        return self.table.mark_failed(address, hold_s)

    async def wait_drained(self, addresses: Iterable[str], timeout_s: float) -> tuple[bool, dict[str, int]]:
        """Wait until no live request may reach ``addresses`` (the drain barrier).

        Returns ``(drained, in_flight per address)``; ``drained`` is False after ``timeout_s``
        seconds. Woken by request ends, not by polling.
        """
        return await self.drains.wait_drained(addresses, timeout_s)

    def _drain_deadline(self, hit: list[str]) -> DrainDeadline:
        return DrainDeadline(
            f"the drain deadline of pool {self.name!r} passed while this request could still reach draining "
            f"endpoint(s) {hit} and no response had started; retry: it will be admitted to a serving endpoint "
            "or held"
        )

    def cut_unserved(self, addresses: Iterable[str]) -> list[Admission]:
        """Refuse, with :class:`DrainDeadline`, every live request that may still reach one of ``addresses`` and
        whose served endpoint is not known yet; returns them. Each is answered through its edge's ``on_cut``
        (requests without one stay counted) and stops counting when its stream ends."""
        cut = self.drains.cut_unserved(addresses, self._drain_deadline)
        self.refused_total += len(cut)
        return cut

    async def drain(self, addresses: Iterable[str], timeout_s: float, cut_grace_s: float = 2.0) -> DrainOutcome:
        """The drain barrier with its deadline: wait up to ``timeout_s`` seconds (:meth:`wait_drained`); if requests
        still count against ``addresses`` then, cut those whose response has not started (:meth:`cut_unserved`,
        :class:`DrainDeadline`) and wait up to ``cut_grace_s`` seconds for their streams to end. Requests whose
        response has started are left to complete (the engine sleeps with ``mode=wait``) and reported in
        ``in_flight``."""
        outcome = await self.drains.drain(addresses, timeout_s, self._drain_deadline, cut_grace_s)
        self.refused_total += len(outcome.cut)
        return outcome

    def set_stale(self, stale: bool) -> None:
        """Enter or leave the stale state (see ``stale``); leaving it releases held requests."""
        if stale == self.table.stale:
            return
        self.table.stale = stale
        if not stale and self._held:
            self._kick_releaser()

    def set_fresh_until(self, deadline: float) -> None:
        """Move the view's deadline (see ``fresh_until``, monotonic seconds of ``clock``); moving it from the past
        into the future releases held requests, as leaving ``stale`` does."""
        table = self.table
        was_expired = table.fresh_until != math.inf and self._clock() >= table.fresh_until
        table.fresh_until = deadline
        if was_expired and self._held and not table.stale:
            self._kick_releaser()

    def close(self) -> None:
        """Refuse every held request with :class:`GateShuttingDown` and admit nothing more."""
        self.closed = True
        self.table.clear_all_failed()
        self.queue.fail_all(lambda: GateShuttingDown(f"gate stopped while pool {self.name!r} held the request"))
        if self._releaser is not None:
            self._releaser.cancel()

    # ---------------------------------------------------------------- release
    def _release_if_serving(self) -> None:
        """A failure mark expired: release held requests if an endpoint serves now."""
        if self._held and self.serving():
            self._kick_releaser()

    def _kick_releaser(self) -> None:
        if self._releaser is None or self._releaser.done():
            self._releaser = asyncio.get_running_loop().create_task(self._release_held())

    async def _release_held(self) -> None:
        """Release held requests in bursts, highest band first and FIFO within a band, at most
        ``release_rate_per_s`` per second."""
        pause = self.release_burst / self.release_rate_per_s if self.release_rate_per_s > 0 else 0.0
        loop = asyncio.get_running_loop()
        due = loop.time()  # bursts on a schedule: the time spent releasing counts against the pause, not on top
        while self._held:
            released = self.queue.release(self._serving_of, self.release_burst)
            self.released_total += released
            if released == 0:
                return
            due += pause
            await asyncio.sleep(max(0.0, due - loop.time()))
