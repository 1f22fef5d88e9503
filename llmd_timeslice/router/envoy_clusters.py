"""The clusters of the router's Envoy configuration: the gate's and the EPP's gRPC clusters (HTTP/2, flood limits
raised), the gate's ext_authz cluster, the model-server cluster behind an EPP (ORIGINAL_DST) and the one behind the
gate's own picks (EDS subsets). The listener, its filters and routes are in :mod:`llmd_timeslice.router.envoy_config`, which
assembles the bootstrap from both."""

from __future__ import annotations

from dataclasses import dataclass

from llmd_timeslice import protocol

HTTP_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


# Far above Envoy's default of 1024 concurrent requests per cluster: each held request is one
# open ext_proc stream to the gate.
_BIG_THRESHOLDS = {
    "thresholds": [
        {
            "priority": "DEFAULT",
            "max_connections": 100_000,
            "max_pending_requests": 100_000,
            "max_requests": 100_000,
            # Each retried check (the gate restarting) and each retried connect (an engine dying) is one retry in
            # flight: thousands at once when a whole hold queue rides out a gate restart.
            "max_retries": 100_000,
        }
    ]
}


def dur(seconds: float) -> str:
    return f"{seconds:.3f}s"


def grpc_http2_options() -> dict:
    """HTTP/2 options of Envoy's connections to the gate and the EPP (``typed_extension_protocol_options``).

    Each held request is one stream on one connection, so the stream limit is lifted, and so are Envoy's outbound
    flood limits, which count frames queued for a peer that is not reading (envoy/config/core/v3/protocol.proto:
    ``max_outbound_control_frames``, PING/SETTINGS/RST_STREAM, default 1,000; ``max_outbound_frames``, default
    10,000; on upstream connections too). Every ext_proc stream Envoy ends is one RST_STREAM, so when a whole hold
    queue (``max_held``, 10,000 per pool) is released, a busy peer can fall 1,000 frames behind: Envoy then closed
    the connection and failed every request on it (a test's EPP, starved of CPU, at 2,000 released requests:
    ``cluster.epp.http2.outbound_control_flood`` 1, hundreds of 500s; docs/decisions/envoy-http2-flood-limits.md).
    These peers are the
    router's own; the limits stay finite (memory) and cover five full hold queues.
    """
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": HTTP_OPTIONS_TYPE,
            "explicit_http_config": {
                "http2_protocol_options": {
                    "max_concurrent_streams": 2_147_483_647,
                    "max_outbound_control_frames": 50_000,
                    "max_outbound_frames": 200_000,
                }
            },
        }
    }


def grpc_cluster(name: str, host: str, port: int) -> dict:
    """A STATIC HTTP/2 cluster for a gRPC service at ``host:port`` (the gate's ext_proc and access-log service, the
    EPP): unlimited streams per connection, circuit breakers and flood limits raised (each held request is one
    stream; :func:`grpc_http2_options`)."""
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": grpc_http2_options(),
        "circuit_breakers": _BIG_THRESHOLDS,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}]}
            ],
        },
    }


def authz_cluster(name: str, host: str, port: int) -> dict:
    """Cluster of the gate's HTTP ext_authz port: HTTP/1.1, one connection per check in progress (a held
    request keeps one), hence the raised circuit breakers."""
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "circuit_breakers": _BIG_THRESHOLDS,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}]}
            ],
        },
    }


OVERRIDE_HOST_TYPE = "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
SUBSET_LB_TYPE = "type.googleapis.com/envoy.extensions.load_balancing_policies.subset.v3.Subset"
ROUND_ROBIN_TYPE = "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
EDS_INITIAL_FETCH_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class EngineConnections:
    """How Envoy connects to the engines (the model-server cluster).

    The default suits engines on the router's machine or a network that refuses rather than loses: a connection
    kept alive between requests (up to 3 s idle), 5 s to connect. Across nodes (:data:`ACROSS_NODES`), where a node
    can be cut off and its packets lost rather than refused:

    * ``one_request_per_connection``: a request never rides on a connection opened before it (Envoy's
      ``max_requests_per_connection: 1``). On a kept-alive connection to a node cut off since its last request, the
      request is written into the kernel's buffer, counts as sent, and is never retried (Envoy retries a reset only
      before any byte went upstream, ``connect-failure`` only a connection that never opened): it hung until its
      timeout although it never reached the node. On a new connection the node's silence is a connect timeout,
      which the route retries on the next endpoint the gate listed (docs/decisions/stack-across-nodes.md).
    * ``connect_timeout_s``: how long that costs the request before its retry, and the gate's first sign of the
      loss (the failed connection takes the endpoint out of its picks).
    * ``keepalive``: (idle seconds, interval seconds, probes) of TCP keepalive on each engine connection: a request
      that had reached a node before it was cut off ends within about idle + interval x probes seconds (503)
      instead of waiting for the route timeout; a busy but live node's kernel answers the probes.
    """

    connect_timeout_s: float = 5.0
    one_request_per_connection: bool = False
    keepalive: tuple[int, int, int] | None = None


ACROSS_NODES = EngineConnections(connect_timeout_s=1.0, one_request_per_connection=True, keepalive=(2, 1, 3))
"""The engine connections of a stack across nodes (:class:`EngineConnections`)."""


def _upstream_http_options(conn: EngineConnections) -> dict:
    # Below uvicorn's 5 s keep-alive (vLLM's server): Envoy must not reuse a connection the
    # engine is closing (seen as 503 "connection termination" after idle training phases).
    common: dict = {"idle_timeout": "3s"}
    if conn.one_request_per_connection:
        common["max_requests_per_connection"] = 1
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": HTTP_OPTIONS_TYPE,
            "common_http_protocol_options": common,
            "explicit_http_config": {"http_protocol_options": {}},
        }
    }


def _engine_connection_fields(conn: EngineConnections) -> dict:
    """The model-server cluster's connection settings (:class:`EngineConnections`)."""
    out: dict = {"connect_timeout": dur(conn.connect_timeout_s), "typed_extension_protocol_options": _upstream_http_options(conn)}
    if conn.keepalive is not None:
        idle, interval, probes = conn.keepalive
        out["upstream_connection_options"] = {
            "tcp_keepalive": {"keepalive_time": idle, "keepalive_interval": interval, "keepalive_probes": probes}
        }
    return out


def endpoints_cluster(conn: EngineConnections = EngineConnections()) -> dict:
    """The model-server cluster behind an EPP: ORIGINAL_DST, routed by the EPP's ``x-gateway-destination-endpoint``."""
    return {
        "name": "endpoints",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        **_engine_connection_fields(conn),
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": protocol.DESTINATION_HEADER},
        "circuit_breakers": _BIG_THRESHOLDS,
    }


def gate_picks_cluster(
    gate_cluster: str, conn: EngineConnections = EngineConnections(), initial_fetch_timeout_s: float = EDS_INITIAL_FETCH_TIMEOUT_S
) -> dict:
    """The model-server cluster when the gate picks (no EPP): its endpoints come from the gate's EDS
    (:mod:`epp_plugin.gate.endpoint_discovery`, over ``gate_cluster``), and the
    ``envoy.load_balancing_policies.override_host`` policy routes to the first address of the gate's
    ``x-gateway-destination-endpoint`` list, then to the next one on each retry (Envoy 1.40
    ``api/envoy/extensions/load_balancing_policies/override_host/v3/override_host.proto``;
    ``source/extensions/load_balancing_policies/override_host/load_balancer.cc``). Its fallback, used when no listed
    address is a host of the cluster, is a subset policy whose one selector no endpoint matches, with
    ``NO_FALLBACK``: it picks nothing and Envoy answers 503 (no healthy upstream) rather than send the request to an
    endpoint the gate did not choose (a sleeping engine). ``initial_fetch_timeout`` (``initial_fetch_timeout_s``) keeps Envoy's
    start from waiting 15 s for a gate that is not up yet, or knows no endpoint yet."""
    no_endpoint = {
        "typed_extension_config": {
            "name": "envoy.load_balancing_policies.subset",
            "typed_config": {
                "@type": SUBSET_LB_TYPE,
                "fallback_policy": "NO_FALLBACK",
                "subset_selectors": [{"keys": ["llmd-timeslice-never"]}],
                "subset_lb_policy": {
                    "policies": [
                        {
                            "typed_extension_config": {
                                "name": "envoy.load_balancing_policies.round_robin",
                                "typed_config": {"@type": ROUND_ROBIN_TYPE},
                            }
                        }
                    ]
                },
            },
        }
    }
    return {
        "name": "endpoints",
        "type": "EDS",
        "eds_cluster_config": {
            "eds_config": {
                "resource_api_version": "V3",
                "initial_fetch_timeout": dur(initial_fetch_timeout_s),
                "api_config_source": {
                    "api_type": "GRPC",
                    "transport_api_version": "V3",
                    # Reconnect to a restarted gate within a second, not Envoy's default 0.5 s doubling to 30 s
                    # (``source/common/config/utility.h``, ``prepareJitteredExponentialBackOffStrategy``).
                    "grpc_services": [
                        {
                            "envoy_grpc": {
                                "cluster_name": gate_cluster,
                                "retry_policy": {"retry_back_off": {"base_interval": "0.1s", "max_interval": "1s"}},
                            }
                        }
                    ],
                },
            }
        },
        **_engine_connection_fields(conn),
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
                            "@type": OVERRIDE_HOST_TYPE,
                            "override_host_sources": [{"header": protocol.DESTINATION_HEADER}],
                            "fallback_policy": {"policies": [no_endpoint]},
                        },
                    }
                }
            ]
        },
        "circuit_breakers": _BIG_THRESHOLDS,
    }
