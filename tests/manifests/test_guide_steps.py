"""The guide's install, walked step by step (issue 37 §4): no moment answers worse than before it, nothing unpinned.

manifests/guide_steps.py keeps each variant's steps as data; the README's install section is rendered from it. The
walk below replays them on a model of the cluster built from the real artefacts: what ``kubectl apply -k`` would
apply is the overlay built by ``kubectl kustomize`` (and filtered by the step's label selector as kubectl does),
what ``helm upgrade`` layers is the values files the step names (read from the guide). After every step it asserts
that the OpenAI API (``/v1/``) is still routed (by the chart's ``/`` route or ours), that whatever sends traffic to
the gate finds it ready (the gate Deployment, or on the Istio fast path a gate container in every Gateway pod), that
a pool selecting the serving label finds the labels kept, and that no switch of the request path happens while a
part it would send traffic to is still rolling. The guide's previous order fails the same walk.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
import yaml

from manifests import guide_steps as gs
from tests.manifests.support import FIXTURE, GUIDE, S, _fixture_values, built, gen, helm_coalesce

GATE = "llmd-timeslice-gate"
ORCHESTRATOR = "llmd-timeslice-orchestrator"
MODELSERVER = "model servers"
GATEWAY_PODS = "Gateway pods"
PATH_KINDS = {"EnvoyFilter", "EnvoyExtensionPolicy", "EnvoyPatchPolicy", "AgentgatewayPolicy", "HTTPRoute"}


class Unsafe(AssertionError):
    """A moment of the install answers worse than before it (or a step could never finish)."""


def _selects(selector: str, labels: dict) -> bool:
    key, _, value = selector.partition("=")
    return labels.get(key) == value.replace("${GUIDE_NAME}", S.guide)


@dataclass
class Cluster:
    """What the install has done so far, as far as the request path is concerned."""

    applied: dict[tuple[str, str], dict] = field(default_factory=dict)
    ready: set[str] = field(default_factory=lambda: {MODELSERVER})
    rolling: set[str] = field(default_factory=set)
    secret: bool = False
    gateway_pods_have_gate: bool = False
    parameters: bool = False
    rendered: bool = False
    chart_routes_slash: bool = True  # the guide installed the release with its / route (HTTPRoute or Envoy's)
    release: dict = field(
        default_factory=lambda: helm_coalesce(_fixture_values("base.values.yaml"), _fixture_values("guide.values.yaml"))
    )
    release_chart: str = "-dev at v0"
    gate_in_envoy: bool = False  # standalone: the chart's Envoy calls the gate
    timesliced: bool = False  # the model servers carry the sampler labels the orchestrator claims pods by

    # ------------------------------------------------------------------------------------------ what is on the path

    def path_objects(self) -> list[dict]:
        return [d for (kind, _), d in self.applied.items() if kind in PATH_KINDS]

    def gate_callers(self) -> list[str]:
        callers = [f"{d['kind']}/{d['metadata']['name']}" for d in self.path_objects() if d["kind"] != "HTTPRoute"]
        return callers + (["the chart's Envoy"] if self.gate_in_envoy else [])

    def fast_path(self) -> bool:
        return any(d["kind"] == "EnvoyFilter" and "ext_authz" in yaml.safe_dump(d) for d in self.path_objects())

    def api_routed(self) -> bool:
        ours = [
            m
            for d in self.path_objects()
            if d["kind"] == "HTTPRoute"
            for rule in d["spec"]["rules"]
            for m in rule.get("matches", [])
        ]
        return self.chart_routes_slash or {"path": {"type": "PathPrefix", "value": "/v1/"}} in ours

    def orchestrator_manages_serving_label(self) -> bool:
        orch = self.applied.get(("Deployment", ORCHESTRATOR))
        return bool(orch) and "--manage-serving-label" in orch["spec"]["template"]["spec"]["containers"][0]["args"]

    # ------------------------------------------------------------------------------------------ the steps

    def switch_path(self, what: str) -> None:
        if self.rolling:
            raise Unsafe(f"{what} while {sorted(self.rolling)} still roll(s) out")

    def do(self, step: gs.Step) -> None:
        e = step.effect
        match e:
            case gs.Generate() | gs.RenderStandalone():
                self.rendered |= isinstance(e, gs.RenderStandalone)
            case gs.Secret():
                self.secret = True
            case gs.Apply(overlay, selector):
                docs = [d for d in built(overlay) if selector is None or _selects(selector, d["metadata"].get("labels", {}))]
                assert docs, f"{step.command}: applies nothing"
                if any(d["kind"] in PATH_KINDS for d in docs):
                    self.switch_path(step.command)
                for d in docs:
                    key = (d["kind"], d["metadata"]["name"])
                    if d["kind"] == "Deployment" and self.applied.get(key) != d:
                        self.ready.discard(key[1])
                        self.rolling.add(key[1])
                    self.applied[key] = d
            case gs.ModelServer():
                self.timesliced = True
                self.ready.discard(MODELSERVER)
                self.rolling.add(MODELSERVER)
            case gs.Wait(selector):
                self.wait(selector, step.command)
            case gs.IstioParameters():
                self.parameters = True
                self.rolling.add(GATEWAY_PODS)
            case gs.WaitGateway():
                if not self.parameters:
                    raise Unsafe(f"{step.command}: nothing changed the Gateway's pods")
                if ORCHESTRATOR not in self.ready:
                    raise Unsafe(f"{step.command}: the new pods' gates never turn ready without the orchestrator")
                self.rolling.discard(GATEWAY_PODS)
                self.gateway_pods_have_gate = True
            case gs.HelmUpgrade(chart, values, _, _):
                self.switch_path(step.command.split("\n")[0])
                layers = []
                for name in values:
                    if name == gs.STANDALONE_VALUES:
                        if not self.rendered:
                            raise Unsafe(f"{step.command}: {name} was never rendered")
                        layers.append(yaml.safe_load(gen.values_standalone(S, gen.chart_envoy.rendered())))
                    else:
                        layers.append(yaml.safe_load((GUIDE / "router" / name).read_text()))
                self.release = helm_coalesce(self.release, *layers)
                self.release_chart = f"{chart} {gs.ROUTER_VERSION}"
                if chart == "llm-d-router-gateway":
                    self.chart_routes_slash = self.release.get("httpRoute", {}).get("create", True) is not False
                else:
                    envoy = gen.render_chart_envoy_yaml(yaml.safe_dump(self.release), S.pool, S.namespace)
                    hcm = gen.chart_envoy.epp_listener(envoy)[1]
                    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
                    assert [r["match"] for r in routes if "route" in r] == [{"prefix": "/v1/"}]
                    self.gate_in_envoy = gen.GATE_FILTER_NAME in [f["name"] for f in hcm["http_filters"]]
            case _:
                raise AssertionError(f"unknown step {step!r}")

    def wait(self, selector: str, command: str) -> None:
        waited = {
            name
            for (kind, name), d in self.applied.items()
            if kind == "Deployment" and _selects(selector, d["metadata"]["labels"])
        }
        if selector == gs.MODELSERVER_SELECTOR:
            waited = {MODELSERVER}
        if not waited:
            raise Unsafe(f"{command}: waits on nothing")
        if not self.secret:
            raise Unsafe(f"{command}: every pod mounts the token Secret, not created yet")
        if GATE in waited and ORCHESTRATOR not in waited | self.ready:
            raise Unsafe(f"{command}: the gate turns ready after the orchestrator's first snapshot; no orchestrator")
        self.rolling -= waited
        self.ready |= waited

    # ------------------------------------------------------------------------------------------ the invariants

    def check(self, after: str) -> None:
        if not self.api_routed():
            raise Unsafe(f"after `{after}`: no route for /v1/ (every request 404)")
        for caller in self.gate_callers():
            if self.fast_path() and caller.startswith("EnvoyFilter"):
                if not self.gateway_pods_have_gate:
                    raise Unsafe(f"after `{after}`: {caller} checks with a gate that the Gateway's pods do not run yet")
            elif GATE not in self.ready:
                raise Unsafe(f"after `{after}`: {caller} calls the gate, which is not ready (fail closed: 503)")
        selector = self.release.get("router", {}).get("modelServers", {}).get("matchLabels", {})
        if "timeslice.io/serving" in selector:
            managed = self.orchestrator_manages_serving_label() and self.timesliced
            if not (managed and {ORCHESTRATOR, MODELSERVER} <= self.ready):
                raise Unsafe(f"after `{after}`: the pool selects timeslice.io/serving, which no orchestrator sets yet")


def walk(steps: list[gs.Step]) -> Cluster:
    cluster = Cluster()
    cluster.check("nothing yet")
    for step in steps:
        cluster.do(step)
        cluster.check(step.command.split("\n")[0])
    return cluster


@pytest.mark.parametrize("variant", gs.VARIANTS)
def test_no_moment_of_the_install_answers_worse_than_before_it(variant):
    end = walk(gs.VARIANTS[variant])
    assert not end.rolling, f"the install ends with {end.rolling} still rolling"
    assert end.release_chart == f"{gs.VARIANTS[variant][-1].effect.chart} {gs.ROUTER_VERSION}"
    assert end.release["router"]["epp"]["image"] == gs.EPP_IMAGE, "the EPP image is the pinned release's"
    if "Label fallback" in variant:
        assert not end.gate_callers()
    else:
        assert end.gate_callers(), "the gate ends up on the request path"
    if "Standalone" not in variant:
        assert not end.chart_routes_slash, "the chart's / route is gone: only /v1/ is routed"


def _steps(*effects) -> list[gs.Step]:
    return [gs.Step(e) for e in effects]


OLD_ORDERS = {
    # The guide before issue 37: the helm upgrade first, so the chart's / route is gone before ours exists ...
    "istio-ext-proc, helm first": (
        _steps(
            gs.Secret(), gs.HelmUpgrade("llm-d-router-gateway", ("values-gateway.yaml",)), gs.Apply("gateways/istio-ext-proc")
        ),
        "no route for /v1/",
    ),
    # ... and on the fast path the EnvoyFilter reached Gateway pods that had no gate container yet.
    "istio fast path, EnvoyFilter during the Gateway's rollout": (
        _steps(
            gs.Secret(),
            gs.Apply("gateways/istio", gs.PHASE_SELECTOR),
            gs.Wait(gs.OURS_SELECTOR),
            gs.IstioParameters(),
            gs.Apply("gateways/istio"),
        ),
        r"\['Gateway pods'\] still roll",
    ),
    "istio fast path, Gateway pods before the orchestrator": (
        _steps(gs.Secret(), gs.IstioParameters(), gs.WaitGateway()),
        "never turn ready without the orchestrator",
    ),
    "ext_proc filter before the gate is ready": (
        _steps(gs.Secret(), gs.Apply("gateways/istio-ext-proc")),
        "calls the gate, which is not ready",
    ),
    "standalone, Envoy switched before the gate rolled out": (
        _steps(
            gs.Secret(),
            gs.Apply("base"),
            gs.RenderStandalone(),
            gs.HelmUpgrade("llm-d-router-standalone", (gs.STANDALONE_VALUES,)),
        ),
        "llmd-timeslice-gate.* still roll",
    ),
    "serving label before the samplers carry the orchestrator's labels": (
        _steps(
            gs.Secret(),
            gs.Apply("gateways/agentgateway", gs.PHASE_SELECTOR),
            gs.Wait(gs.OURS_SELECTOR),
            gs.Apply("gateways/agentgateway"),
            gs.HelmUpgrade("llm-d-router-gateway", ("values-gateway.yaml", "values-serving-label.yaml")),
        ),
        "selects timeslice.io/serving",
    ),
    "gate waited without its orchestrator": (
        _steps(gs.Secret(), gs.Apply("base", "app.kubernetes.io/component=gate"), gs.Wait(gs.OURS_SELECTOR)),
        "after the orchestrator.s first snapshot",
    ),
}


@pytest.mark.parametrize("name", OLD_ORDERS)
def test_the_walk_catches_an_order_that_answers_worse(name):
    steps, why = OLD_ORDERS[name]
    with pytest.raises(Unsafe, match=why):
        walk(steps)


# ------------------------------------------------------------------------------------------ pinned, never followed


def _readme_commands() -> str:
    text = (GUIDE / "README.md").read_text()
    return "\n".join(re.findall(r"```bash\n(.*?)```", text, flags=re.S))


def _helm_commands(code: str) -> list[str]:
    joined = code.replace("\\\n", " ")
    return [ln.strip() for ln in joined.splitlines() for ln in re.split(r"\|", ln) if re.match(r"\s*helm ", ln)]


def test_no_guide_step_follows_a_moving_target():
    steps = "\n".join(step.command for steps in gs.VARIANTS.values() for step in steps)
    for code, where in ((steps, "guide_steps"), (_readme_commands(), "README")):
        for moving in (":main", "pullPolicy: Always", "-dev ", "-dev\n", "--version v0 ", "--reuse-values"):
            assert moving not in code + "\n", f"{where}: {moving.strip()!r} in a command"
        for helm in _helm_commands(code):
            verb = helm.split()[1]
            if verb in ("install", "upgrade", "template"):
                assert re.search(r"--version v?\d+\.\d+\.\d+\b", helm), f"{where}: unpinned chart: {helm}"
            if verb == "upgrade" and "llm-d-router" in helm:  # the router's charts (the DRA driver's has its own steps)
                assert "--reset-then-reuse-values" in helm and "values-pins.yaml" in helm, helm
    values_used = {
        v for steps in gs.VARIANTS.values() for s in steps if isinstance(s.effect, gs.HelmUpgrade) for v in s.effect.values
    }
    for name in values_used - {gs.STANDALONE_VALUES}:
        text = (GUIDE / "router" / name).read_text()
        assert not re.search(r"tag:\s*[\"']?main\b|pullPolicy:\s*Always", text), name


def test_the_pins_are_the_release_checked_here():
    pins = yaml.safe_load((GUIDE / "router" / gs.PINS_FILE).read_text())
    assert pins["router"]["epp"]["image"] == {
        "registry": "ghcr.io/llm-d",
        "repository": "llm-d-router-endpoint-picker",
        "tag": "v0.10.0",
        "pullPolicy": "IfNotPresent",
    }
    assert gs.ROUTER_VERSION == gen.chart_envoy.CHART_VERSION, "the standalone Envoy config is that chart's"
    text = (GUIDE / "README.md").read_text()
    assert "llm-d-router **v0.10.0**" in text and "Helm 3.14" in text, "the README names the versions checked"


def test_the_readme_install_is_rendered_from_the_steps():
    text = (GUIDE / "README.md").read_text()
    assert gs.with_install_block(text) == text, "run python3 manifests/generate.py"
    with pytest.raises(ValueError, match="install:start"):
        gs.with_install_block("no markers")
    assert (FIXTURE / "router" / "guide.values.yaml").exists()
