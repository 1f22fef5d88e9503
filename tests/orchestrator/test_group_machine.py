"""The group state machine (orchestrator/phases.py, groups.py) with scripted switch actions and a manual clock:
every edge of the transition table is walked, illegal commands are refused naming phase and command, and the
timers (lease expiry, repair back-off, engine audit) run without a wall-clock sleep. Persistence: awaited per
transition, coalesced, off the event loop."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable

import pytest

from llmd_timeslice.domain.group_settings import GroupSpec, SamplerEndpoint
from llmd_timeslice.domain.switches import EngineReading
from llmd_timeslice.orchestrator import service
from llmd_timeslice.orchestrator.clock import ManualClock
from llmd_timeslice.orchestrator.errors import GroupFault, NotHolder, StateNotSaved, SwitchFailed
from llmd_timeslice.orchestrator.groups import Command, Orchestrator, _Waiter
from llmd_timeslice.orchestrator.persistence import StatePersister
from llmd_timeslice.orchestrator.phases import (
    IGNORED,
    TRANSITIONS,
    WIRE_STATE,
    GroupCommand,
    GroupPhase,
    GroupState,
    IllegalTransition,
)
from llmd_timeslice.orchestrator.switch import SwitchActions
from llmd_timeslice.weights.update import WeightUpdate

C, P = GroupCommand, GroupPhase
S1 = SamplerEndpoint("p", "10.0.0.1:8000", "10.0.0.1:9001", "s1")
S2 = SamplerEndpoint("p", "10.0.0.2:8000", "10.0.0.2:9001", "s2")
S3 = SamplerEndpoint("p", "10.0.0.3:8000", "10.0.0.3:9001", "s3")


class ScriptedActions(SwitchActions):
    """Each step records its call; a step named in ``hold`` waits for :meth:`release`; ``fail`` makes the next
    call of a step raise; wakes of ``fail_samplers`` fail; ``readings`` is what the engines report."""

    can_read_engines = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[str]]] = []
        self.hold: set[str] = set()
        self._gates: dict[str, asyncio.Event] = {}
        self.fail: dict[str, Exception] = {}
        self.fail_samplers: set[str] = set()
        self.readings: dict[str, EngineReading] = {}
        self.down: set[str] = set()  # samplers whose engine is down at a sleep (left out of it: record.unreachable)

    async def _step(self, name: str, spec: GroupSpec) -> None:
        self.calls.append((name, spec.group_id, [s.address for s in spec.samplers]))
        if name in self.hold:
            await self._gates.setdefault(name, asyncio.Event()).wait()
        err = self.fail.pop(name, None)
        if err is not None:
            raise err

    def release(self, name: str) -> None:
        self.hold.discard(name)
        gate = self._gates.pop(name, None)
        if gate is not None:
            gate.set()

    async def drain_samplers(self, spec, record):
        await self._step("drain", spec)

    async def suspend_samplers(self, spec, record):
        await self._step("suspend", spec)
        for s in spec.samplers:
            if s.address in self.down:
                record.unreachable[s.address] = "connection refused"

    async def resume_samplers(self, spec, record):
        await self._step("resume", spec)
        bad = [s.address for s in spec.samplers if s.address in self.fail_samplers]
        for s in spec.samplers:
            if s.address in bad:
                record.sampler_errors[s.address] = "its engine did not wake"
            elif record.weights is not None:
                record.sampler_versions[s.address] = record.weights.version
        if bad:
            raise RuntimeError(f"wake failed on {bad}")

    async def read_engines(self, spec):
        await self._step("read", spec)
        return {s.address: self.readings[s.address] for s in spec.samplers if s.address in self.readings}

    async def publish_asleep(self, spec):
        self.calls.append(("asleep", spec.group_id, [s.address for s in spec.samplers]))


class Bug(Exception):
    """An exception type the core does not expect (not an OrchestratorError, not a step failure)."""


class MalformedReading:
    """An engine reading whose fields raise when read: a driver returning garbage."""

    @property
    def unreachable(self):
        raise Bug("reading has no 'unreachable'")


class FlakyPersister:
    """Stands in for StatePersister: ``failures`` next saves raise."""

    def __init__(self) -> None:
        self.failures = 0
        self.saves = 0

    async def save(self) -> None:
        self.saves += 1
        if self.failures > 0:
            self.failures -= 1
            raise OSError("disk full")


class Env:
    def __init__(self, repair_first_s: float = 2.0, audit_interval_s: float = 1000.0) -> None:
        self.clock = ManualClock()
        self.acts = ScriptedActions()
        self.orch = Orchestrator([GroupSpec("s", [S1, S2]), GroupSpec("t")], self.acts, clock=self.clock)
        self.orch.start_repair(first_s=repair_first_s, max_s=60.0, audit_interval_s=audit_interval_s)
        self.edges: set[tuple[GroupPhase, GroupCommand, GroupPhase]] = set()
        self.boom: dict[tuple[str, GroupPhase, GroupCommand, GroupPhase], Exception] = {}
        self.orch.on_transition = self._moved
        self.tasks: list[asyncio.Task] = []

    def _moved(self, g, a: GroupPhase, c: GroupCommand, b: GroupPhase) -> None:
        """Record the edge, or raise the exception ``boom`` names for it (a bug in the middle of a handler)."""
        err = self.boom.pop((g.group_id, a, c, b), None)
        if err is not None:
            raise err
        self.edges.add((a, c, b))

    def g(self, gid: str = "s"):
        return self.orch.groups[gid]

    def task(self, coro: Awaitable) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self.tasks.append(t)
        return t

    async def wait(self, phase: GroupPhase, gid: str = "s", pred: Callable | None = None) -> None:
        await self.g(gid).wait_until(lambda g: g.phase is phase and (pred is None or pred(g)), 5)

    async def close(self) -> None:
        await self.orch.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # ---- reach a phase
    async def held(self, gid: str = "s", job: str = "A") -> None:
        await self.orch.acquire(job, gid)

    async def out_of_service(self) -> None:
        await self.held()
        self.acts.fail_samplers = {S2.address}
        await self.orch.yield_("A", "s")
        await self.wait(P.OUT_OF_SERVICE)
        self.acts.fail_samplers = set()

    async def draining(self) -> None:
        self.acts.hold.add("drain")
        self.task(self.orch.acquire("A", "s"))
        await self.wait(P.DRAINING)

    async def suspending(self) -> None:
        self.acts.hold.add("suspend")
        self.task(self.orch.acquire("A", "s"))
        await self.wait(P.SUSPENDING)

    async def resuming(self) -> None:
        await self.held()
        self.acts.hold.add("resume")
        await self.orch.yield_("A", "s")
        await self.wait(P.RESUMING)

    async def repairing(self) -> None:
        await self.out_of_service()
        self.acts.hold.add("resume")
        self.clock.advance(2.0)
        await self.wait(P.REPAIRING)

    async def deferred(self) -> None:
        await self.held("t")
        await self.orch.yield_("A", "t")
        await self.wait(P.DEFERRED, "t")

    async def queued(self, job: str = "B", gid: str = "s") -> asyncio.Task:
        t = self.task(self.orch.acquire(job, gid))
        await self.g(gid).wait_until(lambda g: any(w.job_id == job for w in g.waiters), 5)
        return t

    async def abandon(self, gid: str) -> None:
        w = _Waiter("ghost", 0.0, asyncio.get_running_loop().create_future())
        assert await self.g(gid).ask(Command(C.ABANDON, waiter=w)) is True


def spec_s(*samplers: SamplerEndpoint, **settings) -> GroupSpec:
    return GroupSpec("s", list(samplers), **settings)


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


# ---- an unexpected exception in a handler: a safe phase, the error told, the repair path takes over
async def _fault_free_acquire(e: Env):
    e.boom[("t", P.FREE, C.ACQUIRE, P.HELD)] = Bug("grant")
    with pytest.raises(GroupFault, match=r"internal error in ACQUIRE during phase FREE: Bug\('grant'\)"):
        await e.orch.acquire("A", "t")
    g = e.g("t")
    assert g.phase is P.FREE and g.holder is None and "ACQUIRE during phase FREE" in g.last_error
    await e.held("t")  # the group works on
    assert g.holder == "A"


async def _fault_free_spec_adds_samplers(e: Env):
    e.boom[("t", P.FREE, C.SPEC_UPDATE, P.RESUMING)] = Bug()
    with pytest.raises(GroupFault, match="SPEC_UPDATE during phase FREE"):
        await e.orch.update_spec(GroupSpec("t", [S3]))
    g = e.g("t")
    assert g.phase is P.OUT_OF_SERVICE and "state unknown" in g.sampler_errors[S3.address]
    assert service.weight_status(g).samplers[0].in_service is False
    e.clock.advance(2.0)  # the repair timer wakes and verifies the sampler whose state is unknown
    await e.wait(P.SERVING, "t")
    assert e.acts.calls[-1] == ("resume", "t", [S3.address]) and not g.sampler_errors


async def _fault_serving_malformed_engine_reading(e: Env):
    e.orch.start_repair(audit_interval_s=10)
    e.acts.readings = {S1.address: MalformedReading()}
    e.clock.advance(10)
    await e.wait(P.OUT_OF_SERVICE)
    g = e.g()
    assert set(g.sampler_errors) == {S1.address, S2.address}
    assert "AUDITED during phase SERVING" in service.weight_status(g).last_error
    e.acts.readings = {}
    e.clock.advance(2.0)
    await e.wait(P.SERVING)
    assert e.acts.calls[-1] == ("resume", "s", [S1.address, S2.address]) and e.g().history[-1].kind == "repair"


async def _fault_oos_acquire(e: Env):
    await e.out_of_service()
    e.boom[("s", P.OUT_OF_SERVICE, C.ACQUIRE, P.DRAINING)] = Bug()
    with pytest.raises(GroupFault, match="ACQUIRE during phase OUT_OF_SERVICE"):
        await e.orch.acquire("B", "s")
    assert e.g().phase is P.OUT_OF_SERVICE and not e.g().waiters and e.clock.pending()
    e.clock.advance(2.0)
    await e.wait(P.SERVING)


async def _fault_draining(e: Env):
    await e.draining()
    b = await e.queued("B")
    e.boom[("s", P.DRAINING, C.DRAINED, P.SUSPENDING)] = Bug()
    e.acts.release("drain")
    with pytest.raises(GroupFault, match="DRAINED during phase DRAINING"):
        await e.tasks[0]
    with pytest.raises(GroupFault):  # a queued waiter gets the error too, it does not hang
        await b
    assert e.g().phase is P.OUT_OF_SERVICE and e.g().holder is None
    e.clock.advance(2.0)
    await e.wait(P.SERVING)
    assert [c[0] for c in e.acts.calls] == ["drain", "resume"]


async def _fault_suspending_metrics_callback(e: Env):
    await e.suspending()

    def on_switch(record):
        raise Bug("metrics")

    e.orch._on_switch = on_switch
    e.acts.release("suspend")
    with pytest.raises(GroupFault, match="SUSPENDED during phase SUSPENDING"):
        await e.tasks[-1]
    e.orch._on_switch = None
    assert e.g().phase is P.OUT_OF_SERVICE and e.g().holder is None and not e.g().waiters
    e.clock.advance(2.0)  # the engines went to sleep: the repair wakes and verifies them
    await e.wait(P.SERVING)
    assert e.acts.calls[-1] == ("resume", "s", [S1.address, S2.address])


async def _fault_held_heartbeat(e: Env):
    await e.held()
    b = await e.queued("B")
    token = e.orch.lease("A", "s").token
    e.boom[("s", P.HELD, C.HEARTBEAT, P.HELD)] = Bug()
    with pytest.raises(GroupFault, match="HEARTBEAT during phase HELD"):
        await e.orch.heartbeat("A", "s", token)
    assert e.g().phase is P.HELD and e.g().holder == "A", "an intact lease is kept: the job still uses the accelerators"
    assert [w.job_id for w in e.g().waiters] == ["B"], "its queue is intact too: B is granted at the yield"
    await e.orch.yield_("A", "s", token)
    await b
    assert e.g().holder == "B"


async def _fault_held_half_handed_to_the_next_waiter(e: Env):
    await e.held()
    b = await e.queued("B")
    e.boom[("s", P.HELD, C.YIELD, P.HELD)] = Bug()  # A released, B not granted yet
    with pytest.raises(GroupFault):
        await e.orch.yield_("A", "s")
    with pytest.raises(GroupFault, match="YIELD during phase HELD"):  # the waiter hears it, it does not hang
        await b
    assert e.g().phase is P.OUT_OF_SERVICE and e.g().holder is None and not e.g().waiters


async def _fault_held_half_released(e: Env):
    await e.held()
    e.boom[("s", P.HELD, C.YIELD, P.RESUMING)] = Bug()
    with pytest.raises(GroupFault, match="YIELD during phase HELD"):
        await e.orch.yield_("A", "s")
    g = e.g()
    assert g.phase is P.OUT_OF_SERVICE and g.holder is None and g.lease is None
    with pytest.raises(NotHolder, match="reclaimed after an internal error in YIELD"):
        await e.orch.heartbeat("A", "s", 1)
    e.clock.advance(2.0)
    await e.wait(P.SERVING)


async def _fault_held_half_released_no_samplers(e: Env):
    await e.held("t")
    e.boom[("t", P.HELD, C.YIELD, P.DEFERRED)] = Bug()
    with pytest.raises(GroupFault):
        await e.orch.yield_("A", "t")
    assert e.g("t").phase is P.FREE and e.g("t").holder is None and e.g("t").loaded_job is None
    await e.held("t", "B")


async def _fault_deferred_acquire(e: Env):
    await e.deferred()
    e.boom[("t", P.DEFERRED, C.ACQUIRE, P.HELD)] = Bug()
    with pytest.raises(GroupFault, match="ACQUIRE during phase DEFERRED"):
        await e.orch.acquire("A", "t")
    assert e.g("t").phase is P.DEFERRED and e.g("t").loaded_job == "A"


async def _fault_deferred_spec_adds_samplers(e: Env):
    await e.deferred()
    e.boom[("t", P.DEFERRED, C.SPEC_UPDATE, P.RESUMING)] = Bug()
    with pytest.raises(GroupFault):
        await e.orch.update_spec(GroupSpec("t", [S3]))
    assert e.g("t").phase is P.OUT_OF_SERVICE and e.g("t").deferred_job is None


async def _fault_resuming(e: Env):
    await e.resuming()
    e.boom[("s", P.RESUMING, C.RESUMED, P.SERVING)] = Bug()
    e.acts.release("resume")
    await e.wait(P.OUT_OF_SERVICE)
    assert "RESUMED during phase RESUMING" in e.g().last_error
    e.clock.advance(2.0)
    await e.wait(P.SERVING)


async def _fault_repairing(e: Env):
    await e.repairing()
    e.boom[("s", P.REPAIRING, C.REPAIRED, P.SERVING)] = Bug()
    e.acts.release("resume")
    await e.wait(P.OUT_OF_SERVICE, pred=lambda g: "REPAIRED" in g.last_error)
    assert set(e.g().sampler_errors) == {S1.address, S2.address}
    assert min(e.clock.pending()) == pytest.approx(e.clock.now() + 4.0), "the repair back-off doubles"


async def _asked_nobody_holds(e: Env, gid: str = "s") -> None:
    a = await e.orch.request_yield(gid, "eval waits", band=10, hold_deadline_s=5)
    assert not a.requested and a.holder == "" and f"group {gid!r} is not held" in a.detail, a


async def _yield_request_free_serving_deferred(e: Env):
    await _asked_nobody_holds(e, "t")  # FREE
    await _asked_nobody_holds(e, "s")  # SERVING
    await e.deferred()
    await _asked_nobody_holds(e, "t")


async def _yield_request_draining_suspending(e: Env):
    await e.draining()
    await _asked_nobody_holds(e)
    e.acts.hold.add("suspend")
    e.acts.release("drain")
    await e.wait(P.SUSPENDING)
    await _asked_nobody_holds(e)
    e.acts.release("suspend")
    await e.tasks[0]
    assert e.g().holder == "A"


async def _yield_request_resuming_out_of_service_repairing(e: Env):
    await e.resuming()
    await _asked_nobody_holds(e)
    e.acts.fail_samplers = {S2.address}
    e.acts.release("resume")
    await e.wait(P.OUT_OF_SERVICE)
    await _asked_nobody_holds(e)
    e.acts.fail_samplers = set()
    e.acts.hold.add("resume")
    e.clock.advance(2.0)
    await e.wait(P.REPAIRING)
    await _asked_nobody_holds(e)
    e.acts.release("resume")
    await e.wait(P.SERVING)


async def _yield_request_held_honoured(e: Env):
    await e.held()
    e.clock.advance(10.0)  # min_training_s (default 10 s) since the grant
    a = await e.orch.request_yield("s", "eval waits", band=10, hold_deadline_s=5)
    assert a.requested and a.holder == "A" and not a.detail
    assert e.orch.lease("A", "s").yield_request.band == 10
    again = await e.orch.request_yield("s", "eval waits more", band=10, hold_deadline_s=5)
    assert again.requested and "already requested" in again.detail
    e.clock.advance(1.5)
    await e.orch.yield_("A", "s")
    st = e.g().yield_stats
    assert (st.sent, st.honoured, st.ignored) == (1, 1, 0)


async def _yield_request_held_ignored_past_the_deadline(e: Env):
    await e.held()
    e.clock.advance(10.0)
    assert (await e.orch.request_yield("s", "eval waits", band=10, hold_deadline_s=5)).requested
    e.clock.advance(5.0)  # the band's deadline passes while A keeps the group
    await e.g().wait_until(lambda g: g.yield_stats.ignored == 1, 5)
    assert e.g().holder == "A", "yielding stays cooperative: A keeps the group"


async def _held_with_an_engine_down_at_the_sleep_put_to_sleep_once_it_answers(e: Env):
    e.acts.down = {S2.address}
    await e.held()  # granted: the down engine holds no accelerator memory
    g = e.g()
    assert S2.address in g.sampler_errors and S2.address in g.unreachable_engines
    e.acts.readings = {S2.address: EngineReading(None, False, "connection refused")}
    g.post(Command(C.AUDIT_TICK))  # still down: nothing to do
    await g.wait_until(lambda g: ("read", "s", [S2.address]) in e.acts.calls and not g.repair.reading, 5)
    assert S2.address in g.sampler_errors
    e.acts.down = set()
    e.acts.readings = {S2.address: EngineReading("default", False)}  # back from its restart, awake
    g.post(Command(C.AUDIT_TICK))
    await g.wait_until(lambda g: S2.address not in g.sampler_errors, 5)
    assert ("suspend", "s", [S2.address]) in e.acts.calls and g.phase is P.HELD and g.holder == "A"
    await e.orch.yield_("A", "s")
    await e.wait(P.SERVING)
    assert e.acts.calls[-1] == ("resume", "s", [S1.address, S2.address])


async def _held_with_an_engine_down_at_the_sleep_that_comes_back_asleep(e: Env):
    e.acts.down = {S2.address}
    await e.held()
    e.acts.readings = {S2.address: EngineReading(None, True)}  # e.g. restarted and put to sleep by its own start-up
    e.g().post(Command(C.AUDIT_TICK))
    await e.g().wait_until(lambda g: S2.address not in g.sampler_errors, 5)
    assert ("suspend", "s", [S2.address]) not in e.acts.calls


SCENARIOS = [
    v
    for k, v in sorted(globals().items())
    if k.startswith("_") and k[1:2].islower() and callable(v) and v.__code__.co_varnames[:1] == ("e",)
]


async def test_every_edge_of_the_transition_table_is_walked():
    """Each scenario runs on a fresh orchestrator; together they take every (phase, command, next phase) edge of
    phases.TRANSITIONS, and no move outside it."""
    walked: set = set()
    for scenario in SCENARIOS:
        env = Env()
        try:
            await asyncio.wait_for(scenario(env), 10)
        except Exception as exc:
            raise AssertionError(f"scenario {scenario.__name__} failed: {exc!r}") from exc
        finally:
            await env.close()
        walked |= env.edges
    table = {(p, c, to) for (p, c), tos in TRANSITIONS.items() for to in tos}
    assert walked <= table
    missing = sorted((p.name, c.name, to.name) for p, c, to in table - walked)
    assert not missing, f"edges never walked: {missing}"


async def test_a_command_out_of_turn_is_refused_naming_phase_and_command():
    e = Env()
    try:
        with pytest.raises(IllegalTransition, match=r"command DRAINED is not accepted in phase SERVING"):
            await e.g().ask(Command(C.DRAINED))
        with pytest.raises(NotHolder, match="does not hold group 't'"):  # a job command out of turn: no holder
            await e.orch.yield_("A", "t")
        assert (P.SERVING, C.REPAIR_TICK) in IGNORED
        e.g().post(Command(C.REPAIR_TICK))  # a late tick: dropped, not an error
        await e.held()  # the group works on
        assert e.g().holder == "A"
    finally:
        await e.close()


async def test_an_internal_error_is_logged_at_error_naming_group_command_and_phase(caplog):
    e = Env()
    try:
        await e.held()
        e.boom[("s", P.HELD, C.YIELD, P.RESUMING)] = Bug("boom")
        with caplog.at_level(logging.ERROR, logger="llmd_timeslice.orchestrator.group"), pytest.raises(GroupFault):
            await e.orch.yield_("A", "s")
        rec = next(r for r in caplog.records if "internal error" in r.getMessage())
        assert rec.levelno == logging.ERROR and rec.exc_info is not None
        assert "group=s internal error in YIELD during phase HELD: Bug('boom')" in rec.getMessage()
        assert e.g().last_error.endswith("the group went to OUT_OF_SERVICE")
    finally:
        await e.close()


def test_every_phase_has_a_wire_state_and_the_table_names_only_known_phases():
    assert set(WIRE_STATE) == set(GroupPhase)
    assert {WIRE_STATE[p] for p in GroupPhase} == set(GroupState)
    for (p, c), tos in TRANSITIONS.items():
        assert tos and (p, c) not in IGNORED


# ------------------------------------------------------------------------------------------------- timers
async def test_lease_expiry_and_repair_back_off_run_on_the_clock_without_sleeping():
    e = Env(repair_first_s=2.0, audit_interval_s=0)
    t0 = time.monotonic()
    try:
        await e.held()
        lease = e.orch.lease("A", "s")
        for _ in range(5):  # heartbeats keep it alive far past the TTL
            await e.orch.heartbeat("A", "s", lease.token)
            e.clock.advance(25)
        await asyncio.sleep(0)
        assert e.g().holder == "A"
        e.acts.fail_samplers = {S1.address, S2.address}  # every wake fails from now on
        e.clock.advance(5.1)  # no heartbeat for 30 s: expired, reclaimed, the samplers are woken (and fail)
        await e.wait(P.OUT_OF_SERVICE)
        assert "expired" in e.g().expired_jobs["A"]
        waits = []
        for _ in range(7):
            due = min(e.clock.pending()) - e.clock.now()
            waits.append(round(due, 3))
            n = len(e.g().history)
            e.clock.advance(due)
            await e.wait(P.OUT_OF_SERVICE, pred=lambda g, n=n: len(g.history) > n)
        assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
        e.acts.fail_samplers = set()
        e.clock.advance(60)
        await e.wait(P.SERVING)
        assert not e.clock.pending(), "no repair timer left once serving"
    finally:
        await e.close()
    # 242 s of simulated waits: far below them means the clock was simulated (not a speed bound).
    assert time.monotonic() - t0 < 60, "simulated minutes took real minutes"


async def test_a_stall_of_the_orchestrator_does_not_count_against_the_lease_holder():
    """The orchestrator frozen (SIGSTOP) past the holder's TTL: its heartbeats waited in a socket, so the lease is
    kept for the time the orchestrator could not run; a holder that then stays silent expires after that credit."""
    e = Env(audit_interval_s=0)
    try:
        await e.held()
        lease = e.orch.lease("A", "s")
        await e.orch.heartbeat("A", "s", lease.token)  # armed: 30 s TTL from t = 0
        e.clock.advance(10)
        e.clock.stall(25)  # t = 35: the expiry timer fell due during the stall
        await asyncio.sleep(0)
        await e.g().wait_until(lambda g: g.lease is not None and g.lease.stall_credit_s > 0, 5)
        assert e.g().holder == "A", "the lease must not expire for time the orchestrator could not hear the holder"
        await e.orch.heartbeat("A", "s", lease.token)  # the queued heartbeat: kept, credit cleared
        assert e.g().lease.stall_credit_s == 0.0
        e.clock.stall(10)  # a shorter stall inside the TTL changes nothing
        e.clock.advance(20.1)  # 30.1 s since the heartbeat, 10 of them stalled: still held (expires at 40)
        await asyncio.sleep(0)
        assert e.g().holder == "A"
        e.clock.advance(10)  # 40.1 s: expired
        await e.g().wait_until(lambda g: g.holder is None, 5)
        assert "expired" in e.g().expired_jobs["A"]
    finally:
        await e.close()


async def test_engine_audit_runs_every_interval_on_the_clock():
    e = Env(audit_interval_s=10)
    try:
        e.acts.readings = {S1.address: EngineReading(None, False), S2.address: EngineReading(None, False)}
        for i in range(1, 4):
            e.clock.advance(10)
            await e.g().wait_until(lambda g, i=i: sum(c[0] == "read" for c in e.acts.calls) >= i, 5)
        assert e.g().phase is P.SERVING
    finally:
        await e.close()


# -------------------------------------------------------------------------------------------- persistence
class SlowStore:
    """A store whose save takes ``delay_s`` and records where it ran."""

    def __init__(self, delay_s: float = 0.05) -> None:
        self.delay_s = delay_s
        self.states: list[dict] = []
        self.threads: set[int] = set()

    def load(self):
        return None

    def save(self, state: dict) -> None:
        self.threads.add(threading.get_ident())
        time.sleep(self.delay_s)
        self.states.append(state)


async def test_state_is_saved_off_the_event_loop_coalesced_and_before_a_grant_is_returned():
    store = SlowStore()
    e = Env()
    e.orch.persister = StatePersister(store, e.orch.snapshot)
    try:
        beats = 0

        async def ticker() -> None:  # the loop stays responsive while the store sleeps
            nonlocal beats
            while True:
                beats += 1
                await asyncio.sleep(0.005)

        tick = e.task(ticker())
        await e.orch.acquire("A", "t")
        saved = store.states[-1]["groups"]["t"]
        assert saved["holder"] == "A" and saved["phase"] == "held", "the grant was saved before it was returned"
        assert threading.get_ident() not in store.threads and beats >= 5
        # Twenty jobs queue and take the group in turn: far fewer writes than transitions.
        jobs = [e.task(e.orch.acquire(f"j{i}", "t")) for i in range(20)]
        await e.g("t").wait_until(lambda g: len(g.waiters) == 20, 5)
        writes_before = len(store.states)
        await e.orch.yield_("A", "t")
        for i in range(20):
            await jobs[i]
            await e.orch.yield_(f"j{i}", "t")
        await e.orch.persister.close()
        assert store.states[-1]["groups"]["t"]["phase"] == "deferred"
        assert len(store.states) - writes_before < 40, len(store.states) - writes_before
        tick.cancel()
    finally:
        await e.close()


# -------------------------------------------------------------------------------------------------- tasks
async def test_a_groups_steps_are_kept_while_they_run_and_survive_garbage_collection():
    """Bug 4 of issue 16: tasks the core creates are referenced by their group, so a step awaiting something only
    it references is not collected mid-flight."""
    e = Env()
    release: list[weakref.ref] = []

    async def drain(spec, record):
        fut = asyncio.get_running_loop().create_future()  # referenced only by this coroutine
        release.append(weakref.ref(fut))
        await fut

    e.acts.drain_samplers = drain  # type: ignore[method-assign]
    try:
        acquire = e.task(e.orch.acquire("A", "s"))
        await e.wait(P.DRAINING)
        await asyncio.sleep(0)
        gc.collect()
        fut = release[0]()
        assert fut is not None, "the drain step was collected mid-flight"
        fut.set_result(None)
        await asyncio.wait_for(acquire, 5)
        assert e.g().holder == "A"
    finally:
        await e.close()


async def test_the_next_acquire_warns_only_about_samplers_still_without_the_published_version():
    """Issue 38 §5: a version that failed to load on two samplers, one repaired since: the publisher's next acquire
    names the other only; once both are repaired it warns about nothing."""
    e = Env()
    try:
        await e.held()
        await e.orch.publish_weights("A", "s", WeightUpdate(1, location="/w/1"))
        e.acts.fail_samplers = {S1.address, S2.address}
        await e.orch.yield_("A", "s")
        await e.wait(P.OUT_OF_SERVICE)
        e.acts.fail_samplers = {S2.address}
        e.clock.advance(2.0)  # the repair wakes both; S1 loads version 1 now
        await e.wait(P.OUT_OF_SERVICE, pred=lambda g: set(g.sampler_errors) == {S2.address})
        res = await e.orch.acquire("A", "s")
        assert "did not load on 1 of 2 sampler(s)" in res.weight_sync_error, res
        assert S2.address in res.weight_sync_error and S1.address not in res.weight_sync_error, res
        e.acts.fail_samplers = set()
        await e.orch.yield_("A", "s")
        await e.wait(P.SERVING)
        assert (await e.orch.acquire("A", "s")).weight_sync_error == ""
    finally:
        await e.close()
