"""The label fallback's queue-wait budget follows the EPP it is written for: the pinned llm-d-router (v0.10.0, as v0.9.0) has one
``defaultRequestTTL`` for the empty and the saturated pool, so it must be ``max_hold_s``; an EPP with
``noEndpointRequestTTL`` (llm-d-router #2284, bba90136ff12, after v0.10.0) gets only that, and a saturated pool keeps
the EPP's own ``defaultRequestTTL`` (shed early instead of queued for ``max_hold_s``)."""

from __future__ import annotations

import pytest
import yaml

from tests.manifests.support import S, gen, values


def _layered(text: str) -> dict:
    epp = yaml.safe_load(text)["router"]["epp"]
    return yaml.safe_load(epp["pluginsCustomConfig"][epp["pluginsConfigFile"]])


def _release(flow_control: dict) -> dict:
    epc = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig", "flowControl": flow_control}
    return {"router": {"epp": {"pluginsConfigFile": "c.yaml", "pluginsCustomConfig": {"c.yaml": yaml.safe_dump(epc)}}}}


def test_the_pinned_epp_has_one_ttl_so_the_empty_pool_hold_is_default_request_ttl():
    assert gen.EPP_HAS_NO_ENDPOINT_REQUEST_TTL[gen.EPP_VERSION] is False
    fc = values("values-flow-control.yaml")["router"]["epp"]
    cfg = yaml.safe_load(fc["pluginsCustomConfig"][fc["pluginsConfigFile"]])
    assert cfg["flowControl"] == {"defaultRequestTTL": f"{S.max_hold_s:g}s"}
    text = (gen.GUIDE / "router" / "values-flow-control.yaml").read_text()
    assert "noEndpointRequestTTL (#2284, after v0.10.0)" in text and "429 rejected-ttl-expired" in text


def test_an_epp_with_no_endpoint_request_ttl_holds_only_the_empty_pool_for_max_hold(monkeypatch):
    monkeypatch.setitem(gen.EPP_HAS_NO_ENDPOINT_REQUEST_TTL, "vX-with-2284", True)
    assert gen.flow_control_ttl(S, "vX-with-2284") == {"noEndpointRequestTTL": f"{S.max_hold_s:g}s"}
    monkeypatch.setattr(gen.flow_control, "EPP_VERSION", "vX-with-2284")
    layered = _layered(gen.flow_control_values(S, _release({"defaultRequestTTL": "30s", "maxRequests": "100"})))
    assert layered["flowControl"] == {
        "defaultRequestTTL": "30s",  # the release's own budget for a saturated pool, kept
        "maxRequests": "100",
        "noEndpointRequestTTL": f"{S.max_hold_s:g}s",
    }
    assert "flowControl" in layered["featureGates"]


def test_on_the_pinned_epp_the_layered_config_sets_default_request_ttl():
    layered = _layered(gen.flow_control_values(S, _release({"defaultRequestTTL": "30s"})))
    assert layered["flowControl"] == {"defaultRequestTTL": f"{S.max_hold_s:g}s"}


def test_an_epp_version_not_checked_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"llm-d-router v9\.9\.9: not checked for flowControl\.noEndpointRequestTTL"):
        gen.flow_control_ttl(S, "v9.9.9")
