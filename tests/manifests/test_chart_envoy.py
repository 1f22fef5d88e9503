"""The standalone router's Envoy is the llm-d-router chart's own, with the gate patched in (issue 37 §3).

The chart's rendered ``envoy.yaml`` at llm-d/llm-d-router v0.10.0 (71f4f0999f95) is kept under manifests/chart/ for
both values of the EPP's ``secure-serving`` flag. Checked here: the patch keeps the chart's IPv6 listener addresses
(llm-d-router #1920), its access logs and every cluster, follows the chart's choice of TLS or plain text to the EPP,
puts the gate before the EPP, and the result passes the real ``envoy --mode validate`` of the Envoy our values run.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from manifests import chart_envoy
from tests.manifests.support import GUIDE, REPO, S, envoy_validate_all, gen

FLAGS = {"secure": True, "plaintext": False}


def chart(flavour: str) -> dict:
    return chart_envoy.rendered(FLAGS[flavour])


def patched(flavour: str) -> dict:
    return gen.standalone_bootstrap(S, S.pool, S.namespace, chart(flavour))


def _listeners(cfg: dict) -> dict[str, dict]:
    return {lis["name"]: lis for lis in cfg["static_resources"]["listeners"]}


def _clusters(cfg: dict) -> dict[str, dict]:
    return {c["name"]: c for c in cfg["static_resources"]["clusters"]}


@pytest.mark.parametrize("flavour", FLAGS)
def test_the_patch_keeps_the_charts_ipv6_listener_addresses(flavour):
    before, after = _listeners(chart(flavour)), _listeners(patched(flavour))
    assert set(before) == set(after) == {"envoy-proxy-ready-0.0.0.0-19001", "vllm"}
    for name, lis in before.items():
        v6 = [a["address"]["socket_address"]["address"] for a in lis["additional_addresses"]]
        assert v6 == ["::"], f"the chart's listener {name} binds :: too (#1920)"
        for key in ("address", "additional_addresses", "per_connection_buffer_limit_bytes", "access_log"):
            assert after[name].get(key) == lis.get(key), f"{name}.{key} is the chart's"
    assert _listeners(patched(flavour))["envoy-proxy-ready-0.0.0.0-19001"] == before["envoy-proxy-ready-0.0.0.0-19001"]


@pytest.mark.parametrize("flavour", FLAGS)
def test_the_patch_follows_the_charts_tls_choice_for_the_epp(flavour):
    secure = FLAGS[flavour]
    cfg = patched(flavour)
    epp = _clusters(cfg)[chart_envoy.EPP_CLUSTER]
    assert chart_envoy.epp_serves_tls(chart(flavour)) is secure
    assert chart_envoy.epp_serves_tls(cfg) is secure, "TLS to the EPP exactly when the chart renders it"
    assert ("tls_options" in epp["health_checks"][0]) is secure, "the chart's gRPC health check follows it too"
    chart_epp = _clusters(chart(flavour))[chart_envoy.EPP_CLUSTER]
    for key in ("type", "connect_timeout", "lb_policy", "health_checks", "load_assignment", "circuit_breakers"):
        assert epp.get(key) == chart_epp.get(key), f"ext_proc.{key} is the chart's"
    assert epp.get("transport_socket") == chart_epp.get("transport_socket")


@pytest.mark.parametrize("flavour", FLAGS)
def test_the_patch_adds_only_the_gate_and_keeps_every_other_cluster_and_the_admin(flavour):
    before, after = chart(flavour), patched(flavour)
    assert after["admin"] == before["admin"]
    b, a = _clusters(before), _clusters(after)
    assert set(a) - set(b) == {"llmd_timeslice_gate"} and set(b) <= set(a)
    for name in set(b) - {chart_envoy.EPP_CLUSTER}:
        assert a[name] == b[name], f"cluster {name} is the chart's"
    # The EPP cluster: only HTTP/2 limits raised (a released hold queue); the chart's windows stay.
    key = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    h2_before = b["ext_proc"]["typed_extension_protocol_options"][key]["explicit_http_config"]["http2_protocol_options"]
    h2_after = a["ext_proc"]["typed_extension_protocol_options"][key]["explicit_http_config"]["http2_protocol_options"]
    assert {k: v for k, v in h2_after.items() if k in h2_before} == h2_before
    assert h2_after["max_outbound_control_frames"] > 10_000
    hcm_b = chart_envoy.epp_listener(before)[1]
    hcm_a = chart_envoy.epp_listener(after)[1]
    changed = {"http_filters", "route_config", "stream_idle_timeout", "local_reply_config"}
    for field in set(hcm_b) - changed:
        assert hcm_a[field] == hcm_b[field], f"HCM {field} is the chart's"


@pytest.mark.parametrize("flavour", FLAGS)
def test_the_gate_runs_just_before_the_charts_epp_filter_which_forwards_the_hint_and_fails_closed(flavour):
    hcm = chart_envoy.epp_listener(patched(flavour))[1]
    names = [f["name"] for f in hcm["http_filters"]]
    chart_names = [f["name"] for f in chart_envoy.epp_listener(chart(flavour))[1]["http_filters"]]
    assert names == [gen.GATE_FILTER_NAME, *chart_names], names
    epp = hcm["http_filters"][1]["typed_config"]
    assert chart_envoy.epp_listener(chart(flavour))[1]["http_filters"][0]["typed_config"]["failure_mode_allow"] is True
    assert epp["failure_mode_allow"] is False and epp["status_on_error"] == {"code": 503}
    assert epp["metadata_options"]["forwarding_namespaces"]["untyped"] == ["envoy.lb.subset_hint"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    (api,) = [r for r in routes if "route" in r]
    chart_route = chart_envoy.epp_listener(chart(flavour))[1]["route_config"]["virtual_hosts"][0]["routes"][0]
    assert api["match"] == {"prefix": "/v1/"}
    assert api["route"] == chart_route["route"], "the chart's route action (24 h timeout, websocket) is kept"
    assert api["typed_per_filter_config"] == chart_route["typed_per_filter_config"]


@pytest.mark.parametrize("flavour", FLAGS)
def test_patching_twice_gives_the_same_config(flavour):
    once = patched(flavour)
    assert gen.standalone_bootstrap(S, S.pool, S.namespace, once) == once


def test_the_patched_chart_configs_pass_envoy_validate_with_the_envoy_our_values_run(tmp_path):
    """Envoy 1.40.0: ``router.proxy.image`` of our values. The chart's own default image (distroless-v1.33.2 at
    v0.10.0, ``router.proxy.presets.envoy.image``) predates ``status_on_error`` (Envoy 1.36), so our values replace
    it; the chart's unpatched configs are validated too (the hand-rendered fixtures are valid Envoy)."""
    version = gen.ENVOY_VERSIONS["standalone"]
    image = yaml.safe_load((GUIDE / "router" / "values-standalone.yaml").read_text())["router"]["proxy"]["image"]
    assert image.endswith(f":distroless-v{version}")
    configs = {f"patched-{f}": patched(f) for f in FLAGS} | {f"chart-{f}": chart(f) for f in FLAGS}
    envoy_validate_all(configs, tmp_path, dict.fromkeys(configs, version))


def test_our_values_are_the_pinned_charts_config_patched():
    committed = gen.render_chart_envoy_yaml((GUIDE / "router" / "values-standalone.yaml").read_text(), S.pool, S.namespace)
    assert committed == patched("secure")
    assert chart_envoy.CHART_VERSION in chart_envoy.rendered_path().name


def _cli(*args: str, stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "manifests" / "generate.py"), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("flavour", FLAGS)
def test_the_install_step_patches_what_helm_template_rendered(flavour):
    """`helm template ... | generate.py --standalone-values -`: helm template prints every object of the release;
    the Envoy ConfigMap among them is found and patched, plain text or TLS as rendered."""
    other = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "optimized-baseline-epp"}, "data": {"x": "y"}}
    text = yaml.safe_dump(other) + "---\n" + chart_envoy.rendered_path(FLAGS[flavour]).read_text()
    proc = _cli("--standalone-values", "-", stdin=text)
    assert proc.returncode == 0, proc.stderr
    assert gen.render_chart_envoy_yaml(proc.stdout, S.pool, S.namespace) == patched(flavour)
    assert ("plain text" in proc.stdout) is not FLAGS[flavour]


BAD_INPUTS = {
    "nothing rendered": ("kind: ConfigMap\nmetadata: {name: x}\ndata: {a: b}\n", "no Envoy configuration"),
    "not YAML": ("a: [\n", "not valid YAML"),
    "a key twice": ("kind: ConfigMap\nkind: Secret\n", "duplicate key 'kind'"),
    "two releases": (
        chart_envoy.rendered_path().read_text() + "\n---\n" + chart_envoy.rendered_path(False).read_text(),
        "2 Envoy configurations",
    ),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_a_bad_rendering_is_refused_in_one_line_naming_it(name):
    text, words = BAD_INPUTS[name]
    proc = _cli("--standalone-values", "-", stdin=text)
    assert proc.returncode == 2 and proc.stdout == ""
    assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_chart_config_without_the_epp_filter_or_its_route_is_refused():
    cfg = chart("secure")
    no_epp = copy.deepcopy(cfg)
    chart_envoy.epp_listener(no_epp)[1]["http_filters"].pop(0)
    with pytest.raises(chart_envoy.ChartEnvoyError, match="one listener with the EPP's filter"):
        gen.standalone_bootstrap(S, S.pool, S.namespace, no_epp)
    no_route = copy.deepcopy(cfg)
    chart_envoy.epp_listener(no_route)[1]["route_config"]["virtual_hosts"][0]["routes"] = []
    with pytest.raises(chart_envoy.ChartEnvoyError, match="forwarding route"):
        gen.standalone_bootstrap(S, S.pool, S.namespace, no_route)
    templated = copy.deepcopy(cfg)
    templated["admin"]["address"]["socket_address"]["address"] = "{{ .Values.x }}"
    with pytest.raises(chart_envoy.ChartEnvoyError, match="tpl"):
        gen.values_standalone(S, templated)
