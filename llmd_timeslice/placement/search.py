"""The placement search: which jobs share accelerators, in which layout, under which policy (no I/O).

Objective: the aggregate duty cycle of the plan (useful accelerator-seconds / accelerators used x wall time, over all
its lease groups: docs/benchmarks.md's definition), subject to every job's slowdown against running alone staying
within its budget, every group fitting on the offer's nodes with its workers' states in their host memory
(:func:`~llmd_timeslice.placement.offer.place_groups`) and the plan using at most the accelerators offered. Every
candidate group is judged by simulating its schedule (:func:`~llmd_timeslice.placement.evaluate.evaluate`).

Two searches, chosen by the number of jobs:

* **exact** (at most ``exact_max_jobs``): every set of up to ``max_group_jobs`` jobs is simulated in each layout and
  policy (a set is tried only when each of its subsets one job smaller had a plan within budget: adding a job to a
  group is taken never to shorten another's wait); then every partition of the jobs into such sets, with each
  set's non-dominated options (more busy accelerator-seconds or fewer accelerators), is scored, and the best that
  fits the offer wins.
* **heuristic** beyond: first fit by decreasing load. Each job's best plan alone comes first (colocated alone when
  within budget, else dedicated). Jobs are then taken by decreasing *load* (the share of its period a job holds
  its accelerators, handovers included) and offered to at most ``tries_per_job`` open groups of the same
  accelerator size whose summed load leaves room, fullest first; a job joins the first group whose simulation keeps
  every member within budget under some policy, else opens its own. Colocated groups first; the jobs left dedicated
  are then offered to each other as disaggregated groups the same way. Last, each shared group's layout and policy
  are chosen again among the feasible ones by duty cycle. ``O(jobs x tries_per_job)`` simulations.

When the best plan within every budget does not fit the offer, the budgets are relaxed (x2, x4, ... x64, then none)
until one does; :class:`BudgetsUnmet` then carries that best plan found.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmd_timeslice.placement.evaluate import (
    POLICIES,
    Candidate,
    CandidateResult,
    Draws,
    Layout,
    SwitchCosts,
    evaluate,
    load_bound,
)
from llmd_timeslice.placement.offer import DoesNotFit, GroupNeed, Offer, fits_anywhere, place_groups
from llmd_timeslice.placement.profile import ACCELERATOR_PHASES, IncompleteProfile, JobProfile

PREFERENCE = {("colocated", "fifo"): 0, ("colocated", "round_robin"): 1, ("colocated", "priority"): 2}
"""Among options of equal figures: colocated before disaggregated, fifo, then round_robin, then priority."""


class PlanningError(ValueError):
    """Input the planner cannot plan; ``lines``: one line per problem."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


class JobFitsNowhere(PlanningError):
    """A job fits on no node of the offer even alone; ``job_id`` names it."""

    def __init__(self, job_id: str, why: str) -> None:
        super().__init__([f"job {job_id} fits nowhere: {why}"])
        self.job_id = job_id


class BudgetsUnmet(PlanningError):
    """No plan within every slowdown budget fits the offer; ``best`` is the best plan found that fits."""

    def __init__(self, best: SearchResult) -> None:
        worst = max(best.jobs(), key=lambda j: j.slowdown - j.slowdown_budget)
        super().__init__(
            [
                f"no plan meets every slowdown budget on this offer; best found: duty cycle {best.duty_cycle:.3f} on "
                f"{best.accelerators} accelerators, job {worst.job_id} at {worst.slowdown:+.1%} (budget "
                f"{worst.slowdown_budget:.1%})"
            ]
        )
        self.best = best


@dataclass(frozen=True)
class SearchOptions:
    """Bounds of the search (module docstring)."""

    max_group_jobs: int = 4
    exact_max_jobs: int = 8
    tries_per_job: int = 4
    layouts: tuple[Layout, ...] = (Layout.COLOCATED, Layout.DISAGGREGATED)
    policies: tuple[str, ...] = POLICIES
    seed: int = 0


@dataclass
class SearchResult:
    """The chosen co-execution groups, how they were found, and where each lease group goes (``nodes``: the lease
    group's name, ``<index>:<part>``, -> node names)."""

    chosen: list[CandidateResult]
    method: str
    evaluated: int
    seconds: float
    nodes: dict[str, list[str]]
    budgets_met: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def busy_rate(self) -> float:
        return sum(c.busy_rate for c in self.chosen)

    @property
    def accelerators(self) -> int:
        return sum(c.accelerators for c in self.chosen)

    @property
    def duty_cycle(self) -> float:
        return self.busy_rate / self.accelerators if self.accelerators else 0.0

    def jobs(self) -> list:
        return [j for c in self.chosen for j in c.jobs.values()]


def _needs(results: Sequence[CandidateResult]) -> list[GroupNeed]:
    return [GroupNeed(f"{i}:{g.part}", g.accelerators, g.host_bytes) for i, r in enumerate(results) for g in r.groups]


def _jobs_text(r: CandidateResult) -> str:
    """``job a, colocated`` / ``jobs a, b, disaggregated``: a candidate, for a message."""
    jobs = r.candidate.jobs
    return f"job{'s' if len(jobs) > 1 else ''} {', '.join(jobs)}, {r.candidate.layout}"


def _rank(r: CandidateResult) -> tuple[float, int, int]:
    return (-r.busy_rate, r.accelerators, PREFERENCE.get((str(r.candidate.layout), r.candidate.policy), 3))


def pareto(options: Sequence[CandidateResult]) -> list[CandidateResult]:
    """The options no other beats on both busy rate (more) and accelerators (fewer); equal ones: the preferred."""
    out: list[CandidateResult] = []
    for r in sorted(options, key=_rank):
        if not any(o.busy_rate >= r.busy_rate - 1e-12 and o.accelerators <= r.accelerators for o in out):
            out.append(r)
    return out


class Planner:
    """Plans ``profiles`` on ``offer`` (see the module docstring). ``run()`` returns a :class:`SearchResult`.

    Raises (from ``run``):
        IncompleteProfile: a profile without a complete period (the first; :meth:`problems` lists every one).
        JobFitsNowhere: a job that fits on no node even alone.
        BudgetsUnmet: no plan within every budget fits the offer (carries the best found).
    """

    def __init__(self, profiles: Sequence[JobProfile], offer: Offer, costs: SwitchCosts, options: SearchOptions | None = None):
        self.profiles = {p.job_id: p for p in profiles}
        self.offer = offer
        self.costs = costs
        self.options = options or SearchOptions()
        self.draws = Draws(profiles, self.options.seed)
        self.evaluated = 0
        self._cache: dict[Candidate, CandidateResult] = {}
        self._budget_scale = 1.0
        self._misfit: str | None = None

    # ------------------------------------------------------------------ checks
    def problems(self) -> list[str]:
        """One line per job that cannot be planned: no complete period, or fits nowhere alone (in job order)."""
        lines = []
        for p in self.profiles.values():
            try:
                p.check_complete()
            except IncompleteProfile as exc:
                lines.extend(exc.errors)
                continue
            why = self._fits_nowhere(p)
            if why:
                lines.append(f"job {p.job_id} fits nowhere: {why}")
        return lines

    def _fits_nowhere(self, p: JobProfile) -> str | None:
        colocated = GroupNeed(p.job_id, max(p.accelerators_of(k) for k in ACCELERATOR_PHASES), p.state_bytes_total)
        why = fits_anywhere(colocated, self.offer)
        if why is None:
            return None
        dedicated = [fits_anywhere(GroupNeed(p.job_id, p.accelerators_of(k), 0), self.offer) for k in ACCELERATOR_PHASES]
        return None if not any(dedicated) else why

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, cand: Candidate, keep_trace: bool = False) -> CandidateResult:
        """The candidate's prediction (cached; a trace is simulated again when asked for)."""
        r = self._cache.get(cand)
        if r is None or (keep_trace and r.trace is None):
            r = evaluate(cand, self.profiles, self.draws, self.costs, keep_trace=keep_trace)
            self.evaluated += 1
            self._cache[cand] = r
        return r

    def _ok(self, r: CandidateResult) -> bool:
        if math.isinf(self._budget_scale):
            within = True
        else:
            within = all(j.slowdown <= self._budget_scale * j.slowdown_budget + 1e-9 for j in r.jobs.values())
        if not within:
            return False
        for g in r.groups:
            why = fits_anywhere(GroupNeed(g.part, g.accelerators, g.host_bytes), self.offer)
            if why is not None:
                self._misfit = self._misfit or f"{_jobs_text(r)} ({g.part}): {why}"
                return False
        return True

    def _max_budget(self, jobs: Sequence[str]) -> float:
        return max(self.profiles[j].slowdown_budget for j in jobs) * self._budget_scale

    def _options(self, jobs: tuple[str, ...], layouts: Sequence[Layout] | None = None) -> list[CandidateResult]:
        """The feasible options of one set of jobs (every layout and policy; one job: fifo)."""
        out = []
        members = [self.profiles[j] for j in jobs]
        for layout in layouts or self.options.layouts:
            if len(jobs) > 1 and load_bound(members, layout, self.costs) > 1 + self._max_budget(jobs):
                continue
            for policy in self.options.policies if len(jobs) > 1 else ("fifo",):
                r = self.evaluate(Candidate(jobs, layout, policy))
                if self._ok(r):
                    out.append(r)
        return out

    def single(self, job: str) -> CandidateResult:
        """A job's best plan alone: colocated when within budget and denser, else dedicated."""
        opts = self._options((job,))
        if not opts:
            return self.evaluate(Candidate((job,), Layout.DISAGGREGATED))
        return min(opts, key=lambda r: (-r.duty_cycle, *_rank(r)))

    # ------------------------------------------------------------------ search
    def run(self) -> SearchResult:
        for p in self.profiles.values():
            p.check_complete()
            why = self._fits_nowhere(p)
            if why:
                raise JobFitsNowhere(p.job_id, why)
        t0 = time.process_time()
        jobs = sorted(self.profiles)
        exact = len(jobs) <= self.options.exact_max_jobs
        for scale in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, math.inf):
            self._budget_scale = scale
            self._misfit = None
            chosen = self._exact(jobs) if exact else self._heuristic(jobs)
            placed = self._place(chosen) if chosen is not None else None
            if chosen is not None and placed is not None:
                break
        else:  # pragma: no cover - the last scale accepts any schedule; only an offer smaller than one job is left
            raise PlanningError(
                [
                    f"the offer ({self.offer.describe()}) is too small for these jobs even with every one in one "
                    f"group; {self._misfit or 'no candidate fits'}"
                ]
            )
        res = SearchResult(
            chosen,
            "exact" if exact else "heuristic",
            self.evaluated,
            time.process_time() - t0,
            placed,
            budgets_met=scale == 1.0,
        )
        if scale != 1.0:
            raise BudgetsUnmet(res)
        return res

    def _place(self, chosen: Sequence[CandidateResult]) -> dict[str, list[str]] | None:
        """The groups of ``chosen`` on the offer's nodes; None when they do not fit (the first reason at this budget
        scale is kept in ``_misfit``, for the message when no scale fits)."""
        need = sum(r.accelerators for r in chosen)
        if need > self.offer.accelerators:
            self._misfit = self._misfit or f"needs {need} accelerators, the offer has {self.offer.accelerators}"
            return None
        try:
            return place_groups(_needs(chosen), self.offer)
        except DoesNotFit as exc:
            i, _, part = exc.group.partition(":")  # _needs' names: index in chosen, part
            self._misfit = self._misfit or f"{_jobs_text(chosen[int(i)])} ({part}): {exc.why}"
            return None

    def _exact(self, jobs: list[str]) -> list[CandidateResult] | None:
        feasible: dict[frozenset[str], list[CandidateResult]] = {}
        for size in range(1, min(self.options.max_group_jobs, len(jobs)) + 1):
            for combo in itertools.combinations(jobs, size):
                if size > 1 and any(frozenset(s) not in feasible for s in itertools.combinations(combo, size - 1)):
                    continue
                opts = pareto(self._options(combo))
                if opts:
                    feasible[frozenset(combo)] = opts
        capacity = self.offer.accelerators
        ranked: list[tuple[float, list[CandidateResult]]] = []

        def walk(left: frozenset[str], busy: float, acc: int, picked: list[CandidateResult]) -> None:
            if acc > capacity:
                return
            if not left:
                ranked.append((busy / acc if acc else 0.0, list(picked)))
                return
            first = min(left)
            rest = sorted(left - {first})
            for size in range(min(self.options.max_group_jobs - 1, len(rest)) + 1):
                for others in itertools.combinations(rest, size):
                    block = frozenset((first, *others))
                    for r in feasible.get(block, ()):
                        picked.append(r)
                        walk(left - block, busy + r.busy_rate, acc + r.accelerators, picked)
                        picked.pop()

        walk(frozenset(jobs), 0.0, 0, [])
        ranked.sort(key=lambda x: -x[0])
        for _, chosen in ranked[:200]:
            if self._place(chosen) is not None:
                return chosen
        return None

    def _heuristic(self, jobs: list[str]) -> list[CandidateResult]:
        singles = {j: self.single(j) for j in jobs}
        groups: list[CandidateResult] = []
        alone: list[str] = []
        colocated = [j for j in jobs if singles[j].candidate.layout is Layout.COLOCATED]
        dedicated = [j for j in jobs if singles[j].candidate.layout is Layout.DISAGGREGATED]
        for layout, pool in ((Layout.COLOCATED, colocated), (Layout.DISAGGREGATED, dedicated)):
            formed = self._first_fit(pool, layout, singles)
            groups.extend(r for r in formed if len(r.candidate.jobs) > 1)
            alone.extend(r.candidate.jobs[0] for r in formed if len(r.candidate.jobs) == 1)
        final = [self._best_of(r) for r in groups]
        return final + [singles[j] for j in sorted(alone)]

    def _load(self, job: str, layout: Layout) -> float:
        return load_bound([self.profiles[job]], layout, self.costs)

    def _size(self, job: str, layout: Layout) -> tuple[int, ...]:
        p = self.profiles[job]
        if layout is Layout.COLOCATED:
            return (max(p.accelerators_of(k) for k in ACCELERATOR_PHASES),)
        return tuple(p.accelerators_of(k) for k in ACCELERATOR_PHASES)

    def _first_fit(self, pool: list[str], layout: Layout, singles: dict[str, CandidateResult]) -> list[CandidateResult]:
        open_groups: list[tuple[tuple[str, ...], float, CandidateResult]] = []  # jobs, load, result
        for job in sorted(pool, key=lambda j: (-self._load(j, layout), j)):
            load, size = self._load(job, layout), self._size(job, layout)
            room = [
                (i, g)
                for i, g in enumerate(open_groups)
                if len(g[0]) < self.options.max_group_jobs
                and self._size(g[0][0], layout) == size
                and g[1] + load <= 1 + self._max_budget((*g[0], job))
            ]
            room.sort(key=lambda ig: -ig[1][1])
            placed = False
            for i, (members, gload, _) in room[: self.options.tries_per_job]:
                trial = tuple(sorted((*members, job)))
                opts = self._options(trial, [layout])
                if opts:
                    open_groups[i] = (trial, gload + load, min(opts, key=_rank))
                    placed = True
                    break
            if not placed:
                open_groups.append(((job,), load, singles[job]))
        return [g[2] for g in open_groups]

    def _best_of(self, r: CandidateResult) -> CandidateResult:
        """The best feasible layout and policy for a formed group (by duty cycle)."""
        opts = self._options(r.candidate.jobs) or [r]
        return min(opts, key=lambda o: (-o.duty_cycle, *_rank(o)))

    # ------------------------------------------------------------------ alternatives
    def alternatives(self, naive_max_jobs: int = 64) -> dict[str, list[CandidateResult]]:
        """The placements a plan is compared with, same inputs: ``dedicated`` (every job alone, disaggregated),
        ``colocated_alone`` (every job alone on one group) and ``naive`` (every job in one group, FIFO: each keeps its
        own accelerators, all under one lease; only up to ``naive_max_jobs`` jobs)."""
        jobs = sorted(self.profiles)
        out = {
            "dedicated": [self.evaluate(Candidate((j,), Layout.DISAGGREGATED)) for j in jobs],
            "colocated_alone": [self.evaluate(Candidate((j,), Layout.COLOCATED)) for j in jobs],
        }
        if len(jobs) <= naive_max_jobs:
            out["naive"] = [self.evaluate(Candidate(tuple(jobs), Layout.ONE_LEASE))]
        return out
