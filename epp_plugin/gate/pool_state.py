"""Core of the time-slice gate: per-InferencePool endpoint states, hold queue and drain barrier.

No I/O here. Two edges turn Envoy messages into calls on :class:`PoolState`: the fast path
(``try_admit``/``admit`` on an ext_authz check, ``on_served`` and ``finish`` from access-log entries)
and ext_proc (``admit`` on request headers, ``on_served`` on response headers, ``finish`` on stream
end); the control servicer turns orchestrator calls into ``set_states`` and ``wait_drained``.

Invariants held here (docs/architecture.md, "Invariants"):
1. a request is admitted only with a non-empty list of SERVING endpoints (its *candidates*),
   which becomes the subset hint; with none SERVING it waits in the hold queue of its priority band;
3. held requests are released highest band first, FIFO within a band, only to SERVING endpoints at the
   required weight version;
4. a held request that is cancelled leaves the queue at once;
5. the queue length and hold time are bounded; beyond them admission raises a typed error.

Drain barrier: every live request counts against each endpoint it could still reach (its
candidates until the served endpoint is learned on the response path, then that endpoint
alone). An endpoint set DRAINING at epoch E is never a candidate of a request admitted at or
after E, so "drained" is simply "no live request counts against it".

Drain deadline (:meth:`PoolState.drain`): when the barrier has not held within the deadline, every
live request that may still reach a draining endpoint and whose response has not started (it is
still travelling: in the EPP, queued, connecting, or computing a non-streamed answer) is refused
with :class:`DrainDeadline` (503, retryable) through its edge; a request whose response has started
keeps counting and completes on the engine, which sleeps with ``mode=wait``. So after the deadline
no request admitted before the drain can reach an engine that sleeps, and none is dropped silently.

Priority bands (docs/gate.md, "Priority bands"; :mod:`llmd_timeslice.domain.objectives`): a request naming an
InferenceObjective (:meth:`PoolState.objective`) is held in its objective's band, up to the objective's longest
hold; a sheddable one (priority < 0) is refused at once (:class:`SheddableWhileAsleep`) while the pool has no
SERVING endpoint. A request naming none is band 0 with the pool's ``max_hold_s`` (an undeclared band 0), exactly
as before bands existed; the admission of a request that needs no wait does no band work at all.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from llmd_timeslice.domain.objectives import Band, ObjectiveClass, PoolPriorities
from llmd_timeslice.protocol import MIN_WEIGHT_VERSION_HEADER

log = logging.getLogger(__name__)

_INF = math.inf  # a module global: no attribute lookup per admission
_SERVING_CACHE_LIMIT = 64


class EndpointState(enum.Enum):
    """Gate view of one model-server endpoint (docs/architecture.md, "States and their vocabularies")."""

    SERVING = "SERVING"
    DRAINING = "DRAINING"
    ASLEEP = "ASLEEP"
    WAKING = "WAKING"


class AdmissionRefused(Exception):
    """Base of the typed refusals; ``http_status`` and ``reason`` go to the client."""

    http_status = 503
    reason = "refused"
    retry_after_s: int | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueFull(AdmissionRefused):
    """The pool already holds ``max_held`` requests (HTTP 429)."""

    http_status = 429
    reason = "hold_queue_full"
    retry_after_s = 1


class HoldExpired(AdmissionRefused):
    """The request waited ``max_hold_s`` without a SERVING endpoint (HTTP 503)."""

    http_status = 503
    reason = "hold_expired"
    retry_after_s = 5


class SheddableWhileAsleep(AdmissionRefused):
    """A sheddable request (its objective's priority < 0) while the pool has no SERVING endpoint: refused at once
    rather than held (HTTP 503, retryable once the pool serves again)."""

    http_status = 503
    reason = "sheddable_while_asleep"
    retry_after_s = 5


class UnknownObjective(AdmissionRefused):
    """The request names an InferenceObjective this gate does not know for its pool (HTTP 400)."""

    http_status = 400
    reason = "unknown_objective"


class UnknownPool(AdmissionRefused):
    """The request names a pool this gate does not know (HTTP 503, a configuration error)."""

    http_status = 503
    reason = "unknown_pool"


class DrainDeadline(AdmissionRefused):
    """The drain deadline passed while the request could still reach a draining endpoint and its response had
    not started (HTTP 503, retryable: a retry is admitted to a serving endpoint or held)."""

    http_status = 503
    reason = "drain_deadline"
    retry_after_s = 1


class WeightVersionUnavailable(AdmissionRefused):
    """The request asks for a weight version above the newest the pool has, and none can come now: no job holds or
    waits for the pool's group and none is pending (the orchestrator's ``weights_final``). HTTP 503, refused at once
    rather than held to the longest hold (issue 38 §5)."""

    http_status = 503
    reason = "weight_version_unavailable"


class GateShuttingDown(AdmissionRefused):
    """The gate is stopping; held requests are refused rather than left hanging (HTTP 503)."""

    http_status = 503
    reason = "gate_shutting_down"
    retry_after_s = 1


@dataclass(slots=True)
class Endpoint:
    """One endpoint (``ip:port``) of a pool; ``in_flight`` counts live requests that may reach it."""

    address: str
    state: EndpointState
    weight_version: int = 0
    in_flight: int = 0


@dataclass(eq=False, slots=True)
class Admission:
    """One admitted request, from request headers to stream end.

    ``candidates`` are the endpoints it may reach (the subset hint it was given, then the served
    endpoint once known). ``hold_s`` is the time it waited in the queue, in seconds.
    """

    pool: str
    candidates: tuple[str, ...]
    epoch: int
    hold_s: float
    served: str | None = None
    finished: bool = False
    request_id: str = ""
    """The request's id as the edge read it (Envoy's ``x-request-id``), to name it in drain reports."""
    on_cut: Callable[[AdmissionRefused], None] | None = field(default=None, repr=False)
    """Set by an edge that can still answer the request after admitting it (ext_proc: an ImmediateResponse
    on the open stream); called once with the refusal when the drain deadline cuts the request."""
    cut: bool = False
    band: int = 0
    """Priority band the request was held in (0: no objective, or an objective of priority 0)."""


@dataclass
class DrainOutcome:
    """Result of :meth:`PoolState.drain`: ``drained`` when nothing can reach the addresses any more;
    ``in_flight`` per address (requests whose response has started, or whose edge cannot cut them);
    ``cut`` the requests refused with :class:`DrainDeadline` at the deadline."""

    drained: bool
    in_flight: dict[str, int]
    cut: list[Admission] = field(default_factory=list)


@dataclass(eq=False)
class _Held:
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
        self.endpoints: dict[str, Endpoint] = {}
        self.epoch = 0
        self.last_changed: list[str] = []
        """Addresses the last :meth:`set_states` (or :meth:`replace_states`) changed, for its log line."""
        self._held: dict[int, deque[_Held]] = {}
        """Held requests per band; a band is a key only while it holds one (so ``if self._held`` is "anyone held")."""
        self.priorities: PoolPriorities | None = None
        self._band0 = Band(0, max_hold_s)
        self.band_stats: dict[int, BandStats] = {}
        self.on_pressure: Callable[[], None] | None = None
        """Called when a band with a hold deadline starts or stops holding requests (the subscription sends
        HoldPressure from it)."""
        self.set_priorities(priorities)
        self._live: set[Admission] = set()
        self._changed = asyncio.Condition()
        self._releaser: asyncio.Task | None = None
        self._drain_waiters = 0
        self._tasks: set[asyncio.Task] = set()  # notifications in flight, kept: the loop holds tasks only weakly
        self.admitted_total = 0
        self.forgotten_at_sleep_total = 0
        """Admissions ended because their endpoint was verified asleep (see ``_forget_at``)."""
        self.released_total = 0
        self.refused_total = 0
        self.closed = False
        self.weights_final = False  # the orchestrator says no newer weight version can come now (set_weights_final)
        self.on_change: Callable[[], None] | None = None
        """Called after every change of the endpoint list or states (the EDS directory refreshes from it)."""
        self.failed: dict[str, asyncio.TimerHandle | None] = {}
        """Endpoints Envoy could not connect to (:meth:`mark_failed`): not steered to until their state changes or
        their hold passes."""
        self._serving: dict[int, tuple[str, ...]] = {}
        """:meth:`serving`'s answer per ``min_version``, emptied by every change of an endpoint's state, version or
        failure mark (:meth:`_states_changed`): the data path asks it once per request, the state changes per switch."""
        self.stale = False
        """True while the gate has lost the orchestrator's state stream for longer than its grace: no
        endpoint is steerable (new requests are held) until the stream resyncs."""
        self.fresh_until = math.inf
        """Monotonic deadline (the pool's ``clock``) of the orchestrator view: past it the pool counts as stale at
        once, in the data path, even before the subscription's watchdog runs (after a stall of this process the
        first request must not be steered by a view the orchestrator may have acted past). ``inf``: no deadline."""

    # ------------------------------------------------------------------ queries
    @property
    def held(self) -> int:
        """Requests waiting in the hold queue now (every band)."""
        return sum(len(q) for q in self._held.values())

    def held_by_band(self) -> dict[int, int]:
        """Requests held now per band, highest band first (bands holding none left out)."""
        return {b: len(self._held[b]) for b in sorted(self._held, reverse=True)}

    def oldest_held_by_band(self) -> dict[int, float]:
        """Seconds the oldest held request of each band has waited (bands holding none left out)."""
        now = self._clock()
        return {b: now - q[0].enqueued_at for b, q in self._held.items() if q}

    def pressure(self) -> list[BandPressure]:
        """Each band with a hold deadline that holds requests now, highest first (see :class:`BandPressure`)."""
        out = []
        now = self._clock()
        for b in sorted(self._held, reverse=True):
            band = self._band(b)
            q = self._held[b]
            if band.hold_deadline_s is None or not q:
                continue
            oldest = q[0]
            out.append(BandPressure(b, oldest.objective, now - oldest.enqueued_at, band.hold_deadline_s, len(q)))
        return out

    def deadline_bands(self) -> list[Band]:
        """The declared bands with a hold deadline."""
        if self.priorities is None:
            return [self._band0] if self._band0.hold_deadline_s is not None else []
        return [b for b in self.priorities.bands.values() if b.hold_deadline_s is not None]

    def objective(self, name: str) -> ObjectiveClass | None:
        """The objective a request names (the ``x-gateway-inference-objective`` header's value); None when the pool
        has no objectives configured (the header is then ignored, as before objectives existed).

        Raises:
            UnknownObjective: objectives are configured and none has this name (the message lists the known ones).
        """
        pp = self.priorities
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

    def set_priorities(self, priorities: PoolPriorities | None) -> None:
        """Replace the pool's objectives and bands (file reload, a change of the InferenceObjective objects). Held
        requests keep their band and their longest hold."""
        self.priorities = priorities
        self._band0 = priorities.band(0) if priorities is not None else Band(0, self.max_hold_s)

    def band(self, priority: int) -> Band:
        """The settings of band ``priority`` (declared, else the pool's ``max_hold_s`` and no deadline)."""
        return self._band(priority)

    def _band(self, priority: int) -> Band:
        if priority == 0:
            return self._band0
        return self.priorities.band(priority) if self.priorities is not None else Band(priority, self.max_hold_s)

    def _stats(self, band: int) -> BandStats:
        st = self.band_stats.get(band)
        if st is None:
            st = self.band_stats[band] = BandStats()
        return st

    def _refused(self, band: int, reason: str) -> None:
        self.refused_total += 1
        refused = self._stats(band).refused_total
        refused[reason] = refused.get(reason, 0) + 1

    @property
    def live(self) -> int:
        """Admitted requests whose stream has not ended."""
        return len(self._live)

    def serving(self, min_version: int = 0) -> tuple[str, ...]:
        """Addresses that are SERVING at ``weight_version >= min_version``, in insertion order (none while stale)."""
        if self.stale or (self.fresh_until != _INF and self._clock() >= self.fresh_until):
            return ()
        found = self._serving.get(min_version)
        if found is not None:
            return found
        failed = self.failed
        found = tuple(
            ep.address
            for ep in self.endpoints.values()
            if ep.state is EndpointState.SERVING and ep.weight_version >= min_version and ep.address not in failed
        )
        if len(self._serving) >= _SERVING_CACHE_LIMIT:  # min_version comes from clients: bounded
            self._serving.clear()
        self._serving[min_version] = found
        return found

    def _states_changed(self) -> None:
        """An endpoint was added, removed, changed state or version, or was marked failed or unmarked."""
        self._serving.clear()

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
            candidates = self.serving(min_version)
            if candidates:
                return self._start(candidates, 0.0)
        if objective is not None:
            self._shed(objective)
        return None

    def newest_version(self) -> int:
        """The highest weight version any endpoint of the pool has (whatever its state; 0: the initial weights)."""
        return max((ep.weight_version for ep in self.endpoints.values()), default=0)

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
        for q in list(self._held.values()):
            for entry in [e for e in q if e.min_version > newest and not e.future.done()]:
                entry.future.set_exception(self._unavailable(entry.min_version))  # admit() counts the refusal
                self._drop(entry)  # out of the queue now

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
        if objective is None:  # band 0: the pool's max_hold_s unless band 0 is declared
            band, name = self._band0, ""
            hold_s = band.max_hold_s if self.priorities is not None and 0 in self.priorities.bands else self.max_hold_s
        else:
            band, hold_s, name = objective.band, objective.max_hold_s, objective.name
        held = self.held
        if held >= self.max_held:
            self._refused(band.priority, QueueFull.reason)
            raise QueueFull(f"pool {self.name!r} already holds {held} requests (max_held)")
        loop = asyncio.get_running_loop()
        entry = _Held(min_version, self._clock(), loop.create_future(), band.priority, name)
        q = self._held.get(band.priority)
        if q is None:
            q = self._held[band.priority] = deque()
        q.append(entry)
        if len(q) == 1 and band.hold_deadline_s is not None and self.on_pressure is not None:
            self.on_pressure()
        if candidates:
            self._kick_releaser()
        try:
            candidates = await asyncio.wait_for(entry.future, hold_s)
        except TimeoutError:
            self._drop(entry)
            self._refused(band.priority, HoldExpired.reason)
            if band.hold_deadline_s is not None and hold_s > band.hold_deadline_s:
                self._stats(band.priority).deadline_misses_total += 1
            what = f"objective {name!r} (band {band.priority})" if name else f"band {band.priority}"
            raise HoldExpired(
                f"no endpoint of pool {self.name!r} at weight version >= {min_version} "
                f"turned SERVING within {hold_s:g} s, the longest hold of {what}"
            ) from None
        except asyncio.CancelledError:
            self._drop(entry)
            raise
        except AdmissionRefused as err:
            self._refused(band.priority, err.reason)
            raise
        waited = self._clock() - entry.enqueued_at
        if band.hold_deadline_s is not None and waited > band.hold_deadline_s:
            self._stats(band.priority).deadline_misses_total += 1
        adm = self._start(candidates, waited)
        adm.band = band.priority
        return adm

    def _drop(self, entry: _Held) -> None:
        # A released-but-abandoned entry was never counted in flight (that happens in _start).
        q = self._held.get(entry.band)
        if q is not None:
            try:
                q.remove(entry)
            except ValueError:
                pass
            if not q:
                del self._held[entry.band]
                self._band_emptied(entry.band)
        if not entry.future.done():
            entry.future.cancel()

    def _band_emptied(self, band: int) -> None:
        if self.on_pressure is not None and self._band(band).hold_deadline_s is not None:
            self.on_pressure()

    def _start(self, candidates: tuple[str, ...], hold_s: float) -> Admission:
        adm = Admission(self.name, candidates, self.epoch, hold_s)
        for addr in candidates:
            self.endpoints[addr].in_flight += 1
        self._live.add(adm)
        self.admitted_total += 1
        return adm

    def on_served(self, adm: Admission, address: str) -> int | None:
        """The response path names the endpoint that served ``adm``; it alone stays counted.

        Returns the served endpoint's weight version (None if the endpoint is unknown to the pool)."""
        ep = self.endpoints.get(address)
        version = ep.weight_version if ep is not None else None
        if adm.finished or adm.served is not None:
            return version
        adm.served = address
        dropped = adm.candidates
        if address not in dropped:
            # Served outside the hint (an EPP that ignored it): count it where it really went.
            if ep is not None:
                ep.in_flight += 1
            adm.candidates = (address,) if ep is not None else ()
            if not dropped:
                return version
        else:
            adm.candidates = (address,)
            if len(dropped) == 1:  # the hint was that endpoint alone: nothing stops counting
                return version
        for addr in dropped:
            if addr != address:
                self._uncount(addr)
        self._notify()
        return version

    def narrow(self, adm: Admission, addresses: tuple[str, ...]) -> None:
        """``adm`` may reach only ``addresses`` (a subset of its candidates) from now on: the others stop counting."""
        if adm.finished or adm.served is not None or len(addresses) >= len(adm.candidates):
            return
        dropped = tuple(a for a in adm.candidates if a not in addresses)
        adm.candidates = tuple(a for a in adm.candidates if a in addresses)
        for addr in dropped:
            self._uncount(addr)
        if dropped:
            self._notify()

    def finish(self, adm: Admission) -> None:
        """The request's stream ended (complete, reset or client gone). Idempotent."""
        if adm.finished:
            return
        adm.finished = True
        self._live.discard(adm)
        for addr in adm.candidates:
            self._uncount(addr)
        if adm.candidates:
            self._notify()

    def _uncount(self, addr: str) -> None:
        ep = self.endpoints.get(addr)
        if ep is not None and ep.in_flight > 0:
            ep.in_flight -= 1

    # ------------------------------------------------------------- control path
    def set_states(self, updates: Iterable[tuple[str, EndpointState, int | None]]) -> int:
        """Apply ``(address, state, weight_version or None)`` updates; return the new epoch.

        Endpoints not named keep their state. A change that makes an endpoint SERVING starts the
        release of held requests.
        """
        changed: list[str] = []
        for address, state, version in updates:
            ep = self.endpoints.get(address)
            if ep is None:
                self.endpoints[address] = Endpoint(address, state, version or 0)
                changed.append(address)
                continue
            if state is EndpointState.ASLEEP and ep.state is not EndpointState.ASLEEP and ep.in_flight > 0:
                self._forget_at(address)
            if ep.state is not state or (version is not None and version != ep.weight_version):
                ep.state = state
                if version is not None:
                    ep.weight_version = version
                changed.append(address)
                self._clear_failed(address)  # the orchestrator said something new about it: that governs
        self.last_changed = changed
        if changed:
            self._states_changed()
            self.epoch += 1
            if self._held and self.serving():
                self._kick_releaser()
            self._notify()
            if self.on_change is not None:
                self.on_change()
        return self.epoch

    def _forget_at(self, address: str) -> None:
        """``address`` was verified asleep (the orchestrator publishes ASLEEP only after its sidecar saw the engine
        idle, slept it with ``mode=wait`` and aborted what was parked inside): no admission still counted against it
        can be at that engine. Such counts are lost completions (an access-log entry Envoy dropped while this gate
        was slow or stalled): without this, each would keep every later drain of the endpoint waiting to its
        deadline until the age rule (``--lost-completion-after-s``). An admission that may still reach another
        candidate keeps that one."""
        ended = narrowed = 0
        for adm in list(self._live):
            if address not in adm.candidates:
                continue
            if adm.served == address or adm.candidates == (address,):
                self.finish(adm)
                ended += 1
            else:
                adm.candidates = tuple(a for a in adm.candidates if a != address)
                self._uncount(address)
                narrowed += 1
        self.forgotten_at_sleep_total += ended
        if ended or narrowed:
            log.warning(
                "pool=%s endpoint=%s verified asleep with %d admission(s) still counted against it: ended %d, "
                "narrowed %d to their other candidates (their completions never came: access-log entries lost)",
                self.name,
                address,
                ended + narrowed,
                ended,
                narrowed,
            )

    def mark_failed(self, address: str, hold_s: float) -> bool:
        """Envoy could not connect to ``address``: steer no new request to it until the orchestrator publishes a new
        state for it, or for ``hold_s`` seconds (then it is tried again; 0: until a new state). Requests already
        admitted keep counting. Returns whether it was a SERVING endpoint not marked yet (first failure)."""
        ep = self.endpoints.get(address)
        if ep is None or address in self.failed:
            return False
        timer = asyncio.get_running_loop().call_later(hold_s, self._failed_expired, address) if hold_s > 0 else None
        self.failed[address] = timer
        self._states_changed()
        return ep.state is EndpointState.SERVING

    def _failed_expired(self, address: str) -> None:
        self.failed.pop(address, None)
        self._states_changed()
        if self._held and self.serving():
            self._kick_releaser()

    def _clear_failed(self, address: str) -> None:
        """Unmark ``address`` (no-op when it is not marked failed)."""
        if address not in self.failed:
            return
        timer = self.failed.pop(address)
        self._states_changed()
        if timer is not None:
            timer.cancel()

    def replace_states(self, items: Iterable[tuple[str, EndpointState, int | None]]) -> int:
        """Make ``items`` the whole endpoint list (a full snapshot); returns the new epoch.

        Endpoints not listed are removed when nothing is in flight to them, else set DRAINING
        (never a target again; removed on a later snapshot).
        """
        items = list(items)
        listed = {a for a, _, _ in items}
        for addr in [a for a in self.endpoints if a not in listed]:
            if self.endpoints[addr].in_flight == 0:
                del self.endpoints[addr]
                self._states_changed()
                self._clear_failed(addr)
                if self.on_change is not None:
                    self.on_change()
            else:
                items.append((addr, EndpointState.DRAINING, None))
        return self.set_states(items)

    def in_flight(self, addresses: Iterable[str]) -> dict[str, int]:
        """Live requests that may still reach each address."""
        return {a: (self.endpoints[a].in_flight if a in self.endpoints else 0) for a in addresses}

    async def wait_drained(self, addresses: Iterable[str], timeout_s: float) -> tuple[bool, dict[str, int]]:
        """Wait until no live request may reach ``addresses`` (the drain barrier).

        Returns ``(drained, in_flight per address)``; ``drained`` is False after ``timeout_s``
        seconds. Woken by request ends, not by polling.
        """
        addrs = list(addresses)

        def drained() -> bool:
            return all(v == 0 for v in self.in_flight(addrs).values())

        if drained():
            return True, self.in_flight(addrs)
        self._drain_waiters += 1
        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(drained), max(0.0, timeout_s))
            return True, self.in_flight(addrs)
        except TimeoutError:
            return False, self.in_flight(addrs)
        finally:
            self._drain_waiters -= 1

    def cut_unserved(self, addresses: Iterable[str]) -> list[Admission]:
        """Refuse, with :class:`DrainDeadline`, every live request that may still reach one of ``addresses`` and
        whose served endpoint is not known yet; returns them. Each is answered through its edge's ``on_cut``
        (requests without one stay counted) and stops counting when its stream ends."""
        addrs = set(addresses)
        cut = []
        for adm in list(self._live):
            if adm.served is not None or adm.cut or adm.on_cut is None or addrs.isdisjoint(adm.candidates):
                continue
            adm.cut = True
            hit = sorted(addrs.intersection(adm.candidates))
            adm.on_cut(
                DrainDeadline(
                    f"the drain deadline of pool {self.name!r} passed while this request could still reach draining "
                    f"endpoint(s) {hit} and no response had started; retry: it will be admitted to a serving endpoint "
                    "or held"
                )
            )
            cut.append(adm)
        self.refused_total += len(cut)
        return cut

    async def drain(self, addresses: Iterable[str], timeout_s: float, cut_grace_s: float = 2.0) -> DrainOutcome:
        """The drain barrier with its deadline: wait up to ``timeout_s`` seconds (:meth:`wait_drained`); if requests
        still count against ``addresses`` then, cut those whose response has not started (:meth:`cut_unserved`)
        and wait up to ``cut_grace_s`` seconds for their streams to end. Requests whose response has started
        are left to complete (the engine sleeps with ``mode=wait``) and reported in ``in_flight``."""
        addrs = list(addresses)
        drained, in_flight = await self.wait_drained(addrs, timeout_s)
        if drained:
            return DrainOutcome(True, in_flight)
        cut = self.cut_unserved(addrs)
        if cut:
            drained, in_flight = await self.wait_drained(addrs, cut_grace_s)
        return DrainOutcome(drained, in_flight, cut)

    def set_stale(self, stale: bool) -> None:
        """Enter or leave the stale state (see ``stale``); leaving it releases held requests."""
        if stale == self.stale:
            return
        self.stale = stale
        if not stale and self._held:
            self._kick_releaser()

    def set_fresh_until(self, deadline: float) -> None:
        """Move the view's deadline (see ``fresh_until``, monotonic seconds of ``clock``); moving it from the past
        into the future releases held requests, as leaving ``stale`` does."""
        was_expired = self.fresh_until != math.inf and self._clock() >= self.fresh_until
        self.fresh_until = deadline
        if was_expired and self._held and not self.stale:
            self._kick_releaser()

    def close(self) -> None:
        """Refuse every held request with :class:`GateShuttingDown` and admit nothing more."""
        self.closed = True
        for addr in list(self.failed):
            self._clear_failed(addr)
        queues, self._held = self._held, {}
        for q in queues.values():
            for entry in q:
                if not entry.future.done():
                    entry.future.set_exception(GateShuttingDown(f"gate stopped while pool {self.name!r} held the request"))
        if self._releaser is not None:
            self._releaser.cancel()

    # ---------------------------------------------------------------- internals
    def _notify(self) -> None:
        if self._drain_waiters:  # skip a task when nobody waits (hot path)
            task = asyncio.get_running_loop().create_task(self._notify_all())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _notify_all(self) -> None:
        async with self._changed:
            self._changed.notify_all()

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
            released = 0
            for band in sorted(self._held, reverse=True):
                q = self._held[band]
                skipped: list[_Held] = []
                from_band = 0
                while q and released < self.release_burst:
                    entry = q.popleft()
                    if entry.future.done():
                        continue
                    candidates = self.serving(entry.min_version)
                    if not candidates:
                        skipped.append(entry)  # waits for a newer weight version; keeps its place
                        continue
                    entry.future.set_result(candidates)
                    released += 1
                    from_band += 1
                q.extendleft(reversed(skipped))
                if from_band:
                    self._stats(band).released_total += from_band
                if not q:
                    del self._held[band]
                    self._band_emptied(band)
                if released >= self.release_burst:
                    break
            self.released_total += released
            if released == 0:
                return
            due += pause
            await asyncio.sleep(max(0.0, due - loop.time()))
