"""``llmd-timeslice up`` on a shared node, with real processes (Envoy, gate, orchestrator, sidecar; the engine
is a fake vLLM given to the stack by URL, so no vLLM starts): a second stack on the same ports is refused at once,
naming each port and the process of the first stack that holds it, and the first keeps serving; ``status -f``
prints whole values into a pipe; the printed export line is all the RL script needs; a component whose restart
finds its port taken fails ``up`` instead of restarting forever."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import port_for
import pytest
import yaml

from llmd_timeslice.local.stack_file import StackPorts
from llmd_timeslice.local.up import ROUTER_URL_ENV, alive
from tests.support.fake_engines import FakeVllm
from tests.support.squatter import bind_when_free

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "llmd_timeslice.cli"]
GROUP = "rollout-group-on-a-shared-node"  # long names: a table cut at 80 columns would end them in '…'
ENGINE = "sampler-with-a-rather-long-name-0"


def _distinct_ports() -> dict[str, int]:
    """A free port for each of the stack's port settings, no two the same (the stack file refuses a port used twice:
    two random picks that collided made a test fail with that refusal instead of the one it checks)."""
    picked: set[int] = set()
    while len(picked) < len(StackPorts.model_fields):
        picked.add(port_for.select_random())
    return dict(zip(StackPorts.model_fields, sorted(picked), strict=True))


def _free_offset(taken: list[int]) -> int:
    """An offset that moves every port of ``taken`` onto a port free now and outside ``taken``."""
    from llmd_timeslice.local.ports import bind_error

    for offset in range(101, 5000, 97):
        moved = [p + offset for p in taken]
        if max(moved) <= 65535 and not set(moved) & set(taken) and all(bind_error("127.0.0.1", p) is None for p in moved):
            return offset
    raise AssertionError(f"no free offset for {taken}")


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


def _stack_file(tmp_path: Path, name: str, ports: dict, sidecar_port: int, engine_url: str) -> Path:
    d = {
        "stack": {"name": name, "workdir": str(tmp_path / name), "max_hold_s": 30, "ports": ports},
        "groups": [{"group_id": GROUP, "drain_timeout_s": 5}],
        "engines": [{"name": ENGINE, "group": GROUP, "sidecar_port": sidecar_port, "url": engine_url}],
    }
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump(d))
    return f


def test_second_stack_on_taken_ports_is_refused_naming_each_port_and_holder_and_the_first_keeps_serving(tmp_path):
    engine = FakeVllm().start()
    ports = _distinct_ports()
    sidecar_port = port_for.select_random()
    first = _stack_file(tmp_path, "first", ports, sidecar_port, engine.url)
    second = _stack_file(tmp_path, "second", ports, sidecar_port, engine.url)  # other name and workdir, same ports
    workdir = tmp_path / "first"
    out_path = tmp_path / "first.out"
    out = open(out_path, "wb")  # noqa: SIM115
    up = subprocess.Popen([*CLI, "up", "-f", str(first), "--no-live"], stdout=out, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        _wait(lambda: _state(workdir).get("phase") == "running" or up.poll() is not None, 180, "the first stack to run")
        assert up.poll() is None, out_path.read_text()
        state = _state(workdir)
        pids = [c["pid"] for c in state["components"]]
        ep = state["endpoints"]

        # The second `up`: refused before it starts anything (its ports are checked once, up front: no wait for them to
        # be freed), one line per taken port naming the first stack's process on it.
        r = subprocess.run([*CLI, "up", "-f", str(second), "--no-live"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        for c in state["components"]:
            line = next((ln for ln in r.stderr.splitlines() if f"port {c['port']} (" in ln), "")
            assert f"is in use by pid {c['pid']} (" in line, (c, r.stderr)
        assert f"port {ports['router']} (stack.ports.router) on 127.0.0.1 is in use by pid" in r.stderr
        assert f"port {sidecar_port} (engines[0] ({ENGINE}).sidecar_port)" in r.stderr
        assert "stack up" not in r.stdout and not (tmp_path / "second" / "stack.json").exists(), "nothing started"

        # The same file with one flag, `--port-offset N`, starts beside the first and serves; `down` with the same N.
        offset = _free_offset([*ports.values(), sidecar_port])
        second_up = subprocess.Popen(
            [*CLI, "up", "-f", str(second), "--no-live", "--port-offset", str(offset)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait(
                lambda: _state(tmp_path / "second").get("phase") == "running" or second_up.poll() is not None,
                180,
                "the second stack",
            )
            assert second_up.poll() is None, "the second stack did not start with --port-offset"
            ep2 = _state(tmp_path / "second")["endpoints"]
            assert ep2["router"] == f"http://127.0.0.1:{ports['router'] + offset}", ep2
            resp = httpx.post(
                ep2["router"] + "/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2}, timeout=30
            )
            assert resp.status_code == 200, resp.text
        finally:
            down2 = subprocess.run(
                [*CLI, "down", "-f", str(second), "--port-offset", str(offset)], capture_output=True, text=True, timeout=120
            )
            if second_up.poll() is None:
                second_up.kill()
            second_up.wait()
        assert down2.returncode == 0 and "stack stopped" in down2.stdout, down2.stdout + down2.stderr

        # The first stack still serves, nothing of it restarted: its state as `up` wrote it after the second stack
        # was gone (every second), where a component that died meanwhile shows as not ready.
        gone = time.time()
        _wait(lambda: _state(workdir).get("updated_unix_s", 0) > gone, 30, "the first stack's state written again")
        state = _state(workdir)
        assert up.poll() is None and state["phase"] == "running"
        assert all(c["state"] == "ready" and c["restarts"] == 0 and alive(c["pid"]) for c in state["components"]), state
        resp = httpx.post(ep["router"] + "/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert resp.status_code == 200, resp.text

        # `status -f` into a pipe (not a terminal, COLUMNS unset): whole values, no '…'.
        env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
        st = subprocess.run([*CLI, "status", "-f", str(first)], capture_output=True, text=True, timeout=60, env=env)
        assert st.returncode == 0, st.stdout + st.stderr
        for whole in (GROUP, ENGINE, engine.url.removeprefix("http://"), str(workdir / "logs"), ep["orchestrator"]):
            assert whole in st.stdout, (whole, st.stdout)
        assert "…" not in st.stdout, st.stdout

        # The printed export line is all the RL script needs (no stack file to read, nothing on default ports).
        text = out_path.read_text()
        export = re.search(r"export (.+)$", text, re.MULTILINE)
        assert export, text
        exported = dict(kv.split("=", 1) for kv in export.group(1).split())
        assert exported == {
            "TIMESLICE_ORCH_ADDR": ep["orchestrator"],
            "LLMD_TIMESLICE_TOKEN_FILE": ep["token_file"],
            ROUTER_URL_ENV: ep["router"],
        }
        rl_env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("TIMESLICE_ORCH_ADDR", "LLMD_TIMESLICE_TOKEN_FILE", "LLMD_TIMESLICE_TOKEN", ROUTER_URL_ENV)
        }
        rl = subprocess.run(
            [
                sys.executable,
                str(REPO / "examples" / "rl_loop.py"),
                "--stack",
                str(tmp_path / "none.yaml"),
                "--group",
                GROUP,
                "--model",
                "fake",
                "--iterations",
                "1",
                "--step-s",
                "0.1",  # the stand-in training step: the group is held meanwhile, any length shows that
            ],
            env={**rl_env, **exported},
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert rl.returncode == 0, rl.stdout + rl.stderr
        assert "iteration 0: rollout 4/4 ok" in rl.stdout and "final rollout" in rl.stdout, rl.stdout
        assert any(p == "/sleep" for p in engine.paths()), "the trainer's acquire put the engine to sleep"

        # A component whose restart finds its port taken (here by this test) fails `up`, instead of restarting forever.
        gate = next(c for c in state["components"] if c["name"] == "gate")
        os.kill(gate["pid"], signal.SIGKILL)
        squatter = bind_when_free(gate["port"], 5)  # within the supervisor's 1 s back-off
        try:
            assert up.wait(30) == 1, out_path.read_text()
        finally:
            squatter.close()
        text = out_path.read_text()
        assert f"gate: port {gate['port']} is held by pid {os.getpid()}" in text, text
        assert text.count("gate: restarted") == 0 and _state(workdir)["phase"] == "failed"
    finally:
        if up.poll() is None:
            subprocess.run([*CLI, "down", "-f", str(first)], capture_output=True, timeout=120)
            up.kill()
            up.wait()
        out.close()
        engine.stop()
    assert not [p for p in pids if alive(p)], "nothing of the first stack is left running"


def test_rl_script_without_a_router_stops_instead_of_guessing_a_port(tmp_path):
    """No flag, no exported variable, no running stack: exit 2 naming what is missing and the export line, rather than
    sending rollouts to 127.0.0.1:8080 (on a shared node, possibly another stack's router)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TIMESLICE_ORCH_ADDR", "LLMD_TIMESLICE_TOKEN_FILE", "LLMD_TIMESLICE_TOKEN", ROUTER_URL_ENV)
    }
    r = subprocess.run(
        [sys.executable, str(REPO / "examples" / "rl_loop.py"), "--stack", str(tmp_path / "none.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no --router, --orchestrator, --token-file" in r.stderr and ROUTER_URL_ENV in r.stderr, r.stderr


def test_second_up_of_a_workdir_while_the_first_starts_is_refused_before_building_anything(tmp_path):
    """Found by a first-time user: a second `up` 3 s after the first passed both checks (no stack.json yet, engines
    not yet on their ports), rebuilt the model the first stack was loading and started more engines. The first `up`
    holds WORKDIR/up.lock from before its start-up; here the test holds it, as that `up` would."""
    from filelock import FileLock

    ports = _distinct_ports()
    f = _stack_file(tmp_path, "locked", ports, port_for.select_random(), "http://127.0.0.1:9")
    workdir = tmp_path / "locked"
    workdir.mkdir()
    with FileLock(workdir / "up.lock"):
        r = subprocess.run([*CLI, "up", "-f", str(f), "--no-live"], capture_output=True, text=True, timeout=60)
    said = " ".join(r.stdout.split())
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"another `llmd-timeslice up` is starting or running a stack from {workdir}" in said, r.stdout + r.stderr
    assert sorted(p.name for p in workdir.iterdir()) == ["up.lock"], "nothing built, nothing started"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_up_stopped_while_starting_exits_128_plus_the_signal_and_leaves_nothing(tmp_path, sig):
    """Found by a first-time user: Ctrl-C during the start-up printed "stopped while starting"; `up && next` must
    not go on. The engine is a stand-in that never listens (a `python` that sleeps), so `up` is stopped while it
    waits for it."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    never_ready = tmp_path / "python"
    pid_file = tmp_path / "engine.pid"
    never_ready.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 120\n")
    never_ready.chmod(0o755)
    ports = _distinct_ports()
    f = tmp_path / "stack.yaml"
    engine = {"model": str(model), "port": port_for.select_random(), "python": str(never_ready)}
    d = {
        "stack": {"name": "s", "workdir": str(tmp_path / "wd"), "ports": ports},
        "groups": [{"group_id": GROUP}],
        "engines": [{"name": "e0", "group": GROUP, "sidecar_port": port_for.select_random(), "vllm": engine}],
    }
    f.write_text(yaml.safe_dump(d))
    proc = subprocess.Popen([*CLI, "up", "-f", str(f), "--no-live"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: (pid_file.exists() and pid_file.read_text().strip()) or proc.poll() is not None, 60, "the engine")
        assert proc.poll() is None, proc.communicate()[0]  # `up` did not start the engine: say why, not after 60 s
        engine_pid = int(pid_file.read_text())
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, out
    assert f"stopped while starting ({sig.name})" in out, out
    assert not alive(engine_pid), "the engine it started is stopped"
