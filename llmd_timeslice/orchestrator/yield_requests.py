"""Yield requests: deadline pressure of held traffic reaches the holder of a group (issue 26; pure, no I/O).

The gate holds requests per priority band while a pool sleeps; a band may declare a hold deadline. While such
a band holds requests, each gate sends ``GateMessage.hold_pressure`` (``HoldPressure{pool, band, objective,
oldest_held_s, hold_deadline_s, held}``: at the first held request, at most every 0.25 s, a last one with
``held = 0``). :class:`~llmd_timeslice.orchestrator.gate_hub.GateHub` sums it over gate replicas into one
:class:`HoldPressure` per (pool, band); the orchestrator posts it to every group whose samplers serve that
pool (:meth:`~llmd_timeslice.orchestrator.groups.Orchestrator.hold_pressure`), and the group that a job holds
applies its policy (:func:`refusal`, the four knobs of docs/group-settings.md) and, when it asks, marks the
holder's lease with a :class:`YieldRequest`. The holder reads it from its next ``GetLease`` / ``Heartbeat``
answer (``Lease.yield_requested``). Operators and tests ask through ``LeaseService.RequestYield``
(:class:`YieldAsk` with ``source="operator"``).

Yielding stays cooperative: a holder that keeps the group keeps it. Outcomes (metric
``llmd_timeslice_orchestrator_yield_requests_total{group,band,outcome}``):

* ``sent`` — the lease was marked;
* ``honoured`` — the holder yielded while marked (``llmd_timeslice_orchestrator_yield_request_seconds{group}``
  observes the seconds from the request to the yield);
* ``ignored`` — the band's deadline passed while the holder kept the group (a holder that yields later still
  counts ``honoured`` then: the histogram says how late);
* ``suppressed`` — the policy did not ask (band not allowed, ``min_training_s`` not reached, job opted out);
  counted once per grant, band and knob for the gate's repeated messages, at every operator call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from prometheus_client import Counter, Histogram

from llmd_timeslice.domain.group_settings import GroupSettings

YIELD_REQUESTS = Counter(
    "llmd_timeslice_orchestrator_yield_requests_total",
    "Yield requests to a group's holder by outcome: sent (lease marked), honoured (the holder yielded while "
    "marked), ignored (the band's hold deadline passed while it kept the group), suppressed (the group's policy "
    "did not ask: band not allowed, min_training_s not reached, job opted out).",
    ["group", "band", "outcome"],
)
YIELD_REQUEST_SECONDS = Histogram(
    "llmd_timeslice_orchestrator_yield_request_seconds",
    "Seconds from a yield request to the holder's yield.",
    ["group"],
    buckets=(0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 20, 30, 60, 120),
)

Source = Literal["gate", "operator"]


@dataclass(frozen=True)
class HoldPressure:
    """Held requests of one priority band of one pool, summed over the gate replicas that hold some: ``held``
    requests, the oldest waiting ``oldest_held_s`` seconds (its ``objective``), the band's ``hold_deadline_s``
    (wire: ``gate_state.proto`` ``HoldPressure``). ``held == 0``: the band holds nothing any more."""

    pool: str
    band: int
    objective: str
    oldest_held_s: float
    hold_deadline_s: float
    held: int


@dataclass(frozen=True)
class YieldAsk:
    """One ask to a group's holder: from the gates' hold pressure (``source="gate"``, ``oldest_held_s`` and
    ``held`` set) or from ``RequestYield`` (``source="operator"``). ``hold_deadline_s`` 0: no deadline."""

    reason: str
    band: int
    hold_deadline_s: float
    objective: str = ""
    pool: str = ""
    oldest_held_s: float = 0.0
    held: int = 1
    source: Source = "operator"

    @classmethod
    def from_pressure(cls, p: HoldPressure) -> YieldAsk:
        objective = f" (objective {p.objective})" if p.objective else ""
        return cls(
            reason=(
                f"band {p.band}{objective}: oldest held request {p.oldest_held_s:.1f} s of a {p.hold_deadline_s:g} s "
                f"hold deadline, {p.held} held in pool {p.pool}"
            ),
            band=p.band,
            hold_deadline_s=p.hold_deadline_s,
            objective=p.objective,
            pool=p.pool,
            oldest_held_s=p.oldest_held_s,
            held=p.held,
            source="gate",
        )

    def deadline_in_s(self) -> float | None:
        """Seconds from now until the band's deadline passes for the oldest held request (None: no deadline)."""
        if self.hold_deadline_s <= 0:
            return None
        return max(0.0, self.hold_deadline_s - self.oldest_held_s)

    def due(self, fraction: float) -> bool:
        """Whether the oldest held request reached ``fraction`` of its deadline (an operator's ask always is)."""
        return self.source == "operator" or self.oldest_held_s >= fraction * self.hold_deadline_s


@dataclass
class YieldRequest:
    """The request a holder's lease carries (``Lease.yield_requested``); ``requested_at`` and ``deadline_at``
    are readings of the orchestrator's clock (monotonic seconds; ``deadline_at`` None: no deadline)."""

    reason: str
    band: int
    objective: str
    hold_deadline_s: float
    pool: str
    source: Source
    requested_at: float
    deadline_at: float | None
    ignored: bool = False


@dataclass(frozen=True)
class YieldAnswer:
    """What an ask did (``RequestYieldResponse``): ``requested`` — the holder's lease carries a request now (this
    one or an earlier one); ``holder`` — its job id ("" when nobody holds); ``detail`` — why not, or which
    request is already set."""

    requested: bool
    holder: str
    detail: str = ""


@dataclass
class YieldStats:
    """Per group, since the orchestrator started (``llmd-timeslice status``; the metric has the same counts)."""

    sent: int = 0
    honoured: int = 0
    ignored: int = 0
    suppressed: int = 0


def check_ask(band: int, hold_deadline_s: float) -> str | None:
    """Why an operator's ask is malformed (the one-line answer), or None."""
    if not math.isfinite(hold_deadline_s) or hold_deadline_s < 0:
        return f"hold_deadline_s must be a finite number of seconds >= 0 (0: no deadline), got {hold_deadline_s!r}"
    if not -(2**31) <= band < 2**31:
        return f"band must be an int32 (InferenceObjective spec.priority), got {band}"
    return None


def refusal(spec: GroupSettings, ask: YieldAsk, job: str, trained_s: float) -> tuple[str, str] | None:
    """``(knob, detail)`` when the group's policy does not ask ``job`` (which has held the group ``trained_s``
    seconds since its grant or since the last request it honoured, whichever is later), else None. The knobs,
    in the order they are checked: ``yield_request_bands``, ``job_yield_opt_out``, ``min_training_s``
    (docs/group-settings.md)."""
    bands = spec.yield_request_bands
    if bands is None:
        if ask.hold_deadline_s <= 0:
            return (
                "yield_request_bands",
                f"band {ask.band} declares no hold deadline, and yield_request_bands is unset (every band that "
                "declares a hold deadline may ask)",
            )
    elif ask.band not in bands:
        return "yield_request_bands", f"band {ask.band} may not request a yield (yield_request_bands: {list(bands)})"
    if job in spec.job_yield_opt_out:
        return "job_yield_opt_out", f"job {job!r} opted out of yield requests (job_yield_opt_out)"
    if trained_s < spec.min_training_s:
        return (
            "min_training_s",
            f"job {job!r} has trained {trained_s:.1f} s since its grant or its last honoured request, less than "
            f"min_training_s ({spec.min_training_s:g} s)",
        )
    return None
