"""Prometheus metrics of the gate (prefix ``llmd_timeslice_gate_``).

Per-request counters on the hot path would cost CPU on every request, so pool figures (held now,
admitted, released, in flight per endpoint, endpoint state, state epoch) are read from the pools
at scrape time by :class:`PoolCollector`; only refusals and hold durations (rare paths) are
counted as they happen.

Per priority band (issue 26; docs/gate.md, "Priority bands"): ``llmd_timeslice_gate_band_held_requests``,
``..._band_released_total``, ``..._band_refused_total{reason}`` and ``..._band_deadline_misses_total`` are read from
the pools' band counters at scrape time; ``..._band_hold_seconds`` is observed with each held request's admission.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from epp_plugin.gate.pool_state import Admission, EndpointState, PoolState

HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
REFUSED = Counter("llmd_timeslice_gate_refused_total", "Requests refused with 4xx/503, by reason.", ["pool", "reason"])
HOLD_SECONDS = Histogram(
    "llmd_timeslice_gate_hold_seconds",
    "Seconds a held request waited before admission (held requests only).",
    ["pool"],
    buckets=HOLD_BUCKETS,
)
BAND_HOLD_SECONDS = Histogram(
    "llmd_timeslice_gate_band_hold_seconds",
    "Seconds a held request waited before admission, by priority band (held requests only).",
    ["pool", "band"],
    buckets=HOLD_BUCKETS,
)


def observe_hold(pool: str, adm: Admission) -> None:
    """A held request was admitted after ``adm.hold_s`` seconds: the pool's and its band's hold histograms."""
    HOLD_SECONDS.labels(pool=pool).observe(adm.hold_s)
    BAND_HOLD_SECONDS.labels(pool=pool, band=str(adm.band)).observe(adm.hold_s)


ORCHESTRATOR_EPOCH = Gauge("llmd_timeslice_gate_orchestrator_epoch", "Last state epoch received from the orchestrator.")
LOST_COMPLETIONS = Counter(
    "llmd_timeslice_gate_lost_completions_total",
    "Fast-path admissions dropped without an access-log entry: reason age (older than lost_completion_after_s), "
    "envoy_gone (every access-log stream of that Envoy ended) or unread (Envoy reset the check as it was answered).",
    ["reason"],
)

EXT_PROC_OUT_OF_PHASE = Counter(
    "llmd_timeslice_gate_ext_proc_out_of_phase_total",
    "ext_proc streams ended with FAILED_PRECONDITION because a message came out of phase (a second request_headers, "
    "response_headers before the request was admitted, ...), by the message that did.",
    ["pool", "message"],
)

ENDPOINT_FAILURES = Counter(
    "llmd_timeslice_gate_endpoint_failures_total",
    "Endpoints taken out of the gate's picks because Envoy could not connect to them (access-log flag UF; counted "
    "once per failure episode, not per request).",
    ["pool", "endpoint"],
)

OBJECTIVES_SOURCE_STATES = ("reading", "no_crd", "forbidden", "unreachable")
"""States of ``llmd_timeslice_gate_objectives_source`` (``epp_plugin.gate.objectives_k8s.SourceState``)."""
OBJECTIVES_SOURCE = Gauge(
    "llmd_timeslice_gate_objectives_source",
    "InferenceObjectives read from Kubernetes (--objectives-from-kubernetes): 1 for the source's current state, 0 for "
    "the others. state reading: bands on, group_version names the group read (llm-d.ai/v1alpha2 or "
    "inference.networking.x-k8s.io/v1alpha2); no_crd (neither served), forbidden (RBAC), unreachable: bands off, "
    "unless group_version names the objects last read, still applied.",
    ["namespace", "state", "group_version"],
)
_objectives_series: dict[str, list[tuple[str, str]]] = {}


def set_objectives_source(namespace: str, state: str | None, group_version: str | None) -> None:
    """The objectives source of ``namespace`` is now ``state`` (one of :data:`OBJECTIVES_SOURCE_STATES`), applying
    the objects of ``group_version`` (None: none); ``state`` None withdraws the namespace's series (gate stopped)."""
    for labels in _objectives_series.pop(namespace, []):
        OBJECTIVES_SOURCE.remove(namespace, *labels)
    if state is None:
        return
    series = [(s, (group_version or "") if s == state else "") for s in OBJECTIVES_SOURCE_STATES]
    for s, gv in series:
        OBJECTIVES_SOURCE.labels(namespace=namespace, state=s, group_version=gv).set(1 if s == state else 0)
    _objectives_series[namespace] = series


class PoolCollector(Collector):
    """Reads the figures of every registered gate's pools (and fast-path books) at scrape time."""

    def __init__(self) -> None:
        self.pool_maps: list[Mapping[str, PoolState]] = []
        self.books: list = []  # AdmissionBook of each gate with the fast path
        self.access_logs: list = []  # GateAccessLogService of each gate

    def _pools(self):
        for pools in list(self.pool_maps):
            yield from list(pools.items())

    def collect(self):
        held = GaugeMetricFamily("llmd_timeslice_gate_held", "Requests held now.", labels=["pool"])
        admitted = CounterMetricFamily(
            "llmd_timeslice_gate_admitted", "Requests admitted (forwarded with a subset hint).", labels=["pool"]
        )
        released = CounterMetricFamily("llmd_timeslice_gate_released", "Held requests released.", labels=["pool"])
        epoch = GaugeMetricFamily("llmd_timeslice_gate_state_epoch", "State epoch of the pool.", labels=["pool"])
        in_flight = GaugeMetricFamily(
            "llmd_timeslice_gate_in_flight", "Live requests that may reach the endpoint.", labels=["pool", "endpoint"]
        )
        state = GaugeMetricFamily(
            "llmd_timeslice_gate_endpoint_state",
            "1 for the endpoint's current state, 0 for the others.",
            labels=["pool", "endpoint", "state"],
        )
        band_held = GaugeMetricFamily(
            "llmd_timeslice_gate_band_held_requests", "Requests held now, by priority band.", labels=["pool", "band"]
        )
        band_released = CounterMetricFamily(
            "llmd_timeslice_gate_band_released", "Held requests released, by priority band.", labels=["pool", "band"]
        )
        band_refused = CounterMetricFamily(
            "llmd_timeslice_gate_band_refused",
            "Requests of a band refused by the pool (hold_expired, sheddable_while_asleep, hold_queue_full, ...).",
            labels=["pool", "band", "reason"],
        )
        band_misses = CounterMetricFamily(
            "llmd_timeslice_gate_band_deadline_misses",
            "Held requests of a band with a hold deadline released, or refused at their longest hold, after it.",
            labels=["pool", "band"],
        )
        unexpected = CounterMetricFamily(
            "llmd_timeslice_gate_endpoint_unexpected_transitions",
            "Endpoint updates from the orchestrator that took an edge outside the gate's endpoint table (flagged and "
            'applied; docs/gate.md, "Endpoint states").',
            labels=["pool", "from_state", "to_state"],
        )
        for name, pool in self._pools():
            held.add_metric([name], pool.held)
            for (frm, to), n in list(pool.table.unexpected_transitions.items()):
                unexpected.add_metric([name, frm.value, to.value], n)
            # Band 0 (requests without an objective) always, so every pool's series exist from the start; other
            # bands once they hold, declare a deadline or have counts.
            by_band = pool.held_by_band()
            stats = dict(pool.band_stats)
            for band in sorted({0, *by_band, *stats, *(b.priority for b in pool.deadline_bands())}):
                band_held.add_metric([name, str(band)], by_band.get(band, 0))
            for band in sorted({0, *stats}):
                st = stats.get(band)
                band_released.add_metric([name, str(band)], st.released_total if st is not None else 0)
                band_misses.add_metric([name, str(band)], st.deadline_misses_total if st is not None else 0)
                for reason, n in list(st.refused_total.items()) if st is not None else ():
                    band_refused.add_metric([name, str(band), reason], n)
            admitted.add_metric([name], pool.admitted_total)
            released.add_metric([name], pool.released_total)
            epoch.add_metric([name], pool.epoch)
            for ep in list(pool.endpoints.values()):
                in_flight.add_metric([name, ep.address], ep.in_flight)
                for st in EndpointState:
                    state.add_metric([name, ep.address, st.value], 1 if ep.state is st else 0)
        yield from (
            held,
            admitted,
            released,
            epoch,
            in_flight,
            state,
            band_held,
            band_released,
            band_refused,
            band_misses,
            unexpected,
        )
        if self.books:
            open_ = GaugeMetricFamily(
                "llmd_timeslice_gate_open_admissions", "Fast-path admissions answered and not yet ended by an access-log entry."
            )
            completed = CounterMetricFamily(
                "llmd_timeslice_gate_completions", "Fast-path admissions ended by an access-log entry."
            )
            foreign = CounterMetricFamily(
                "llmd_timeslice_gate_foreign_completions",
                "Access-log entries naming another gate process's admission (an earlier incarnation, or another replica: "
                "then one Envoy's checks and access log reach different replicas, see docs/gate.md).",
            )
            open_.add_metric([], sum(len(b) for b in self.books))
            completed.add_metric([], sum(b.completed_total for b in self.books))
            foreign.add_metric([], sum(b.foreign_total for b in self.books))
            yield from (open_, completed, foreign)
        if self.access_logs:
            messages = CounterMetricFamily(
                "llmd_timeslice_gate_access_log_messages", "gRPC access-log messages received (each a batch of entries)."
            )
            entries = CounterMetricFamily("llmd_timeslice_gate_access_log_entries", "Access-log entries received.")
            messages.add_metric([], sum(a.messages_total for a in self.access_logs))
            entries.add_metric([], sum(a.entries_total for a in self.access_logs))
            yield from (messages, entries)


COLLECTOR = PoolCollector()
REGISTRY.register(COLLECTOR)
