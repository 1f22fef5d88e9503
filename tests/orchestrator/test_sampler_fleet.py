"""The sampler fleet on its own (orchestrator/sampler_fleet.py): the repair back-off, the engine judgement, and the
outcomes it takes in (wakes, sleeps with engines down, audit faults, probes, samplers joining and leaving)."""

from __future__ import annotations

from llmd_timeslice.domain.group_settings import SamplerEndpoint
from llmd_timeslice.domain.switches import EngineFault, EngineReading, SwitchKind, SwitchRecord
from llmd_timeslice.orchestrator.clock import ManualClock
from llmd_timeslice.orchestrator.sampler_fleet import SamplerFleet, judge_engines

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def test_the_repair_back_off_doubles_to_its_cap_and_a_reset_starts_over() -> None:
    clock, ticks = ManualClock(), []
    fleet = SamplerFleet([A], clock)
    delays = [fleet.schedule_repair(2.0, 5.0, lambda: ticks.append(clock.now())) for _ in range(3)]
    assert delays == [2.0, 4.0, 5.0] and fleet.repair_armed
    clock.advance(5.0)
    assert len(ticks) == 1, "re-arming cancels the earlier timer: one tick"
    fleet.cancel_repair(reset=False)
    assert fleet.schedule_repair(2.0, 5.0, lambda: None) == 5.0, "no reset: the back-off keeps its length"
    fleet.cancel_repair(reset=True)
    assert not fleet.repair_armed and fleet.repair_delay_s is None
    assert fleet.schedule_repair(2.0, 5.0, lambda: None) == 2.0


def test_engines_are_judged_against_the_recorded_versions_and_only_in_service() -> None:
    fleet = SamplerFleet([A, B], ManualClock())
    samplers = [SamplerEndpoint("p", A, "10.0.0.1:9000", "s1"), SamplerEndpoint("p", B, "10.0.0.2:9000", "s2")]
    fleet.versions[A] = 3
    assert judge_engines(samplers, fleet, {A: EngineReading("3", False)}) == {}
    assert judge_engines(samplers, fleet, {A: EngineReading("default", False)})[A][0] is EngineFault.RESTARTED
    assert judge_engines(samplers, fleet, {A: EngineReading(None, True)})[A][0] is EngineFault.ASLEEP
    assert judge_engines(samplers, fleet, {A: EngineReading(None, False, "refused")})[A][0] is EngineFault.UNREACHABLE
    assert judge_engines(samplers, fleet, {B: EngineReading("default", False)}) == {}, "never synced: initial weights"
    fleet.errors[A] = "out of service"
    assert judge_engines(samplers, fleet, {A: EngineReading(None, True)}) == {}, "out of service: not judged"


def test_a_wake_outcome_puts_samplers_back_in_service_or_out_with_the_reason_and_ignores_ones_gone() -> None:
    fleet = SamplerFleet([A, B], ManualClock())
    fleet.errors[A], fleet.unreachable = "down", {A}
    rec = SwitchRecord("g", SwitchKind.REPAIR, "", 0.0)
    rec.sampler_versions.update({A: 2, B: 2, "10.9.9.9:1": 2})
    rec.sampler_errors[B] = "its engine did not wake"
    fleet.take_wake(rec, known={A, B})
    assert fleet.versions == {A: 2, B: 2} and fleet.errors == {B: "its engine did not wake"} and not fleet.unreachable
    assert fleet.serving_version == 2
    fleet.errors[A] = "out"
    assert fleet.serving_version == 0, "no sampler in service"


def test_engines_down_at_the_sleep_come_back_asleep_or_awake() -> None:
    fleet = SamplerFleet([A, B], ManualClock())
    assert not fleet.down_at_sleep({})
    assert fleet.down_at_sleep({A: "connection refused", B: "connection refused"})
    assert fleet.unreachable == {A, B} and "its engine was down at the sleep (connection refused)" in fleet.errors[A]
    asleep, awake = fleet.returned({A: EngineReading(None, True), B: EngineReading(None, False), "x": EngineReading(None, True)})
    assert (asleep, awake) == ([A], [B])
    assert fleet.returned({A: EngineReading(None, True, "refused")}) == ([], []), "still down"
    fleet.back_asleep(A)
    assert A not in fleet.errors and A not in fleet.unreachable


def test_audit_faults_and_answers_of_engines_that_were_down() -> None:
    fleet = SamplerFleet([A, B], ManualClock())
    fleet.versions[A] = 3
    fleet.take_faults({A: (EngineFault.RESTARTED, "restarted"), B: (EngineFault.UNREACHABLE, "refused")})
    assert fleet.versions[A] == 0 and fleet.errors == {A: "restarted", B: "refused"} and fleet.unreachable == {B}
    assert fleet.answering_again({B: EngineReading(None, False, "refused")}) == [] and fleet.unreachable == {B}
    assert fleet.answering_again({A: EngineReading(None, False), B: EngineReading("0", False)}) == [B]
    assert not fleet.unreachable and B in fleet.errors, "answering is not serving: the repair wakes it"


def test_samplers_join_and_leave_and_an_unknown_state_marks_them_out_of_service_keeping_the_first_reason() -> None:
    fleet = SamplerFleet([A], ManualClock())
    fleet.add(B)
    fleet.errors[A] = "failed wake"
    fleet.mark_unknown([A, B], "state unknown after an internal error")
    assert fleet.errors == {A: "failed wake", B: "state unknown after an internal error"}
    fleet.remove(B)
    assert fleet.versions == {A: 0} and B not in fleet.errors
