"""Helpers of benchmarks.placement (the measurement of a run) and benchmarks.placement_scale (the mix, the
baselines), without a stack: the stack run itself is the benchmark's (docs/benchmarks.md, "Placement")."""

from __future__ import annotations

import pytest

from benchmarks import placement as b
from benchmarks import placement_scale as s


def test_measure_counts_each_phase_times_its_accelerators_in_the_window_and_slowdown_against_the_draws():
    runs = {j.name: b.JobRun() for j in b.JOBS}
    for j in b.JOBS:
        r = runs[j.name]
        for i in range(5):  # a 10 s period against 8 s of drawn phases: +25 %
            r.starts.append(10.0 * i)
            r.drawn.append([2.0, 3.0, 2.0, 1.0])
            r.holds += [
                ("rollout", 10.0 * i, 10.0 * i + 2, j.accelerators),
                ("train", 10.0 * i + 5, 10.0 * i + 7, j.accelerators),
            ]
        r.starts.append(50.0)
    m = b.measure(runs, 40, 10.0, 50.0)
    assert m["duty_cycle_measured"] == pytest.approx(sum(4 * j.accelerators for j in b.JOBS) / (40 * 10))
    assert all(
        x["slowdown"] == pytest.approx(0.25) and x["iterations"] == 4 and not x["within_budget"] for x in m["jobs"].values()
    )


def test_targets_say_what_is_met():
    res = {
        "naive": {"duty_cycle_measured": 0.2},
        "plan": {"duty_cycle_measured": 0.5, "duty_cycle_predicted": 0.52, "jobs": {"a": {"within_budget": True}}},
    }
    t = b.targets(res)
    assert t["plan_vs_naive_met"] and t["prediction_met"] and t["budgets_met"] and t["prediction_error"] == pytest.approx(0.04)


def test_the_scale_mix_is_64_jobs_on_480_dedicated_accelerators_each_input_sourced():
    jobs = s.make_jobs(64)
    assert len(jobs) == 64 and sum(2 * p.accelerators_of("train") for p in jobs) == 480
    assert all(c.source for c in s.CLASSES) and all(p.switch_s["rollout"] > 0 for p in jobs)


def test_the_baselines_place_every_job_once():
    from llmd_timeslice.placement.offer import parse_offer
    from llmd_timeslice.placement.search import Planner

    planner = Planner(s.make_jobs(8), parse_offer(s.OFFER), s.COSTS)
    for results in (s.random_pairing(planner, 0), s.rollmux_like(planner)):
        placed = sorted(j for r in results for j in r.candidate.jobs)
        assert placed == sorted(planner.profiles)
