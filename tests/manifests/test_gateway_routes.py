"""Each gateway variant's route and gate: only ``/v1/`` reaches a model server, the gate before the EPP with its contract
and timeouts (standalone, Istio over ext_proc, agentgateway, Envoy Gateway), and the label fallback's EPP flow control
(issue 14 defects 7, 9)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from llmd_timeslice import protocol
from llmd_timeslice.router.envoy_config import (
    gate_filter,
)
from tests.manifests.support import (
    BIG,
    GATEWAYS,
    GUIDE,
    MANIFESTS,
    SUBSET_NS,
    S,
    _assert_gate_contract,
    _eg_docs,
    _fixture_values,
    _hcm_filters,
    _hold_plus_generation,
    _names,
    _seconds,
    built,
    find,
    gen,
    helm_coalesce,
    values,
)

# ----------------------------------------------- defect 7: only /v1/ reaches a model server


@pytest.mark.parametrize("overlay", GATEWAYS)
def test_every_route_we_ship_matches_only_the_openai_api(overlay):
    routes = [d for d in built(overlay) if d["kind"] == "HTTPRoute"]
    assert len(routes) == 1
    for rule in routes[0]["spec"]["rules"]:
        assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1/"}}], rule["matches"]
    assert values("values-gateway.yaml")["httpRoute"]["create"] is False, "the chart's route matches /"


def test_standalone_envoy_routes_only_the_openai_api_and_404s_the_rest():
    boot = yaml.safe_load((GUIDE / "router" / "standalone-envoy.yaml").read_text())
    routes = _hcm_filters(boot, "vllm")[0]["route_config"]["virtual_hosts"][0]["routes"]
    forwarded = [r["match"] for r in routes if "route" in r]
    assert forwarded == [{"prefix": "/v1/"}]
    assert routes[-1]["match"] == {"prefix": "/"} and routes[-1]["direct_response"]["status"] == 404
    for r in routes:
        if "direct_response" in r:
            assert all(v["disabled"] for v in r["typed_per_filter_config"].values()), "a 404 is never held"
            assert set(r["typed_per_filter_config"]) == {gen.GATE_FILTER_NAME, gen.EPP_FILTER_NAME}
    hcm = _hcm_filters(boot, "vllm")[0]
    assert hcm["normalize_path"] and hcm["merge_slashes"]
    # The chart's own action (UNESCAPE_AND_REDIRECT) is kept: the client's redirected request is routed normalized.
    assert hcm["path_with_escaped_slashes_action"] in ("REJECT_REQUEST", "UNESCAPE_AND_REDIRECT")


# ------------------------------------------------ gate filter order, contract, timeouts per gateway


def _expected_gate(cluster: str, pool: str | None) -> dict:
    g = gate_filter(cluster, pool or S.pool, S.max_hold_s, failure_mode_allow=False)
    g["name"] = gen.GATE_FILTER_NAME
    if pool is None:
        g["typed_config"]["grpc_service"].pop("initial_metadata")
    return g


def test_standalone_envoy_orders_gate_before_epp_forwards_the_hint_and_fits_long_generations():
    boot = yaml.safe_load((GUIDE / "router" / "standalone-envoy.yaml").read_text())
    hcm, filters = _hcm_filters(boot, "vllm")
    assert _names(filters) == [gen.GATE_FILTER_NAME, gen.EPP_FILTER_NAME, "envoy.filters.http.router"]
    gate, epp = filters[0], filters[1]
    assert gate == _expected_gate("llmd_timeslice_gate", S.pool)
    _assert_gate_contract(gate)
    epp_md = epp["typed_config"]["metadata_options"]
    assert SUBSET_NS in epp_md["forwarding_namespaces"]["untyped"]
    assert epp["typed_config"]["failure_mode_allow"] is False
    assert _seconds(hcm["stream_idle_timeout"]) > _hold_plus_generation()
    route = next(r for r in hcm["route_config"]["virtual_hosts"][0]["routes"] if "route" in r)
    assert _seconds(route["route"]["timeout"]) > _hold_plus_generation(), "defect 14: generation must fit"
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    gate_cluster = clusters["llmd_timeslice_gate"]
    assert gate_cluster["circuit_breakers"]["thresholds"][0]["max_requests"] >= BIG
    addr = gate_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert addr["address"] == f"{gen.GATE_HEADLESS_SERVICE}.{S.namespace}.svc.cluster.local"
    assert clusters["ext_proc"]["transport_socket"]["name"] == "envoy.transport_sockets.tls", "the EPP serves TLS"

    vals = values("values-standalone.yaml")
    router = vals["router"]
    assert gen.render_chart_envoy_yaml((GUIDE / "router" / "values-standalone.yaml").read_text(), S.pool, S.namespace) == boot
    assert router["proxy"]["failOpen"] is False and router["proxy"]["mode"] == "sidecar"
    assert router["inferencePool"]["failureMode"] == "FailClose"
    assert "flags" not in router.get("epp", {}), "the guide's EPP keeps its TLS and flags"


def _istio_patches():
    return find(built("gateways/istio-ext-proc"), "EnvoyFilter")["spec"]["configPatches"]


def test_istio_inserts_the_gate_before_the_epp_and_names_the_pool_per_route():
    insert, merge, hcm_merge, *routes = _istio_patches()
    assert insert["patch"]["operation"] == "INSERT_BEFORE" and insert["match"]["context"] == "GATEWAY"
    assert insert["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == gen.EPP_FILTER_NAME
    gate = insert["patch"]["value"]
    assert gate == _expected_gate(f"outbound|{gen.GATE_EXT_PROC_PORT}||{S.gate_fqdn}", None), (
        "no pool on the listener (defect 12)"
    )
    _assert_gate_contract(gate)
    assert merge["patch"]["operation"] == "MERGE"
    assert merge["patch"]["value"]["typed_config"]["metadata_options"]["forwarding_namespaces"]["untyped"] == [SUBSET_NS]
    assert _seconds(hcm_merge["patch"]["value"]["typed_config"]["stream_idle_timeout"]) > _hold_plus_generation()
    (route_patch,) = routes
    route = find(built("gateways/istio-ext-proc"), "HTTPRoute")
    assert (
        route_patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
        == f"{route['metadata']['namespace']}.{route['metadata']['name']}.0"
    )
    override = route_patch["patch"]["value"]["typed_per_filter_config"][gen.GATE_FILTER_NAME]
    assert override["overrides"]["grpc_initial_metadata"] == [{"key": protocol.POOL_METADATA_KEY, "value": S.pool}]
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": S.pool}
    ]
    assert _seconds(route["spec"]["rules"][0]["timeouts"]["request"]) > _hold_plus_generation()
    dr = find(built("gateways/istio-ext-proc"), "DestinationRule")
    assert dr["spec"]["host"] == S.gate_fqdn
    assert dr["spec"]["trafficPolicy"]["connectionPool"]["http"]["http2MaxRequests"] >= BIG


def test_agentgateway_runs_the_gate_on_the_route_and_pairs_the_serving_label():
    docs = built("gateways/agentgateway")
    pol = find(docs, "AgentgatewayPolicy")
    route = find(docs, "HTTPRoute")
    assert pol["spec"]["targetRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": route["metadata"]["name"]}
    ]
    assert pol["spec"]["traffic"]["extProc"]["backendRef"] == {"name": gen.GATE_SERVICE, "port": gen.GATE_EXT_PROC_PORT}
    assert "failOpen" not in json.dumps(pol), "agentgateway's controller always sets FAIL_CLOSED"
    assert _seconds(pol["spec"]["traffic"]["timeouts"]["request"]) > _hold_plus_generation()
    assert _seconds(route["spec"]["rules"][0]["timeouts"]["request"]) > _hold_plus_generation()
    # No subset hint reaches agentgateway's EPP call: the serving label steers instead.
    assert values("values-serving-label.yaml")["router"]["modelServers"]["matchLabels"] == {"timeslice.io/serving": "true"}
    text = (GUIDE / "README.md").read_text()
    assert "values-serving-label.yaml" in text and "agentgateway" in text


def test_envoy_gateway_chains_gate_then_epp_over_tls_and_never_falls_back_to_a_sleeping_pod():
    docs = _eg_docs()
    eep = find(docs, "EnvoyExtensionPolicy")
    gate, epp = eep["spec"]["extProc"]
    assert gate["backendRefs"] == [{"name": gen.GATE_SERVICE, "port": gen.GATE_EXT_PROC_PORT}]
    assert gate["failOpen"] is False and epp["failOpen"] is False
    assert _seconds(gate["messageTimeout"]) > S.max_hold_s
    assert gate["processingMode"]["request"] == {}, "headers only"
    assert gate["metadata"]["writableNamespaces"] == [SUBSET_NS]
    assert SUBSET_NS in epp["metadata"]["accessibleNamespaces"]
    assert gate["backendSettings"]["circuitBreaker"]["maxParallelRequests"] >= BIG
    # The EPP serves TLS: a Backend with TLS, not the Service in plaintext (defect 8).
    (epp_ref,) = epp["backendRefs"]
    backend = find(docs, "Backend", epp_ref["name"])
    assert epp_ref["kind"] == "Backend" and backend["spec"]["tls"]["insecureSkipVerify"] is True
    assert backend["spec"]["endpoints"][0]["fqdn"]["hostname"] == f"{S.epp_service}.{S.namespace}.svc.cluster.local"
    route = find(docs, "HTTPRoute")
    assert eep["spec"]["targetRefs"][0]["name"] == route["metadata"]["name"]
    assert _seconds(route["spec"]["rules"][0]["timeouts"]["request"]) > _hold_plus_generation()
    # The load balancer's fallback set is SERVING samplers only (defect 8).
    svc = find(docs, "Service", route["spec"]["rules"][0]["backendRefs"][0]["name"])
    assert svc["spec"]["selector"] == {"llm-d.ai/guide": S.guide, "timeslice.io/serving": "true"}
    btp = find(docs, "BackendTrafficPolicy")
    assert btp["spec"]["loadBalancer"]["endpointOverride"]["extractFrom"] == [{"header": protocol.DESTINATION_HEADER}]
    ctp = find(docs, "ClientTrafficPolicy")
    assert _seconds(ctp["spec"]["timeout"]["http"]["streamIdleTimeout"]) > _hold_plus_generation()
    patches = find(docs, "EnvoyPatchPolicy")["spec"]["jsonPatches"]
    hcm_path = "..filters[?(@.name=='envoy.filters.network.http_connection_manager')].typed_config"
    for p in patches:
        assert p["operation"]["jsonPath"] == hcm_path or f"@.name=='{gen._eg_gate_filter_name(S)}'" in p["operation"]["jsonPath"]
        assert p["name"] == f"{S.namespace}/{S.gateway}/{S.gateway_listener}"
    assert {p["operation"]["path"] for p in patches} == {
        "response_trailer_mode",
        "max_message_timeout",
        "status_on_error",
        "local_reply_config",
    }


# ------------------------------------------------ EndpointPickerConfig (label fallback), defect 9

# Fields of llm-d-router v0.10.0 (and v0.9.0) apix/config/v1alpha1 EndpointPickerConfig and FlowControlConfig (the EPP's
# loader is strict: serializer.EnableStrict in pkg/epp/config/loader/configloader.go).
_EPC_TOP = {
    "apiVersion",
    "kind",
    "featureGates",
    "plugins",
    "schedulingProfiles",
    "dataLayer",
    "flowControl",
    "requestHandler",
    "saturationDetector",
    "parser",
}
_EPC_FLOW = {
    "maxBytes",
    "maxRequests",
    "defaultRequestTTL",
    "defaultPriorityBand",
    "defaultNegativePriorityBand",
    "priorityBands",
    "usageLimitPolicyPluginRef",
    "saturationDetector",
}


def _check_endpoint_picker_config(cfg: dict) -> None:
    assert cfg["apiVersion"] == "llm-d.ai/v1alpha1" and cfg["kind"] == "EndpointPickerConfig"
    assert set(cfg) <= _EPC_TOP, set(cfg) - _EPC_TOP
    names = []
    for p in cfg["plugins"]:
        assert set(p) <= {"name", "type", "parameters"} and p["type"], p
        names.append(p.get("name", p["type"]))
    assert len(names) == len(set(names))
    for prof in cfg["schedulingProfiles"]:
        for ref in prof["plugins"]:
            assert set(ref) <= {"pluginRef", "weight"} and ref["pluginRef"] in names, ref
    assert set(cfg.get("flowControl", {})) <= _EPC_FLOW, set(cfg.get("flowControl", {})) - _EPC_FLOW


def test_label_fallback_holds_in_flow_control_and_dispatches_after_an_empty_pool():
    serving = values("values-serving-label.yaml")["router"]
    assert serving["epp"]["flags"]["disable-endpoint-subset-filter"] is True, (
        "queued requests keep a stale (empty) subset otherwise (gateway-api-inference-extension#2117)"
    )
    fc = values("values-flow-control.yaml")["router"]["epp"]
    cfg = yaml.safe_load(fc["pluginsCustomConfig"][fc["pluginsConfigFile"]])
    _check_endpoint_picker_config(cfg)
    assert "flowControl" in cfg["featureGates"]
    assert _seconds(cfg["flowControl"]["defaultRequestTTL"]) >= S.max_hold_s
    route = find(built("gateways/label-fallback"), "HTTPRoute")
    assert _seconds(route["spec"]["rules"][0]["timeouts"]["request"]) > _seconds(cfg["flowControl"]["defaultRequestTTL"])
    tpl = find(built("modelserver/example"), "Deployment")["spec"]["template"]
    assert tpl["metadata"]["labels"]["timeslice.io/serving"] == "true", "pods start with the label the pool selects"


def _epcs_of(values_doc: dict) -> list[dict]:
    epp = values_doc["router"]["epp"]
    return [yaml.safe_load(v) for v in (epp.get("pluginsCustomConfig") or {}).values()]


def test_every_epp_config_rendered_or_cited_has_only_parameters_the_pinned_epp_knows():
    """Issue 25 defect 6: the EPP decodes plugin parameters strictly (llm-d-router v0.9.0 StrictDecoder) and the
    guide's values file we cited (@0a3b0c939d50) sets maxTokensInFlightPenalty, which v0.9.0 no longer has. Every
    EndpointPickerConfig we render passes the check of the pinned EPP's parameters; the cited one is caught, and
    ``--flow-control-values`` refuses to layer onto it."""
    rendered = [*_epcs_of(values("values-flow-control.yaml"))]
    for name in ("base.values.yaml", "guide.values.yaml"):
        rendered += _epcs_of(_fixture_values(name)) if "pluginsCustomConfig" in _fixture_values(name)["router"]["epp"] else []
    release = helm_coalesce(_fixture_values("base.values.yaml"), _fixture_values("guide.values.yaml"))
    rendered += _epcs_of(yaml.safe_load(gen.flow_control_values(S, release)))
    for epc in rendered:
        assert gen.epp_config_errors(epc) == [], epc
    cited = _fixture_values("optimized-baseline-0a3b0c939d50.values.yaml")
    (epc,) = _epcs_of(cited)
    errors = gen.epp_config_errors(epc)
    assert len(errors) == 1 and "'maxTokensInFlightPenalty' is unknown to llm-d-router v0.10.0" in errors[0], errors
    with pytest.raises(ValueError, match="maxTokensInFlightPenalty"):
        gen.flow_control_values(S, cited)
    assert gen.epp_config_errors({"plugins": [{"type": "made-up-scorer"}]}), "an unknown plugin type is not waved through"
    readme = (GUIDE / "README.md").read_text()
    assert "maxTokensInFlightPenalty" in readme, "the README says what to remove from the cited guide values"


def test_label_fallback_layers_flow_control_onto_the_guides_own_plugins():
    """Issue 25 defect 8: values-flow-control.yaml replaced the guide's EndpointPickerConfig with three scorers of
    ours. ``generate.py --flow-control-values`` takes the release's values (``helm get values``) and adds only the
    flowControl gate and TTL: every plugin and scheduling profile of the guide stays."""
    release = helm_coalesce(_fixture_values("base.values.yaml"), _fixture_values("guide.values.yaml"))
    src = yaml.safe_dump(release)
    proc = subprocess.run(
        [sys.executable, str(MANIFESTS / "generate.py"), "--flow-control-values", "-"],
        input=src,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    ours = yaml.safe_load(proc.stdout)
    layered = helm_coalesce(release, values("values-gateway.yaml"), values("values-serving-label.yaml"), ours)
    epp = layered["router"]["epp"]
    theirs = yaml.safe_load(release["router"]["epp"]["pluginsCustomConfig"][release["router"]["epp"]["pluginsConfigFile"]])
    cfg = yaml.safe_load(epp["pluginsCustomConfig"][epp["pluginsConfigFile"]])
    assert epp["pluginsConfigFile"] == release["router"]["epp"]["pluginsConfigFile"]
    assert cfg["plugins"] == theirs["plugins"] and cfg["schedulingProfiles"] == theirs["schedulingProfiles"]
    assert "flowControl" in cfg["featureGates"] and _seconds(cfg["flowControl"]["defaultRequestTTL"]) >= S.max_hold_s
    _check_endpoint_picker_config(cfg)
    del release["router"]["epp"]["pluginsCustomConfig"]
    bad = subprocess.run(
        [sys.executable, str(MANIFESTS / "generate.py"), "--flow-control-values", "-"],
        input=yaml.safe_dump(release),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "values-flow-control.yaml" in bad.stderr and bad.stderr.count("\n") == 1
