"""What ``llmd-timeslice plan`` does, step by step (the command's I/O; the CLI only parses options).

1. Profiles: the live orchestrator's (``--orchestrator``; the CLI finds the one of ``-f``'s running stack) and the
   files' (``--profiles``); a job in both keeps its measured durations and takes the file's accelerators, state
   bytes, budget and priority.
2. Offer, switch costs (a file, else measured live, else :data:`DEFAULT_SWITCH_COSTS`), budgets.
3. Every job that cannot be planned: one line each (exit 2). Then the search (:class:`~.search.Planner`); budgets no
   plan meets: the best found is kept, one line (exit 3).
4. ``OUT/plan.json``, ``OUT/plan.txt``, ``OUT/plan.png``; with ``--apply`` ``OUT/stack.yaml``, ``OUT/k8s-patch.sh``
   and ``OUT/job-groups.json`` (:mod:`~.apply`).

Errors are returned as lines in :class:`Outcome`, never raised to the command.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import ValidationError

from llmd_timeslice import yaml_files
from llmd_timeslice.placement.evaluate import Candidate, SwitchCosts
from llmd_timeslice.placement.offer import Offer, parse_offer
from llmd_timeslice.placement.plan_file import Plan, build_plan, group_ids
from llmd_timeslice.placement.profile import JobProfile, ProfileError, load_profiles
from llmd_timeslice.placement.search import BudgetsUnmet, Planner, PlanningError, SearchOptions, SearchResult

DEFAULT_SWITCH_COSTS = SwitchCosts(grant_s=0.073, rollout_switch_s=1.74, train_switch_s=1.53)
"""Without a measurement: this project's handovers at 7B on an accelerator node as the RL model composes them
(samplers: drain barrier, verified level-1 sleep and wake; trainer: offload and restore with the device checksum;
release + grant), the figures and their sources in docs/benchmarks.md and docs/placement.md."""

HAND_FIELDS = ("accelerators", "state_bytes", "slowdown_budget", "priority", "switch_s")
"""What a profiles file adds to a job the orchestrator measured."""


@dataclass
class PlanArgs:
    """The command's options (see ``llmd-timeslice plan --help``)."""

    profile_files: Sequence[Path] = ()
    orchestrator: str | None = None
    token_file: Path | None = None
    stack_file: Path | None = None
    offer: str | None = None
    offer_file: Path | None = None
    switch_costs_file: Path | None = None
    budget: float | None = None
    max_group_jobs: int = 4
    exact_max_jobs: int = 8
    tries_per_job: int = 4
    seed: int = 0
    group_prefix: str = "ts"
    out: Path = Path("plan")
    apply: bool = False
    apply_stack: Path | None = None
    engine_map: dict[str, str] = field(default_factory=dict)
    namespace: str | None = None
    move_holders: bool = False
    picture: bool = True
    check_stack: Callable[[Path], list[str]] | None = None
    """Checks a written stack file as ``up`` would (one line per problem; the CLI passes the stack loader's)."""

    def __post_init__(self) -> None:
        if not self.profile_files and not self.orchestrator:
            raise ValueError("no profiles: give --profiles FILE, --orchestrator HOST:PORT or -f STACK_FILE (a running stack)")
        if (self.offer is None) == (self.offer_file is None):
            raise ValueError("give the accelerators on offer: --offer 64x8:2TiB or --offer-file FILE (one of them)")


@dataclass
class Outcome:
    """What the command prints (``lines`` to stdout, ``errors`` to stderr) and its exit code."""

    code: int = 0
    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    plan: Plan | None = None


def parse_engine_map(items: Sequence[str]) -> dict[str, str]:
    """``ENGINE=JOB`` items -> {engine: job}. Raises ValueError naming a malformed item."""
    out = {}
    for item in items:
        engine, sep, job = item.partition("=")
        if not sep or not engine or not job:
            raise ValueError(f"--engine {item!r}: expected ENGINE=JOB")
        out[engine] = job
    return out


def read_offer(text: str | None, path: Path | None) -> Offer:
    """The offer of ``--offer`` or ``--offer-file``. Raises ValueError (one line)."""
    if text is not None:
        return parse_offer(text)
    assert path is not None
    try:
        return Offer.model_validate(yaml_files.load(path.read_text()))
    except ValidationError as exc:
        raise ValueError("; ".join(f"{path}: {line}" for line in yaml_files.validation_lines(exc, Offer))) from None
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def read_switch_costs(path: Path) -> SwitchCosts:
    """Switch costs from a YAML file. Raises ValueError (one line)."""
    try:
        return SwitchCosts.model_validate(yaml_files.load(path.read_text()) or {})
    except ValidationError as exc:
        raise ValueError("; ".join(f"{path}: {line}" for line in yaml_files.validation_lines(exc, SwitchCosts))) from None
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def merge_profiles(measured: Sequence[JobProfile], files: Sequence[JobProfile]) -> list[JobProfile]:
    """Measured profiles, with a file's accelerators, state bytes, budget, priority and switch seconds for the same
    job; jobs only in a file as they are. Job order: measured first."""
    by_file = {p.job_id: p for p in files}
    out = []
    for p in measured:
        hand = by_file.pop(p.job_id, None)
        out.append(p if hand is None else p.model_copy(update={f: getattr(hand, f) for f in HAND_FIELDS}))
    return out + list(by_file.values())


def run(args: PlanArgs) -> Outcome:
    """Plan, write the files, apply (module docstring)."""
    res = Outcome()
    try:
        files = load_profiles(args.profile_files)
    except ProfileError as exc:
        return Outcome(2, errors=exc.errors)
    live = None
    if args.orchestrator:
        from llmd_timeslice.placement import live as live_source

        try:
            live = live_source.fetch(args.orchestrator, args.token_file)
        except live_source.LiveUnavailable as exc:
            return Outcome(2, errors=[str(exc)])
    profiles = merge_profiles(live.profiles if live else [], files)
    if args.budget is not None:
        profiles = [p.model_copy(update={"slowdown_budget": args.budget}) for p in profiles]
    if not profiles:
        return Outcome(2, errors=["no job to plan: the profiles are empty (has any job acquired a group yet?)"])
    try:
        offer = read_offer(args.offer, args.offer_file)
        if args.switch_costs_file is not None:
            costs = read_switch_costs(args.switch_costs_file)
        elif live is not None and live.switch_costs is not None:
            costs = live.switch_costs
        else:
            costs = DEFAULT_SWITCH_COSTS
    except ValueError as exc:
        return Outcome(2, errors=[str(exc)])
    options = SearchOptions(args.max_group_jobs, args.exact_max_jobs, args.tries_per_job, seed=args.seed)
    planner = Planner(profiles, offer, costs, options)
    problems = planner.problems()
    if problems:
        return Outcome(2, errors=problems)
    try:
        result = planner.run()
    except BudgetsUnmet as exc:
        result = exc.best
        res.code = 3
        res.errors.extend(exc.lines)
    except PlanningError as exc:
        return Outcome(2, errors=exc.lines)
    plan = build_plan(result, profiles, costs, offer, planner.alternatives(), args.group_prefix)
    res.plan = plan
    args.out.mkdir(parents=True, exist_ok=True)
    from llmd_timeslice.placement.report import PictureUnavailable, summary_lines, write_picture

    text = summary_lines(plan)
    plan.save(args.out / "plan.json")
    (args.out / "plan.txt").write_text("\n".join(text) + "\n")
    res.lines.extend(text)
    res.lines.append("")
    res.lines.append(f"wrote {args.out / 'plan.json'}, {args.out / 'plan.txt'}")
    if args.picture:
        try:
            write_picture(plan, traces(planner, result, args.group_prefix), args.out / "plan.png")
            res.lines[-1] += f", {args.out / 'plan.png'}"
        except PictureUnavailable as exc:
            res.lines.append(str(exc))
    if args.apply:
        code = _apply(args, plan, live.holders if live else {}, res)
        res.code = res.code or code
    return res


def traces(planner: Planner, result: SearchResult, prefix: str = "ts") -> dict:
    """Co-execution id -> (trace, window) of each chosen group, simulated again with its trace."""
    ids = group_ids(result.chosen, prefix)
    out = {}
    for cid, r in sorted(zip(ids, result.chosen, strict=True), key=lambda x: int(x[0].rsplit("-", 1)[1])):
        cand: Candidate = r.candidate
        full = planner.evaluate(cand, keep_trace=True)
        out[cid] = (full.trace, full.window_s)
    return out


def _absolute_paths(data: dict, base: Path) -> dict:
    """The stack file's relative paths (token file, model directories) made absolute from ``base``, its folder: the
    written file lives elsewhere. An unset workdir stays unset (the new stack gets its own, beside the new file)."""
    stack = data.get("stack") or {}
    if isinstance(stack.get("token_file"), str) and not Path(stack["token_file"]).is_absolute():
        stack["token_file"] = str(base / stack["token_file"])
    if isinstance(stack.get("workdir"), str) and not Path(stack["workdir"]).is_absolute():
        stack["workdir"] = str(base / stack["workdir"])
    for e in data.get("engines") or []:
        model = (e.get("vllm") or {}).get("model")
        if isinstance(model, str) and not model.startswith("builtin:") and not Path(model).is_absolute():
            e["vllm"]["model"] = str(base / model)
    return data


def _apply(args: PlanArgs, plan: Plan, holders: dict[str, str], res: Outcome) -> int:
    import json

    from llmd_timeslice.placement.apply import ApplyRefused, apply_to_stack, job_environment, kubernetes_patch

    (args.out / "k8s-patch.sh").write_text(kubernetes_patch(plan, args.namespace, holders))
    (args.out / "job-groups.json").write_text(json.dumps(job_environment(plan), indent=1) + "\n")
    written = [args.out / "k8s-patch.sh", args.out / "job-groups.json"]
    if args.apply_stack is not None:
        try:
            data = _absolute_paths(yaml_files.load(args.apply_stack.read_text()), args.apply_stack.resolve().parent)
            new, changes = apply_to_stack(data, plan, holders, args.move_holders, args.engine_map)
            new.setdefault("stack", {})["placement_plan"] = str((args.out / "plan.json").resolve())
        except ApplyRefused as exc:
            res.errors.extend(exc.lines)
            return 2
        except (OSError, yaml.YAMLError) as exc:
            res.errors.append(f"{args.apply_stack}: {exc}")
            return 2
        header = (
            f"# Written by `llmd-timeslice plan --apply` from {args.apply_stack} (predicted duty cycle "
            f"{plan.predicted_duty_cycle:.3f}; plan: {args.out / 'plan.json'}). Start it with `llmd-timeslice up -f`.\n"
        )
        out = args.out / "stack.yaml"
        out.write_text(header + yaml.safe_dump(new, sort_keys=False))
        problems = args.check_stack(out) if args.check_stack else []
        if problems:
            res.errors.extend(f"{out}: {e}" for e in problems)
            return 2
        written.insert(0, out)
        res.lines.append("applied to the stack file:")
        res.lines.extend(f"  {c}" for c in changes)
    elif holders:
        res.lines.append("no stack file to rewrite (-f or --stack): only the Kubernetes patch and the job groups")
    res.lines.append(f"wrote {', '.join(str(w) for w in written)}")
    return 0
