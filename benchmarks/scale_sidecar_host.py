"""The scale benchmark's sidecar host: a child process serving ``count`` real sidecars, each on a fake engine whose
``/metrics`` page has the shape of vLLM 0.32's (so a sidecar parses a realistic page), and answering ``calls`` on stdin
with the engines' HTTP calls and CPU since the last ask (benchmarks/scale.py, benchmarks/README.md).

Run by :class:`SidecarHost` as ``python -m benchmarks.scale_sidecar_host COUNT TOKEN_FILE``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


def _vllm_metrics_padding() -> str:
    """The rest of a vLLM 0.32 ``/metrics`` page (one engine): its counters, gauges and histograms with buckets, by
    the names ``vllm/v1/metrics/loggers.py`` registers, so a sidecar parses a page of that shape (~30 KiB, 400
    lines; vLLM 0.32's own on the tests' server: 50 KB, 619 lines)."""
    lab = 'engine="0",model_name="fake"'
    out: list[str] = []
    gauges = ["kv_cache_usage_perc", "num_requests_waiting_by_reason", "lora_requests_info"]
    counters = [
        "corrupted_requests",
        "num_preemptions",
        "prompt_tokens",
        "generation_tokens",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "external_prefix_cache_queries",
        "external_prefix_cache_hits",
        "mm_cache_queries",
        "mm_cache_hits",
        "prompt_tokens_cached",
    ]
    token_buckets: list[float] = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
    time_buckets: list[float] = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80]
    histograms: dict[str, list[float]] = {
        "request_prompt_tokens": token_buckets,
        "request_generation_tokens": token_buckets,
        "iteration_tokens_total": token_buckets,
        "request_max_num_generation_tokens": token_buckets,
        "request_params_n": [1.0, 2.0, 5.0, 10.0, 20.0],
        "request_params_max_tokens": token_buckets,
        "time_to_first_token_seconds": time_buckets,
        "inter_token_latency_seconds": time_buckets,
        "request_time_per_output_token_seconds": time_buckets,
        "e2e_request_latency_seconds": time_buckets,
        "request_queue_time_seconds": time_buckets,
        "request_inference_time_seconds": time_buckets,
        "request_prefill_time_seconds": time_buckets,
        "request_decode_time_seconds": time_buckets,
        "request_num_preemptions": token_buckets,
        "request_prefill_kv_computed_tokens": token_buckets,
    }
    for g in gauges:
        out += [f"# HELP vllm:{g} {g}.", f"# TYPE vllm:{g} gauge", f"vllm:{g}{{{lab}}} 0.0"]
    for c in counters:
        out += [f"# HELP vllm:{c}_total {c}.", f"# TYPE vllm:{c}_total counter", f"vllm:{c}_total{{{lab}}} 0.0"]
    for h, buckets in histograms.items():
        out += [f"# HELP vllm:{h} {h}.", f"# TYPE vllm:{h} histogram"]
        out += [f'vllm:{h}_bucket{{{lab},le="{float(b)}"}} 0.0' for b in buckets]
        out += [f'vllm:{h}_bucket{{{lab},le="+Inf"}} 0.0', f"vllm:{h}_count{{{lab}}} 0.0", f"vllm:{h}_sum{{{lab}}} 0.0"]
    for i in range(3):  # the process and Python collectors prometheus-client adds
        out += ["# TYPE python_gc_objects_collected_total counter", f'python_gc_objects_collected_total{{generation="{i}"}} 0.0']
    for p in ("virtual_memory_bytes", "resident_memory_bytes", "start_time_seconds", "cpu_seconds_total", "open_fds"):
        out += [f"# TYPE process_{p} gauge", f"process_{p} 0.0"]
    return "\n".join(out) + "\n"


def _engine_threads_cpu_s() -> float:
    """CPU seconds of the fake engines' threads alive now (their servers' loops and one thread per kept-alive
    connection, stdlib ``ThreadingHTTPServer``), so the sidecars' own CPU can be told from the engines'."""
    total = 0.0
    for t in threading.enumerate():
        if t.ident is not None and ("serve_forever" in t.name or "process_request_thread" in t.name):
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except OSError:  # it ended meanwhile
                pass
    return total


async def _serve_host(count: int, token: str) -> None:
    """``count`` fake vLLM engines, each with its real sidecar; prints their addresses, then answers ``calls`` on
    stdin (engine HTTP calls since the last ``calls``, by path) until stdin closes."""
    from llmd_timeslice.snapshot.backends.vllm import VllmBackend
    from llmd_timeslice.snapshot.server import SidecarServer
    from tests.support.fake_engines import FakeVllm

    padding = _vllm_metrics_padding()

    class VllmShapedFake(FakeVllm):
        def handle(self, method, path, query, body):
            status, payload, ctype = super().handle(method, path, query, body)
            return (status, payload + padding, ctype) if path == "/metrics" else (status, payload, ctype)

    engines = [VllmShapedFake().start() for _ in range(count)]
    sidecars = [
        SidecarServer({f"s{i}": VllmBackend(e.url, idle_timeout_s=5)}, port=0, token=token) for i, e in enumerate(engines)
    ]
    for s in sidecars:
        await s.start()
    addrs = [
        {"engine": e.url.removeprefix("http://"), "sidecar": f"127.0.0.1:{s.port}"}
        for e, s in zip(engines, sidecars, strict=True)
    ]
    print(json.dumps(addrs), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        by_path: dict[str, int] = {}
        for e in engines:
            with e.lock:
                calls, e.calls = e.calls, []
            for _, p, _ in calls:
                by_path[p] = by_path.get(p, 0) + 1
        print(json.dumps({"calls": by_path, "engine_cpu_s": _engine_threads_cpu_s()}), flush=True)
    for s in sidecars:
        await s.stop(0.5)
    for e in engines:
        e.stop()


class SidecarHost:
    """A child process hosting ``count`` sidecars on fake engines (:func:`_serve_host`)."""

    def __init__(self, count: int, token_file: Path, log: Path) -> None:
        self._log = open(log, "wb")  # noqa: SIM115 - kept open for the child's lifetime
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scale_sidecar_host", str(count), str(token_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"sidecar host did not start; see {log}")
        self.samplers: list[dict] = json.loads(line)

    def calls(self) -> dict:
        """``{"calls": engine HTTP calls by path since the last call, "engine_cpu_s": the engines' CPU so far}``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("calls\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


if __name__ == "__main__":
    asyncio.run(_serve_host(int(sys.argv[1]), Path(sys.argv[2]).read_text()))
