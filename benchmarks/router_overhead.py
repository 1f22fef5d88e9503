"""What the gate costs on the request path, for both of its edges, in one run.

Chains, each a real Envoy with one worker (``--concurrency 1``) in front of a fast upstream (a third Envoy
answering with a direct response); the gate and the picker (EPP) are real processes started by the CLI, one gate
serving every gate chain:

* ``picker_only``: Envoy -> picker -> upstream (the chain without the gate, baseline of the next two);
* ``ext_authz``: Envoy -> gate (HTTP ext_authz, completions over the gRPC access log) -> picker -> upstream:
  **the default edge** (the rendered configs and the Kubernetes guide's Envoy variants);
* ``ext_proc``: Envoy -> gate (ext_proc) -> picker -> upstream;
* ``direct``: Envoy -> upstream (no filter; baseline of the next two);
* ``ext_authz_pick``: Envoy -> gate (ext_authz, the gate picks the endpoint) -> upstream: the local stack;
* ``authz_floor`` and ``authz_floor_epp``: the same two chains with, instead of the gate, a Python ext_authz
  server that only answers (``benchmarks.authz_floor``: same HTTP stack, no gate logic, no access log): what any
  Python ext_authz costs on this machine at the same request rates, to read the gate's own share off.

Figures, per edge under ``edges`` (``ext_authz``, ``ext_proc`` against ``picker_only``; ``ext_authz_pick``
against ``direct``) and at the top level for the default edge:

* ``gate_added_p50_ms`` / ``gate_added_p99_ms``: latency added by the gate, one connection (``wrk -t1 -c1``),
  against its baseline chain (medians over rounds);
* ``gate_cpu_us_per_request``: CPU time (user + system) of the gate process per request at 8 connections
  (``gate_cpu_us_per_request_1c``: at one);
* ``throughput_ratio``: requests per second at saturation (``wrk -c32``) against the baseline chain;
* ``held_request_bytes``: gate resident memory per held request (2,000 held);
* ``release_1000_ms``: from publishing SERVING on the state stream until the gate reports none of 1,000 held requests left
  in its queue (status polled every 2 ms); ``release_1000_all_responses_ms``: until the last response (the
  Python client, 1,000 connections in one process, dominates it);
* ``access_log_entries_per_message`` (fast path, 8 connections): how well Envoy batched the access log;
* ``drain_barrier_ms``: from the moment the client has the last byte of a streaming response to the moment the
  gate's drain barrier (a drain query on the state stream) reports the endpoint drained; median of 10 (and max).

    .venv/bin/python -m benchmarks.router_overhead --out /tmp/router/router_overhead.json

Writes that JSON, a plain-text summary beside it (``.txt``) and a PNG (``.png``). Needs ``wrk`` (Debian
package ``wrk``; ``make bench-deps`` installs it). About 6 minutes with the defaults (``--rounds 3 --seconds 4``):
each round runs every chain in turn, and each figure is the median over rounds (CPU: total over rounds), so a
shared machine's drifting background load hits every chain alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import httpx
import port_for
import psutil

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2_grpc as gpb_grpc
from llmd_timeslice.local.commands import GateCommand, PickerCommand
from llmd_timeslice.router.envoy_config import EnvoyRouterConfig
from llmd_timeslice.router.envoy_launcher import EnvoyProcess, envoy_binary
from tests.support.cli import CliProcess
from tests.support.state_stream import StatePublisher

DEFAULT_EDGE = "ext_authz"
BASELINE = {
    "ext_authz": "picker_only",
    "ext_proc": "picker_only",
    "authz_floor_epp": "picker_only",
    "ext_authz_pick": "direct",
    "authz_floor": "direct",
}
TARGETS = {
    "gate_cpu_us_per_request": 50.0,
    "gate_added_p50_ms": 0.1,
    "gate_added_p99_ms": 0.5,
    "held_request_bytes": 8 * 1024,
    "release_1000_ms": 100.0,
    "drain_barrier_ms": 50.0,
}
TARGETS_AT_LEAST = {"throughput_ratio": 0.8}
TOKEN = "bench"
_MD = (("authorization", f"Bearer {TOKEN}"),)
_ENVOY = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def _envoy_bootstrap(port: int, admin: int, route: dict, clusters: list) -> dict:
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": _ENVOY,
                                        "stat_prefix": "b",
                                        "route_config": {
                                            "virtual_hosts": [
                                                {"name": "a", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, **route}]}
                                            ]
                                        },
                                        "http_filters": [
                                            {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}
                                        ],
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


class PlainEnvoy:
    """An Envoy from a hand-written bootstrap: the fast upstream (direct response) or the ``direct`` chain."""

    def __init__(self, workdir: Path, name: str, route: dict, clusters: list | None = None) -> None:
        self.port, self.admin = port_for.select_random(), port_for.select_random()
        self.config = workdir / f"{name}.json"
        self.config.write_text(json.dumps(_envoy_bootstrap(self.port, self.admin, route, clusters or [])))
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def start(self) -> PlainEnvoy:
        self.proc = subprocess.Popen(
            [
                str(envoy_binary()),
                "-c",
                str(self.config),
                "--concurrency",
                "1",
                "--use-dynamic-base-id",
                "--log-level",
                "error",
                "--disable-hot-restart",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(200):
            try:
                if httpx.get(f"http://127.0.0.1:{self.admin}/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"envoy {self.config} did not start")

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(10)


class _Streaming(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(5):
            data = f"data: {i}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
            time.sleep(0.02)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def wrk(url: str, connections: int, seconds: float) -> dict:
    """Run wrk; returns requests/s, request count and latency percentiles in ms."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, int(seconds))}s", "--latency", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    unit = {"us": 1e-3, "ms": 1.0, "s": 1000.0}

    def lat(p: str) -> float:
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        return float(m.group(1)) * unit[m.group(2)]

    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "requests": int(re.search(r"(\d+) requests in", out).group(1)),
        "p50_ms": lat(50),
        "p99_ms": lat(99),
        "non_2xx": int(errors.group(1)) if errors else 0,
    }


def _started(proc: CliProcess) -> CliProcess:
    """``proc`` started, once it listens (its log named if it does not within 60 s)."""
    asyncio.run(proc.start())
    return proc


class Gate:
    """The gate process, subscribed to the state stream of a :class:`StatePublisher` (the orchestrator's hub, the one
    writer of its endpoint states), and a control-API stub for its read-only status."""

    def __init__(self, workdir: Path) -> None:
        self.grpc_port, self.authz_port, self.control_port, self.metrics_port = (port_for.select_random() for _ in range(4))
        (workdir / "token").write_text(TOKEN)
        self.publisher = StatePublisher()
        self.published: dict[str, int] = {}  # address -> the last state published
        cmd = GateCommand(
            ext_proc_port=self.grpc_port,
            authz_port=self.authz_port,
            control_port=self.control_port,
            metrics_port=self.metrics_port,
            token_file=workdir / "token",
            max_held=5000,
            orchestrator=self.publisher.target,
        )
        self.proc = _started(CliProcess(cmd.args(), self.control_port, workdir / "gate.log"))
        self.publisher.wait_gates(1)
        self.ps = psutil.Process(self.proc.proc.pid)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.control_port}")
        self.stub = gpb_grpc.GateControlServiceStub(self.channel)

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def set_states(self, states: dict[str, int]) -> None:
        """Publish the states on the state stream; returns once the gate acked them (applied). An endpoint put into
        service from another state than WAKING is published WAKING first, as the orchestrator's resume does (the
        gate's endpoint table: epp_plugin/gate/endpoints.py)."""
        serving, waking = gpb.ENDPOINT_STATE_SERVING, gpb.ENDPOINT_STATE_WAKING
        wake = {a: waking for a, s in states.items() if s == serving and self.published.get(a, waking) not in (serving, waking)}
        if wake:
            self.publisher.publish("default", wake)
        self.publisher.publish("default", states)
        self.published.update(states)

    def access_log_counts(self) -> tuple[float, float]:
        """(messages, entries) received on the access-log stream so far, from the gate's /metrics."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

        def value(name: str) -> float:
            m = re.search(rf"^{name} ([\d.e+]+)$", text, re.M)
            return float(m.group(1)) if m else 0.0

        return value("llmd_timeslice_gate_access_log_messages_total"), value("llmd_timeslice_gate_access_log_entries_total")

    def held(self) -> int:
        return self.stub.GetPoolStatus(gpb.GetPoolStatusRequest(pool="default"), timeout=5, metadata=_MD).held

    def wait_drained(self, address: str, timeout_s: float) -> bool:
        return self.publisher.wait_drained("default", [address], timeout_s)[0]

    def stop(self) -> None:
        self.channel.close()
        self.proc.stop()
        self.publisher.stop()


async def _hold(url: str, n: int, ready) -> list:
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        tasks = [asyncio.create_task(c.get(url)) for _ in range(n)]
        await ready(tasks)
        return await asyncio.gather(*tasks, return_exceptions=True)


def measure_holds(gate: Gate, url: str, fast: str) -> dict:
    """Memory per held request (2,000 held) and the release of 1,000, through one chain."""
    out: dict = {}
    asleep, serving = gpb.ENDPOINT_STATE_ASLEEP, gpb.ENDPOINT_STATE_SERVING
    gate.set_states({fast: asleep})
    rss0 = gate.ps.memory_info().rss

    async def memory(tasks, n=2000):
        while gate.held() < n:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        out["held_request_bytes"] = (gate.ps.memory_info().rss - rss0) / n
        gate.set_states({fast: serving})

    asyncio.run(_hold(url, 2000, memory))
    time.sleep(1.0)
    gate.set_states({fast: asleep})

    async def release(tasks, n=1000):
        while gate.held() < n:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)
        gate.set_states({fast: gpb.ENDPOINT_STATE_WAKING})  # the resume's first step, outside the timed release
        t0 = time.perf_counter()
        gate.set_states({fast: serving})
        while gate.held() > 0:
            time.sleep(0.002)  # each poll is a gRPC call the gate answers: polling harder slows what it measures
        out["release_1000_ms"] = (time.perf_counter() - t0) * 1000
        await asyncio.gather(*tasks, return_exceptions=True)
        out["release_1000_all_responses_ms"] = (time.perf_counter() - t0) * 1000

    rs = asyncio.run(_hold(url, 1000, release))
    out["release_1000_ok"] = sum(1 for r in rs if getattr(r, "status_code", 0) == 200)
    time.sleep(1.0)
    return out


def measure_drain(gate: Gate, url: str, fast: str, slow: str, trials: int = 10) -> dict:
    """Drain barrier latency after the last byte of a streaming response, ``trials`` times."""
    serving, draining, asleep = gpb.ENDPOINT_STATE_SERVING, gpb.ENDPOINT_STATE_DRAINING, gpb.ENDPOINT_STATE_ASLEEP
    lat = []
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=10) as c:
        for _ in range(trials):
            gate.set_states({slow: serving, fast: asleep})
            with c.stream("GET", url + "/v1/stream") as r:
                it = r.iter_bytes()
                next(it)
                gate.set_states({slow: draining})
                waiter = pool.submit(gate.wait_drained, slow, 10.0)
                time.sleep(0.005)
                for _ in it:
                    pass
                t_end = time.perf_counter()
            assert waiter.result(15), "the drain barrier did not pass"
            lat.append((time.perf_counter() - t_end) * 1000)
            time.sleep(0.05)
    gate.set_states({fast: serving, slow: asleep})
    return {"drain_barrier_ms": statistics.median(lat), "drain_barrier_max_ms": max(lat), "drain_barrier_trials_ms": lat}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = list(result["edges"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, label, target in (
        (axes[0], "gate_cpu_us_per_request", "gate CPU per request, 8 connections (µs)", TARGETS["gate_cpu_us_per_request"]),
        (axes[1], "gate_added_p50_ms", "added latency p50, 1 connection (ms)", TARGETS["gate_added_p50_ms"]),
        (axes[2], "drain_barrier_ms", "drain barrier after the last byte (ms)", TARGETS["drain_barrier_ms"]),
    ):
        shown = [e for e in edges if key in result["edges"][e]]
        vals = [result["edges"][e][key] for e in shown]
        ax.bar(shown, vals, color=["tab:green" if v <= target else "tab:red" for v in vals])
        if key == "gate_cpu_us_per_request":
            ax.set_yscale("log")
        ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target:g}")
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("llmd-timeslice gate: both edges, one run (Envoy 1 worker, this machine)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(result: dict) -> str:
    lines = [
        f"router overhead, {time.strftime('%Y-%m-%d %H:%M')}, Envoy 1 worker, {result['rounds']} rounds of wrk "
        f"{result['wrk_seconds']:g} s per chain and load (medians)",
        f"default edge: {DEFAULT_EDGE} (top-level figures)",
        "",
    ]
    keys = [
        "gate_cpu_us_per_request",
        "gate_cpu_us_per_request_1c",
        "gate_added_p50_ms",
        "gate_added_p99_ms",
        "throughput_ratio",
        "held_request_bytes",
        "release_1000_ms",
        "release_1000_all_responses_ms",
        "drain_barrier_ms",
        "drain_barrier_max_ms",
        "access_log_entries_per_message",
    ]
    header = f"{'figure':34s}" + "".join(f"{e:>16s}" for e in result["edges"]) + "   target"
    lines.append(header)
    for k in keys:
        row = f"{k:34s}"
        for e in result["edges"].values():
            v = e.get(k)
            row += f"{v:16.3f}" if isinstance(v, int | float) else f"{'-':>16s}"
        if k in TARGETS:
            row += f"   <= {TARGETS[k]:g}"
        elif k in TARGETS_AT_LEAST:
            row += f"   >= {TARGETS_AT_LEAST[k]:g}"
        lines.append(row)
    lines.append("")
    for name, c in result["chains"].items():
        one, eight, sat = c["one_connection"], c["eight_connections"], c["saturation"]
        lines.append(
            f"chain {name:15s} 1 conn p50 {one['p50_ms']:.3f} ms p99 {one['p99_ms']:.3f} ms; 8 conns "
            f"{eight['rps']:.0f} rps; 32 conns {sat['rps']:.0f} rps"
        )
    lines.append("")
    lines.append(
        "meets targets (default edge): " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in result["meets_targets"].items())
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write (.txt and .png beside it).")
    ap.add_argument("--seconds", type=float, default=4.0, help="Duration of each wrk run.")
    ap.add_argument("--rounds", type=int, default=3, help="Rounds over every chain (medians per chain are reported).")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: install it (Debian package 'wrk', or `make bench-deps`)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    upstream = PlainEnvoy(work, "upstream", {"direct_response": {"status": 200, "body": {"inline_string": '{"ok":true}'}}})
    upstream.start()
    streaming = ThreadingHTTPServer(("127.0.0.1", 0), _Streaming)
    streaming.daemon_threads = True
    threading.Thread(target=streaming.serve_forever, daemon=True).start()
    fast, slow = upstream.address, f"127.0.0.1:{streaming.server_address[1]}"
    gate = Gate(work)
    # Two pickers (same code): the baseline's knows only the fast upstream (with no subset hint it would round-robin
    # onto the streaming one); the gate chains' knows both, the gate's hint choosing (the drain measurement uses it).
    base_port, picker_port = port_for.select_random(), port_for.select_random()
    pickers = [
        _started(
            CliProcess(
                PickerCommand(port=base_port, endpoints=[("default", fast)]).args(), base_port, work / "picker-baseline.log"
            )
        ),
        _started(
            CliProcess(
                PickerCommand(port=picker_port, endpoints=[("default", fast), ("default", slow)]).args(),
                picker_port,
                work / "picker.log",
            )
        ),
    ]

    def router(gate_port, epp_port, edge="ext_authz") -> EnvoyProcess:
        return EnvoyProcess(
            EnvoyRouterConfig(
                port_for.select_random(),
                port_for.select_random(),
                gate_port,
                epp_port,
                gate_edge=edge,
                authz_port=gate.authz_port,
            ),
            work,
        ).start()

    chains = {
        "picker_only": router(None, base_port),
        "ext_authz": router(gate.grpc_port, picker_port),
        "ext_proc": router(gate.grpc_port, picker_port, "ext_proc"),
        "direct": PlainEnvoy(
            work,
            "direct",
            {"route": {"cluster": "up"}},
            [
                {
                    "name": "up",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "load_assignment": {
                        "cluster_name": "up",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {"socket_address": {"address": "127.0.0.1", "port_value": upstream.port}}
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
            ],
        ).start(),
        "ext_authz_pick": router(gate.grpc_port, None),
    }
    floors = {}
    for name, epp, mode in (("authz_floor_epp", picker_port, ["hint"]), ("authz_floor", None, [])):
        port = port_for.select_random()
        floors[name] = subprocess.Popen([sys.executable, "-m", "benchmarks.authz_floor", str(port), fast, *mode])
        # The floor's Envoy has the fast path's shape; its access log goes to a closed port (Envoy drops the entries).
        chains[name] = EnvoyProcess(
            EnvoyRouterConfig(port_for.select_random(), port_for.select_random(), port_for.select_random(), epp, authz_port=port),
            work,
        ).start()
    floor_ps = {name: psutil.Process(f.pid) for name, f in floors.items()}
    result: dict = {
        "measured_here": True,
        "envoy_concurrency": 1,
        "wrk_seconds": args.seconds,
        "rounds": args.rounds,
        "default_edge": DEFAULT_EDGE,
        "chains": {},
        "edges": {},
    }
    try:
        gate.set_states({fast: gpb.ENDPOINT_STATE_SERVING, slow: gpb.ENDPOINT_STATE_ASLEEP})
        for env in chains.values():
            wrk(env.url + "/v1/completions", 8, 2)  # warm-up
        cpu: dict = {}
        per_message: dict = {}
        # Rounds, each running every chain in turn: the background load of a shared machine drifts over minutes,
        # so chains measured side by side in each round, then the median per chain, compare like with like.
        runs: dict = {name: {"one_connection": [], "eight_connections": [], "saturation": []} for name in chains}
        spent: dict = {name: [0.0, 0, 0.0, 0, 0.0, 0.0] for name in chains}  # cpu 1c, requests 1c, cpu 8c, requests 8c,
        for rnd in range(args.rounds):  # access-log messages, entries (8c)
            for name, env in chains.items():
                server_cpu = (lambda n=name: sum(floor_ps[n].cpu_times()[:2])) if name in floor_ps else gate.cpu_s
                c0 = server_cpu()
                one = wrk(env.url + "/v1/completions", 1, args.seconds)
                c1, (m1, e1) = server_cpu(), gate.access_log_counts()
                eight = wrk(env.url + "/v1/completions", 8, args.seconds)
                c2, (m2, e2) = server_cpu(), gate.access_log_counts()
                sat = wrk(env.url + "/v1/completions", 32, args.seconds)
                for k, v in (("one_connection", one), ("eight_connections", eight), ("saturation", sat)):
                    runs[name][k].append(v)
                t = spent[name]
                t[0] += c1 - c0
                t[1] += one["requests"]
                t[2] += c2 - c1
                t[3] += eight["requests"]
                t[4] += m2 - m1
                t[5] += e2 - e1
                print(
                    f"round {rnd + 1}/{args.rounds} {name}: 1 conn p50 {one['p50_ms']:.3f} ms p99 {one['p99_ms']:.3f} ms;"
                    f" 8 conns {eight['rps']:.0f} rps; 32 conns {sat['rps']:.0f} rps",
                    flush=True,
                )
        for name in chains:
            result["chains"][name] = {
                k: {f: statistics.median(r[f] for r in rs) for f in rs[0]} | {"rounds": rs} for k, rs in runs[name].items()
            }
            t = spent[name]
            cpu[name] = (t[0] / t[1] * 1e6, t[2] / t[3] * 1e6)
            if t[4] > 0:
                per_message[name] = t[5] / t[4]
        for edge, base in BASELINE.items():
            c, b = result["chains"][edge], result["chains"][base]
            result["edges"][edge] = {
                "baseline_chain": base,
                "gate_cpu_us_per_request": cpu[edge][1],
                "gate_cpu_us_per_request_1c": cpu[edge][0],
                "gate_added_p50_ms": c["one_connection"]["p50_ms"] - b["one_connection"]["p50_ms"],
                "gate_added_p99_ms": c["one_connection"]["p99_ms"] - b["one_connection"]["p99_ms"],
                "throughput_ratio": c["saturation"]["rps"] / b["saturation"]["rps"],
                "non_2xx": sum(c[k]["non_2xx"] for k in c),
            }
            if edge in per_message:
                result["edges"][edge]["access_log_entries_per_message"] = per_message[edge]
        for edge in ("ext_authz", "ext_proc"):
            print(f"{edge}: holds ...", flush=True)
            result["edges"][edge].update(measure_holds(gate, chains[edge].url + "/v1/completions", fast))
        for edge in ("ext_authz", "ext_proc", "ext_authz_pick"):
            print(f"{edge}: drain barrier ...", flush=True)
            result["edges"][edge].update(measure_drain(gate, chains[edge].url, fast, slow))
    finally:
        for env in chains.values():
            env.stop()
        gate.stop()
        for p in pickers:
            p.stop()
        for f in floors.values():
            f.terminate()
            f.wait(10)
        upstream.stop()
        streaming.shutdown()
    top = result["edges"][DEFAULT_EDGE]
    for k in (*TARGETS, *TARGETS_AT_LEAST, "gate_cpu_us_per_request_1c", "release_1000_all_responses_ms", "drain_barrier_max_ms"):
        result[k] = top[k]
    result["targets"] = {**TARGETS, **{k: f">= {v}" for k, v in TARGETS_AT_LEAST.items()}}
    result["meets_targets"] = {
        **{k: top[k] <= v for k, v in TARGETS.items()},
        **{k: top[k] >= v for k, v in TARGETS_AT_LEAST.items()},
    }
    args.out.write_text(json.dumps(result, indent=1))
    text = summary(result)
    args.out.with_suffix(".txt").write_text(text + "\n")
    try:
        plot(result, args.out.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no PNG (pip install -e '.[demo]')")
    print(text)
    print(f"wrote {args.out}, {args.out.with_suffix('.txt')}, {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
