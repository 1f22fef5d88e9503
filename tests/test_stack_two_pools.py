"""``llmd-timeslice up`` with two pools, real vLLM on CPU behind the stack's real Envoy (issue 15 item 8, issue 14).

One stack, two engines, each its own pool and group: ``default`` serves ``/v1/...``, ``pool-b`` serves
``/pool-b/v1/...`` (the prefix is stripped before the engine, which only knows ``/v1/``). Checked in one
stack start (two vLLM servers take about a minute here):

* a completion through each pool;
* pool-b asleep (a trainer holds its group): pool-a keeps serving, pool-b's request is held and served
  once the trainer yields. pool-a's latency with pool-b awake and asleep is printed (a figure for the
  report, not an assertion: timing on a shared 2-core machine is not a test);
* engine admin endpoints (``POST /sleep``, ``/wake_up``, ``/collective_rpc``, ...) sent to the router
  get 404, with and without a pool prefix, and the engines stay awake (``/is_sleeping`` on each).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import port_for
import pytest
import yaml

from llmd_timeslice.client import TimeSliceOrchestratorClient
from llmd_timeslice.demo.vllm_server import SERVED_MODEL_NAME
from tests.support.prometheus import sample

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CLI = [sys.executable, "-m", "llmd_timeslice.cli"]
COMPLETION = {"model": SERVED_MODEL_NAME, "prompt": "the quick brown", "max_tokens": 4, "temperature": 0}
ADMIN = ["/sleep?level=1", "/wake_up", "/collective_rpc", "/reset_prefix_cache", "/pause"]


def _state(workdir: Path) -> dict:
    try:
        return json.loads((workdir / "stack.json").read_text())
    except (OSError, ValueError):
        return {}


def _stack_file(tmp_path: Path) -> tuple[Path, Path, dict]:
    ports = {
        k: port_for.select_random()
        for k in (
            "router",
            "router_admin",
            "gate_ext_proc",
            "gate_control",
            "gate_metrics",
            "picker",
            "orchestrator",
            "orchestrator_metrics",
        )
    }
    workdir = tmp_path / "work"
    engines = []
    for name, pool, group in (("sampler-a", "default", "group-a"), ("sampler-b", "pool-b", "group-b")):
        engines.append(
            {
                "name": name,
                "pool": pool,
                "group": group,
                "sidecar_port": port_for.select_random(),
                "vllm": {"model": "builtin:tiny-llama", "port": port_for.select_random()},
            }
        )
    doc = {
        "stack": {"name": "two-pools", "workdir": str(workdir), "max_hold_s": 120, "ports": ports},
        "pools": [{"name": "default"}, {"name": "pool-b", "path_prefix": "/pool-b/"}],
        "groups": [{"group_id": "group-a", "drain_timeout_s": 20}, {"group_id": "group-b", "drain_timeout_s": 20}],
        "engines": engines,
    }
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, workdir, doc


def _latencies(c: httpx.Client, url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = c.post(url, json=COMPLETION)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text
        out.append(time.perf_counter() - t)
    return out


def test_two_pool_stack_serves_each_pool_keeps_one_serving_while_the_other_sleeps_and_refuses_admin_paths(tmp_path):
    stack_file, workdir, doc = _stack_file(tmp_path)
    out = open(tmp_path / "up.out", "wb")  # noqa: SIM115
    up = subprocess.Popen([*CLI, "up", "-f", str(stack_file), "--no-live"], stdout=out, stderr=subprocess.STDOUT)
    trainer = None
    try:
        deadline = time.monotonic() + 600
        while _state(workdir).get("phase") != "running":
            assert up.poll() is None, (tmp_path / "up.out").read_text()[-4000:]
            assert time.monotonic() < deadline, "the stack did not start in 600 s"
            time.sleep(0.5)
        ep = _state(workdir)["endpoints"]
        router = ep["router"]
        engine_urls = [f"http://127.0.0.1:{e['vllm']['port']}" for e in doc["engines"]]
        with httpx.Client(timeout=120) as c:
            # 1. Each pool serves; pool-b's engine sees /v1/completions (a 404 from vLLM otherwise).
            for prefix in ("", "/pool-b"):
                r = c.post(f"{router}{prefix}/v1/completions", json=COMPLETION)
                assert r.status_code == 200, f"{prefix or '/'}: {r.status_code} {r.text}"

            # 2. Engine admin paths through the router: 404, and the engines stay awake.
            for prefix in ("", "/pool-b"):
                for path in ADMIN:
                    r = c.post(f"{router}{prefix}{path}", json={"method": "reload_weights"})
                    assert r.status_code == 404, f"POST {prefix}{path} through the router: {r.status_code} {r.text}"
            for url in engine_urls:
                assert c.get(url + "/is_sleeping").json() == {"is_sleeping": False}, f"{url} must stay awake"

            # 3. pool-b asleep: pool-a keeps serving; pool-b's request is held until the trainer yields.
            awake = _latencies(c, f"{router}/v1/completions", 10)
            token = Path(ep["token_file"]).read_text().strip()
            trainer = TimeSliceOrchestratorClient(ep["orchestrator"], job_id="trainer-b", group_id="group-b", token=token)
            trainer.acquire(timeout_sec=180)
            assert c.get(engine_urls[1] + "/is_sleeping").json() == {"is_sleeping": True}
            held: dict = {}

            def send_b() -> None:
                resp = httpx.post(f"{router}/pool-b/v1/completions", json=COMPLETION, timeout=120)
                held.update(status=resp.status_code, hold_ms=resp.headers.get("x-llmd-timeslice-hold-ms"))

            t = threading.Thread(target=send_b)
            t.start()
            asleep = _latencies(c, f"{router}/v1/completions", 10)
            deadline = time.monotonic() + 60
            while sample(ep["metrics_gate"], "llmd_timeslice_gate_held", pool="pool-b") != 1:
                assert time.monotonic() < deadline, "pool-b's request never reached the gate"
                time.sleep(0.1)
            assert not held, "pool-b's request is held while its engine sleeps"
            assert c.get(engine_urls[0] + "/is_sleeping").json() == {"is_sleeping": False}
            trainer.release()
            t.join(120)
            assert held.get("status") == 200 and int(held["hold_ms"]) > 0, held
        print(
            f"\npool-a completion latency, median of 10: pool-b awake {statistics.median(awake) * 1e3:.0f} ms, "
            f"pool-b asleep {statistics.median(asleep) * 1e3:.0f} ms"
        )
    finally:
        if trainer is not None:
            trainer.close()
        subprocess.run([*CLI, "down", "-f", str(stack_file)], capture_output=True, timeout=120)
        if up.poll() is None:
            up.kill()
        up.wait(30)
        out.close()
