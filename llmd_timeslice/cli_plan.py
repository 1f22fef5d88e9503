"""``llmd-timeslice plan``: propose which jobs share accelerators (the placement planner; docs/placement.md). Added
to the main command by :mod:`llmd_timeslice.cli`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from llmd_timeslice.cli_files import existing_file

PLAN_HELP = """Propose which RL jobs share accelerators, in which groups, under which policy.

Reads each job's phase profile (rollout, CPU gap, train, weight sync: durations, accelerators, host-memory state),
from a live orchestrator (--orchestrator, or -f for a stack run by `up`) and/or files (--profiles: hand-written
YAML, or profiles saved by `status --profiles --json`), and the accelerators on offer (--offer 64x8:2TiB: nodes x
accelerators : host memory per node). Every candidate group is judged by simulating its schedule with the switch
costs the orchestrator measured (or --switch-costs); the plan maximises the aggregate duty cycle with every job's
slowdown against running alone within its budget (default 5 %) and every time-sliced job's state in host memory.
Search: exact up to --exact-max-jobs jobs, then first fit by decreasing load (docs/placement.md).

Writes OUT/plan.json (groups, members, policy, predicted duty cycle, per-job slowdown with its spread),
OUT/plan.txt (the summary, also printed) and OUT/plan.png (each group's predicted timeline, and the duty cycle
against the alternatives: dedicated, each job alone, all in one group). With --apply also OUT/stack.yaml (the stack
file of -f/--stack rewritten with the plan's groups, for `up`), OUT/k8s-patch.sh (kubectl label/annotate commands
to review) and OUT/job-groups.json (the groups each job acquires); a job that holds accelerators now is never
moved silently (--move-holders to allow it).

Exit codes: 0 a plan within every budget; 2 bad input (one line each: a profile with no complete period, a job
that fits nowhere, an unreadable file); 3 no plan meets every budget (the best found is written, and said in one
line)."""


def plan(
    profiles: Annotated[
        list[Path],
        typer.Option(
            "--profiles",
            "-p",
            metavar="FILE",
            help="Profiles file (YAML or JSON; repeatable): hand entries {job_id, rollout_s, train_s, cpu_gap_s, "
            "weight_sync_s, accelerators, state_bytes, slowdown_budget} or profiles saved by `status --profiles "
            "--json`. A job also measured live: the file's accelerators, state bytes, budget and priority win.",
            callback=existing_file("profiles file"),
        ),
    ] = [],  # noqa: B006
    orchestrator: Annotated[
        str | None,
        typer.Option(
            "--orchestrator", metavar="HOST:PORT", help="Live orchestrator: its recorded profiles, switch costs and holders."
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option("--token-file", metavar="FILE", help="Control-plane token file (default: $LLMD_TIMESLICE_TOKEN_FILE)."),
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option(
            "--file",
            "-f",
            metavar="FILE",
            help="Stack file of `up`: its running orchestrator and token (like --orchestrator), and the file --apply rewrites.",
            callback=existing_file("stack file"),
        ),
    ] = None,
    offer: Annotated[
        str | None,
        typer.Option(
            metavar="SPEC",
            help="Accelerators on offer: COUNTxACCELERATORS[:HOST_MEMORY] per node pool, comma separated (64x8:2TiB).",
        ),
    ] = None,
    offer_file: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Offer as YAML: {nodes: [{name, count, accelerators, host_memory}]}.",
            callback=existing_file("offer file"),
        ),
    ] = None,
    switch_costs: Annotated[
        Path | None,
        typer.Option(
            help="Switch costs as YAML {grant_s, rollout_switch_s, train_switch_s, served, sleep_s, wake_s} (default: "
            "measured by the live orchestrator; without one, docs/placement.md's defaults).",
            metavar="FILE",
            callback=existing_file("switch costs file"),
        ),
    ] = None,
    budget: Annotated[
        float | None,
        typer.Option(
            min=0, metavar="NUMBER", help="Every job's slowdown budget, relative (0.05 = 5 %), instead of the profiles'."
        ),
    ] = None,
    max_group_jobs: Annotated[
        int, typer.Option(min=1, max=16, metavar="INTEGER", help="Most jobs in one co-execution group.")
    ] = 4,
    exact_max_jobs: Annotated[
        int, typer.Option(min=0, max=10, metavar="INTEGER", help="Exact search up to this many jobs; heuristic beyond.")
    ] = 8,
    tries_per_job: Annotated[
        int, typer.Option(min=1, metavar="INTEGER", help="Heuristic: open groups a job is simulated in before it opens its own.")
    ] = 4,
    seed: Annotated[int, typer.Option(metavar="INTEGER", help="Seed of the durations drawn from each profile.")] = 0,
    group_prefix: Annotated[str, typer.Option(metavar="PREFIX", help="Group ids are PREFIX-0, PREFIX-1 and so on.")] = "ts",
    out: Annotated[
        Path, typer.Option(metavar="DIR", help="Folder for plan.json, plan.txt, plan.png (and --apply's files).")
    ] = Path("plan-out"),
    apply: Annotated[
        bool, typer.Option("--apply", help="Also write OUT/stack.yaml, OUT/k8s-patch.sh and OUT/job-groups.json.")
    ] = False,
    stack: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE", help="With --apply: the stack file to rewrite (default: -f's).", callback=existing_file("stack file")
        ),
    ] = None,
    engine: Annotated[
        list[str],
        typer.Option(metavar="ENGINE=JOB", help="With --apply: engine ENGINE serves job JOB (default: by name, JOB or JOB-...)."),
    ] = [],  # noqa: B006
    namespace: Annotated[
        str | None, typer.Option(metavar="TEXT", help="With --apply: namespace of the kubectl commands.")
    ] = None,
    move_holders: Annotated[bool, typer.Option(help="With --apply: allow moving jobs that hold accelerators now.")] = False,
    picture: Annotated[bool, typer.Option(help="Write OUT/plan.png (needs matplotlib).")] = True,
) -> None:
    from llmd_timeslice.placement import run_plan

    if file is not None and orchestrator is None:
        from llmd_timeslice.local.find_stack import running_stack_endpoints

        eps = running_stack_endpoints(file)
        if eps:
            orchestrator = eps.get("orchestrator")
            token_file = token_file or (Path(eps["token_file"]) if eps.get("token_file") else None)
        elif not profiles:
            typer.echo(f"llmd-timeslice plan: no stack runs from {file}: start it with `up`, or give --profiles", err=True)
            raise typer.Exit(2)
    try:
        args = run_plan.PlanArgs(
            profile_files=profiles,
            orchestrator=orchestrator,
            token_file=token_file,
            stack_file=file,
            offer=offer,
            offer_file=offer_file,
            switch_costs_file=switch_costs,
            budget=budget,
            max_group_jobs=max_group_jobs,
            exact_max_jobs=exact_max_jobs,
            tries_per_job=tries_per_job,
            seed=seed,
            group_prefix=group_prefix,
            out=out,
            apply=apply,
            apply_stack=stack or file,
            engine_map=run_plan.parse_engine_map(engine),
            namespace=namespace,
            move_holders=move_holders,
            picture=picture,
            check_stack=_stack_problems,
        )
    except ValueError as exc:
        typer.echo(f"llmd-timeslice plan: {exc}", err=True)
        raise typer.Exit(2) from None
    outcome = run_plan.run(args)
    for line in outcome.lines:
        typer.echo(line)
    for line in outcome.errors:
        typer.echo(f"llmd-timeslice plan: {line}", err=True)
    raise typer.Exit(outcome.code)


plan.__doc__ = PLAN_HELP


def _stack_problems(path: Path) -> list[str]:
    """What ``up`` would refuse in the stack file at ``path`` (one line each; files it names are checked too)."""
    from llmd_timeslice.local.stack_file import StackError, load_stack_file

    try:
        load_stack_file(path)  # its cross-field checks included
    except StackError as exc:
        return list(exc.errors)
    return []


def profiles_json(profiles: list) -> str:
    """The profiles as ``plan --profiles`` reads them back (JSON)."""
    return json.dumps({"profiles": [p.model_dump(mode="json") for p in profiles]}, indent=1)
