"""Re-planning while jobs run: the plan's prediction against what the orchestrator measures (no I/O).

:func:`check` takes the plan in force, the current profiles and the duty cycle measured over the plan's groups, and
says whether a re-plan is worth it:

1. the **gap**: ``(measured - predicted) / predicted`` of the aggregate duty cycle, and each job's measured slowdown
   (its recent mean period over its period alone, from its own profile) against its budget;
2. past ``gap_threshold`` (or a job over its budget), the planner runs again on the current profiles (the plan's
   offer and switch costs; each job's accelerators, state bytes and budget from the plan's profiles where the
   measured ones lack them), and the plan's *current* groups are predicted again with the same profiles;
3. a re-plan is **advised** when its predicted duty cycle beats the current groups' by more than ``gain_threshold``
   (relative) with every budget met; :func:`changes` says what it would move, one line each.

What the orchestrator may apply itself (a group whose settings allow it): the policy and job priorities of the
groups the re-plan keeps; moving jobs between groups stays a person's ``plan --apply``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmd_timeslice.placement.evaluate import Candidate, Layout
from llmd_timeslice.placement.plan_file import Plan, build_plan
from llmd_timeslice.placement.profile import DEFAULT_GAIN, DEFAULT_GAP, IncompleteProfile, JobProfile
from llmd_timeslice.placement.search import BudgetsUnmet, Planner, PlanningError, SearchOptions


@dataclass
class Check:
    """One comparison (module docstring); figures are fractions (0.1 = 10 %)."""

    plan: str
    checked_unix_s: float
    predicted_duty_cycle: float
    measured_duty_cycle: float
    duty_cycle_gap: float
    replan_duty_cycle: float = 0.0
    replan_gain: float = 0.0
    replan_advised: bool = False
    changes: list[str] = field(default_factory=list)
    detail: str = ""
    measured_slowdowns: dict[str, float] = field(default_factory=dict)
    predicted_slowdowns: dict[str, float] = field(default_factory=dict)
    new_plan: Plan | None = None


def measured_slowdown(p: JobProfile, recent: int = 8) -> float | None:
    """A job's recent mean period over its period alone, minus 1 (None: no period measured yet)."""
    periods = p.periods.samples_s[-recent:]
    alone = p.alone_period_s
    if not periods or alone <= 0:
        return None
    return sum(periods) / len(periods) / alone - 1


def _with_plan_hints(current: Sequence[JobProfile], plan: Plan) -> list[JobProfile]:
    by_job = {p.job_id: p for p in plan.profiles}
    out = []
    for p in current:
        hand = by_job.get(p.job_id)
        if hand is None:
            out.append(p)
            continue
        update = {
            "accelerators": p.accelerators or hand.accelerators,
            "state_bytes": p.state_bytes or hand.state_bytes,
            "switch_s": p.switch_s or hand.switch_s,
            "slowdown_budget": hand.slowdown_budget,
            "priority": hand.priority,
        }
        out.append(p.model_copy(update=update))
    return out


def changes(old: Plan, new: Plan) -> list[str]:
    """What ``new`` changes of ``old``, one line each: jobs moved between co-execution groups, layouts and policies."""

    def together(plan: Plan) -> dict[str, tuple[frozenset[str], str, str]]:
        out = {}
        for g in plan.groups:
            members = frozenset(m.job_id for m in g.members)
            for j in members:
                out[j] = (members, str(g.layout), g.policy)
        return out

    a, b = together(old), together(new)
    lines = []
    for job in sorted(set(a) | set(b)):
        if job not in a or job not in b:
            continue
        if a[job][0] != b[job][0]:
            lines.append(
                f"job {job}: with {sorted(a[job][0] - {job}) or 'nobody'} -> with {sorted(b[job][0] - {job}) or 'nobody'}"
            )
        elif a[job][1:] != b[job][1:]:
            lines.append(f"job {job}: {a[job][1]}, {a[job][2]} -> {b[job][1]}, {b[job][2]}")
    return sorted(set(lines))


def _current_groups(plan: Plan, planner: Planner) -> float | None:
    """The plan's co-execution groups predicted again on the planner's (current) profiles: their duty cycle."""
    busy = acc = 0.0
    seen = set()
    for g in plan.groups:
        if g.co_execution in seen:
            continue
        seen.add(g.co_execution)
        jobs = tuple(sorted({m.job_id for x in plan.groups if x.co_execution == g.co_execution for m in x.members}))
        if any(j not in planner.profiles for j in jobs):
            return None
        r = planner.evaluate(Candidate(jobs, Layout(g.layout), g.policy))
        busy += r.busy_rate
        acc += r.accelerators
    return busy / acc if acc else None


def check(
    plan: Plan,
    plan_name: str,
    current: Sequence[JobProfile],
    measured_duty_cycle: float,
    gap_threshold: float = DEFAULT_GAP,
    gain_threshold: float = DEFAULT_GAIN,
    options: SearchOptions | None = None,
) -> Check:
    """Compare ``plan`` with the measurements (module docstring). Never raises for bad profiles: the reason is the
    check's ``detail``."""
    planned = {j.job_id for j in plan.jobs}
    profiles = [p for p in _with_plan_hints(current, plan) if p.job_id in planned]
    predicted = plan.predicted_duty_cycle
    gap = (measured_duty_cycle - predicted) / predicted if predicted else 0.0
    res = Check(plan_name, time.time(), predicted, measured_duty_cycle, gap)
    res.predicted_slowdowns = {j.job_id: j.slowdown for j in plan.jobs}
    for p in profiles:
        s = measured_slowdown(p)
        if s is not None:
            res.measured_slowdowns[p.job_id] = s
    budgets = {j.job_id: j.slowdown_budget for j in plan.jobs}
    over = sorted(j for j, s in res.measured_slowdowns.items() if s > budgets.get(j, 0.05) + 1e-9)
    if abs(gap) <= gap_threshold and not over:
        res.detail = f"measured duty cycle {measured_duty_cycle:.3f} within {gap_threshold:.0%} of the plan's {predicted:.3f}"
        return res
    why = f"measured duty cycle {measured_duty_cycle:.3f} vs {predicted:.3f} predicted ({gap:+.0%})"
    if over:
        why += f"; over budget: {', '.join(over)}"
    complete = []
    for p in profiles:
        try:
            p.check_complete()
            complete.append(p)
        except IncompleteProfile:
            pass
    if len(complete) < len(planned):
        res.detail = f"{why}; not re-planned: {len(planned) - len(complete)} planned jobs have no complete period yet"
        return res
    if plan.offer is None:
        res.detail = f"{why}; not re-planned: the plan names no offer"
        return res
    planner = Planner(complete, plan.offer, plan.switch_costs, options)
    now = _current_groups(plan, planner)
    try:
        result = planner.run()
    except BudgetsUnmet as exc:
        result = exc.best
    except PlanningError as exc:
        res.detail = f"{why}; not re-planned: {exc.lines[0]}"
        return res
    new = build_plan(result, complete, plan.switch_costs, plan.offer)
    res.new_plan = new
    res.replan_duty_cycle = new.predicted_duty_cycle
    base = now if now else predicted
    res.replan_gain = (new.predicted_duty_cycle - base) / base if base else 0.0
    res.changes = changes(plan, new)
    res.replan_advised = bool(res.changes) and res.replan_gain > gain_threshold and new.budgets_met
    verdict = "a re-plan is advised" if res.replan_advised else "no re-plan advised"
    res.detail = (
        f"{why}; {verdict}: predicted {new.predicted_duty_cycle:.3f} against {base:.3f} for the current groups "
        f"({res.replan_gain:+.0%}, threshold {gain_threshold:.0%}), {len(res.changes)} changes"
    )
    return res
