"""The orchestrator's Kubernetes reconcile loop (llmd_timeslice/discovery/reconcile.py): pods watched through the
real ``kubernetes`` client's HTTP layer (the fake API server of tests/support/kube_pods.py), each change applied
to a real :class:`~llmd_timeslice.orchestrator.groups.Orchestrator` by its group's worker: a watch event, a
410 Gone answered by a re-list, an apply that fails for one group while the others apply, API errors backed off."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import pytest

from llmd_timeslice.discovery import reconcile
from llmd_timeslice.discovery.kubernetes import DiscoveryDefaults, KubernetesDiscovery, make_api_client
from llmd_timeslice.discovery.reconcile import Reconciler
from llmd_timeslice.domain.group_settings import GroupSpec, SamplerEndpoint
from llmd_timeslice.orchestrator.groups import Orchestrator
from llmd_timeslice.orchestrator.spec_updates import SpecUpdates
from llmd_timeslice.orchestrator.switch import SwitchActions
from tests.support.kube_pods import NS, FakeKube, make_pod

DEFAULTS = DiscoveryDefaults(default_pool="p")


class Actions(SwitchActions):
    """Samplers that wake and sleep at once; records which samplers each wake was for."""

    def __init__(self) -> None:
        self.woken: list[tuple[str, list[str]]] = []
        self.retired: list[str] = []

    async def suspend_samplers(self, spec, record) -> None:
        await asyncio.sleep(0)

    async def resume_samplers(self, spec, record) -> None:
        self.woken.append((spec.group_id, [s.address for s in spec.samplers]))
        await asyncio.sleep(0)

    async def retire_samplers(self, samplers) -> None:
        self.retired.extend(s.address for s in samplers)


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


class Loop:
    """Discovery -> reconciler -> orchestrator, wired as ``llmd-timeslice orchestrator --discovery kubernetes``."""

    def __init__(self, api, backoff_s: float = 0.05) -> None:
        self.actions = Actions()
        self.reconciler = Reconciler(backoff_s=backoff_s, backoff_max_s=1.0)
        self.disc = KubernetesDiscovery(NS, api, defaults=DEFAULTS, on_change=self.reconciler.submit, backoff_s=backoff_s)
        self.orch: Orchestrator | None = None

    async def start(self) -> Loop:
        specs = await self.disc.start()
        self.orch = Orchestrator(specs, self.actions)
        await self.orch.start(reconcile=False)
        self.reconciler.start(self.orch)
        return self

    def samplers(self, gid: str) -> list[str]:
        assert self.orch is not None
        g = self.orch.groups.get(gid)
        return [] if g is None else [s.address for s in g.spec.samplers]

    async def stop(self) -> None:
        await self.reconciler.close()
        await self.disc.stop()
        if self.orch is not None:
            await self.orch.close()


async def until(predicate, timeout_s: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        await asyncio.sleep(0.01)


async def _watching(kube: FakeKube, n: int = 1) -> None:
    await until(lambda: len(kube.seen("GET", watch=True)) >= n, what="a watch request")


async def test_watch_events_reach_the_orchestrators_groups(kube, api):
    kube.add(make_pod("s0", "g0", ip="10.0.0.1"))
    loop = await Loop(api).start()
    try:
        assert loop.samplers("g0") == ["10.0.0.1:8000"]
        # ADDED: a ready sampler joins g0, woken and verified (just it) before it serves.
        kube.add(make_pod("s1", "g0", ip="10.0.0.2"))
        await until(lambda: loop.samplers("g0") == ["10.0.0.1:8000", "10.0.0.2:8000"], what="s1 in g0")
        await loop.reconciler.settled()
        assert loop.actions.woken == [("g0", ["10.0.0.2:8000"])]
        # A trainer pod of a new group: the group is created.
        kube.add(make_pod("t0", "g-new", role="trainer", ip="10.0.0.9"))
        await until(lambda: loop.orch is not None and "g-new" in loop.orch.groups, what="group g-new")
        # MODIFIED (a settings annotation) and DELETED.
        kube.modify("s1", lambda p: p["metadata"]["annotations"].update({"timeslice.io/drain-timeout-s": "7"}))
        await until(lambda: loop.orch is not None and loop.orch.groups["g0"].spec.drain_timeout_s == 7.0, what="settings")
        kube.delete("s0")
        await until(lambda: loop.samplers("g0") == ["10.0.0.2:8000"], what="s0 gone")
        await loop.reconciler.settled()
        assert loop.actions.retired == ["10.0.0.1:8000"] and loop.reconciler.failures == {}
        assert loop.disc.relists == 1  # all of it from one list and the watch
    finally:
        await loop.stop()


async def test_410_gone_is_answered_by_a_relist_whose_change_is_applied(kube, api):
    kube.add(make_pod("s0", "g0", ip="10.0.0.1"))
    loop = await Loop(api).start()
    try:
        await _watching(kube)
        # A pod appears while the watch's resourceVersion falls out of the history: no event for it, only a list.
        kube.add(make_pod("s1", "g0", ip="10.0.0.2"), record=False)
        kube.expire_history()
        await until(lambda: loop.samplers("g0") == ["10.0.0.1:8000", "10.0.0.2:8000"], what="s1 after the re-list")
        assert loop.disc.relists == 2 and len(kube.seen("GET", watch=False)) == 2
        # And the watch goes on from the new list's resourceVersion: a later event is applied too.
        kube.add(make_pod("s2", "g0", ip="10.0.0.3"))
        await until(lambda: len(loop.samplers("g0")) == 3, what="s2")
        assert loop.disc.relists == 2
    finally:
        await loop.stop()


async def test_an_apply_failing_for_one_group_leaves_the_others_applied_and_is_retried(kube, api, monkeypatch, caplog):
    kube.add(make_pod("a0", "g0", ip="10.0.0.1"))
    kube.add(make_pod("b0", "g1", ip="10.0.1.1"))
    attempts: list[float] = []
    real = SpecUpdates._apply

    async def failing_for_g1(self, spec, replies):
        if self._g.group_id == "g1" and len(attempts) < 2:
            attempts.append(time.monotonic())
            raise RuntimeError("injected fault applying g1")  # a bug in the group: GroupFault to the caller
        await real(self, spec, replies)

    monkeypatch.setattr(SpecUpdates, "_apply", failing_for_g1)
    errors_before = reconcile.APPLIES.labels(result="error")._value.get()
    loop = await Loop(api, backoff_s=0.1).start()
    caplog.set_level(logging.WARNING, logger=reconcile.__name__)
    try:
        await _watching(kube)
        kube.add(make_pod("a1", "g0", ip="10.0.0.2"))
        kube.add(make_pod("b1", "g1", ip="10.0.1.2"))
        # g0 applies while g1 keeps failing.
        await until(lambda: len(loop.samplers("g0")) == 2, what="g0 applied")
        await until(lambda: loop.reconciler.failures.get("g1") == 1, what="g1's first failure")
        assert "internal error in SPEC_UPDATE" in loop.reconciler.last_error["g1"]  # the group's GroupFault
        # g1: failed twice (logged, counted), then applied by the retry.
        await until(lambda: len(loop.samplers("g1")) == 2, what="g1 applied after its retries")
        await loop.reconciler.settled()
        assert loop.reconciler.failures == {"g1": 2} and loop.reconciler.last_error == {"g0": "", "g1": ""}
        assert reconcile.APPLIES.labels(result="error")._value.get() - errors_before == 2
        failed = [r.getMessage() for r in caplog.records if "applying the discovered spec failed" in r.getMessage()]
        assert len(failed) == 2 and all(m.startswith("group g1:") and "injected fault applying g1" in m for m in failed)
        # The retry waited the back-off (at least backoff_s, doubling), not at once.
        assert attempts[1] - attempts[0] >= 0.1
        assert ("g0", ["10.0.0.2:8000"]) in loop.actions.woken and ("g1", ["10.0.1.2:8000"]) in loop.actions.woken
    finally:
        await loop.stop()


async def test_a_failure_is_retried_with_the_latest_spec_of_its_group(kube, api, monkeypatch):
    kube.add(make_pod("b0", "g1", ip="10.0.1.1"))
    sent: list[list[str]] = []
    real = SpecUpdates._apply

    async def first_fails(self, spec, replies):
        sent.append([s.address for s in spec.samplers])
        if len(sent) == 1:
            raise RuntimeError("injected fault")
        await real(self, spec, replies)

    monkeypatch.setattr(SpecUpdates, "_apply", first_fails)
    loop = await Loop(api, backoff_s=5.0).start()  # a long back-off: the newer spec must cut it short
    try:
        await _watching(kube)
        kube.add(make_pod("b1", "g1", ip="10.0.1.2"))
        await until(lambda: len(sent) == 1, what="the failed apply")
        kube.add(make_pod("b2", "g1", ip="10.0.1.3"))
        await until(lambda: len(loop.samplers("g1")) == 3, timeout_s=3.0, what="the latest spec applied")
        assert sent[-1] == ["10.0.1.1:8000", "10.0.1.2:8000", "10.0.1.3:8000"] and loop.reconciler.failures == {"g1": 1}
    finally:
        await loop.stop()


async def test_api_errors_are_backed_off_then_the_watch_resumes_and_applies(kube, api):
    kube.add(make_pod("s0", "g0", ip="10.0.0.1"))
    kube.fail_next_watch = [500, 500, 503]
    loop = await Loop(api, backoff_s=0.05).start()
    try:
        kube.add(make_pod("s1", "g0", ip="10.0.0.2"))
        await until(lambda: len(loop.samplers("g0")) == 2, what="s1 applied after the errors")
        watches = [r["at"] for r in kube.seen("GET", watch=True)]
        assert len(watches) >= 4 and len(kube.seen("GET", watch=False)) == 1  # resumed from its resourceVersion
        gaps = [b - a for a, b in itertools.pairwise(watches[:4])]  # after each of the 3 errors
        assert all(gap >= 0.05 * 2**i for i, gap in enumerate(gaps)), gaps  # a doubling wait after each error
        assert "503" in loop.disc.last_error and "watch" in loop.disc.last_error
        assert loop.reconciler.failures == {}
    finally:
        await loop.stop()


async def test_snapshots_submitted_before_start_are_applied_once_started():
    actions = Actions()
    orch = Orchestrator([GroupSpec("g0")], actions)
    await orch.start(reconcile=False)
    r = Reconciler()
    smp = SamplerEndpoint("p", "10.0.0.1:8000", "10.0.0.1:9001", "s0")
    r.submit([GroupSpec("g0", [smp]), GroupSpec("g1")])
    assert orch.groups["g0"].spec.samplers == []  # not started: nothing applied
    r.start(orch)
    await r.settled()
    assert orch.groups["g0"].spec.samplers == [smp] and "g1" in orch.groups
    # A group gone from discovery keeps existing with no samplers (it may hold a lease).
    r.submit([GroupSpec("g1")])
    await r.settled()
    assert orch.groups["g0"].spec.samplers == [] and actions.retired == ["10.0.0.1:8000"]
    await r.close()
    r.submit([GroupSpec("g0", [smp])])  # closed: ignored
    await asyncio.sleep(0.02)
    assert orch.groups["g0"].spec.samplers == []
    await orch.close()
