"""Scenarios of the group state machine, one a phase edge (``test_group_machine.py`` walks them all): acquire, spec,
audit and repair from each phase, drain, suspend, the held lease, deferral, resume, repair and abandon."""

from __future__ import annotations

import asyncio

import pytest

from llmd_timeslice.domain.group_settings import GroupSpec
from llmd_timeslice.domain.switches import EngineReading
from llmd_timeslice.orchestrator.errors import StateNotSaved, SwitchFailed
from llmd_timeslice.orchestrator.phases import (
    GroupState,
)
from llmd_timeslice.weights.update import WeightUpdate
from tests.orchestrator.group_machine_support import (
    S1,
    S2,
    S3,
    Env,
    FlakyPersister,
    P,
    spec_s,
)


# --------------------------------------------------------------------------------------------- scenarios
async def _free_acquire(e: Env):
    await e.held("t")
    assert e.g("t").phase is P.HELD


async def _free_spec_settings(e: Env):
    await e.orch.update_spec(GroupSpec("t", lease_ttl_s=5))
    assert e.g("t").phase is P.FREE and e.g("t").spec.lease_ttl_s == 5


async def _free_spec_adds_samplers(e: Env):
    await e.orch.update_spec(GroupSpec("t", [S3]))
    assert e.g("t").phase is P.SERVING and ("resume", "t", [S3.address]) in e.acts.calls


async def _free_start(e: Env):
    await e.orch.start(reconcile=True)
    assert e.g("t").phase is P.FREE


async def _serving_acquire(e: Env):
    await e.draining()


async def _serving_spec_settings(e: Env):
    await e.orch.update_spec(spec_s(S1, S2, drain_timeout_s=7))
    assert e.g().phase is P.SERVING and e.g().spec.drain_timeout_s == 7


async def _serving_spec_adds(e: Env):
    await e.orch.update_spec(spec_s(S1, S2, S3))
    assert e.g().phase is P.SERVING and e.acts.calls[-1] == ("resume", "s", [S3.address])


async def _serving_spec_removes_all(e: Env):
    await e.orch.update_spec(spec_s())
    assert e.g().phase is P.FREE


async def _serving_audit(e: Env):
    e.orch.start_repair(audit_interval_s=10)
    e.acts.readings = {S1.address: EngineReading(None, False), S2.address: EngineReading(None, False)}
    e.clock.advance(10)
    await e.g().wait_until(lambda g: ("read", "s", [S1.address, S2.address]) in e.acts.calls, 5)
    await asyncio.sleep(0)
    await e.wait(P.SERVING, pred=lambda g: not g.repair.reading)
    assert not e.g().sampler_errors


async def _serving_audit_fault(e: Env):
    e.orch.start_repair(audit_interval_s=10)
    e.acts.readings = {S1.address: EngineReading(None, True)}  # asleep while it should serve
    e.acts.hold.add("resume")
    e.clock.advance(10)
    await e.wait(P.REPAIRING)
    assert e.g().sampler_errors == {S1.address: "its engine sleeps while it should serve"}
    e.acts.release("resume")
    await e.wait(P.SERVING)
    assert not e.g().sampler_errors and e.g().history[-1].engine_faults == {S1.address: "asleep"}


async def _serving_start(e: Env):
    await e.orch.start(reconcile=False)
    assert e.g().phase is P.SERVING and not e.acts.calls


async def _serving_start_reconciles(e: Env):
    await e.orch.start(reconcile=True)
    assert e.acts.calls == [("resume", "s", [S1.address, S2.address])] and e.g().history[-1].kind == "reconcile"


async def _oos_acquire(e: Env):
    await e.out_of_service()
    await e.held()
    assert [c[0] for c in e.acts.calls[-2:]] == ["drain", "suspend"]


async def _oos_spec_settings(e: Env):
    await e.out_of_service()
    await e.orch.update_spec(spec_s(S1, S2, sleep_level=2))
    assert e.g().phase is P.OUT_OF_SERVICE and e.g().spec.sleep_level == 2


async def _oos_spec_removes_failed(e: Env):
    await e.out_of_service()
    await e.orch.update_spec(spec_s(S1))
    assert e.g().phase is P.SERVING and not e.g().sampler_errors


async def _oos_spec_adds(e: Env):
    await e.out_of_service()
    await e.orch.update_spec(spec_s(S1, S2, S3))
    assert e.g().phase is P.OUT_OF_SERVICE and e.acts.calls[-1] == ("resume", "s", [S3.address])


async def _oos_spec_removes_all(e: Env):
    await e.out_of_service()
    await e.orch.update_spec(spec_s())
    assert e.g().phase is P.FREE


async def _oos_repair_tick(e: Env):
    await e.repairing()
    e.acts.release("resume")
    await e.wait(P.SERVING)
    assert e.acts.calls[-1] == ("resume", "s", [S2.address]) and e.g().history[-1].kind == "repair"


async def _oos_probe(e: Env):
    e2 = e
    e2.orch.start_repair(first_s=500, audit_interval_s=10)
    await e2.out_of_service()
    e2.acts.readings = {S2.address: EngineReading(None, False, unreachable="connection refused")}
    e2.clock.advance(10)
    await e2.g().wait_until(lambda g: S2.address in g.unreachable_engines, 5)
    assert e2.g().phase is P.OUT_OF_SERVICE
    e2.acts.readings = {S2.address: EngineReading(None, False)}  # it answers again: repaired at once
    e2.clock.advance(10)
    await e2.wait(P.SERVING)
    assert e2.g().history[-1].kind == "repair"


async def _draining_drained(e: Env):
    await e.draining()
    e.acts.release("drain")
    await e.wait(P.HELD)


async def _draining_failed(e: Env):
    e.acts.fail["drain"] = RuntimeError("serving label false: 403")
    with pytest.raises(SwitchFailed, match="serving label false"):
        await e.orch.acquire("A", "s")
    await e.wait(P.SERVING)
    assert [c[0] for c in e.acts.calls] == ["drain", "resume"]


async def _draining_queues(e: Env):
    await e.draining()
    await e.queued("B")
    t = e.task(e.orch.update_spec(spec_s(S1, S2, S3)))
    await asyncio.sleep(0.01)
    assert not t.done() and e.g().phase is P.DRAINING and len(e.g().spec.samplers) == 2
    e.acts.release("drain")
    await t
    assert e.g().holder == "A" and len(e.g().spec.samplers) == 3


async def _suspending_suspended(e: Env):
    await e.suspending()
    e.acts.release("suspend")
    await e.wait(P.HELD)


async def _suspending_waiter_gave_up(e: Env):
    await e.suspending()
    acquire = e.tasks[-1]
    acquire.cancel()
    await e.g().wait_until(lambda g: not g.waiters, 5)
    e.acts.release("suspend")
    await e.wait(P.SERVING)
    assert e.g().holder is None and [c[0] for c in e.acts.calls] == ["drain", "suspend", "resume"]


async def _suspending_failed(e: Env):
    e.acts.fail["suspend"] = RuntimeError("is_sleeping says awake")
    with pytest.raises(SwitchFailed, match="is_sleeping says awake"):
        await e.orch.acquire("A", "s")
    await e.wait(P.SERVING)


async def _suspending_queues(e: Env):
    await e.suspending()
    await e.queued("B")
    t = e.task(e.orch.update_spec(spec_s(S1)))
    await asyncio.sleep(0.01)
    assert not t.done() and e.g().phase is P.SUSPENDING
    e.acts.release("suspend")
    await t
    assert e.g().holder == "A" and e.g().spec.samplers == [S1]


async def _held_yield_to_next(e: Env):
    await e.held()
    b = await e.queued("B")
    res = await e.orch.yield_("A", "s")
    assert res.pending_waiters == 1 and not res.snapshot_deferred
    await b
    assert e.g().holder == "B" and [c[0] for c in e.acts.calls] == ["drain", "suspend"], "job to job: still asleep"


async def _held_yield_to_samplers(e: Env):
    await e.held()
    await e.orch.yield_("A", "s")
    await e.wait(P.SERVING)
    await e.wait(P.SERVING, pred=lambda g: g.history and g.history[-1].kind == "to_samplers")
    assert [(r.kind, r.cause) for r in e.g().history] == [("to_job", "acquire"), ("to_samplers", "yield")]


async def _held_yield_deferred(e: Env):
    await e.deferred()
    assert e.g("t").loaded_job == "A" and e.g("t").state is GroupState.IDLE_YIELDED


async def _held_lease_expires_to_next(e: Env):
    await e.held()
    lease = e.orch.lease("A", "s")
    await e.orch.heartbeat("A", "s", lease.token)
    b = await e.queued("B")
    e.clock.advance(29)
    await asyncio.sleep(0.01)
    assert e.g().holder == "A"
    e.clock.advance(2)
    await b
    assert e.g().holder == "B" and "expired" in e.g().expired_jobs["A"]


async def _held_lease_expires_to_samplers(e: Env):
    await e.held()
    await e.orch.heartbeat("A", "s", e.orch.lease("A", "s").token)
    e.clock.advance(31)
    await e.wait(P.SERVING)
    await e.wait(P.SERVING, pred=lambda g: g.history and g.history[-1].kind == "to_samplers")
    assert e.g().history[-1].cause == "lease_expired", "status tells a lease expiry from a yield"


async def _held_lease_expires_deferred(e: Env):
    await e.held("t")
    await e.orch.heartbeat("A", "t", e.orch.lease("A", "t").token)
    e.clock.advance(31)
    await e.wait(P.DEFERRED, "t")


async def _held_grant_not_saved_next(e: Env):
    await e.held("t")
    b, c = await e.queued("B", "t"), await e.queued("C", "t")
    persister = FlakyPersister()
    e.orch.persister = persister
    persister.failures = 1
    await e.orch.yield_("A", "t")
    with pytest.raises(StateNotSaved, match="disk full"):
        await b
    await c
    assert e.g("t").holder == "C"


async def _held_grant_not_saved_resume(e: Env):
    persister = FlakyPersister()
    e.orch.persister = persister
    await e.suspending()
    persister.failures = 1  # the grant's save
    e.acts.release("suspend")
    with pytest.raises(StateNotSaved, match=r"taken back.*disk full"):
        await e.tasks[-1]
    await e.wait(P.SERVING)
    assert e.g().holder is None and e.g().lease is None


async def _held_grant_not_saved_free(e: Env):
    persister = FlakyPersister()
    e.orch.persister = persister
    persister.failures = 1
    with pytest.raises(StateNotSaved):
        await e.orch.acquire("A", "t")
    assert e.g("t").phase is P.FREE and e.g("t").holder is None
    await e.orch.acquire("A", "t")  # the store works again
    assert e.g("t").holder == "A"


async def _held_heartbeat_publish_queue_spec(e: Env):
    await e.held()
    lease = await e.orch.heartbeat("A", "s", e.orch.lease("A", "s").token)
    await e.orch.publish_weights("A", "s", WeightUpdate(1, "files", "/w/v1"), lease.token)
    await e.queued("B")
    await e.orch.update_spec(spec_s(S1, S2, S3, sleep_level=2))
    g = e.g()
    assert g.phase is P.HELD and len(g.spec.samplers) == 3 and g.spec.sleep_level == 1, "settings wait for the wake"


async def _held_start(e: Env):
    e.orch.restore(
        {"groups": {"s": {"holder": "A", "lease": {"job_id": "A", "token": 4, "ttl_s": 30, "armed": True}, "last_token": 4}}}
    )
    await e.orch.start()
    assert e.g().phase is P.HELD and ("asleep", "s", [S1.address, S2.address]) in e.acts.calls
    assert e.clock.pending(), "the armed lease runs again"


async def _deferred_acquire(e: Env):
    await e.deferred()
    r = await e.orch.acquire("A", "t")
    assert r.waited_ms == 0 and e.g("t").holder == "A"


async def _deferred_spec(e: Env):
    await e.deferred()
    await e.orch.update_spec(GroupSpec("t", policy="priority"))
    assert e.g("t").phase is P.DEFERRED and e.g("t").spec.policy.value == "priority"
    await e.orch.update_spec(GroupSpec("t", [S3]))
    assert e.g("t").phase is P.SERVING and e.g("t").deferred_job is None


async def _deferred_start(e: Env):
    e.orch.restore({"groups": {"t": {"state": "IDLE_YIELDED", "loaded_job": "A"}}})
    await e.orch.start()
    assert e.g("t").phase is P.DEFERRED and e.g("t").loaded_job == "A"


async def _resuming_done(e: Env):
    await e.resuming()
    e.acts.release("resume")
    await e.wait(P.SERVING)


async def _resuming_fails(e: Env):
    await e.out_of_service()


async def _resuming_then_waiter(e: Env):
    await e.resuming()
    await e.queued("B")
    t = e.task(e.orch.update_spec(spec_s(S1, S2, sleep_level=2)))
    e.acts.hold.add("drain")
    e.acts.release("resume")
    await e.wait(P.DRAINING)
    assert not t.done()
    e.acts.release("drain")
    await t
    assert e.g().holder == "B"


async def _repairing_done(e: Env):
    await e.repairing()
    await e.queued("B")
    t = e.task(e.orch.update_spec(spec_s(S1, S2, drain_timeout_s=9)))
    e.acts.release("resume")
    await t
    assert e.g().holder == "B"


async def _repairing_fails_again(e: Env):
    await e.repairing()
    e.acts.fail_samplers = {S2.address}
    e.acts.release("resume")
    await e.wait(P.OUT_OF_SERVICE, pred=lambda g: len(g.history) >= 2)
    assert e.clock.pending()[0] == pytest.approx(e.clock.now() + 4.0), "back-off doubled"


async def _repairing_ok(e: Env):
    await e.repairing()
    e.acts.release("resume")
    await e.wait(P.SERVING)


async def _abandon_everywhere(e: Env):
    await e.abandon("t")  # FREE
    await e.abandon("s")  # SERVING
    await e.deferred()
    await e.abandon("t")  # DEFERRED
    await e.held("t", "B")
    await e.abandon("t")  # HELD
    await e.draining()
    await e.abandon("s")
    e.acts.hold.add("suspend")
    e.acts.release("drain")
    await e.wait(P.SUSPENDING)
    await e.abandon("s")
    e.acts.fail_samplers = {S2.address}
    e.acts.hold.add("resume")
    e.acts.release("suspend")
    await e.wait(P.HELD)
    await e.orch.yield_("A", "s")
    await e.wait(P.RESUMING)
    await e.abandon("s")
    e.acts.release("resume")
    await e.wait(P.OUT_OF_SERVICE)
    await e.abandon("s")
    e.acts.hold.add("resume")
    e.clock.advance(2)
    await e.wait(P.REPAIRING)
    await e.abandon("s")
