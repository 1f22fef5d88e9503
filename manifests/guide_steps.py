"""The guide's install steps, as data: the README's install commands are rendered from here, and a test walks them.

Each step is a shell command (as the README shows it) and the effect it has on the cluster, in words a test can
replay (tests/manifests/test_guide_steps.py): which overlay it applies (and which part of it), what it waits for,
which Helm values it layers and with which chart version. The order is the design (issue 37 §4,
docs/decisions/pinned-router-and-install-order.md): nothing on the request path changes before what it sends
traffic to is up and ready, so no moment of the install answers worse than before it:

1. the gate and the orchestrator (and, on the Istio fast path, the gate containers in the Gateway's pods) and the
   time-sliced model servers first, each waited for, while the release still routes ``/`` as the guide installed it;
2. then what puts the gate on the path (EnvoyFilter, policy, our ``/v1/`` HTTPRoute beside the chart's ``/``);
3. last the ``helm upgrade`` that removes the chart's ``/`` route (gateway) or swaps the Envoy config (standalone),
   at a pinned chart version and EPP image, waited for.

Versions are pinned, never followed: the released charts (``llm-d-router-standalone`` / ``-gateway``, not the ``-dev``
ones at ``v0`` that track ``main``) at :data:`ROUTER_VERSION`, the EPP image at the same tag, ``IfNotPresent``, and
``--reset-then-reuse-values`` (Helm 3.14+), which keeps the release's own values but takes the new chart's defaults
(``--reuse-values`` would keep the old chart's defaults too: helm/helm #3957).
"""

from __future__ import annotations

from dataclasses import dataclass

from manifests import chart_envoy

ROUTER_VERSION = chart_envoy.CHART_VERSION
"""The llm-d-router release this guide pins and was checked against (charts and EPP image share the tag)."""
CHART_REPO = "oci://ghcr.io/llm-d/charts"
EPP_IMAGE = {
    # llm-d/llm-d-router v0.10.0 hack/push-chart.sh: a release chart's values get these (registry, repository,
    # the release tag, IfNotPresent); config/charts/routerlib/values.yaml says main / Always for the -dev charts.
    "registry": "ghcr.io/llm-d",
    "repository": "llm-d-router-endpoint-picker",
    "tag": ROUTER_VERSION,
    "pullPolicy": "IfNotPresent",
}
PHASE_LABEL = {"timeslice.io/install-phase": "backends"}
"""On every object of base/ (gate, orchestrator): what may run before anything sends it traffic."""
PHASE_SELECTOR = "timeslice.io/install-phase=backends"
OURS_SELECTOR = "app.kubernetes.io/part-of=llmd-timeslice"
MODELSERVER_SELECTOR = "llm-d.ai/guide=${GUIDE_NAME}"
GATEWAY_DEPLOYMENT = "${GATEWAY:-llm-d-inference-gateway}-istio"
"""The Deployment Istio generates for the Gateway: ``<gateway>-<class>`` (tests/fixtures/istio-gateway-deployment.yaml)."""
PINS_FILE = "values-pins.yaml"
STANDALONE_VALUES = "ts-values-standalone.yaml"


# --------------------------------------------------------------------------------------------------- effects


@dataclass(frozen=True)
class Generate:
    """``python3 manifests/generate.py`` (only after editing settings.yaml)."""


@dataclass(frozen=True)
class Secret:
    """The token Secret the gate, orchestrator and sidecars mount."""


@dataclass(frozen=True)
class Apply:
    """``kubectl apply -k ${TS}/<overlay>`` (``selector``: only its objects with these labels)."""

    overlay: str
    selector: str | None = None


@dataclass(frozen=True)
class ModelServer:
    """The guide's model servers, time-sliced in place (sidecar, sleep mode, the group's claim): they roll."""


@dataclass(frozen=True)
class Wait:
    """``kubectl rollout status deploy -l <selector>``: every Deployment it selects has rolled out and is ready."""

    selector: str


@dataclass(frozen=True)
class IstioParameters:
    """The Gateway's parameters ConfigMap with the gate container folded in: Istio rolls the Gateway's pods."""


@dataclass(frozen=True)
class WaitGateway:
    """``kubectl rollout status`` of the Deployment Istio generates for the Gateway."""


@dataclass(frozen=True)
class RenderStandalone:
    """The chart's Envoy config rendered for the release at the pinned version, the gate patched in."""


@dataclass(frozen=True)
class HelmUpgrade:
    """``helm upgrade`` of the release to the pinned chart, the release's values reset-then-reused, ours on top."""

    chart: str
    values: tuple[str, ...]
    sets: tuple[tuple[str, str], ...] = ()
    flow_control: bool = False


Effect = Generate | Secret | Apply | ModelServer | Wait | IstioParameters | WaitGateway | RenderStandalone | HelmUpgrade


@dataclass(frozen=True)
class Step:
    effect: Effect
    comment: str = ""
    optional: bool = False

    @property
    def command(self) -> str:
        return command(self.effect)


# --------------------------------------------------------------------------------------------------- commands


def chart_ref(chart: str) -> str:
    return f"{CHART_REPO}/{chart} --version {ROUTER_VERSION}"


def command(effect: Effect) -> str:
    """The shell text of one step, exactly as the README shows it (continuation lines included)."""
    ns = "-n ${NAMESPACE}"
    match effect:
        case Generate():
            return "python3 manifests/generate.py"
        case Secret():
            return (
                f"kubectl create secret generic llmd-timeslice-token {ns} "
                '--from-literal=token="$(head -c 32 /dev/urandom | base64)"'
            )
        case Apply(overlay, selector):
            return f"kubectl apply -k ${{TS}}/{overlay}" + (f" -l {selector}" if selector else "")
        case ModelServer():
            return (
                f"kubectl get deploy {ns} -l {MODELSERVER_SELECTOR} -o yaml | tee ts-backup-modelserver.yaml \\\n"
                "  | llmd-timeslice k8s modelserver - --settings ${TS}/settings.yaml --replicas 1 | kubectl apply -f -"
            )
        case Wait(selector):
            return f"kubectl rollout status deploy {ns} -l {selector} --timeout=30m"
        case IstioParameters():
            return (
                "kubectl get configmap ${GATEWAY:-llm-d-inference-gateway} -n ${NAMESPACE} -o yaml "
                "| tee ts-backup-gateway-parameters.yaml \\\n"
                "  | python3 manifests/generate.py --istio-parameters - | kubectl apply -n ${NAMESPACE} -f -"
            )
        case WaitGateway():
            return f"kubectl rollout status deploy/{GATEWAY_DEPLOYMENT} {ns} --timeout=30m"
        case RenderStandalone():
            return (
                "helm get values ${GUIDE_NAME} -n ${NAMESPACE} --revision ${TS_ROUTER_REVISION} -o yaml \\\n"
                f"  | helm template ${{GUIDE_NAME}} {chart_ref('llm-d-router-standalone')} {ns} \\\n"
                f"      -f - -f ${{TS}}/router/{PINS_FILE} \\\n"
                f"  | python3 manifests/generate.py --standalone-values - > {STANDALONE_VALUES}"
            )
        case HelmUpgrade(chart, values, sets, flow_control):
            files = " ".join(f"-f {v if v.startswith('ts-') else '${TS}/router/' + v}" for v in values)
            extra = "".join(f" --set {k}={v}" for k, v in sets)
            fc = (
                " \\\n  -f <(helm get values ${GUIDE_NAME} -n ${NAMESPACE} -o yaml "
                "| python3 manifests/generate.py --flow-control-values -)"
                if flow_control
                else ""
            )
            return (
                f"helm upgrade ${{GUIDE_NAME}} {chart_ref(chart)} {ns} \\\n"
                f"  --reset-then-reuse-values {files}{extra}{fc} --wait --timeout 30m"
            )
    raise TypeError(f"not a step effect: {effect!r}")


# --------------------------------------------------------------------------------------------------- the variants


def _gateway_variant(
    overlay: str, values: tuple[str, ...], sets=(), flow_control: bool = False, what: str = "", settings_note: str = ""
) -> list:
    gateway_values = (PINS_FILE, "values-gateway.yaml", *values)
    return [
        Step(Generate(), "only after editing settings.yaml" + settings_note, optional=True),
        Step(Secret()),
        Step(Apply(overlay, PHASE_SELECTOR), "gate + orchestrator: nothing sends them traffic yet"),
        Step(ModelServer(), "your model servers as they run, time-sliced in place"),
        Step(Wait(OURS_SELECTOR), "gate ready = orchestrator up"),
        Step(Wait(MODELSERVER_SELECTOR)),
        Step(Apply(overlay), what + " + /v1/ HTTPRoute (the chart's / route still serves)"),
        Step(HelmUpgrade("llm-d-router-gateway", gateway_values, tuple(sets), flow_control), "pinned; drops the chart's / route"),
    ]


VARIANTS: dict[str, list[Step]] = {
    "Standalone router (Envoy in the EPP pod)": [
        Step(Generate(), "only after editing settings.yaml", optional=True),
        Step(Secret()),
        Step(Apply("base"), "gate + orchestrator: nothing sends them traffic yet"),
        Step(ModelServer(), "your model servers as they run, time-sliced in place"),
        Step(Wait(OURS_SELECTOR), "gate ready = orchestrator up"),
        Step(Wait(MODELSERVER_SELECTOR)),
        Step(RenderStandalone(), "the pinned chart's own Envoy config for your values, the gate patched in"),
        Step(HelmUpgrade("llm-d-router-standalone", (PINS_FILE, STANDALONE_VALUES)), "pinned; the EPP pod rolls"),
    ],
    "Istio (fast path: the gate in each Gateway pod)": [
        Step(Secret()),
        Step(Apply("gateways/istio", PHASE_SELECTOR), "orchestrator (the gates run in the Gateway's pods)"),
        Step(ModelServer(), "your model servers as they run, time-sliced in place"),
        Step(Wait(OURS_SELECTOR), "orchestrator up"),
        Step(Wait(MODELSERVER_SELECTOR)),
        Step(IstioParameters(), "regenerates, then folds the gate container into the Gateway's pods (backup kept)"),
        Step(WaitGateway(), "every Gateway pod has a ready gate before any check reaches one"),
        Step(Apply("gateways/istio"), "EnvoyFilter (fast path) + /v1/ HTTPRoute (the chart's / route still serves)"),
        Step(
            HelmUpgrade("llm-d-router-gateway", (PINS_FILE, "values-gateway.yaml"), (("provider.name", "istio"),)),
            "pinned; drops the chart's / route",
        ),
    ],
    "Istio (ext_proc: a replicated gate Service)": _gateway_variant(
        "gateways/istio-ext-proc", (), (("provider.name", "istio"),), what="EnvoyFilter (ext_proc)"
    ),
    "agentgateway": _gateway_variant(
        "gateways/agentgateway", ("values-serving-label.yaml",), (("provider.name", "none"),), what="AgentgatewayPolicy"
    ),
    "Envoy Gateway": _gateway_variant(
        "gateways/envoy-gateway", (), (("provider.name", "none"),), what="policies", settings_note=" (set gateway_listener too)"
    ),
    "Label fallback (a gateway that cannot run an ext_proc before the EPP)": _gateway_variant(
        "gateways/label-fallback", ("values-serving-label.yaml",), flow_control=True, what="the pool's route"
    ),
}
"""README install section title -> its steps, in order."""

BEFORE_ANY_VARIANT = (
    "export TS=$PWD/manifests/guides/time-slicing      # in this repository",
    "export TS_ROUTER_REVISION=$(helm history ${GUIDE_NAME} -n ${NAMESPACE} -o json | jq '.[-1].revision')",
)


# --------------------------------------------------------------------------------------------------- the README


INSTALL_START = "<!-- install:start -->"
INSTALL_END = "<!-- install:end -->"


def _with_comment(cmd: str, comment: str, optional: bool) -> str:
    if not comment:
        return cmd
    first, *rest = cmd.split("\n")
    note = f"# {comment}"
    if not rest and len(first) + len(note) + 2 <= 118:
        return f"{first:<50} {note}" if len(first) < 50 else f"{first}  {note}"
    return "\n".join([note, first, *rest])


def install_block() -> str:
    """The README's install section (between the markers), rendered from :data:`VARIANTS`."""
    out = [
        "",
        "```bash",
        *BEFORE_ANY_VARIANT,
        "```",
        "",
    ]
    for title, steps in VARIANTS.items():
        out += [f"#### {title}", "", "```bash"]
        out += [_with_comment(step.command, step.comment, step.optional) for step in steps]
        out += ["```", ""]
    return "\n".join(out)


def with_install_block(readme: str) -> str:
    """``readme`` with its install section replaced by :func:`install_block`. Raises ValueError without the markers."""
    if readme.count(INSTALL_START) != 1 or readme.count(INSTALL_END) != 1:
        raise ValueError(f"README needs one {INSTALL_START} and one {INSTALL_END}")
    head, rest = readme.split(INSTALL_START)
    _, tail = rest.split(INSTALL_END)
    return head + INSTALL_START + "\n" + install_block() + INSTALL_END + tail


def pins_values() -> dict:
    """``router/values-pins.yaml``: the EPP image of the pinned release, never ``main`` / ``Always``."""
    return {"router": {"epp": {"image": dict(EPP_IMAGE)}}}
