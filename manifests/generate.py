"""Render every file of the time-slicing guide that carries a name or a limit, from ``settings.yaml``.

The ONE place to set the guide name, namespace, Gateway name, pool (InferencePool) name, accelerator
group, image and limits is ``manifests/guides/time-slicing/settings.yaml``. This script writes every
file that depends on them (the kustomizations that put names on the static manifests, the Envoy
configurations, the gateway policies, the HTTPRoutes, the Helm values), so no file can disagree with
another. The gate's ext_proc filter itself is defined once, in ``llmd_timeslice.router.envoy_config.gate_filter()``,
and embedded here, so the Kubernetes variants cannot drift from what the tests run against a real Envoy.

Usage::

    python3 manifests/generate.py                 # rewrite the files from settings.yaml
    python3 manifests/generate.py --check         # exit 1 if a file differs (the tests do this too)
    python3 manifests/generate.py --settings my.yaml --out DIR
                                                  # a full copy of the guide in DIR for other names
    helm template ... | python3 manifests/generate.py --standalone-values -
                                                  # only print our standalone values: the chart's own Envoy
                                                  # config as rendered for the release, the gate patched in
    python3 manifests/generate.py --istio-parameters <llm-d>/guides/recipes/gateway/istio/configmap.yaml \
        | kubectl apply -n <namespace> -f -       # also print the Istio Gateway's parameters ConfigMap with
                                                  # the gate container folded in (none: without a recipe's)

Needs PyYAML and this repository (``epp_plugin``); nothing else.
"""

# ruff: noqa: E402  (the imports follow the sys.path line that lets this run as a script)
from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import fields
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from llmd_timeslice import yaml_files
from llmd_timeslice.router.envoy_clusters import grpc_http2_options
from manifests import chart_envoy, guide_steps
from manifests.families import flow_control
from manifests.families.common import (
    EPP_FILTER_NAME,
    GATE_AUTHZ_PORT,
    GATE_CONTAINER,
    GATE_EXT_PROC_PORT,
    GATE_FILTER_NAME,
    GATE_HEADLESS_SERVICE,
    GATE_READINESS_SERVICE,
    GATE_SERVICE,
    GUIDE,
    HEADER,
    LOCAL_GATE_CLUSTER,
    SETTINGS_FILE,
    TOKEN_DIR,
    GuideSettings,
    _add_args,
    _doc,
    _dump,
    _images,
    _inference_pool_ref,
    _kustomization,
    httproute,
    load_settings,
)
from manifests.families.components import (
    gate_objectives_component,
    gate_objectives_rbac,
    resource_claim,
    sampler_component,
    shared_accelerator_component,
    trainer_component,
)
from manifests.families.envoy import ENVOY_VERSIONS, gate_error_mappers
from manifests.families.flow_control import (
    EPP_HAS_NO_ENDPOINT_REQUEST_TTL,
    EPP_VERSION,
    epp_config_errors,
    flow_control_ttl,
    flow_control_values,
    values_flow_control,
)
from manifests.families.gateway_policies import _eg_gate_filter_name, agentgateway_policy, envoy_gateway_docs
from manifests.families.istio import (
    GATE_PROBE,
    istio_destinationrule,
    istio_ext_proc_envoyfilter,
    istio_fast_path_envoyfilter,
    istio_gateway_overlay,
    istio_gateway_parameters,
    istio_route_name,
)
from manifests.families.router_values import (
    render_chart_envoy_yaml,
    standalone_bootstrap,
    values_gateway,
    values_serving_label,
    values_standalone,
)

__all__ = [  # this entry point's own names, and those the tests and docs read from it (defined in manifests/families/)
    "ENVOY_VERSIONS",
    "EPP_FILTER_NAME",
    "EPP_HAS_NO_ENDPOINT_REQUEST_TTL",
    "EPP_VERSION",
    "GATE_AUTHZ_PORT",
    "GATE_CONTAINER",
    "GATE_EXT_PROC_PORT",
    "GATE_FILTER_NAME",
    "GATE_HEADLESS_SERVICE",
    "GATE_PROBE",
    "GATE_READINESS_SERVICE",
    "GATE_SERVICE",
    "GUIDE",
    "LOCAL_GATE_CLUSTER",
    "TOKEN_DIR",
    "_eg_gate_filter_name",
    "chart_envoy",
    "epp_config_errors",
    "flow_control",
    "flow_control_ttl",
    "flow_control_values",
    "gate_error_mappers",
    "grpc_http2_options",
    "istio_ext_proc_envoyfilter",
    "istio_fast_path_envoyfilter",
    "istio_gateway_overlay",
    "istio_gateway_parameters",
    "istio_route_name",
    "load_settings",
    "main",
    "prometheus_rule",
    "render_chart_envoy_yaml",
    "render_tree",
    "rendered_files",
    "standalone_bootstrap",
    "values_standalone",
]

ALERT_RULES_FILE = ROOT / "alerts" / "llmd-timeslice-rules.yaml"
"""The alerting rules' one source: a plain Prometheus rules file (the local stack loads it as it is); the guide's
PrometheusRule carries the same groups (:func:`prometheus_rule`)."""

# ------------------------------------------------------------------------------ the file set


def _settings_yaml(s: GuideSettings) -> str:
    lines = [
        "# The ONE place for the names and limits this guide shares with your llm-d deployment.",
        "# After a change run `python3 manifests/generate.py`: it rewrites every file that uses them",
        "# (tests/manifests/test_manifests.py checks that each file agrees with this one).",
    ]
    for f in fields(GuideSettings):
        v = getattr(s, f.name)
        lines.append(f"{f.name}: {yaml.safe_dump(v, default_flow_style=True, width=1000).strip().removesuffix('...').strip()}")
    return "\n".join(lines) + "\n"


def prometheus_rule(rules_file: Path = ALERT_RULES_FILE) -> dict:
    """The guide's ``PrometheusRule`` (prometheus-operator, ``monitoring.coreos.com/v1``): the groups of the plain
    rules file, unchanged. Raises ValueError when the file has no ``groups``."""
    groups = (yaml_files.load(rules_file.read_text()) or {}).get("groups")
    if not groups:
        raise ValueError(f"{rules_file}: no 'groups' of alerting rules")
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "llmd-timeslice", "labels": {"app.kubernetes.io/name": "llmd-timeslice"}},
        "spec": {"groups": groups},
    }


def rendered_files(s: GuideSettings, guide: Path = GUIDE) -> dict[Path, str]:
    """Every generated file for ``s``, path -> content (paths under ``guide``)."""
    ns = s.namespace
    pool_args = [f"--pool={s.pool}", f"--default-pool={s.pool}"]
    base = _kustomization(
        namespace=ns,
        labels=[{"pairs": {"app.kubernetes.io/part-of": "llmd-timeslice", **guide_steps.PHASE_LABEL}, "includeSelectors": False}],
        resources=["gate", "orchestrator"],
        images=_images(s),
        patches=[
            {
                "target": {"group": "apps", "version": "v1", "kind": "Deployment", "name": "llmd-timeslice-gate"},
                "patch": _add_args(*pool_args, f"--max-hold-s={s.max_hold_s:g}"),
            },
            {
                "target": {"group": "apps", "version": "v1", "kind": "Deployment", "name": "llmd-timeslice-orchestrator"},
                "patch": _add_args(f"--default-pool={s.pool}"),
            },
        ],
    )

    def overlay(*extra: str, components: tuple[str, ...] = ()) -> dict:
        k = _kustomization(namespace=ns, resources=["../../base", *extra])
        if components:
            k["components"] = list(components)
        return k

    eg = envoy_gateway_docs(s)
    out: dict[str, str] = {
        "base/kustomization.yaml": _doc(
            "The time-slicing control and data plane: gate + orchestrator, named from settings.yaml.\n"
            "Every gateway overlay includes it; with the standalone router apply it on its own:\n"
            "  kubectl apply -k manifests/guides/time-slicing/base",
            base,
        ),
        "router/values-pins.yaml": _doc(
            f"The llm-d-router release this guide pins (llm-d/llm-d-router {guide_steps.ROUTER_VERSION}): its EPP image,\n"
            "never main / Always (the -dev charts' defaults). Every helm upgrade of the guide layers it (README: Install).",
            guide_steps.pins_values(),
        ),
        "README.md": guide_steps.with_install_block((guide / "README.md").read_text()),
        "base/monitoring/kustomization.yaml": _doc(
            "Optional: needs the prometheus-operator CRDs (monitoring.coreos.com).\n"
            "  kubectl apply -k manifests/guides/time-slicing/base/monitoring",
            _kustomization(namespace=ns, resources=["servicemonitors.yaml", "prometheusrule.yaml"]),
        ),
        "base/monitoring/prometheusrule.yaml": _doc(
            "The alerting rules of manifests/alerts/llmd-timeslice-rules.yaml (their one source; docs/operations.md,\n"
            '"Alerts") as a PrometheusRule. A Prometheus of the prometheus-operator loads it where its ruleSelector\n'
            "matches these labels (kube-prometheus-stack: add its release label, or set ruleSelectorNilUsesHelmValues: false).",
            prometheus_rule(),
        ),
        "router/values-standalone.yaml": values_standalone(s),
        "router/standalone-envoy.yaml": HEADER + "# What the chart renders from values-standalone.yaml for release "
        f"{s.pool!r} in {ns!r} (envoy --mode validate checks it).\n" + _dump(standalone_bootstrap(s, s.pool, ns)),
        "router/values-gateway.yaml": values_gateway(s),
        "router/values-serving-label.yaml": values_serving_label(s),
        "router/values-flow-control.yaml": values_flow_control(s),
        "gateways/istio/kustomization.yaml": _doc(
            "Istio (1.29, ENABLE_GATEWAY_API_INFERENCE_EXTENSION=true on istiod), the fast path: the gate runs\n"
            "beside each Envoy of the Gateway (a container in its pods, added by the Gateway's parameters\n"
            "ConfigMap: generate.py --istio-parameters), Envoy checks it over HTTP ext_authz on loopback before\n"
            "the EPP and sends it each request's end over the gRPC access log. This overlay: the orchestrator\n"
            "(base without its replicated gate) + the EnvoyFilter + the /v1/-only route.\n"
            "  python3 manifests/generate.py --istio-parameters <recipe configmap> | kubectl apply -n <ns> -f -\n"
            "  kubectl apply -k manifests/guides/time-slicing/gateways/istio",
            overlay("httproute.yaml", "envoyfilter.yaml", components=("../../components/no-gate-deployment",)),
        ),
        "gateways/istio/httproute.yaml": _doc(
            "The guide's InferencePool behind the Gateway, /v1/ only.", httproute(s, _inference_pool_ref(s))
        ),
        "gateways/istio/envoyfilter.yaml": _doc(
            "Istio Gateway API mode with the inference extension: the fast path to the gate container of each\n"
            "Gateway pod (127.0.0.1).",
            istio_fast_path_envoyfilter(s),
        ),
        "gateways/istio/gateway-parameters.yaml": _doc(
            "NOT applied by the kustomization. What `generate.py --istio-parameters none` prints: the Gateway's\n"
            "parameters ConfigMap with the gate container in its Deployment overlay (Istio applies it as a\n"
            "strategic merge patch to the Deployment it generates for the Gateway). Apply the one generate.py\n"
            "prints for YOUR Gateway's ConfigMap (the llm-d Istio recipe's: every key of it is kept).",
            istio_gateway_parameters(s),
        ),
        "gateways/istio-ext-proc/kustomization.yaml": _doc(
            "Istio with the gate over ext_proc (replicated gate Deployment behind a Service): for an EPP that\n"
            "queues requests (flow control), whose requests the drain deadline must be able to cut (docs/gate.md),\n"
            "or where the Gateway's pods cannot take the gate container.\n"
            "  kubectl apply -k manifests/guides/time-slicing/gateways/istio-ext-proc",
            overlay("httproute.yaml", "envoyfilter.yaml", "destinationrule.yaml"),
        ),
        "gateways/istio-ext-proc/httproute.yaml": _doc(
            "The guide's InferencePool behind the Gateway, /v1/ only.", httproute(s, _inference_pool_ref(s))
        ),
        "gateways/istio-ext-proc/envoyfilter.yaml": _doc(
            "Istio Gateway API mode with the inference extension.", istio_ext_proc_envoyfilter(s)
        ),
        "gateways/istio-ext-proc/destinationrule.yaml": _doc(
            "Each held request is one open ext_proc stream to the gate: raise Istio's connection pool limits.",
            istio_destinationrule(s),
        ),
        "gateways/agentgateway/kustomization.yaml": _doc(
            "agentgateway (v1.1, inferenceExtension.enabled=true): base + the gate as an AgentgatewayPolicy\n"
            "extProc on the /v1/-only route. agentgateway sends the EPP no metadata from an earlier ext_proc,\n"
            "so the subset hint cannot reach it: steering is paired with the serving label (install the\n"
            "router with values-serving-label.yaml). The gate still holds and counts in-flight requests.\n"
            "  kubectl apply -k manifests/guides/time-slicing/gateways/agentgateway",
            overlay("httproute.yaml", "policy.yaml", components=("../../components/serving-label",)),
        ),
        "gateways/agentgateway/httproute.yaml": _doc(
            "The guide's InferencePool behind the Gateway, /v1/ only.", httproute(s, _inference_pool_ref(s))
        ),
        "gateways/agentgateway/policy.yaml": _doc(
            "The gate on the route (fail closed: the controller always sets FAIL_CLOSED).", agentgateway_policy(s)
        ),
        "gateways/envoy-gateway/kustomization.yaml": _doc(
            "Envoy Gateway (v1.9; no upstream llm-d path: this variant wires the EPP itself). Needs\n"
            "extensionApis.enableEnvoyPatchPolicy and enableBackend in the Envoy Gateway configuration.\n"
            "  kubectl apply -k manifests/guides/time-slicing/gateways/envoy-gateway",
            overlay(*eg, components=("../../components/serving-label",)),
        ),
        **{
            f"gateways/envoy-gateway/{name}": _doc("Envoy Gateway variant (see kustomization.yaml).", d) for name, d in eg.items()
        },
        "gateways/label-fallback/kustomization.yaml": _doc(
            "For gateways that cannot chain an ext_proc before the EPP: no gate on the request path; the\n"
            "orchestrator keeps timeslice.io/serving current and the pool selects serving pods only.\n"
            "Install the router with values-gateway.yaml + values-serving-label.yaml + values-flow-control.yaml.\n"
            "  kubectl apply -k manifests/guides/time-slicing/gateways/label-fallback",
            overlay("httproute.yaml", components=("../../components/serving-label",)),
        ),
        "gateways/label-fallback/httproute.yaml": _doc(
            "The guide's InferencePool behind the Gateway, /v1/ only.", httproute(s, _inference_pool_ref(s))
        ),
        "modelserver/sampler/kustomization.yaml": _doc(
            "Adds time-slicing to the guide's vLLM model servers (Deployments labelled llm-d.ai/guide=<guide>):\n"
            "the snapshot sidecar, VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode on the container named\n"
            "modelserver (the first container), and the pod labels the orchestrator and gates agree on.",
            sampler_component(s),
        ),
        "modelserver/trainer/kustomization.yaml": _doc(
            "Connects trainer Jobs (labelled timeslice.io/role=trainer, container named trainer) to the\n"
            "orchestrator: address, group, token.",
            trainer_component(s),
        ),
        "modelserver/shared-accelerator/kustomization.yaml": _doc(
            "The sampler and the trainer share ONE Dynamic Resource Allocation ResourceClaim (resource.k8s.io/v1),\n"
            "as llm-d-incubation/llm-d-rl-time-slicing does; device-plugin grants (nvidia.com/gpu) are exclusive.\n"
            "Needs Kubernetes 1.34+ and a DRA driver with the DeviceClass in settings.yaml (README).",
            shared_accelerator_component(s),
        ),
        "modelserver/shared-accelerator/resourceclaim.yaml": _doc(
            f"The accelerators of group {s.group}: every pod that references this claim gets the same devices.", resource_claim(s)
        ),
        "modelserver/example/llm-d-guide/kustomization.yaml": _doc(
            "Stands for a guide's model-server overlay: labels the Deployment with llm-d.ai/guide the way the\n"
            "llm-d guides do (guides/optimized-baseline/modelserver/gpu/vllm/base/kustomization.yaml).",
            _kustomization(
                resources=["vllm-sampler.yaml"],
                labels=[{"pairs": {"llm-d.ai/guide": s.guide}, "includeSelectors": True, "includeTemplates": True}],
            ),
        ),
        "modelserver/example/kustomization.yaml": _doc(
            "An upstream-shaped sampler Deployment (llm-d-guide/) and a trainer Job, with the components applied:\n"
            "they share one ResourceClaim (the tests build and validate it).\n"
            "  kubectl apply -k manifests/guides/time-slicing/modelserver/example",
            _kustomization(
                namespace=ns,
                resources=["llm-d-guide", "trainer-job.yaml"],
                components=["../sampler", "../trainer", "../shared-accelerator"],
            ),
        ),
        "components/gate-objectives/kustomization.yaml": _doc(
            "Optional: the replicated gate reads the InferenceObjectives of its pools from the Kubernetes API\n"
            "(--objectives-from-kubernetes: list + watch, in its own namespace), so a request's\n"
            'x-gateway-inference-objective header picks its priority band (docs/gate.md, "Priority bands").\n'
            "Reads InferenceObjectives from the group the cluster serves (llm-d.ai/v1alpha2 first, as the EPP;\n"
            "else inference.networking.x-k8s.io/v1alpha2); with neither CRD installed the gate serves with\n"
            "bands off. Add it to an overlay that keeps base's gate Deployment:\n"
            "components: [../../components/gate-objectives]",
            gate_objectives_component(),
        ),
        "components/gate-objectives/rbac.yaml": _doc(
            "What the gate needs to read InferenceObjectives, and nothing else: get/list/watch on them, in both\n"
            "groups that serve them, in its own namespace (Role, not ClusterRole). Discovery (which group is\n"
            "served) needs no rule here: the cluster's default system:discovery covers it.",
            *gate_objectives_rbac(),
        ),
    }
    return {guide / k: v for k, v in out.items()}


def render_tree(s: GuideSettings, dest: Path) -> Path:
    """A full copy of the guide under ``dest`` for settings ``s`` (static files copied, the rest rendered)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(GUIDE, dest)
    (dest / "settings.yaml").write_text(_settings_yaml(s))
    for path, text in rendered_files(s, dest).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Only compare; exit 1 if a file is out of date.")
    parser.add_argument("--settings", type=Path, default=SETTINGS_FILE, help="Settings file (default: the guide's).")
    parser.add_argument("--out", type=Path, help="Write a full copy of the guide there instead of in place.")
    parser.add_argument(
        "--istio-parameters",
        metavar="CONFIGMAP|none",
        help="Then print (stdout) the Istio Gateway's parameters ConfigMap with the gate container "
        "folded into its Deployment overlay: give the ConfigMap file the Gateway's "
        "infrastructure.parametersRef names (the llm-d Istio recipe's), or none.",
    )
    parser.add_argument(
        "--flow-control-values",
        metavar="VALUES|-",
        help="Only print (stdout) the label fallback's EPP values: the release's EndpointPickerConfig "
        "(`helm get values <release> -o yaml`, - for stdin) with flow control layered on.",
    )
    parser.add_argument(
        "--standalone-values",
        metavar="RENDERED|-",
        help="Only print (stdout) our standalone chart values: the chart's Envoy config as `helm template` renders "
        "it for the release (- for stdin) with the gate patched in (manifests/chart_envoy.py).",
    )
    args = parser.parse_args(argv)
    if args.standalone_values:
        source = args.standalone_values
        try:
            s = load_settings(args.settings)
            text = sys.stdin.read() if source == "-" else Path(source).read_text()
            chart = chart_envoy.chart_envoy_config(text)
            sys.stdout.write(values_standalone(s, chart, "the `helm template` output on stdin" if source == "-" else source))
        except (OSError, ValueError, TypeError, yaml.YAMLError) as exc:
            print(f"generate.py: --standalone-values {source}: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.flow_control_values:
        try:
            s = load_settings(args.settings)
            sys.stdout.write(flow_control_values(s, _read_recipe(Path(args.flow_control_values))))
        except (OSError, ValueError, TypeError, yaml.YAMLError) as exc:
            print(f"generate.py: --flow-control-values {args.flow_control_values}: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.check and args.istio_parameters:
        parser.error("--check and --istio-parameters do not go together")
    try:
        s = load_settings(args.settings)
    except (OSError, ValueError, TypeError, yaml.YAMLError) as exc:
        print(f"generate.py: {exc}", file=sys.stderr)
        return 2
    parameters = None
    if args.istio_parameters:
        try:
            recipe = None if args.istio_parameters == "none" else _read_recipe(Path(args.istio_parameters))
            parameters = istio_gateway_parameters(s, recipe)
        except (OSError, ValueError) as exc:
            print(f"generate.py: --istio-parameters {args.istio_parameters}: {exc}", file=sys.stderr)
            return 2
    if args.out:
        render_tree(s, args.out)
        print(f"wrote the guide for {args.settings} to {args.out}", file=sys.stderr)
        if parameters is not None:
            sys.stdout.write(_dump(parameters))
        return 0
    stale = []
    for path, text in rendered_files(s).items():
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(path.relative_to(REPO))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}", file=sys.stderr)
    if stale:
        print("out of date (run python3 manifests/generate.py):", *map(str, stale), sep="\n  ")
        return 1
    if parameters is not None:
        sys.stdout.write(_dump(parameters))
    return 0


def _read_recipe(path: Path) -> dict:
    """The YAML document in ``path`` (``-``: stdin). Raises OSError (unreadable) or ValueError (not YAML)."""
    try:
        return yaml_files.load(sys.stdin.read() if str(path) == "-" else path.read_text())
    except yaml_files.DuplicateKeyError as exc:
        raise ValueError(str(exc)) from None
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML: {exc}") from exc


if __name__ == "__main__":
    raise SystemExit(main())
