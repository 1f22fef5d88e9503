"""Prometheus metrics of the gate (prefix ``llmd_timeslice_gate_``).

Per-request counters on the hot path would cost CPU on every request, so pool figures (held now,
admitted, released, in flight per endpoint, endpoint state, state epoch) are read from the pools
at scrape time by :class:`PoolCollector`; only refusals and hold durations (rare paths) are
counted as they happen.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from epp_plugin.gate.pool_state import EndpointState, PoolState

REFUSED = Counter("llmd_timeslice_gate_refused_total", "Requests refused with 4xx/503, by reason.", ["pool", "reason"])
HOLD_SECONDS = Histogram(
    "llmd_timeslice_gate_hold_seconds",
    "Seconds a held request waited before admission (held requests only).",
    ["pool"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)
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
        for name, pool in self._pools():
            held.add_metric([name], pool.held)
            admitted.add_metric([name], pool.admitted_total)
            released.add_metric([name], pool.released_total)
            epoch.add_metric([name], pool.epoch)
            for ep in list(pool.endpoints.values()):
                in_flight.add_metric([name, ep.address], ep.in_flight)
                for st in EndpointState:
                    state.add_metric([name, ep.address, st.value], 1 if ep.state is st else 0)
        yield from (held, admitted, released, epoch, in_flight, state)
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
