"""The llm-d-router-standalone chart's own Envoy configuration, patched with the gate (never replaced).

The chart renders its proxy's ``envoy.yaml`` from a template (llm-d/llm-d-router v0.10.0, 71f4f0999f95,
``config/charts/llm-d-router-standalone/values.yaml`` ``router.proxy.presets.envoy.configMap.data["envoy.yaml"]``,
resolved by ``config/charts/routerlib/templates/_helpers.tpl`` ``llm-d-router.proxyConfigMapData``). The template
follows the release's values: the listeners also bind ``::`` (``additional_addresses``, llm-d-router #1920), and the
``ext_proc`` cluster to the EPP speaks TLS only while ``router.epp.flags.secure-serving`` is not ``false``
(``llm-d-router.proxy.eppSecureServing``, ``envoyExtProcTransportSocket``, ``envoyExtProcTLSOptions``). So this module
takes what the chart rendered (``helm template`` output, or the bare ``envoy.yaml``) and adds only what the gate
needs; every other field is the chart's, and a chart change reaches users the next time they render.

What :func:`patch` adds or changes, and nothing else (docs/decisions/patch-the-charts-envoy.md):

* the gate's ext_proc filter, just before the EPP's (``envoy.filters.http.ext_proc``), and its cluster;
* on the EPP's filter: the subset hint forwarded (``metadata_options.forwarding_namespaces``), fail closed
  (``failure_mode_allow: false``, ``status_on_error`` 503);
* on the EPP's cluster: HTTP/2 stream and outbound-frame limits raised to the gate's (a released hold queue);
* routes: only ``/v1/`` forwarded (the chart's own ``/`` route action, match narrowed), vLLM's admin paths and
  everything else 404 with both filters off;
* the HTTP connection manager: a stream idle timeout and route timeout that fit a hold plus a generation (the
  chart's, where longer, stays), the gate's local-reply mappers first, escaped slashes never forwarded unescaped.

Patching its own output again gives the same config (the gate's pieces are replaced, not added twice).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

import yaml

from llmd_timeslice import protocol, yaml_files
from llmd_timeslice.router.envoy_config import (
    ADMIN_PATHS_UNDER_API,
    API_PREFIX,
    GATE_FILTER_NAME,
    NOT_ROUTED_BODY,
    PER_ROUTE_TYPE,
)

CHART = "llm-d-router-standalone"
CHART_VERSION = "v0.10.0"
"""The chart version whose rendered ``envoy.yaml`` is kept under manifests/chart/ and patched into our values."""
CHART_COMMIT = "71f4f0999f95b96c49a9d0c4afbd18dfdb943c26"
CONFIG_KEY = "envoy.yaml"
EPP_FILTER_NAME = "envoy.filters.http.ext_proc"
"""The name the chart gives the EPP's ext_proc filter (and its route's per-filter config)."""
EPP_CLUSTER = "ext_proc"
"""The chart's cluster to the EPP (``grpc_service.envoy_grpc.cluster_name`` of its filter)."""
HCM_NAME = "envoy.filters.network.http_connection_manager"
TLS_SOCKET = "envoy.transport_sockets.tls"
ENVOY_DEFAULT_STREAM_IDLE_S = 300.0  # envoy http_connection_manager.proto stream_idle_timeout default
SAFE_ESCAPED_SLASH_ACTIONS = ("REJECT_REQUEST", "UNESCAPE_AND_REDIRECT")
"""``path_with_escaped_slashes_action`` values under which ``/v1%2F..%2Fsleep`` never reaches an engine unescaped."""


class ChartEnvoyError(ValueError):
    """The input is not a chart-rendered Envoy configuration this patch understands (one line, names the part)."""


def seconds(duration: str | int | float) -> float:
    """An Envoy (protobuf JSON) duration, ``"86400s"`` / ``"0.250s"``, in seconds. Raises ChartEnvoyError."""
    text = str(duration)
    try:
        return float(text[:-1] if text.endswith("s") else text)
    except ValueError:
        raise ChartEnvoyError(f"not an Envoy duration: {duration!r}") from None


def duration(value_s: float) -> str:
    return f"{value_s:.3f}s" if value_s != int(value_s) else f"{int(value_s)}s"


# ----------------------------------------------------------------------------------- reading what the chart rendered


def _envoy_configs(docs: Iterable) -> list[dict]:
    found = []
    for doc in docs:
        if not isinstance(doc, dict):
            continue
        if "static_resources" in doc:
            found.append(doc)
        elif doc.get("kind") == "ConfigMap" and CONFIG_KEY in (doc.get("data") or {}):
            text = doc["data"][CONFIG_KEY]
            try:
                cfg = yaml_files.load(text)
            except yaml.YAMLError as exc:
                name = doc.get("metadata", {}).get("name")
                raise ChartEnvoyError(f"ConfigMap {name}: {CONFIG_KEY} is not YAML: {yaml_files.error_text(exc)}") from None
            if isinstance(cfg, dict) and "static_resources" in cfg:
                found.append(cfg)
    return found


def chart_envoy_config(text: str) -> dict:
    """The Envoy bootstrap the chart rendered, from ``text``: ``helm template`` output (every document; the ConfigMap
    whose ``data["envoy.yaml"]`` has static resources) or that ``envoy.yaml`` itself. Raises ChartEnvoyError when
    there is none, or more than one."""
    try:
        docs = list(yaml_files.load_all(text))
    except yaml.YAMLError as exc:
        raise ChartEnvoyError(yaml_files.error_text(exc)) from None
    configs = _envoy_configs(docs)
    if not configs:
        raise ChartEnvoyError(
            f"no Envoy configuration: expected `helm template` output of {CHART} with a ConfigMap holding {CONFIG_KEY} "
            "(router.proxy.proxyType envoy), or that envoy.yaml"
        )
    if len(configs) > 1:
        raise ChartEnvoyError(f"{len(configs)} Envoy configurations in the input: give one release's")
    return configs[0]


def _hcms(listener: dict) -> list[dict]:
    return [
        f["typed_config"]
        for chain in listener.get("filter_chains", [])
        for f in chain.get("filters", [])
        if f.get("name") == HCM_NAME
    ]


def epp_listener(cfg: dict) -> tuple[dict, dict]:
    """(listener, HTTP connection manager) of the one listener whose filters call the EPP. Raises ChartEnvoyError."""
    hits = [
        (lis, hcm)
        for lis in cfg.get("static_resources", {}).get("listeners", [])
        for hcm in _hcms(lis)
        if any(f.get("name") == EPP_FILTER_NAME for f in hcm.get("http_filters", []))
    ]
    if len(hits) != 1:
        raise ChartEnvoyError(f"expected one listener with the EPP's filter {EPP_FILTER_NAME}, found {len(hits)}")
    return hits[0]


def cluster(cfg: dict, name: str) -> dict:
    """The static cluster ``name``. Raises ChartEnvoyError."""
    hits = [c for c in cfg.get("static_resources", {}).get("clusters", []) if c.get("name") == name]
    if len(hits) != 1:
        raise ChartEnvoyError(f"expected one cluster {name!r}, found {len(hits)}")
    return hits[0]


def epp_serves_tls(cfg: dict) -> bool:
    """Whether the chart rendered TLS to the EPP (its ``secure-serving`` flag is not ``false``)."""
    socket = cluster(cfg, EPP_CLUSTER).get("transport_socket") or {}
    return socket.get("name") == TLS_SOCKET


# --------------------------------------------------------------------------------------------------- the patch


def _not_routed(match: dict) -> dict:
    """vLLM's dev endpoints (VLLM_SERVER_DEV_MODE=1) and anything outside the API: 404 from Envoy, gate and EPP off."""
    disabled = {"@type": PER_ROUTE_TYPE, "disabled": True}
    return {
        "match": match,
        "direct_response": {"status": 404, "body": {"inline_string": NOT_ROUTED_BODY}},
        "typed_per_filter_config": {GATE_FILTER_NAME: copy.deepcopy(disabled), EPP_FILTER_NAME: copy.deepcopy(disabled)},
    }


def _routes(chart_routes: list[dict], route_timeout_s: float) -> list[dict]:
    forwarding = [r for r in chart_routes if "route" in r]
    if len(forwarding) != 1 or forwarding[0].get("match") not in ({"prefix": "/"}, {"prefix": API_PREFIX}):
        matches = [r.get("match") for r in forwarding]
        raise ChartEnvoyError(f"expected the chart's one forwarding route for prefix '/', found {matches}")
    api = copy.deepcopy(forwarding[0])
    api["match"] = {"prefix": API_PREFIX}
    chart_timeout = seconds(api["route"].get("timeout", "15s"))  # route.proto RouteAction.timeout default 15 s
    if chart_timeout != 0 and chart_timeout < route_timeout_s:
        api["route"]["timeout"] = duration(route_timeout_s)
    return [*(_not_routed({"path": p}) for p in ADMIN_PATHS_UNDER_API), api, _not_routed({"prefix": "/"})]


def _without(mappers: list[dict], ours: list[dict]) -> list[dict]:
    return [m for m in mappers if m not in ours]


def _raise_http2_limits(epp_cluster: dict, gate_options: dict) -> None:
    """Lift the EPP cluster's HTTP/2 stream and outbound-frame limits to the gate's (keeps the chart's windows)."""
    key = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ours = gate_options[key]["explicit_http_config"]["http2_protocol_options"]
    options = epp_cluster.setdefault("typed_extension_protocol_options", {}).setdefault(key, copy.deepcopy(gate_options[key]))
    h2 = options.setdefault("explicit_http_config", {}).setdefault("http2_protocol_options", {})
    for name, value in ours.items():
        if name.startswith("max_"):
            h2[name] = max(int(h2.get(name, 0)), int(value))


def patch(
    chart_cfg: dict,
    *,
    gate_filter: dict,
    gate_cluster: dict,
    local_reply_mappers: list[dict],
    request_timeout_s: float,
    http2_options: dict,
) -> dict:
    """The chart's Envoy bootstrap ``chart_cfg`` with the gate layered in (module docstring: what changes).

    ``gate_filter``/``gate_cluster``: the gate's ext_proc filter (named ``GATE_FILTER_NAME``) and its cluster;
    ``local_reply_mappers``: HCM ``local_reply_config`` mappers that turn a failed gate call into 503;
    ``request_timeout_s``: the longest a request may take (hold + generation + margin), a floor for the route and
    stream-idle timeouts; ``http2_options``: the gate cluster's ``typed_extension_protocol_options`` (its HTTP/2
    limits are raised on the EPP's cluster too). Returns a new dict; raises ChartEnvoyError when the chart's
    config lacks a piece the patch needs (the EPP's filter, its cluster, its forwarding route)."""
    cfg = copy.deepcopy(chart_cfg)
    _, hcm = epp_listener(cfg)
    filters = [f for f in hcm["http_filters"] if f.get("name") != gate_filter["name"]]
    epp_index = next(i for i, f in enumerate(filters) if f.get("name") == EPP_FILTER_NAME)
    epp = filters[epp_index]["typed_config"]
    if epp.get("grpc_service", {}).get("envoy_grpc", {}).get("cluster_name") != EPP_CLUSTER:
        raise ChartEnvoyError(f"the EPP's filter does not call cluster {EPP_CLUSTER!r}")
    epp["failure_mode_allow"] = False
    epp["status_on_error"] = {"code": 503}
    forwarding = epp.setdefault("metadata_options", {}).setdefault("forwarding_namespaces", {}).setdefault("untyped", [])
    if protocol.SUBSET_HINT_NAMESPACE not in forwarding:
        forwarding.append(protocol.SUBSET_HINT_NAMESPACE)
    hcm["http_filters"] = [*filters[:epp_index], copy.deepcopy(gate_filter), *filters[epp_index:]]

    for vhost in hcm.get("route_config", {}).get("virtual_hosts", []):
        vhost["routes"] = _routes(vhost.get("routes", []), request_timeout_s)
    if not hcm.get("route_config", {}).get("virtual_hosts"):
        raise ChartEnvoyError("the EPP's listener has no inline route_config with virtual hosts")
    idle = seconds(hcm.get("stream_idle_timeout", f"{ENVOY_DEFAULT_STREAM_IDLE_S}s"))
    if idle != 0 and idle < request_timeout_s:
        hcm["stream_idle_timeout"] = duration(request_timeout_s)
    replies = hcm.setdefault("local_reply_config", {})
    replies["mappers"] = [*copy.deepcopy(local_reply_mappers), *_without(replies.get("mappers", []), local_reply_mappers)]
    hcm["normalize_path"] = True
    hcm["merge_slashes"] = True
    if hcm.get("path_with_escaped_slashes_action") not in SAFE_ESCAPED_SLASH_ACTIONS:
        hcm["path_with_escaped_slashes_action"] = "REJECT_REQUEST"

    _raise_http2_limits(cluster(cfg, EPP_CLUSTER), http2_options)
    clusters = cfg["static_resources"]["clusters"]
    clusters[:] = [c for c in clusters if c.get("name") != gate_cluster["name"]] + [copy.deepcopy(gate_cluster)]
    return cfg


def template_safe(cfg: dict) -> None:
    """The chart runs ``tpl`` over a user-supplied ``envoy.yaml`` again: refuse a rendered config that still holds a
    template delimiter (it would be evaluated a second time). Raises ChartEnvoyError."""
    text = yaml.safe_dump(cfg)
    if "{{" in text or "}}" in text:
        raise ChartEnvoyError("the rendered envoy.yaml holds '{{' or '}}': the chart would evaluate it again (tpl)")


# ------------------------------------------------------------------------- the chart's output kept here, per flag

RENDERED_DIR = Path(__file__).resolve().parent / "chart"


def rendered_path(secure_serving: bool = True) -> Path:
    """The kept ``helm template`` output of the pinned chart (manifests/chart/), for either ``secure-serving``."""
    flavour = "secure" if secure_serving else "plaintext"
    return RENDERED_DIR / f"llm-d-router-{CHART_VERSION}-standalone-envoy-{flavour}.yaml"


def rendered(secure_serving: bool = True) -> dict:
    """The pinned chart's rendered Envoy bootstrap (the chart's defaults and the guide's values; see the file)."""
    return chart_envoy_config(rendered_path(secure_serving).read_text())
