"""A stack across three nodes started by Slurm itself: ``srun --ntasks-per-node=1 llmd-timeslice up -f FILE`` over a
Slurm cluster of namespace nodes (slurmctld, a slurmd per node: tests/support/slurm_cluster.py), the stack file with
no node list (the allocation's, ``SLURM_JOB_NODELIST``, expanded by Slurm's own ``scontrol``), each task starting
its node's part; ``scancel`` stops every node's part. Skipped, one line, without root, ``ip`` or the unpacked Slurm
(``make slurm``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from tests.support import netns_nodes, slurm_cluster
from tests.support.netns_nodes import CLI, NamespaceNodes

pytestmark = [pytest.mark.nodes, pytest.mark.envoy, pytest.mark.timeout(240)]


@pytest.fixture
def cluster(tmp_path):
    why = netns_nodes.skip_reason() or slurm_cluster.skip_reason()
    if why:
        pytest.skip(why)
    nodes = NamespaceNodes(3)
    try:
        slurm = slurm_cluster.SlurmCluster(nodes, tmp_path / "slurm")
    except BaseException:
        nodes.close()
        raise
    yield nodes, slurm
    slurm.close()
    nodes.close()


def _phase(workdir, node: str) -> str | None:
    try:
        return json.loads((workdir / "nodes" / node / "stack.json").read_text()).get("phase")
    except (OSError, ValueError):
        return None


def _wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_srun_starts_each_nodes_part_serves_through_the_head_and_scancel_stops_every_node(tmp_path, cluster):
    nodes, slurm = cluster
    h = nodes.hostnames
    workdir = tmp_path / "wd"
    stack = {
        "stack": {"name": "srun", "workdir": str(workdir), "max_hold_s": 30},  # no node list: the allocation's
        "groups": [{"group_id": "g", "drain_timeout_s": 5}],
        "engines": [
            {"name": f"s{i}", "group": "g", "node": i, "sidecar_port": 9100, "url": f"http://{h[i]}:8001"} for i in (1, 2)
        ],
    }
    f = tmp_path / "stack.yaml"
    f.write_text(yaml.safe_dump(stack))
    engines = [
        nodes.popen(i, [sys.executable, "-m", "tests.support.fake_engine_process", "8001", "0", nodes.addresses[i]])
        for i in (1, 2)
    ]
    out = open(tmp_path / "srun.out", "w")  # noqa: SIM115
    env = slurm.env(netns_nodes.env())
    srun = slurm.popen(
        0,
        ["srun", "-N3", "--ntasks-per-node=1", "--kill-on-bad-exit=1", *CLI, "up", "-f", str(f), "--no-live"],
        env=env,
        cwd=netns_nodes.REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait(
            lambda: all(_phase(workdir, n) == "running" for n in h) or srun.poll() is not None,
            150,
            "every node's part running under srun",
        )
        assert srun.poll() is None, (tmp_path / "srun.out").read_text()[-3000:]
        record = json.loads((workdir / "nodes.json").read_text())
        assert record["nodes"] == h and record["head"] == h[0], record  # SLURM_JOB_NODELIST, expanded by scontrol
        for i, n in enumerate(h):  # each task knew its node from Slurm's environment
            assert json.loads((workdir / "nodes" / n / "stack.json").read_text())["address"] == nodes.addresses[i]
        served = nodes.run(0, [sys.executable, "-m", "tests.support.netns_client", "serve", f"http://{h[0]}:8080", "4"])
        assert json.loads(served.stdout)["ok"] == 4, served.stdout + served.stderr
        st = nodes.run(2, [*CLI, "status", "-f", str(f)])
        assert st.returncode == 0 and all(f"node {n}" in st.stdout for n in h), st.stdout + st.stderr
        jobs = slurm.run(0, ["squeue", "-h", "-o", "%i"]).stdout.split()
        assert len(jobs) == 1, jobs
        t0 = time.monotonic()
        assert slurm.run(0, ["scancel", jobs[0]]).returncode == 0
        srun.wait(60)
        stop_s = time.monotonic() - t0
        for e in engines:
            e.kill()
            e.wait(10)
        _wait(lambda: all(_phase(workdir, n) == "stopped" for n in h), 30, "every node's part stopped")
        daemons = slurm.daemon_pids()
        left = {n: [p for p in nodes.described(i) if int(p.split(":")[0]) not in daemons] for i, n in enumerate(h)}
        assert left == {n: [] for n in h}, left
        print(f"scancel stopped every node in {stop_s:.1f} s")
    finally:
        for p in [srun, *engines]:
            if p.poll() is None:
                p.kill()
        out.close()
