"""The placement planner in simulation at scale (part of ``benchmarks.placement``; issue 40 §4).

64 RL jobs drawn from four published workload classes on 512 accelerators (64 nodes x 8, 2 TB of host memory each),
placed four ways and judged by the same simulation (:mod:`llmd_timeslice.placement.evaluate`):

* ``dedicated``: every job alone, rollout and training on their own accelerators (disaggregated);
* ``random_pairing``: jobs paired at random (seeded), each pair on one group (rollout and training colocated), FIFO;
* ``rollmux_like``: greedy pairing by complementary phases (the most rollout-heavy job with the most training-heavy
  one of the same size), each pair a disaggregated co-execution group (a rollout pool and a training pool),
  round-robin inside (RollMux, arXiv 2512.11306, as its abstract describes it; not its code);
* ``plan``: :class:`~llmd_timeslice.placement.search.Planner` (the heuristic: 64 jobs is beyond the exact search).

Switch costs per job are this project's, from the RL model (``benchmarks/rl_model/``, strategy ``llmd_timeslice``
at the job's model size: verified level-1 sleep and wake of the samplers, trainer state offload and restore over
PCIe with the device checksum). The planner's run time on 1,000 jobs of the same mix is measured too (process CPU
seconds, one core).

Every input says where it comes from (``SOURCES``, ``CLASSES``: ``published`` with its source, or ``assumption``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from benchmarks import rl_model as m
from llmd_timeslice.placement.evaluate import Candidate, CandidateResult, Layout, SwitchCosts
from llmd_timeslice.placement.offer import parse_offer
from llmd_timeslice.placement.profile import JobProfile, hand_profile
from llmd_timeslice.placement.search import BudgetsUnmet, Planner, SearchOptions

SOURCES = {
    "llmd_blog": m.SOURCES["llmd_blog"],
    "zero": m.SOURCES["zero"],
    "rl_in_the_wild": (
        "Zhou et al., 'RL in the Wild: Characterizing RLVR Training in LLM Deployment' (arXiv 2509.25279): a single "
        "RLVR step takes minutes to over an hour; rollouts may invoke tools and sandboxes (environment interaction)"
    ),
    "long_cot": (
        "abhinavnandwani.com/posts/rlvr-training-costs.html: with long chain-of-thought rollouts (8K-32K tokens) "
        "generation takes 70-90% of wall time; SimpleRL-Zoo 32B GRPO on 64 H100, 7B on 16 H100 (veRL)"
    ),
    "dgx_h100": "NVIDIA DGX H100: 8 H100 80 GB per node, 2 TB of system memory",
    "rollmux": (
        "Wu et al., 'RollMux: Phase-Level Multiplexing for Disaggregated RL Post-Training' (arXiv 2512.11306): "
        "co-execution groups, round-robin inside a group, residency constraint; 1.84x the cost efficiency of "
        "disaggregation on 656 GPUs"
    ),
}


@dataclass(frozen=True)
class WorkloadClass:
    """One published workload: model size (billion parameters), rollout share of the accelerator phases, CPU gap
    (seconds; ``None``: calibrated), accelerators per phase, jobs of it in the 64, and where each figure comes from."""

    name: str
    model_b: float
    rollout_fraction: float
    cpu_gap_s: float | None
    accelerators: int
    jobs: int
    source: str


CLASSES = (
    WorkloadClass(
        "grpo-7b-math",
        7,
        0.5,
        3.0,
        4,
        16,
        "published setup [llmd_blog]: Qwen2.5-7B GRPO, vLLM TP4 samplers and FSDP trainers on 4 H100 each; phases "
        "120 s per iteration, half rollout, 3 s CPU gap: the RL model's assumptions (docs/benchmarks.md)",
    ),
    WorkloadClass(
        "grpo-7b-llmd-measured",
        7,
        0.5,
        None,
        4,
        16,
        "published [llmd_blog]: the same job at llm-d's measured standalone duty cycle of 41% (DCGM): the CPU gap "
        "calibrated to it by the RL model (gap_for_dedicated_duty)",
    ),
    WorkloadClass(
        "long-cot-32b",
        32,
        0.8,
        5.0,
        8,
        8,
        "published [long_cot, rl_in_the_wild]: generation 80% of the step (70-90%), a 32B model on 8 + 8 H100; "
        "phases scaled with parameters from the 7B anchor (the RL model's rule)",
    ),
    WorkloadClass(
        "agentic-1.5b",
        1.5,
        0.5,
        None,
        2,
        24,
        "published [rl_in_the_wild]: rollouts calling tools in sandboxes; assumption: the environment's CPU time "
        "per iteration is twice the accelerator phases, 1.5B on 2 + 2 H100",
    ),
)
"""The 64 jobs (16 + 16 + 8 + 24): 480 accelerators dedicated, on an offer of 512."""

OFFER = "64x8:2TB"
"""64 DGX H100 nodes [dgx_h100]."""
JOB_JITTER = 0.15
"""Each job's phases scaled by a log-normal factor of this sigma (jobs of a class differ: assumption)."""
ITERATION_JITTER = {"rollout": 0.2, "train": 0.05, "cpu_gap": 0.1, "weight_sync": 0.05}
"""Per-iteration log-normal sigma of each phase (rollouts have a long tail: assumption)."""
SAMPLES = 8
LOOSER_BUDGETS = (0.10, 0.20)
"""The plan again with every job's budget at these (the default is 5 %)."""


def _switch_s(inp: dict, model_b: float, group: int) -> dict[str, float]:
    """Seconds to put a job's samplers / trainer aside and back on shared accelerators: the RL model's handover
    components of this project at ``model_b`` (suspend + resume of that role)."""
    s = m.make_strategy("llmd_timeslice", inp, model_b, group)
    return {
        "rollout": sum(c.seconds for c in s.suspend("sampler") + s.resume("sampler")),
        "train": sum(c.seconds for c in s.suspend("trainer") + s.resume("trainer")),
    }


def make_jobs(n: int, seed: int = 0) -> list[JobProfile]:
    """``n`` jobs of the mix (the classes' shares of 64, in turn), each with :data:`SAMPLES` durations per phase."""
    inp = m.default_inputs()
    rng = np.random.default_rng(seed)
    weights = np.array([c.jobs for c in CLASSES], dtype=float)
    counts = np.floor(weights / weights.sum() * n).astype(int)
    counts[: n - counts.sum()] += 1
    out = []
    for c, count in zip(CLASSES, counts, strict=True):
        wl = m.make_workload(inp, model_b=c.model_b, rollout_fraction=c.rollout_fraction)
        gap = c.cpu_gap_s
        if gap is None and c.name == "grpo-7b-llmd-measured":
            gap = m.gap_for_dedicated_duty(inp, 0.41)
        elif gap is None:
            gap = 2 * (wl.rollout_s + wl.train_s)
        state = c.model_b * 1e9 * (inp["trainer_state_bytes_per_param"].value + inp["weight_bytes_per_param"].value)
        switch = _switch_s(inp, c.model_b, c.accelerators)
        for i in range(count):
            f = rng.lognormal(0, JOB_JITTER)
            base = {"rollout": wl.rollout_s * f, "train": wl.train_s * f, "cpu_gap": gap * f, "weight_sync": wl.weight_sync_s}
            draws = {k: [round(v * x, 3) for x in rng.lognormal(0, ITERATION_JITTER[k], SAMPLES)] for k, v in base.items()}
            out.append(
                hand_profile(
                    job_id=f"{c.name}-{i:02d}",
                    rollout_s=draws["rollout"],
                    train_s=draws["train"],
                    cpu_gap_s=draws["cpu_gap"],
                    weight_sync_s=draws["weight_sync"],
                    accelerators=c.accelerators,
                    state_bytes=int(state),
                    switch_s=switch,
                )
            )
    return out


COSTS = SwitchCosts(grant_s=m.default_inputs()["ts_release_s"].value + m.default_inputs()["ts_grant_s"].value)
"""Group-level handover control (release + grant, measured here); the rest is each job's ``switch_s``."""


def _figures(name: str, results: list[CandidateResult]) -> dict:
    acc = sum(r.accelerators for r in results)
    jobs = [j for r in results for j in r.jobs.values()]
    return {
        "placement": name,
        "duty_cycle": round(sum(r.busy_rate for r in results) / acc, 4),
        "accelerators": acc,
        "groups": len(results),
        "shared_groups": sum(len(r.candidate.jobs) > 1 for r in results),
        "jobs_over_budget": sum(not j.within_budget for j in jobs),
        "worst_slowdown": round(max(j.slowdown for j in jobs), 4),
        "mean_slowdown": round(float(np.mean([j.slowdown for j in jobs])), 4),
    }


def random_pairing(planner: Planner, seed: int) -> list[CandidateResult]:
    jobs = sorted(planner.profiles)
    order = np.random.default_rng(seed).permutation(len(jobs))
    shuffled = [jobs[i] for i in order]
    pairs = [tuple(sorted(shuffled[i : i + 2])) for i in range(0, len(shuffled), 2)]
    return [planner.evaluate(Candidate(p, Layout.COLOCATED, "fifo")) for p in pairs]


def rollmux_like(planner: Planner) -> list[CandidateResult]:
    """Greedy pairing by complementary phases within each accelerator size; disaggregated, round-robin."""
    by_size: dict[int, list[JobProfile]] = {}
    for p in planner.profiles.values():
        by_size.setdefault(max(p.accelerators.values()), []).append(p)
    out = []
    for size in sorted(by_size):
        ps = sorted(by_size[size], key=lambda p: (p.mean_s("rollout") / (p.mean_s("rollout") + p.mean_s("train")), p.job_id))
        lo, hi = 0, len(ps) - 1
        while lo < hi:
            pair = tuple(sorted((ps[lo].job_id, ps[hi].job_id)))
            out.append(planner.evaluate(Candidate(pair, Layout.DISAGGREGATED, "round_robin")))
            lo, hi = lo + 1, hi - 1
        if lo == hi:
            out.append(planner.evaluate(Candidate((ps[lo].job_id,), Layout.DISAGGREGATED)))
    return out


def run_scale(jobs: int = 64, seed: int = 0, timing_jobs: int = 1000, log=print) -> dict:
    """The comparison (module docstring) and the planner's run time on ``timing_jobs`` jobs."""
    profiles = make_jobs(jobs, seed)
    planner = Planner(profiles, parse_offer(OFFER), COSTS, SearchOptions(seed=seed))
    t0 = time.process_time()
    try:
        result = planner.run()
        budgets_met = True
    except BudgetsUnmet as exc:
        result, budgets_met = exc.best, False
    plan_cpu_s = time.process_time() - t0
    rows = {
        "dedicated": _figures("dedicated", planner.alternatives(naive_max_jobs=0)["dedicated"]),
        "random_pairing": _figures("random_pairing", random_pairing(planner, seed)),
        "rollmux_like": _figures("rollmux_like", rollmux_like(planner)),
        "plan": _figures("plan", result.chosen),
    }
    rows["plan"]["budgets_met"] = budgets_met
    for budget in LOOSER_BUDGETS:  # the same planner with every job accepting more slowdown: what sharing more buys
        looser = Planner([p.model_copy(update={"slowdown_budget": budget}) for p in profiles], planner.offer, COSTS)
        rows[f"plan_budget_{round(budget * 100)}pct"] = _figures(f"plan, budget {budget:.0%}", looser.run().chosen)
    ratios = {
        f"plan_vs_{k}": round(rows["plan"]["duty_cycle"] / v["duty_cycle"], 3)
        for k, v in rows.items()
        if not k.startswith("plan")
    }
    log(f"scale: {jobs} jobs on {OFFER}: " + ", ".join(f"{k} {v['duty_cycle']:.3f}" for k, v in rows.items()))
    timing = {}
    if timing_jobs:
        many = make_jobs(timing_jobs, seed + 1)
        nodes = math.ceil(sum(2 * max(p.accelerators.values()) for p in many) / 8)
        big = Planner(many, parse_offer(f"{nodes}x8:2TB"), COSTS, SearchOptions(seed=seed))
        t0 = time.process_time()
        try:
            res = big.run()
        except BudgetsUnmet as exc:
            res = exc.best
        timing = {
            "jobs": timing_jobs,
            "cpu_seconds": round(time.process_time() - t0, 2),
            "method": res.method,
            "candidates_evaluated": res.evaluated,
            "duty_cycle": round(res.duty_cycle, 4),
        }
        log(f"planner on {timing_jobs} jobs: {timing['cpu_seconds']} s of CPU ({res.method}, {res.evaluated} candidates)")
    return {
        "jobs": jobs,
        "offer": OFFER,
        "accelerators_offered": parse_offer(OFFER).accelerators,
        "placements": rows,
        "ratios": ratios,
        "plan_search": {"method": result.method, "candidates_evaluated": result.evaluated, "cpu_seconds": round(plan_cpu_s, 3)},
        "timing": timing,
        "classes": [c.__dict__ for c in CLASSES],
        "jitter": {"job": JOB_JITTER, "iteration": ITERATION_JITTER},
        "sources": SOURCES,
        "switch_costs": "per job: benchmarks/rl_model/ strategy llmd_timeslice at the job's model size; group grant: "
        f"{COSTS.grant_s:.4f} s (measured here)",
    }
