"""The Istio fast path: the gate beside each Envoy of the Gateway (authz, hint, EPP order; the gate container folded
into the Gateway's parameters ConfigMap as Istio's strategic merge applies it, its probes run against a real gate)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmd_timeslice import protocol
from llmd_timeslice.router.envoy_config import (
    SUBSET_HINT_FILTER_NAME,
    gate_access_log,
    gate_upstream_log,
    refusal_local_reply,
    subset_hint_filter,
)
from tests.manifests.support import (
    BIG,
    FIXTURE,
    GUIDE,
    MANIFESTS,
    REPO,
    SUBSET_NS,
    S,
    _cli_options,
    _hcm_filters,
    _hold_plus_generation,
    _names,
    _readable_by,
    _seconds,
    built,
    envoy_validate_all,
    find,
    gen,
    istio_effective_config,
    validate_builtin,
)

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
