"""The agentgateway and Envoy Gateway variants: the policies and patches that put the gate in front of the EPP."""

from __future__ import annotations

from llmd_timeslice import protocol
from manifests.families.common import (
    ENGINE_PORT,
    EPP_PORT,
    GATE_EXT_PROC_PORT,
    GATE_SERVICE,
    GuideSettings,
    _dur,
    httproute,
)
from manifests.families.envoy import ENVOY_VERSIONS, gate_error_mappers

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
