"""Rendering of the local Envoy bootstrap: gate ext_proc -> EPP ext_proc -> ORIGINAL_DST cluster.

The same filter chain as the llm-d router (DESIGN.md §3). Facts this relies on (Envoy 1.40,
checked on this machine, DESIGN.md §7):

* ext_proc answers may be delayed for as long as ``message_timeout`` (default 200 ms), which is
  therefore raised above the gate's ``max_hold_s``; ``max_message_timeout`` caps server overrides
  (Envoy allows at most 3600 s).
* dynamic metadata written by the first ext_proc filter is accepted only for namespaces listed in
  its ``metadata_options.receiving_namespaces`` and forwarded to the second filter only for
  namespaces in that filter's ``forwarding_namespaces`` (the subset hint needs both).
* ``response_attributes: [upstream.address]`` puts the served endpoint into the gate's
  response-headers message.
* with ``response_trailer_mode: SEND`` Envoy keeps the gate's ext_proc stream open until the
  response ends, even when the upstream sends no trailers (with SKIP it closes the stream right
  after response headers, so a streaming (SSE) response would leave the in-flight count early);
  the drain barrier counts on this.
* the HTTP connection manager's ``stream_idle_timeout`` (default 300 s) would reset a held request
  with no body traffic, so it is raised above the hold limit too.

Routes: only the OpenAI API (``/v1/``, :data:`API_PREFIX`) reaches an engine. vLLM serves its admin
endpoints (``/sleep``, ``/wake_up``, ``/collective_rpc``, ``/reset_prefix_cache``, ``/is_sleeping``,
``/pause``, the weight-transfer endpoints, ...) on the same port once ``VLLM_SERVER_DEV_MODE=1`` is set
(vllm 0.32.0: ``vllm/entrypoints/launchers/api_server/routers.py`` registers ``vllm/entrypoints/serve/dev``
and ``vllm/entrypoints/rl``), so every other path gets a 404 from Envoy itself, with both ext_proc filters
disabled on that route (``ExtProcPerRoute.disabled``: a 404 is never held). The two admin endpoints under
``/v1/`` (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, served with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) are answered 404 the same way (:data:`ADMIN_PATHS_UNDER_API`). Paths are
normalized (RFC 3986 dot segments, merged slashes) before matching, and an escaped slash (``%2F``) is
refused (400), so ``/v1/../sleep`` cannot reach the engine either. A pool's ``path_prefix`` is
stripped on the way to the engine (``prefix_rewrite``): ``/b/v1/completions`` arrives as
``/v1/completions``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from epp_plugin import protocol

EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
HTTP_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
MAX_MESSAGE_TIMEOUT_S = 3600
PER_ROUTE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
GATE_FILTER_NAME = "envoy.filters.http.ext_proc.timeslice_gate"
EPP_FILTER_NAME = "envoy.filters.http.ext_proc.epp"
API_PREFIX = "/v1/"
"""The only path prefix routed to engines (the OpenAI API); everything else is answered 404 by Envoy."""
ADMIN_PATHS_UNDER_API = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
"""vLLM admin endpoints inside the API prefix: never routed either."""

# Far above Envoy's default of 1024 concurrent requests per cluster: each held request is one
# open ext_proc stream to the gate.
_BIG_THRESHOLDS = {
    "thresholds": [
        {"priority": "DEFAULT", "max_connections": 100_000, "max_pending_requests": 100_000,
         "max_requests": 100_000, "max_retries": 10}
    ]
}


@dataclass
class EnvoyRouterConfig:
    """What the rendered router needs; durations in seconds, ports on loopback by default."""

    listen_port: int
    admin_port: int
    gate_port: int | None
    epp_port: int
    pool: str = "default"
    host: str = "127.0.0.1"
    max_hold_s: float = 600.0
    upstream_timeout_s: float = 600.0
    epp_message_timeout_s: float = 5.0
    gate_failure_mode_allow: bool = False
    pools_by_prefix: dict[str, str] = field(default_factory=dict)
    """Extra routes: path prefix -> pool. ``<prefix>v1/...`` goes to that pool with the prefix stripped
    (the engine sees ``/v1/...``); each sends its pool to both ext_proc services through the per-route
    override ``ExtProcPerRoute.overrides.grpc_initial_metadata``; ``/v1/...`` goes to ``pool``."""


def _dur(seconds: float) -> str:
    return f"{seconds:.3f}s"


def _grpc_cluster(name: str, host: str, port: int) -> dict:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": HTTP_OPTIONS_TYPE,
                "explicit_http_config": {"http2_protocol_options": {"max_concurrent_streams": 2_147_483_647}},
            }
        },
        "circuit_breakers": _BIG_THRESHOLDS,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}]}
            ],
        },
    }


def gate_filter(cluster: str, pool: str, max_hold_s: float, failure_mode_allow: bool = False) -> dict:
    """The gate's ext_proc filter: headers only, hold-capable timeout, receives the subset hint."""
    return {
        "name": GATE_FILTER_NAME,
        "typed_config": {
            "@type": EXT_PROC_TYPE,
            "grpc_service": {
                "envoy_grpc": {"cluster_name": cluster},
                "initial_metadata": [{"key": protocol.POOL_METADATA_KEY, "value": pool}],
            },
            "failure_mode_allow": failure_mode_allow,
            # Gate unreachable or crashed (failure_mode_allow false): the client gets 503 (retryable)
            # at once, not Envoy's default 500, and never an unsteered request to a sleeping engine.
            "status_on_error": {"code": 503},
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "NONE",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SEND",
            },
            "message_timeout": _dur(min(max_hold_s + 10, MAX_MESSAGE_TIMEOUT_S)),
            "max_message_timeout": f"{MAX_MESSAGE_TIMEOUT_S}s",
            "metadata_options": {"receiving_namespaces": {"untyped": [protocol.SUBSET_HINT_NAMESPACE]}},
            "response_attributes": [protocol.UPSTREAM_ADDRESS_ATTRIBUTE],
        },
    }


def epp_filter(cluster: str, pool: str, message_timeout_s: float = 5.0) -> dict:
    """The EPP's ext_proc filter: request headers only, forwards the subset hint, receives ``envoy.lb``."""
    return {
        "name": EPP_FILTER_NAME,
        "typed_config": {
            "@type": EXT_PROC_TYPE,
            "grpc_service": {
                "envoy_grpc": {"cluster_name": cluster},
                "initial_metadata": [{"key": protocol.POOL_METADATA_KEY, "value": pool}],
            },
            "failure_mode_allow": False,
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SKIP",
                "request_body_mode": "NONE",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
            "message_timeout": _dur(message_timeout_s),
            "metadata_options": {
                "forwarding_namespaces": {"untyped": [protocol.SUBSET_HINT_NAMESPACE]},
                "receiving_namespaces": {"untyped": [protocol.DESTINATION_NAMESPACE]},
            },
        },
    }


def _route(prefix: str, pool: str | None, cfg: EnvoyRouterConfig, prefix_rewrite: str | None = None) -> dict:
    route: dict = {
        "match": {"prefix": prefix},
        "route": {
            "cluster": "endpoints",
            "timeout": _dur(cfg.upstream_timeout_s),
            # Safe to retry: the request never reached the engine.
            "retry_policy": {"retry_on": "reset-before-request", "num_retries": 2},
        },
    }
    if prefix_rewrite is not None:
        route["route"]["prefix_rewrite"] = prefix_rewrite
    if pool is not None:
        override = {"@type": PER_ROUTE_TYPE, "overrides": {
            "grpc_initial_metadata": [{"key": protocol.POOL_METADATA_KEY, "value": pool}]}}
        route["typed_per_filter_config"] = {n: override for n in _ext_proc_filter_names(cfg)}
    return route


def _ext_proc_filter_names(cfg: EnvoyRouterConfig) -> list[str]:
    return [EPP_FILTER_NAME] + ([GATE_FILTER_NAME] if cfg.gate_port is not None else [])


def _routes(cfg: EnvoyRouterConfig) -> list[dict]:
    """``<prefix>v1/`` per extra pool (prefix stripped), ``/v1/`` for the default pool, 404 for the rest."""
    disabled = {"@type": PER_ROUTE_TYPE, "disabled": True}

    def not_routed(match: dict) -> dict:
        # Engine admin endpoints (VLLM_SERVER_DEV_MODE=1) and anything else: never forwarded, never held.
        return {"match": match, "direct_response": {"status": 404, "body": {"inline_string": NOT_ROUTED_BODY}},
                "typed_per_filter_config": {n: disabled for n in _ext_proc_filter_names(cfg)}}

    bases = [prefix.rstrip("/") for prefix in cfg.pools_by_prefix] + [""]
    routes = [not_routed({"path": base + p}) for base in bases for p in ADMIN_PATHS_UNDER_API]
    routes += [_route(prefix.rstrip("/") + API_PREFIX, pool, cfg, prefix_rewrite=API_PREFIX)
               for prefix, pool in cfg.pools_by_prefix.items()]
    routes.append(_route(API_PREFIX, None, cfg))
    routes.append(not_routed({"prefix": "/"}))
    return routes


NOT_ROUTED_BODY = (
    '{"error": {"type": "not_routed", "message": "only the OpenAI API (/v1/...) is routed to model servers"}}'
)


def render_bootstrap(cfg: EnvoyRouterConfig) -> dict:
    """Envoy bootstrap (as a dict, JSON-serialisable) for the local router.

    With ``cfg.gate_port`` None the chain is picker-only (the baseline of the router benchmark).
    """
    filters = []
    if cfg.gate_port is not None:
        filters.append(gate_filter("timeslice_gate", cfg.pool, cfg.max_hold_s, cfg.gate_failure_mode_allow))
    filters.append(epp_filter("epp", cfg.pool, cfg.epp_message_timeout_s))
    filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}})
    hcm = {
        "@type": HCM_TYPE,
        "stat_prefix": "inference",
        "stream_idle_timeout": _dur(cfg.max_hold_s + cfg.upstream_timeout_s),
        # Route on the normalized path: /v1/../sleep is /sleep (404); %2F is refused, not decoded.
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "route_config": {
            "name": "inference",
            "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": _routes(cfg)}],
        },
        "http_filters": filters,
    }
    clusters = [
        _grpc_cluster("epp", cfg.host, cfg.epp_port),
        {
            "name": "endpoints",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s",
            # Below uvicorn's 5 s keep-alive (vLLM's server): Envoy must not reuse a connection the
            # engine is closing (seen as 503 "connection termination" after idle training phases).
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": HTTP_OPTIONS_TYPE,
                    "common_http_protocol_options": {"idle_timeout": "3s"},
                    "explicit_http_config": {"http_protocol_options": {}},
                }
            },
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": protocol.DESTINATION_HEADER},
            "circuit_breakers": _BIG_THRESHOLDS,
        },
    ]
    if cfg.gate_port is not None:
        clusters.insert(0, _grpc_cluster("timeslice_gate", cfg.host, cfg.gate_port))
    return {
        "admin": {"address": {"socket_address": {"address": cfg.host, "port_value": cfg.admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "inference",
                    "address": {"socket_address": {"address": cfg.host, "port_value": cfg.listen_port}},
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


def write_bootstrap(cfg: EnvoyRouterConfig, path: Path) -> Path:
    """Render and write the bootstrap as JSON (Envoy reads JSON as YAML). Returns ``path``."""
    path.write_text(json.dumps(render_bootstrap(cfg), indent=1))
    return path
