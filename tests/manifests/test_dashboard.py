"""The Grafana dashboard (manifests/grafana/llmd-timeslice-groups.json) queries only what the components export.

The exported names come from the real registries: every module of ``epp_plugin`` and ``llmd_timeslice`` that uses
``prometheus_client`` is imported (registering its metrics in the default registry), a gate pool with one endpoint
is added to the gate's scrape-time collector, and the registry is collected; each family gives the names a scrape
shows (counter ``_total``, histogram ``_bucket`` / ``_sum`` / ``_count``, ...) and its label names. Every PromQL
expression of the dashboard (panels and template variables) is parsed into its metric names and label matchers;
each name must be exported and each label must be one the metric carries or one Prometheus adds at scrape time.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "manifests" / "grafana" / "llmd-timeslice-groups.json"

CONTRACT_METRICS = (  # issue 26's metric names (/work/prompts/contract-26.md): the dashboard uses exactly these
    "llmd_timeslice_gate_band_held_requests",
    "llmd_timeslice_gate_band_released_total",
    "llmd_timeslice_gate_band_refused_total",
    "llmd_timeslice_gate_band_hold_seconds_bucket",
    "llmd_timeslice_gate_band_deadline_misses_total",
    "llmd_timeslice_orchestrator_yield_requests_total",
    "llmd_timeslice_orchestrator_yield_request_seconds_bucket",
)
TARGET_LABELS = {"namespace", "pod", "instance", "job", "container", "service", "endpoint"}
"""Labels Prometheus (or the prometheus-operator's ServiceMonitor / PodMonitor) attaches at scrape time."""
PROMQL_WORDS = {
    # aggregations, their modifiers, functions and binary operators/modifiers the dashboard may use
    *("sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "stddev", "group"),
    *("by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"),
    *("rate", "irate", "increase", "delta", "deriv", "changes", "resets", "histogram_quantile", "label_replace"),
    *("avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "count_over_time", "last_over_time"),
    *("clamp_min", "clamp_max", "clamp", "abs", "vector", "scalar", "time", "absent", "label_values"),
}
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}


def _metric_modules() -> list[str]:
    mods = []
    for pkg in ("epp_plugin", "llmd_timeslice"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            if "prometheus_client" in path.read_text() and "/api/" not in str(path):
                mods.append(".".join(path.relative_to(REPO).with_suffix("").parts))
    return mods


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every name a scrape of the components shows -> the label names it carries."""
    from prometheus_client import REGISTRY

    for mod in _metric_modules():
        importlib.import_module(mod)
    from epp_plugin.gate.metrics import COLLECTOR
    from epp_plugin.gate.pool_state import EndpointState, PoolState

    pool = PoolState("p")
    pool.set_states([("127.0.0.1:1", EndpointState.SERVING, None)])
    pools = {"p": pool}
    COLLECTOR.pool_maps.append(pools)
    try:
        families = list(REGISTRY.collect())
    finally:
        COLLECTOR.pool_maps.remove(pools)
    wrappers = {}
    for collector in list(getattr(REGISTRY, "_collector_to_names", {})):
        if hasattr(collector, "_labelnames") and hasattr(collector, "_name"):
            wrappers[collector._name] = set(collector._labelnames)
    out: dict[str, set[str]] = {}
    for fam in families:
        # a scrape-time family declares its labels (``labels=[...]``) even when no pool fills it
        labels = (
            set(wrappers.get(fam.name, ())) | set(getattr(fam, "_labelnames", ())) | {k for s in fam.samples for k in s.labels}
        )
        for suffix in _SUFFIXES.get(fam.type, ("",)):
            out[fam.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def _exprs() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and template variable query."""
    dash = json.loads(DASHBOARD.read_text())
    out = []

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dash["panels"]):
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} target {t['refId']}", t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']!r}", query))
    return out


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"(?<![\w$.])[A-Za-z_:][A-Za-z0-9_:]*")


def parse(expr: str) -> tuple[set[str], dict[str, set[str]], set[str]]:
    """PromQL -> (metric names, metric -> label names in its matchers, label names in groupings). Grafana's
    variables (``$pool``, ``$__rate_interval``) and quoted strings are dropped first."""
    matchers: dict[str, set[str]] = {}
    text = expr
    label_values = re.match(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*(\w+)\s*\)\s*$", text)
    if label_values:
        name, label = label_values.groups()
        return {name}, {name: {label}}, set()
    text = re.sub(r"\[[^\]]*\]", "", _STRING.sub('""', text))  # range selectors and subqueries
    for m in _MATCHERS.finditer(text):
        labels = {part.split("=")[0].split("!")[0].strip() for part in m.group(2).split(",") if part.strip()}
        if m.group(1):
            matchers.setdefault(m.group(1), set()).update(labels)
    text = _MATCHERS.sub(lambda m: f" {m.group(1) or ''} ", text)
    grouping = {lab.strip() for m in _GROUPING.finditer(text) for lab in m.group(2).split(",") if lab.strip()}
    text = _GROUPING.sub(" ", text)
    names = {w for w in _IDENT.findall(text) if w not in PROMQL_WORDS and not re.fullmatch(r"[0-9.e+-]+", w)}
    return names, matchers, grouping


def test_parse_finds_names_matchers_and_groupings():
    names, matchers, grouping = parse(
        'histogram_quantile(0.99, sum by (le, band) (rate(foo_bucket{pool=~"$pool",ns="a,b"}[$__rate_interval]))) '
        "/ clamp_min(sum(bar_total), 1) + avg_over_time((sum(baz{x='1'}))[10m:15s])"
    )
    assert names == {"foo_bucket", "bar_total", "baz"}
    assert matchers == {"foo_bucket": {"pool", "ns"}, "baz": {"x"}}
    assert grouping == {"le", "band"}
    assert parse("label_values(qux_count, group_id)") == ({"qux_count"}, {"qux_count": {"group_id"}}, set())


def test_every_dashboard_query_names_exported_metrics_and_their_labels(exported):
    problems = []
    for where, expr in _exprs():
        names, matchers, grouping = parse(expr)
        assert names, f"{where}: no metric name found in {expr!r}"
        for name in names:
            if name not in exported:
                problems.append(f"{where}: {name} is not exported by any component")
                continue
        for name, labels in matchers.items():
            missing = labels - exported.get(name, labels) - TARGET_LABELS
            if missing:
                problems.append(f"{where}: {name} has no label(s) {sorted(missing)}")
        known = set().union(*(exported.get(n, set()) for n in names)) | TARGET_LABELS
        if grouping - known:
            problems.append(f"{where}: grouping by {sorted(grouping - known)}, labels none of {sorted(names)} carry")
    assert not problems, "\n".join(problems)


def test_the_dashboard_uses_the_contract_metrics_and_they_are_exported(exported):
    used = set().union(*(parse(e)[0] for _, e in _exprs()))
    assert set(CONTRACT_METRICS) <= used, sorted(set(CONTRACT_METRICS) - used)
    missing = [n for n in CONTRACT_METRICS if n not in exported]
    assert not missing, f"issue 26's metrics not exported by the components: {missing}"


def test_the_dashboard_has_the_shape_of_llm_d_dashboards():
    """Importable like llm-d's own (llm-d/llm-d guides/recipes/observability/grafana/dashboards/*.json): a
    DS_PROMETHEUS input every panel uses, a uid, template variables, and one row repeated per group."""
    dash = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 39
    assert {v["name"] for v in dash["templating"]["list"]} >= {"DS_PROMETHEUS", "group", "pool"}
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    assert rows and rows[0]["repeat"] == "group"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
            assert p["description"] and p["targets"], p["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
