"""``llmd-timeslice up`` end to end: a stack from the CPU example (real Envoy, real vLLM on CPU), the example RL
script against it with phase switches and weight versions, a killed child restarted, a request held while a
trainer holds the group answered 503 on `down`, and no process left afterwards."""

from __future__ import annotations

import json
import os
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
from llmd_timeslice.local.up import alive
from tests.support.prometheus import sample

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "llmd_timeslice.cli"]


def _state(workdir: Path) -> dict:
    try:
        return json.loads((workdir / "stack.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _component(state: dict, name: str) -> dict:
    return next(c for c in state["components"] if c["name"] == name)


def test_up_runs_the_example_stack_for_an_rl_script_restarts_children_and_down_leaves_nothing(tmp_path):
    d = yaml.safe_load((REPO / "examples" / "cpu-stack.yaml").read_text())
    for k in d["stack"]["ports"]:
        d["stack"]["ports"][k] = port_for.select_random()
    d["engines"] = d["engines"][:1]  # one engine keeps the test short; the file is otherwise the example's
    d["engines"][0]["sidecar_port"] = port_for.select_random()
    d["engines"][0]["vllm"]["port"] = port_for.select_random()
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
        assert (workdir / "logs" / "gate.log").exists() and (workdir / "logs" / "vllm-sampler-0.log").exists()

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
                str(workdir / "tiny-llama"),
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
        # Run again (the same command, the same weights folder): it goes on from version 2 instead of failing on v1.
        again = subprocess.run([*r.args[:5], "1", *r.args[6:]], env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "final rollout at weight version(s) [3]" in again.stdout, again.stdout

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
    assert not [p for p in pids if alive(p)], "no component is left running"
    vllm_port = str(d["engines"][0]["vllm"]["port"])
    leftovers = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(workdir) in cmd or f"--port {vllm_port}" in cmd:
                leftovers.append(cmd)
    assert not leftovers, leftovers
    assert _state(workdir)["phase"] == "stopped"
