"""Chaos soak: phase switches under steady load on the local stack while a seeded schedule kills, freezes and
cuts its components; per fault kind, the requests lost, the time back to full service and every component's RSS.

    .venv/bin/python -m benchmarks.soak --chaos --switches 1000 --out chaos.json [--seed 1] [--rps 6]

The stack is ``llmd-timeslice up`` on a generated stack file (Envoy, gate on the fast path, orchestrator with its
state file, one sidecar per engine, ``--engines`` real vLLM CPU servers), run as a user runs it: its supervisor
restarts what dies. A trainer loop (acquire -> ``--train-s`` -> release) counts switches, each direction one; an
open-loop load sends ``--rps`` completions per second through the router (a third streaming), as a client that
follows the gate's retry contract: a refusal with ``x-llmd-timeslice-reason`` and ``retry-after`` is sent again
after that wait (up to 5 tries), as ``TimeSliceRollouts`` does, and a connection the router refused (nothing sent:
Envoy restarting) is retried with back-off by the HTTP client's transport. Every ``--faults-every`` switches one fault,
kinds in a seeded shuffled cycle:

* ``freeze_gate`` / ``freeze_orchestrator`` / ``freeze_sidecar``: SIGSTOP for ``--freeze-s`` (10 s: past the gate's
  ``stale_after_s`` of 5 s, the drain and ack deadlines), then SIGCONT;
* ``kill_gate`` / ``kill_orchestrator`` / ``kill_sidecar`` / ``kill_vllm`` / ``kill_envoy``: SIGKILL (the stack
  restarts it);
* ``cut_orchestrator_gate`` / ``cut_orchestrator_sidecar``: the TCP connections between the two reset
  (``ss -K``; black holes are tests/faults/test_gate_partition.py's).

After each fault, "full service" is the first moment when every component is ready again, a probe request through
the router is answered 200 and the trainer has completed another switch in each direction; the fault heals within
its bound (``--heal-bound-s``, longer for a killed vLLM, which restarts in ~25 s) or is reported not healed. A failed
request (after the retries above) counts against the fault whose window (the fault's start - 1 s to its heal + 1 s)
holds its send time; it is *documented* when the docs say it can be lost: in flight inside a killed Envoy, or
already sent to a killed vLLM (docs/faults.md). Everything else is *undocumented*. RSS: each component's growth
over the longest life of one of its processes, after that life's first ``--warmup`` fraction. Writes JSON, a PNG
(RSS over switches with the faults marked; time to full service per fault) and a text summary beside ``--out``.
Targets: zero undocumented losses, every fault healed within its bound, RSS growth < 5 %.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.report import rss_kib, write_summary

FAULT_KINDS = (
    "freeze_gate",
    "freeze_orchestrator",
    "freeze_sidecar",
    "kill_gate",
    "kill_orchestrator",
    "kill_sidecar",
    "kill_vllm",
    "kill_envoy",
    "cut_orchestrator_gate",
    "cut_orchestrator_sidecar",
)
MAX_TRIES = 5


@dataclass
class Fault:
    kind: str
    at_switch: int
    target: str
    start: float  # seconds since t0
    end: float = 0.0  # the fault's action done (SIGCONT sent, the kill or cut done)
    healed: float | None = None
    lost_documented: int = 0
    lost_undocumented: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def heal_s(self) -> float | None:
        return None if self.healed is None else self.healed - self.end


def _free_ports(n: int) -> list[int]:
    import port_for

    ports: set[int] = set()
    while len(ports) < n:
        ports.add(port_for.select_random())
    return sorted(ports)


def _stack_file(work: Path, n_engines: int) -> tuple[Path, dict]:
    names = ["router", "router_admin", "gate_ext_proc", "gate_authz", "gate_control", "gate_metrics", "picker"]
    names += ["orchestrator", "orchestrator_metrics"]
    ports = _free_ports(len(names) + 2 * n_engines)
    stack_ports = dict(zip(names, ports, strict=False))
    rest = ports[len(names) :]
    engines = [
        {
            "name": f"sampler-{i}",
            "group": "chaos-group",
            "sidecar_port": rest[2 * i],
            "vllm": {"model": "builtin:tiny-llama", "port": rest[2 * i + 1]},
        }
        for i in range(n_engines)
    ]
    token = work / "token"
    token.write_text(secrets.token_urlsafe(24))
    token.chmod(0o600)
    doc = {
        "stack": {
            "name": "chaos",
            "workdir": str(work / "stack"),
            "token_file": str(token),
            "max_hold_s": 120,
            "generation_timeout_s": 600,
            "log_level": "warning",
            "ports": stack_ports,
        },
        "pools": [{"name": "default"}],
        "groups": [{"group_id": "chaos-group", "sleep_level": 1, "drain_timeout_s": 5, "lease_ttl_s": 30}],
        "engines": engines,
    }
    import yaml

    path = work / "stack.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, doc


class Stack:
    """``llmd-timeslice up -f FILE`` as a child process; components read from its ``stack.json``."""

    def __init__(self, path: Path, doc: dict, log: Path) -> None:
        self.path, self.doc, self.log = path, doc, log
        self.workdir = Path(doc["stack"]["workdir"])
        self.proc: subprocess.Popen | None = None
        p = doc["stack"]["ports"]
        self.router = f"http://127.0.0.1:{p['router']}"
        self.orchestrator = f"127.0.0.1:{p['orchestrator']}"
        self.orchestrator_port = p["orchestrator"]
        self.token = Path(doc["stack"]["token_file"]).read_text().strip()
        self.sidecar_ports = {f"sidecar-{e['name']}": e["sidecar_port"] for e in doc["engines"]}

    def state(self) -> dict:
        try:
            return json.loads((self.workdir / "stack.json").read_text())
        except (OSError, ValueError):
            return {}

    def components(self) -> dict[str, dict]:
        return {c["name"]: c for c in self.state().get("components", [])}

    def pid(self, name: str) -> int | None:
        return self.components().get(name, {}).get("pid")

    def all_ready(self) -> bool:
        comps = self.components()
        return bool(comps) and all(c.get("state") == "ready" and c.get("pid") for c in comps.values())

    async def start(self, timeout_s: float = 600.0) -> None:
        cmd = [sys.executable, "-m", "llmd_timeslice.cli", "up", "-f", str(self.path)]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`llmd-timeslice up` exited with {self.proc.returncode}; see {self.log}")
            if self.state().get("phase") == "running" and self.all_ready():
                return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the stack did not start within {timeout_s:g} s; see {self.log}")

    def stop(self) -> None:
        down = [sys.executable, "-m", "llmd_timeslice.cli", "down", "-f", str(self.path)]
        subprocess.run(down, capture_output=True, timeout=120)
        if self.proc is not None:
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _sample(stack: Stack, switches: int, t: float) -> dict:
    """Each component's pid and RSS (KiB) now."""
    return {"switches": switches, "t": t, **{n: [c.get("pid"), rss_kib(c.get("pid"))] for n, c in stack.components().items()}}


def _peers(pid: int | None) -> list[str]:
    """``local port -> remote port (status)`` of every TCP connection of ``pid`` (for a cut that found nothing)."""
    import psutil

    try:
        return [
            f"{c.laddr.port}->{c.raddr.port if c.raddr else '-'} {c.status}" for c in psutil.Process(pid).net_connections("tcp")
        ]
    except (psutil.Error, ValueError):
        return []


def _cut(local_pid: int | None, remote_port: int) -> int:
    """Reset every TCP connection of ``local_pid`` to ``remote_port`` (``ss -K``); returns how many."""
    import psutil

    if not local_pid:
        return 0
    n = 0
    try:
        conns = psutil.Process(local_pid).net_connections(kind="tcp")
    except psutil.Error:
        return 0
    for c in conns:
        if c.raddr and c.raddr.port == remote_port and c.status == psutil.CONN_ESTABLISHED:
            # By ports only: a gRPC socket may be IPv6 dual-stack (::ffff:127.0.0.1), which an IPv4 src filter misses.
            r = subprocess.run(
                ["ss", "-K", "sport", "=", f":{c.laddr.port}", "dport", "=", f":{remote_port}"], capture_output=True, text=True
            )
            n += max(0, len(r.stdout.strip().splitlines()) - 1)  # the rows ss killed, under its header
    return n


class RetryingLoad:
    """Open-loop completions through the router; a gate refusal with a reason and ``retry-after`` is retried."""

    def __init__(self, url: str, model: str, rps: float, t0: float) -> None:
        self.url, self.model, self.rps, self.t0 = url, model, rps, t0
        self.records: list = []  # RequestRecord, with .tries set
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()

    async def _one(self, client, i: int) -> None:
        from llmd_timeslice.demo.loadgen import PROMPTS, send_completion

        first_sent, attempt = None, 0
        while attempt < MAX_TRIES:
            attempt += 1
            rec = await send_completion(
                client, self.url, self.model, PROMPTS[i % len(PROMPTS)], stream=i % 3 == 0, kind="load", t0=self.t0, max_tokens=4
            )
            first_sent = rec.sent_at if first_sent is None else first_sent
            if rec.ok or not (rec.status in (429, 503) and rec.reason and rec.retry_after_s is not None):
                break
            await asyncio.sleep(min(rec.retry_after_s, 5.0))
        rec.sent_at = first_sent
        rec.tries = attempt  # type: ignore[attr-defined]
        self.records.append(rec)

    async def run(self, client) -> None:
        i, next_at = 0, time.monotonic()
        while not self._stop.is_set():
            t = asyncio.create_task(self._one(client, i))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
            i += 1
            next_at += 1 / self.rps
            try:
                await asyncio.wait_for(self._stop.wait(), max(0.0, next_at - time.monotonic()))
            except TimeoutError:
                pass

    async def stop(self, timeout_s: float = 180.0) -> None:
        self._stop.set()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)


async def _probe(client, url: str, model: str) -> bool:
    import httpx

    try:
        r = await client.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1}, timeout=5)
        return r.status_code == 200
    except httpx.HTTPError:
        return False


async def _run(a, out: Path, progress) -> dict:
    import httpx

    from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
    from llmd_timeslice.engines.vllm_server import SERVED_MODEL_NAME

    work = out.parent / "chaos-work"
    work.mkdir(parents=True, exist_ok=True)
    path, doc = _stack_file(work, a.engines)
    stack = Stack(path, doc, work / "up.log")
    rng = random.Random(a.seed)
    kinds = [k for k in FAULT_KINDS if k in a.kinds]
    cycle: list[str] = []
    progress("starting the stack (llmd-timeslice up: vLLM servers, sidecars, orchestrator, gate, Envoy) ...")
    await stack.start()
    t0 = time.monotonic()

    def now() -> float:
        return time.monotonic() - t0

    faults: list[Fault] = []
    samples: list[dict] = []
    switch_errors: list[str] = []
    done = 0
    client = AsyncTimeSliceOrchestratorClient(
        stack.orchestrator, job_id="chaos-trainer", group_id="chaos-group", token=stack.token
    )
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=50)
    # Connection failures (nothing sent: the router restarting) are retried by the transport with back-off, as any
    # client of a restarting proxy should; httpx retries only those.
    transport = httpx.AsyncHTTPTransport(retries=6, limits=limits)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(180, connect=10), transport=transport) as http:
            load = RetryingLoad(stack.router, SERVED_MODEL_NAME, a.rps, t0)
            load_task = asyncio.create_task(load.run(http))

            async def heal(f: Fault) -> None:
                bound = a.heal_bound_s * (3 if f.kind == "kill_vllm" else 1)
                base = done
                while now() - f.end < bound:
                    if stack.all_ready() and done >= base + 2 and await _probe(http, stack.router, SERVED_MODEL_NAME):
                        f.healed = now()
                        return
                    await asyncio.sleep(0.25)
                f.notes.append(f"not healed within {bound:g} s")

            async def inject(kind: str, at: int) -> Fault:
                comps = stack.components()
                target = {"gate": "gate", "orchestrator": "orchestrator", "envoy": "envoy"}.get(kind.split("_", 1)[1], "")
                if kind.endswith("sidecar") and not kind.startswith("cut"):
                    target = rng.choice(sorted(n for n in comps if n.startswith("sidecar-")))
                elif kind == "kill_vllm":
                    target = rng.choice(sorted(n for n in comps if n.startswith("vllm-")))
                elif kind.startswith("cut"):
                    target = kind.removeprefix("cut_")
                f = Fault(kind, at, target, now())
                if kind.startswith("freeze"):
                    pid = stack.pid(target)
                    os.kill(pid, signal.SIGSTOP)
                    try:
                        await asyncio.sleep(a.freeze_s)
                    finally:
                        os.kill(pid, signal.SIGCONT)
                elif kind.startswith("kill"):
                    pid = stack.pid(target)
                    os.kill(pid, signal.SIGKILL)
                    f.notes.append(f"pid {pid}")
                elif kind == "cut_orchestrator_gate":
                    n = _cut(stack.pid("gate"), stack.orchestrator_port)
                    f.notes.append(f"{n} connection(s) reset" + ("" if n else f"; the gate's: {_peers(stack.pid('gate'))}"))
                else:
                    side = rng.choice(sorted(stack.sidecar_ports))
                    n = _cut(stack.pid("orchestrator"), stack.sidecar_ports[side])
                    f.notes.append(
                        f"{n} connection(s) to {side} reset"
                        + ("" if n else f"; the orchestrator's: {_peers(stack.pid('orchestrator'))}")
                    )
                f.end = now()
                await heal(f)
                return f

            fault_task: asyncio.Task | None = None
            next_fault = a.faults_every
            await asyncio.sleep(2.0)
            while done < a.switches:
                if done % a.sample_every == 0 and (not samples or samples[-1]["switches"] != done):
                    samples.append(_sample(stack, done, now()))
                    lost = sum(not r.ok for r in load.records)
                    progress(f"{done}/{a.switches} switches, {len(faults)} faults, {len(load.records)} requests, {lost} failed")
                if fault_task is None and done >= next_fault and kinds:
                    if not cycle:
                        cycle = kinds[:]
                        rng.shuffle(cycle)
                    fault_task = asyncio.create_task(inject(cycle.pop(), done))
                if fault_task is not None and fault_task.done():
                    faults.append(fault_task.result())
                    fault_task = None
                    next_fault = done + a.faults_every
                try:
                    await client.acquire(timeout_sec=120)
                except Exception as exc:  # a fault cut the switch: recorded, tried again
                    switch_errors.append(f"{now():.1f}s acquire: {type(exc).__name__}: {str(exc)[:160]}")
                    await asyncio.sleep(1.0)
                    continue
                await asyncio.sleep(a.train_s)
                try:
                    await client.release()
                except Exception as exc:
                    switch_errors.append(f"{now():.1f}s release: {type(exc).__name__}: {str(exc)[:160]}")
                done += 2
                await asyncio.sleep(a.train_s)
            if fault_task is not None:
                faults.append(await fault_task)
            samples.append(_sample(stack, done, now()))
            progress("waiting for the last requests ...")
            await load.stop()
            await load_task
    finally:
        await client.close()
        progress("stopping the stack ...")
        await asyncio.to_thread(stack.stop)
    return {"faults": faults, "records": load.records, "samples": samples, "switch_errors": switch_errors, "wall_s": now()}


def _attribute(faults: list[Fault], records: list) -> list:
    """Charge each failed request to the fault whose window holds its send time; returns the unattributed ones."""
    outside = []
    for r in records:
        if r.ok:
            continue
        f = next((f for f in faults if f.start - 1 <= r.sent_at <= (f.healed or f.end + 60) + 1), None)
        if f is None:
            outside.append(r)
            continue
        # In flight at the kill: sent before it (0.5 s of slack: a connection the dying process's kernel backlog
        # took just before SIGKILL, whose send time is read before the request goes out) and ended after it; a
        # refused connection is retried by the load's transport, so what fails here was inside the killed process.
        in_flight_at_kill = r.sent_at <= f.end + 0.5 and r.done_at >= f.start - 0.05
        if f.kind in ("kill_envoy", "kill_vllm") and in_flight_at_kill:
            f.lost_documented += 1
        else:
            f.lost_undocumented += 1
    return outside


def _growth(samples: list[dict], warmup: float) -> dict[str, dict]:
    """Per component: RSS growth (%) over the longest life of one of its processes, after its warm-up."""
    out: dict[str, dict] = {}
    names = sorted({k for s in samples for k in s if k not in ("switches", "t")})
    for n in names:
        lives: dict[int, list[tuple[int, int]]] = {}
        for s in samples:
            pid, rss = (s.get(n) or [None, None])[:2]
            if pid and rss:
                lives.setdefault(pid, []).append((s["switches"], rss))
        if not lives:
            continue
        life = max(lives.values(), key=len)
        if len(life) < 4:
            out[n] = {"growth_pct": None, "over_switches": 0, "processes": len(lives)}
            continue
        w = max(1, round(len(life) * warmup))
        base = life[w][1]
        tail = [rss for _, rss in life[max(w + 1, len(life) - max(1, len(life) // 10)) :]] or [life[-1][1]]
        out[n] = {
            "growth_pct": round((statistics.mean(tail) - base) / base * 100, 2),
            "over_switches": life[-1][0] - life[w][0],
            "processes": len(lives),
        }
    return out


def _plot(path: Path, samples: list[dict], faults: list[Fault]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 7))
    names = sorted({k for s in samples for k in s if k not in ("switches", "t")})
    for n in names:
        pts = [(s["switches"], s[n][1] / 1024) for s in samples if s.get(n) and s[n][1]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=n, lw=1)
    for f in faults:
        ax.axvline(f.at_switch, color="red" if f.lost_undocumented or f.healed is None else "grey", lw=0.5, alpha=0.6)
    ax.set_xlabel("phase switches (vertical lines: faults; red: not healed or undocumented loss)")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title("chaos soak: component RSS")
    ax.legend(fontsize=6, ncol=3)
    kinds = sorted({f.kind for f in faults})
    for i, k in enumerate(kinds):
        ys = [f.heal_s for f in faults if f.kind == k and f.heal_s is not None]
        bx.scatter([i] * len(ys), ys, s=14)
    bx.set_xticks(range(len(kinds)), kinds, rotation=30, ha="right", fontsize=7)
    bx.set_ylabel("time to full service (s)")
    bx.set_title("per fault: from the fault's end to full service")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak --chaos", description=__doc__.split("\n")[0])
    ap.add_argument("--switches", type=int, default=1000, help="phase switches (each direction counts one)")
    ap.add_argument("--out", type=Path, required=True, help="JSON output (PNG and .txt written beside it)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the fault schedule")
    ap.add_argument("--rps", type=float, default=6.0, help="steady load, completions per second through the router")
    ap.add_argument("--engines", type=int, default=2, help="real vLLM CPU servers in the group")
    ap.add_argument("--train-s", type=float, default=0.2, help="seconds in each phase (training, then rollout)")
    ap.add_argument("--faults-every", type=int, default=40, help="switches between the end of one fault and the next")
    ap.add_argument("--freeze-s", type=float, default=10.0, help="how long a freeze lasts (SIGSTOP to SIGCONT), seconds")
    ap.add_argument("--heal-bound-s", type=float, default=30.0, help="time to full service allowed per fault (x3 for kill_vllm)")
    ap.add_argument("--kinds", default=",".join(FAULT_KINDS), help="comma-separated fault kinds to schedule")
    ap.add_argument("--sample-every", type=int, default=20, help="read RSS every this many switches")
    ap.add_argument("--warmup", type=float, default=0.3, help="fraction of a process's life counted as warm-up")
    a = ap.parse_args(argv)
    a.kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    unknown = sorted(set(a.kinds) - set(FAULT_KINDS))
    if unknown:
        ap.error(f"unknown fault kind(s) {unknown}; known: {', '.join(FAULT_KINDS)}")
    from rich.console import Console

    console = Console()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with console.status("chaos soak ...") as st:
        r = asyncio.run(_run(a, a.out, st.update))
    faults, records = r["faults"], r["records"]
    outside = _attribute(faults, records)
    growth = _growth(r["samples"], a.warmup)
    by_kind = {}
    for k in sorted({f.kind for f in faults}):
        fs = [f for f in faults if f.kind == k]
        heals = [f.heal_s for f in fs if f.heal_s is not None]
        by_kind[k] = {
            "count": len(fs),
            "healed": sum(f.healed is not None for f in fs),
            "heal_s_max": round(max(heals), 2) if heals else None,
            "heal_s_median": round(statistics.median(heals), 2) if heals else None,
            "lost_documented": sum(f.lost_documented for f in fs),
            "lost_undocumented": sum(f.lost_undocumented for f in fs),
        }
    grown = [g["growth_pct"] for g in growth.values() if g["growth_pct"] is not None]
    res = {
        "switches": r["samples"][-1]["switches"] if r["samples"] else 0,
        "wall_s": round(r["wall_s"], 1),
        "seed": a.seed,
        "rps": a.rps,
        "engines": a.engines,
        "freeze_s": a.freeze_s,
        "requests_sent": len(records),
        "requests_completed": sum(x.ok for x in records),
        "requests_retried": sum(getattr(x, "tries", 1) > 1 for x in records),
        "requests_failed": sum(not x.ok for x in records),
        "lost_outside_fault_windows": len(outside),
        "lost_undocumented": sum(f.lost_undocumented for f in faults) + len(outside),
        "faults": len(faults),
        "faults_healed": sum(f.healed is not None for f in faults),
        "by_kind": by_kind,
        "rss_growth_pct_max": max(grown) if grown else None,
        "rss_by_component": growth,
        "switch_errors": r["switch_errors"][:50],
        "fault_log": [
            {
                "kind": f.kind,
                "target": f.target,
                "at_switch": f.at_switch,
                "start_s": round(f.start, 2),
                "heal_s": None if f.heal_s is None else round(f.heal_s, 2),
                "lost_documented": f.lost_documented,
                "lost_undocumented": f.lost_undocumented,
                "notes": f.notes,
            }
            for f in faults
        ],
        "failures": [f"{x.sent_at:.1f}s (tries {getattr(x, 'tries', 1)}): {x.error[:160]}" for x in records if not x.ok][:40],
        "targets": {"lost_undocumented": 0, "faults_healed": "all", "rss_growth_pct_max": "< 5"},
        "rss_samples": r["samples"],
    }
    a.out.write_text(json.dumps(res, indent=1))
    _plot(a.out.with_suffix(".png"), r["samples"], faults)
    lines = [
        f"chaos soak: {res['switches']} phase switches in {res['wall_s']} s, {res['faults']} faults (seed {a.seed}), "
        f"{a.engines} real vLLM, load {a.rps} rps",
        f"requests: sent {res['requests_sent']}, completed {res['requests_completed']}, failed {res['requests_failed']} "
        f"(retried {res['requests_retried']}); lost outside the documented windows: {res['lost_undocumented']} (target 0)",
        f"faults healed: {res['faults_healed']}/{res['faults']} (target all)",
    ]
    for k, v in by_kind.items():
        lines.append(
            f"  {k:26s} x{v['count']}: healed {v['healed']}, time to full service median {v['heal_s_median']} s, "
            f"max {v['heal_s_max']} s; lost {v['lost_documented']} documented, {v['lost_undocumented']} undocumented"
        )
    lines.append(
        "rss growth (%): "
        + ", ".join(f"{n} {g['growth_pct']:+.1f}" for n, g in sorted(growth.items()) if g["growth_pct"] is not None)
        + (f"; max {res['rss_growth_pct_max']:+.1f} (target < 5)" if grown else "")
    )
    write_summary(a.out, lines)
    ok = res["lost_undocumented"] == 0 and res["faults_healed"] == res["faults"] and (not grown or max(grown) < 5)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
