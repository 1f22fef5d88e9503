"""A real vLLM on a namespace node (issue 41: "one real vLLM at least once"): the head node runs the control plane,
an engine node the stack starts a vLLM server on (the tiny Llama, CPU), bound to that node's address, with its
sidecar beside it. Served through the head's router; a trainer's acquire puts it to sleep, verified by the sidecar
and by vLLM's own ``/is_sleeping``, and its yield wakes it.

Not part of `make test`: 31–41 s and ~24 s of CPU on 2 cores (a vLLM start is ~22 s), on top of a run already near its
3-minute budget. It runs when asked for by its marker, ``pytest -m nodes_vllm`` (``make test-nodes-vllm``), and is
skipped with that hint otherwise; skipped too without root, ``ip`` or the vLLM environment."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from llmd_timeslice.engines.vllm_server import SERVED_MODEL_NAME, default_python
from tests.support import netns_nodes
from tests.support.netns_nodes import CLI, NamespaceNodes

pytestmark = [pytest.mark.nodes_vllm, pytest.mark.nodes, pytest.mark.vllm, pytest.mark.envoy, pytest.mark.timeout(420)]


@pytest.fixture
def nodes(request):
    if "nodes_vllm" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("a real vLLM on a namespace node runs when asked for: pytest -m nodes_vllm (make test-nodes-vllm)")
    why = netns_nodes.skip_reason()
    if why:
        pytest.skip(why)
    if not Path(default_python()).exists():
        pytest.skip(f"no vLLM environment at {default_python()} (make setup)")
    n = NamespaceNodes(2)
    yield n
    n.close()


def _phase(workdir: Path, node: str) -> str | None:
    try:
        return json.loads((workdir / "nodes" / node / "stack.json").read_text()).get("phase")
    except (OSError, ValueError):
        return None


def test_a_real_vllm_on_an_engine_node_serves_sleeps_and_wakes_through_the_head(tmp_path, nodes):
    h = nodes.hostnames
    workdir = tmp_path / "wd"
    stack = {
        "stack": {"name": "vllm-node", "workdir": str(workdir), "max_hold_s": 60, "nodes": h, "head_node": 0},
        "groups": [{"group_id": "g", "drain_timeout_s": 10}],
        "engines": [
            {"name": "s1", "group": "g", "node": 1, "sidecar_port": 9100,
             "vllm": {"model": "builtin:tiny-llama", "port": 8001}},
        ],
    }  # fmt: skip
    f = tmp_path / "stack.yaml"
    f.write_text(yaml.safe_dump(stack))
    logs = [open(tmp_path / f"up-{i}.log", "w") for i in range(2)]  # noqa: SIM115
    env = {**netns_nodes.env(), "NETNS_CLIENT_MODEL": SERVED_MODEL_NAME, "NETNS_CLIENT_TIMEOUT_S": "120"}
    t0 = time.monotonic()
    ups = [
        nodes.popen(i, [*CLI, "up", "-f", str(f), "--node", h[i], "--no-live"], env=env, stdout=logs[i],
                    stderr=subprocess.STDOUT)
        for i in range(2)
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not all(_phase(workdir, n) == "running" for n in h):
            assert all(u.poll() is None for u in ups), [(tmp_path / f"up-{i}.log").read_text()[-2000:] for i in range(2)]
            assert time.monotonic() < deadline, "the stack did not start within 300 s"
            time.sleep(0.5)
        started_s = time.monotonic() - t0
        vllm_url = f"http://{h[1]}:8001"
        # the vLLM server of node 1 listens on node 1's address, not on the head's or on loopback
        vllm = next(c for c in json.loads((workdir / "nodes" / h[1] / "stack.json").read_text())["components"]
                    if c["name"] == "vllm-s1")  # fmt: skip
        assert vllm["state"] == "ready", vllm
        client = [sys.executable, "-m", "tests.support.netns_client"]
        served = nodes.run(0, [*client, "serve", f"http://{h[0]}:8080", "3"], env=env, timeout=120)
        assert json.loads(served.stdout)["ok"] == 3, served.stdout + served.stderr[-2000:]
        turn = nodes.run(
            0, [*client, "trainer", f"{h[0]}:50051", str(workdir / "control-token"), "g", f"http://{h[0]}:8080", vllm_url],
            env=env, timeout=180,
        )  # fmt: skip
        assert turn.returncode == 0, turn.stdout + turn.stderr[-3000:]
        rec = json.loads(turn.stdout.strip().splitlines()[-1])
        assert rec["asleep_while_held"] == {vllm_url: True}, rec
        assert rec["answered_while_held"] == {}, rec
        assert rec["awake_after_yield"] == {vllm_url: True}, rec
        assert rec["held_request"]["status"] == 200, rec
        orch_log = (workdir / "nodes" / h[0] / "logs" / "orchestrator.log").read_text()
        assert "SUSPENDING -suspended-> HELD" in orch_log and "HELD -yield-> RESUMING" in orch_log
        down = nodes.run(1, [*CLI, "down", "-f", str(f)], timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr
        for u in ups:
            assert u.wait(90) == 0
        assert {n: nodes.described(i) for i, n in enumerate(h)} == {n: [] for n in h}
        print(f"real vLLM on a namespace node: stack running in {started_s:.0f} s, acquire {rec['acquire_s']} s, "
              f"held request answered {rec['held_answered_after_yield_s']} s after the yield")  # fmt: skip
    finally:
        for u in ups:
            if u.poll() is None:
                u.kill()
        for lg in logs:
            lg.close()
