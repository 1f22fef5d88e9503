"""Held traffic with priorities (issue 26): a second traffic class beside the rollouts, yield requests off and on.

    .venv/bin/python -m benchmarks.priorities --out DIR [--iterations 3] [--train-s 10] [--eval-rps 1]

The local stack as ``llmd-timeslice up`` runs it (real Envoy, gate, orchestrator and one snapshot sidecar per
engine, each a process of its own), on fake vLLM engines in this process (``tests.support.fake_engines.FakeVllm``
over real HTTP, the engines the other benchmarks use; a completion takes ``--rollout-service-s`` or
``--eval-service-s``). The stack file declares an InferenceObjective ``eval`` (priority 10) and its band's hold
deadline (``--deadline-s``, 5 s) and longest hold (``--eval-max-hold-s``), and the group's yield-request policy
(``yield_request_fraction``, ``min_training_s``; docs/group-settings.md).

A GRPO-style loop: per iteration a rollout batch (``--batch`` completions through Envoy, no objective header:
band 0), then the trainer acquires the group (the engines drain and sleep) and trains ``--train-s`` seconds in
steps of ``--step-s`` (its safe points), then releases (the engines wake; the next batch waits for them, held).
Three runs, one after the other on the same stack:

* ``no_eval``: rollouts only (the duty-cycle baseline);
* ``yield_off``: plus eval traffic (``--eval-rps``, header ``x-gateway-inference-objective: eval``); the trainer
  is a job in the group's ``job_yield_opt_out``, so the orchestrator never asks it to yield (outcome
  ``suppressed``): an eval request that arrives while it trains waits for the training phase to end;
* ``yield_on``: the same traffic; the trainer is asked to yield when the oldest held eval request reached the
  fraction of its deadline, learns it on its lease heartbeat answer, and the phase-callback integration
  (``AsyncTimesliceCallback.at_step_boundary``) yields at its next step boundary, then acquires the group again
  at once; the trainer goes on with the rest of its phase.

Per run: each request's hold (its arrival at an engine less its send time: the time the gate held it plus the
router's own few milliseconds), p50 / p99 per band, the trainer's duty cycle (training-step seconds / the loop's
wall time), failed requests (any answer but 200), and the orchestrator's yield requests by outcome (its metrics).
Writes ``DIR/priorities.json``, ``DIR/priorities.png`` (bands and yield requests on a timeline, bars) and
``DIR/priorities.txt``. Targets (issue 26): eval p99 within the deadline with yield requests on and above it off,
duty cycle within 10 % of ``no_eval``, no failed request.
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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.report import write_summary

OBJECTIVE_HEADER = "x-gateway-inference-objective"
"""Gateway API Inference Extension: the header naming the request's InferenceObjective (docs/gate.md)."""
EVAL_OBJECTIVE, EVAL_PRIORITY = "eval", 10
GROUP, POOL = "rollout-group", "default"
TRAINER, TRAINER_OPTED_OUT = "trainer-0", "trainer-opted-out"
RUNS = ("no_eval", "yield_off", "yield_on")
DUTY_SLACK = 0.10


@dataclass
class Params:
    iterations: int = 3
    batch: int = 8
    train_s: float = 10.0
    step_s: float = 0.5
    rollout_service_s: float = 0.8
    eval_service_s: float = 0.1
    eval_rps: float = 1.0
    deadline_s: float = 5.0
    eval_max_hold_s: float = 30.0
    fraction: float = 0.5
    min_training_s: float = 2.0
    lease_ttl_s: float = 1.5
    engines: int = 2

    def check(self) -> None:
        """One-line ValueError per unusable value (before anything starts)."""
        if self.iterations < 1 or self.batch < 1 or self.engines < 1:
            raise ValueError(f"iterations, batch and engines must be >= 1, got {self.iterations}, {self.batch}, {self.engines}")
        for name in ("train_s", "step_s", "rollout_service_s", "eval_rps", "deadline_s", "lease_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.deadline_s > self.eval_max_hold_s:
            raise ValueError(f"--deadline-s {self.deadline_s} is above the eval band's longest hold {self.eval_max_hold_s}")
        if self.step_s > self.train_s:
            raise ValueError(f"--step-s {self.step_s} is longer than the training phase --train-s {self.train_s}")


# ----------------------------------------------------------------------------------------------- engines
def timed_fake_vllm(service_s: dict[str, float], arrivals: dict[str, float], lock: threading.Lock):
    """A started :class:`~tests.support.fake_engines.FakeVllm` whose completions take ``service_s[class]`` (the class:
    the OpenAI ``user`` field up to its first ``-``), counted as running meanwhile, and that records when each
    request (named by its ``user`` field) arrived in ``arrivals`` (``time.monotonic()``)."""
    from tests.support.fake_engines import FakeVllm

    class TimedFakeVllm(FakeVllm):
        def _completion(self, body: dict):
            rid = str((body or {}).get("user", ""))
            with lock:
                arrivals.setdefault(rid, time.monotonic())
            with self.lock:
                self.running += 1
            try:
                time.sleep(service_s.get(rid.partition("-")[0], 0.0))
            finally:
                with self.lock:
                    self.running -= 1
            return super()._completion(body)

    return TimedFakeVllm().start()


# ----------------------------------------------------------------------------------------------- the stack
def stack_file(p: Params, work: Path, engines: list, token_file: Path) -> dict:
    """The ``llmd-timeslice up`` stack file of the benchmark (free loopback ports)."""
    from llmd_timeslice.local.ports import free_ports

    names = (
        "router",
        "router_admin",
        "gate_ext_proc",
        "gate_authz",
        "gate_control",
        "gate_metrics",
        "picker",
        "orchestrator",
        "orchestrator_metrics",
    )
    # Distinct ports, the sidecars' included: ports chosen one by one collided here once (picker = gate_control).
    chosen = free_ports(len(names) + len(engines))
    ports = dict(zip(names, chosen, strict=False))
    sidecar_ports = chosen[len(names) :]
    return {
        "stack": {
            "name": "priorities",
            "workdir": str(work / "stack"),
            "token_file": str(token_file),
            "max_hold_s": max(120.0, p.eval_max_hold_s),
            "log_level": "info",
            "gate_edge": "ext_authz",
            "ports": ports,
        },
        "pools": [{"name": POOL}],
        "objectives": [{"name": EVAL_OBJECTIVE, "priority": EVAL_PRIORITY}],
        "priority_bands": [
            {"priority": EVAL_PRIORITY, "max_hold_s": p.eval_max_hold_s, "hold_deadline_s": p.deadline_s},
        ],
        "groups": [
            {
                "group_id": GROUP,
                "sleep_level": 1,
                "drain_timeout_s": 30,
                "lease_ttl_s": p.lease_ttl_s,
                "yield_request_fraction": p.fraction,
                "min_training_s": p.min_training_s,
                "job_yield_opt_out": [TRAINER_OPTED_OUT],
            }
        ],
        "engines": [
            {"name": f"sampler-{i}", "group": GROUP, "pool": POOL, "sidecar_port": sidecar_ports[i], "url": e.url}
            for i, e in enumerate(engines)
        ],
    }


class StackProcess:
    """``llmd-timeslice up -f FILE`` as a child process; ready once it printed its endpoints ("stack up")."""

    def __init__(self, file: Path, log: Path) -> None:
        self.file, self.log_path = file, log
        self._log = open(log, "wb")  # noqa: SIM115 - kept open for the child's lifetime
        env = {**os.environ, "COLUMNS": "200"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmd_timeslice.cli", "up", "-f", str(file)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            if "stack up" in text:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"llmd-timeslice up exited with {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"llmd-timeslice up not ready after {timeout_s} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


# ----------------------------------------------------------------------------------------------- one run
@dataclass
class Request:
    rid: str
    band: int
    sent: float
    status: int | None = None
    done: float | None = None
    error: str = ""


@dataclass
class RunRecord:
    name: str
    t0: float = 0.0
    t1: float = 0.0
    train_busy_s: float = 0.0
    requests: list[Request] = field(default_factory=list)
    phases: list[tuple[str, float, float]] = field(default_factory=list)  # (rollout | train, start, end)
    yields: list[tuple[float, float]] = field(default_factory=list)  # (request noticed, yield began)


async def _send(http, rec: RunRecord, rid: str, band: int, headers: dict[str, str], max_tokens: int) -> None:
    req = Request(rid, band, time.monotonic())
    rec.requests.append(req)
    try:
        r = await http.post(
            "/v1/completions",
            json={"model": "fake", "prompt": f"prompt {rid}", "max_tokens": max_tokens, "user": rid},
            headers=headers,
        )
        req.status = r.status_code
        if r.status_code != 200:
            req.error = f"{r.status_code} {r.headers.get('x-llmd-timeslice-reason', '')} {r.text[:120]}"
    except Exception as exc:  # every failure is counted and reported, never raised
        req.error = f"{type(exc).__name__}: {exc}"
    req.done = time.monotonic()


async def one_run(name: str, p: Params, router: str, orchestrator: str, token: str, progress) -> RunRecord:
    """The GRPO-style loop of one run (see the module docstring), driven through the phase-callback integration
    (:class:`~llmd_timeslice.client.integrations.phase_callback.AsyncTimesliceCallback`: ``train`` takes the group,
    :meth:`at_step_boundary` honours a yield request between two steps, ``generate`` takes no lock in router
    mode)."""
    import httpx

    from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
    from llmd_timeslice.client.integrations.phase_callback import AsyncRoleLocks, AsyncTimesliceCallback

    rec = RunRecord(name)
    job = TRAINER_OPTED_OUT if name == "yield_off" else TRAINER
    asked: list[float] = []  # when the heartbeat answer carried a yield request (the client's callback)
    client = AsyncTimeSliceOrchestratorClient(orchestrator, job_id=job, group_id=GROUP, token=token)
    client.on_yield_requested(lambda _request: asked.append(time.monotonic()))
    cb = AsyncTimesliceCallback(await AsyncRoleLocks.create(job, orchestrator, GROUP, GROUP, client=client))
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    http = httpx.AsyncClient(base_url=router, timeout=p.eval_max_hold_s + 120, limits=limits)
    eval_tasks: list[asyncio.Task] = []
    stop_eval = asyncio.Event()

    async def eval_traffic() -> None:
        n, period = 0, 1.0 / p.eval_rps
        start = time.monotonic()
        while not stop_eval.is_set():
            eval_tasks.append(
                asyncio.create_task(_send(http, rec, f"eval-{name}-{n}", EVAL_PRIORITY, {OBJECTIVE_HEADER: EVAL_OBJECTIVE}, 4))
            )
            n += 1
            delay = start + n * period - time.monotonic()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop_eval.wait(), delay)
                except TimeoutError:
                    pass

    steps = max(1, round(p.train_s / p.step_s))
    try:
        rec.t0 = time.monotonic()
        ev = asyncio.create_task(eval_traffic()) if name != "no_eval" else None
        for it in range(p.iterations):
            t = time.monotonic()
            await cb.on_phase_begin("generate", "sampler")
            batch = [f"rollout-{name}-{it}-{k}" for k in range(p.batch)]
            await asyncio.gather(*(_send(http, rec, rid, 0, {}, 16) for rid in batch))
            await cb.on_phase_end("generate", "sampler")
            rec.phases.append(("rollout", t, time.monotonic()))
            await cb.on_phase_begin("train", "trainer")  # the engines drain and sleep
            t = time.monotonic()
            for step in range(steps):
                s0 = time.monotonic()
                await asyncio.sleep(p.step_s)  # one training step: the accelerators compute
                rec.train_busy_s += time.monotonic() - s0
                if step == steps - 1:
                    break
                b = time.monotonic()
                if await cb.at_step_boundary("train", "trainer"):  # yielded, then acquired again
                    rec.phases.append(("train", t, b))
                    t = time.monotonic()
                    rec.yields.append((asked[-1] if asked else b, b))
            rec.phases.append(("train", t, time.monotonic()))
            await cb.on_phase_end("train", "trainer")  # the engines wake
            progress(f"{name}: iteration {it + 1}/{p.iterations} ({len(rec.yields)} yields so far)")
        rec.t1 = time.monotonic()
        stop_eval.set()
        if ev is not None:
            await ev
        await asyncio.gather(*eval_tasks)
    finally:
        stop_eval.set()
        await http.aclose()
        await cb.close()
        await client.close()
    return rec


# ----------------------------------------------------------------------------------------------- figures
def _pct(xs: list[float], q: int) -> float | None:
    from llmd_timeslice.demo.loadgen import percentile

    return percentile(xs, q) if xs else None


def _scrape(url: str) -> dict:
    """The orchestrator's yield-request counters by outcome (prometheus-client's parser)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in fam.samples:
            if s.name == "llmd_timeslice_orchestrator_yield_requests_total" and s.labels.get("group") == GROUP:
                out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0.0) + s.value
    return out


def summarize(rec: RunRecord, arrivals: dict[str, float], p: Params) -> dict:
    """One run's figures (seconds)."""
    holds: dict[int, list[float]] = {0: [], EVAL_PRIORITY: []}
    failed = [r for r in rec.requests if r.status != 200]
    for r in rec.requests:
        if r.status == 200 and r.rid in arrivals:
            holds[r.band].append(max(0.0, arrivals[r.rid] - r.sent))
    wall = rec.t1 - rec.t0
    ev, ro = holds[EVAL_PRIORITY], holds[0]
    return {
        "wall_s": wall,
        "duty_cycle": rec.train_busy_s / wall if wall > 0 else 0.0,
        "train_busy_s": rec.train_busy_s,
        "requests_sent": len(rec.requests),
        "requests_failed": len(failed),
        "failures": sorted({f.error for f in failed})[:10],
        "eval_requests": len(ev),
        "eval_hold_p50_s": _pct(ev, 50),
        "eval_hold_p99_s": _pct(ev, 99),
        "eval_hold_max_s": max(ev) if ev else None,
        "eval_held_over_deadline": sum(1 for h in ev if h > p.deadline_s),
        "rollout_requests": len(ro),
        "rollout_hold_p50_s": _pct(ro, 50),
        "rollout_hold_p99_s": _pct(ro, 99),
        "yields": len(rec.yields),
        "request_to_yield_s_mean": (sum(b - a for a, b in rec.yields) / len(rec.yields)) if rec.yields else None,
        "timeline": {
            "phases": [(k, a - rec.t0, b - rec.t0) for k, a, b in rec.phases],
            "yields": [a - rec.t0 for a, _ in rec.yields],
            "eval": [(r.sent - rec.t0, arrivals.get(r.rid, r.sent) - r.sent) for r in rec.requests if r.band != 0],
        },
    }


def targets(res: dict) -> dict:
    runs, d = res["runs"], res["deadline_s"]
    on, off, base = runs["yield_on"], runs["yield_off"], runs["no_eval"]["duty_cycle"]
    return {
        "eval_p99_within_deadline_with_yield_on": (on["eval_hold_p99_s"] or 0) <= d,
        "eval_p99_above_deadline_with_yield_off": (off["eval_hold_p99_s"] or 0) > d,
        "duty_cycle_within_10pct_of_no_eval": all(
            runs[k]["duty_cycle"] >= (1 - DUTY_SLACK) * base for k in ("yield_off", "yield_on")
        ),
        "zero_failed": all(r["requests_failed"] == 0 for r in runs.values()),
    }


def plot(path: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res["runs"]
    fig = plt.figure(figsize=(13, 8))
    grid = fig.add_gridspec(len(RUNS) + 1, 2, height_ratios=[1] * len(RUNS) + [1.4])
    d = res["deadline_s"]
    for i, name in enumerate(RUNS):
        ax = fig.add_subplot(grid[i, :])
        tl = runs[name]["timeline"]
        for kind, a, b in tl["phases"]:
            ax.axvspan(a, b, color="#9ecae1" if kind == "rollout" else "#fdae6b", alpha=0.6, lw=0)
        if tl["eval"]:
            xs, ys = zip(*tl["eval"], strict=True)
            ax.scatter(xs, ys, s=10, color="#31a354", label="eval request: hold (s)", zorder=3)
        for y in tl["yields"]:
            ax.axvline(y, color="#d62728", lw=1, ls="--")
        ax.axhline(d, color="#636363", lw=0.8, ls=":")
        ax.set_ylim(0, 1.15 * max([d * 1.3] + [h for _, h in tl["eval"]]))
        ax.set_ylabel("hold s")
        r = runs[name]
        ax.set_title(
            f"{name}: duty cycle {r['duty_cycle']:.3f}, eval p99 {r['eval_hold_p99_s'] or 0:.2f} s, "
            f"{r['yields']} yields (red), failed {r['requests_failed']}",
            fontsize=9,
        )
        if i == 0:
            ax.plot([], [], color="#9ecae1", lw=6, label="rollout (band 0)")
            ax.plot([], [], color="#fdae6b", lw=6, label="trainer holds the group")
            ax.plot([], [], color="#d62728", ls="--", label="yield request honoured")
            ax.plot([], [], color="#636363", ls=":", label=f"eval deadline {d:g} s")
            ax.legend(fontsize=7, loc="upper right", ncols=5)
    ax.set_xlabel("s since the run's start")
    bx = fig.add_subplot(grid[-1, 0])
    width = 0.2
    for k, (key, label) in enumerate(
        [
            ("eval_hold_p50_s", "eval p50"),
            ("eval_hold_p99_s", "eval p99"),
            ("rollout_hold_p50_s", "rollout p50"),
            ("rollout_hold_p99_s", "rollout p99"),
        ]
    ):
        bx.bar([i + (k - 1.5) * width for i in range(len(RUNS))], [runs[n][key] or 0 for n in RUNS], width, label=label)
    bx.axhline(d, color="#636363", lw=0.8, ls=":")
    bx.set_xticks(range(len(RUNS)), RUNS)
    bx.set_ylabel("hold s")
    bx.legend(fontsize=7)
    cx = fig.add_subplot(grid[-1, 1])
    cx.bar(RUNS, [runs[n]["duty_cycle"] for n in RUNS], color=["#7f7f7f", "#ff7f0e", "#1f77b4"])
    base = runs["no_eval"]["duty_cycle"]
    cx.axhline((1 - DUTY_SLACK) * base, color="#636363", lw=0.8, ls=":", label="no_eval - 10 %")
    cx.set_ylabel("trainer duty cycle")
    cx.legend(fontsize=7)
    fig.suptitle("benchmarks.priorities: eval traffic beside rollouts, yield requests off and on", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_lines(res: dict) -> list[str]:
    runs, t = res["runs"], res["targets"]

    def f(x) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        f"benchmarks.priorities: {res['params']['iterations']} iterations x (batch {res['params']['batch']}, training "
        f"{res['params']['train_s']:g} s in {res['params']['step_s']:g} s steps), eval {res['params']['eval_rps']:g} rps, "
        f"deadline {res['deadline_s']:g} s, {res['wall_s']:.0f} s",
        f"{'run':10s} {'duty':>6s} {'x no_eval':>9s} {'eval p50':>8s} {'eval p99':>8s} {'roll p50':>8s} {'roll p99':>8s} "
        f"{'yields':>6s} {'sent':>5s} {'failed':>6s}",
    ]
    base = runs["no_eval"]["duty_cycle"]
    for n in RUNS:
        r = runs[n]
        lines.append(
            f"{n:10s} {r['duty_cycle']:6.3f} {r['duty_cycle'] / base:9.3f} {f(r['eval_hold_p50_s']):>8s} "
            f"{f(r['eval_hold_p99_s']):>8s} {f(r['rollout_hold_p50_s']):>8s} {f(r['rollout_hold_p99_s']):>8s} "
            f"{r['yields']:6d} {r['requests_sent']:5d} {r['requests_failed']:6d}"
        )
    lines.append(f"orchestrator yield requests by outcome (all runs): {res.get('yield_requests_by_outcome', {})}")
    lines.append("targets: " + ", ".join(f"{k} {'MET' if v else 'NOT met'}" for k, v in t.items()))
    return lines


async def _bench(p: Params, work: Path, progress) -> dict:
    arrivals: dict[str, float] = {}
    lock = threading.Lock()
    service = {"rollout": p.rollout_service_s, "eval": p.eval_service_s}
    engines = [timed_fake_vllm(service, arrivals, lock) for _ in range(p.engines)]
    token_file = work / "control-token"
    token = secrets.token_urlsafe(24)
    token_file.write_text(token)
    token_file.chmod(0o600)
    import yaml

    sf = stack_file(p, work, engines, token_file)
    file = work / "stack.yaml"
    file.write_text(yaml.safe_dump(sf, sort_keys=False))
    progress(f"starting the stack (llmd-timeslice up -f {file}) on {p.engines} fake engines")
    stack = StackProcess(file, work / "up.log")
    res: dict = {"runs": {}}
    try:
        await asyncio.to_thread(stack.wait_ready)
        ports = sf["stack"]["ports"]
        router, orch = f"http://127.0.0.1:{ports['router']}", f"127.0.0.1:{ports['orchestrator']}"
        for name in RUNS:
            progress(f"run {name}")
            rec = await one_run(name, p, router, orch, token, progress)
            # every request's answer came back (one_run awaits them all), and an engine records a request's arrival
            # before it answers it: no wait here
            with lock:
                seen = dict(arrivals)
            res["runs"][name] = summarize(rec, seen, p)
        res["yield_requests_by_outcome"] = await asyncio.to_thread(
            _scrape, f"http://127.0.0.1:{ports['orchestrator_metrics']}/metrics"
        )
    finally:
        await asyncio.to_thread(stack.stop)
        for e in engines:
            e.stop()
    return res


def run(out: Path, p: Params) -> dict:
    p.check()
    out.mkdir(parents=True, exist_ok=True)
    work = out / "priorities-work"
    work.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def progress(msg: str) -> None:
        with lock:
            print(f"[priorities] {msg}", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    res = asyncio.run(_bench(p, work, progress))
    res.update(
        deadline_s=p.deadline_s,
        params=p.__dict__,
        wall_s=time.monotonic() - t0,
        engine="tests.support.fake_engines.FakeVllm (completions sleep the service time), over real HTTP",
    )
    res["targets"] = targets(res)
    (out / "priorities.json").write_text(json.dumps(res, indent=1))
    plot(out / "priorities.png", res)
    write_summary(out / "priorities.json", summary_lines(res))
    return res


def main(argv: list[str] | None = None) -> int:
    d = Params()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.priorities", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder (priorities.json, .png, .txt)")
    ap.add_argument("--iterations", type=int, default=d.iterations, help="GRPO iterations per run")
    ap.add_argument("--batch", type=int, default=d.batch, help="rollout completions per iteration")
    ap.add_argument("--train-s", type=float, default=d.train_s, help="training seconds per iteration")
    ap.add_argument("--step-s", type=float, default=d.step_s, help="seconds per training step (the safe points)")
    ap.add_argument("--rollout-service-s", type=float, default=d.rollout_service_s, help="seconds per rollout completion")
    ap.add_argument("--eval-service-s", type=float, default=d.eval_service_s, help="seconds per eval completion")
    ap.add_argument("--eval-rps", type=float, default=d.eval_rps, help="eval requests per second")
    ap.add_argument("--deadline-s", type=float, default=d.deadline_s, help="the eval band's hold deadline")
    ap.add_argument("--eval-max-hold-s", type=float, default=d.eval_max_hold_s, help="the eval band's longest hold")
    ap.add_argument("--fraction", type=float, default=d.fraction, help="group setting yield_request_fraction")
    ap.add_argument("--min-training-s", type=float, default=d.min_training_s, help="group setting min_training_s")
    ap.add_argument("--lease-ttl-s", type=float, default=d.lease_ttl_s, help="group lease TTL (heartbeat every TTL/3)")
    ap.add_argument("--engines", type=int, default=d.engines, help="fake vLLM engines in the group")
    a = ap.parse_args(argv)
    p = Params(**{k: v for k, v in vars(a).items() if k != "out"})
    try:
        p.check()
    except ValueError as exc:
        ap.error(str(exc))
    res = run(a.out, p)
    return 0 if res["targets"]["zero_failed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
