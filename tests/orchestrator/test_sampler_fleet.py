"""The sampler fleet on its own (orchestrator/sampler_fleet.py): the repair back-off and the engine judgement."""

from __future__ import annotations

from llmd_timeslice.domain.group_settings import SamplerEndpoint
from llmd_timeslice.domain.switches import EngineFault, EngineReading
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
