"""Orchestrator core and its gRPC edge with the TimeSlice client (in-memory switch actions)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from llmd_timeslice.client import AcquireTimeout, LeaseError, TimeSliceOrchestratorClient
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.domain.switches import SwitchKind
from llmd_timeslice.orchestrator.errors import NotHolder, SwitchFailed, UnknownGroup
from llmd_timeslice.orchestrator.groups import Orchestrator
from llmd_timeslice.orchestrator.phases import GroupState
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.orchestrator.switch import SwitchActions
from tests.support.waits import until


class RecordingActions(SwitchActions):
    """Switch actions that record calls; ``fail_suspend`` makes the next suspend raise."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail_suspend = False

    async def suspend_samplers(self, spec, record):
        await asyncio.sleep(0.01)
        if self.fail_suspend:
            self.fail_suspend = False
            raise RuntimeError("sidecar said no")
        self.calls.append("suspend")

    async def resume_samplers(self, spec, record):
        await asyncio.sleep(0.01)
        self.calls.append("resume")


INVENTORY = Inventory.model_validate(
    {
        "groups": [
            {
                "group_id": "g0",
                "samplers": [
                    {"pool": "default", "address": "127.0.0.1:8001", "sidecar": "127.0.0.1:9101", "job_id": "sampler-0"}
                ],
            },
            {"group_id": "trainers-only"},
        ],
    }
)


async def test_switch_sequence_suspend_grant_yield_resume():
    acts = RecordingActions()
    orch = Orchestrator(INVENTORY.group_specs(), acts)
    await orch.acquire("trainer", "g0")
    g = orch.groups["g0"]
    assert acts.calls == ["suspend"] and g.state is GroupState.LOCKED and g.holder == "trainer"
    res = await orch.yield_("trainer", "g0")
    assert res.pending_waiters == 0 and not res.snapshot_deferred
    for _ in range(100):
        if g.state is GroupState.IDLE:
            break
        await asyncio.sleep(0.01)
    assert acts.calls == ["suspend", "resume"] and g.state is GroupState.IDLE


async def test_errors_name_the_problem():
    orch = Orchestrator(INVENTORY.group_specs(), RecordingActions())
    with pytest.raises(UnknownGroup, match="known groups"):
        await orch.acquire("j", "nope")
    with pytest.raises(NotHolder, match="does not hold"):
        await orch.yield_("j", "g0")
    await orch.acquire("j", "g0")
    with pytest.raises(NotHolder, match="already holds"):
        await orch.acquire("j", "g0")


async def test_failed_suspend_fails_the_acquire_and_wakes_samplers_again():
    acts = RecordingActions()
    acts.fail_suspend = True
    orch = Orchestrator(INVENTORY.group_specs(), acts)
    with pytest.raises(SwitchFailed, match="sidecar said no"):
        await orch.acquire("trainer", "g0")
    await asyncio.sleep(0.1)
    assert acts.calls == ["resume"] and orch.groups["g0"].holder is None


async def test_group_without_samplers_defers_snapshot_and_same_job_reacquires_at_once():
    orch = Orchestrator(INVENTORY.group_specs(), RecordingActions())
    await orch.acquire("a", "trainers-only")
    res = await orch.yield_("a", "trainers-only")
    assert res.snapshot_deferred and orch.groups["trainers-only"].state is GroupState.IDLE_YIELDED
    r = await orch.acquire("a", "trainers-only")
    assert r.waited_ms == 0


@pytest.fixture
def orchestrator_server(loop_thread):
    srv = OrchestratorServer(INVENTORY, port=0, actions=RecordingActions(), token="s3cret")
    loop_thread.run(srv.start())
    yield srv
    loop_thread.run(srv.stop())


def test_two_jobs_contending_for_one_group_are_served_fifo(orchestrator_server):
    target = f"127.0.0.1:{orchestrator_server.port}"
    order: list[str] = []
    lock = threading.Lock()
    first = TimeSliceOrchestratorClient(target, job_id="job-a", group_id="g0", token="s3cret")
    first.acquire()

    def contender(job: str, delay: float) -> None:
        time.sleep(delay)
        c = TimeSliceOrchestratorClient(target, job_id=job, group_id="g0", token="s3cret")
        with c.on_accelerators(timeout_sec=30):
            with lock:
                order.append(job)
            time.sleep(0.05)

    threads = [threading.Thread(target=contender, args=(j, d)) for j, d in (("job-b", 0.0), ("job-c", 0.2))]
    for t in threads:
        t.start()
    time.sleep(0.5)
    status = first.group_status()
    assert status.group.locking_job == "job-a" and status.group.waiter_queue_depth == 2
    res = first.release()
    assert res.pending_waiters == 2
    for t in threads:
        t.join(10)
    assert order == ["job-b", "job-c"], f"grants were not FIFO: {order}"


def test_client_errors_say_what_happened(orchestrator_server):
    target = f"127.0.0.1:{orchestrator_server.port}"
    holder = TimeSliceOrchestratorClient(target, job_id="h", group_id="g0", token="s3cret")
    holder.acquire()
    waiter = TimeSliceOrchestratorClient(target, job_id="w", group_id="g0", token="s3cret")
    with pytest.raises(AcquireTimeout):
        waiter.acquire(timeout_sec=0.3)
    with pytest.raises(LeaseError, match="NOT_FOUND"):
        waiter.acquire(group_id="missing", timeout_sec=1)
    with pytest.raises(LeaseError, match="FAILED_PRECONDITION"):
        waiter.release()
    holder.release()


def test_call_without_or_with_wrong_token_is_unauthenticated(orchestrator_server):
    target = f"127.0.0.1:{orchestrator_server.port}"
    for token in ("", "wrong"):
        c = TimeSliceOrchestratorClient(target, job_id="x", group_id="g0", token=token)
        with pytest.raises(LeaseError, match="UNAUTHENTICATED"):
            c.list_groups()


LEASE_INV = Inventory.model_validate({"groups": [{"group_id": "g0", "lease_ttl_s": 0.3}]})


async def test_lease_expires_only_after_heartbeats_stop_and_the_group_is_reclaimed():
    orch = Orchestrator(LEASE_INV.group_specs(), RecordingActions())
    await orch.acquire("upstream-client", "g0")
    await asyncio.sleep(0.5)
    assert orch.groups["g0"].holder == "upstream-client", "a holder that never heartbeats is never expired"
    await orch.yield_("upstream-client", "g0")
    await orch.acquire("trainer", "g0")
    token = orch.lease("trainer", "g0").token
    for _ in range(4):  # heartbeats keep it alive past the TTL
        await orch.heartbeat("trainer", "g0", token)
        await asyncio.sleep(0.15)
    assert orch.groups["g0"].holder == "trainer"
    waiter = asyncio.create_task(orch.acquire("next", "g0"))
    await asyncio.wait_for(waiter, 2)  # heartbeats stopped: expired (0.3 s), reclaimed, granted to the waiter
    assert orch.groups["g0"].holder == "next"
    with pytest.raises(NotHolder, match=r"lease .* expired"):
        await orch.yield_("trainer", "g0")


async def test_stale_fencing_token_is_rejected_on_every_call():
    from llmd_timeslice.orchestrator.errors import StaleFencingToken

    orch = Orchestrator(LEASE_INV.group_specs(), RecordingActions())
    await orch.acquire("job", "g0")
    old = orch.lease("job", "g0").token
    await orch.yield_("job", "g0", old)
    await orch.acquire("job", "g0")
    new = orch.lease("job", "g0").token
    assert new > old
    with pytest.raises(StaleFencingToken, match="stale"):
        await orch.heartbeat("job", "g0", old)
    with pytest.raises(StaleFencingToken, match="stale"):
        await orch.yield_("job", "g0", old)
    await orch.yield_("job", "g0", new)


def test_client_heartbeats_keep_the_lease_and_a_silent_holder_loses_it(loop_thread):
    srv = OrchestratorServer(LEASE_INV, port=0, actions=RecordingActions(), token="s3cret")
    loop_thread.run(srv.start())
    target = f"127.0.0.1:{srv.port}"
    try:
        a = TimeSliceOrchestratorClient(target, job_id="a", group_id="g0", token="s3cret")
        a.acquire()
        time.sleep(1.0)  # > 3 TTLs: the background heartbeats renew it
        assert a.group_status().group.locking_job == "a"
        a.release()
        b = TimeSliceOrchestratorClient(target, job_id="b", group_id="g0", token="s3cret")
        b.acquire()
        b._beats[("b", "g0")].stop()  # the holder hangs: no more heartbeats
        deadline = time.monotonic() + 10
        while (status := b.group_status()).group.locking_job != "":  # expired one TTL (0.3 s) after its last heartbeat
            assert time.monotonic() < deadline, "the silent holder's lease never expired"
            time.sleep(0.05)
        assert [(a.job_id, a.job_state) for a in status.agent_job_states] == [("b", status.agent_job_states[0].STATE_FAULTED)], (
            "the expired job is reported FAULTED"
        )
        with pytest.raises(LeaseError, match="expired"):
            b.release()
    finally:
        loop_thread.run(srv.stop())


async def test_lock_order_trainer_group_before_sampler_group():
    from llmd_timeslice.orchestrator.errors import LockOrderViolation

    orch = Orchestrator(INVENTORY.group_specs(), RecordingActions())
    await orch.acquire("job", "trainers-only")  # trainer group first: fine
    await orch.acquire("job", "g0")  # then the sampler group: fine (weight sync holds both)
    await orch.yield_("job", "g0")
    await orch.yield_("job", "trainers-only")
    await orch.acquire("other", "g0")
    with pytest.raises(LockOrderViolation, match="take the trainer group first"):
        await orch.acquire("other", "trainers-only")


class _SamplerInventory:
    INV = Inventory.model_validate(
        {
            "groups": [
                {
                    "group_id": "g0",
                    "lease_ttl_s": 30,
                    "samplers": [
                        {"pool": "default", "address": "127.0.0.1:8001", "sidecar": "127.0.0.1:9101", "job_id": "sampler-0"}
                    ],
                },
                {
                    "group_id": "g1",
                    "samplers": [
                        {"pool": "default", "address": "127.0.0.1:8002", "sidecar": "127.0.0.1:9102", "job_id": "sampler-1"}
                    ],
                },
            ]
        }
    )


class ReconcilingActions(RecordingActions):
    async def resume_samplers(self, spec, record):
        if record.kind is SwitchKind.RECONCILE:
            self.calls.append(("reconcile", [spec.group_id]))
        else:
            await super().resume_samplers(spec, record)

    async def publish_asleep(self, spec):
        self.calls.append(("asleep", [spec.group_id]))


async def test_orchestrator_restart_keeps_holders_and_fencing_tokens_and_wakes_only_free_groups(tmp_path):
    from llmd_timeslice.orchestrator.persistence import FileStateStore

    store = FileStateStore(tmp_path / "state.json")
    first = OrchestratorServer(_SamplerInventory.INV, port=0, actions=ReconcilingActions(), state_store=store)
    await first.start()
    await first.orchestrator.acquire("trainer", "g0")
    token = first.orchestrator.lease("trainer", "g0").token
    await first.orchestrator.heartbeat("trainer", "g0", token)
    await first.stop()  # "crash": the trainer never yielded

    acts = ReconcilingActions()
    second = OrchestratorServer(_SamplerInventory.INV, port=0, actions=acts, state_store=store)
    await second.start()
    try:
        g0 = second.orchestrator.groups["g0"]
        assert g0.holder == "trainer" and g0.state.value == "LOCKED"
        assert ("asleep", ["g0"]) in acts.calls, "a held group's samplers stay asleep after a restart"
        assert ("reconcile", ["g1"]) in acts.calls, "free groups' samplers are woken and verified"
        await second.orchestrator.heartbeat("trainer", "g0", token)  # same fencing token still valid
        assert g0.lease.expires_at is not None, "an armed lease keeps expiring after a restart"
        await second.orchestrator.yield_("trainer", "g0", token)
        await asyncio.sleep(0.1)
        assert "resume" in acts.calls
    finally:
        await second.stop()


class BreakableStore:
    """A state store that works until ``broken`` is set (a full disk, an API server refusing writes)."""

    def __init__(self) -> None:
        self.broken = False
        self.saved: dict | None = None

    def load(self):
        return None

    def save(self, state: dict) -> None:
        if self.broken:
            raise OSError("No space left on device")
        self.saved = state


async def test_a_grant_whose_state_cannot_be_saved_fails_the_acquire_and_the_group_goes_on():
    """Bug 3 of issue 16: the save failed inside the grant, the group stayed LOCKED with an unarmed lease and the
    acquire never returned. Now the grant is taken back, the acquire fails with the reason (ABORTED on the wire),
    the samplers are woken again, and the group works once the store does."""
    store = BreakableStore()
    acts = RecordingActions()
    srv = OrchestratorServer(INVENTORY, port=0, actions=acts, state_store=store)
    await srv.start()
    g = srv.orchestrator.groups["g0"]
    try:
        store.broken = True
        with pytest.raises(SwitchFailed, match=r"could not be saved .*No space left on device"):
            await asyncio.wait_for(srv.orchestrator.acquire("trainer", "g0"), 10)
        for _ in range(200):
            if g.state is GroupState.IDLE:
                break
            await asyncio.sleep(0.01)
        assert g.state is GroupState.IDLE and g.holder is None and g.lease is None
        assert acts.calls[-2:] == ["suspend", "resume"], "the samplers were woken again"
        store.broken = False
        await asyncio.wait_for(srv.orchestrator.acquire("trainer", "g0"), 10)
        assert g.holder == "trainer" and store.saved["groups"]["g0"]["holder"] == "trainer"
    finally:
        await srv.stop()


def test_corrupt_state_file_is_refused_with_its_path(tmp_path):
    from llmd_timeslice.orchestrator.persistence import FileStateStore

    f = tmp_path / "state.json"
    f.write_text("{not json")
    with pytest.raises(ValueError, match=r"state\.json"):
        FileStateStore(f).load()


async def test_async_client_heartbeats_keep_the_lease_and_report_loss():
    from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient, LeaseLost

    srv = OrchestratorServer(LEASE_INV, port=0, actions=RecordingActions(), token="s3cret")
    await srv.start()
    try:
        c = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{srv.port}", job_id="a", group_id="g0", token="s3cret")
        async with c.on_accelerators():
            await asyncio.sleep(1.0)  # > 3 TTLs: renewed in the background
            assert srv.orchestrator.groups["g0"].holder == "a"
        await c.acquire()
        await asyncio.sleep(0.15)  # the first heartbeat arms the lease
        beat = c._beats[("a", "g0")]
        beat.stop()  # then the holder hangs
        await until(lambda: srv.orchestrator.groups["g0"].holder is None, 10, what="the silent holder's lease expired")
        beat.lost = "stopped by the test"
        with pytest.raises(LeaseLost):
            await c.release()
        await c.close()
    finally:
        await srv.stop()


async def _grant_order(policy: str, priorities: dict | None = None, warmup: tuple = ()) -> list[str]:
    inv = Inventory.model_validate({"groups": [{"group_id": "g", "policy": policy, "job_priorities": priorities or {}}]})
    orch = Orchestrator(inv.group_specs(), RecordingActions())
    for job in warmup:  # earlier grants (round-robin remembers them)
        await orch.acquire(job, "g")
        await orch.yield_(job, "g")
    await orch.acquire("holder", "g")
    order: list[str] = []

    async def one(job):
        await orch.acquire(job, "g", timeout_s=5)
        order.append(job)
        await orch.yield_(job, "g")

    tasks = []
    for job in ("a", "b", "c"):
        tasks.append(asyncio.create_task(one(job)))
        await asyncio.sleep(0.01)  # arrival order a, b, c
    await orch.yield_("holder", "g")
    await asyncio.gather(*tasks)
    return order


async def test_scheduling_policies_fifo_priority_round_robin():
    assert await _grant_order("fifo") == ["a", "b", "c"]
    assert await _grant_order("priority", {"c": 5, "b": 1}) == ["c", "b", "a"]
    # a and b were granted before; c never: round-robin serves c first, then the least recently granted.
    assert await _grant_order("round_robin", warmup=("b", "a")) == ["c", "b", "a"]


def test_client_config_from_environment_and_both_groups_in_lock_order(monkeypatch):
    monkeypatch.setenv("TIMESLICE_ORCH_ADDR", "127.0.0.1:1")
    monkeypatch.setenv("TIMESLICE_JOB_ID", "env-job")
    monkeypatch.setenv("TIMESLICE_TRAINER_GROUP", "trainers-only")
    monkeypatch.setenv("TIMESLICE_SAMPLER_GROUP", "g0")
    c = TimeSliceOrchestratorClient()
    assert (c.target, c.job_id, c.group_id, c.sampler_group_id) == ("127.0.0.1:1", "env-job", "trainers-only", "g0")
    c.close()


def test_on_both_groups_takes_trainer_then_sampler_group(loop_thread):
    srv = OrchestratorServer(INVENTORY, port=0, actions=RecordingActions(), token="s3cret")
    loop_thread.run(srv.start())
    try:
        c = TimeSliceOrchestratorClient(
            f"127.0.0.1:{srv.port}", job_id="sync-job", group_id="trainers-only", sampler_group_id="g0", token="s3cret"
        )
        with c.on_both_groups(timeout_sec=10):
            groups = srv.orchestrator.groups
            assert groups["trainers-only"].holder == "sync-job" and groups["g0"].holder == "sync-job"
        assert srv.orchestrator.groups["g0"].holder is None
        c.close()
    finally:
        loop_thread.run(srv.stop())


def test_unreachable_orchestrator_is_reported_as_such():
    """After the client's own retries of UNAVAILABLE (its 5 attempts; their back-off shortened to 0.05-0.1 s by the
    caller's service config: ~3 s with the client's; tests/client/test_client_error_reasons.py runs it as it comes)."""
    import json

    from llmd_timeslice.client import OrchestratorUnavailable
    from llmd_timeslice.client import client as client_module

    config = json.loads(client_module._SERVICE_CONFIG)
    config["methodConfig"][0]["retryPolicy"].update(initialBackoff="0.05s", maxBackoff="0.1s")
    c = TimeSliceOrchestratorClient(
        "127.0.0.1:1", job_id="j", group_id="g", token="x", channel_options=[("grpc.service_config", json.dumps(config))]
    )
    with pytest.raises(OrchestratorUnavailable, match="unreachable"):
        c.acquire(timeout_sec=5)
    c.close()
