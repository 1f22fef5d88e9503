"""Prometheus metrics of the gate (prefix ``llmd_timeslice_gate_``)."""

from prometheus_client import Counter, Gauge, Histogram

ADMITTED = Counter("llmd_timeslice_gate_admitted_total", "Requests admitted (forwarded with a subset hint).", ["pool"])
REFUSED = Counter("llmd_timeslice_gate_refused_total", "Requests refused with 429/503, by reason.", ["pool", "reason"])
HOLD_SECONDS = Histogram(
    "llmd_timeslice_gate_hold_seconds",
    "Seconds a held request waited before admission (held requests only).",
    ["pool"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)
HELD = Gauge("llmd_timeslice_gate_held", "Requests held now.", ["pool"])
IN_FLIGHT = Gauge("llmd_timeslice_gate_in_flight", "Live requests that may reach the endpoint.", ["pool", "endpoint"])
ENDPOINT_STATE = Gauge(
    "llmd_timeslice_gate_endpoint_state",
    "1 for the endpoint's current state (SERVING, DRAINING, ASLEEP, WAKING), 0 otherwise.",
    ["pool", "endpoint", "state"],
)
STATE_EPOCH = Gauge("llmd_timeslice_gate_state_epoch", "Current state epoch of the pool.", ["pool"])
