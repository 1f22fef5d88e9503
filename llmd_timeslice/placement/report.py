"""A plan as plain text and as a picture: the summary ``plan`` prints and writes (``plan.txt``) and the PNG of each
group's predicted timeline with the duty cycle against the alternatives (``plan.png``; matplotlib, imported only
here: :class:`PictureUnavailable` when it is not installed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from llmd_timeslice.placement.plan_file import Plan
from llmd_timeslice.placement.simulation import Trace

ALTERNATIVE_TEXT = {
    "plan": "this plan",
    "dedicated": "dedicated (each job alone, rollout and training on their own accelerators)",
    "colocated_alone": "each job alone, rollout and training on the same accelerators",
    "naive": "every job in one group, FIFO (each on its own accelerators, one lease)",
}


class PictureUnavailable(RuntimeError):
    """matplotlib is not installed (``pip install 'llmd-timeslice[plan]'``)."""


def summary_lines(plan: Plan) -> list[str]:
    """The plan in plain text: headline, groups, jobs, alternatives, search. Slowdowns as percentages."""
    s = plan.search
    out = [
        f"plan: {_count(len(plan.jobs), 'job')} in {_count(len({g.co_execution for g in plan.groups}), 'co-execution group')} "
        f"({_count(len(plan.groups), 'lease group')}) on {plan.accelerators_used} of "
        f"{_count(plan.accelerators_offered, 'accelerator')}; "
        f"predicted duty cycle {plan.predicted_duty_cycle:.3f}",
        f"slowdown budgets: {'every job within its budget' if plan.budgets_met else 'NOT all met (best plan found)'}",
        f"search: {s.method}, {_count(s.candidates_evaluated, 'candidate group')} simulated, {s.cpu_seconds:.2f} s of CPU",
        "",
        "groups:",
    ]
    for g in plan.groups:
        members = ", ".join(f"{m.job_id}/{m.phase}" for m in g.members)
        prio = f" priorities {g.job_priorities}" if g.job_priorities else ""
        nodes = f" on {', '.join(g.nodes)}" if g.nodes else ""
        out.append(
            f"  {g.group_id}: {g.layout}, policy {g.policy}{prio}, {_count(g.accelerators, 'accelerator')}{nodes}, "
            f"duty {g.predicted_duty_cycle:.3f}: {members}"
        )
    out += ["", "jobs (slowdown against running alone: mean [p05, p95] / budget):"]
    for j in plan.jobs:
        mark = "" if j.within_budget else "  OVER BUDGET"
        out.append(
            f"  {j.job_id}: {j.slowdown:+.1%} [{j.slowdown_p05:+.1%}, {j.slowdown_p95:+.1%}] / {j.slowdown_budget:.0%}, "
            f"period {j.period_s:.2f} s (alone {j.alone_period_s:.2f} s), groups "
            f"{', '.join(f'{k}: {v}' for k, v in j.groups.items())}{mark}"
        )
    if len(plan.alternatives) > 1:
        base = plan.alternatives[0].duty_cycle
        out += ["", "duty cycle against the alternatives (same jobs, same simulation):"]
        for a in plan.alternatives:
            over = (
                f", {_count(len(a.jobs_over_budget), 'job')} over budget (worst {a.worst_slowdown:+.0%})"
                if a.jobs_over_budget
                else ""
            )
            ratio = f", plan {base / a.duty_cycle:.2f}x" if a.name != "plan" and a.duty_cycle else ""
            out.append(
                f"  {ALTERNATIVE_TEXT.get(a.name, a.name)}: {a.duty_cycle:.3f} on {_count(a.accelerators, 'accelerator')}"
                f"{ratio}{over}"
            )
    return out


def _count(n: int, noun: str) -> str:
    """``1 job``, ``2 jobs``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def write_picture(plan: Plan, traces: dict[str, tuple[Trace, tuple[float, float]]], path: str | Path, lanes: int = 12) -> Path:
    """The PNG: each co-execution group's predicted timeline (``traces``: co-execution id -> its simulation trace and
    steady window; at most ``lanes`` groups, the largest first) and a bar chart of the duty cycle against the
    alternatives.

    Raises:
        PictureUnavailable: matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise PictureUnavailable("the plan's picture needs matplotlib: pip install 'llmd-timeslice[plan]'") from exc
    shown = list(traces.items())[:lanes]
    rows = [(cid, name, g, window) for cid, (tr, window) in shown for name, g in tr.groups.items()]
    fig, (ax, bx) = plt.subplots(
        2, 1, figsize=(12, 2.2 + 0.45 * max(1, len(rows)) + 2.6), gridspec_kw={"height_ratios": [max(2, len(rows)), 4]}
    )
    colours = plt.get_cmap("tab10")
    jobs = sorted({j.job_id for j in plan.jobs})
    colour = {j: colours(i % 10) for i, j in enumerate(jobs)}
    span = max((min(w[1] - w[0], 4 * _longest(plan, cid)) for cid, _, _, w in rows), default=1.0)
    for y, (_, _, g, (a, _)) in enumerate(rows):
        for s, e, kind, job, _acc in g.busy:
            if e > a and s < a + span:
                ax.barh(
                    y,
                    min(e, a + span) - max(s, a),
                    left=max(s, a) - a,
                    height=0.6,
                    color=colour.get(job, "grey"),
                    hatch="" if kind == "rollout" else "//",
                    edgecolor="k",
                    linewidth=0.3,
                )
        for s, e, _, _ in g.switches:
            if e > a and s < a + span and e > s:
                ax.barh(y, min(e, a + span) - max(s, a), left=max(s, a) - a, height=0.6, color=HANDOVER_COLOUR)
    ax.set_yticks(range(len(rows)), [f"{cid}{'' if n == 'all' else '-' + n}" for cid, n, _, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds of steady state")
    shown_jobs = sorted({job for _, _, g, _ in rows for _, _, _, job, _ in g.busy})
    ax.legend(
        handles=_timeline_legend(shown_jobs, colour),
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        title="marks",
        title_fontsize=8,
    )
    ax.set_title("predicted timeline per lease group")
    names = [a.name for a in plan.alternatives]
    vals = [a.duty_cycle for a in plan.alternatives]
    bars = bx.bar(range(len(vals)), vals, color=[PLAN_COLOUR if n == "plan" else ALTERNATIVE_COLOUR for n in names])
    for b, alt in zip(bars, plan.alternatives, strict=True):
        over = f"\n{len(alt.jobs_over_budget)} over budget" if alt.jobs_over_budget else ""
        note = f"{alt.duty_cycle:.2f}\n{alt.accelerators} acc{over}"
        bx.text(b.get_x() + b.get_width() / 2, b.get_height(), note, ha="center", va="bottom", fontsize=8)
    bx.legend(
        handles=[Patch(color=PLAN_COLOUR, label="this plan"), Patch(color=ALTERNATIVE_COLOUR, label="an alternative")],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
    )
    bx.set_xticks(range(len(vals)), names)
    bx.set_ylim(0, 1.25)
    bx.set_ylabel("predicted duty cycle")
    bx.set_title("duty cycle: the plan against the alternatives (same jobs, same simulation)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


LEGEND_JOBS = 10
"""Jobs named in the timeline's legend (the colours repeat after 10); more are summed up in one entry."""
PLAN_COLOUR, ALTERNATIVE_COLOUR, HANDOVER_COLOUR = "#2b8cbe", "#bdbdbd", "#d9d9d9"


def _timeline_legend(jobs: Sequence[str], colour: dict) -> list:
    """The timeline's legend: one colour per job (at most :data:`LEGEND_JOBS`), then the marks of the phases."""
    from matplotlib.patches import Patch

    out = [Patch(facecolor=colour[j], edgecolor="k", linewidth=0.3, label=f"job {j}") for j in jobs[:LEGEND_JOBS]]
    if len(jobs) > LEGEND_JOBS:
        out.append(Patch(facecolor="white", edgecolor="white", label=f"+{len(jobs) - LEGEND_JOBS} more jobs (colours repeat)"))
    return [
        *out,
        Patch(facecolor="white", edgecolor="k", linewidth=0.3, label="rollout (plain)"),
        Patch(facecolor="white", edgecolor="k", linewidth=0.3, hatch="//", label="train (hatched)"),
        Patch(facecolor=HANDOVER_COLOUR, label="handover (switch)"),
    ]


def _longest(plan: Plan, cid: str) -> float:
    periods: Sequence[float] = [
        j.alone_period_s for j in plan.jobs if any(g == cid or g.startswith(cid + "-") for g in j.groups.values())
    ]
    return max(periods, default=1.0)
