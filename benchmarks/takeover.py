"""Takeover time of the orchestrator's leader election: leader SIGKILL -> first granted acquire by the new leader.

Two ``llmd-timeslice orchestrator --leader-election`` processes against the test Kubernetes API server
(tests/support/kube_api.py: Leases and ConfigMaps with resourceVersion conflicts; there is no cluster here), their
state in its ConfigMap. Per election setting (lease duration / renew deadline / retry period) and repetition: the
leader A is Ready, the follower B campaigns; A is SIGKILLed and a trainer asks B to acquire every 50 ms (what
clients behind the Service do: UNAVAILABLE "not the leader" is retried) until granted. With ``--samplers 2`` the
group has two samplers (fake vLLM engines behind real sidecars in this process), so the takeover includes the new
leader's reconcile and a phase switch (drain, verified sleep); with 0 it is the control plane alone.

Baseline, same run: one acquire + yield on the live leader before the kill. The bound the settings give is
``lease_duration_s + 2 * retry_period_s`` (a follower counts the lease from its own sighting of the last renewal, up
to a retry period late, and takes the Lease at its next retry), plus the start-up of the new leader's groups and one
switch. B's log says when it took the Lease and when it served; the rest is the client's retry back-off.

    .venv/bin/python -m benchmarks.takeover --out /tmp/takeover/takeover.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient, TimeSliceError
from llmd_timeslice.local.commands import OrchestratorCommand

SETTINGS = [(2, 1.5, 1.0), (5, 3.0, 1.0), (15, 10.0, 2.0)]  # the last: Kubernetes controllers' defaults
TOKEN = "bench"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serving(port: int) -> bool:
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
    except (TimeoutError, grpc.RpcError):
        return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


def _spawn(name: str, port: int, inventory: Path, kubeconfig: str, token_file: Path, setting, log: Path) -> subprocess.Popen:
    lease, renew, retry = setting
    cmd = OrchestratorCommand(
        inventory=inventory, port=port, metrics_port=0, state_configmap="orch-state", leader_election=True,
        kubeconfig=kubeconfig, namespace="ml", lease_duration_s=lease, renew_deadline_s=renew, retry_period_s=retry,
        engine_audit_interval_s=0, token_file=token_file,
        log_level="info",  # the takeover steps are read from its log
    )  # fmt: skip
    args = cmd.argv()
    return subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT, env={**os.environ, "POD_NAME": name})


async def _until(pred, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not await pred():
        if time.monotonic() > end:
            raise RuntimeError("timed out")
        await asyncio.sleep(0.05)


async def one_takeover(setting, samplers: int, workdir: Path, stop: str = "kill") -> dict:
    from tests.support.fake_engines import FakeVllm
    from tests.support.kube_api import FakeKubeApi, write_kubeconfig

    api = FakeKubeApi()
    engines, sidecars = [], []
    procs: list[subprocess.Popen] = []
    try:
        if samplers:
            from llmd_timeslice.snapshot.backends.vllm import VllmBackend
            from llmd_timeslice.snapshot.server import SidecarServer

            engines = [FakeVllm().start() for _ in range(samplers)]
            sidecars = [
                SidecarServer({f"s{i}": VllmBackend(e.url, idle_timeout_s=1)}, port=0, token=TOKEN) for i, e in enumerate(engines)
            ]
            for s in sidecars:
                await s.start()
        inv = workdir / "inventory.json"
        entries = [
            {"pool": "default", "address": e.url.removeprefix("http://"), "sidecar": f"127.0.0.1:{s.port}", "job_id": f"s{i}"}
            for i, (e, s) in enumerate(zip(engines, sidecars, strict=True))
        ]
        inv.write_text(json.dumps({"groups": [{"group_id": "g", "drain_timeout_s": 5, "samplers": entries}]}))
        token_file = workdir / "token"
        token_file.write_text(TOKEN)
        kc = write_kubeconfig(workdir / "kubeconfig", api.url, "ml")
        pa, pb = _port(), _port()
        procs.append(_spawn("orch-a", pa, inv, kc, token_file, setting, workdir / "orch-a.log"))
        await _until(lambda: _serving(pa), 60)
        procs.append(_spawn("orch-b", pb, inv, kc, token_file, setting, workdir / "orch-b.log"))
        await asyncio.sleep(2.0)  # B is up and following
        a_client = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{pa}", job_id="trainer", group_id="g", token=TOKEN)
        t = time.perf_counter()
        await a_client.acquire(timeout_sec=30)
        await a_client.release()
        baseline = time.perf_counter() - t
        await a_client.close()
        await asyncio.sleep(0.5)
        b_client = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{pb}", job_id="trainer", group_id="g", token=TOKEN)
        killed, killed_wall = time.perf_counter(), time.time()
        # kill: the node died; term: a rolling update stops it (it hands the Lease back first).
        os.kill(procs[0].pid, signal.SIGKILL if stop == "kill" else signal.SIGTERM)
        attempts = 0
        while True:
            attempts += 1
            try:
                await b_client.acquire(timeout_sec=60)
                break
            except TimeSliceError:
                await asyncio.sleep(0.05)
        takeover = time.perf_counter() - killed
        await b_client.release()
        await b_client.close()
        log = (workdir / "orch-b.log").read_text()
        return {
            "takeover_s": takeover,
            # From B's log (wall clock, ms): when it took the Lease, and when it served (state restored, groups up).
            "leads_s": _logged_at(log, "leads (Lease") - killed_wall,
            "serving_s": _logged_at(log, "leader term=") - killed_wall,
            "baseline_acquire_yield_s": baseline,
            "refused_attempts": attempts - 1,
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for s in sidecars:
            await s.stop()
        for e in engines:
            e.stop()
        api.stop()


def _logged_at(log: str, marker: str) -> float:
    """Wall-clock time of the first log line containing ``marker`` (``ts=YYYY-mm-dd HH:MM:SS,mmm`` of
    llmd_timeslice.cli's log format)."""
    import datetime

    line = next(x for x in log.splitlines() if marker in x)
    stamp = line.split(" level=")[0].removeprefix("ts=")
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    labels = [
        f"{r['stop']} {r['lease_duration_s']:g}/{r['renew_deadline_s']:g}/{r['retry_period_s']:g} s\n{r['samplers']} samplers"
        for r in rows
    ]
    ax.bar(range(len(rows)), [r["takeover_s_median"] for r in rows], label="takeover (median)")
    ax.plot(range(len(rows)), [r["bound_s"] for r in rows], "k_", markersize=30, label="lease + 2 x retry")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("seconds (SIGKILL -> granted)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def main(out: Path, reps: int, samplers_list: list[int], settings, stops: list[str]) -> None:
    rows = []
    for setting, samplers, stop in [(st, n, how) for how in stops for st in settings for n in samplers_list]:
        runs = []
        for _ in range(reps):
            with tempfile.TemporaryDirectory() as d:
                runs.append(await one_takeover(setting, samplers, Path(d), stop))
        lease, renew, retry = setting
        med = statistics.median(r["takeover_s"] for r in runs)
        base = statistics.median(r["baseline_acquire_yield_s"] for r in runs)
        row = {
            "stop": stop,
            "lease_duration_s": lease,
            "renew_deadline_s": renew,
            "retry_period_s": retry,
            "samplers": samplers,
            "takeover_s": [round(r["takeover_s"], 3) for r in runs],
            "leads_s": [round(r["leads_s"], 3) for r in runs],
            "serving_s": [round(r["serving_s"], 3) for r in runs],
            "refused_attempts": [r["refused_attempts"] for r in runs],
            "takeover_s_median": round(med, 3),
            "takeover_s_max": round(max(r["takeover_s"] for r in runs), 3),
            "leads_s_median": round(statistics.median(r["leads_s"] for r in runs), 3),
            "serving_s_median": round(statistics.median(r["serving_s"] for r in runs), 3),
            "bound_s": lease + 2 * retry,
            "baseline_acquire_yield_s_median": round(base, 4),
            "ratio_to_baseline": round(med / base, 1),
        }
        rows.append(row)
        print(
            f"{'SIGKILL' if stop == 'kill' else 'SIGTERM'}, lease {lease:g} s / renew {renew:g} s / retry {retry:g} s, "
            f"{samplers} samplers: takeover median "
            f"{med:.2f} s (max {row['takeover_s_max']:.2f} s, runs {row['takeover_s']}; B took the Lease at "
            f"{row['leads_s']} s, served at {row['serving_s']} s); lease+2*retry {lease + 2 * retry:g} s; "
            f"baseline acquire+yield on the live leader {base * 1000:.1f} ms ({row['ratio_to_baseline']}x)",
            flush=True,
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "takeover", "rows": rows}, indent=1))
    _plot(out.with_suffix(".png"), rows)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("takeover.json"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--samplers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--quick", action="store_true", help="only the 2/1.5/1 s setting")
    p.add_argument(
        "--stop", nargs="+", choices=["kill", "term"], default=["kill"], help="SIGKILL (node lost) and/or SIGTERM (rollout)"
    )
    a = p.parse_args()
    asyncio.run(main(a.out, a.reps, a.samplers, SETTINGS[:1] if a.quick else SETTINGS, a.stop))
