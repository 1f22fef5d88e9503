"""Read one sample from a component's Prometheus endpoint: for a test to wait on what a process reports (a request
held at the gate, say) instead of sleeping a fixed time."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def sample(url: str, name: str, **labels: str) -> float | None:
    """Value of the sample ``name`` whose labels include ``labels`` at ``url`` (a ``/metrics`` URL); None if none."""
    text = httpx.get(url, timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None
