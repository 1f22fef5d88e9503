"""Leader election of the orchestrator replicas (llmd_timeslice/orchestrator/election.py) through the real
``kubernetes`` client's leader election against the test API server (tests/support/kube_api.py: Leases with
resourceVersion conflicts): candidates racing for one Lease, the term that grows with every takeover, a
release that hands over at once, and the library's timing rules as one-line errors."""

from __future__ import annotations

import asyncio
import threading

import pytest
from kubernetes.leaderelection.leaderelectionrecord import LeaderElectionRecord

from llmd_timeslice.discovery.kubernetes import make_api_client
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.election import ElectionStopped, LeaderElector, TermLeaseLock, check_timings
from llmd_timeslice.orchestrator.server import OrchestratorServer
from tests.support.kube_api import FakeKubeApi
from tests.support.tcp_proxy import TcpProxy
from tests.support.waits import until

pytestmark = pytest.mark.timeout(60)
FAST = {"lease_duration_s": 2, "renew_deadline_s": 1.5, "retry_period_s": 1}


@pytest.fixture
def apiserver():
    s = FakeKubeApi()
    yield s
    s.stop()


def _candidate(apiserver, identity: str) -> LeaderElector:
    return LeaderElector(make_api_client(host=apiserver.url), "ml", "orch", identity, **FAST)


async def test_three_candidates_racing_for_a_free_lease_elect_exactly_one(apiserver):
    cands = [_candidate(apiserver, f"c{i}") for i in range(3)]
    for c in cands:
        c.start()
    try:
        waits = [asyncio.ensure_future(c.leading.wait()) for c in cands]
        await asyncio.wait(waits, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(2.5)  # more than a lease duration: the others keep following
        leaders = [c for c in cands if c.leading.is_set()]
        assert len(leaders) == 1, [c.identity for c in leaders]
        assert apiserver.lease("ml", "orch")["holderIdentity"] == leaders[0].identity
        assert leaders[0].term == 1 and not leaders[0].lost.is_set()
        assert all(c.leader == leaders[0].identity for c in cands), "followers know who leads"
        assert apiserver.lease("ml", "orch").get("leaseTransitions") == 0, "the Lease never changed hands"
    finally:
        await asyncio.gather(*(c.stop() for c in cands))


def test_two_writers_of_one_lease_version_one_wins_the_other_gets_409(apiserver):
    """What decides a race for a Lease: both read it at one resourceVersion, both replace it; the API server takes
    the first write and answers the second 409 Conflict, so the second candidate does not lead."""
    first = TermLeaseLock(make_api_client(host=apiserver.url), "orch", "ml", "first")
    second = TermLeaseLock(make_api_client(host=apiserver.url), "orch", "ml", "second")
    first.create("orch", "ml", LeaderElectionRecord("nobody", "2", "2026-01-01 00:00:00", "2026-01-01 00:00:00"))
    assert first.get("orch", "ml")[0] and second.get("orch", "ml")[0]
    assert first.update("orch", "ml", LeaderElectionRecord("first", "2", "2026-01-01 00:00:01", "2026-01-01 00:00:01"))
    assert not second.update("orch", "ml", LeaderElectionRecord("second", "2", "2026-01-01 00:00:01", "2026-01-01 00:00:01"))
    assert apiserver.conflicts == 1 and apiserver.lease("ml", "orch")["holderIdentity"] == "first"
    assert first.term == 2, "the holder changed (nobody -> first): leaseTransitions 1, term 2"


async def test_a_released_lease_goes_to_the_follower_with_a_higher_term(apiserver):
    a = _candidate(apiserver, "a")
    a.start()
    assert await asyncio.wait_for(a.wait_leading(), 10) == 1
    b = _candidate(apiserver, "b")
    b.start()
    try:
        await until(lambda: b.leader == "a", 10, what="b read the Lease held by a")  # and so follows
        assert not b.leading.is_set()
        await a.stop(release=True)
        assert await asyncio.wait_for(b.wait_leading(), 5) == 2, "term = leaseTransitions + 1"
        assert apiserver.lease("ml", "orch")["leaseTransitions"] == 1
    finally:
        await b.stop()


async def test_a_releasing_leader_hands_the_lease_back_without_waiting_out_its_retry_period(apiserver):
    """The election thread sleeps ``retry_period_s`` between renewals (15 s here); a stop with release waits only
    for a Lease call in flight, not for that sleep (it used to join the thread: a SIGTERMed orchestrator took up to
    a retry period to exit), and the thread writes the Lease no more after the release."""
    slow = {"lease_duration_s": 30, "renew_deadline_s": 20, "retry_period_s": 15}
    a = LeaderElector(make_api_client(host=apiserver.url), "ml", "orch", "a", **slow)
    a.start()
    assert await asyncio.wait_for(a.wait_leading(), 10) == 1
    await until(lambda: not a.lock.calling.locked(), what="the renewal done, the thread asleep")
    await asyncio.wait_for(a.stop(release=True), 10)  # a bound below the retry period, not a speed target
    assert not apiserver.lease("ml", "orch").get("holderIdentity"), "released"
    with pytest.raises(ElectionStopped):
        a.lock.get("orch", "ml")  # the thread's next call, after its sleep


async def test_a_leader_whose_lease_is_taken_loses_it(apiserver):
    a = _candidate(apiserver, "a")
    a.start()
    await asyncio.wait_for(a.wait_leading(), 10)
    try:
        apiserver.take_lease("ml", "orch", "intruder")  # as a takeover after a partition would
        await asyncio.wait_for(a.lost.wait(), 5)
        assert "intruder" in a.lost_reason
    finally:
        await a.stop()


async def test_a_deposed_leader_cut_off_from_the_api_server_stops_without_waiting_for_its_hung_lease_call(apiserver):
    """A leader that steps down (a fenced refusal) exits at once: ``stop()`` without release does not wait for the
    Lease call hanging on an unreachable API server (before: the process waited its renew deadline, 5 s, to exit)."""
    proxy = await TcpProxy("127.0.0.1", int(apiserver.url.rsplit(":", 1)[1])).start()
    timings = {"lease_duration_s": 6, "renew_deadline_s": 5, "retry_period_s": 1}
    a = LeaderElector(make_api_client(host=f"http://{proxy.address}"), "ml", "orch", "a", **timings)
    api = a.lock.api_instance
    calls = {"done": 0, "started": 0}

    def counted(call):
        def run(*args, **kwargs):
            calls["started"] += 1
            try:
                return call(*args, **kwargs)
            finally:
                calls["done"] += 1

        return run

    api.read_namespaced_lease = counted(api.read_namespaced_lease)
    api.replace_namespaced_lease = counted(api.replace_namespaced_lease)
    a.start()
    try:
        await asyncio.wait_for(a.wait_leading(), 10)
        done = calls["done"]
        await until(lambda: calls["done"] > done, 10, what="a renewal call answered")
        proxy.blackhole()  # the node is cut off: every Lease call from now on hangs until renew_deadline_s
        started = calls["started"]
        await until(lambda: calls["started"] > started, 10, what="a Lease call after the cut")
        await a.stop()
        assert a._thread is not None and a._thread.is_alive(), "stop() returned while the Lease call still hangs"
    finally:
        await proxy.stop()  # the hung call fails now: the thread ends
    await until(lambda: not a._thread.is_alive(), 10, what="the election thread ends")


class _HangingStore:
    """A state store whose saves hang until ``go`` is set once ``hang`` is (a ConfigMap write to an API server the
    node is cut off from)."""

    def __init__(self) -> None:
        self.hang, self.go, self.hanging = threading.Event(), threading.Event(), threading.Event()

    def load(self) -> dict | None:
        return None

    def save(self, state: dict) -> None:
        if self.hang.is_set():
            self.hanging.set()
            self.go.wait(30)


async def test_a_leader_that_stepped_down_stops_without_waiting_for_its_state_write_in_flight(apiserver):
    """A deposed leader's write in flight is refused or moot (a newer leader owns the state): its stop does not wait
    for it (before: a thawed leader cut off from the API server waited that write's request timeout to exit)."""
    inv = Inventory.model_validate({"groups": [{"group_id": "g"}]})
    store = _HangingStore()
    srv = OrchestratorServer(
        inv, port=0, token="t", reconcile_on_start=False, state_store=store, election=_candidate(apiserver, "a")
    )
    await srv.start()
    try:
        await asyncio.wait_for(srv.election.wait_leading(), 10)
        await until(lambda: srv.serving, 10, what="serving as the leader")
        store.hang.set()
        write = srv.orchestrator.persister.request()
        await asyncio.wait_for(asyncio.to_thread(store.hanging.wait), 10)
        srv.step_down("a test")
        await srv.stop()
        assert not write.done(), "stop() returned while the write still hangs"
    finally:
        store.go.set()


@pytest.mark.parametrize(
    ("timings", "message"),
    [
        ((2.5, 1.5, 1), "lease_duration_s must be whole seconds"),
        ((2, 1.5, 0.5), "retry_period_s must be at least 1 s"),
        ((3, 1.2, 1), r"renew_deadline_s \(1.2\) must be above 1.2 x retry_period_s"),
        ((2, 2, 1), r"lease_duration_s \(2\) must be above renew_deadline_s \(2\)"),
    ],
)
def test_timings_the_library_refuses_are_one_line_errors(timings, message):
    with pytest.raises(ValueError, match=message):
        check_timings(*timings)
