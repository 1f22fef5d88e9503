"""The schedule simulation (placement/simulation.py): leases, waiter policies, handovers, idle holders, duty cycle."""

from __future__ import annotations

import pytest

from llmd_timeslice.placement import simulation as sim


def _steps(rollout: float, gap: float, train: float, sync: float):
    def script(job: str, it: int):
        return [
            sim.Use("sampler", rollout, "rollout"),
            sim.Idle(gap, "cpu_gap"),
            sim.Use("trainer", train, "train"),
            sim.Idle(sync, "weight_sync"),
        ]

    return script


def _free(group, resident, incoming):
    return 0.0, None


def test_one_job_alone_runs_its_phases_back_to_back_and_its_duty_cycle_is_their_share():
    place = {("a", "sampler"): "g", ("a", "trainer"): "g"}
    tr = sim.simulate_schedule(["a"], place, [sim.GroupSim("g", 4)], _steps(2, 1, 3, 1), _free, iterations=5)
    starts = tr.iteration_starts["a"]
    assert starts == pytest.approx([0, 7, 14, 21, 28, 35])
    assert sim.duty_cycle(tr, 0, 35) == pytest.approx(5 / 7)


def test_fifo_second_job_waits_for_the_first_and_pays_the_handover():
    place = {(j, r): "g" for j in ("a", "b") for r in ("sampler", "trainer")}

    def switch(group, resident, incoming):
        return (0.5, "x") if resident is not None and resident != incoming else (0.0, None)

    tr = sim.simulate_schedule(["a", "b"], place, [sim.GroupSim("g", 1)], _steps(2, 10, 2, 0), switch, iterations=1)
    b_rollout = next(u for u in tr.uses["b"] if u.kind == "rollout")
    assert b_rollout.asked_s == 0 and b_rollout.start_s == pytest.approx(2.5)  # a's rollout, then the handover
    assert len(tr.groups["g"].switches) >= 1


def test_priority_policy_grants_the_higher_priority_waiter_first():
    place = {(j, r): "g" for j in ("a", "b", "c") for r in ("sampler", "trainer")}
    group = sim.GroupSim("g", 1, policy="priority", priorities={"c": 5})
    tr = sim.simulate_schedule(["a", "b", "c"], place, [group], _steps(1, 50, 1, 0), _free, iterations=1)
    first = {j: next(u.start_s for u in tr.uses[j] if u.kind == "rollout") for j in "abc"}
    assert first["a"] == 0 and first["c"] == pytest.approx(1) and first["b"] == pytest.approx(2)


def test_idle_holder_takes_the_group_when_nobody_waits_and_is_put_aside_before_the_next_grant():
    place = {("a", "sampler"): "g", ("a", "trainer"): "g"}
    costs = {"wake": 0.25, "sleep": 0.5}

    def switch(group, resident, incoming):
        if incoming == ("", "samplers"):
            return costs["wake"], "wake"
        if resident == ("", "samplers"):
            return costs["sleep"], "sleep"
        return 0.0, None

    g = sim.GroupSim("g", 1, idle_holder=("", "samplers"))
    tr = sim.simulate_schedule(["a"], place, [g], _steps(1, 2, 1, 2), switch, iterations=2)
    # per iteration: sleep 0.5 + rollout 1, the wake (0.25 s) inside the 2 s gap, sleep 0.5 + train 1, wake, sync 2
    assert tr.iteration_starts["a"] == pytest.approx([0, 7, 14])
    assert [d for _, _, d, _ in tr.groups["g"].switches][:4] == ["sleep", "wake", "sleep", "wake"]


def test_a_phase_counts_its_own_accelerators_not_the_groups():
    place = {("a", "sampler"): "g", ("a", "trainer"): "g"}

    def script(job, it):
        return [sim.Use("sampler", 1, "rollout", accelerators=2), sim.Use("trainer", 1, "train", accelerators=8)]

    tr = sim.simulate_schedule(["a"], place, [sim.GroupSim("g", 8)], script, _free, iterations=1)
    assert sim.duty_cycle(tr, 0, 2) == pytest.approx((2 + 8) / 16)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="iterations or until_s"):
        sim.simulate_schedule(["a"], {}, [sim.GroupSim("g", 1)], _steps(1, 1, 1, 1), _free)
    with pytest.raises(ValueError, match="named twice"):
        sim.simulate_schedule(["a"], {}, [sim.GroupSim("g", 1), sim.GroupSim("g", 2)], _steps(1, 1, 1, 1), _free, iterations=1)
    with pytest.raises(ValueError, match="has no group"):
        sim.simulate_schedule(["a"], {}, [sim.GroupSim("g", 1)], _steps(1, 1, 1, 1), _free, iterations=1)
    with pytest.raises(ValueError, match="empty window"):
        tr = sim.simulate_schedule(
            ["a"], {("a", "sampler"): "g", ("a", "trainer"): "g"}, [sim.GroupSim("g", 1)], _steps(1, 1, 1, 1), _free, iterations=1
        )
        sim.duty_cycle(tr, 1, 1)
