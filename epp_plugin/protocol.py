"""Wire names shared by the gate, the picker and the rendered Envoy configuration.

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

# Project names (not upstream).
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
