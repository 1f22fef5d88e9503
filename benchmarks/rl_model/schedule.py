"""The RL model's schedule of one workload under one strategy (the simpy schedule is
:mod:`llmd_timeslice.placement.simulation`), its analytic checks, and the experiments over strategies and sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import simpy

from benchmarks.rl_model.costs import (
    STRATEGIES,
    VARIANTS,
    Bytes,
    Component,
    Strategy,
    Workload,
    make_strategy,
    make_workload,
)
from benchmarks.rl_model.inputs import Input
from llmd_timeslice.placement import simulation as sim


# --------------------------------------------------------------------------- simulation
@dataclass
class _Group:
    name: str
    n_acc: int
    res: simpy.Resource | None
    resident: tuple[int, str] | None = None
    busy: list[tuple[float, float, str, int]] = field(default_factory=list)
    switches: list[tuple[float, float, list[Component], str]] = field(default_factory=list)


def _placement(wl: Workload, dedicated: bool) -> tuple[dict[tuple[int, str], int], int, int]:
    """worker -> group index, number of groups, accelerators provisioned."""
    if dedicated:
        place = {(j, r): 2 * j + k for j in range(wl.jobs) for k, r in enumerate(("sampler", "trainer"))}
        return place, 2 * wl.jobs, 2 * wl.jobs * wl.group_size
    n_groups = wl.node_accelerators // wl.group_size
    if n_groups < 2:
        raise ValueError("time-slicing needs at least two accelerator groups on the node")
    if wl.layout == "interleaved":  # samplers share group 0, trainers group 1 (A trains while B rolls out)
        place = {(j, "sampler"): 0 for j in range(wl.jobs)} | {(j, "trainer"): 1 for j in range(wl.jobs)}
    elif wl.layout == "crossed":  # group g holds job g's samplers and job g+1's trainer
        place = {(j, "sampler"): j % n_groups for j in range(wl.jobs)}
        place |= {(j, "trainer"): (j + 1) % n_groups for j in range(wl.jobs)}
    elif wl.layout == "colocated":  # each job alone on its group
        place = {(j, r): j % n_groups for j in range(wl.jobs) for r in ("sampler", "trainer")}
    else:
        raise ValueError(f"unknown layout {wl.layout!r}")
    return place, n_groups, wl.node_accelerators


_overlap = sim.overlap


def _request_fractions(rng: np.random.Generator, n: int) -> np.ndarray:
    """Completion time of each request of a batch as a fraction of the rollout phase.

    All requests of a batch run concurrently (continuous batching); a request finishes in
    proportion to its response length; the longest one ends the phase. Lengths: log-normal
    (median 30% of the maximum, sigma 0.7), capped at the maximum response length.
    """
    lengths = np.minimum(rng.lognormal(np.log(0.3), 0.7, n), 1.0)
    return lengths / lengths.max()


def simulate(strategy: Strategy, wl: Workload, seed: int = 0, warmup: int = 3, keep_trace: bool = False) -> dict:
    """Run the DES for one strategy and workload; returns the figures (and, optionally, the trace).

    The schedule itself is :func:`llmd_timeslice.placement.simulation.simulate_schedule` (FIFO groups, the
    resident worker suspended only when another one arrives); this function builds the placement and the
    iterations of the workload and turns the trace into the model's figures."""
    place, n_groups, total_acc = _placement(wl, strategy.dedicated)
    rng = np.random.default_rng(seed)
    fracs = {(j, i): _request_fractions(rng, wl.requests_per_rollout) for j in range(wl.jobs) for i in range(wl.iterations)}
    job_ids = [str(j) for j in range(wl.jobs)]
    steps = (
        sim.Use("sampler", wl.rollout_s, "rollout"),
        sim.Idle(wl.cpu_gap_s, "cpu_gap"),
        sim.Use("trainer", wl.train_s, "train"),
        sim.Idle(wl.weight_sync_s, "weight_sync"),
    )

    def switch(group: str, resident: sim.Worker | None, incoming: sim.Worker) -> tuple[float, list[Component]]:
        comps = (strategy.suspend(resident[1]) if resident is not None else []) + strategy.resume(incoming[1])
        return sum(c.seconds for c in comps), comps

    trace = sim.simulate_schedule(
        job_ids,
        {(str(j), r): f"g{gi}" for (j, r), gi in place.items()},
        [sim.GroupSim(f"g{i}", wl.group_size) for i in range(n_groups)],
        lambda job, it: steps,
        switch,
        iterations=wl.iterations,
    )
    iter_start = {j: trace.iteration_starts[str(j)] for j in range(wl.jobs)}
    lat: dict[int, list[np.ndarray]] = {j: [] for j in range(wl.jobs)}
    done_at: dict[int, list[np.ndarray]] = {j: [] for j in range(wl.jobs)}
    train_step: dict[int, list[float]] = {j: [] for j in range(wl.jobs)}
    waits: dict[int, list[float]] = {j: [] for j in range(wl.jobs)}
    for j in range(wl.jobs):
        for u in trace.uses[str(j)]:
            if u.kind == "rollout":
                waits[j].append(u.start_s - u.asked_s)
                finish = u.start_s + wl.rollout_s * fracs[(j, u.iteration)]
                lat[j].append(finish - u.asked_s)
                done_at[j].append(finish)
            else:
                train_step[j].append(u.end_s - u.asked_s)
    groups = [
        _Group(g.name, g.accelerators, None, busy=[(s, e, k, int(job)) for s, e, k, job, _ in g.busy], switches=g.switches)
        for g in trace.groups.values()
    ]

    # Steady-state window: whole iterations of job 0 after the warm-up, excluding the last one.
    last = wl.iterations - 1
    a, b = iter_start[0][warmup], iter_start[0][last]
    busy = sum(g.n_acc * _overlap(s, e, a, b) for g in groups for s, e, _, _ in g.busy)
    duty = busy / (total_acc * (b - a))
    its = slice(warmup, last)
    lat_ss = np.concatenate([x for j in range(wl.jobs) for x in lat[j][its]])
    done_ss = np.concatenate([x for j in range(wl.jobs) for x in done_at[j]])
    completed = int(((done_ss >= a) & (done_ss < b)).sum())
    steps = [s for j in range(wl.jobs) for s in train_step[j][its]]
    periods = [(iter_start[j][last] - iter_start[j][warmup]) / (last - warmup) for j in range(wl.jobs)]
    switch_rows = [(s, e, comps, role) for g in groups for s, e, comps, role in g.switches if a <= s < b]
    breakdown: dict[str, dict[str, float]] = {}
    for role in ("sampler", "trainer"):
        rows = [r for r in switch_rows if r[3] == role]
        if rows:
            comp_sum: dict[str, float] = {}
            for _, _, comps, _ in rows:
                for c in comps:
                    comp_sum[c.name] = comp_sum.get(c.name, 0.0) + c.seconds
            breakdown[f"handover_to_{role}"] = {k: round(v / len(rows), 4) for k, v in comp_sum.items()}
    out = {
        "strategy": strategy.name,
        "duty_cycle": duty,
        "accelerators": total_acc,
        "rollout_throughput_req_per_s_per_8_acc": completed / (b - a) / (total_acc / 8),
        "rollout_throughput_req_per_s_per_job": wl.requests_per_rollout / float(np.mean(periods)),
        "training_step_s": float(np.mean(steps)),
        "training_step_s_max": float(np.max(steps)),
        "rollout_p99_latency_s": float(np.percentile(lat_ss, 99)),
        "rollout_p50_latency_s": float(np.percentile(lat_ss, 50)),
        "rollout_wait_s_mean": float(np.mean([w for j in range(wl.jobs) for w in waits[j][its]])),
        "iteration_s": float(np.mean(periods)),
        "handovers_per_iteration": len(switch_rows) / ((b - a) / float(np.mean(periods))),
        "switch_s_per_iteration": sum(e - s for s, e, _, _ in switch_rows) / ((b - a) / float(np.mean(periods))),
        "switch_breakdown_s": breakdown,  # mean seconds per handover, by the incoming worker's role
        "window_s": [a, b],
    }
    if keep_trace:
        out["trace"] = {
            "groups": [
                {
                    "name": g.name,
                    "busy": [(s, e, k, j) for s, e, k, j in g.busy],
                    "switches": [(s, e, role) for s, e, _, role in g.switches],
                }
                for g in groups
            ],
        }
    return out


# --------------------------------------------------------------------------- analytic checks
def analytic_dedicated(wl: Workload) -> float:
    """Dedicated duty cycle: every worker busy only in its own phase, period = R + T + gap."""
    return (wl.rollout_s + wl.train_s) / (2 * (wl.rollout_s + wl.train_s + wl.gap_s))


def analytic_ceiling(wl: Workload) -> float:
    """Zero-cost time-slicing, two jobs, interleaved layout: period = max(R+T+gap, 2R, 2T)."""
    r, t = wl.rollout_s, wl.train_s
    return (r + t) / max(r + t + wl.gap_s, 2 * r, 2 * t)


# --------------------------------------------------------------------------- experiments
def run_config(inp: dict[str, Input], names=STRATEGIES + VARIANTS, keep_trace: bool = False, **wl_kw) -> dict:
    wl = make_workload(inp, **wl_kw)
    res = {}
    for n in names:
        res[n] = simulate(make_strategy(n, inp, wl.model_b, wl.group_size), wl, keep_trace=keep_trace)
    ded = res.get("dedicated")
    if ded:
        for r in res.values():
            r["training_step_vs_dedicated"] = r["training_step_s"] / ded["training_step_s"]
            r["duty_cycle_vs_dedicated"] = r["duty_cycle"] / ded["duty_cycle"]
            r["rollout_throughput_per_8_acc_vs_dedicated"] = (
                r["rollout_throughput_req_per_s_per_8_acc"] / ded["rollout_throughput_req_per_s_per_8_acc"]
            )
    return {
        "workload": wl.__dict__ | {"gap_s": wl.gap_s},
        "results": res,
        "analytic": {"dedicated_duty_cycle": analytic_dedicated(wl), "ceiling_duty_cycle": analytic_ceiling(wl)},
        "trainer_state_fits_on_device": Bytes(inp, wl.model_b, wl.group_size).trainer_state_fits,
    }


def gap_for_dedicated_duty(inp: dict[str, Input], duty: float) -> float:
    """cpu_gap_s that makes the dedicated duty cycle equal ``duty`` (calibration to a published baseline)."""
    wl = make_workload(inp)
    phases = wl.rollout_s + wl.train_s
    return max(0.0, phases * (1 / (2 * duty) - 1) - wl.weight_sync_s)


def winner(results: dict, names: tuple[str, ...], slack: float = 1.05) -> str:
    """Highest duty cycle among strategies whose training step stays within ``slack`` of dedicated."""
    ok = [n for n in names if n == "dedicated" or results[n]["training_step_vs_dedicated"] <= slack]
    return max(ok, key=lambda n: results[n]["duty_cycle"])


SWEEP_NAMES = ("dedicated", "reference", "llmd_timeslice", "ceiling")


def sweep(
    inp: dict[str, Input],
    sizes=(1.5, 3, 7, 14, 32, 70),
    fractions=(0.25, 0.375, 0.5, 0.625, 0.75),
    names=SWEEP_NAMES,
    layouts=("interleaved", "crossed"),
    slack: float = 1.05,
) -> list[dict]:
    """Model size x rollout fraction; each time-slicing strategy takes the better of the layouts (an
    operator places the jobs), i.e. the highest duty cycle whose training step stays within ``slack``."""
    rows = []
    for b in sizes:
        for f in fractions:
            by_layout = {lay: run_config(inp, names=names, model_b=b, rollout_fraction=f, layout=lay) for lay in layouts}
            best: dict[str, dict] = {}
            chosen: dict[str, str] = {}
            for n in names:
                cands = [(lay, by_layout[lay]["results"][n]) for lay in layouts]
                ok = [c for c in cands if c[1]["training_step_vs_dedicated"] <= slack] or cands[:1]
                # near-ties (model noise) go to the first (default) layout
                lay, r = max(ok, key=lambda c: (round(c[1]["duty_cycle"], 3), -layouts.index(c[0])))
                best[n], chosen[n] = r, lay
            wl = by_layout[layouts[0]]["workload"]
            rows.append(
                {
                    "model_b": b,
                    "rollout_fraction": f,
                    "rollout_s": wl["rollout_s"],
                    "train_s": wl["train_s"],
                    "gap_s": wl["gap_s"],
                    "duty_cycle": {n: best[n]["duty_cycle"] for n in names},
                    "training_step_vs_dedicated": {n: best[n]["training_step_vs_dedicated"] for n in names},
                    "rollout_p99_latency_s": {n: best[n]["rollout_p99_latency_s"] for n in names},
                    "layout": chosen,
                    "by_layout": {
                        lay: {
                            n: {
                                "duty_cycle": v["results"][n]["duty_cycle"],
                                "training_step_vs_dedicated": v["results"][n]["training_step_vs_dedicated"],
                            }
                            for n in names
                        }
                        for lay, v in by_layout.items()
                    },
                    "winner": winner(best, tuple(n for n in names if n != "ceiling"), slack),
                    "trainer_state_fits_on_device": by_layout[layouts[0]]["trainer_state_fits_on_device"],
                }
            )
    return rows
