"""``llmd-timeslice status --profiles``: the orchestrator's recorded phase profiles, its measured switch costs and
its last check of the placement plan, as tables (or as JSON that ``plan --profiles`` reads back)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmd_timeslice.placement.live import LiveUnavailable, fetch
from llmd_timeslice.placement.profile import PhaseKind


def _table(title: str, columns: tuple[str, ...]) -> Table:
    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col, overflow="fold")
    return t


def print_profiles(orchestrator: str, token_file: Path | None, as_json: bool, console: Console) -> int:
    """Print the profiles (``as_json``: one JSON document on stdout); 1 when the orchestrator cannot be asked."""
    try:
        state = fetch(orchestrator, token_file)
    except LiveUnavailable as exc:
        console.print(str(exc), style="red", markup=False)
        return 1
    if as_json:
        console.print_json(json.dumps({"profiles": [p.model_dump(mode="json") for p in state.profiles]}))
        return 0
    cols = ("job", "period s (n)", *(f"{k} s (p95)" for k in PhaseKind), "accelerators", "state bytes", "groups")
    t = _table(f"phase profiles @ {orchestrator} (mean of the recent samples)", cols)
    for p in state.profiles:
        phases = [f"{p.mean_s(k):.2f} ({p.phase(k).quantile_s(0.95):.2f})" if p.phase(k).count else "-" for k in PhaseKind]
        acc = "/".join(str(p.accelerators_of(k)) for k in (PhaseKind.ROLLOUT, PhaseKind.TRAIN))
        t.add_row(
            p.job_id,
            f"{p.periods.mean_s:.2f} ({p.periods.count})" if p.periods.count else "-",
            *phases,
            acc,
            str(p.state_bytes_total) if p.state_bytes_total else "-",
            ", ".join(p.groups),
        )
    console.print(t)
    c = state.switch_costs
    if c is not None:
        console.print(
            f"switch costs (medians): sleep {c.sleep_s:.3f} s, wake {c.wake_s:.3f} s, handover {c.grant_s:.3f} s"
            f"{', served samplers' if c.served else ''}",
            markup=False,
        )
    pc = state.placement
    if pc is not None and pc.plan:
        console.print(f"placement plan {pc.plan}: {pc.detail}", markup=False)
        if pc.checked_unix_s:
            advised = "[bold]re-plan advised[/bold]" if pc.replan_advised else "no re-plan advised"
            console.print(
                f"  duty cycle measured {pc.measured_duty_cycle:.3f}, predicted {pc.predicted_duty_cycle:.3f} "
                f"({pc.duty_cycle_gap:+.0%}); a re-plan predicts {pc.replan_duty_cycle:.3f} ({pc.replan_gain:+.0%}): {advised}"
            )
            for line in pc.changes:
                console.print(f"  would change: {line}", markup=False)
            if pc.measured_slowdowns:
                worst = sorted(pc.measured_slowdowns.items(), key=lambda kv: -kv[1])[:5]
                console.print("  slowdowns measured: " + ", ".join(f"{j} {s:+.1%}" for j, s in worst), markup=False)
    return 0
