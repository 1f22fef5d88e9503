"""Our containers in the guide: security contexts, real CLI flags and probes, names from settings, the orchestrator's
replicas and RBAC, the readable token, DRA and the image, coexistence with the upstream orchestrator, the gate's
InferenceObjective RBAC (issue 14 defects 2, 10, 11, 13; issue 26)."""

from __future__ import annotations

import pytest
import yaml

from tests.manifests.support import (
    FIXTURE,
    IMAGE,
    OVERLAYS,
    S,
    _args,
    _cli_options,
    _readable_by,
    built,
    find,
    gen,
    kustomize,
    validate_builtin,
)

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


# ------------------------------------------------------------- defect 2: the token is readable


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
