"""The RL model's second traffic class: eval requests to one job's sampler pool, with and without yield requests, and
the trade-off of ``min_training_s`` against the eval deadline."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import simpy

from benchmarks.rl_model.costs import (
    Component,
    Strategy,
    Workload,
    make_strategy,
    make_workload,
)
from benchmarks.rl_model.inputs import Input
from benchmarks.rl_model.schedule import (
    _Group,
    _overlap,
    _placement,
)


# --------------------------------------------------------------------------- second traffic class (eval)
@dataclass(frozen=True)
class EvalClass:
    """A second traffic class sent to job 0's sampler pool besides its rollouts (evaluation, a judge model, a
    canary): Poisson arrivals at ``rps``, each needing ``service_s`` on an awake sampler, held by the gate while
    the pool sleeps, in a priority band with a hold deadline (``hold_deadline_s``) and a longest hold
    (``max_hold_s``: past it the gate answers 503 ``hold_expired``, counted as failed).

    Yield requests (``yield_requests``) follow the group settings of docs/group-settings.md: the orchestrator asks
    the holder once the band's oldest held request reached ``fraction`` of the deadline and the holder kept the
    group ``min_training_s`` since its grant; the gate reports the band's pressure every ``pressure_period_s``;
    the holder learns it on its next lease heartbeat (every ``heartbeat_period_s`` from its grant) and yields at
    its next step boundary (``train_step_s`` of compute per step); it asks for the group again at once and
    resumes the rest of its training phase once the sampler served what was held and drained."""

    rps: float = 1.0
    hold_deadline_s: float = 5.0
    max_hold_s: float = 120.0
    service_s: float = 0.5
    yield_requests: bool = True
    fraction: float = 0.5
    min_training_s: float = 10.0
    train_step_s: float = 2.0
    heartbeat_period_s: float = 1.0
    pressure_period_s: float = 0.25

    def __post_init__(self) -> None:
        if self.rps < 0:
            raise ValueError(f"eval rps must be >= 0, got {self.rps}")
        if not 0 < self.hold_deadline_s <= self.max_hold_s:
            raise ValueError(f"eval hold deadline must be in (0, max_hold_s={self.max_hold_s}], got {self.hold_deadline_s}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"yield request fraction must be in (0, 1], got {self.fraction}")
        for name in ("min_training_s", "service_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("train_step_s", "heartbeat_period_s", "pressure_period_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def eval_class(inp: dict[str, Input], **override) -> EvalClass:
    """The :class:`EvalClass` of the ``eval_*`` inputs (and the policy knobs' defaults), with ``override``."""
    v = {k: i.value for k, i in inp.items()}
    base = {
        "rps": v["eval_rps"],
        "hold_deadline_s": v["eval_hold_deadline_s"],
        "max_hold_s": v["eval_max_hold_s"],
        "service_s": v["eval_service_s"],
        "fraction": v["yield_request_fraction"],
        "min_training_s": v["min_training_s"],
        "train_step_s": v["train_step_s"],
        "heartbeat_period_s": v["heartbeat_period_s"],
        "pressure_period_s": v["hold_pressure_period_s"],
    }
    return EvalClass(**(base | override))


def _next_tick(t: float, origin: float, period: float) -> float:
    """First time >= ``t`` on the grid ``origin + k * period`` (k >= 0)."""
    if t <= origin:
        return origin
    return origin + math.ceil((t - origin) / period - 1e-9) * period


def simulate_eval(strategy: Strategy, wl: Workload, ev: EvalClass | None, seed: int = 0, warmup: int = 3) -> dict:
    """The DES of :func:`simulate` with a second traffic class (``ev``; None: none) sent to job 0's sampler pool.

    As in the project (and unlike :func:`simulate`, where a worker's switch waits for its next phase), a trainer's
    release on that group wakes the sampler at once, so the wake overlaps the trainer's idle gap. The layout must
    let a trainer take that sampler's group (``colocated`` or ``crossed``; in ``interleaved`` the
    samplers' group never sleeps for a trainer). Returns the figures of :func:`simulate` (duty cycle, training
    step, ...) and ``eval_hold_p50_s`` / ``eval_hold_p99_s`` (arrival -> a SERVING sampler; 0 when it arrives while
    one serves), ``eval_failed`` (held past ``max_hold_s``), ``yield_requests`` (sent / honoured / per iteration)
    and ``eval_serving_fraction`` (share of the eval group's time spent serving the held requests during yields,
    not counted as busy in the duty cycle)."""
    if strategy.dedicated:
        raise ValueError("the eval class is modelled on time-sliced strategies only (dedicated samplers never sleep)")
    if wl.layout == "interleaved":
        raise ValueError("layout 'interleaved' never lends the samplers' group to a trainer: use colocated or crossed")
    env = simpy.Environment()
    place, n_groups, total_acc = _placement(wl, False)
    groups = [_Group(f"g{i}", wl.group_size, simpy.Resource(env, capacity=1)) for i in range(n_groups)]
    eg = groups[place[(0, "sampler")]]  # the group that serves the eval pool
    ev_rng = np.random.default_rng(seed)
    iter_start: dict[int, list[float]] = {j: [] for j in range(wl.jobs)}
    train_step: dict[int, list[float]] = {j: [] for j in range(wl.jobs)}
    serving = {"on": False}
    held: list[float] = []  # arrival times of the eval requests held now (oldest first)
    holds: list[tuple[float, float]] = []  # (arrival, seconds held)
    eval_windows: list[tuple[float, float]] = []
    yields: list[dict] = []  # one per yield request sent: {"sent", "honoured"}
    finished = {"jobs": 0}

    def switch_to(g: _Group, worker: tuple[int, str]):
        comps: list[Component] = []
        if g.resident is not None:
            comps += strategy.suspend(g.resident[1])
        comps += strategy.resume(worker[1])
        sw = sum(c.seconds for c in comps)
        if g is eg:
            serving["on"] = False
        g.switches.append((env.now, env.now + sw, comps, worker[1]))
        if sw > 0:
            yield env.timeout(sw)
        g.resident = worker
        if g is eg and worker == (0, "sampler"):
            serving["on"] = True
            for t in held:
                holds.append((t, env.now - t))
            held.clear()

    def use(job: int, role: str, duration: float, kind: str):
        g = groups[place[(job, role)]]
        t_req = env.now
        with g.res.request() as req:
            yield req
            if g.resident != (job, role):
                yield from switch_to(g, (job, role))
            start = env.now
            yield env.timeout(duration)
            g.busy.append((start, env.now, kind, job))
        return t_req, start

    def ask_time(grant: float) -> float | None:
        """When the orchestrator sends the yield request to a holder granted at ``grant`` (None: not yet due)."""
        while ev is not None and held and env.now - held[0] > ev.max_hold_s:  # 503 hold_expired: failed
            holds.append((held.pop(0), ev.max_hold_s + 1e-6))
        if ev is None or not ev.yield_requests or not held:
            return None
        oldest = held[0]
        due = max(oldest + ev.fraction * ev.hold_deadline_s, grant + ev.min_training_s)
        return _next_tick(due, oldest, ev.pressure_period_s)

    def serve_held(req):
        """The sampler's turn during a yield: wake, serve what was held, drain, hand the group back."""
        yield req
        if eg.resident != (0, "sampler"):
            yield from switch_to(eg, (0, "sampler"))
        start = env.now
        yield env.timeout(ev.service_s if ev is not None else 0.0)
        eval_windows.append((start, env.now))
        eg.res.release(req)

    def train(job: int):
        """One training phase; on the eval group it is cut at a step boundary when a yield request was noticed."""
        g = groups[place[(job, "trainer")]]
        t_req, remaining = env.now, wl.train_s
        while remaining > 1e-9:
            req = g.res.request()
            yield req
            if g.resident != (job, "trainer"):
                yield from switch_to(g, (job, "trainer"))
            grant, sent = env.now, None
            while remaining > 1e-9:
                step = min(ev.train_step_s if ev is not None else remaining, remaining)
                start = env.now
                yield env.timeout(step)
                g.busy.append((start, env.now, "train", job))
                remaining -= step
                if g is not eg or ev is None:
                    continue
                ask = ask_time(grant)
                if ask is None or ask > env.now:
                    continue
                if sent is None:
                    sent = {"sent": ask, "honoured": None}
                    yields.append(sent)
                noticed = _next_tick(ask, grant, ev.heartbeat_period_s)
                if noticed <= env.now and remaining > 1e-9:
                    sent["honoured"] = env.now
                    server = g.res.request()  # queued before the yield: the sampler's turn comes next
                    env.process(serve_held(server))
                    break
            g.res.release(req)
        train_step[job].append(env.now - t_req)
        if g is eg:  # the yield wakes the samplers at once (they serve until the next acquire)
            env.process(wake_samplers())

    def wake_samplers():
        with eg.res.request() as req:
            yield req
            if eg.resident != (0, "sampler"):
                yield from switch_to(eg, (0, "sampler"))

    def job(j: int):
        for _ in range(wl.iterations):
            iter_start[j].append(env.now)
            yield env.process(use(j, "sampler", wl.rollout_s, "rollout"))
            yield env.timeout(wl.cpu_gap_s)
            yield env.process(train(j))
            yield env.timeout(wl.weight_sync_s)
        iter_start[j].append(env.now)
        finished["jobs"] += 1

    def arrivals():
        while ev is not None and ev.rps > 0 and finished["jobs"] < wl.jobs:
            yield env.timeout(float(ev_rng.exponential(1.0 / ev.rps)))
            if serving["on"]:
                holds.append((env.now, 0.0))
            else:
                held.append(env.now)

    for j in range(wl.jobs):
        env.process(job(j))
    env.process(arrivals())
    env.run()

    last = wl.iterations - 1
    a, b = iter_start[0][warmup], iter_start[0][last]
    busy = sum(g.n_acc * _overlap(s, e, a, b) for g in groups for s, e, _, _ in g.busy)
    period = (b - a) / (last - warmup)
    its = slice(warmup, last)
    in_window = [h for t, h in holds if a <= t < b]
    window_yields = [y for y in yields if a <= y["sent"] < b]
    out = {
        "strategy": strategy.name,
        "layout": wl.layout,
        "duty_cycle": busy / (total_acc * (b - a)),
        "iteration_s": period,
        "training_step_s": float(np.mean([s for j in range(wl.jobs) for s in train_step[j][its]])),
        "eval_requests": len(in_window),
        "eval_hold_p50_s": float(np.percentile(in_window, 50)) if in_window else 0.0,
        "eval_hold_p99_s": float(np.percentile(in_window, 99)) if in_window else 0.0,
        "eval_hold_max_s": float(max(in_window)) if in_window else 0.0,
        "eval_held_fraction": sum(1 for h in in_window if h > 0) / len(in_window) if in_window else 0.0,
        "eval_failed": sum(1 for h in in_window if ev is not None and h > ev.max_hold_s),
        "yield_requests": {
            "sent": len(window_yields),
            "honoured": sum(1 for y in window_yields if y["honoured"] is not None),
            "per_iteration": len(window_yields) / ((b - a) / period),
            "request_to_yield_s_mean": float(
                np.mean([y["honoured"] - y["sent"] for y in window_yields if y["honoured"] is not None])
            )
            if any(y["honoured"] is not None for y in window_yields)
            else None,
        },
        "eval_serving_fraction": sum(_overlap(s, e, a, b) for s, e in eval_windows) / (b - a),
        "window_s": [a, b],
    }
    if ev is not None:
        out["eval_class"] = ev.__dict__
    return out


EVAL_RUNS = ("no_eval", "yield_off", "yield_on")


def run_eval(
    inp: dict[str, Input], strategy: str = "llmd_timeslice", layout: str = "colocated", iterations: int | None = None, **ev_kw
) -> dict:
    """The three runs of benchmarks.priorities at node scale: no eval traffic, eval with yield requests off, on.

    ``ev_kw`` overrides the :class:`EvalClass` of the inputs (``rps``, ``hold_deadline_s``, ``min_training_s`` ...).
    Each run's ``duty_cycle_vs_no_eval`` is its duty cycle over the no-eval run's (same workload, same seed)."""
    wl = make_workload(inp, layout=layout, iterations=iterations)
    s = make_strategy(strategy, inp, wl.model_b, wl.group_size)
    ev_on = eval_class(inp, **ev_kw)
    runs = {
        "no_eval": simulate_eval(s, wl, None),
        "yield_off": simulate_eval(s, wl, replace(ev_on, yield_requests=False)),
        "yield_on": simulate_eval(s, wl, ev_on),
    }
    for r in runs.values():
        r["duty_cycle_vs_no_eval"] = r["duty_cycle"] / runs["no_eval"]["duty_cycle"]
    return {"workload": wl.__dict__ | {"gap_s": wl.gap_s}, "deadline_s": ev_on.hold_deadline_s, "runs": runs}


def eval_tradeoff(
    inp: dict[str, Input],
    min_training=(0.0, 2.5, 5.0, 10.0, 20.0, 40.0),
    steps=(0.5, 2.0, 7.5),
    strategy: str = "llmd_timeslice",
    layout: str = "colocated",
    iterations: int | None = None,
) -> list[dict]:
    """Eval hold p99 against the duty cycle, yield requests on, over ``min_training_s`` x ``train_step_s``: the
    policy's trade-off at node scale (each row also carries the no-eval duty cycle it is compared with)."""
    wl = make_workload(inp, layout=layout, iterations=iterations)
    s = make_strategy(strategy, inp, wl.model_b, wl.group_size)
    base = simulate_eval(s, wl, None)
    rows = []
    for step in steps:
        for mt in min_training:
            r = simulate_eval(s, wl, eval_class(inp, min_training_s=mt, train_step_s=step))
            rows.append(
                {
                    "min_training_s": mt,
                    "train_step_s": step,
                    "eval_hold_p99_s": r["eval_hold_p99_s"],
                    "eval_hold_p50_s": r["eval_hold_p50_s"],
                    "duty_cycle": r["duty_cycle"],
                    "duty_cycle_vs_no_eval": r["duty_cycle"] / base["duty_cycle"],
                    "yields_per_iteration": r["yield_requests"]["per_iteration"],
                    "within_deadline": r["eval_hold_p99_s"] <= eval_class(inp).hold_deadline_s,
                }
            )
    return rows
