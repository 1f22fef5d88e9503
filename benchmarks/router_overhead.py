"""What the gate costs on the request path: Envoy + picker alone versus Envoy + gate + picker.

One run on loopback, Envoy with one worker (``--concurrency 1``), a fast upstream (a third Envoy
answering with a direct response), the gate and the picker as real processes (the CLI):

* ``gate_added_p50_ms`` / ``gate_added_p99_ms``: latency added by the gate, one connection, no
  queueing (``wrk -t1 -c1``), gate chain minus picker-only chain measured in the same run;
* ``gate_cpu_us_per_request``: CPU time of the gate process divided by the requests it saw;
* ``throughput_ratio``: gate chain / picker-only chain requests per second at saturation
  (``wrk -c32``; on two shared cores this mostly shows CPU cost);
* ``held_request_bytes``: gate resident memory per held request (2,000 held);
* ``release_1000_ms``: from the SetEndpointStates(SERVING) call to the moment the gate reports
  none of 1,000 held requests left in its queue (its status polled every millisecond).

    .venv/bin/python -m benchmarks.router_overhead --out router_overhead.json

Needs ``wrk`` (Debian package ``wrk``; ``make bench-deps`` installs it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import port_for
import psutil

from epp_plugin.envoy_config import EnvoyRouterConfig
from epp_plugin.envoy_launcher import EnvoyProcess, envoy_binary
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2_grpc as gpb_grpc
from llmd_timeslice.demo.stack import ComponentProcess

TARGETS = {"gate_added_p50_ms": 0.3, "gate_added_p99_ms": 1.0, "gate_cpu_us_per_request": 150.0,
           "held_request_bytes": 16 * 1024, "release_1000_ms": 200.0}


class FastUpstream:
    """An Envoy answering every request with 200 and a small JSON body (direct_response)."""

    def __init__(self, workdir: Path) -> None:
        self.port, self.admin = port_for.select_random(), port_for.select_random()
        self.config = workdir / "upstream.json"
        self.config.write_text(json.dumps({
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": self.admin}}},
            "static_resources": {"listeners": [{
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": self.port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                                 "HttpConnectionManager",
                        "stat_prefix": "up",
                        "route_config": {"virtual_hosts": [{"name": "a", "domains": ["*"], "routes": [{
                            "match": {"prefix": "/"},
                            "direct_response": {"status": 200, "body": {"inline_string": '{"ok":true}'}}}]}]},
                        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
                    }}]}],
            }]},
        }))
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen([str(envoy_binary()), "-c", str(self.config), "--concurrency", "1",
                                      "--use-dynamic-base-id", "--log-level", "error", "--disable-hot-restart"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                if httpx.get(f"http://{self.address}/", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("fast upstream did not start")

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(10)


def wrk(url: str, connections: int, seconds: float) -> dict:
    """Run wrk; returns requests/s and latency percentiles in ms."""
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{int(seconds)}s", "--latency", url],
                         capture_output=True, text=True, check=True).stdout
    unit = {"us": 1e-3, "ms": 1.0, "s": 1000.0}

    def lat(p: str) -> float:
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        return float(m.group(1)) * unit[m.group(2)]

    requests = int(re.search(r"(\d+) requests in", out).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)), "requests": requests,
            "p50_ms": lat(50), "p99_ms": lat(99), "non_2xx": int(errors.group(1)) if errors else 0}


def _set(stub, address: str, state: int) -> None:
    stub.SetEndpointStates(gpb.SetEndpointStatesRequest(pool="default", endpoints=[
        gpb.EndpointUpdate(address=address, state=state)]), timeout=5, metadata=(("authorization", "Bearer bench"),))


def _held(stub) -> int:
    return stub.GetPoolStatus(gpb.GetPoolStatusRequest(pool="default"), timeout=5,
                              metadata=(("authorization", "Bearer bench"),)).held


async def _hold(url: str, n: int, ready, timeout_s: float = 120) -> list:
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as c:
        tasks = [asyncio.create_task(c.get(url)) for _ in range(n)]
        await ready(tasks)
        return await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write.")
    ap.add_argument("--seconds", type=float, default=10.0, help="Duration of each wrk run.")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: install it (Debian package 'wrk', or `make bench-deps`)")
    work = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    (work / "token").write_text("bench")
    upstream = FastUpstream(work)
    upstream.start()
    gate_port, control_port, picker_port = (port_for.select_random() for _ in range(3))
    gate = ComponentProcess("gate", ["gate", "--ext-proc-port", str(gate_port), "--control-port", str(control_port),
                                     "--token-file", str(work / "token"), "--max-held", "5000"], control_port, work).start()
    picker = ComponentProcess("picker", ["picker", "--port", str(picker_port), "--endpoint",
                                         f"default={upstream.address}"], picker_port, work).start()
    chains = {
        "picker_only": EnvoyProcess(EnvoyRouterConfig(port_for.select_random(), port_for.select_random(), None,
                                                      picker_port), work).start(),
        "gate": EnvoyProcess(EnvoyRouterConfig(port_for.select_random(), port_for.select_random(), gate_port,
                                               picker_port), work).start(),
    }
    channel = grpc.insecure_channel(f"127.0.0.1:{control_port}")
    stub = gpb_grpc.GateControlServiceStub(channel)
    gate_ps = psutil.Process(gate.pid)
    result: dict = {"measured_here": True, "envoy_concurrency": 1, "wrk_seconds": args.seconds}
    try:
        _set(stub, upstream.address, gpb.ENDPOINT_STATE_SERVING)
        for env in chains.values():
            wrk(env.url + "/v1/completions", 1, 2)  # warm-up
        lat = {}
        for name, env in chains.items():
            cpu0 = sum(gate_ps.cpu_times()[:2])
            lat[name] = wrk(env.url + "/v1/completions", 1, args.seconds)
            if name == "gate":
                cpu = sum(gate_ps.cpu_times()[:2]) - cpu0
                result["gate_cpu_us_per_request"] = cpu / lat[name]["requests"] * 1e6
        result["latency_one_connection"] = lat
        result["gate_added_p50_ms"] = lat["gate"]["p50_ms"] - lat["picker_only"]["p50_ms"]
        result["gate_added_p99_ms"] = lat["gate"]["p99_ms"] - lat["picker_only"]["p99_ms"]
        sat = {name: wrk(env.url + "/v1/completions", 32, args.seconds) for name, env in chains.items()}
        result["saturation_32_connections"] = sat
        result["throughput_ratio"] = sat["gate"]["rps"] / sat["picker_only"]["rps"]

        # Memory per held request, and the release of 1,000.
        _set(stub, upstream.address, gpb.ENDPOINT_STATE_ASLEEP)
        url = chains["gate"].url + "/v1/completions"
        rss0 = gate_ps.memory_info().rss

        async def measure_memory(tasks, n=2000):
            while _held(stub) < n:
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            result["held_request_bytes"] = (gate_ps.memory_info().rss - rss0) / n
            _set(stub, upstream.address, gpb.ENDPOINT_STATE_SERVING)

        asyncio.run(_hold(url, 2000, measure_memory))
        _set(stub, upstream.address, gpb.ENDPOINT_STATE_ASLEEP)

        async def measure_release(tasks, n=1000):
            while _held(stub) < n:
                await asyncio.sleep(0.1)
            t0 = time.perf_counter()
            _set(stub, upstream.address, gpb.ENDPOINT_STATE_SERVING)
            while _held(stub) > 0:
                time.sleep(0.001)
            result["release_1000_ms"] = (time.perf_counter() - t0) * 1000
            await asyncio.gather(*tasks, return_exceptions=True)
            result["release_1000_all_responses_ms"] = (time.perf_counter() - t0) * 1000

        rs = asyncio.run(_hold(url, 1000, measure_release))
        result["release_1000_ok"] = sum(1 for r in rs if getattr(r, "status_code", 0) == 200)
    finally:
        channel.close()
        for env in chains.values():
            env.stop()
        gate.stop()
        picker.stop()
        upstream.stop()
    result["targets"] = TARGETS
    result["meets_targets"] = {k: result[k] <= v for k, v in TARGETS.items()}
    args.out.write_text(json.dumps(result, indent=1))
    lo = result["latency_one_connection"]
    print(f"one connection: picker-only p50 {lo['picker_only']['p50_ms']:.3f} ms p99 {lo['picker_only']['p99_ms']:.3f} ms;"
          f" with gate p50 {lo['gate']['p50_ms']:.3f} ms p99 {lo['gate']['p99_ms']:.3f} ms")
    for k in ("gate_added_p50_ms", "gate_added_p99_ms", "gate_cpu_us_per_request", "throughput_ratio",
              "held_request_bytes", "release_1000_ms", "release_1000_all_responses_ms"):
        target = f" (target <= {TARGETS[k]:g})" if k in TARGETS else ""
        print(f"{k}: {result[k]:.3f}{target}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
