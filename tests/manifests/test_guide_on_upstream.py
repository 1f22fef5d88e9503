"""Our guide on top of an unmodified llm-d guide (``tests/fixtures/llm-d-guide``): the sampler component on an
upstream-shaped Deployment, our router values layered on the guide's, the Gateway's name everywhere, one settings file
for every name (issue 14 defects 1, 3 to 6)."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tests.manifests.support import (
    CRD_GROUPS,
    FIXTURE,
    GATEWAYS,
    OVERLAYS,
    S,
    _args,
    _fixture_values,
    _group,
    built,
    find,
    gen,
    helm_coalesce,
    kustomize,
    validate_builtin,
    validate_custom,
    values,
)

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


# ------------------------------------ defects 3, 6: router values layered on the guide's own


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
