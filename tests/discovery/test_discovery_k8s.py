"""Kubernetes discovery and the serving label, through the real ``kubernetes`` client's HTTP layer.

The API server is a small fake (stdlib ``http.server`` in a thread) behind the same interface as the
real one: tests/support/kube_pods.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from llmd_timeslice.discovery.kubernetes import (
    LABEL_SERVING,
    STRATEGIC_MERGE_PATCH,
    DiscoveryDefaults,
    KubernetesDiscovery,
    KubernetesError,
    PodLabeler,
    make_api_client,
)
from llmd_timeslice.discovery.sync import InventorySync
from llmd_timeslice.domain.group_settings import GroupSpec, SamplerEndpoint
from llmd_timeslice.domain.switches import SwitchKind, SwitchRecord
from llmd_timeslice.orchestrator.actions import GrpcSwitchActions
from llmd_timeslice.orchestrator.groups import Orchestrator
from llmd_timeslice.orchestrator.phases import GroupState
from llmd_timeslice.orchestrator.switch import SwitchActions
from tests.support.cli import run_cli
from tests.support.kube_pods import NS, FakeKube, make_pod


@pytest.fixture
def kube():
    fake = FakeKube()
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def api(kube):
    client = make_api_client(host=kube.url)
    yield client
    client.close()


async def next_change(it, predicate=lambda specs: True, timeout: float = 5.0) -> list[GroupSpec]:
    deadline = time.monotonic() + timeout
    while True:
        specs = await asyncio.wait_for(it.__anext__(), max(0.01, deadline - time.monotonic()))
        if predicate(specs):
            return specs


def by_id(specs: list[GroupSpec]) -> dict[str, GroupSpec]:
    return {g.group_id: g for g in specs}


DEFAULTS = DiscoveryDefaults(default_pool="sampler-pool")


# --------------------------------------------------------------------------- discovery
async def test_discovery_builds_groups_from_labelled_pods(kube, api):
    kube.add(make_pod("s0", "g0", ip="10.0.0.1"))
    kube.add(
        make_pod(
            "s1",
            "g0",
            ip="10.0.0.2",
            labels={"timeslice.io/job-id": "job-1"},
            annotations={
                "timeslice.io/pool": "other",
                "timeslice.io/engine-port": "8200",
                "timeslice.io/sidecar-port": "9101",
                "timeslice.io/sleep-level": "2",
                "timeslice.io/drain-timeout-s": "15",
            },
        )
    )
    kube.add(make_pod("t0", "g1", role="trainer", ip="10.0.0.9"))
    kube.add(make_pod("not-ready", "g0", ip="10.0.0.3", ready=False))
    kube.add(make_pod("pending", "g0", ip="", phase="Pending", ready=False))
    kube.add(make_pod("leaving", "g0", ip="10.0.0.4", terminating=True))
    kube.add(make_pod("unlabelled", None, ip="10.0.0.5"))

    disc = KubernetesDiscovery(NS, api, defaults=DEFAULTS)
    try:
        specs = await disc.start()
    finally:
        await disc.stop()
    assert specs == [
        GroupSpec(
            "g0",
            [
                SamplerEndpoint("sampler-pool", "10.0.0.1:8000", "10.0.0.1:9001", "s0"),
                SamplerEndpoint("other", "10.0.0.2:8200", "10.0.0.2:9101", "job-1"),
            ],
            sleep_level=2,
            drain_timeout_s=15.0,
        ),
        GroupSpec("g1", []),
    ]
    assert disc.pod_for("10.0.0.2:8200") == "s1" and disc.pod_for("10.9.9.9:1") is None
    lists = kube.seen("GET", watch=False)
    assert lists and lists[0]["query"]["labelSelector"] == "timeslice.io/group"


def _upstream_pod(ports_by_container: dict[str, int]) -> dict:
    """A sampler pod whose containers are named as given (each with one port), after our sidecar."""
    pod = make_pod("up", "g0", ip="10.0.0.7")
    sidecar = pod["spec"]["containers"][1]
    pod["spec"]["containers"] = [
        sidecar,
        *(
            {"name": name, "image": "vllm", "ports": [{"name": "modelserver", "containerPort": port}]}
            for name, port in ports_by_container.items()
        ),
    ]
    return pod


@pytest.mark.parametrize(
    "containers, port",
    [
        # llm-d's guides name the vLLM container `modelserver` and its port `modelserver`
        # (tests/fixtures/llm-d-guide/modelserver/decode-deployment.yaml, upstream's shape).
        ({"modelserver": 8123}, 8123),
        ({"vllm": 8124}, 8124),  # older manifests: still found
        ({"vllm": 8126, "modelserver": 8125}, 8125),  # both: modelserver wins, whatever the order
        ({"engine": 8127}, 8000),  # neither: DiscoveryDefaults.engine_port
    ],
)
def test_engine_port_comes_from_the_container_named_modelserver_as_upstream_names_it(containers, port):
    from llmd_timeslice.discovery.kubernetes import pod_member

    member = pod_member(_upstream_pod(containers), DEFAULTS)
    assert member.sampler.address == f"10.0.0.7:{port}"
    assert member.sampler.sidecar == "10.0.0.7:9001", "the sidecar's ts-grpc port, not the engine's"


async def test_watch_added_modified_deleted_update_groups(kube, api):
    kube.add(make_pod("s0", "g0", ip="10.0.0.1"))
    kube.add(make_pod("s1", "g0", ip="10.0.0.2", ready=False))
    disc = KubernetesDiscovery(NS, api, defaults=DEFAULTS)
    specs = await disc.start()
    list_rv = str(kube.rv)
    it = disc.changes()
    try:
        assert [s.address for s in specs[0].samplers] == ["10.0.0.1:8000"]
        # ADDED: a ready sampler of a new group.
        kube.add(make_pod("s2", "g2", ip="10.0.0.7"))
        got = await next_change(it, lambda s: "g2" in by_id(s))
        assert [s.address for s in by_id(got)["g2"].samplers] == ["10.0.0.7:8000"]
        watch = kube.seen("GET", watch=True)[0]["query"]
        assert watch["resourceVersion"] == list_rv and watch["allowWatchBookmarks"] in ("true", "True")
        # MODIFIED: s1 turns Ready -> joins; s2 moves to another pool.
        kube.modify("s1", lambda p: p["status"]["conditions"][0].update(status="True"))
        got = await next_change(it, lambda s: len(by_id(s)["g0"].samplers) == 2)
        assert [s.address for s in by_id(got)["g0"].samplers] == ["10.0.0.1:8000", "10.0.0.2:8000"]
        kube.modify("s2", lambda p: p["metadata"]["annotations"].update({"timeslice.io/pool": "p2"}))
        got = await next_change(it, lambda s: by_id(s)["g2"].samplers[0].pool == "p2")
        # Readiness lost later (e.g. a sleeping engine) does not remove a member.
        kube.modify("s1", lambda p: p["status"]["conditions"][0].update(status="False"))
        # DELETED.
        kube.delete("s0")
        got = await next_change(it, lambda s: len(by_id(s)["g0"].samplers) == 1)
        assert [s.address for s in by_id(got)["g0"].samplers] == ["10.0.0.2:8000"]
        assert disc.relists == 1  # all of it from one list + the watch
    finally:
        await disc.stop()
    assert disc.groups() == got


async def test_410_gone_triggers_a_relist(kube, api):
    kube.add(make_pod("s0", "g0", ip="10.0.0.1"))
    disc = KubernetesDiscovery(NS, api, defaults=DEFAULTS, backoff_s=0.05)
    await disc.start()
    it = disc.changes()
    try:
        for _ in range(100):
            if kube.seen("GET", watch=True):
                break
            await asyncio.sleep(0.02)
        # A pod appears while the client's resourceVersion falls out of the history: no event for it.
        kube.add(make_pod("s1", "g0", ip="10.0.0.2"), record=False)
        kube.expire_history()
        got = await next_change(it, lambda s: len(by_id(s)["g0"].samplers) == 2)
        assert [s.address for s in got[0].samplers] == ["10.0.0.1:8000", "10.0.0.2:8000"]
        assert disc.relists == 2 and len(kube.seen("GET", watch=False)) == 2
        # And it watches on from the new list's resourceVersion.
        kube.add(make_pod("s2", "g0", ip="10.0.0.3"))
        await next_change(it, lambda s: len(by_id(s)["g0"].samplers) == 3)
        # 410 as the HTTP status of the watch request itself (not an ERROR event): also a re-list.
        kube.fail_next_watch = [410]
        kube.add(make_pod("s3", "g0", ip="10.0.0.4"), record=False)  # only a re-list can see it
        kube.end_watches()
        await next_change(it, lambda s: len(by_id(s)["g0"].samplers) == 4)
        assert disc.relists == 3
    finally:
        await disc.stop()


async def test_watch_errors_back_off_then_resume(kube, api):
    kube.add(make_pod("s0", "g0", ip="10.0.0.1"))
    kube.fail_next_watch = [500, 500]
    disc = KubernetesDiscovery(NS, api, defaults=DEFAULTS, backoff_s=0.05)
    await disc.start()
    it = disc.changes()
    try:
        kube.add(make_pod("s1", "g0", ip="10.0.0.2"))
        await next_change(it, lambda s: len(s[0].samplers) == 2)
        assert "500" in disc.last_error and "watch" in disc.last_error
        watches = kube.seen("GET", watch=True)
        assert len(watches) >= 3 and len(kube.seen("GET", watch=False)) == 1  # resumed, no re-list
    finally:
        await disc.stop()


async def test_list_forbidden_at_start_names_the_rbac_verb(kube, api):
    kube.forbid = {"list"}
    disc = KubernetesDiscovery(NS, api)
    with pytest.raises(KubernetesError) as err:
        await disc.start()
    msg = str(err.value)
    assert err.value.status == 403 and "'list'" in msg and NS in msg and "cannot list resource" in msg, msg


async def test_group_settings_come_from_pod_annotations_and_reach_the_orchestrator(kube, api):
    """Bug 2 of issue 16: in Kubernetes mode only the sleep level and the drain timeout were read; the scheduling
    policy, job priorities, lease TTL, sleep-level policy and per-job sleep levels were dropped (FIFO and defaults
    always). Group-wide settings come from any member pod; per-job ones from the job's own pods."""
    kube.add(
        make_pod(
            "s0",
            "g0",
            ip="10.0.0.1",
            annotations={
                "timeslice.io/lease-ttl-s": "12",
                "timeslice.io/scheduling-policy": "priority",
                "timeslice.io/sleep-level-policy": "auto",
            },
        )
    )
    kube.add(
        make_pod(
            "t-a",
            "g0",
            role="trainer",
            ip="10.0.0.8",
            labels={"timeslice.io/job-id": "job-a"},
            annotations={"timeslice.io/job-priority": "5", "timeslice.io/job-sleep-level": "2"},
        )
    )
    kube.add(
        make_pod(
            "t-b",
            "g0",
            role="trainer",
            ip="10.0.0.9",
            labels={"timeslice.io/job-id": "job-b"},
            annotations={"timeslice.io/job-priority": "-1"},
        )
    )
    disc = KubernetesDiscovery(NS, api, defaults=DEFAULTS)
    try:
        specs = await disc.start()
    finally:
        await disc.stop()
    g0 = by_id(specs)["g0"]
    got = (g0.lease_ttl_s, g0.policy, g0.sleep_level_policy, g0.job_priorities, g0.job_sleep_levels)
    assert got == (12.0, "priority", "auto", {"job-a": 5, "job-b": -1}, {"job-a": 2}), got
    # The orchestrator is built from them at start (inventory_from_specs) and applies them on change.
    from llmd_timeslice.discovery.sync import inventory_from_specs

    built = by_id(inventory_from_specs(specs).group_specs())["g0"]
    assert (built.lease_ttl_s, built.policy, built.job_priorities, built.job_sleep_levels) == (
        12.0,
        "priority",
        {"job-a": 5, "job-b": -1},
        {"job-a": 2},
    )
    orch = Orchestrator([GroupSpec("g0", list(g0.samplers))], InnerActions())
    try:
        await InventorySync(orch).apply(specs)
        spec = orch.groups["g0"].spec
        assert (spec.lease_ttl_s, spec.policy, spec.sleep_level_policy, spec.job_priorities) == (
            12.0,
            "priority",
            "auto",
            {"job-a": 5, "job-b": -1},
        )
    finally:
        await orch.close()


@pytest.mark.parametrize(
    "key, value, why",
    [
        ("timeslice.io/sleep-level", "3", "Input should be less than or equal to 2"),
        ("timeslice.io/drain-timeout-s", "0", "Input should be greater than 0"),
        ("timeslice.io/drain-timeout-s", "7200", "Input should be less than or equal to 3600"),
        ("timeslice.io/lease-ttl-s", "forever", "Input should be a valid number, unable to parse string as a number"),
        ("timeslice.io/scheduling-policy", "lifo", "Input should be 'fifo', 'priority' or 'round_robin'"),
        ("timeslice.io/sleep-level-policy", "sometimes", "Input should be 'fixed' or 'auto'"),
        ("timeslice.io/job-priority", "high", "Input should be a valid integer, unable to parse string as an integer"),
        ("timeslice.io/job-sleep-level", "0", "Input should be greater than or equal to 1"),
        ("timeslice.io/yield-request-fraction", "1.5", "Input should be less than or equal to 1"),
        ("timeslice.io/yield-request-bands", "eval", "Input should be a valid integer, unable to parse string as an integer"),
        ("timeslice.io/min-training-s", "-1", "Input should be greater than or equal to 0"),
        ("timeslice.io/yield-opt-out", "maybe", "Input should be a valid boolean, unable to interpret input"),
    ],
)
async def test_a_malformed_settings_annotation_is_ignored_naming_pod_key_and_value(kube, api, caplog, key, value, why):
    kube.add(make_pod("t0", "g0", role="trainer", ip="10.0.0.9", annotations={key: value}))
    disc = KubernetesDiscovery(NS, api, defaults=DEFAULTS)
    try:
        with caplog.at_level("WARNING", logger="llmd_timeslice.discovery.kubernetes"):
            specs = await disc.start()
    finally:
        await disc.stop()
    assert f"pod t0: annotation {key}={value!r} is invalid ({why}); ignored" in caplog.text
    assert specs[0].settings() == GroupSpec("g0").settings(), "defaults kept"


async def test_an_async_on_change_is_kept_while_it_runs(kube, api):
    """Bug 4 of issue 16: discovery started an async ``on_change`` as a task it kept no reference to; a task blocked
    on something only it references was garbage-collected mid-flight ("Task was destroyed but it is pending")."""
    import gc
    import weakref

    kube.add(make_pod("s0", "g0", ip="10.0.0.1"))
    refs: list[weakref.ref] = []
    done: list = []

    async def on_change(specs):
        fut = asyncio.get_running_loop().create_future()  # referenced only by this coroutine
        refs.append(weakref.ref(fut))
        await fut
        done.append(specs)

    disc = KubernetesDiscovery(NS, api, defaults=DEFAULTS, on_change=on_change)
    await disc.start()
    try:
        kube.add(make_pod("s1", "g0", ip="10.0.0.2"))
        deadline = time.monotonic() + 5
        while not refs:
            assert time.monotonic() < deadline, "on_change was not called"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0)
        gc.collect()
        fut = refs[0]()
        assert fut is not None, "the on_change task was collected mid-flight"
        fut.set_result(None)
        for _ in range(100):
            if done:
                break
            await asyncio.sleep(0.01)
        assert done and len(done[0][0].samplers) == 2
    finally:
        await disc.stop()


# --------------------------------------------------------------------------- labeler
async def test_labeler_sends_a_strategic_merge_patch(kube, api):
    kube.add(make_pod("s0", "g0", ip="10.0.0.1"))
    disc = KubernetesDiscovery(NS, api, defaults=DEFAULTS)
    specs = await disc.start()
    try:
        labeler = PodLabeler(NS, api, disc.pod_for)
        sampler = specs[0].samplers[0]
        await labeler.set_serving(sampler, False)
        patch = kube.seen("PATCH")[-1]
        assert patch["path"] == f"/api/v1/namespaces/{NS}/pods/s0"
        assert patch["content_type"] == STRATEGIC_MERGE_PATCH
        assert patch["body"] == {"metadata": {"labels": {LABEL_SERVING: "false"}}}
        assert kube.pods["s0"]["metadata"]["labels"][LABEL_SERVING] == "false"
        await labeler.set_serving(sampler, True)
        assert kube.seen("PATCH")[-1]["body"] == {"metadata": {"labels": {LABEL_SERVING: "true"}}}
        assert disc.groups() == specs  # the label is not part of the contract: no group change
    finally:
        await disc.stop()


async def test_labeler_403_names_the_missing_verb_and_404_is_skipped(kube, api):
    kube.add(make_pod("s0", "g0", ip="10.0.0.1"))
    labeler = PodLabeler(NS, api, lambda s: "s0", backoff_s=0.01)
    kube.forbid = {"patch"}
    with pytest.raises(KubernetesError) as err:
        await labeler.set_serving(SamplerEndpoint("p", "10.0.0.1:8000", "10.0.0.1:9001", "s0"), False)
    msg = str(err.value)
    assert "403" in msg and "RBAC verb 'patch'" in msg and NS in msg and "label-fallback" in msg, msg
    assert len(kube.seen("PATCH")) == 1  # not retried
    kube.forbid = set()
    PodLabeler(NS, api, lambda s: "gone").patch_serving("gone", True)  # 404: logged, no error
    with pytest.raises(KubernetesError, match="no pod known"):
        await PodLabeler(NS, api, lambda s: None).set_serving(SamplerEndpoint("p", "1.2.3.4:1", "1.2.3.4:2", "j"), True)


def test_labeler_repeats_transient_failures_with_a_doubling_wait_then_gives_up(kube, api):
    kube.add(make_pod("s0", "g0", ip="10.0.0.1"))
    labeler = PodLabeler(NS, api, lambda s: "s0", attempts=3, backoff_s=0.05)
    kube.fail_next_patch = [503, 429]
    started = time.monotonic()
    labeler.patch_serving("s0", False)
    assert len(kube.seen("PATCH")) == 3 and kube.pods["s0"]["metadata"]["labels"][LABEL_SERVING] == "false"
    assert time.monotonic() - started >= 0.05 + 0.1  # waited 0.05 s, then 0.1 s
    kube.fail_next_patch = [500, 500, 500]
    with pytest.raises(KubernetesError, match="500"):
        labeler.patch_serving("s0", True)
    assert len(kube.seen("PATCH")) == 6, "three attempts, then the error"
    assert kube.pods["s0"]["metadata"]["labels"][LABEL_SERVING] == "false"


# --------------------------------------------------------------------------- actions hook
class FakeHub:
    def __init__(self, log: list) -> None:
        self.log = log
        self.state: dict[str, dict] = {}

    async def publish(self, pool, updates):
        for address, state, _ in updates:
            self.state.setdefault(pool, {})[address] = state
            self.log.append(("publish", address, state))
        return 1, []

    async def publish_coalesced(self, pool, updates):  # GateHub's in-service publication (shared epochs)
        return await self.publish(pool, updates)

    async def wait_drained(self, pool, addresses, timeout_s, cut=None):
        self.log.append(("drain", tuple(addresses)))
        return True, {}


class RecordingLabeler:
    def __init__(self, log: list, fail: bool = False) -> None:
        self.log, self.fail = log, fail

    async def set_serving(self, sampler, serving):
        self.log.append(("label", sampler.address, serving))
        if self.fail:
            raise KubernetesError("403 no patch for you", 403)


SPEC = GroupSpec(
    "g0",
    [SamplerEndpoint("p", "10.0.0.1:8000", "10.0.0.1:9001", "s0"), SamplerEndpoint("p", "10.0.0.2:8000", "10.0.0.2:9001", "s1")],
)


async def _no_sidecar(self, sampler, group, kind, config, weights=None, residual_budget_bytes=0, spec=None):
    from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as spb

    self.sampler_states[sampler.address] = "ok"
    return spb.GetOperationResponse(status=spb.OPERATION_STATUS_COMPLETE)  # what a sidecar's completed operation says


async def test_switch_actions_label_draining_false_and_serving_true(monkeypatch):
    from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb

    monkeypatch.setattr(GrpcSwitchActions, "_operation", _no_sidecar)
    log: list = []
    acts = GrpcSwitchActions(FakeHub(log), labeler=RecordingLabeler(log))
    await acts.drain_samplers(SPEC, SwitchRecord("g0", SwitchKind.TO_JOB, "t", 0))
    await acts.suspend_samplers(SPEC, SwitchRecord("g0", SwitchKind.TO_JOB, "t", 0))
    draining = [i for i, e in enumerate(log) if e[0] == "publish" and e[2] == gpb.ENDPOINT_STATE_DRAINING]
    labels = [i for i, e in enumerate(log) if e[0] == "label"]
    drain = next(i for i, e in enumerate(log) if e[0] == "drain")
    assert {log[i][1:] for i in labels} == {("10.0.0.1:8000", False), ("10.0.0.2:8000", False)}
    assert max(draining) < min(labels) and max(labels) < drain  # after DRAINING, before the drain barrier
    log.clear()
    await acts.resume_samplers(SPEC, SwitchRecord("g0", SwitchKind.TO_SAMPLERS, "t", 0))
    for addr in ("10.0.0.1:8000", "10.0.0.2:8000"):
        label = log.index(("label", addr, True))
        assert log.index(("publish", addr, gpb.ENDPOINT_STATE_SERVING)) > label  # labelled, then SERVING

    # A failed label fails the suspend (the router would keep sending) and leaves a woken sampler out of service.
    log.clear()
    acts = GrpcSwitchActions(FakeHub(log), labeler=RecordingLabeler(log, fail=True))
    with pytest.raises(RuntimeError, match="serving label false"):
        await acts.drain_samplers(SPEC, SwitchRecord("g0", SwitchKind.TO_JOB, "t", 0))
    with pytest.raises(RuntimeError, match="serving label true"):
        await acts.resume_samplers(SPEC, SwitchRecord("g0", SwitchKind.TO_SAMPLERS, "t", 0))
    assert acts.hub.state["p"] == {"10.0.0.1:8000": gpb.ENDPOINT_STATE_ASLEEP, "10.0.0.2:8000": gpb.ENDPOINT_STATE_ASLEEP}
    # Without a labeler nothing is labelled.
    log.clear()
    await GrpcSwitchActions(FakeHub(log)).drain_samplers(SPEC, SwitchRecord("g0", SwitchKind.TO_JOB, "t", 0))
    assert not [e for e in log if e[0] == "label"]


# --------------------------------------------------------------------------- runtime group changes
class InnerActions(SwitchActions):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[str]]] = []
        self.hub = FakeHub([])

    async def retire_samplers(self, samplers):
        for s in samplers:
            await self.hub.publish(s.pool, [(s.address, 3, None)])  # ASLEEP

    async def suspend_samplers(self, spec, record):
        self.calls.append(("suspend", spec.group_id, [s.address for s in spec.samplers]))
        await asyncio.sleep(0.01)

    async def resume_samplers(self, spec, record):
        self.calls.append(("resume", spec.group_id, [s.address for s in spec.samplers]))
        for s in spec.samplers:
            await self.hub.publish(s.pool, [(s.address, 1, None)])
        await asyncio.sleep(0.01)


def sampler(i: int, pool: str = "p") -> SamplerEndpoint:
    return SamplerEndpoint(pool, f"10.0.0.{i}:8000", f"10.0.0.{i}:9001", f"s{i}")


async def wait_state(g, state, timeout=2.0):
    deadline = time.monotonic() + timeout
    while g.state is not state:
        assert time.monotonic() < deadline, g.state
        await asyncio.sleep(0.005)


async def test_sync_adds_and_removes_samplers_without_racing_switches():
    inner = InnerActions()
    orch = Orchestrator([GroupSpec("g0", [sampler(1)])], inner)
    sync = InventorySync(orch)
    g = orch.groups["g0"]

    # Idle group: the new sampler is woken/verified (resume of just it), then serves.
    await sync.apply([GroupSpec("g0", [sampler(1), sampler(2)])])
    assert inner.calls == [("resume", "g0", ["10.0.0.2:8000"])]
    assert [s.address for s in g.spec.samplers] == ["10.0.0.1:8000", "10.0.0.2:8000"]

    # A trainer holds the group: a new sampler joins the spec but is not resumed now...
    await orch.acquire("trainer", "g0")
    assert inner.calls[-1] == ("suspend", "g0", ["10.0.0.1:8000", "10.0.0.2:8000"])
    await sync.apply([GroupSpec("g0", [sampler(1), sampler(2), sampler(3)], sleep_level=2)])
    assert inner.calls[-1][0] == "suspend" and g.spec.sleep_level == 1  # settings deferred
    # ...the resume after the yield wakes and publishes it with the others, then the settings apply.
    await orch.yield_("trainer", "g0")
    await wait_state(g, GroupState.IDLE)
    assert inner.calls[-1] == ("resume", "g0", ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"])
    for _ in range(100):
        if g.spec.sleep_level == 2:
            break
        await asyncio.sleep(0.01)
    assert g.spec.sleep_level == 2

    # Removed (pod deleted): out of service at the gates, gone from the spec; the next switch skips it.
    await sync.apply([GroupSpec("g0", [sampler(2), sampler(3)], sleep_level=2)])
    assert inner.hub.state["p"]["10.0.0.1:8000"] == 3  # ASLEEP
    await orch.acquire("trainer", "g0")
    assert inner.calls[-1] == ("suspend", "g0", ["10.0.0.2:8000", "10.0.0.3:8000"])
    await orch.yield_("trainer", "g0")
    await wait_state(g, GroupState.IDLE)

    # A new group appears with a sampler: created and its sampler served.
    await sync.apply([GroupSpec("g0", [sampler(2), sampler(3)], sleep_level=2), GroupSpec("g1", [sampler(5, "q")])])
    assert inner.calls[-1] == ("resume", "g1", ["10.0.0.5:8000"]) and "g1" in orch.groups
    await orch.close()


async def test_sync_change_during_a_switch_waits_for_the_switch():
    inner = InnerActions()
    gate = asyncio.Event()

    async def slow_suspend(spec, record):
        inner.calls.append(("suspend", spec.group_id, [s.address for s in spec.samplers]))
        await gate.wait()

    inner.suspend_samplers = slow_suspend
    orch = Orchestrator([GroupSpec("g0", [sampler(1)])], inner)
    sync = InventorySync(orch)
    acquire = asyncio.create_task(orch.acquire("trainer", "g0"))
    while not inner.calls:
        await asyncio.sleep(0.001)
    apply = asyncio.create_task(sync.apply([GroupSpec("g0", [sampler(1), sampler(2)])]))
    await asyncio.sleep(0.05)
    assert not apply.done() and len(orch.groups["g0"].spec.samplers) == 1  # waits for the suspend
    gate.set()
    await acquire
    await apply
    # Added while LOCKED: in the spec, not resumed (not served) until the yield.
    assert [c[0] for c in inner.calls] == ["suspend"] and len(orch.groups["g0"].spec.samplers) == 2
    await orch.close()


# --------------------------------------------------------------------------- the CLI, end to end
def _kubeconfig(tmp_path, url: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{url}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: u, namespace: {NS}}}}}]
current-context: fake
""")
    return str(path)


def _cli_env(tmp_path, url: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "LLMD_TIMESLICE_"))}
    env["KUBECONFIG"] = _kubeconfig(tmp_path, url)
    return env


def test_cli_orchestrator_with_kubernetes_discovery(kube, tmp_path):
    from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as pb
    from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as pb_grpc
    from tests.conftest import free_port

    kube.add(make_pod("t0", "g0", role="trainer", ip="10.0.0.9"))
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmd_timeslice.cli",
            "orchestrator",
            "--discovery",
            "kubernetes",
            "--port",
            str(port),
            "--log-level",
            "info",
        ],
        env=_cli_env(tmp_path, kube.url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.TimeSliceOrchestratorServiceStub(ch)
            groups = stub.ListGroups(pb.ListGroupsRequest(), timeout=90, wait_for_ready=True).group_ids
            assert list(groups) == ["g0"]
            kube.add(make_pod("t1", "g-new", role="trainer", ip="10.0.0.10"))
            deadline = time.monotonic() + 30
            while "g-new" not in stub.ListGroups(pb.ListGroupsRequest(), timeout=5).group_ids:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert kube.seen("GET", watch=True)[0]["query"]["resourceVersion"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err


def test_cli_kubernetes_errors_are_one_line(kube, tmp_path):
    kube.forbid = {"list"}
    r = subprocess.run(  # a process: the discovery's first list runs in the command's event loop
        [sys.executable, "-m", "llmd_timeslice.cli", "orchestrator", "--discovery", "kubernetes", "--port", "0"],
        env=_cli_env(tmp_path, kube.url),
        capture_output=True,
        text=True,
        timeout=90,  # a bound on a hang, not a speed: a loaded 2-core machine starts the CLI in 20+ s
    )
    assert r.returncode == 2 and "RBAC verb 'list'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = run_cli("orchestrator", "--manage-serving-label", "--inventory", __file__)
    assert r.returncode == 2 and "--discovery kubernetes" in r.stderr
    r = run_cli("orchestrator")
    assert r.returncode == 2 and "--inventory" in r.stderr and "required" in r.stderr


@pytest.mark.parametrize(
    "domain",
    [
        "timeslice.io",  # upstream today (llm-d-rl-time-slicing 6cf8e9b07c60 infrastructure/kubernetes.go)
        "timeslicing.llm-d.ai",  # proposed by its issue #43
        "timeslicing.k8s.io",  # proposed by its issue #43
    ],
)
def test_upstreams_group_and_job_id_labels_are_read_in_each_spelling(domain):
    from llmd_timeslice.discovery.kubernetes import pod_member

    pod = make_pod("p", None, labels={f"{domain}/group": "g7", f"{domain}/job-id": "job-a"})
    member = pod_member(pod, DEFAULTS)
    assert (member.group, member.job_id, member.sampler.address) == ("g7", "job-a", "10.0.0.1:8000")


def test_a_pod_whose_label_spellings_disagree_is_skipped_naming_both(caplog):
    from llmd_timeslice.discovery.kubernetes import pod_member

    agree = make_pod("same", "g1", labels={"timeslicing.llm-d.ai/group": "g1"})
    assert pod_member(agree, DEFAULTS).group == "g1", "the same value in two spellings is one label"
    pod = make_pod("p", "g1", labels={"timeslice.io/job-id": "a", "timeslicing.k8s.io/job-id": "b"})
    with caplog.at_level("WARNING"):
        assert pod_member(pod, DEFAULTS) is None
    assert (
        "pod p skipped: its labels spell one upstream label with different values: "
        "timeslice.io/job-id='a', timeslicing.k8s.io/job-id='b'"
    ) in caplog.text
