"""Extract the OpenAPI v3 schemas of the few CRDs the guide uses, for offline validation.

kubernetes-validate ships schemas for built-in kinds only. The gateway variants and the
monitoring objects are custom resources, so the tests validate them against the real CRD
schemas published by each project, vendored here (descriptions stripped to keep them small;
everything else, including ``required``, enums and patterns, kept). ``SOURCES`` below records
where each came from.

Usage (with the upstream CRD YAML files at hand)::

    python manifests/crd-schemas/extract.py CRD.yaml [CRD.yaml ...]

writes ``<group>_<kind>_<version>.json`` next to this file for every (CRD, version) listed in
``WANTED``. Files that are templated (Helm ``{{ ... }}`` lines) are read with those lines dropped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent

WANTED = {
    ("gateway.envoyproxy.io", "EnvoyExtensionPolicy", "v1alpha1"),
    ("gateway.envoyproxy.io", "EnvoyPatchPolicy", "v1alpha1"),
    ("gateway.envoyproxy.io", "BackendTrafficPolicy", "v1alpha1"),
    ("gateway.envoyproxy.io", "ClientTrafficPolicy", "v1alpha1"),
    ("gateway.networking.k8s.io", "HTTPRoute", "v1"),
    ("networking.istio.io", "EnvoyFilter", "v1alpha3"),
    ("networking.istio.io", "DestinationRule", "v1"),
    ("monitoring.coreos.com", "ServiceMonitor", "v1"),
    ("monitoring.coreos.com", "PodMonitor", "v1"),
}

SOURCES = {
    "gateway.envoyproxy.io": "envoyproxy/gateway @ d32f28294245 (v1.9.0+375), charts/gateway-crds-helm/templates/generated/",
    "gateway.networking.k8s.io": ("envoyproxy/gateway @ d32f28294245, "
                                  "charts/gateway-crds-helm/templates/standard-gatewayapi-crds.yaml"),
    "networking.istio.io": "istio/api @ b8f8791d9653 (1.31.0-alpha.0), kubernetes/customresourcedefinitions.gen.yaml",
    "monitoring.coreos.com": ("prometheus-operator/prometheus-operator @ 6adcebc5076c (v0.93.0+24), "
                              "example/prometheus-operator-crd/"),
}


def _strip(node):
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def _docs(path: Path):
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("{{"))
    return [d for d in yaml.safe_load_all(text) if d]


def main(paths: list[str]) -> int:
    found = set()
    for p in paths:
        for doc in _docs(Path(p)):
            if doc.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
            for ver in doc["spec"]["versions"]:
                key = (group, kind, ver["name"])
                if key not in WANTED:
                    continue
                schema = _strip(ver["schema"]["openAPIV3Schema"])
                out = HERE / f"{group}_{kind}_{ver['name']}.json"
                out.write_text(json.dumps({"source": SOURCES[group], "schema": schema}, sort_keys=True,
                                          separators=(",", ":")) + "\n")
                found.add(key)
                print(f"wrote {out.name} ({out.stat().st_size} bytes)")
    missing = WANTED - found
    if missing:
        print("not found:", sorted(missing))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
