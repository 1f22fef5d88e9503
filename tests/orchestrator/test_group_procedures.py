"""The group's procedures on their own (orchestrator/phase_switch.py, repair.py, spec_updates.py), over a fake
GroupHost that records the moves, the steps spawned and the commands posted: no actor, no orchestrator. The actor
running them through every edge of the phase table is tests/orchestrator/test_group_machine.py."""

from __future__ import annotations

import asyncio

from llmd_timeslice.domain.group_settings import GroupSpec, SamplerEndpoint
from llmd_timeslice.domain.switches import EngineReading, SwitchKind, SwitchRecord
from llmd_timeslice.orchestrator.clock import ManualClock
from llmd_timeslice.orchestrator.commands import NO_REPLY, Command
from llmd_timeslice.orchestrator.errors import SwitchFailed
from llmd_timeslice.orchestrator.lease import Waiter
from llmd_timeslice.orchestrator.lease_queue import LeaseQueue
from llmd_timeslice.orchestrator.phase_switch import PhaseSwitch
from llmd_timeslice.orchestrator.phases import GroupCommand, GroupPhase
from llmd_timeslice.orchestrator.repair import RepairPath
from llmd_timeslice.orchestrator.sampler_fleet import SamplerFleet
from llmd_timeslice.orchestrator.spec_updates import SpecUpdates
from llmd_timeslice.orchestrator.switch import SwitchActions
from llmd_timeslice.orchestrator.weight_ledger import WeightLedger

C, P = GroupCommand, GroupPhase
S1 = SamplerEndpoint("p", "10.0.0.1:8000", "10.0.0.1:9001", "s1")
S2 = SamplerEndpoint("p", "10.0.0.2:8000", "10.0.0.2:9001", "s2")
S3 = SamplerEndpoint("p", "10.0.0.3:8000", "10.0.0.3:9001", "s3")


class Actions(SwitchActions):
    can_read_engines = True

    def __init__(self) -> None:
        self.retired: list[str] = []

    async def suspend_samplers(self, spec, record):
        pass

    async def resume_samplers(self, spec, record):
        pass

    async def retire_samplers(self, samplers):
        self.retired += [s.address for s in samplers]


class Host:
    """A GroupHost that records what the procedures ask of the actor."""

    def __init__(self, phase: GroupPhase = P.SERVING, samplers=(S1, S2)) -> None:
        self.spec = GroupSpec("g", list(samplers))
        self.phase = phase
        self.last_error = ""
        self._clock = ManualClock()
        self._actions = Actions()
        self.leases = LeaseQueue("g", self._clock, lambda token: None)
        self.ledger = WeightLedger("g")
        self.fleet = SamplerFleet((s.address for s in samplers), self._clock)
        self.moves: list[tuple[GroupPhase, GroupCommand]] = []
        self.spawned: list[str] = []
        self.posted: list[Command] = []
        self.records: list[SwitchRecord] = []
        self.granted: list[tuple[str, GroupCommand]] = []
        self.dirty = False
        self.epoch = 0

    group_id = "g"

    @property
    def clock(self):
        return self._clock

    @property
    def actions(self):
        return self._actions

    def enter(self, to, kind):
        self.moves.append((to, kind))
        if to is not self.phase:
            self.phase, self.epoch = to, self.epoch + 1

    def spawn(self, coro, name):
        self.spawned.append(name)
        coro.close()

    def post(self, cmd):
        self.posted.append(cmd)

    def record(self, rec):
        self.records.append(rec)

    def mark_dirty(self):
        self.dirty = True

    def next_waiter(self):
        return self.leases.next_waiter("fifo", {})

    async def grant(self, w, kind):
        self.granted.append((w.job_id, kind))


def _waiter(job: str) -> Waiter:
    return Waiter(job, 0.0, asyncio.get_running_loop().create_future())


async def test_a_drain_is_for_the_next_waiter_and_a_failed_switch_fails_it_and_wakes_every_sampler() -> None:
    g = Host()
    sw = PhaseSwitch(g)
    w = _waiter("A")
    g.leases.enqueue(w)
    sw.start_drain(C.ACQUIRE)
    assert g.moves == [(P.DRAINING, C.ACQUIRE)] and g.spawned == ["drain"] and sw.in_flight and sw.in_flight.waiter is w
    await sw.on_failed(Command(C.DRAIN_FAILED, error=RuntimeError("gate gone")))
    assert isinstance(w.future.exception(), SwitchFailed) and not g.leases.waiters
    assert "switch to job 'A' failed: gate gone" in g.last_error and g.records[-1].ok is False
    assert g.moves[-1] == (P.RESUMING, C.DRAIN_FAILED) and sw.in_flight and sw.in_flight.record.kind is SwitchKind.TO_SAMPLERS


async def test_a_sleep_grants_the_waiter_it_was_for_or_the_next_or_wakes_the_samplers_again() -> None:
    g = Host()
    sw = PhaseSwitch(g)
    a, b = _waiter("A"), _waiter("B")
    g.leases.enqueue(a)
    g.leases.enqueue(b)
    sw.start_drain(C.ACQUIRE)
    sw.in_flight.record.unreachable[S2.address] = "connection refused"  # type: ignore[union-attr]
    await sw.on_suspended(Command(C.SUSPENDED))
    assert g.granted == [("A", C.SUSPENDED)] and g.dirty and S2.address in g.fleet.unreachable
    sw.start_drain(C.ACQUIRE)
    a.future.cancel()  # the waiter it was for gave up
    await sw.on_suspended(Command(C.SUSPENDED))
    assert g.granted[-1] == ("B", C.SUSPENDED)
    g.leases.remove(b)
    c = _waiter("C")
    g.leases.enqueue(c)
    sw.start_drain(C.ACQUIRE)
    c.future.cancel()  # and nobody else waits: the samplers wake again
    await sw.on_suspended(Command(C.SUSPENDED))
    assert g.granted[-1] == ("B", C.SUSPENDED) and g.moves[-1] == (P.RESUMING, C.SUSPENDED)


async def test_a_wake_outcome_serves_stays_out_of_service_or_drains_for_a_waiter_and_answers_its_replies() -> None:
    g = Host()
    sw = PhaseSwitch(g)
    reply = asyncio.get_running_loop().create_future()
    sw.start_resume(SwitchKind.DISCOVERED, C.SPEC_UPDATE, replies=[reply])
    rec = sw.in_flight.record  # type: ignore[union-attr]
    rec.sampler_errors[S2.address] = "its engine did not wake"
    await sw.on_resumed(Command(C.RESUMED, record=rec, error=RuntimeError("1 of 2 failed")))
    assert g.moves[-1] == (P.OUT_OF_SERVICE, C.RESUMED) and reply.result() is None
    assert "new samplers failed verification" in g.last_error and g.fleet.errors == {S2.address: "its engine did not wake"}
    g.leases.enqueue(_waiter("A"))
    sw.start_resume(SwitchKind.REPAIR, C.REPAIR_TICK, samplers=[S2])
    assert g.moves[-1] == (P.REPAIRING, C.REPAIR_TICK)
    await sw.on_resumed(Command(C.REPAIRED, record=sw.in_flight.record))  # type: ignore[union-attr]
    assert g.moves[-1] == (P.DRAINING, C.REPAIRED) and g.last_error == "" and not g.fleet.errors


async def test_the_audit_reads_what_the_phase_asks_about_one_read_at_a_time() -> None:
    g = Host()
    repair = RepairPath(g, PhaseSwitch(g))
    await repair.on_audit_tick(Command(C.AUDIT_TICK))
    assert repair.reading and g.spawned == ["audit"]
    await repair.on_audit_tick(Command(C.AUDIT_TICK))
    assert g.spawned == ["audit"], "a read in flight: no second one"
    repair.reading = False
    g.phase = P.HELD  # nobody was down at the sleep: nothing to probe
    await repair.on_audit_tick(Command(C.AUDIT_TICK))
    assert g.spawned == ["audit"] and not repair.reading


async def test_an_audit_fault_repairs_that_sampler_and_a_stale_reading_judges_nothing() -> None:
    g = Host()
    repair = RepairPath(g, PhaseSwitch(g))
    await repair.on_audited(Command(C.AUDITED, readings={S1.address: EngineReading(None, True)}, epoch=g.epoch - 1))
    assert g.moves == [(P.SERVING, C.AUDITED)], "an older epoch's reading is ignored"
    await repair.on_audited(Command(C.AUDITED, readings={S1.address: EngineReading(None, True)}, epoch=g.epoch))
    assert g.moves[-1] == (P.REPAIRING, C.AUDITED) and "sleeps while it should serve" in g.last_error
    assert g.spawned[-1] == "repair" and list(g.fleet.errors) == [S1.address]


async def test_engines_back_while_held_are_counted_asleep_or_put_to_sleep() -> None:
    g = Host(P.HELD)
    g.leases.grant("A", 0.0)
    g.fleet.down_at_sleep({S1.address: "refused", S2.address: "refused"})
    repair = RepairPath(g, PhaseSwitch(g))
    readings = {S1.address: EngineReading(None, True), S2.address: EngineReading("0", False)}
    await repair.on_probed(Command(C.PROBED, readings=readings, epoch=g.epoch))
    assert S1.address not in g.fleet.errors and g.fleet.returning == {S2.address} and g.spawned == ["returned"]
    rec = SwitchRecord("g", SwitchKind.TO_JOB, "A", 0.0)
    await repair.on_returned(Command(C.RETURNED, record=rec))
    assert not g.fleet.errors and not g.fleet.returning and g.moves[-1] == (P.HELD, C.RETURNED)


async def test_a_spec_update_waits_for_a_stable_phase_then_adds_and_removes_samplers() -> None:
    g = Host(P.DRAINING)
    updates = SpecUpdates(g, PhaseSwitch(g))
    reply = asyncio.get_running_loop().create_future()
    assert await updates.on_spec_update(Command(C.SPEC_UPDATE, spec=GroupSpec("g", [S1, S3]), reply=reply)) is NO_REPLY
    assert updates.pending is not None and not reply.done()
    g.phase = P.SERVING
    await updates.settle()
    assert g.actions.retired == [S2.address] and set(g.fleet.versions) == {S1.address, S3.address}
    assert g.moves[-1] == (P.RESUMING, C.SPEC_UPDATE) and g.spawned == ["resume"], "new samplers are woken first"
    assert updates.pending is None and not reply.done(), "answered when the wake ends"


async def test_settings_of_a_held_group_wait_for_its_samplers() -> None:
    g = Host(P.HELD)
    updates = SpecUpdates(g, PhaseSwitch(g))
    await updates.on_spec_update(Command(C.SPEC_UPDATE, spec=GroupSpec("g", [S1, S2], drain_timeout_s=99.0)))
    assert g.spec.drain_timeout_s != 99.0 and g.moves[-1] == (P.HELD, C.SPEC_UPDATE)
    g.phase = P.SERVING
    await updates.settle()
    assert g.spec.drain_timeout_s == 99.0
