"""The Istio variants: the ext_proc and the fast-path EnvoyFilters, the DestinationRule, and the gate container folded
into the Istio Gateway's parameters ConfigMap (``generate.py --istio-parameters``)."""

from __future__ import annotations

import copy

import yaml

from llmd_timeslice import k8s_modelserver, protocol, yaml_files
from llmd_timeslice.router.envoy_clusters import authz_cluster, grpc_cluster
from llmd_timeslice.router.envoy_config import (
    AUTHZ_FILTER_NAME,
    EXT_PROC_TYPE,
    HCM_TYPE,
    PER_ROUTE_TYPE,
    authz_filter,
    authz_per_route,
    gate_access_log,
    gate_filter,
    refusal_local_reply,
    router_filter,
    subset_hint_filter,
)
from manifests.families.common import (
    EPP_FILTER_NAME,
    GATE_AUTHZ_PORT,
    GATE_CONTAINER,
    GATE_CONTROL_PORT,
    GATE_EXT_PROC_PORT,
    GATE_FILTER_NAME,
    GATE_METRICS_PORT,
    GATE_READINESS_SERVICE,
    LOCAL_AUTHZ_CLUSTER,
    LOCAL_GATE_CLUSTER,
    LOOPBACK,
    ORCHESTRATOR_ADDRESS,
    ROUTE_RULE_INDEX,
    TOKEN_DIR,
    GuideSettings,
    _dump,
    _dur,
)
from manifests.families.envoy import ENVOY_VERSIONS, gate_error_mappers

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
    return _envoy_filter(
        s.gateway,
        [
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
                            "local_reply_config": {"mappers": gate_error_mappers("ext_proc", ENVOY_VERSIONS["istio-ext-proc"])},
                        },
                    },
                },
            },
            # 4. Each pool's route tells the gate its pool.
            *(istio_gate_route_patch(s, pool, route) for pool, route in pools.items()),
        ],
    )


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
    return _envoy_filter(
        s.gateway,
        [
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
    )


def _envoy_filter(gateway: str, patches: list[dict]) -> dict:
    """The EnvoyFilter ``llmd-timeslice-gate`` applying ``patches`` to the Gateway's pods (Istio labels them with the
    Gateway API name)."""
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": "llmd-timeslice-gate", "labels": {"app.kubernetes.io/part-of": "llmd-timeslice"}},
        "spec": {"workloadSelector": {"labels": {"gateway.networking.k8s.io/gateway-name": gateway}}, "configPatches": patches},
    }
