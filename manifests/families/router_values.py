"""The router release's Helm values: standalone (the chart's Envoy with the gate patched in), gateway mode, and the
label fallback's serving label (manifests/generate.py writes them under ``router/``)."""

from __future__ import annotations

import copy

from llmd_timeslice import yaml_files
from llmd_timeslice.router.envoy_clusters import _BIG_THRESHOLDS, grpc_http2_options
from llmd_timeslice.router.envoy_config import (
    API_PREFIX,
    gate_filter,
)
from manifests import chart_envoy, guide_steps
from manifests.families.common import (
    GATE_EXT_PROC_PORT,
    GATE_FILTER_NAME,
    GATE_HEADLESS_SERVICE,
    HEADER,
    RELEASE_NAME,
    RELEASE_NAMESPACE,
    REPO,
    GuideSettings,
    _doc,
    _dump,
    _indent,
)
from manifests.families.envoy import ENVOY_VERSIONS, STANDALONE_PROXY_IMAGE, gate_error_mappers

# ------------------------------------------------------------------------------ Envoy: standalone


def _standalone_gate_cluster(namespace: str) -> dict:
    """Every gate replica, by the headless Service (one address per ready pod), so Envoy spreads ext_proc streams over
    replicas stream by stream. Each held request is one open stream: hence the raised circuit breakers."""
    address = f"{GATE_HEADLESS_SERVICE}.{namespace}.svc.cluster.local"
    return {
        "name": "llmd_timeslice_gate",
        "type": "STRICT_DNS",
        "dns_refresh_rate": "5s",
        "respect_dns_ttl": True,
        "connect_timeout": "1s",
        "lb_policy": "LEAST_REQUEST",
        "circuit_breakers": copy.deepcopy(_BIG_THRESHOLDS),
        "typed_extension_protocol_options": grpc_http2_options(),
        "load_assignment": {
            "cluster_name": "llmd_timeslice_gate",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": address, "port_value": GATE_EXT_PROC_PORT}}}}
                    ]
                }
            ],
        },
    }


def standalone_bootstrap(s: GuideSettings, release: str, namespace: str, chart_cfg: dict | None = None) -> dict:
    """Envoy bootstrap for the llm-d standalone router (EPP in the same pod, sidecar mode): the chart's own rendered
    ``envoy.yaml`` (``chart_cfg``; default: the pinned chart's, manifests/chart/) with the gate patched in
    (manifests/chart_envoy.py says what changes; everything else stays the chart's).

    ``release``/``namespace``: the Helm release and its namespace; the values file passes the template
    expressions ``{{ .Release.Name }}`` / ``{{ .Release.Namespace }}``, which the chart renders
    (routerlib ``_helpers.tpl`` runs ``tpl`` over ``proxy.configMap.data["envoy.yaml"]``).
    """
    gate = gate_filter("llmd_timeslice_gate", release, s.max_hold_s, failure_mode_allow=False)
    gate["name"] = GATE_FILTER_NAME
    return chart_envoy.patch(
        chart_envoy.rendered() if chart_cfg is None else chart_cfg,
        gate_filter=gate,
        gate_cluster=_standalone_gate_cluster(namespace),
        # A gate that does not answer in time: 503, not ext_proc's 504 (gate_error_mappers).
        local_reply_mappers=gate_error_mappers("ext_proc", ENVOY_VERSIONS["standalone"]),
        request_timeout_s=s.request_timeout_s,
        http2_options=grpc_http2_options(),
    )


def values_standalone(s: GuideSettings, chart_cfg: dict | None = None, source: str | None = None) -> str:
    """Our values for the standalone chart: its rendered ``envoy.yaml`` (``chart_cfg``, from ``source``; default: the
    pinned chart's for the guide's values, manifests/chart/) with the gate patched in."""
    if chart_cfg is not None:
        chart_envoy.template_safe(chart_cfg)
    boot = standalone_bootstrap(s, RELEASE_NAME, RELEASE_NAMESPACE, chart_cfg)
    envoy_yaml = _dump(boot)
    source = source or (
        f"llm-d/llm-d-router {chart_envoy.CHART_VERSION} ({chart_envoy.CHART_COMMIT[:12]}) for the guide's values\n"
        f"# ({chart_envoy.rendered_path().relative_to(REPO)})"
    )
    tls = "TLS (secure-serving on)" if chart_envoy.epp_serves_tls(boot) else "plain text (secure-serving false)"
    return (
        (HEADER if chart_cfg is None else "")
        + "# Helm values for the llm-d-router-standalone chart, LAYERED LAST on the guide's own values (they keep the\n"
        "# guide's EPP plugins and its model-server selector). envoy.yaml below is the chart's own, as rendered from\n"
        f"# {source},\n"
        f"# with the gate patched in (manifests/chart_envoy.py); its EPP cluster speaks {tls}, as the chart\n"
        "# rendered it. Render it again whenever the chart, its version or the EPP's flags change (README: Install).\n"
        "# The chart renders {{ .Release.Name }} / {{ .Release.Namespace }} below (tpl over envoy.yaml).\n"
        "router:\n"
        "  inferencePool:\n"
        "    # Pool-level failure mode (CRD enum FailOpen|FailClose). The recipes' base values say FailOpen:\n"
        "    # a fail-open router would send requests to sleeping engines.\n"
        "    failureMode: FailClose\n"
        "  proxy:\n"
        "    enabled: true\n"
        "    proxyType: envoy\n"
        "    # The Envoy this bootstrap is validated with (manifests/generate.py ENVOY_VERSIONS): the chart's default\n"
        "    # image, distroless-v1.33.2, refuses the gate filter's status_on_error (Envoy 1.36+).\n"
        f"    image: {STANDALONE_PROXY_IMAGE}\n"
        "    mode: sidecar          # the bootstrap below reaches the EPP on loopback\n"
        "    failOpen: false\n"
        "    configMap:\n"
        "      name: envoy\n"
        "      data:\n"
        "        envoy.yaml: |\n" + _indent(envoy_yaml, 10)
    )


def render_chart_envoy_yaml(values_text: str, release: str, namespace: str) -> dict:
    """What the chart puts in its ConfigMap for our values (the two template expressions rendered)."""
    tpl = yaml_files.load(values_text)["router"]["proxy"]["configMap"]["data"]["envoy.yaml"]
    rendered = tpl.replace(RELEASE_NAME, release).replace(RELEASE_NAMESPACE, namespace)
    if "{{" in rendered:
        raise ValueError("envoy.yaml has a template expression the test renderer does not know")
    return yaml_files.load(rendered)


def values_gateway(s: GuideSettings) -> str:
    doc = {
        "router": {"inferencePool": {"failureMode": "FailClose"}},
        "httpRoute": {"create": False},
    }
    return _doc(
        f"Helm values for the llm-d-router-gateway chart (llm-d/llm-d-router {guide_steps.ROUTER_VERSION}), LAYERED LAST on\n"
        "the release's own values, for every gateway variant (README: Install, after our /v1/ route is applied):\n"
        f"  helm upgrade <guide> oci://ghcr.io/llm-d/charts/llm-d-router-gateway --version {guide_steps.ROUTER_VERSION} \\\n"
        "    --reset-then-reuse-values -f values-pins.yaml -f values-gateway.yaml \\\n"
        "    --set provider.name=<istio|agentgateway|none> -n <namespace> --wait\n"
        "* failureMode FailClose: the gateway never routes around the EPP (CRD enum FailOpen|FailClose).\n"
        "* httpRoute.create false: the chart's HTTPRoute matches PathPrefix / (templates/httproute.yaml), which\n"
        "  would expose vLLM's /sleep, /wake_up, /collective_rpc; each gateway overlay ships its own route\n"
        f"  ({s.route}) for {API_PREFIX} only, with timeouts above the hold plus the longest generation.",
        doc,
    )


def values_serving_label(s: GuideSettings) -> str:
    doc = {
        "router": {
            "modelServers": {"matchLabels": {"timeslice.io/serving": "true"}},
            "epp": {"flags": {"disable-endpoint-subset-filter": True}},
        }
    }
    return _doc(
        "Layer after values-gateway.yaml where the subset hint cannot reach the EPP (agentgateway, the label\n"
        "fallback). The orchestrator (--manage-serving-label) keeps the pod label timeslice.io/serving\n"
        'current: "false" from the start of a drain until the wake is verified.\n'
        "* matchLabels: Helm merges maps, so the pool selects the guide's label AND serving=true: a draining\n"
        "  or sleeping pod leaves the InferencePool and the EPP never picks it.\n"
        "* disable-endpoint-subset-filter (EPP flag, llm-d-router v0.9.0 pkg/epp/server/options.go): requests\n"
        "  queued while the pool was empty carry an empty subset and would never dispatch once pods return\n"
        "  (kubernetes-sigs/gateway-api-inference-extension#2117); no gate writes a hint on these paths.",
        doc,
    )
