"""The plan file: what ``llmd-timeslice plan`` proposes, as data (no I/O but :meth:`Plan.save` / :func:`load_plan`).

Shape (JSON; every figure predicted by simulating the schedule)::

    kind: llmd-timeslice-plan, version: 1, created_unix_s
    predicted_duty_cycle, accelerators_used, accelerators_offered, budgets_met
    search: {method: exact | heuristic, candidates_evaluated, cpu_seconds, jobs}
    groups: [{group_id, co_execution, layout, policy, job_priorities, members: [{job_id, phase, role}],
              accelerators, nodes, host_bytes, predicted_duty_cycle}]
    jobs:   [{job_id, groups: {rollout: G, train: G}, period_s, alone_period_s,
              slowdown, slowdown_p05, slowdown_p95, slowdown_budget, within_budget}]
    alternatives: [{name, duty_cycle, accelerators, jobs_over_budget, worst_slowdown}]
    switch_costs, offer, profiles          # the inputs, so the plan can be simulated again (re-planning)

A *co-execution group* (``co_execution``) is the set of jobs that take turns on the same accelerators; it is one
lease group (``colocated``) or two (``disaggregated``: ``<id>-rollout`` and ``<id>-train``). Group ids are
``<prefix>-<n>`` by decreasing accelerators, then by first job id.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmd_timeslice import yaml_files
from llmd_timeslice.placement.evaluate import CandidateResult, Layout, SwitchCosts
from llmd_timeslice.placement.offer import Offer
from llmd_timeslice.placement.profile import ROLE_OF, JobProfile, PhaseKind
from llmd_timeslice.placement.search import SearchResult


class PlanMember(BaseModel):
    job_id: str
    phase: PhaseKind
    role: str


class PlanGroup(BaseModel):
    group_id: str
    co_execution: str
    layout: Layout
    policy: str
    job_priorities: dict[str, int] = Field(default_factory=dict)
    members: list[PlanMember]
    accelerators: int
    nodes: list[str] = Field(default_factory=list)
    host_bytes: int = 0
    predicted_duty_cycle: float

    @property
    def jobs(self) -> list[str]:
        return sorted({m.job_id for m in self.members})


class PlanJob(BaseModel):
    job_id: str
    groups: dict[PhaseKind, str]
    period_s: float
    alone_period_s: float
    slowdown: float
    slowdown_p05: float
    slowdown_p95: float
    slowdown_budget: float
    within_budget: bool


class PlanAlternative(BaseModel):
    name: str
    duty_cycle: float
    accelerators: int
    jobs_over_budget: list[str] = Field(default_factory=list)
    worst_slowdown: float = 0.0


class PlanSearch(BaseModel):
    method: str
    candidates_evaluated: int
    cpu_seconds: float
    jobs: int


class Plan(BaseModel):
    """A whole plan (module docstring)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["llmd-timeslice-plan"] = "llmd-timeslice-plan"
    version: Literal[1] = 1
    created_unix_s: float = 0.0
    predicted_duty_cycle: float
    accelerators_used: int
    accelerators_offered: int
    budgets_met: bool = True
    search: PlanSearch
    groups: list[PlanGroup]
    jobs: list[PlanJob]
    alternatives: list[PlanAlternative] = Field(default_factory=list)
    switch_costs: SwitchCosts = Field(default_factory=SwitchCosts)
    offer: Offer | None = None
    profiles: list[JobProfile] = Field(default_factory=list)

    def group(self, group_id: str) -> PlanGroup:
        return next(g for g in self.groups if g.group_id == group_id)

    def job(self, job_id: str) -> PlanJob:
        return next(j for j in self.jobs if j.job_id == job_id)

    def group_of(self, job_id: str, phase: PhaseKind) -> str:
        """The lease group ``job_id``'s ``phase`` holds."""
        return self.job(job_id).groups[phase]

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON (a ``.yaml``/``.yml`` path: as YAML)."""
        path = Path(path)
        data = self.model_dump(mode="json")
        if path.suffix in (".yaml", ".yml"):
            import yaml

            path.write_text(yaml.safe_dump(data, sort_keys=False))
        else:
            path.write_text(json.dumps(data, indent=1) + "\n")
        return path


class PlanFileError(ValueError):
    """A plan file that cannot be read; ``errors``: one line each."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


def load_plan(path: str | Path) -> Plan:
    """Read a plan file (JSON or YAML).

    Raises:
        PlanFileError: unreadable, not a plan, or invalid (one line per problem).
    """
    try:
        data = yaml_files.load(Path(path).read_text())
    except OSError as exc:
        raise PlanFileError([f"{path}: {exc.strerror or exc}"]) from None
    except Exception as exc:
        raise PlanFileError([f"{path}: {exc}"]) from None
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        raise PlanFileError([f"{path}: {line}" for line in yaml_files.validation_lines(exc, Plan)]) from None


def _alternative(name: str, results: list[CandidateResult]) -> PlanAlternative:
    acc = sum(r.accelerators for r in results)
    jobs = [j for r in results for j in r.jobs.values()]
    return PlanAlternative(
        name=name,
        duty_cycle=round(sum(r.busy_rate for r in results) / acc, 4) if acc else 0.0,
        accelerators=acc,
        jobs_over_budget=sorted(j.job_id for j in jobs if not j.within_budget),
        worst_slowdown=round(max((j.slowdown for j in jobs), default=0.0), 4),
    )


def group_ids(chosen: list[CandidateResult], prefix: str = "ts") -> list[str]:
    """The co-execution group id of each chosen candidate, in the order of ``chosen`` (module docstring)."""
    order = sorted(range(len(chosen)), key=lambda i: (-chosen[i].accelerators, chosen[i].candidate.jobs))
    ids = [""] * len(chosen)
    for n, i in enumerate(order):
        ids[i] = f"{prefix}-{n}"
    return ids


def build_plan(
    result: SearchResult,
    profiles: list[JobProfile],
    costs: SwitchCosts,
    offer: Offer,
    alternatives: dict[str, list[CandidateResult]] | None = None,
    prefix: str = "ts",
) -> Plan:
    """The plan of a search's result (figures rounded to 4 digits)."""
    from llmd_timeslice.placement.evaluate import priorities_for

    by_id = {p.job_id: p for p in profiles}
    ids = group_ids(result.chosen, prefix)
    groups: list[PlanGroup] = []
    jobs: list[PlanJob] = []
    for i in sorted(range(len(ids)), key=lambda i: int(ids[i].rsplit("-", 1)[1])):
        cid, r = ids[i], result.chosen[i]
        prio = priorities_for([by_id[j] for j in r.candidate.jobs]) if r.candidate.policy == "priority" else {}
        where: dict[str, dict[PhaseKind, str]] = {}
        for g in r.groups:
            gid = cid if g.part == "all" else f"{cid}-{g.part}"
            groups.append(
                PlanGroup(
                    group_id=gid,
                    co_execution=cid,
                    layout=r.candidate.layout,
                    policy=r.candidate.policy,
                    job_priorities=prio,
                    members=[PlanMember(job_id=j, phase=k, role=ROLE_OF[k]) for j, k in g.members],
                    accelerators=g.accelerators,
                    nodes=result.nodes.get(f"{i}:{g.part}", []),
                    host_bytes=g.host_bytes,
                    predicted_duty_cycle=round(g.duty_cycle, 4),
                )
            )
            for j, k in g.members:
                where.setdefault(j, {})[k] = gid
        for o in r.jobs.values():
            jobs.append(
                PlanJob(
                    job_id=o.job_id,
                    groups=where[o.job_id],
                    period_s=round(o.period_s, 4),
                    alone_period_s=round(o.alone_period_s, 4),
                    slowdown=round(o.slowdown, 4),
                    slowdown_p05=round(o.slowdown_p05, 4),
                    slowdown_p95=round(o.slowdown_p95, 4),
                    slowdown_budget=o.slowdown_budget,
                    within_budget=o.within_budget,
                )
            )
    alts = [_alternative("plan", result.chosen)]
    alts += [_alternative(name, rs) for name, rs in (alternatives or {}).items()]
    return Plan(
        created_unix_s=round(time.time(), 3),
        predicted_duty_cycle=round(result.duty_cycle, 4),
        accelerators_used=result.accelerators,
        accelerators_offered=offer.accelerators,
        budgets_met=result.budgets_met,
        search=PlanSearch(
            method=result.method,
            candidates_evaluated=result.evaluated,
            cpu_seconds=round(result.seconds, 3),
            jobs=len(profiles),
        ),
        groups=groups,
        jobs=sorted(jobs, key=lambda j: j.job_id),
        alternatives=alts,
        switch_costs=costs,
        offer=offer,
        profiles=list(profiles),
    )
