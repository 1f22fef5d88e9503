"""The placement planner, measured (issue 40 §4): a naive placement against the plan, on the local stack.

    .venv/bin/python -m benchmarks.placement --out DIR [--run-s 100] [--seed 0] [--no-scale]

Six synthetic RL jobs of different profiles (:data:`JOBS`: a long rollout that keeps its accelerators busy, two long
CPU reward gaps, a short rollout, a small state, a large state), each a loop of the public client
(``AsyncTimeSliceOrchestratorClient``): acquire its rollout group naming the phase, its accelerators and state bytes
(the profile hints) -> roll out -> release -> reward on CPU -> acquire its train group -> train -> release -> weight
sync; every duration drawn per iteration around the job's means (seeded). Each job has its own fake vLLM engine
(``tests.support.fake_engines.FakeVllm``) behind a real sidecar, so every grant from served samplers is a real
drain + verified sleep and every release nobody waits for a real verified wake, through the real gate and
orchestrator that ``llmd-timeslice up`` starts.

1. **naive**: one stack file, one group for every job (the example stack's layout): every job keeps its own
   accelerators, all take turns under one lease, FIFO. Run ``--run-s`` seconds; measured duty cycle and slowdowns.
2. **plan**: while the naive stack still runs, ``llmd-timeslice plan -f NAIVE_STACK --offer OFFER --apply`` (the
   command a user runs): the profiles the orchestrator recorded, its measured switch costs -> ``DIR/plan/``
   (plan.json, plan.png, plan.txt, and stack.yaml with the plan's groups). The naive stack goes down, the plan's
   ``stack.yaml`` comes up with ``up``, the jobs run again on the groups of ``DIR/plan/job-groups.json``.
3. **scale** (:mod:`benchmarks.placement_scale`): 64 jobs from published workloads on 512 accelerators, the plan
   against dedicated, random pairing and a RollMux-like greedy pairing; the planner's CPU time on 1,000 jobs.

Measured, per run: the duty cycle (docs/benchmarks.md: useful accelerator-seconds, each phase's own seconds times
its accelerators, from the jobs' own clocks, over the groups' accelerators x the window after a warm-up of
:data:`WARMUP_PERIODS` of the longest period) and each job's slowdown (its mean period in the window over the sum of
its drawn durations for the same iterations, minus 1). Writes ``DIR/placement.json`` (``naive``, ``plan`` with
``duty_cycle_measured``, ``duty_cycle_predicted`` and ``jobs`` with ``slowdown`` and ``slowdown_budget``,
``scale``, ``targets``), ``DIR/placement.png`` and ``DIR/placement.txt``. Targets: the plan's measured duty cycle
>= 1.3x the naive one's, every job of the plan within its slowdown budget, the prediction within 10 % of the
measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from benchmarks.report import number

OFFER = "2x8:768GiB"
"""Two 8-accelerator nodes, 768 GiB of host memory each: fewer than the jobs alone need (20), so jobs must share."""
JITTER = 0.05
"""Per-iteration log-normal sigma of every phase."""
WARMUP_PERIODS = 1.0
"""Left out of every figure at the start of a run, in periods of the longest job alone."""
GIB = 2**30


@dataclass(frozen=True)
class SyntheticJob:
    """One RL job's phases (seconds, means), accelerators, host bytes of its trainer's state (its samplers' weights:
    an eighth of that, 2 bytes per parameter against 16), slowdown budget."""

    name: str
    rollout_s: float
    cpu_gap_s: float
    train_s: float
    weight_sync_s: float
    accelerators: int
    state_bytes: int
    budget: float = 0.05

    @property
    def period_s(self) -> float:
        return self.rollout_s + self.cpu_gap_s + self.train_s + self.weight_sync_s

    def draws(self, seed: int, n: int) -> np.ndarray:
        """``n`` iterations x (rollout, cpu_gap, train, weight_sync) seconds."""
        rng = np.random.default_rng([seed, sum(map(ord, self.name))])
        means = np.array([self.rollout_s, self.cpu_gap_s, self.train_s, self.weight_sync_s])
        return means * rng.lognormal(0, JITTER, (n, 4))


JOBS = (
    SyntheticJob("long-rollout", 4.0, 0.8, 2.5, 0.4, 4, 120 * GIB),
    SyntheticJob("reward-gap-a", 1.5, 14.0, 1.0, 0.3, 4, 100 * GIB),
    SyntheticJob("reward-gap-b", 1.2, 13.0, 1.3, 0.3, 4, 100 * GIB),
    SyntheticJob("short-rollout", 0.8, 4.0, 1.2, 0.3, 2, 30 * GIB),
    SyntheticJob("small-state", 1.0, 3.5, 0.8, 0.3, 2, 8 * GIB),
    SyntheticJob("large-state", 2.0, 5.0, 2.0, 0.5, 4, 600 * GIB),
)


@dataclass
class JobRun:
    """What one job did: iteration starts (s since the run's start), holds ``(kind, start, end, accelerators)`` of
    its useful work, and the drawn durations of each iteration it started."""

    starts: list[float] = field(default_factory=list)
    holds: list[tuple[str, float, float, int]] = field(default_factory=list)
    drawn: list[list[float]] = field(default_factory=list)


class Stack:
    """``llmd-timeslice up -f FILE`` as a child process, ready when its ``stack.json`` says every component is."""

    def __init__(self, path: Path, log: Path) -> None:
        self.path, self.log = path, log
        doc = yaml.safe_load(path.read_text())
        self.workdir = path.parent / ".llmd-timeslice" / doc["stack"]["name"]
        self.orchestrator = f"127.0.0.1:{doc['stack']['ports']['orchestrator']}"
        self.token = Path(doc["stack"]["token_file"]).read_text().strip()
        self.proc: subprocess.Popen | None = None

    def _state(self) -> dict:
        try:
            return json.loads((self.workdir / "stack.json").read_text())
        except (OSError, ValueError):
            return {}

    async def start(self, timeout_s: float = 180.0) -> None:
        cmd = [sys.executable, "-m", "llmd_timeslice.cli", "up", "-f", str(self.path), "--no-live"]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`llmd-timeslice up` exited with {self.proc.returncode}; see {self.log}")
            st = self._state()
            comps = st.get("components") or []
            if st.get("phase") == "running" and comps and all(c.get("state") == "ready" for c in comps):
                return
            await asyncio.sleep(0.3)
        raise RuntimeError(f"the stack of {self.path} did not start within {timeout_s:g} s; see {self.log}")

    def stop(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "llmd_timeslice.cli", "down", "-f", str(self.path)], capture_output=True, timeout=120
        )
        if self.proc is not None:
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def naive_stack(work: Path, engines: dict[str, str]) -> Path:
    """The naive stack file: one group ``naive`` holding every job's engine (``engines``: job -> url)."""
    from llmd_timeslice.local.ports import free_ports

    names = ["router", "router_admin", "gate_ext_proc", "gate_authz", "gate_control", "gate_metrics", "picker"]
    names += ["orchestrator", "orchestrator_metrics"]
    ports = free_ports(len(names) + len(engines))
    token = work / "token"
    token.write_text(secrets.token_urlsafe(24))
    token.chmod(0o600)
    doc = {
        "stack": {
            "name": "bench",
            "token_file": str(token),
            "log_level": "warning",
            "ports": dict(zip(names, ports, strict=False)),
        },
        "pools": [{"name": "default"}],
        "groups": [{"group_id": "naive", "drain_timeout_s": 5, "lease_ttl_s": 30}],
        "engines": [
            {"name": f"{job}-sampler", "group": "naive", "sidecar_port": port, "url": url}
            for (job, url), port in zip(engines.items(), ports[len(names) :], strict=True)
        ],
    }
    path = work / "naive" / "stack.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


async def run_jobs(
    orchestrator: str, token: str, groups: dict[str, tuple[str, str]], run_s: float, seed: int
) -> dict[str, JobRun]:
    """Every job of :data:`JOBS` at once on ``groups`` (job -> (rollout group, train group)) for ``run_s`` seconds
    (no iteration starts after it; the last one finishes)."""
    from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient

    t0 = time.monotonic()
    runs = {j.name: JobRun() for j in JOBS}

    async def one(job: SyntheticJob) -> None:
        run, draws = runs[job.name], job.draws(seed, 1000)
        rollout_group, train_group = groups[job.name]
        c = AsyncTimeSliceOrchestratorClient(orchestrator, job_id=job.name, token=token)
        state = {"rollout": job.state_bytes // 8, "train": job.state_bytes}
        try:
            for it in range(1000):
                now = time.monotonic() - t0
                if now >= run_s:
                    break
                r, gap, t, sync = (float(x) for x in draws[it])
                run.starts.append(now)
                run.drawn.append([r, gap, t, sync])
                for kind, group, seconds, idle in (("rollout", rollout_group, r, gap), ("train", train_group, t, sync)):
                    await c.acquire(
                        group_id=group, timeout_sec=600, phase=kind, accelerators=job.accelerators, state_bytes=state[kind]
                    )
                    start = time.monotonic() - t0
                    await asyncio.sleep(seconds)
                    run.holds.append((kind, start, time.monotonic() - t0, job.accelerators))
                    await c.release(group_id=group)
                    await asyncio.sleep(idle)
            run.starts.append(time.monotonic() - t0)
        finally:
            await c.close()

    await asyncio.gather(*(one(j) for j in JOBS))
    return runs


def measure(runs: dict[str, JobRun], accelerators: int, warm_s: float, end_s: float) -> dict:
    """Duty cycle and per-job slowdowns over ``[warm_s, end_s]`` (module docstring)."""
    busy = sum(acc * max(0.0, min(e, end_s) - max(s, warm_s)) for r in runs.values() for _, s, e, acc in r.holds)
    jobs = {}
    for job in JOBS:
        r = runs[job.name]
        idx = [i for i in range(len(r.starts) - 1) if warm_s <= r.starts[i] < end_s] or list(range(len(r.starts) - 1))
        periods = np.array([r.starts[i + 1] - r.starts[i] for i in idx])
        alone = np.array([sum(r.drawn[i]) for i in idx])
        slowdown = float(periods.sum() / alone.sum() - 1)
        jobs[job.name] = {
            "slowdown": round(slowdown, 4),
            "slowdown_budget": job.budget,
            "within_budget": slowdown <= job.budget,
            "period_s": round(float(periods.mean()), 3),
            "alone_period_s": round(float(alone.mean()), 3),
            "iterations": len(idx),
            "slowdown_per_iteration_p05_p95": [round(float(np.percentile(periods / alone - 1, q)), 4) for q in (5, 95)],
        }
    return {
        "duty_cycle_measured": round(busy / (accelerators * (end_s - warm_s)), 4),
        "accelerators": accelerators,
        "window_s": [round(warm_s, 2), round(end_s, 2)],
        "jobs": jobs,
    }


def _plan_command(naive: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "llmd_timeslice.cli", "plan", "-f", str(naive), "--offer", OFFER, "--out", str(out), "--apply"]


async def run_stack_benchmark(out: Path, run_s: float, seed: int, log=print) -> dict:
    from tests.support.fake_engines import FakeVllm

    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    engines = {j.name: FakeVllm().start() for j in JOBS}
    warm = WARMUP_PERIODS * max(j.period_s for j in JOBS)
    try:
        naive_path = naive_stack(work, {name: e.url for name, e in engines.items()})
        stack = Stack(naive_path, work / "naive-up.log")
        t = time.monotonic()
        await stack.start()
        log(f"naive stack up in {time.monotonic() - t:.1f} s; jobs run {run_s:g} s")
        try:
            runs = await run_jobs(stack.orchestrator, stack.token, {j.name: ("naive", "naive") for j in JOBS}, run_s, seed)
            naive = measure(runs, sum(j.accelerators for j in JOBS), warm, run_s)
            naive["timeline"] = {n: r.holds for n, r in runs.items()}
            cmd = _plan_command(naive_path, out / "plan")
            planned = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=300)
            (work / "plan.log").write_text(planned.stdout + planned.stderr)
            log(f"plan ({' '.join(cmd[3:])}): exit {planned.returncode}")
            if planned.returncode not in (0, 3):
                raise RuntimeError(f"plan failed: {planned.stderr.strip()}")
        finally:
            stack.stop()
        plan = json.loads((out / "plan" / "plan.json").read_text())
        groups = json.loads((out / "plan" / "job-groups.json").read_text())
        stack = Stack(out / "plan" / "stack.yaml", work / "plan-up.log")
        await stack.start()
        log(f"plan stack up: {len(plan['groups'])} groups on {plan['accelerators_used']} accelerators")
        try:
            pairs = {j: (g["TIMESLICE_SAMPLER_GROUP"], g["TIMESLICE_TRAINER_GROUP"]) for j, g in groups.items()}
            runs = await run_jobs(stack.orchestrator, stack.token, pairs, run_s, seed + 1)
        finally:
            stack.stop()
        measured = measure(runs, plan["accelerators_used"], warm, run_s)
        measured["timeline"] = {n: r.holds for n, r in runs.items()}
        predicted = {j["job_id"]: j for j in plan["jobs"]}
        for name, j in measured["jobs"].items():
            j["slowdown_predicted"] = predicted[name]["slowdown"]
        measured["duty_cycle_predicted"] = plan["predicted_duty_cycle"]
        measured["groups"] = [{k: g[k] for k in ("group_id", "policy", "accelerators", "predicted_duty_cycle")} | {
            "jobs": sorted({m["job_id"] for m in g["members"]})} for g in plan["groups"]]  # fmt: skip
        measured["switch_costs_measured_in_naive"] = plan["switch_costs"]
        measured["search"] = plan["search"]
        measured["naive_predicted_duty_cycle"] = next(
            (a["duty_cycle"] for a in plan["alternatives"] if a["name"] == "naive"), None
        )
        return {"naive": naive, "plan": measured}
    finally:
        for e in engines.values():
            e.stop()


def targets(res: dict) -> dict:
    naive, plan = res["naive"], res["plan"]
    ratio = plan["duty_cycle_measured"] / naive["duty_cycle_measured"]
    error = abs(plan["duty_cycle_predicted"] - plan["duty_cycle_measured"]) / plan["duty_cycle_measured"]
    over = sorted(n for n, j in plan["jobs"].items() if not j["within_budget"])
    return {
        "plan_vs_naive_measured": round(ratio, 3),
        "plan_vs_naive_met": ratio >= 1.3,
        "prediction_error": round(error, 4),
        "prediction_met": error <= 0.10,
        "jobs_over_budget": over,
        "budgets_met": not over,
    }


def summary_lines(res: dict) -> list[str]:
    n, p, t = res["naive"], res["plan"], res["targets"]
    lines = [
        f"placement: {len(JOBS)} synthetic RL jobs on the local stack (real orchestrator, gate, sidecars; fake engines), "
        f"offer {OFFER}",
        f"naive (one group, FIFO, {n['accelerators']} accelerators): duty cycle {n['duty_cycle_measured']:.3f} measured",
        f"plan ({len(p['groups'])} groups, {p['accelerators']} accelerators): duty cycle {p['duty_cycle_measured']:.3f} "
        f"measured, {p['duty_cycle_predicted']:.3f} predicted",
        f"targets: plan/naive {t['plan_vs_naive_measured']:.2f}x (>= 1.3: {'met' if t['plan_vs_naive_met'] else 'NOT met'}); "
        f"prediction off by {t['prediction_error']:.1%} (<= 10%: {'met' if t['prediction_met'] else 'NOT met'}); "
        f"budgets {'all met' if t['budgets_met'] else 'NOT met: ' + ', '.join(t['jobs_over_budget'])}",
    ]
    for g in p["groups"]:
        lines.append(f"  {g['group_id']}: {', '.join(g['jobs'])} ({g['policy']}, {g['accelerators']} accelerators)")
    for name, j in p["jobs"].items():
        lines.append(
            f"  {name}: slowdown {j['slowdown']:+.1%} measured, {j['slowdown_predicted']:+.1%} predicted, budget "
            f"{j['slowdown_budget']:.0%}; naive {n['jobs'][name]['slowdown']:+.0%}"
        )
    s = res.get("scale")
    if s:
        rows = s["placements"]
        lines.append(
            f"scale ({s['jobs']} jobs, {s['accelerators_offered']} accelerators, simulated): "
            + ", ".join(f"{k} {v['duty_cycle']:.3f} ({v['jobs_over_budget']} over budget)" for k, v in rows.items())
        )
        lines.append("  ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in s["ratios"].items()))
        if s.get("timing"):
            lines.append(f"  planner on {s['timing']['jobs']} jobs: {s['timing']['cpu_seconds']} s of CPU (one core)")
    return lines


def plot(path: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(12, 11), gridspec_kw={"height_ratios": [3, 3, 2]})
    colours = {j.name: plt.get_cmap("tab10")(i) for i, j in enumerate(JOBS)}
    for ax, key in zip(axes[:2], ("naive", "plan"), strict=True):
        r = res[key]
        lanes = [("naive", [j.name for j in JOBS])] if key == "naive" else [(g["group_id"], g["jobs"]) for g in r["groups"]]
        for y, (_lane, members) in enumerate(lanes):
            for name in members:
                for kind, s, e, _ in r["timeline"][name]:
                    ax.barh(
                        y,
                        e - s,
                        left=s,
                        height=0.6,
                        color=colours[name],
                        hatch="" if kind == "rollout" else "//",
                        edgecolor="k",
                        lw=0.2,
                    )
        ax.set_yticks(range(len(lanes)), [lane for lane, _ in lanes])
        ax.axvline(r["window_s"][0], color="grey", ls=":")
        ax.set_title(f"{key}: holds per group (measured; colour: job, hatched: train), duty cycle {r['duty_cycle_measured']:.3f}")
        ax.invert_yaxis()
    axes[1].set_xlabel("seconds since the jobs started (dotted: end of the warm-up)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    axes[0].legend(handles, list(colours), ncol=6, fontsize=7, loc="upper right")
    ax = axes[2]
    bars = [("naive\nmeasured", res["naive"]["duty_cycle_measured"]), ("plan\npredicted", res["plan"]["duty_cycle_predicted"]),
            ("plan\nmeasured", res["plan"]["duty_cycle_measured"])]  # fmt: skip
    if res.get("scale"):
        bars += [(f"scale\n{k}", v["duty_cycle"]) for k, v in res["scale"]["placements"].items()]
    ax.bar(range(len(bars)), [v for _, v in bars], color=["#bdbdbd", "#9ecae1", "#2b8cbe"] + ["#fdae6b"] * (len(bars) - 3))
    for i, (_, v) in enumerate(bars):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [b for b, _ in bars], fontsize=7)
    ax.set_ylabel("duty cycle")
    ax.set_ylim(0, 1.1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for placement.json, placement.png, placement.txt, plan/")
    ap.add_argument("--run-s", type=number(float, 20, 3600), default=100.0, help="seconds each placement runs (default 100)")
    ap.add_argument("--seed", type=number(int, 0), default=0)
    ap.add_argument("--no-scale", action="store_true", help="skip the simulation at scale")
    a = ap.parse_args(argv)
    if a.out.exists() and not a.out.is_dir():
        ap.error(f"--out {a.out} is a file; give a folder")
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    load_before = os.getloadavg()
    res = asyncio.run(run_stack_benchmark(a.out, a.run_s, a.seed))
    # the jobs' own clocks count every stall of this shared machine as slowdown: say how busy it was
    res["load_average_1_5_15"] = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
    res["targets"] = targets(res)
    if not a.no_scale:
        from benchmarks.placement_scale import run_scale

        res["scale"] = run_scale(seed=a.seed)
    res["jobs_defined"] = [j.__dict__ for j in JOBS]
    res["offer"] = OFFER
    res["run_s"] = a.run_s
    res["wall_s"] = round(time.monotonic() - t0, 1)
    (a.out / "placement.json").write_text(json.dumps(res, indent=1) + "\n")
    plot(a.out / "placement.png", res)
    load = res["load_average_1_5_15"]
    lines = [
        *summary_lines(res),
        f"wall time {res['wall_s']} s; load average (1 min) {load['before'][0]} before, {load['after'][0]} after",
    ]
    (a.out / "placement.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {a.out / 'placement.json'}, {a.out / 'placement.png'}, {a.out / 'placement.txt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
