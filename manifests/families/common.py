"""The guide's settings (``settings.yaml``), the names every manifest family shares, and the YAML helpers that write
the generated files (manifests/generate.py renders them)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from llmd_timeslice import k8s_modelserver, yaml_files
from llmd_timeslice.router.envoy_config import (
    API_PREFIX,
    lost_completion_after_s,
    route_timeout_s,
)

ROOT = Path(__file__).resolve().parents[1]
REPO = ROOT.parent
GUIDE = ROOT / "guides" / "time-slicing"
SETTINGS_FILE = GUIDE / "settings.yaml"

# --------------------------------------------------------------------------------------- settings


# Upstream facts the defaults follow (cited in the guide's README):
#   llm-d/llm-d guides/optimized-baseline (GUIDE_NAME, NAMESPACE=llm-d-<guide>, release and InferencePool
#   named after the guide, model servers labelled llm-d.ai/guide=<guide>, Gateway llm-d-inference-gateway).
@dataclass(frozen=True)
class GuideSettings:
    """Names and limits every file of the guide agrees on (``settings.yaml``; the tests check each use)."""

    guide: str = "optimized-baseline"
    """``GUIDE_NAME`` of the llm-d guide: its model servers carry ``llm-d.ai/guide: <guide>``."""
    namespace: str = "llm-d-optimized-baseline"
    """``NAMESPACE`` of the guide: the router release, the model servers, the Gateway and this guide."""
    gateway: str = "llm-d-inference-gateway"
    """The Gateway (gateway mode; the llm-d gateway recipes name it so)."""
    gateway_listener: str = "http"
    """Envoy Gateway only: the Gateway listener serving the route (its Envoy listener is <ns>/<gw>/<listener>)."""
    pool: str = "optimized-baseline"
    """InferencePool = router release name (the llm-d guides install the release as GUIDE_NAME)."""
    group: str = "rollout-0"
    """Accelerator group the samplers and the trainer take turns on (``timeslice.io/group``)."""
    accelerators: int = 1
    """Devices in the group's shared ResourceClaim (each sampler pod and the trainer get all of them)."""
    device_class: str = "gpu.nvidia.com"
    """DRA DeviceClass of the shared ResourceClaim (NVIDIA's DRA driver)."""
    image: str = "registry.invalid/llmd-timeslice:0.1.0"
    """This project's image (gate, orchestrator, sidecar): build manifests/Dockerfile, push, set it here."""
    max_hold_s: float = 600.0
    """The gate's ``--max-hold-s``: the longest a request waits while every sampler sleeps."""
    generation_timeout_s: float = 3600.0
    """The longest generation (response) a client may wait for once admitted."""

    @property
    def epp_service(self) -> str:
        return f"{self.pool}-epp"  # llm-d-router routerlib _helpers.tpl: <release>-epp

    @property
    def route(self) -> str:
        """Our HTTPRoute (only /v1/): not the chart's name, so the chart's own route (``/``) can be removed."""
        return f"{self.pool}-v1"

    @property
    def request_timeout_s(self) -> float:
        """Route and stream-idle timeouts: a held request (no bytes) then the longest generation, plus margin."""
        return route_timeout_s(self.max_hold_s, self.generation_timeout_s)

    @property
    def lost_completion_after_s(self) -> float:
        """The gate's ``--lost-completion-after-s`` on the fast path: above every route timeout."""
        return lost_completion_after_s(self.request_timeout_s)

    @property
    def gate_fqdn(self) -> str:
        return f"{GATE_SERVICE}.{self.namespace}.svc.cluster.local"

    def image_name_tag(self) -> tuple[str, str]:
        name, _, tag = self.image.rpartition(":")
        if not name or "/" in tag:
            return self.image, "latest"
        return name, tag


GATE_SERVICE = "llmd-timeslice-gate"
GATE_HEADLESS_SERVICE = "llmd-timeslice-gate-headless"
GATE_EXT_PROC_PORT = 9002
GATE_AUTHZ_PORT = 9005
GATE_CONTROL_PORT = 9003
GATE_METRICS_PORT = 9094
ORCHESTRATOR_ADDRESS = "llmd-timeslice-orchestrator:50051"  # base/orchestrator: Service in the same namespace
TOKEN_SECRET = k8s_modelserver.TOKEN_SECRET
TOKEN_DIR = k8s_modelserver.TOKEN_DIR
LOOPBACK = "127.0.0.1"
GATE_CONTAINER = "timeslice-gate"
"""The gate beside an Envoy (fast path): a container in the Envoy's pod, on loopback."""
LOCAL_AUTHZ_CLUSTER = "llmd_timeslice_gate_authz"
LOCAL_GATE_CLUSTER = "llmd_timeslice_gate_local"
EPP_PORT = 9002  # llm-d-router routerlib values.yaml router.epp.extProcPort
ENGINE_PORT = 8000  # routerlib values.yaml router.modelServers.targetPorts
IMAGE_PLACEHOLDER = "llmd-timeslice"
"""The image name the static manifests use; each kustomization's ``images:`` sets the real one."""
SAMPLER_TARGET_KIND = "Deployment"
ROUTE_RULE_INDEX = 0

GATE_FILTER_NAME = "envoy.filters.http.ext_proc.timeslice_gate"
EPP_FILTER_NAME = "envoy.filters.http.ext_proc"  # the name the llm-d chart and Istio give the EPP's filter
GATE_READINESS_SERVICE = "llmd_timeslice.v1alpha1.GateReadiness"
RELEASE_NAME = "{{ .Release.Name }}"
RELEASE_NAMESPACE = "{{ .Release.Namespace }}"

HEADER = (
    "# GENERATED by manifests/generate.py from settings.yaml: do not edit by hand.\n"
    "# Change manifests/guides/time-slicing/settings.yaml, then run: python3 manifests/generate.py\n"
)


def load_settings(path: Path = SETTINGS_FILE) -> GuideSettings:
    """Read ``settings.yaml``. Raises ValueError naming an unknown key or a bad value."""
    try:
        data = yaml_files.load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: {yaml_files.error_text(exc)}") from None
    known = {f.name: f for f in fields(GuideSettings)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; known: {sorted(known)}")
    values = {}
    for k, v in data.items():
        kind = type(getattr(GuideSettings, k))
        if kind is float and isinstance(v, int):
            v = float(v)
        if not isinstance(v, kind) or (kind is str and not v):
            raise ValueError(f"{path}: {k} must be a non-empty {kind.__name__}, got {v!r}")
        values[k] = v
    s = GuideSettings(**values)
    if s.max_hold_s + 10 > 3600:
        raise ValueError(f"{path}: max_hold_s must be at most 3590 (Envoy caps ext_proc message timeouts at 3600 s)")
    return s


def _dur(seconds: float) -> str:
    return f"{seconds:g}s"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (inline patches) as literal blocks, so the generated files read like hand-written ones;
    no YAML anchors for shared sub-objects (each place gets its own copy)."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def _dump(data) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)


def _doc(comment: str, *docs: dict) -> str:
    lines = "".join(f"# {line}\n" if line else "#\n" for line in comment.strip("\n").splitlines())
    return HEADER + lines + "---\n".join(_dump(d) for d in docs)


def _indent(text: str, n: int) -> str:
    pad = " " * n
    return "".join(pad + line if line.strip() else line for line in text.splitlines(keepends=True))


def _images(s: GuideSettings) -> list[dict]:
    name, tag = s.image_name_tag()
    return [{"name": IMAGE_PLACEHOLDER, "newName": name, "newTag": tag}]


def _kustomization(**fields_) -> dict:
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", **fields_}


def _component(**fields_) -> dict:
    return {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component", **fields_}


def _json_patch(ops: list[dict]) -> str:
    return _dump(ops)


def _add_args(*args: str) -> str:
    return _json_patch([{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": a} for a in args])


# ------------------------------------------------------------------------------ Gateway API route


def httproute(s: GuideSettings, backend: dict) -> dict:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": s.route, "labels": {"app.kubernetes.io/part-of": "llmd-timeslice"}},
        "spec": {
            "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": s.gateway}],
            "rules": [
                {
                    # Only the OpenAI API: vLLM's dev endpoints (VLLM_SERVER_DEV_MODE=1) stay unreachable.
                    "matches": [{"path": {"type": "PathPrefix", "value": API_PREFIX}}],
                    "backendRefs": [backend],
                    "timeouts": {"request": _dur(s.request_timeout_s)},
                }
            ],
        },
    }


def _inference_pool_ref(s: GuideSettings) -> dict:
    return {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": s.pool}
