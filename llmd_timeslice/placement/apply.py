"""``plan --apply``: a plan written where the groups live (no I/O; the command writes what these return).

* **Stack file** (:func:`apply_to_stack`): the stack file of ``llmd-timeslice up`` with the plan's lease groups
  (each with the plan's ``policy`` and ``job_priorities``, the other settings taken from the group its members'
  engines were in), every engine moved to the group its job's rollouts hold, and the groups left without engines or
  plan members dropped. An engine belongs to the job it is mapped to (``engine_jobs``), else to the job whose id
  its name is or starts with (``<job>-...``, the longest such id); an engine of no job stays where it was.
* **Kubernetes** (:func:`kubernetes_patch`): a shell script of ``kubectl label`` / ``kubectl annotate`` commands to
  review, then run: each job's pods (``timeslice.io/job-id``) get the ``timeslice.io/group`` of their role's phase,
  and each group's policy and job priorities their annotations (``timeslice.io/scheduling-policy``,
  ``timeslice.io/job-priority``).
* **Jobs** (:func:`job_environment`): which group each job acquires for each phase (the variables of the
  upstream phase callback, ``TIMESLICE_SAMPLER_GROUP`` and ``TIMESLICE_TRAINER_GROUP``).

Never silently: a job that holds accelerators now (``holders``: group -> job, from the live orchestrator) and whose
groups the plan changes is refused (:class:`ApplyRefused`, one line per job) unless ``move_holders`` is set.
"""

from __future__ import annotations

import copy
import shlex
from collections.abc import Mapping
from typing import Any

from llmd_timeslice.domain.group_settings import GroupSettings
from llmd_timeslice.placement.plan_file import Plan
from llmd_timeslice.placement.profile import PhaseKind

ANNOTATION_POLICY = str(GroupSettings.model_fields["policy"].json_schema_extra["annotation"])  # type: ignore[index]
ANNOTATION_JOB_PRIORITY = str(GroupSettings.model_fields["job_priorities"].json_schema_extra["annotation"])  # type: ignore[index]
LABEL_GROUP, LABEL_ROLE, LABEL_JOB_ID = "timeslice.io/group", "timeslice.io/role", "timeslice.io/job-id"
"""The pod labels Kubernetes discovery reads (:mod:`llmd_timeslice.discovery.pods`, which imports the orchestrator:
spelled here, and a test holds them equal)."""
ENV_SAMPLER_GROUP = "TIMESLICE_SAMPLER_GROUP"
ENV_TRAINER_GROUP = "TIMESLICE_TRAINER_GROUP"


class ApplyRefused(ValueError):
    """The plan cannot be applied as asked; ``lines``: one per problem."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


def engine_jobs(engines: list[Mapping[str, Any]], jobs: set[str], mapping: Mapping[str, str] | None = None) -> dict[str, str]:
    """Engine name -> its job (module docstring); engines of no job are left out."""
    out = {}
    for e in engines:
        name = str(e.get("name", ""))
        if mapping and name in mapping:
            out[name] = mapping[name]
            continue
        owners = [j for j in jobs if name == j or name.startswith(j + "-")]
        if owners:
            out[name] = max(owners, key=len)
    return out


def moved_holders(plan: Plan, holders: Mapping[str, str]) -> list[str]:
    """One line per job that holds a group now and that the plan puts elsewhere."""
    lines = []
    planned = {j.job_id: set(j.groups.values()) for j in plan.jobs}
    for group, job in sorted(holders.items()):
        if job and job in planned and group not in planned[job]:
            lines.append(
                f"job {job} holds group {group} now; the plan moves it to {', '.join(sorted(planned[job]))} "
                "(apply once it yielded, or pass --move-holders)"
            )
    return lines


def apply_to_stack(
    stack: Mapping[str, Any],
    plan: Plan,
    holders: Mapping[str, str] | None = None,
    move_holders: bool = False,
    mapping: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The stack file's data with the plan applied, and one line per change.

    Raises:
        ApplyRefused: a job holding accelerators would move (without ``move_holders``), or an engine of no job is
            left in a group the plan drops.
    """
    refused = [] if move_holders else moved_holders(plan, holders or {})
    data = copy.deepcopy(dict(stack))
    engines = list(data.get("engines") or [])
    old_groups = {str(g.get("group_id")): g for g in data.get("groups") or []}
    owner = engine_jobs(engines, {j.job_id for j in plan.jobs}, mapping)
    changes: list[str] = []
    engine_group: dict[str, str] = {}
    for e in engines:
        job = owner.get(str(e.get("name")))
        target = plan.group_of(job, PhaseKind.ROLLOUT) if job else str(e.get("group"))
        engine_group[str(e["name"])] = target
    new_groups = []
    for g in plan.groups:
        sources = [str(e.get("group")) for e in engines if engine_group[str(e["name"])] == g.group_id]
        known = [old_groups[s] for s in sources if s in old_groups] or list(old_groups.values())
        base: Mapping[str, Any] = known[0] if known else {}
        entry = {k: copy.deepcopy(v) for k, v in base.items() if k != "group_id"}
        entry = {"group_id": g.group_id, **entry, "policy": g.policy, "job_priorities": dict(g.job_priorities)}
        new_groups.append(entry)
        changes.append(
            f"group {g.group_id}: {g.layout}, policy {g.policy}, jobs {', '.join(g.jobs)} "
            f"({', '.join(f'{m.job_id}/{m.phase}' for m in g.members)})"
        )
    planned_ids = {g.group_id for g in plan.groups}
    for e in engines:
        name, before = str(e["name"]), str(e.get("group"))
        after = engine_group[name]
        if after not in planned_ids:
            refused.append(
                f"engine {name} (no job of the plan) stays in group {after}, which the plan drops; map it with --engine"
            )
        elif after != before:
            changes.append(f"engine {name}: group {before} -> {after}")
            e["group"] = after
    for gid in sorted(set(old_groups) - planned_ids):
        changes.append(f"group {gid}: dropped (no engine or job of the plan left in it)")
    if refused:
        raise ApplyRefused(refused)
    data["groups"] = new_groups
    data["engines"] = engines
    return data, changes


def job_environment(plan: Plan) -> dict[str, dict[str, str]]:
    """Job -> the variables that name its groups (``TIMESLICE_SAMPLER_GROUP``, ``TIMESLICE_TRAINER_GROUP``)."""
    return {
        j.job_id: {ENV_SAMPLER_GROUP: j.groups[PhaseKind.ROLLOUT], ENV_TRAINER_GROUP: j.groups[PhaseKind.TRAIN]}
        for j in plan.jobs
    }


def kubernetes_patch(plan: Plan, namespace: str | None = None, holders: Mapping[str, str] | None = None) -> str:
    """A shell script (``kubectl``) that labels each job's pods with their group and annotates each group's policy
    and job priorities; commented, to be reviewed before it is run. Jobs that hold accelerators now (``holders``)
    are flagged in a comment above their commands."""
    ns = f" -n {shlex.quote(namespace)}" if namespace else ""
    lines = [
        "#!/bin/sh",
        "# Generated by `llmd-timeslice plan --apply`: review, then run. Labels set on running pods last until the pods",
        "# are replaced: put the same labels and annotations in each workload's pod template to keep them.",
        f"# Plan: predicted duty cycle {plan.predicted_duty_cycle:.3f} on {plan.accelerators_used} accelerators.",
        "set -eu",
    ]
    busy = set((holders or {}).values())
    for j in plan.jobs:
        roles = {"sampler": j.groups[PhaseKind.ROLLOUT], "trainer": j.groups[PhaseKind.TRAIN]}
        lines.append("")
        lines.append(f"# job {j.job_id}: slowdown {j.slowdown:+.1%} predicted (budget {j.slowdown_budget:.0%})")
        if j.job_id in busy:
            lines.append(f"# WARNING: {j.job_id} holds accelerators now; run this once it yielded")
        for role, group in roles.items():
            selector = shlex.quote(f"{LABEL_JOB_ID}={j.job_id},{LABEL_ROLE}={role}")
            lines.append(f"kubectl label pods{ns} -l {selector} {LABEL_GROUP}={shlex.quote(group)} --overwrite")
        if any(j.job_id in g.job_priorities for g in plan.groups):
            prio = next(g.job_priorities[j.job_id] for g in plan.groups if j.job_id in g.job_priorities)
            selector = shlex.quote(f"{LABEL_JOB_ID}={j.job_id}")
            lines.append(f"kubectl annotate pods{ns} -l {selector} {ANNOTATION_JOB_PRIORITY}={prio} --overwrite")
    for g in plan.groups:
        selector = shlex.quote(f"{LABEL_GROUP}={g.group_id}")
        lines.append("")
        lines.append(
            f"# group {g.group_id}: {g.layout}, {g.accelerators} accelerators, predicted duty {g.predicted_duty_cycle:.3f}"
        )
        lines.append(f"kubectl annotate pods{ns} -l {selector} {ANNOTATION_POLICY}={g.policy} --overwrite")
    return "\n".join(lines) + "\n"
