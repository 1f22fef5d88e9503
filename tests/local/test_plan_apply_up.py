"""A plan applied to a stack file starts with ``up`` and serves (issue 40): ``plan --apply`` rewrites a two-engine
stack file into the plan's groups; ``up`` starts it; a completion is answered through the router; each job acquires
and yields the group the plan gave it; the orchestrator was started with the plan to check (stack.placement_plan)
and serves the job's profile; ``down`` leaves nothing. Fake engines, as tests/local/test_stack_up.py says why."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from llmd_timeslice.client import TimeSliceOrchestratorClient
from llmd_timeslice.engines.vllm_server import SERVED_MODEL_NAME
from llmd_timeslice.local.ports import free_ports
from llmd_timeslice.placement import live
from tests.support.fake_engines import FakeVllm

pytestmark = [pytest.mark.timeout(300)]

CLI = [sys.executable, "-m", "llmd_timeslice.cli"]
JOBS = """profiles:
  - {job_id: env-a, rollout_s: 10, train_s: 8, cpu_gap_s: 60, weight_sync_s: 1, accelerators: 4}
  - {job_id: busy, rollout_s: 30, train_s: 30, cpu_gap_s: 1, weight_sync_s: 1, accelerators: 4}
"""


def _state(workdir: Path) -> dict:
    try:
        return json.loads((workdir / "stack.json").read_text())
    except (OSError, ValueError):
        return {}


def test_a_plan_applied_to_a_stack_file_starts_with_up_and_serves(tmp_path):
    names = ["router", "router_admin", "gate_ext_proc", "gate_authz", "gate_control", "gate_metrics", "picker"]
    names += ["orchestrator", "orchestrator_metrics"]
    ports = free_ports(len(names) + 2)
    engines = {"env-a": FakeVllm().start(), "busy": FakeVllm().start()}
    doc = {
        "stack": {"name": "planned", "log_level": "warning", "ports": dict(zip(names, ports, strict=False))},
        "groups": [{"group_id": "everyone", "drain_timeout_s": 5}],
        "engines": [
            {"name": f"{job}-sampler", "group": "everyone", "sidecar_port": port, "url": e.url}
            for (job, e), port in zip(engines.items(), ports[len(names) :], strict=True)
        ],
    }
    (tmp_path / "stack.yaml").write_text(yaml.safe_dump(doc))
    (tmp_path / "jobs.yaml").write_text(JOBS)
    out = tmp_path / "plan"
    plan = [*CLI, "plan", "-p", str(tmp_path / "jobs.yaml"), "--offer", "2x8", "--out", str(out), "--no-picture"]
    r = subprocess.run([*plan, "--apply", "--stack", str(tmp_path / "stack.yaml")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    groups = json.loads((out / "job-groups.json").read_text())
    assert groups["env-a"]["TIMESLICE_TRAINER_GROUP"] != groups["busy"]["TIMESLICE_TRAINER_GROUP"]
    workdir = out / ".llmd-timeslice" / "planned"
    log = open(tmp_path / "up.out", "wb")  # noqa: SIM115
    up = subprocess.Popen([*CLI, "up", "-f", str(out / "stack.yaml"), "--no-live"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while _state(workdir).get("phase") != "running":
            assert up.poll() is None and time.monotonic() < deadline, (tmp_path / "up.out").read_text()
            time.sleep(0.1)
        ep = _state(workdir)["endpoints"]
        body = {"model": SERVED_MODEL_NAME, "prompt": "the quick brown", "max_tokens": 4}
        resp = httpx.post(f"{ep['router']}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        token = Path(ep["token_file"]).read_text().strip()
        for job, g in groups.items():
            with TimeSliceOrchestratorClient(ep["orchestrator"], job_id=job, token=token) as c:
                c.acquire(group_id=g["TIMESLICE_TRAINER_GROUP"], timeout_sec=60, phase="train", accelerators=4)
                c.release(group_id=g["TIMESLICE_TRAINER_GROUP"])
        state = live.fetch(ep["orchestrator"], Path(ep["token_file"]))
        assert {p.job_id for p in state.profiles} == set(groups)
        assert state.placement is not None and state.placement.plan == str((out / "plan.json").resolve())
    finally:
        subprocess.run([*CLI, "down", "-f", str(out / "stack.yaml")], capture_output=True, timeout=120)
        up.wait(60)
        for e in engines.values():
            e.stop()
    assert not any(c.get("pid") and Path(f"/proc/{c['pid']}").exists() for c in _state(workdir).get("components", []))
