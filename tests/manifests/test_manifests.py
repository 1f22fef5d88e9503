"""The Kubernetes guide under manifests/: it builds, validates, fits today's llm-d, and keeps the gate's contract.

Real tools only: ``kubectl kustomize`` builds every overlay, kubernetes-validate checks built-in kinds
strictly against the Kubernetes 1.34 schemas (``resource.k8s.io/v1`` ResourceClaim included), the vendored
upstream CRD schemas (manifests/crd-schemas, sources in extract.py) check the custom resources, and the
real Envoy binary (``envoy --mode validate``) checks every Envoy configuration a variant produces. A
missing tool is a failure, never a skip.

The llm-d side is ``tests/fixtures/llm-d-guide``: a guide's model-server overlay and router values written
in the shape of the upstream ones, so "our components fit an unmodified guide" is built, not assumed.
Each defect of issue 14 has a test in this folder named after what it checks; the helpers they share are in support.py.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys

import pytest
import yaml

from tests.manifests.support import (
    CRD_GROUPS,
    CRD_SCHEMAS,
    GUIDE,
    MANIFESTS,
    OVERLAYS,
    REPO,
    SUBSET_NS,
    S,
    _group,
    built,
    crd_validator,
    find,
    gen,
    kustomize,
    validate_builtin,
    validate_custom,
)

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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_builtin_kinds_validate_strictly(overlay):
    checked = 0
    for d in built(overlay):
        if _group(d["apiVersion"]) in CRD_GROUPS:
            continue
        validate_builtin(d, overlay)
        checked += 1
    assert checked or overlay == "base/monitoring", f"{overlay}: nothing validated"


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
