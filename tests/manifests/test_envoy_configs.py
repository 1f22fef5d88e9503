"""Every Envoy configuration a variant produces, as that variant's Envoy runs it: ``envoy --mode validate`` with the
variant's own version, the gate contract on the effective (Istio-, Envoy Gateway-merged) configs, the flood limits."""

from __future__ import annotations

import inspect

import pytest
import yaml

from llmd_timeslice.router.envoy_config import (
    EnvoyRouterConfig,
    render_bootstrap,
)
from tests.manifests.support import (
    GUIDE,
    SUBSET_NS,
    S,
    _assert_gate_contract,
    _hcm_filters,
    _names,
    built,
    envoy_gateway_effective_config,
    envoy_validate_all,
    find,
    gen,
    istio_effective_config,
    values,
)
from tests.support.envoy_versions import envoy_binary_of, makefile_extra_versions, wheel_version

# ------------------------------------------------------------- every Envoy config, validated


def test_istio_with_two_pools_sends_each_routes_own_pool_to_the_gate(tmp_path):
    """Defect 12: one Gateway, two InferencePools. Each route's requests reach the gate with their pool."""
    ef = gen.istio_ext_proc_envoyfilter(S, extra_pools={"other-pool": "other-pool-v1"})
    pools = {gen.istio_route_name(S): S.pool, gen.istio_route_name(S, "other-pool-v1"): "other-pool"}
    boot = istio_effective_config(ef, pools)
    routes = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"][
        "virtual_hosts"
    ][0]["routes"]
    sent = {
        r["name"]: r["typed_per_filter_config"][gen.GATE_FILTER_NAME]["overrides"]["grpc_initial_metadata"][0]["value"]
        for r in routes
    }
    assert sent == pools
    gate = _hcm_filters(boot, "gw")[1][0]
    assert "initial_metadata" not in gate["typed_config"]["grpc_service"], "a listener-level pool would win for both"
    envoy_validate_all({"istio-two-pools": boot}, tmp_path, {"istio-two-pools": gen.ENVOY_VERSIONS["istio-ext-proc"]})


def test_envoy_gateway_generated_gate_filter_meets_the_gate_contract():
    _, gate = envoy_gateway_effective_config()
    _assert_gate_contract(gate)


def test_every_envoy_config_passes_envoy_validate(tmp_path):
    ef = find(built("gateways/istio-ext-proc"), "EnvoyFilter")
    configs = {
        "standalone": yaml.safe_load((GUIDE / "router" / "standalone-envoy.yaml").read_text()),
        "values-standalone": gen.render_chart_envoy_yaml(
            (GUIDE / "router" / "values-standalone.yaml").read_text(), S.pool, S.namespace
        ),
        "istio": istio_effective_config(ef),
        "istio-fast-path": istio_effective_config(find(built("gateways/istio"), "EnvoyFilter")),
        "envoy-gateway": envoy_gateway_effective_config()[0],
    }
    istio_names = _names(_hcm_filters(configs["istio"], "gw")[1])
    assert istio_names.index(gen.GATE_FILTER_NAME) < istio_names.index(gen.EPP_FILTER_NAME)
    epp = _hcm_filters(configs["istio"], "gw")[1][1]["typed_config"]["metadata_options"]
    assert SUBSET_NS in epp["forwarding_namespaces"]["untyped"] and "envoy.lb" in epp["forwarding_namespaces"]["untyped"]
    eg_names = _names(_hcm_filters(configs["envoy-gateway"], "gw")[1])
    assert eg_names[0].endswith("/extproc/0") and eg_names[1].endswith("/extproc/1"), "gate first on Envoy Gateway"
    envoy_validate_all(configs, tmp_path, CONFIG_ENVOY_VERSIONS)


CONFIG_ENVOY_VERSIONS = {
    "standalone": gen.ENVOY_VERSIONS["standalone"],
    "values-standalone": gen.ENVOY_VERSIONS["standalone"],
    "istio": gen.ENVOY_VERSIONS["istio-ext-proc"],
    "istio-fast-path": gen.ENVOY_VERSIONS["istio"],
    "envoy-gateway": gen.ENVOY_VERSIONS["envoy-gateway"],
}
"""Each validated configuration -> the Envoy version of the variant that runs it."""


def test_each_variant_is_validated_with_the_envoy_it_runs_and_make_setup_installs_it():
    """Issue 25 defect 1: one Envoy (the wheel's) validated every variant, while each gateway runs its own. Every
    Envoy-based variant has its version (cited in manifests/families/envoy.py), the Makefile installs each one the venv's wheel is
    not, and the standalone values pin the proxy image to the version the bootstrap is validated with (the chart's
    default, distroless-v1.33.2, refuses ``status_on_error``)."""
    assert set(gen.ENVOY_VERSIONS) == {"standalone", "istio", "istio-ext-proc", "envoy-gateway"}
    assert set(CONFIG_ENVOY_VERSIONS.values()) == set(gen.ENVOY_VERSIONS.values())
    assert sorted(set(gen.ENVOY_VERSIONS.values()) - {wheel_version()}) == sorted(makefile_extra_versions())
    for v in gen.ENVOY_VERSIONS.values():
        envoy_binary_of(v)  # installed, and that version
    image = values("values-standalone.yaml")["router"]["proxy"]["image"]
    assert image == f"docker.io/envoyproxy/envoy:distroless-v{gen.ENVOY_VERSIONS['standalone']}", image
    major_minor = tuple(int(x) for x in gen.ENVOY_VERSIONS["standalone"].split(".")[:2])
    assert major_minor >= (1, 36), "ExternalProcessor.status_on_error needs Envoy 1.36+"


def test_gate_and_epp_connections_lift_envoys_outbound_flood_limits():
    """Every ext_proc stream Envoy ends sends one RST_STREAM, and Envoy closes an HTTP/2 connection whose queue of
    such frames passes ``max_outbound_control_frames`` (default 1,000): a release of 2,000 held requests to a
    CPU-starved EPP failed hundreds of them that way (tests/gate/test_gate_envoy.py). Every HTTP/2 cluster of every
    rendered Envoy config (the gate's and the EPP's) must allow more than a full hold queue (``max_held``)."""
    from epp_plugin.gate.pool_state import PoolState

    max_held = inspect.signature(PoolState).parameters["max_held"].default
    configs = {
        "local": render_bootstrap(EnvoyRouterConfig(listen_port=1, admin_port=2, gate_port=3, epp_port=4, gate_edge="ext_proc")),
        "standalone": yaml.safe_load((GUIDE / "router" / "standalone-envoy.yaml").read_text()),
        "values-standalone": gen.render_chart_envoy_yaml(
            (GUIDE / "router" / "values-standalone.yaml").read_text(), S.pool, S.namespace
        ),
        # the cluster the fast path's EnvoyFilter adds (the istio-ext-proc variant adds none: there, as for the
        # EPP, Istio builds the clusters)
        "istio-fast-path": find(built("gateways/istio"), "EnvoyFilter"),
    }

    def http2_options(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "http2_protocol_options":
                    yield v
                else:
                    yield from http2_options(v)
        elif isinstance(node, list):
            for v in node:
                yield from http2_options(v)

    for name, cfg in configs.items():
        # Clusters only: the chart's own listener keeps its downstream (client) HTTP/2 options.
        found = list(http2_options(cfg.get("static_resources", {}).get("clusters", cfg)))
        assert found, f"{name}: no HTTP/2 cluster"
        for opts in found:
            assert opts.get("max_outbound_control_frames", 1000) > max_held, (name, opts)
            assert opts.get("max_outbound_frames", 10_000) > 2 * max_held, (name, opts)


def test_envoy_validate_rejects_a_broken_config(tmp_path):
    """The validation above is real: Envoy refuses an unknown processing mode."""
    cfg = istio_effective_config(find(built("gateways/istio-ext-proc"), "EnvoyFilter"))
    _hcm_filters(cfg, "gw")[1][0]["typed_config"]["processing_mode"]["response_trailer_mode"] = "SENDING"
    with pytest.raises(AssertionError, match="envoy --mode validate rejected"):
        envoy_validate_all({"broken": cfg}, tmp_path)
