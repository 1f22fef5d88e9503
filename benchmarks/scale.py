"""Cost of the control path as the work grows: N samplers and M gates behind one orchestrator.

    .venv/bin/python -m benchmarks.scale --out scale.json [--quick] [--switches 30] [--profile-dir DIR]

For each (N samplers, M gates) in {1, 16, 64, 128} x {1, 4} (``--quick``: {1, 4} x {2}, 3 switches: the tests' run): one real
orchestrator (``llmd-timeslice orchestrator``, a child process), M real gates subscribed to it (``llmd-timeslice
gate`` processes), and N real sidecars (``SidecarServer`` + ``VllmBackend``, real gRPC) each on a fake vLLM over real
HTTP (``tests.support.fake_engines.FakeVllm``, with TCP_NODELAY, its ``/metrics`` page padded to the families and
buckets vLLM 0.32 exports: ``vllm/v1/metrics/loggers.py``). The sidecars are hosted 32 to a process (a process each
would be 128 Python start-ups and ~8 GB here); the engines answer at once, so what is timed is our own path.
One group holds every sampler; a trainer does ``--switches`` switches (acquire, then release) after 2 warm-up ones.

Figures per run: ``acquire_ms_p50`` (the client's acquire: publish DRAINING, drain barrier, verified sleeps, grant),
``release_ms_p50`` (the yield until every sampler was published SERVING and acked by every gate, from the
orchestrator's switch record), CPU per switch of each process measured apart (psutil on the children:
``orchestrator_cpu_ms_per_switch``, ``gate_cpu_ms_per_switch`` per gate; per sampler
``sidecar_cpu_ms_per_sampler_switch`` and ``fake_engine_cpu_ms_per_sampler_switch``, told apart by the engines'
thread CPU clocks), commands and endpoint updates sent to each gate per switch (the orchestrator's counters),
engine HTTP calls per sampler per switch, and acquire / release with the sidecars' CPU taken out
(``*_ms_p50_excl_sidecars``: wall time minus the CPU of the sidecar processes, their fake engines included, in that
step divided by the cores; the sidecars and engines of 128 samplers share the machine's cores with the path being
measured, so this is an estimate). The summary's
``marginal_orchestrator_cpu_ms_per_sampler`` is (cpu at the largest N - cpu at N = 1) / (N - 1) with one gate
(target <= 0.25), with ratios of the largest N to N = 1 for acquire and release (target <= 2 with the sidecars'
CPU taken out). Writes JSON, a PNG of the curves and a text summary beside ``--out``.

Floors in the same run (:mod:`benchmarks.stream_floor`): after the runs, a client that does nothing but send each
sampler the orchestrator's two commands per switch (sleep, wake) on one stream each, to do-nothing servers that
answer spread over the sleep phase the largest one-gate run measured (as the engines' answers arrived there), at
N = 1 and the largest N (one server process per transport serves both), over grpc.aio (the orchestrator's
library) and over plain asyncio TCP. The summary's
``floor_marginal_cpu_ms_per_sampler`` gives each floor's (cpu at the largest N - cpu at N = 1) / (N - 1), and
``ratio_marginal_to_grpc_floor`` the orchestrator's marginal over grpc.aio's (1.0: nothing above the two commands).
``--no-floor`` skips them.

``--profile-dir DIR`` runs the orchestrator under cProfile on CPU time (``DIR/orchestrator-N{n}-M{m}.prof``; the
figures of such a run include the profiler's overhead).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.report import write_summary
from benchmarks.scale_sidecar_host import SidecarHost

HOST_SIZE = 32
"""Sidecars (and fake engines) per sidecar host process."""

FULL_SAMPLERS, FULL_GATES, FULL_SWITCHES = (1, 16, 64, 128), (1, 4), 30
FLOOR_SWITCHES = 10
"""Switches of each floor measurement (at most the run's own): each takes two spreads of wall time."""
QUICK_SAMPLERS, QUICK_GATES, QUICK_SWITCHES = (1, 4), (2,), 3
WARMUP_SWITCHES = 2


# ---------------------------------------------------------------------------------------- components
_PROFILED_CLI = """
import cProfile, runpy, sys, time
sys.argv[0] = "llmd_timeslice.cli"
prof = cProfile.Profile(time.process_time)
prof.enable()
try:
    runpy.run_module("llmd_timeslice.cli", run_name="__main__", alter_sys=True)
finally:
    prof.disable()
    prof.dump_stats({out!r})
"""


class _Child:
    """``python [-m cProfile -o PROF] -m llmd_timeslice.cli ARGS``, ready once ``port`` accepts connections."""

    def __init__(self, name: str, args: list[str], port: int, logdir: Path, profile: Path | None = None) -> None:
        from mirakuru import TCPExecutor

        from llmd_timeslice.local.commands import cli_argv

        self.name = name
        self._log = open(logdir / f"{name}.log", "wb")  # noqa: SIM115
        # cProfile on CPU time (its default clock is wall time, which counts waiting for a core)
        profiled = [sys.executable, "-c", _PROFILED_CLI.format(out=str(profile)), *args] if profile is not None else None
        cmd = profiled or cli_argv(args)
        self._exec = TCPExecutor(cmd, host="127.0.0.1", port=port, timeout=120, stdout=self._log, stderr=subprocess.STDOUT)

    def start(self) -> _Child:
        self._exec.start()
        return self

    @property
    def pid(self) -> int:
        assert self._exec.process is not None
        return self._exec.process.pid

    def stop(self) -> None:
        if self._exec.running():
            self._exec.stop()
        self._log.close()


def _cpu_s(procs) -> float:
    """User + system CPU seconds of ``procs`` (psutil.Process)."""
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def _scrape(metrics_port: int) -> dict[str, float]:
    """The orchestrator's gate-command counters (Prometheus text, prometheus-client's parser)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "llmd_timeslice_orchestrator_gate_commands_total":
                out[s.labels["kind"]] = s.value
            elif s.name == "llmd_timeslice_orchestrator_gate_endpoint_updates_total":
                out["endpoint_updates"] = s.value
            elif s.name == "llmd_timeslice_orchestrator_connected_gates":
                out["connected_gates"] = s.value
    return out


def _pct(xs: list[float], q: int) -> float:
    from llmd_timeslice.demo.loadgen import percentile

    return percentile(xs, q)


async def _one_run(
    n: int, m: int, switches: int, hosts: list[SidecarHost], work: Path, token_file: Path, profile_dir: Path | None, progress
) -> dict:
    import psutil
    import yaml

    from llmd_timeslice.api.llmd_timeslice.v1alpha1 import orchestrator_info_pb2 as ipb
    from llmd_timeslice.api.llmd_timeslice.v1alpha1 import orchestrator_info_pb2_grpc as ipb_grpc
    from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
    from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
    from llmd_timeslice.local.ports import free_ports

    samplers = [s for h in hosts for s in h.samplers][:n]
    used_hosts = hosts[: (n + HOST_SIZE - 1) // HOST_SIZE]
    inv = {
        "groups": [
            {
                "group_id": "scale",
                "sleep_level": 1,
                "drain_timeout_s": 30,
                "samplers": [
                    {"pool": "default", "address": s["engine"], "sidecar": s["sidecar"], "job_id": f"s{i % HOST_SIZE}"}
                    for i, s in enumerate(samplers)
                ],
            }
        ]
    }
    inv_path = work / f"inventory-{n}.yaml"
    inv_path.write_text(yaml.safe_dump(inv, sort_keys=False))
    logdir = work / "logs"
    from llmd_timeslice.local.commands import GateCommand, OrchestratorCommand

    # Distinct ports for every child of the run (chosen one by one, two could collide).
    orch_port, orch_metrics, *gate_ports = free_ports(2 + 3 * m)
    profile = profile_dir / f"orchestrator-N{n}-M{m}.prof" if profile_dir is not None else None
    orch = _Child(
        f"orchestrator-N{n}-M{m}",
        OrchestratorCommand(
            inventory=inv_path,
            port=orch_port,
            metrics_port=orch_metrics,
            engine_audit_interval_s=3600,  # the audit reads every engine each interval: not part of a switch
            token_file=token_file,
        ).args(),
        orch_port,
        logdir,
        profile,
    )
    gates: list[_Child] = []
    client = None
    try:
        progress(f"N={n} M={m}: starting the orchestrator and {m} gate(s)")
        orch.start()
        for i in range(m):
            p = gate_ports[3 * i : 3 * i + 3]
            gates.append(
                _Child(
                    f"gate-{i}-N{n}-M{m}",
                    GateCommand(
                        ext_proc_port=p[0],
                        authz_port=p[1],
                        control_port=p[2],
                        orchestrator=f"127.0.0.1:{orch_port}",
                        gate_id=f"gate-{i}",
                        token_file=token_file,
                    ).args(),
                    p[2],
                    logdir,
                )
            )
        await asyncio.gather(*(asyncio.to_thread(g.start) for g in gates))
        client = AsyncTimeSliceOrchestratorClient(
            f"127.0.0.1:{orch_port}", job_id="trainer", group_id="scale", token=token_file.read_text(), heartbeats=False
        )
        info = ipb_grpc.OrchestratorInfoServiceStub(client._channel)

        async def group_state() -> int:
            r = await client._stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="scale"))
            return r.group.group_state

        deadline = time.monotonic() + 120
        while (await asyncio.to_thread(_scrape, orch_metrics)).get(
            "connected_gates", 0
        ) < m or await group_state() != opb.GroupStatus.STATE_IDLE:
            if time.monotonic() > deadline:
                raise RuntimeError(f"N={n} M={m}: gates not subscribed or group not serving after 120 s")
            await asyncio.sleep(0.2)

        orch_p = psutil.Process(orch.pid)
        gate_ps = [psutil.Process(g.pid) for g in gates]
        host_ps = [psutil.Process(h.proc.pid) for h in used_hosts]
        me = psutil.Process()
        acq_ms: list[float] = []
        yields: list[float] = []
        acq_side_cpu: list[float] = []
        rel_side_cpu: list[float] = []
        rel_wall: list[float] = []
        guess = 0.05

        async def switch() -> tuple[float, float, float, float, float]:
            """One acquire + release; returns (acquire s, sidecar CPU s in it, yield unix time, release wall s
            until the group is idle again, sidecar CPU s in it)."""
            nonlocal guess
            c0 = _cpu_s(host_ps)
            t = time.perf_counter()
            await client.acquire(timeout_sec=300)
            a = time.perf_counter() - t
            c1 = _cpu_s(host_ps)
            y = time.time()
            t = time.perf_counter()
            await client.release()
            await asyncio.sleep(guess)  # few status calls: each one is orchestrator CPU too
            while await group_state() != opb.GroupStatus.STATE_IDLE:
                await asyncio.sleep(0.01)
            r = time.perf_counter() - t
            guess = r * 0.9
            return a, c1 - c0, y, r, _cpu_s(host_ps) - c1

        for _ in range(WARMUP_SWITCHES):
            await switch()
        engine_cpu0 = sum(h.calls()["engine_cpu_s"] for h in used_hosts)  # also resets the call counts
        m0 = await asyncio.to_thread(_scrape, orch_metrics)
        cpu0 = (_cpu_s([orch_p]), [_cpu_s([g]) for g in gate_ps], _cpu_s(host_ps), _cpu_s([me]), psutil.cpu_times())
        t_start = time.perf_counter()
        for i in range(switches):
            a, ca, y, r, cr = await switch()
            acq_ms.append(a * 1000)
            acq_side_cpu.append(ca)
            yields.append(y)
            rel_wall.append(r)
            rel_side_cpu.append(cr)
            if i % 10 == 9:
                progress(f"N={n} M={m}: {i + 1}/{switches} switches")
        wall = time.perf_counter() - t_start
        orch_cpu = _cpu_s([orch_p]) - cpu0[0]
        gate_cpu = [_cpu_s([g]) - c for g, c in zip(gate_ps, cpu0[1], strict=True)]
        host_cpu = _cpu_s(host_ps) - cpu0[2]
        me_cpu = _cpu_s([me]) - cpu0[3]
        mt = psutil.cpu_times()
        machine_cpu = (sum(mt) - mt.idle - mt.iowait) - (sum(cpu0[4]) - cpu0[4].idle - cpu0[4].iowait)  # nice included
        m1 = await asyncio.to_thread(_scrape, orch_metrics)
        calls: dict[str, int] = {}
        engine_cpu = -engine_cpu0
        for h in used_hosts:
            answer = h.calls()
            engine_cpu += answer["engine_cpu_s"]
            for path, k in answer["calls"].items():
                calls[path] = calls.get(path, 0) + k
        recs = (await info.ListSwitches(ipb.ListSwitchesRequest(group_id="scale", limit=1000))).switches
        back = sorted((r for r in recs if r.kind == "to_samplers" and r.ok), key=lambda r: r.started_at_unix_s)
        release_ms = []
        for y in yields:  # each yield's record: the first one started at or after it
            rec = next((r for r in back if r.started_at_unix_s >= y - 0.001), None)
            if rec is not None:
                release_ms.append((rec.started_at_unix_s + sum(rec.phase_seconds.values()) - y) * 1000)
        to_job = sorted((r for r in recs if r.kind == "to_job" and r.ok), key=lambda r: r.started_at_unix_s)[-switches:]
        cores = psutil.cpu_count() or 1
        acq_excl = [max(0.0, a - c * 1000 / cores) for a, c in zip(acq_ms, acq_side_cpu, strict=True)]
        rel_excl = [max(0.0, r - c * 1000 / cores) for r, c in zip(release_ms, rel_side_cpu, strict=False)]

        def per_gate_switch(key: str) -> float:
            return (m1.get(key, 0.0) - m0.get(key, 0.0)) / m / switches

        return {
            "samplers": n,
            "gates": m,
            "switches": switches,
            "acquire_ms_p50": _pct(acq_ms, 50),
            "acquire_ms_p99": _pct(acq_ms, 99),
            "release_ms_p50": _pct(release_ms, 50),
            "release_ms_p99": _pct(release_ms, 99),
            "release_wall_until_idle_ms_p50": _pct([r * 1000 for r in rel_wall], 50),
            "acquire_ms_p50_excl_sidecars": _pct(acq_excl, 50),
            "release_ms_p50_excl_sidecars": _pct(rel_excl, 50),
            "acquire_phases_ms_p50": {
                k: _pct([r.phase_seconds[k] * 1000 for r in to_job if k in r.phase_seconds], 50)
                for k in ("publish_draining", "drain", "sleep")
            },
            "orchestrator_cpu_ms_per_switch": orch_cpu * 1000 / switches,
            "gate_cpu_ms_per_switch": sum(gate_cpu) * 1000 / m / switches,
            "gate_cpu_ms_per_switch_each": [c * 1000 / switches for c in gate_cpu],
            "sidecar_cpu_ms_per_sampler_switch": (host_cpu - engine_cpu) * 1000 / n / switches,
            "fake_engine_cpu_ms_per_sampler_switch": engine_cpu * 1000 / n / switches,
            "harness_cpu_ms_per_switch": me_cpu * 1000 / switches,
            "machine_cpu_ms_per_switch": machine_cpu * 1000 / switches,
            "wall_s": wall,
            "state_messages_per_gate_per_switch": per_gate_switch("state"),
            "drain_queries_per_gate_per_switch": per_gate_switch("drain"),
            "messages_per_gate_per_switch": per_gate_switch("state") + per_gate_switch("drain"),
            "endpoint_updates_per_gate_per_switch": per_gate_switch("endpoint_updates"),
            "endpoints_changed_per_switch": 4 * n,  # DRAINING, ASLEEP, WAKING, SERVING: each sampler once
            "engine_calls_per_sampler_switch": sum(calls.values()) / n / switches,
            "engine_calls_by_path_per_sampler_switch": {p: k / n / switches for p, k in sorted(calls.items())},
            "profiled": profile is not None,
        }
    finally:
        if client is not None:
            await client.close()
        await asyncio.gather(*(asyncio.to_thread(c.stop) for c in [*gates, orch]))


def _summary(runs: list[dict]) -> dict:
    one = {(r["samplers"], r["gates"]): r for r in runs}
    ns = sorted({r["samplers"] for r in runs})
    ms = sorted({r["gates"] for r in runs})
    lo, hi, m1 = ns[0], ns[-1], ms[0]
    out: dict = {"largest_samplers": hi}
    if hi > lo and (lo, m1) in one and (hi, m1) in one:
        a, b = one[(lo, m1)], one[(hi, m1)]
        out["marginal_orchestrator_cpu_ms_per_sampler"] = (
            b["orchestrator_cpu_ms_per_switch"] - a["orchestrator_cpu_ms_per_switch"]
        ) / (hi - lo)
        out["marginal_gate_cpu_ms_per_sampler"] = (b["gate_cpu_ms_per_switch"] - a["gate_cpu_ms_per_switch"]) / (hi - lo)
        for k in ("acquire_ms_p50", "release_ms_p50", "acquire_ms_p50_excl_sidecars", "release_ms_p50_excl_sidecars"):
            out[f"ratio_{k}_largest_to_1"] = b[k] / a[k] if a[k] else None
    if len(ms) > 1 and (hi, ms[0]) in one and (hi, ms[-1]) in one:
        a, b = one[(hi, ms[0])], one[(hi, ms[-1])]
        out["orchestrator_cpu_ratio_most_to_fewest_gates_at_largest_n"] = (
            b["orchestrator_cpu_ms_per_switch"] / a["orchestrator_cpu_ms_per_switch"]
        )
    out["targets"] = {
        "marginal_orchestrator_cpu_ms_per_sampler": "<= 0.25",
        "ratio_acquire_ms_p50_excl_sidecars_largest_to_1": "<= 2",
        "ratio_release_ms_p50_excl_sidecars_largest_to_1": "<= 2",
        "messages_per_gate_per_switch": "grows no faster than endpoints_changed_per_switch",
    }
    return out


def _floors(runs: list[dict], switches: int, progress) -> dict:
    """:mod:`benchmarks.stream_floor` at N = 1 and the largest N, both transports, answers spread over the largest
    one-gate run's sleep phase (p50); the marginal of each, as the summary's orchestrator marginal is computed."""
    from benchmarks import stream_floor

    ns = sorted({r["samplers"] for r in runs})
    m1 = min(r["gates"] for r in runs)
    largest = next(r for r in runs if r["samplers"] == ns[-1] and r["gates"] == m1)
    spread_s = largest["acquire_phases_ms_p50"].get("sleep", 0.0) / 1000
    out: dict = {"spread_ms": spread_s * 1000, "switches": switches, "runs": []}
    for transport in ("grpc", "tcp"):
        progress(f"floor: {transport}, N={ns[0]} and N={ns[-1]}, answers spread over {spread_s * 1000:.0f} ms")
        at = {r["samplers"]: r for r in stream_floor.measure_each(tuple({ns[0], ns[-1]}), switches, spread_s, transport)}
        out["runs"].extend(at.values())
        if ns[-1] > ns[0]:
            out[f"{transport}_marginal_cpu_ms_per_sampler"] = (
                at[ns[-1]]["cpu_ms_per_switch"] - at[ns[0]]["cpu_ms_per_switch"]
            ) / (ns[-1] - ns[0])
    return out


def _plot(path: Path, runs: list[dict], floors: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for m in sorted({r["gates"] for r in runs}):
        rs = sorted((r for r in runs if r["gates"] == m), key=lambda r: r["samplers"])
        xs = [r["samplers"] for r in rs]
        axes[0].plot(xs, [r["acquire_ms_p50"] for r in rs], "o-", label=f"acquire, {m} gate(s)")
        axes[0].plot(xs, [r["release_ms_p50"] for r in rs], "s--", label=f"release, {m} gate(s)")
        axes[1].plot(xs, [r["orchestrator_cpu_ms_per_switch"] for r in rs], "o-", label=f"orchestrator, {m} gate(s)")
        axes[1].plot(xs, [r["gate_cpu_ms_per_switch"] for r in rs], "s--", label=f"each gate, {m} gate(s)")
        axes[2].plot(xs, [r["messages_per_gate_per_switch"] for r in rs], "o-", label=f"commands per gate, {m} gate(s)")
    for transport, style in (("grpc", "k:"), ("tcp", "k-.")):
        measured = (floors or {}).get("runs", [])
        pts = sorted((f["samplers"], f["cpu_ms_per_switch"]) for f in measured if f["transport"] == transport)
        if pts:
            name = "grpc.aio" if transport == "grpc" else "plain TCP"
            axes[1].plot(*zip(*pts, strict=True), style, label=f"floor: 2 commands per sampler, {name}")
    rs = sorted((r for r in runs if r["gates"] == min(r["gates"] for r in runs)), key=lambda r: r["samplers"])
    axes[2].plot([r["samplers"] for r in rs], [r["endpoints_changed_per_switch"] for r in rs], "k:", label="endpoints changed")
    axes[0].set_ylabel("ms (p50)")
    axes[1].set_ylabel("CPU ms per switch")
    axes[2].set_ylabel("per switch")
    for ax, title in zip(axes, ("switch latency", "CPU per switch", "state stream"), strict=True):
        ax.set_xlabel("samplers")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle("benchmarks.scale: control path vs samplers and gates")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def _bench(
    samplers: tuple[int, ...], gates: tuple[int, ...], switches: int, work: Path, profile_dir: Path | None, progress
) -> list[dict]:
    token_file = work / "control-token"
    token_file.write_text(secrets.token_urlsafe(24))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    need = max(samplers)
    sizes = [min(HOST_SIZE, need - i) for i in range(0, need, HOST_SIZE)]
    progress(f"starting {need} sidecars on fake engines in {len(sizes)} process(es)")
    hosts = await asyncio.gather(
        *(asyncio.to_thread(SidecarHost, k, token_file, work / "logs" / f"sidecar-host-{i}.log") for i, k in enumerate(sizes))
    )
    runs = []
    try:
        for m in gates:
            for n in samplers:
                runs.append(await _one_run(n, m, switches, list(hosts), work, token_file, profile_dir, progress))
    finally:
        for h in hosts:
            await asyncio.to_thread(h.stop)
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="JSON output (PNG and .txt written beside it)")
    ap.add_argument("--quick", action="store_true", help=f"N in {QUICK_SAMPLERS}, M in {QUICK_GATES}, {QUICK_SWITCHES} switches")
    ap.add_argument("--switches", type=int, help=f"switches per run (default {FULL_SWITCHES})")
    ap.add_argument("--samplers", type=str, help="comma-separated N values (default 1,16,64,128)")
    ap.add_argument("--gates", type=str, help="comma-separated M values (default 1,4)")
    ap.add_argument("--profile-dir", type=Path, help="run the orchestrator under cProfile, writing .prof files here")
    ap.add_argument("--no-floor", action="store_true", help="skip the do-nothing command floors (benchmarks.stream_floor)")
    a = ap.parse_args(argv)
    if a.out is None:
        ap.error("--out is required")
    samplers = tuple(int(x) for x in a.samplers.split(",")) if a.samplers else (QUICK_SAMPLERS if a.quick else FULL_SAMPLERS)
    gates = tuple(int(x) for x in a.gates.split(",")) if a.gates else (QUICK_GATES if a.quick else FULL_GATES)
    switches = a.switches or (QUICK_SWITCHES if a.quick else FULL_SWITCHES)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    work = a.out.parent / "scale-work"
    work.mkdir(parents=True, exist_ok=True)
    if a.profile_dir is not None:
        a.profile_dir.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def progress(msg: str) -> None:
        with lock:
            print(f"[scale] {msg}", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    runs = asyncio.run(_bench(samplers, gates, switches, work, a.profile_dir, progress))
    summary = _summary(runs)
    floors = None if a.no_floor else _floors(runs, min(switches, FLOOR_SWITCHES), progress)
    if floors is not None and "grpc_marginal_cpu_ms_per_sampler" in floors:
        summary["floor_marginal_cpu_ms_per_sampler"] = {t: floors[f"{t}_marginal_cpu_ms_per_sampler"] for t in ("grpc", "tcp")}
        if "marginal_orchestrator_cpu_ms_per_sampler" in summary and floors["grpc_marginal_cpu_ms_per_sampler"] > 0:
            summary["ratio_marginal_to_grpc_floor"] = (
                summary["marginal_orchestrator_cpu_ms_per_sampler"] / floors["grpc_marginal_cpu_ms_per_sampler"]
            )
    res = {
        "runs": runs,
        "summary": summary,
        "floors": floors,
        "wall_s": round(time.monotonic() - t0, 1),
        "quick": a.quick,
        "cores": os.cpu_count(),
        "engine": "tests.support.fake_engines.FakeVllm (TCP_NODELAY, vLLM-shaped /metrics), answers at once",
        "note": (
            "CPU per process from psutil on the children; the sidecars (HOST_SIZE per process) and their engines share "
            "the machine's cores with the orchestrator and gates, so wall times at large N include waiting for them: "
            "the *_excl_sidecars figures take their CPU (divided by the cores) out of each step's wall time."
        ),
    }
    a.out.write_text(json.dumps(res, indent=1))
    _plot(a.out.with_suffix(".png"), runs, floors)
    lines = [f"benchmarks.scale: {len(runs)} runs, {switches} switches each, {res['wall_s']} s, {res['cores']} cores"]
    lines.append(
        f"{'N':>4} {'M':>2} {'acq p50':>8} {'rel p50':>8} {'acq-sc':>7} {'rel-sc':>7} {'orch cpu':>9} {'gate cpu':>9} "
        f"{'sidecar':>8} {'engine':>7} {'msgs/gate':>9} {'eps/gate':>8} {'calls':>6}"
    )
    for r in runs:
        lines.append(
            f"{r['samplers']:>4} {r['gates']:>2} {r['acquire_ms_p50']:>8.1f} {r['release_ms_p50']:>8.1f} "
            f"{r['acquire_ms_p50_excl_sidecars']:>7.1f} {r['release_ms_p50_excl_sidecars']:>7.1f} "
            f"{r['orchestrator_cpu_ms_per_switch']:>9.2f} {r['gate_cpu_ms_per_switch']:>9.2f} "
            f"{r['sidecar_cpu_ms_per_sampler_switch']:>8.2f} {r['fake_engine_cpu_ms_per_sampler_switch']:>7.2f} "
            f"{r['messages_per_gate_per_switch']:>9.1f} "
            f"{r['endpoint_updates_per_gate_per_switch']:>8.1f} {r['engine_calls_per_sampler_switch']:>6.1f}"
        )
    lines.append(
        "(ms; CPU per switch: orchestrator, each gate, per sampler its sidecar and its fake engine; acq-sc / rel-sc: "
        "the sidecar processes' CPU taken out; msgs/gate: state commands + drain queries per gate; calls: engine HTTP "
        "calls per sampler)"
    )
    s = res["summary"]
    if "marginal_orchestrator_cpu_ms_per_sampler" in s:
        lines.append(
            f"marginal orchestrator CPU {s['marginal_orchestrator_cpu_ms_per_sampler']:.3f} ms per sampler per switch "
            f"(target <= 0.25); N={s['largest_samplers']} / N=1: acquire {s['ratio_acquire_ms_p50_largest_to_1']:.1f}x, "
            f"release {s['ratio_release_ms_p50_largest_to_1']:.1f}x; sidecars' CPU taken out: acquire "
            f"{s['ratio_acquire_ms_p50_excl_sidecars_largest_to_1']:.1f}x, release "
            f"{s['ratio_release_ms_p50_excl_sidecars_largest_to_1']:.1f}x (target <= 2)"
        )
    if "floor_marginal_cpu_ms_per_sampler" in s:
        f = s["floor_marginal_cpu_ms_per_sampler"]
        ratio = s.get("ratio_marginal_to_grpc_floor")
        lines.append(
            f"floor, two do-nothing commands per sampler per switch, answers spread over {floors['spread_ms']:.0f} ms "
            f"(benchmarks.stream_floor): grpc.aio {f['grpc']:.3f} ms per sampler, plain asyncio TCP {f['tcp']:.3f}; "
            f"orchestrator / grpc.aio floor {ratio:.2f}"
            if ratio is not None
            else "orchestrator / grpc.aio floor: n/a"
        )
    write_summary(a.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
