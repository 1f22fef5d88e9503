"""Wire names shared by the gate, the picker, the rendered Envoy configuration and the router's clients.

In the library, not in ``epp_plugin``, because clients (``llmd_timeslice.client.integrations.rollouts``, the demo's load)
send and read these headers, and of the library only the entry points that start the whole stack import the
router side (docs/decisions/process-code-layout.md).

EPP protocol facts are from the Gateway API Inference Extension, proposal 004
("Endpoint Picker Protocol"): the subset hint is dynamic metadata namespace
``envoy.lb.subset_hint`` key ``x-gateway-destination-endpoint-subset`` (a list of ``ip:port``);
the picked endpoint goes in request header ``x-gateway-destination-endpoint`` and in dynamic
metadata namespace ``envoy.lb`` under the same key.
"""

SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
DESTINATION_SERVED_KEY = "x-gateway-destination-endpoint-served"

OBJECTIVE_HEADER = "x-gateway-inference-objective"
"""Request header naming the request's InferenceObjective (Gateway API Inference Extension, ``release-1.5``
commit 1e46715cf4e1, ``pkg/epp/metadata/consts.go``, ``ObjectiveKey``; :mod:`llmd_timeslice.domain.objectives`)."""

# Project names (not upstream).
GATE_READINESS_SERVICE = "llmd_timeslice.v1alpha1.GateReadiness"
"""The gate's gRPC health service name that turns SERVING once its first state snapshot from the orchestrator is
applied (``""``: SERVING while the process serves at all)."""
POOL_METADATA_KEY = "x-llmd-timeslice-pool"
"""gRPC initial metadata key that Envoy sends with each ext_proc stream (grpc_service.initial_metadata)."""
MIN_WEIGHT_VERSION_HEADER = "x-llmd-timeslice-min-weight-version"
"""Request header: hold until an endpoint at this weight version (integer) or newer serves."""
HOLD_MS_HEADER = "x-llmd-timeslice-hold-ms"
"""Response header added by the gate: milliseconds the request was held before admission."""
REASON_HEADER = "x-llmd-timeslice-reason"
"""Response header on a refusal (429/503): the machine-readable reason."""
WEIGHT_VERSION_HEADER = "x-llmd-timeslice-weight-version"
"""Response header set by the gate: the weight version of the endpoint that served the request (as the gate
saw it when the response headers passed; the orchestrator publishes it with each SERVING state)."""
EXT_PROC_ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
UPSTREAM_ADDRESS_ATTRIBUTE = "upstream.address"

# The fast path (HTTP ext_authz + access-log stream). Facts (Envoy 1.40, measured here, docs/gate.md):
# ext_authz HTTP ``authorization_request.headers_to_add`` values are substitution-formatted and overwrite a client
# header of the same name; ``allowed_upstream_headers`` copy headers of a 200 answer onto the request (overwriting);
# an answer with a 5xx status is treated as an error (status_on_error, body and headers dropped).
POOL_HEADER = "x-llmd-timeslice-pool"
"""Header Envoy adds to each ext_authz check (``headers_to_add``, per route): the request's InferencePool."""
ENVOY_ID_HEADER = "x-llmd-timeslice-envoy"
"""Header Envoy adds to each ext_authz check: the id of that Envoy process (``%ENVIRONMENT(LLMD_TIMESLICE_ENVOY_ID)%``),
so the gate can finish that Envoy's admissions when its access-log streams end for good (Envoy gone)."""
ENVOY_ID_ENV = "LLMD_TIMESLICE_ENVOY_ID"
"""Environment variable holding a fresh id per Envoy process (set by whoever starts Envoy)."""
PICK_HEADER = "x-llmd-timeslice-pick"
"""Header Envoy adds to each ext_authz check when no EPP follows: ``least-in-flight`` asks the gate to choose the
endpoint itself (answer header ``x-gateway-destination-endpoint``)."""
PICK_LEAST_IN_FLIGHT = "least-in-flight"
EDS_HEADER = "x-llmd-timeslice-eds"
"""Header Envoy adds to each ext_authz check when the gate picks and Envoy's model-server cluster takes its endpoints
from the gate's EDS (value ``1``): the gate then names an endpoint only once that Envoy has it
(:mod:`epp_plugin.gate.endpoint_discovery`). Without it (an ORIGINAL_DST cluster) the gate answers at once."""
ADMISSION_HEADER = "x-llmd-timeslice-admission"
"""Answer header of an admission, copied onto the request (``allowed_upstream_headers``) and logged by the access
log (``additional_request_headers_to_log``): matches a completion to its admission."""
SUBSET_HINT_HEADER = "x-llmd-timeslice-subset-hint"
"""Answer header carrying the subset hint as a base64-serialized ``google.protobuf.Value`` (a list of ``ip:port``);
Envoy's header_to_metadata filter turns it into ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``
dynamic metadata (``PROTOBUF_VALUE``, ``BASE64``) and removes it."""
STATUS_HEADER = "x-llmd-timeslice-status"
"""Refusal answer header: the status the client must get when it is a 5xx (Envoy treats a 5xx ext_authz answer as an
error, so the answer carries 429 and the rendered ``local_reply_config`` maps it back by this header's metadata)."""
AUTHZ_METADATA_NAMESPACE = "envoy.filters.http.ext_authz"
"""Namespace of the dynamic metadata ext_authz emits from answer headers (``dynamic_metadata_from_headers``)."""
REQUEST_ID_HEADER = "x-request-id"
