"""Re-planning while jobs run (placement/replan.py) and the orchestrator's periodic check of a plan file
(orchestrator/placement_watch.py): the gap, the re-plan's gain, what it would change, and when nothing is said."""

from __future__ import annotations

import pytest

from llmd_timeslice.orchestrator.placement_watch import CheckSettings, PlacementWatch
from llmd_timeslice.placement import replan
from llmd_timeslice.placement.evaluate import SwitchCosts
from llmd_timeslice.placement.offer import parse_offer
from llmd_timeslice.placement.plan_file import build_plan
from llmd_timeslice.placement.profile import PhaseKind, PhaseStats, hand_profile
from llmd_timeslice.placement.search import Planner

COSTS = SwitchCosts(grant_s=0.05, rollout_switch_s=0.5, train_switch_s=0.5)


def _plan(profiles):
    planner = Planner(profiles, parse_offer("2x8:1TiB"), COSTS)
    return build_plan(planner.run(), profiles, COSTS, planner.offer)


def _measured(p, period_s):
    return p.model_copy(update={"source": "measured", "periods": PhaseStats.of([period_s] * 4)})


def test_no_re_plan_while_the_measurement_matches():
    jobs = [hand_profile(job_id=f"j{i}", rollout_s=10, train_s=10, cpu_gap_s=2, accelerators=4) for i in range(2)]
    plan = _plan(jobs)
    check = replan.check(plan, "plan.json", [_measured(p, p.alone_period_s * 1.02) for p in jobs], plan.predicted_duty_cycle)
    assert not check.replan_advised and check.new_plan is None and "within 10%" in check.detail


def test_longer_cpu_gaps_than_planned_advise_sharing_and_say_what_moves():
    busy = [hand_profile(job_id=f"j{i}", rollout_s=10, train_s=10, cpu_gap_s=1, accelerators=4) for i in range(2)]
    plan = _plan(busy)  # each alone: their accelerators are busy
    assert all(len(g.jobs) == 1 for g in plan.groups)
    drifted = [p.model_copy(update={"phases": {**p.phases, PhaseKind.CPU_GAP: PhaseStats.of([80.0])}}) for p in busy]
    measured = [_measured(p, p.alone_period_s) for p in drifted]
    check = replan.check(plan, "plan.json", measured, plan.predicted_duty_cycle * 0.3)
    assert check.duty_cycle_gap == pytest.approx(-0.7)
    assert check.replan_advised and check.replan_gain > 0.1, check.detail
    assert check.changes == ["job j0: with nobody -> with ['j1']", "job j1: with nobody -> with ['j0']"]


def test_the_watch_checks_the_plan_file_over_its_window(tmp_path):
    jobs = [hand_profile(job_id=f"j{i}", rollout_s=1, train_s=1, cpu_gap_s=0.1, accelerators=4) for i in range(2)]
    plan = _plan(jobs)
    plan.save(tmp_path / "plan.json")
    now = [1000.0]
    watch = PlacementWatch(CheckSettings(tmp_path / "plan.json", interval_s=60), clock=lambda: now[0])
    assert watch.check_now() is None  # the first call opens the window
    for g in plan.groups:  # every group held half the time since
        watch.recorder.busy_accelerator_s[g.group_id] = 0.5 * 60 * g.accelerators
    now[0] += 60
    check = watch.check_now()
    assert check is not None and check.measured_duty_cycle == pytest.approx(0.5)
    resp = watch.list_profiles()
    assert resp.placement.plan.endswith("plan.json") and resp.placement.measured_duty_cycle == pytest.approx(0.5)
