"""Extract the OpenAPI v3 schemas of the custom resources the guide uses, for offline validation.

kubernetes-validate ships schemas for built-in kinds only (its 1.34+ schemas include
``resource.k8s.io/v1`` ResourceClaim, so that one is not vendored). The gateway variants and the
monitoring objects are custom resources, so the tests validate them against the real CRD schemas
published by each project, vendored here: descriptions stripped to keep them small; everything
else, including ``required``, enums, patterns and CEL rules, kept. ``SOURCES`` records, per API
group, the repository, the tag the guide pins, its commit and the file each schema comes from.

Usage::

    # from local git mirrors of the source repositories (<mirrors>/<owner>+<name>/repo, bare or not):
    python manifests/crd-schemas/extract.py --mirrors /work/.mirror
    # or from CRD YAML files at hand:
    python manifests/crd-schemas/extract.py CRD.yaml [CRD.yaml ...]

writes ``<group>_<kind>_<version>.json`` next to this file for every (group, kind, version) in
``WANTED``. Files that are templated (Helm ``{{ ... }}`` lines) are read with those lines dropped.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Source:
    repo: str
    tag: str
    commit: str
    paths: tuple[str, ...]

    def describe(self, path: str) -> str:
        return f"{self.repo} {self.tag} @ {self.commit[:12]}, {path}"


SOURCES: dict[str, Source] = {
    "inference.networking.k8s.io": Source(
        "kubernetes-sigs/gateway-api-inference-extension",
        "v1.5.0",
        "9cd2896dd6c1f6e79be4098e5a55ae0a01119e44",
        ("config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",),
    ),
    "gateway.networking.k8s.io": Source(
        "kubernetes-sigs/gateway-api",
        "v1.5.1",
        "e7677b70ae75d14a4448fba94870e7deea6cf0ad",
        (
            "config/crd/standard/gateway.networking.k8s.io_httproutes.yaml",
            "config/crd/standard/gateway.networking.k8s.io_gateways.yaml",
        ),
    ),
    "gateway.envoyproxy.io": Source(
        "envoyproxy/gateway",
        "v1.9.0",
        "3cfc0df171ec89945cefdebc939e5cabcab55b7d",
        tuple(
            f"charts/gateway-crds-helm/templates/generated/gateway.envoyproxy.io_{n}.yaml"
            for n in (
                "envoyextensionpolicies",
                "envoypatchpolicies",
                "backendtrafficpolicies",
                "clienttrafficpolicies",
                "backends",
            )
        ),
    ),
    "networking.istio.io": Source(
        "istio/istio", "1.29.2", "5c9e58b03ec3dd5ae1c87dba463d7388e0792fb8", ("manifests/charts/base/files/crd-all.gen.yaml",)
    ),
    "agentgateway.dev": Source(
        "agentgateway/agentgateway",
        "v1.1.0",
        "d204f9ce1ac785d4b23145cce64c4a34a5c540c9",
        ("controller/install/helm/agentgateway-crds/templates/agentgateway.dev_agentgatewaypolicies.yaml",),
    ),
    "monitoring.coreos.com": Source(
        "prometheus-operator/prometheus-operator",
        "v0.93.0+24",
        "6adcebc5076c",
        (
            "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml",
            "example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml",
            "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml",
        ),
    ),
}

WANTED = {
    ("inference.networking.k8s.io", "InferencePool", "v1"),
    ("gateway.networking.k8s.io", "HTTPRoute", "v1"),
    ("gateway.networking.k8s.io", "Gateway", "v1"),
    ("gateway.envoyproxy.io", "EnvoyExtensionPolicy", "v1alpha1"),
    ("gateway.envoyproxy.io", "EnvoyPatchPolicy", "v1alpha1"),
    ("gateway.envoyproxy.io", "BackendTrafficPolicy", "v1alpha1"),
    ("gateway.envoyproxy.io", "ClientTrafficPolicy", "v1alpha1"),
    ("gateway.envoyproxy.io", "Backend", "v1alpha1"),
    ("networking.istio.io", "EnvoyFilter", "v1alpha3"),
    ("networking.istio.io", "DestinationRule", "v1"),
    ("agentgateway.dev", "AgentgatewayPolicy", "v1alpha1"),
    ("monitoring.coreos.com", "ServiceMonitor", "v1"),
    ("monitoring.coreos.com", "PodMonitor", "v1"),
    ("monitoring.coreos.com", "PrometheusRule", "v1"),
}


def _strip(node):
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def _docs(text: str):
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("{{"))
    return [d for d in yaml.safe_load_all(text) if d]


def _write(docs, origin: str, found: set) -> None:
    for doc in docs:
        if doc.get("kind") != "CustomResourceDefinition":
            continue
        group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
        for ver in doc["spec"]["versions"]:
            key = (group, kind, ver["name"])
            if key not in WANTED:
                continue
            schema = _strip(ver["schema"]["openAPIV3Schema"])
            out = HERE / f"{group}_{kind}_{ver['name']}.json"
            out.write_text(json.dumps({"source": origin, "schema": schema}, sort_keys=True, separators=(",", ":")) + "\n")
            found.add(key)
            print(f"wrote {out.name} ({out.stat().st_size} bytes) from {origin}")


def from_mirrors(mirrors: Path, found: set) -> None:
    for group, src in SOURCES.items():
        git_dir = mirrors / src.repo.replace("/", "+") / "repo"
        if not git_dir.exists():
            print(f"skipped {group}: no mirror at {git_dir} (the vendored files are kept)")
            continue
        for path in src.paths:
            text = subprocess.run(
                ["git", "--git-dir", str(git_dir), "show", f"{src.commit}:{path}"], capture_output=True, text=True, check=True
            ).stdout
            _write(_docs(text), src.describe(path), found)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirrors", type=Path, help="folder of git mirrors (<owner>+<name>/repo)")
    parser.add_argument("files", nargs="*", type=Path, help="CRD YAML files")
    args = parser.parse_args(argv)
    found: set = set()
    if args.mirrors:
        from_mirrors(args.mirrors, found)
    for p in args.files:
        _write(_docs(p.read_text()), str(p), found)
    missing = WANTED - found - {k for k in WANTED if (HERE / f"{k[0]}_{k[1]}_{k[2]}.json").exists()}
    if missing:
        print("not found:", sorted(missing))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
