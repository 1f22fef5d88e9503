"""Cluster-mode persistence: the orchestrator's state in a ConfigMap, through the real kubernetes client
against a small fake API server (tests/support/kube_api.py: GET/PUT/POST configmaps, with the API server's
resourceVersion checks), a restart that restores the holder, and two writers that conflict instead of overwriting each other."""

from __future__ import annotations

import json

import pytest

from llmd_timeslice.discovery.kubernetes import make_api_client
from llmd_timeslice.orchestrator.errors import StateConflict, StateNotSaved
from llmd_timeslice.orchestrator.persistence import ConfigMapStateStore
from llmd_timeslice.orchestrator.server import OrchestratorServer
from tests.orchestrator.test_orchestrator import LEASE_INV, RecordingActions
from tests.support.kube_api import FakeKubeApi as FakeConfigMaps


@pytest.fixture
def apiserver():
    s = FakeConfigMaps()
    yield s
    s.stop()


async def test_state_survives_a_restart_in_a_configmap(apiserver):
    store = ConfigMapStateStore(make_api_client(host=apiserver.url), "ml", "orch-state")
    assert store.load() is None
    first = OrchestratorServer(LEASE_INV, port=0, actions=RecordingActions(), state_store=store)
    await first.start()
    await first.orchestrator.acquire("trainer", "g0")
    token = first.orchestrator.lease("trainer", "g0").token
    await first.stop()
    assert ("POST", "/api/v1/namespaces/ml/configmaps") in apiserver.requests, "created on first save"
    saved = json.loads(apiserver.items[("ml", "orch-state")]["data"]["state.json"])
    assert saved["groups"]["g0"]["holder"] == "trainer"
    second = OrchestratorServer(
        LEASE_INV,
        port=0,
        actions=RecordingActions(),
        state_store=ConfigMapStateStore(make_api_client(host=apiserver.url), "ml", "orch-state"),
    )
    await second.start()
    try:
        assert second.orchestrator.groups["g0"].holder == "trainer"
        await second.orchestrator.yield_("trainer", "g0", token)
    finally:
        await second.stop()


def _holder(apiserver) -> str:
    return json.loads(apiserver.items[("ml", "orch-state")]["data"]["state.json"])["groups"]["g"]["holder"]


def test_two_writers_of_one_configmap_conflict_instead_of_overwriting(apiserver):
    a = ConfigMapStateStore(make_api_client(host=apiserver.url), "ml", "orch-state")
    b = ConfigMapStateStore(make_api_client(host=apiserver.url), "ml", "orch-state")
    assert a.load() is None and b.load() is None
    a.save({"version": 1, "groups": {"g": {"holder": "a"}}})
    with pytest.raises(StateConflict, match=r"another writer.*HTTP 409"):
        b.save({"version": 1, "groups": {"g": {"holder": "b"}}})  # b would create what a created meanwhile
    assert _holder(apiserver) == "a", "nothing was overwritten"
    b.load()
    b.save({"version": 1, "groups": {"g": {"holder": "b"}}})  # b read a's write first: fine
    with pytest.raises(StateConflict, match="second orchestrator"):
        a.save({"version": 1, "groups": {"g": {"holder": "a2"}}})  # a's resourceVersion is stale now
    assert _holder(apiserver) == "b"
    assert apiserver.put_versions and all(apiserver.put_versions), "every replace carries a resourceVersion"


async def test_an_orchestrator_refuses_a_grant_when_another_wrote_its_configmap(apiserver):
    """The orchestrator's own writes check the version too: with a second writer on its ConfigMap, a grant cannot
    be saved, so it is not handed out (the acquire fails with the reason) and the other writer's state stands."""
    store = ConfigMapStateStore(make_api_client(host=apiserver.url), "ml", "orch-state")
    srv = OrchestratorServer(LEASE_INV, port=0, actions=RecordingActions(), state_store=store)
    await srv.start()
    try:
        other = ConfigMapStateStore(make_api_client(host=apiserver.url), "ml", "orch-state")
        other.load()
        other.save({"version": 1, "groups": {"g0": {"holder": "someone-else"}}})
        with pytest.raises(StateNotSaved, match="another writer"):
            await srv.orchestrator.acquire("trainer", "g0")
        assert srv.orchestrator.groups["g0"].holder is None
        saved = json.loads(apiserver.items[("ml", "orch-state")]["data"]["state.json"])
        assert saved["groups"]["g0"]["holder"] == "someone-else"
    finally:
        await srv.stop()


def test_forbidden_configmap_says_which_rbac_verb():
    s = FakeConfigMaps(deny=True)
    try:
        store = ConfigMapStateStore(make_api_client(host=s.url), "ml", "orch-state")
        with pytest.raises(RuntimeError, match="needs `get` on configmaps"):
            store.load()
        with pytest.raises(RuntimeError, match="update"):
            store.save({"version": 1, "groups": {}})
    finally:
        s.stop()
