"""What the vLLM backend reads from the engine's ``GET /metrics`` (Prometheus text exposition): request counts, the
sleep state of every engine core, the aborted-request counter (vLLM 0.32, ``vllm/v1/metrics/loggers.py``;
docs/snapshot.md, "vLLM facts the backend relies on")."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

SLEEP_STATE_FOR_LEVEL = {1: "weights_offloaded", 2: "discard_all"}
"""Sleep level -> the ``sleep_state`` label ``vllm:engine_sleep_state`` reports at 1 after that sleep."""


@dataclass
class EngineMetrics:
    """What the backend reads from vLLM's ``/metrics``: request counts (summed over engines) and the sleep
    state of each engine core (``sleep_states``: the ``engine`` label -> the ``sleep_state`` label whose series is 1,
    None for an engine with no series at 1; empty when the gauge is not exported).

    vLLM 0.32 exports ``vllm:engine_sleep_state`` with labels ``model_name``, ``engine`` (the engine core index; one
    per data-parallel rank behind the server) and ``sleep_state`` (``vllm/v1/metrics/loggers.py``,
    ``PrometheusStatLogger``)."""

    running: float = 0.0
    waiting: float = 0.0
    sleep_states: dict[str, str | None] = field(default_factory=dict)
    aborted_total: float = 0.0
    """``vllm:request_success_total{finished_reason="abort"}`` summed over engines (requests that ended aborted)."""

    @property
    def sleep_state(self) -> str | None:
        """The state every engine reports (None: not exported, or the engines disagree)."""
        states = set(self.sleep_states.values())
        return states.pop() if len(states) == 1 else None

    def engines_not_in(self, expected: str) -> dict[str, str | None]:
        """Engine label -> its state, for every engine not in ``expected`` (empty: all are, or none is exported)."""
        return {e: s for e, s in sorted(self.sleep_states.items()) if s != expected}


_NEEDED_LINES = re.compile(
    r"^(?:# (?:HELP|TYPE) )?vllm:(?:num_requests_running|num_requests_waiting|request_success(?:_total|_created)?"
    r"|engine_sleep_state)[{ ].*$",
    re.MULTILINE,
)
"""The lines of the four families :func:`parse_engine_metrics` reads (samples, ``# HELP`` and ``# TYPE``)."""


def needed_metric_lines(text: str) -> str:
    """Only the lines of ``text`` (Prometheus text exposition) that belong to the families the backend reads.

    vLLM 0.32's page has some 40 families, most of them histograms with a dozen or more buckets
    (``vllm/v1/metrics/loggers.py``), plus the process and Python collectors: tens of KiB for one engine core. Picking
    the few lines out with one compiled regular expression costs a fraction of running prometheus-client's parser
    over the whole page, which was most of a sidecar's CPU per switch (issue 29, ``benchmarks/scale.py``)."""
    return "\n".join(m.group(0) for m in _NEEDED_LINES.finditer(text)) + "\n"


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Parse Prometheus text exposition from vLLM (prometheus-client's parser, on :func:`needed_metric_lines`)."""
    m = EngineMetrics()
    for fam in text_string_to_metric_families(needed_metric_lines(text)):
        if fam.name == "vllm:num_requests_running":
            m.running = sum(s.value for s in fam.samples if s.name == fam.name)
        elif fam.name == "vllm:num_requests_waiting":
            m.waiting = sum(s.value for s in fam.samples if s.name == fam.name)
        elif fam.name.removesuffix("_total") == "vllm:request_success":  # the parser names counters either way
            m.aborted_total += sum(
                s.value
                for s in fam.samples
                if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "abort"
            )
        elif fam.name == "vllm:engine_sleep_state":
            for s in fam.samples:
                if "sleep_state" not in s.labels:
                    continue
                engine = s.labels.get("engine", "")
                m.sleep_states.setdefault(engine, None)
                if s.value >= 1:
                    m.sleep_states[engine] = s.labels["sleep_state"]
    return m


def describe_engines(bad: dict[str, str | None]) -> str:
    return ", ".join(f"engine {e or '?'} is {s!r}" if s else f"engine {e or '?'} reports no sleep state" for e, s in bad.items())
