"""The Kubernetes guide under manifests/: it builds, validates, and keeps the gate's contract.

Real tools only: ``kubectl kustomize`` builds every overlay, kubernetes-validate checks built-in
kinds strictly against the pinned Kubernetes schemas, the vendored upstream CRD schemas
(manifests/crd-schemas) check the custom resources, and the real Envoy binary
(``envoy --mode validate``) checks every Envoy configuration a variant produces. A missing tool is
a failure, never a skip.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from epp_plugin import protocol
from epp_plugin.envoy_config import EXT_PROC_TYPE, HCM_TYPE, ROUTER_TYPE, gate_filter
from epp_plugin.envoy_launcher import envoy_binary

REPO = Path(__file__).resolve().parent.parent
MANIFESTS = REPO / "manifests"
GUIDE = MANIFESTS / "guides" / "time-slicing"
CRD_SCHEMAS = MANIFESTS / "crd-schemas"

K8S_VERSION = "1.32.0"
"""Kubernetes version the built-in kinds are validated against (kubernetes-validate, strict)."""

OVERLAYS = [
    "base",
    "modelserver/example",
    "gateways/istio",
    "gateways/envoy-gateway",
    "gateways/kgateway",
    "gateways/label-fallback",
]
IMAGE = "ghcr.io/llm-d-incubation/llmd-timeslice:0.1.0"
SUBSET_NS = protocol.SUBSET_HINT_NAMESPACE
BIG = 100_000


def _load_generator():
    spec = importlib.util.spec_from_file_location("manifests_generate", MANIFESTS / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()
S = gen.SETTINGS


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(value))
    assert m, f"not a duration: {value!r}"
    return float(m[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m[2]]


@cache
def built(overlay: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with kustomize) is required: it is on the project's machine image"
    proc = subprocess.run([kubectl, "kustomize", str(GUIDE / overlay)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {overlay} failed:\n{proc.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(proc.stdout) if d)
    assert docs, f"{overlay} built to nothing"
    return docs


def find(docs, kind: str, name: str | None = None) -> dict:
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def envoy_validate_all(configs: dict[str, dict], tmp_path: Path) -> None:
    """Run the real ``envoy --mode validate`` on each config (in parallel); fail with Envoy's words."""
    binary = str(envoy_binary())

    def one(item):
        name, cfg = item
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        proc = subprocess.run([binary, "--mode", "validate", "-c", str(path), "--log-level", "error"],
                              capture_output=True, text=True, timeout=60)
        return name, proc.returncode, (proc.stderr or proc.stdout)[-3000:]

    with ThreadPoolExecutor(max_workers=4) as pool:
        failures = [(n, out) for n, rc, out in pool.map(one, configs.items()) if rc != 0]
    assert not failures, "envoy --mode validate rejected: " + "\n".join(f"{n}: {o}" for n, o in failures)


# --------------------------------------------------------------------------- parse + build


def test_every_yaml_file_parses():
    files = sorted(MANIFESTS.rglob("*.yaml"))
    assert len(files) > 20
    for f in files:
        docs = [d for d in yaml.safe_load_all(f.read_text()) if d is not None]
        assert docs, f"{f} is empty"


def test_generated_files_are_current():
    """router/*.yaml and the Istio EnvoyFilter are rendered from epp_plugin.envoy_config."""
    for path, text in gen.rendered_files().items():
        assert path.exists(), f"{path} missing: run .venv/bin/python manifests/generate.py"
        assert path.read_text() == text, f"{path.relative_to(REPO)} is stale: run .venv/bin/python manifests/generate.py"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_with_kubectl_kustomize(overlay):
    for d in built(overlay):
        assert d.get("apiVersion") and d.get("kind") and d.get("metadata", {}).get("name"), d
        assert d["metadata"].get("namespace") == S.namespace, f"{d['kind']}/{d['metadata']['name']} not in {S.namespace}"


# ------------------------------------------------------------------- schema validation

CRD_GROUPS = {
    "gateway.envoyproxy.io",
    "gateway.networking.k8s.io",
    "networking.istio.io",
    "monitoring.coreos.com",
    "gateway.kgateway.dev",
}


def _group(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_builtin_kinds_validate_strictly(overlay):
    checked = 0
    for d in built(overlay):
        if _group(d["apiVersion"]) in CRD_GROUPS:
            continue
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(map(str, e.path))
            pytest.fail(f"{overlay}: {d['kind']}/{d['metadata']['name']} at {path}: {e.message}")
        checked += 1
    # Only the pure custom-resource overlays (istio, envoy-gateway's policies) may have no built-in kind.
    assert checked or overlay in ("gateways/istio", "gateways/kgateway"), f"{overlay}: nothing validated"


def _openapi_to_jsonschema(node):
    """OpenAPI v3 (CRD structural schema) -> JSON Schema, strict: unknown fields are errors unless the
    CRD keeps them (x-kubernetes-preserve-unknown-fields), as the API server would prune them."""
    if isinstance(node, list):
        return [_openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in ("properties", "patternProperties"):
            out[k] = {pk: _openapi_to_jsonschema(pv) for pk, pv in v.items()}
        elif k in ("items", "additionalProperties", "not") and isinstance(v, dict):
            out[k] = _openapi_to_jsonschema(v)
        elif k in ("allOf", "anyOf", "oneOf"):
            out[k] = [_openapi_to_jsonschema(x) for x in v]
        elif k.startswith("x-kubernetes-") or k == "nullable":
            continue
        else:
            out[k] = v
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


@cache
def crd_validator(group: str, kind: str, version: str):
    path = CRD_SCHEMAS / f"{group}_{kind}_{version}.json"
    if not path.exists():
        return None
    schema = _openapi_to_jsonschema(json.loads(path.read_text())["schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    schema["properties"].setdefault("apiVersion", {"type": "string"})  # Istio's schemas leave these out
    schema["properties"].setdefault("kind", {"type": "string"})
    return jsonschema.Draft7Validator(schema)


# kgateway publishes its CRDs only inside its Helm chart; these are the fields of the Go API
# types (kgateway-dev/kgateway api/v1alpha1/kgateway: gateway_extensions_types.go,
# ext_proc_types.go, traffic_policy_types.go, backend_config_policy_types.go) for what the guide uses.
_DUR = re.compile(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")
_KGW = {
    "GatewayExtension.spec": {"type", "extAuth", "extProc", "rateLimit", "jwt", "oauth2"},
    "GatewayExtension.spec.extProc": {"grpcService", "failOpen", "processingMode", "allowProcessingModeOverride",
                                      "allowedProcessingModeOverrides", "messageTimeout", "maxMessageTimeout",
                                      "statPrefix", "routeCacheAction", "metadataOptions"},
    "GatewayExtension.spec.extProc.grpcService": {"backendRef", "authority", "requestTimeout", "retry"},
    "GatewayExtension.spec.extProc.grpcService.backendRef": {"group", "kind", "name", "namespace", "port", "weight"},
    "GatewayExtension.spec.extProc.processingMode": {"requestHeaderMode", "responseHeaderMode", "requestBodyMode",
                                                     "responseBodyMode", "requestTrailerMode", "responseTrailerMode"},
    "TrafficPolicy.spec": {"targetRefs", "targetSelectors", "extProc", "timeouts", "retry", "headerModifiers"},
    "TrafficPolicy.spec.extProc": {"extensionRef", "processingMode", "disable", "stage"},
    "TrafficPolicy.spec.extProc.extensionRef": {"name", "namespace"},
    "TrafficPolicy.spec.timeouts": {"request", "streamIdle"},
    "BackendConfigPolicy.spec": {"targetRefs", "targetSelectors", "circuitBreakers", "connectTimeout"},
    "BackendConfigPolicy.spec.circuitBreakers": {"maxConnections", "maxPendingRequests", "maxRequests", "maxRetries"},
}


def _check_kgateway(d: dict) -> None:
    assert d["apiVersion"] == "gateway.kgateway.dev/v1alpha1", d["apiVersion"]

    def walk(prefix: str, obj):
        allowed = _KGW.get(prefix)
        if allowed is None or not isinstance(obj, dict):
            return
        unknown = set(obj) - allowed
        assert not unknown, f"{d['kind']}/{d['metadata']['name']}: unknown fields {sorted(unknown)} under {prefix}"
        for k, v in obj.items():
            walk(f"{prefix}.{k}", v)

    walk(f"{d['kind']}.spec", d["spec"])
    if d["kind"] == "GatewayExtension":
        pm = d["spec"]["extProc"]["processingMode"]
        for k, v in pm.items():
            allowed = {"NONE", "STREAMED", "BUFFERED", "BUFFERED_PARTIAL", "FULL_DUPLEX_STREAMED"} if "Body" in k \
                else {"DEFAULT", "SEND", "SKIP"}
            assert v in allowed, f"processingMode.{k}={v}"
        for k in ("messageTimeout", "maxMessageTimeout"):
            assert _DUR.match(d["spec"]["extProc"][k]), k
    for ref in d["spec"].get("targetRefs", []):
        assert {"group", "kind", "name"} <= set(ref), ref
    for v in d["spec"].get("timeouts", {}).values():
        assert _DUR.match(v), v


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_resources_validate_against_upstream_schemas(overlay):
    for d in built(overlay):
        group = _group(d["apiVersion"])
        if group not in CRD_GROUPS:
            continue
        if group == "gateway.kgateway.dev":
            _check_kgateway(d)
            continue
        validator = crd_validator(group, d["kind"], d["apiVersion"].split("/")[1])
        assert validator is not None, f"no vendored CRD schema for {d['apiVersion']} {d['kind']} (manifests/crd-schemas)"
        errors = sorted(validator.iter_errors(d), key=lambda e: list(e.path))
        assert not errors, f"{d['kind']}/{d['metadata']['name']}: " + "; ".join(
            f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:5])


def test_crd_validation_is_strict():
    """The CRD check catches an invented field (the failure mode it is there for)."""
    d = copy.deepcopy(find(built("gateways/envoy-gateway"), "EnvoyExtensionPolicy"))
    d["spec"]["extProc"][0]["receivingNamespaces"] = [SUBSET_NS]
    v = crd_validator("gateway.envoyproxy.io", "EnvoyExtensionPolicy", "v1alpha1")
    assert any("receivingNamespaces" in e.message for e in v.iter_errors(d))


# ---------------------------------------------------------- our containers, security, CLI


def _pod_specs(docs):
    for d in docs:
        spec = d.get("spec", {}).get("template", {}).get("spec")
        if spec:
            yield d, spec


def _ours(spec):
    return [c for c in spec["containers"] if c.get("image") == IMAGE]


@pytest.mark.parametrize("overlay", ["base", "modelserver/example"])
def test_security_contexts(overlay):
    seen = 0
    for d, spec in _pod_specs(built(overlay)):
        where = f"{overlay}: {d['kind']}/{d['metadata']['name']}"
        for ns in ("hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace"):
            assert not spec.get(ns), f"{where}: {ns} (only a process-level backend may need one; none ships)"
        for c in _ours(spec):
            sc = c.get("securityContext", {})
            pod_sc = spec.get("securityContext", {})
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, f"{where}/{c['name']}: runAsNonRoot"
            assert sc.get("readOnlyRootFilesystem") is True, f"{where}/{c['name']}: readOnlyRootFilesystem"
            assert sc.get("allowPrivilegeEscalation") is False, f"{where}/{c['name']}: allowPrivilegeEscalation"
            assert sc.get("privileged") is not True
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}/{c['name']}: capabilities"
            assert "/tmp" in {m["mountPath"] for m in c.get("volumeMounts", [])}, f"{where}/{c['name']}: writable /tmp"
            seen += 1
    assert seen >= (2 if overlay == "base" else 1)


@cache
def _cli_options() -> dict[str, set[str]]:
    import typer

    from llmd_timeslice.cli import app

    group = typer.main.get_command(app)
    return {name: {o for p in cmd.params for o in getattr(p, "opts", [])} for name, cmd in group.commands.items()}


@pytest.mark.parametrize("overlay", ["base", "modelserver/example"])
def test_container_args_are_real_cli_flags_and_probes_match_ports(overlay):
    opts = _cli_options()
    for d, spec in _pod_specs(built(overlay)):
        for c in _ours(spec):
            assert c["command"] == ["llmd-timeslice"]
            sub, *flags = c["args"]
            assert sub in opts, f"unknown subcommand {sub}"
            values = {}
            for f in flags:
                name, _, value = f.partition("=")
                assert name in opts[sub], f"{d['metadata']['name']}/{c['name']}: `llmd-timeslice {sub}` has no {name}"
                values[name] = value
            assert values.get("--host") == "0.0.0.0", "bind all interfaces: probes and peers use the pod IP"
            assert values.get("--token-file", "").startswith("/var/run/secrets/llmd-timeslice/")
            ports = {p["containerPort"] for p in c["ports"]}
            grpc_port = int(values.get("--ext-proc-port") or values.get("--port"))
            assert int(values["--metrics-port"]) in ports and grpc_port in ports
            for probe in ("readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"]["port"] == grpc_port, f"{c['name']} {probe} must use the native gRPC probe"


def test_gate_and_orchestrator_settings_agree():
    docs = built("base")
    gate = find(docs, "Deployment", "llmd-timeslice-gate")["spec"]["template"]["spec"]["containers"][0]
    args = dict(a.partition("=")[::2] for a in gate["args"][1:])
    assert args["--pool"] == args["--default-pool"] == S.pool
    assert float(args["--max-hold-s"]) == S.max_hold_s
    assert int(args["--ext-proc-port"]) == S.gate_ext_proc_port
    orch_host, orch_port = args["--orchestrator"].split(":")
    orch = find(docs, "Service", orch_host)
    assert int(orch_port) in {p["port"] for p in orch["spec"]["ports"]}
    assert gate["readinessProbe"]["grpc"]["service"] == gen.GATE_READINESS_SERVICE
    assert find(docs, "Service", S.gate_headless_service)["spec"]["clusterIP"] == "None"
    assert find(docs, "Service", S.gate_service)["spec"]["ports"][0]["port"] == S.gate_ext_proc_port


def test_orchestrator_discovers_pods_and_fallback_manages_the_serving_label():
    orch = find(built("base"), "Deployment", "llmd-timeslice-orchestrator")
    args = orch["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--discovery=kubernetes" in args and "--namespace=$(POD_NAMESPACE)" in args
    assert "--manage-serving-label" not in args, "only the label fallback writes pod labels"
    fb = find(built("gateways/label-fallback"), "Deployment", "llmd-timeslice-orchestrator")
    assert "--manage-serving-label" in fb["spec"]["template"]["spec"]["containers"][0]["args"]


STATE_RULES = [
    {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["llmd-timeslice-orchestrator-state"],
     "verbs": ["get", "update"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
]


def test_orchestrator_rbac_is_limited_to_pods_and_its_state_configmap():
    base_role = find(built("base"), "Role", "llmd-timeslice-orchestrator")
    assert base_role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                                  *STATE_RULES]
    orch = find(built("base"), "Deployment", "llmd-timeslice-orchestrator")
    assert "--state-configmap=llmd-timeslice-orchestrator-state" in orch["spec"]["template"]["spec"]["containers"][0]["args"]
    fallback = find(built("gateways/label-fallback"), "Role", "llmd-timeslice-orchestrator")
    pod_rules = [r for r in fallback["rules"] if r not in STATE_RULES]
    assert {v for r in pod_rules for v in r["verbs"]} == {"get", "list", "watch", "patch"}
    assert all(r["resources"] == ["pods"] and r["apiGroups"] == [""] for r in pod_rules)
    kinds = {d["kind"] for o in OVERLAYS for d in built(o)}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}


# ------------------------------------------------------------------------ the sidecar patch


def test_sidecar_patch_adds_sleep_mode_and_the_snapshot_sidecar():
    docs = built("modelserver/example")
    dep = find(docs, "Deployment", "vllm-sampler")
    tpl = dep["spec"]["template"]
    containers = {c["name"]: c for c in tpl["spec"]["containers"]}
    vllm = containers["vllm"]
    assert "--enable-sleep-mode" in vllm["args"]
    assert vllm["args"][:2] == ["Qwen/Qwen3-0.6B", "--port=8000"], "the patch appends, it must not replace args"
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in vllm["env"]
    side = containers["timeslice-sidecar"]
    args = dict(a.partition("=")[::2] for a in side["args"][1:])
    assert args["--engine-url"] == "http://127.0.0.1:8000" and args["--port"] == "9001"
    assert args["--job-id"] == "$(POD_NAME)"
    assert {p["name"]: p["containerPort"] for p in side["ports"]} == {"ts-grpc": 9001, "ts-metrics": 9095}
    assert side["readinessProbe"]["grpc"]["port"] == side["livenessProbe"]["grpc"]["port"] == 9001
    assert tpl["metadata"]["labels"]["timeslice.io/serving"] == "true"
    assert tpl["metadata"]["labels"]["timeslice.io/role"] == "sampler"
    vols = {v["name"] for v in tpl["spec"]["volumes"]}
    assert {"llmd-timeslice-token", "llmd-timeslice-tmp"} <= vols

    job = find(docs, "Job", "grpo-trainer")
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in trainer["env"]}
    assert env["TIMESLICE_ORCH_ADDR"]["value"] == "llmd-timeslice-orchestrator:50051"
    assert env["TIMESLICE_TRAINER_GROUP"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['timeslice.io/group']"
    assert env["LLMD_TIMESLICE_TOKEN_FILE"]["value"].startswith("/var/run/secrets/llmd-timeslice/")


def test_podmonitor_selects_the_sidecar_metrics_port():
    pm = find(built("base"), "PodMonitor")
    tpl = find(built("modelserver/example"), "Deployment", "vllm-sampler")["spec"]["template"]
    sel = pm["spec"]["selector"]["matchLabels"]
    assert all(tpl["metadata"]["labels"].get(k) == v for k, v in sel.items())
    ports = {p["name"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] in ports


# ------------------------------------------------ gate filter order + metadata forwarding


def _expected_gate(cluster: str) -> dict:
    g = gate_filter(cluster, S.pool, S.max_hold_s, failure_mode_allow=False)
    g["name"] = gen.GATE_FILTER_NAME
    return g


def _assert_gate_contract(gate: dict) -> None:
    tc = gate["typed_config"]
    pm = tc["processing_mode"]
    assert (pm["request_header_mode"], pm["response_header_mode"], pm["response_trailer_mode"]) == ("SEND",) * 3
    assert pm.get("request_body_mode", "NONE") == pm.get("response_body_mode", "NONE") == "NONE"
    assert tc["failure_mode_allow"] is False
    assert _seconds(tc["message_timeout"]) > S.max_hold_s
    assert _seconds(tc["max_message_timeout"]) == 3600
    assert SUBSET_NS in tc["metadata_options"]["receiving_namespaces"]["untyped"]
    assert protocol.UPSTREAM_ADDRESS_ATTRIBUTE in tc["response_attributes"]


def _hcm_filters(bootstrap: dict, listener: str) -> tuple[dict, list[dict]]:
    lis = next(x for x in bootstrap["static_resources"]["listeners"] if x["name"] == listener)
    hcm = lis["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm, hcm["http_filters"]


def _names(filters):
    return [f["name"] for f in filters]


def test_standalone_envoy_orders_gate_before_epp_and_forwards_the_hint():
    boot = yaml.safe_load((GUIDE / "router" / "standalone-envoy.yaml").read_text())
    hcm, filters = _hcm_filters(boot, "vllm")
    assert _names(filters) == [gen.GATE_FILTER_NAME, gen.EPP_FILTER_NAME, "envoy.filters.http.router"]
    gate, epp = filters[0], filters[1]
    assert gate == _expected_gate("llmd_timeslice_gate")
    _assert_gate_contract(gate)
    epp_md = epp["typed_config"]["metadata_options"]
    assert SUBSET_NS in epp_md["forwarding_namespaces"]["untyped"]
    assert epp["typed_config"]["failure_mode_allow"] is False
    assert _seconds(hcm["stream_idle_timeout"]) > S.max_hold_s
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    gate_cluster = clusters["llmd_timeslice_gate"]
    assert gate_cluster["circuit_breakers"]["thresholds"][0]["max_requests"] >= BIG
    addr = gate_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert addr["address"] == f"{S.gate_headless_service}.{S.namespace}.svc.cluster.local"
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[0]["match"] == {"prefix": "/v1/"}, "only the OpenAI API reaches the model servers"
    assert routes[-1]["direct_response"]["status"] == 404

    values = yaml.safe_load((GUIDE / "router" / "values-standalone.yaml").read_text())
    router = values["router"]
    assert yaml.safe_load(router["proxy"]["configMap"]["data"]["envoy.yaml"]) == boot
    assert router["proxy"]["failOpen"] is False
    assert router["inferencePool"]["failureMode"] == "FailClose"
    assert router["epp"]["flags"]["secure-serving"] is False, "plaintext EPP: the bootstrap has no TLS to it"
    epp_cfg_file = router["epp"]["pluginsConfigFile"]
    _check_endpoint_picker_config(yaml.safe_load(router["epp"]["pluginsCustomConfig"][epp_cfg_file]))


def _istio_patches():
    return find(built("gateways/istio"), "EnvoyFilter")["spec"]["configPatches"]


def test_istio_inserts_the_gate_before_the_epp_and_merges_forwarding():
    insert, merge, hcm_merge = _istio_patches()
    assert insert["patch"]["operation"] == "INSERT_BEFORE"
    assert insert["match"]["context"] == "GATEWAY"
    assert insert["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == gen.EPP_FILTER_NAME
    gate = insert["patch"]["value"]
    assert gate == _expected_gate(f"outbound|{S.gate_ext_proc_port}||{S.gate_fqdn}")
    _assert_gate_contract(gate)
    assert merge["patch"]["operation"] == "MERGE"
    md = merge["patch"]["value"]["typed_config"]["metadata_options"]
    assert md["forwarding_namespaces"]["untyped"] == [SUBSET_NS]
    assert _seconds(hcm_merge["patch"]["value"]["typed_config"]["stream_idle_timeout"]) > S.max_hold_s
    dr = find(built("gateways/istio"), "DestinationRule")
    assert dr["spec"]["host"] == S.gate_fqdn
    assert dr["spec"]["trafficPolicy"]["connectionPool"]["http"]["http2MaxRequests"] >= BIG


def _eg_docs():
    return built("gateways/envoy-gateway")


def test_envoy_gateway_chains_gate_then_epp_with_forwarding():
    docs = _eg_docs()
    eep = find(docs, "EnvoyExtensionPolicy")
    gate, epp = eep["spec"]["extProc"]
    assert gate["backendRefs"] == [{"name": S.gate_service, "port": S.gate_ext_proc_port}]
    assert gate["failOpen"] is False and epp["failOpen"] is False
    assert _seconds(gate["messageTimeout"]) > S.max_hold_s
    assert gate["processingMode"]["request"] == {}, "headers only"
    assert "body" not in gate["processingMode"]["response"]
    assert protocol.UPSTREAM_ADDRESS_ATTRIBUTE in gate["processingMode"]["response"]["attributes"]
    assert gate["metadata"]["writableNamespaces"] == [SUBSET_NS]
    assert SUBSET_NS in epp["metadata"]["accessibleNamespaces"]
    assert gate["backendSettings"]["circuitBreaker"]["maxParallelRequests"] >= BIG
    route = find(docs, "HTTPRoute")
    assert eep["spec"]["targetRefs"][0]["name"] == route["metadata"]["name"]
    assert _seconds(route["spec"]["rules"][0]["timeouts"]["request"]) > S.max_hold_s
    btp = find(docs, "BackendTrafficPolicy")
    assert btp["spec"]["loadBalancer"]["endpointOverride"]["extractFrom"] == [{"header": protocol.DESTINATION_HEADER}]
    ctp = find(docs, "ClientTrafficPolicy")
    assert _seconds(ctp["spec"]["timeout"]["http"]["streamIdleTimeout"]) > S.max_hold_s
    # The patch policy completes exactly the filter Envoy Gateway generates for extProc[0].
    gate_filter_name = (f"envoy.filters.http.ext_proc/envoyextensionpolicy/{eep['metadata']['namespace']}/"
                        f"{eep['metadata']['name']}/extproc/0")
    patches = find(docs, "EnvoyPatchPolicy")["spec"]["jsonPatches"]
    for p in patches:
        assert f"@.name=='{gate_filter_name}'" in p["operation"]["jsonPath"]
        assert p["name"].startswith(f"{S.namespace}/{S.gateway}/")
    assert {(p["operation"]["path"], p["operation"]["value"]) for p in patches} == {
        ("response_trailer_mode", "SEND"), ("max_message_timeout", "3600s")}


def test_kgateway_gate_fails_closed_and_keeps_the_stream():
    docs = built("gateways/kgateway")
    ext = find(docs, "GatewayExtension")["spec"]["extProc"]
    assert "failOpen" in ext and ext["failOpen"] is False, "kgateway defaults failOpen to true: it must be set"
    pm = ext["processingMode"]
    assert (pm["requestHeaderMode"], pm["responseHeaderMode"], pm["responseTrailerMode"]) == ("SEND",) * 3
    assert pm["requestBodyMode"] == pm["responseBodyMode"] == "NONE"
    assert _seconds(ext["messageTimeout"]) > S.max_hold_s and _seconds(ext["maxMessageTimeout"]) == 3600
    assert ext["grpcService"]["backendRef"] == {"name": S.gate_service, "port": S.gate_ext_proc_port}
    tp = find(docs, "TrafficPolicy")
    assert tp["spec"]["extProc"]["extensionRef"]["name"] == find(docs, "GatewayExtension")["metadata"]["name"]
    assert all(_seconds(v) > S.max_hold_s for v in tp["spec"]["timeouts"].values())
    assert find(docs, "BackendConfigPolicy")["spec"]["circuitBreakers"]["maxRequests"] >= BIG
    # No receiving namespaces in kgateway's API: the hint cannot reach the EPP, so the variant
    # is documented together with the label fallback that steers instead.
    text = (GUIDE / "gateways" / "kgateway" / "kustomization.yaml").read_text() + (GUIDE / "README.md").read_text()
    assert "label-fallback" in text and "receiving" in text


# ------------------------------------------------ EndpointPickerConfig (label fallback)

_EPC_TOP = {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "dataLayer", "flowControl",
            "requestHandler", "saturationDetector", "parser"}
_EPC_FLOW = {"maxBytes", "maxRequests", "defaultRequestTTL", "noEndpointRequestTTL", "defaultPriorityBand",
             "defaultNegativePriorityBand", "priorityBands", "usageLimitPolicyPluginRef", "saturationDetector",
             "enableEviction"}


def _check_endpoint_picker_config(cfg: dict) -> None:
    """Fields of llm-d-router's apix/config/v1alpha1 EndpointPickerConfig (the EPP rejects others)."""
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
    assert set(cfg.get("flowControl", {})) <= _EPC_FLOW


def test_label_fallback_excludes_sleeping_pods_and_holds_in_flow_control():
    values = yaml.safe_load((GUIDE / "gateways" / "label-fallback" / "values-label-fallback.yaml").read_text())
    router = values["router"]
    cfg = yaml.safe_load(router["epp"]["pluginsCustomConfig"][router["epp"]["pluginsConfigFile"]])
    _check_endpoint_picker_config(cfg)
    (flt,) = [p for p in cfg["plugins"] if p["type"] == "label-selector-filter"]
    # parameters are a metav1.LabelSelector
    assert set(flt["parameters"]) <= {"matchLabels", "matchExpressions"}
    assert flt["parameters"]["matchLabels"] == {"timeslice.io/serving": "true"}
    assert flt["name"] in [r["pluginRef"] for r in cfg["schedulingProfiles"][0]["plugins"]]
    # Holding needs the sleeping pods OUT of the pool (flow control's empty-pool wait) ...
    assert "flowControl" in cfg["featureGates"]
    assert _seconds(cfg["flowControl"]["noEndpointRequestTTL"]) >= S.max_hold_s
    assert router["modelServers"]["matchLabels"]["timeslice.io/serving"] == "true"
    assert router["inferencePool"]["failureMode"] == "FailClose"
    assert _seconds(values["httpRoute"]["requestTimeout"]) > _seconds(cfg["flowControl"]["noEndpointRequestTTL"])
    # ... and the pods must start with the label the selector wants.
    tpl = find(built("modelserver/example"), "Deployment", "vllm-sampler")["spec"]["template"]
    assert tpl["metadata"]["labels"]["timeslice.io/serving"] == "true"


# ------------------------------------------------------------- every Envoy config, validated


def _bootstrap_with_chain(filters: list[dict], clusters: list[str], stream_idle: str) -> dict:
    """A gateway-like bootstrap around ``filters`` (the chain a variant produces), for validation."""
    def cluster(name, port):
        return {
            "name": name, "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": gen._http2_options(),
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]},
        }
    hcm = {
        "@type": HCM_TYPE, "stat_prefix": "gw", "stream_idle_timeout": stream_idle,
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/v1/"}, "route": {"cluster": "original_destination_cluster"}}]}]},
        "http_filters": [*filters, {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}}],
    }
    return {"static_resources": {
        "listeners": [{"name": "gw", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 18080}},
                       "filter_chains": [{"filters": [
                           {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}],
        "clusters": [*(cluster(n, 19002 + i) for i, n in enumerate(clusters)), {
            "name": "original_destination_cluster", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "1s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": protocol.DESTINATION_HEADER}}],
    }}


def _merge(dst: dict, src: dict) -> None:
    """Proto MERGE semantics as Istio applies them: maps merge, repeated fields append."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        elif isinstance(v, list) and isinstance(dst.get(k), list):
            dst[k] = dst[k] + v
        else:
            dst[k] = v


def istio_effective_config() -> dict:
    """Istio's gateway chain for an InferencePool backend (pilot BuildInferencePoolExtProcFilter:
    forwards/receives envoy.lb only) with the guide's EnvoyFilter patches applied."""
    epp_cluster = "outbound|9002||sampler-pool-epp.llm-d-timeslice.svc.cluster.local"
    istio_epp = {"name": gen.EPP_FILTER_NAME, "typed_config": {
        "@type": EXT_PROC_TYPE, "grpc_service": {"envoy_grpc": {"cluster_name": epp_cluster}, "timeout": "10s"},
        "failure_mode_allow": False,
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
                            "request_trailer_mode": "SEND", "response_header_mode": "SEND",
                            "response_body_mode": "FULL_DUPLEX_STREAMED", "response_trailer_mode": "SEND"},
        "message_timeout": "1000s",
        "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]},
                             "forwarding_namespaces": {"untyped": ["envoy.lb"]}}}}
    filters = [istio_epp]
    insert, merge, hcm_merge = _istio_patches()
    filters.insert(0, copy.deepcopy(insert["patch"]["value"]))
    _merge(filters[1], copy.deepcopy(merge["patch"]["value"]))
    boot = _bootstrap_with_chain(filters, [insert["patch"]["value"]["typed_config"]["grpc_service"]["envoy_grpc"]
                                           ["cluster_name"], epp_cluster], "300s")
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    _merge(hcm, {k: v for k, v in hcm_merge["patch"]["value"]["typed_config"].items() if k != "@type"})
    return boot


def _eg_ext_proc(ep: dict, name: str, cluster: str) -> dict:
    """Envoy Gateway's translation of one EnvoyExtensionPolicy extProc (internal/xds/translator/extproc.go)."""
    modes = {"Streamed": "STREAMED", "Buffered": "BUFFERED", "BufferedPartial": "BUFFERED_PARTIAL",
             "FullDuplexStreamed": "FULL_DUPLEX_STREAMED"}
    pm = {"request_header_mode": "SKIP", "response_header_mode": "SKIP", "request_body_mode": "NONE",
          "response_body_mode": "NONE", "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}
    cfg = {"@type": EXT_PROC_TYPE, "grpc_service": {"envoy_grpc": {"cluster_name": cluster}, "timeout": "10s"}}
    req, resp = ep["processingMode"].get("request"), ep["processingMode"].get("response")
    if req is not None:
        pm["request_header_mode"] = "SEND"
        if "body" in req:
            pm["request_body_mode"] = modes[req["body"]]
            if pm["request_body_mode"] == "FULL_DUPLEX_STREAMED":
                pm["request_trailer_mode"] = "SEND"
    if resp is not None:
        pm["response_header_mode"] = "SEND"
        if "body" in resp:
            pm["response_body_mode"] = modes[resp["body"]]
            if pm["response_body_mode"] == "FULL_DUPLEX_STREAMED":
                pm["response_trailer_mode"] = "SEND"
        if resp.get("attributes"):
            cfg["response_attributes"] = list(resp["attributes"])
    cfg["processing_mode"] = pm
    cfg["failure_mode_allow"] = ep.get("failOpen", False)
    cfg["message_timeout"] = ep["messageTimeout"]
    md = ep.get("metadata", {})
    if md:
        cfg["metadata_options"] = {}
        if "accessibleNamespaces" in md:
            cfg["metadata_options"]["forwarding_namespaces"] = {"untyped": md["accessibleNamespaces"]}
        if "writableNamespaces" in md:
            cfg["metadata_options"]["receiving_namespaces"] = {"untyped": md["writableNamespaces"]}
    return {"name": name, "typed_config": cfg}


def envoy_gateway_effective_config() -> tuple[dict, dict]:
    """The chain Envoy Gateway generates from the guide's policies, with its EnvoyPatchPolicy applied."""
    docs = _eg_docs()
    eep = find(docs, "EnvoyExtensionPolicy")
    ns, pol = eep["metadata"]["namespace"], eep["metadata"]["name"]
    filters, clusters = [], []
    for i, ep in enumerate(eep["spec"]["extProc"]):
        name = f"envoy.filters.http.ext_proc/envoyextensionpolicy/{ns}/{pol}/extproc/{i}"
        cluster = f"envoyextensionpolicy/{ns}/{pol}/extproc/{i}"
        filters.append(_eg_ext_proc(ep, name, cluster))
        clusters.append(cluster)
    for p in find(docs, "EnvoyPatchPolicy")["spec"]["jsonPatches"]:
        op = p["operation"]
        m = re.fullmatch(r"\.\.http_filters\[\?\(@\.name=='([^']+)'\)\]((?:\.\w+)*)", op["jsonPath"])
        assert m and op["op"] == "add", op
        (target,) = [f for f in filters if f["name"] == m[1]]
        node = target
        for part in m[2].strip(".").split("."):
            node = node[part]
        node[op["path"]] = op["value"]
    idle = find(docs, "ClientTrafficPolicy")["spec"]["timeout"]["http"]["streamIdleTimeout"]
    return _bootstrap_with_chain(filters, clusters, idle), filters[0]


def kgateway_effective_gate() -> dict:
    """kgateway's buildCompositeExtProcFilter for the GatewayExtension (the wrapped ext_proc config)."""
    ext = find(built("gateways/kgateway"), "GatewayExtension")["spec"]["extProc"]
    pm = {re.sub(r"([A-Z])", r"_\1", k).lower(): v for k, v in ext["processingMode"].items()}
    cfg = {"@type": EXT_PROC_TYPE,
           "grpc_service": {"envoy_grpc": {"cluster_name": "kube_llm-d-timeslice_llmd-timeslice-gate_9002"}},
           "failure_mode_allow": ext["failOpen"], "processing_mode": pm,
           "message_timeout": ext["messageTimeout"], "max_message_timeout": ext["maxMessageTimeout"],
           "stat_prefix": ext["statPrefix"]}
    return {"name": "ext_proc/llm-d-timeslice/llmd-timeslice-gate", "typed_config": cfg}


def test_envoy_gateway_generated_gate_filter_meets_the_gate_contract():
    _, gate = envoy_gateway_effective_config()
    _assert_gate_contract(gate)


def test_every_envoy_config_passes_envoy_validate(tmp_path):
    kgw_gate = kgateway_effective_gate()
    configs = {
        "standalone": yaml.safe_load((GUIDE / "router" / "standalone-envoy.yaml").read_text()),
        "values-standalone": yaml.safe_load(yaml.safe_load((GUIDE / "router" / "values-standalone.yaml").read_text())
                                            ["router"]["proxy"]["configMap"]["data"]["envoy.yaml"]),
        "istio": istio_effective_config(),
        "envoy-gateway": envoy_gateway_effective_config()[0],
        "kgateway": _bootstrap_with_chain([kgw_gate], [kgw_gate["typed_config"]["grpc_service"]["envoy_grpc"]
                                                       ["cluster_name"]], "1210s"),
    }
    istio_names = _names(_hcm_filters(configs["istio"], "gw")[1])
    assert istio_names.index(gen.GATE_FILTER_NAME) < istio_names.index(gen.EPP_FILTER_NAME)
    epp = _hcm_filters(configs["istio"], "gw")[1][1]["typed_config"]["metadata_options"]
    assert SUBSET_NS in epp["forwarding_namespaces"]["untyped"] and "envoy.lb" in epp["forwarding_namespaces"]["untyped"]
    envoy_validate_all(configs, tmp_path)


def test_envoy_validate_rejects_a_broken_config(tmp_path):
    """The validation above is real: Envoy refuses an unknown processing mode."""
    cfg = istio_effective_config()
    _hcm_filters(cfg, "gw")[1][0]["typed_config"]["processing_mode"]["response_trailer_mode"] = "SENDING"
    with pytest.raises(AssertionError, match="envoy --mode validate rejected"):
        envoy_validate_all({"broken": cfg}, tmp_path)
