"""The planner's search (placement/search.py) and the candidates it simulates (placement/evaluate.py)."""

from __future__ import annotations

import pytest

from llmd_timeslice.placement.evaluate import Candidate, Draws, Layout, SwitchCosts, evaluate
from llmd_timeslice.placement.offer import parse_offer
from llmd_timeslice.placement.profile import hand_profile
from llmd_timeslice.placement.search import BudgetsUnmet, JobFitsNowhere, Planner, SearchOptions

COSTS = SwitchCosts(grant_s=0.07, rollout_switch_s=1.0, train_switch_s=1.0)


def test_dedicated_never_slows_a_job_and_colocated_alone_pays_its_handovers(long_gap_jobs):
    profiles = {p.job_id: p for p in long_gap_jobs}
    draws = Draws(long_gap_jobs)
    ded = evaluate(Candidate(("busy",), Layout.DISAGGREGATED), profiles, draws, COSTS)
    col = evaluate(Candidate(("busy",), Layout.COLOCATED), profiles, draws, COSTS)
    assert ded.jobs["busy"].slowdown == pytest.approx(0, abs=1e-9) and ded.accelerators == 8
    # two handovers per iteration: 2 x (0.5 + 0.5 + 0.07) s on a 62 s period
    assert col.jobs["busy"].slowdown == pytest.approx(2 * 1.07 / 62, rel=0.05) and col.accelerators == 4
    assert col.duty_cycle == pytest.approx(2 * ded.duty_cycle, rel=0.05)


def test_exact_search_shares_the_long_gap_jobs_and_leaves_the_busy_one_alone(long_gap_jobs):
    planner = Planner(long_gap_jobs, parse_offer("2x8:1TiB"), COSTS)
    res = planner.run()
    assert res.method == "exact" and res.budgets_met
    groups = {c.candidate.jobs for c in res.chosen}
    assert ("busy",) in groups
    assert any(len(g) >= 2 for g in groups), groups
    assert all(j.within_budget for j in res.jobs())
    alternatives = planner.alternatives()
    dedicated = sum(r.busy_rate for r in alternatives["dedicated"]) / sum(r.accelerators for r in alternatives["dedicated"])
    assert res.duty_cycle > 1.5 * dedicated


def test_heuristic_keeps_every_budget_and_beats_each_job_alone(long_gap_jobs):
    jobs = [p.model_copy(update={"job_id": f"{p.job_id}-{i}"}) for i in range(6) for p in long_gap_jobs]
    planner = Planner(jobs, parse_offer("16x8:1TiB"), COSTS, SearchOptions(exact_max_jobs=4))
    res = planner.run()
    assert res.method == "heuristic" and res.budgets_met
    alone = planner.alternatives(naive_max_jobs=0)["colocated_alone"]
    assert res.duty_cycle > sum(r.busy_rate for r in alone) / sum(r.accelerators for r in alone)
    assert res.evaluated < 10 * len(jobs)


def test_a_job_that_fits_nowhere_is_named_with_why():
    big = hand_profile(job_id="big-70b", rollout_s=10, train_s=10, accelerators=16)
    with pytest.raises(JobFitsNowhere, match=r"job big-70b fits nowhere: needs 16 accelerators, pool pool0 has 8 \(1 x 8\)"):
        Planner([big], parse_offer("1x8:1TiB"), COSTS).run()


def test_budgets_no_plan_meets_say_the_best_found():
    busy = [hand_profile(job_id=f"busy-{i}", rollout_s=10, train_s=10, cpu_gap_s=1, accelerators=4) for i in range(3)]
    with pytest.raises(
        BudgetsUnmet, match=r"no plan meets every slowdown budget on this offer; best found: duty cycle 0\.\d+ on 4"
    ) as exc:
        Planner(busy, parse_offer("1x4:1TiB"), COSTS).run()
    assert exc.value.best.accelerators <= 4 and not exc.value.best.budgets_met
