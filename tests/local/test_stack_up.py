"""``llmd-timeslice up`` end to end behind the stack's real Envoy, in one stack start:

* the CPU example's stack with its second engine moved to a second pool and group (``pool-b`` serves
  ``/pool-b/v1/...``; the prefix is stripped before the engine, which only knows ``/v1/``). Both engines are ones
  the stack does not start (``url:``, a running engine: the tests' fake vLLM server). Each pool serves; engine admin
  paths (``POST /sleep``, ``/wake_up``, ``/collective_rpc``, ...) sent to the router get 404, with and without a pool
  prefix, and leave the engines awake (issue 15 item 8, issue 14);
* the example RL script against the default pool, run twice (phase switches, weight versions 1-3, the tiny Llama
  really trained);
* pool-b asleep (a trainer holds its group): the default pool keeps serving, pool-b's request is held and served
  once the trainer yields;
* a killed child reported and restarted;
* a request held while a trainer holds the group answered 503 on ``down``, and no process left afterwards.

Fake engines, not real vLLM: a vLLM start here is ~40 s of CPU and this test took 170 s of a full run with one
(docs/benchmarks.md#make-test-layout). What ``up`` starts for a ``vllm:`` engine is the command line and
environment of the session's real vLLM server (tests/local/test_stack_commands.py checks they are equal), whose tests
check real vLLM's sleep, wake and weight reloads under the sidecar (tests/snapshot/test_snapshot_vllm.py,
tests/snapshot/test_vllm_phase_switch.py, tests/snapshot/test_vllm_weight_sync.py); two vLLM engines started by one
stack run in ``make demo``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from llmd_timeslice.client import TimeSliceOrchestratorClient
from llmd_timeslice.engines.tiny_model import build_tiny_llama
from llmd_timeslice.engines.vllm_server import SERVED_MODEL_NAME
from llmd_timeslice.local.ports import free_ports
from llmd_timeslice.local.up import alive
from tests.support.fake_engines import FakeVllm
from tests.support.prometheus import sample

pytestmark = [pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "llmd_timeslice.cli"]
COMPLETION = {"model": SERVED_MODEL_NAME, "prompt": "the quick brown", "max_tokens": 4, "temperature": 0}
ADMIN = ["/sleep?level=1", "/wake_up", "/collective_rpc", "/reset_prefix_cache", "/pause"]


def _state(workdir: Path) -> dict:
    try:
        return json.loads((workdir / "stack.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _component(state: dict, name: str) -> dict:
    return next(c for c in state["components"] if c["name"] == name)


def _latencies(c: httpx.Client, url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = c.post(url, json=COMPLETION)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text
        out.append(time.perf_counter() - t)
    return out


def _check_pools_serve_and_admin_paths_are_refused(router: str, engine_urls: list[str]) -> None:
    with httpx.Client(timeout=120) as c:
        # Each pool serves; pool-b's engine sees /v1/completions (a 404 from vLLM otherwise).
        for prefix in ("", "/pool-b"):
            r = c.post(f"{router}{prefix}/v1/completions", json=COMPLETION)
            assert r.status_code == 200, f"{prefix or '/'}: {r.status_code} {r.text}"
        # Engine admin paths through the router: 404, and the engines stay awake.
        for prefix in ("", "/pool-b"):
            for path in ADMIN:
                r = c.post(f"{router}{prefix}{path}", json={"method": "reload_weights"})
                assert r.status_code == 404, f"POST {prefix}{path} through the router: {r.status_code} {r.text}"
        for url in engine_urls:
            assert c.get(url + "/is_sleeping").json() == {"is_sleeping": False}, f"{url} must stay awake"


def _check_pool_b_asleep_holds_its_request_while_the_default_pool_serves(ep: dict, engine_urls: list[str]) -> None:
    router = ep["router"]
    token = Path(ep["token_file"]).read_text().strip()
    with (
        httpx.Client(timeout=120) as c,
        TimeSliceOrchestratorClient(ep["orchestrator"], job_id="trainer-b", group_id="group-b", token=token) as trainer,
    ):
        _latencies(c, f"{router}/v1/completions", 3)
        trainer.acquire(timeout_sec=180)
        assert c.get(engine_urls[1] + "/is_sleeping").json() == {"is_sleeping": True}
        held: dict = {}

        def send_b() -> None:
            resp = httpx.post(f"{router}/pool-b/v1/completions", json=COMPLETION, timeout=120)
            held.update(status=resp.status_code, hold_ms=resp.headers.get("x-llmd-timeslice-hold-ms"))

        t = threading.Thread(target=send_b)
        t.start()
        _latencies(c, f"{router}/v1/completions", 3)  # the default pool serves meanwhile
        _wait(
            lambda: sample(ep["metrics_gate"], "llmd_timeslice_gate_held", pool="pool-b") == 1,
            60,
            "pool-b's request to be held at the gate",
        )
        assert not held, "pool-b's request is held while its engine sleeps"
        assert c.get(engine_urls[0] + "/is_sleeping").json() == {"is_sleeping": False}
        trainer.release()
        t.join(120)
        assert held.get("status") == 200 and int(held["hold_ms"]) > 0, held


def test_up_runs_a_two_pool_stack_for_an_rl_script_restarts_children_and_down_leaves_nothing(tmp_path):
    d = yaml.safe_load((REPO / "examples" / "cpu-stack.yaml").read_text())
    ports = free_ports(len(d["stack"]["ports"]) + len(d["engines"]))  # distinct: one by one, two could collide
    d["stack"]["ports"] = dict(zip(d["stack"]["ports"], ports, strict=False))
    sidecar_ports = ports[len(d["stack"]["ports"]) :]
    # The example's file, with its second engine in a pool and group of its own.
    assert [e["name"] for e in d["engines"]] == ["sampler-0", "sampler-1"]
    d["pools"].append({"name": "pool-b", "path_prefix": "/pool-b/"})
    d["groups"].append({"group_id": "group-b", "drain_timeout_s": 20})
    engines = [FakeVllm().start(), FakeVllm().start()]
    for e, engine, sidecar_port in zip(d["engines"], engines, sidecar_ports, strict=True):
        del e["vllm"]
        e.update(url=engine.url, sidecar_port=sidecar_port)
    d["engines"][1].update(pool="pool-b", group="group-b")
    engine_urls = [e.url for e in engines]
    model_dir = build_tiny_llama(tmp_path / "tiny-llama")  # the model the RL script trains
    workdir = tmp_path / "work"
    d["stack"]["workdir"] = str(workdir)
    stack_file = tmp_path / "stack.yaml"
    stack_file.write_text(yaml.safe_dump(d))
    out = open(tmp_path / "up.out", "wb")  # noqa: SIM115
    up = subprocess.Popen([*CLI, "up", "-f", str(stack_file), "--no-live"], stdout=out, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        _wait(lambda: _state(workdir).get("phase") == "running" or up.poll() is not None, 600, "the stack to run")
        assert up.poll() is None, (tmp_path / "up.out").read_text()
        state = _state(workdir)
        pids = [c["pid"] for c in state["components"]]
        ep = state["endpoints"]
        text = (tmp_path / "up.out").read_text()
        assert ep["router"] in text and ep["orchestrator"] in text, "up prints what to connect to"
        assert (workdir / "logs" / "gate.log").exists() and (workdir / "logs" / "sidecar-sampler-0.log").exists()
        _check_pools_serve_and_admin_paths_are_refused(ep["router"], engine_urls)

        # The example RL script, public client API only: 2 iterations, real training, weight versions 1 and 2.
        env = {**os.environ, "TIMESLICE_ORCH_ADDR": ep["orchestrator"], "LLMD_TIMESLICE_TOKEN_FILE": ep["token_file"]}
        r = subprocess.run(
            [
                sys.executable,
                str(REPO / "examples" / "rl_loop.py"),
                "--router",
                ep["router"],
                "--iterations",
                "2",
                "--model-dir",
                str(model_dir),
                "--weights-dir",
                str(tmp_path / "weights"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "final rollout at weight version(s) [2]" in r.stdout, r.stdout
        # Running it again with the same weights folder goes on from version 2: tests/test_input_files.py checks the
        # versions it chooses (a second run here was ~11 s of CPU, importing torch and transformers again).

        _check_pool_b_asleep_holds_its_request_while_the_default_pool_serves(ep, engine_urls)

        # A child that dies is reported and restarted.
        before = _component(state, "sidecar-sampler-0")
        os.kill(before["pid"], 9)
        _wait(
            lambda: (c := _component(_state(workdir), "sidecar-sampler-0"))["restarts"] == 1 and c["state"] == "ready",
            60,
            "the sidecar to be restarted",
        )
        pids.append(_component(_state(workdir), "sidecar-sampler-0")["pid"])
        assert "sidecar-sampler-0: exited (signal SIGKILL)" in (tmp_path / "up.out").read_text()
        st = subprocess.run([*CLI, "status", "-f", str(stack_file)], capture_output=True, text=True, timeout=60)
        assert st.returncode == 0 and "sidecar-sampler-0" in st.stdout and "SERVING" in st.stdout, st.stdout + st.stderr

        # A trainer holds the group: a request is held; `down` answers it 503 with a reason.
        token = Path(ep["token_file"]).read_text().strip()
        client = TimeSliceOrchestratorClient(ep["orchestrator"], job_id="trainer-0", group_id="rollout-group", token=token)
        client.acquire(timeout_sec=120)
        held: dict = {}

        def send() -> None:
            resp = httpx.post(
                ep["router"] + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4}, timeout=120
            )
            held.update(status=resp.status_code, reason=resp.headers.get("x-llmd-timeslice-reason"))

        t = threading.Thread(target=send)
        t.start()
        _wait(
            lambda: sample(ep["metrics_gate"], "llmd_timeslice_gate_held", pool="default") == 1,
            60,
            "the request to be held at the gate",
        )
        assert not held, "the request is held while the trainer holds the group"
        t0 = time.monotonic()
        down = subprocess.run([*CLI, "down", "-f", str(stack_file)], capture_output=True, text=True, timeout=120)
        stop_s = time.monotonic() - t0
        t.join(30)
        client.close()
        assert down.returncode == 0, down.stdout + down.stderr
        assert held == {"status": 503, "reason": "gate_shutting_down"}
        assert up.wait(30) == 0
        assert stop_s < 60
    finally:
        if up.poll() is None:  # a failed assertion above: stop the stack the way a user would, then make sure
            subprocess.run([*CLI, "down", "-f", str(stack_file)], capture_output=True, timeout=120)
            up.kill()
            up.wait()
        out.close()
        for engine in engines:
            engine.stop()
    assert not [p for p in pids if alive(p)], "no component is left running"
    leftovers = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(workdir) in cmd:
                leftovers.append(cmd)
    assert not leftovers, leftovers
    assert _state(workdir)["phase"] == "stopped"
