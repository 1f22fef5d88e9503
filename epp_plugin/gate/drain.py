"""The drain accounting of one InferencePool at the gate (no I/O): live admissions, the in-flight count each puts
on the endpoints it may reach, the drain barrier and its deadline.

Drain barrier: every live request counts against each endpoint it could still reach (its candidates until the
served endpoint is learned on the response path, then that endpoint alone). An endpoint set DRAINING at epoch E is
never a candidate of a request admitted at or after E, so "drained" is simply "no live request counts against it".

Drain deadline (:meth:`DrainAccounting.drain`): when the barrier has not held within the deadline, every live
request that may still reach a draining endpoint and whose response has not started (it is still travelling: in the
EPP, queued, connecting, or computing a non-streamed answer) is refused with a drain-deadline refusal through its
edge; a request whose response has started keeps counting and completes on the engine, which sleeps with
``mode=wait``. So after the deadline no request admitted before the drain can reach an engine that sleeps, and
none is dropped silently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from epp_plugin.gate.endpoints import EndpointTable
from epp_plugin.gate.refusals import AdmissionRefused

log = logging.getLogger(__name__)


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
    """Result of :meth:`DrainAccounting.drain`: ``drained`` when nothing can reach the addresses any more;
    ``in_flight`` per address (requests whose response has started, or whose edge cannot cut them);
    ``cut`` the requests refused at the deadline."""

    drained: bool
    in_flight: dict[str, int]
    cut: list[Admission] = field(default_factory=list)


class DrainAccounting:
    """Live admissions of one pool and the in-flight counts they put on ``table``'s endpoints."""

    def __init__(self, pool: str, table: EndpointTable) -> None:
        self.pool = pool
        self._table = table
        self._endpoints = table.endpoints  # the same dict: the table adds and removes, this counts
        self.live: set[Admission] = set()
        self._changed = asyncio.Condition()
        self._waiters = 0
        self._tasks: set[asyncio.Task] = set()  # notifications in flight, kept: the loop holds tasks only weakly
        self.forgotten_at_sleep_total = 0
        """Admissions ended because their endpoint was verified asleep (see :meth:`forget_at`)."""

    # ------------------------------------------------------------- admissions
    def start(self, adm: Admission) -> Admission:
        """Count ``adm`` against each of its candidates."""
        endpoints = self._endpoints
        for addr in adm.candidates:
            endpoints[addr].in_flight += 1
        self.live.add(adm)
        return adm

    def on_served(self, adm: Admission, address: str) -> int | None:
        """The response path names the endpoint that served ``adm``; it alone stays counted.

        Returns the served endpoint's weight version (None if the endpoint is unknown to the pool)."""
        ep = self._endpoints.get(address)
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
        self.notify()
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
            self.notify()

    def finish(self, adm: Admission) -> None:
        """The request's stream ended (complete, reset or client gone). Idempotent."""
        if adm.finished:
            return
        adm.finished = True
        self.live.discard(adm)
        for addr in adm.candidates:
            self._uncount(addr)
        if adm.candidates:
            self.notify()

    def _uncount(self, addr: str) -> None:
        ep = self._endpoints.get(addr)
        if ep is not None and ep.in_flight > 0:
            ep.in_flight -= 1

    def forget_at(self, address: str) -> None:
        """``address`` was verified asleep (the orchestrator publishes ASLEEP only after its sidecar saw the engine
        idle, slept it with ``mode=wait`` and aborted what was parked inside): no admission still counted against it
        can be at that engine. Such counts are lost completions (an access-log entry Envoy dropped while this gate
        was slow or stalled): without this, each would keep every later drain of the endpoint waiting to its
        deadline until the age rule (``--lost-completion-after-s``). An admission that may still reach another
        candidate keeps that one."""
        ended = narrowed = 0
        for adm in list(self.live):
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
                self.pool,
                address,
                ended + narrowed,
                ended,
                narrowed,
            )

    # ------------------------------------------------------------- the barrier
    async def wait_drained(self, addresses: Iterable[str], timeout_s: float) -> tuple[bool, dict[str, int]]:
        """Wait until no live request may reach ``addresses`` (the drain barrier).

        Returns ``(drained, in_flight per address)``; ``drained`` is False after ``timeout_s``
        seconds. Woken by request ends, not by polling.
        """
        addrs = list(addresses)
        in_flight = self._table.in_flight

        def drained() -> bool:
            return all(v == 0 for v in in_flight(addrs).values())

        if drained():
            return True, in_flight(addrs)
        self._waiters += 1
        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(drained), max(0.0, timeout_s))
            return True, in_flight(addrs)
        except TimeoutError:
            return False, in_flight(addrs)
        finally:
            self._waiters -= 1

    def cut_unserved(self, addresses: Iterable[str], refusal: Callable[[list[str]], AdmissionRefused]) -> list[Admission]:
        """Refuse, with ``refusal(the draining addresses it may reach)``, every live request that may still reach one
        of ``addresses`` and whose served endpoint is not known yet; returns them. Each is answered through its
        edge's ``on_cut`` (requests without one stay counted) and stops counting when its stream ends."""
        addrs = set(addresses)
        cut = []
        for adm in list(self.live):
            if adm.served is not None or adm.cut or adm.on_cut is None or addrs.isdisjoint(adm.candidates):
                continue
            adm.cut = True
            adm.on_cut(refusal(sorted(addrs.intersection(adm.candidates))))
            cut.append(adm)
        return cut

    async def drain(
        self,
        addresses: Iterable[str],
        timeout_s: float,
        refusal: Callable[[list[str]], AdmissionRefused],
        cut_grace_s: float = 2.0,
    ) -> DrainOutcome:
        """The drain barrier with its deadline: wait up to ``timeout_s`` seconds (:meth:`wait_drained`); if requests
        still count against ``addresses`` then, cut those whose response has not started (:meth:`cut_unserved`)
        and wait up to ``cut_grace_s`` seconds for their streams to end. Requests whose response has started
        are left to complete (the engine sleeps with ``mode=wait``) and reported in ``in_flight``."""
        addrs = list(addresses)
        drained, in_flight = await self.wait_drained(addrs, timeout_s)
        if drained:
            return DrainOutcome(True, in_flight)
        cut = self.cut_unserved(addrs, refusal)
        if cut:
            drained, in_flight = await self.wait_drained(addrs, cut_grace_s)
        return DrainOutcome(drained, in_flight, cut)

    # ---------------------------------------------------------------- internals
    def notify(self) -> None:
        """Wake the drain waiters (a count dropped or the states changed); no task when nobody waits (hot path)."""
        if self._waiters:
            task = asyncio.get_running_loop().create_task(self._notify_all())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _notify_all(self) -> None:
        async with self._changed:
            self._changed.notify_all()
