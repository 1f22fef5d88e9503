"""A stack across nodes, tested as hosts: each node a network namespace with its own address (10.203.N.1 and
10.203.N.2 on a veth pair between two namespaces this test creates and removes), each running its own
``llmd-timeslice up --node``; fake engines (vLLM's HTTP interface) on both nodes. Skipped, one line, without root or
``ip``. Traffic goes only between the two namespaces."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.nodes, pytest.mark.envoy, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "llmd_timeslice.cli"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def two_nodes():
    """(namespace, address) of two nodes joined by a veth pair; removed afterwards with everything in them."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`: not available here")
    tag = os.getpid() % 200 + 20
    names = [f"h11n{tag}a", f"h11n{tag}b"]
    addrs = [f"10.203.{tag}.1", f"10.203.{tag}.2"]
    veth = [f"h11v{tag}a", f"h11v{tag}b"]
    try:
        for ns in names:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", veth[0], "netns", names[0], "type", "veth", "peer", "name", veth[1], "netns", names[1])
        for ns, dev, addr in zip(names, veth, addrs, strict=True):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        pytest.skip(f"cannot create network namespaces here: {getattr(exc, 'stderr', b'') or exc}")
    yield list(zip(names, addrs, strict=True))
    for ns in names:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout.split()
        for pid in pids:
            subprocess.run(["kill", "-9", pid], check=False)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _in(ns: str, argv: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, cwd=REPO, **kw)


def _run_in(ns: str, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(["ip", "netns", "exec", ns, *argv], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _node_phase(workdir: Path, node: str) -> str | None:
    try:
        return json.loads((workdir / "nodes" / node / "stack.json").read_text()).get("phase")
    except (OSError, ValueError):
        return None


def _node_updated(workdir: Path, node: str) -> float:
    """When ``node``'s ``up`` last refreshed its record (unix seconds; now, if it cannot be read this moment)."""
    try:
        return float(json.loads((workdir / "nodes" / node / "stack.json").read_text())["updated_unix_s"])
    except (OSError, ValueError, KeyError):
        return time.time()


def _wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_two_nodes_serve_through_the_heads_router_and_down_from_the_engine_node_stops_both(tmp_path, two_nodes):
    (ns0, a0), (ns1, a1) = two_nodes
    workdir = tmp_path / "wd"
    stack = {
        "stack": {"name": "two", "workdir": str(workdir), "max_hold_s": 20, "nodes": [a0, a1], "head_node": 0},
        "groups": [{"group_id": "g", "drain_timeout_s": 5}],
        "engines": [
            {"name": "s0", "group": "g", "node": 0, "sidecar_port": 9100, "url": f"http://{a0}:8001"},
            {"name": "s1", "group": "g", "node": a1, "sidecar_port": 9100, "url": f"http://{a1}:8001"},
        ],
    }
    f = tmp_path / "stack.yaml"
    f.write_text(yaml.safe_dump(stack))
    engines = [_in(ns, [sys.executable, "-m", "tests.support.fake_engine_process", "8001", "0", a]) for ns, a in two_nodes]
    logs = [open(tmp_path / f"up-{i}.log", "w") for i in range(2)]  # noqa: SIM115
    ups = [
        _in(ns, [*CLI, "up", "-f", str(f), "--node", str(i), "--no-live"], stdout=logs[i], stderr=subprocess.STDOUT)
        for i, (ns, _) in enumerate(two_nodes)
    ]
    try:
        _wait(
            lambda: (
                (_node_phase(workdir, a0) == "running" and _node_phase(workdir, a1) == "running")
                or any(u.poll() is not None for u in ups)
            ),
            150,
            "both nodes running",
        )
        assert all(u.poll() is None for u in ups), [(tmp_path / f"up-{i}.log").read_text()[-2000:] for i in range(2)]
        assert oct((workdir / "control-token").stat().st_mode & 0o777) == "0o600"
        inv = yaml.safe_load((workdir / "nodes" / a0 / "inventory.yaml").read_text())
        assert {s["job_id"]: s["sidecar"] for s in inv["groups"][0]["samplers"]} == {"s0": f"{a0}:9100", "s1": f"{a1}:9100"}
        st = _run_in(ns1, [*CLI, "status", "-f", str(f)])
        assert f"node {a0} (head): running" in st.stdout and f"node {a1}: running" in st.stdout, st.stdout + st.stderr
        # completions through the head's router (from inside the head's namespace)
        client = (
            "import httpx,sys; ok=0\n"
            "for i in range(4):\n"
            f"    r=httpx.post('http://{a0}:8080/v1/completions',\n"
            "        json={'model': 'fake', 'prompt': 'hi', 'max_tokens': 2}, timeout=5)\n"
            "    ok+=r.status_code==200\n"
            "print(ok)"
        )
        served = _run_in(ns0, [sys.executable, "-c", client], timeout=90)
        down = _run_in(ns1, [*CLI, "down", "-f", str(f)], timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        for u in ups:
            assert u.wait(60) == 0
        for e in engines:
            e.kill()
            e.wait(10)
        for ns, _ in two_nodes:  # nothing of the stack is left in either namespace
            left = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout.split()
            assert left == [], (ns, [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left if Path(f"/proc/{p}").exists()])
        assert served.stdout.strip() == "4", served.stdout + served.stderr[-1500:]
    finally:
        for p in [*ups, *engines]:
            if p.poll() is None:
                p.kill()
        for lg in logs:
            lg.close()


def _completions(ns: str, router: str, n: int, timeout_s: float = 5) -> int:
    """How many of ``n`` completions through ``router`` (sent from inside ``ns``) answered 200."""
    client = (
        "import httpx; ok=0\n"
        f"for i in range({n}):\n"
        "    try:\n"
        f"        r=httpx.post('{router}/v1/completions', json={{'model': 'fake', 'prompt': 'hi', 'max_tokens': 2}},\n"
        f"                     timeout={timeout_s})\n"
        "        ok+=r.status_code==200\n"
        "    except httpx.HTTPError:\n"
        "        pass\n"
        "print(ok)"
    )
    r = _run_in(ns, [sys.executable, "-c", client], timeout=n * timeout_s + 30)
    return int(r.stdout.strip() or 0)


STALE_AFTER_S = 3.0
"""The frozen-node test's ``stack.node_stale_after_s``: 2 s above the state refresh (every second), a margin for a
loaded machine (the head's record, refreshed meanwhile, must not read stale)."""


def test_a_frozen_node_shows_unreachable_and_is_back_in_service_once_continued(tmp_path, two_nodes):
    (ns0, a0), (ns1, a1) = two_nodes
    workdir = tmp_path / "wd"
    stack = {
        "stack": {
            "name": "two",
            "workdir": str(workdir),
            "max_hold_s": 20,
            "nodes": [a0, a1],
            "node_stale_after_s": STALE_AFTER_S,
        },
        "groups": [{"group_id": "g", "drain_timeout_s": 5}],
        "engines": [
            {"name": "s0", "group": "g", "node": 0, "sidecar_port": 9100, "url": f"http://{a0}:8001"},
            {"name": "s1", "group": "g", "node": 1, "sidecar_port": 9100, "url": f"http://{a1}:8001"},
        ],
    }
    f = tmp_path / "stack.yaml"
    f.write_text(yaml.safe_dump(stack))
    engines = [_in(ns, [sys.executable, "-m", "tests.support.fake_engine_process", "8001", "0", a]) for ns, a in two_nodes]
    logs = [open(tmp_path / f"up-{i}.log", "w") for i in range(2)]  # noqa: SIM115
    ups = [
        _in(ns, [*CLI, "up", "-f", str(f), "--node", str(i), "--no-live"], stdout=logs[i], stderr=subprocess.STDOUT)
        for i, (ns, _) in enumerate(two_nodes)
    ]
    router = f"http://{a0}:8080"
    frozen: list[str] = []
    try:
        _wait(
            lambda: (
                (_node_phase(workdir, a0) == "running" and _node_phase(workdir, a1) == "running")
                or any(u.poll() is not None for u in ups)
            ),
            150,
            "both nodes running",
        )
        assert _completions(ns0, router, 2) == 2
        frozen = subprocess.run(["ip", "netns", "pids", ns1], capture_output=True, text=True, check=True).stdout.split()
        for pid in frozen:  # every process of the engine node stops, as a node that hangs
            os.kill(int(pid), 19)  # SIGSTOP
        # until its record is older than the bound the other nodes judge it by (stack.node_stale_after_s, which the
        # node wrote into its record; the default is 10 s)
        assert json.loads((workdir / "nodes" / a1 / "stack.json").read_text())["stale_after_s"] == STALE_AFTER_S
        _wait(lambda: time.time() - _node_updated(workdir, a1) > STALE_AFTER_S + 0.3, 30, "the frozen node's record stale")
        st = _run_in(ns0, [*CLI, "status", "-f", str(f)])
        assert f"node {a1}: unreachable" in st.stdout and f"node {a0} (head): running" in st.stdout, st.stdout
        for pid in frozen:
            os.kill(int(pid), 18)  # SIGCONT
        frozen = []
        _wait(lambda: _node_phase(workdir, a1) == "running" and _run_in(ns0, [*CLI, "status", "-f", str(f)]).returncode == 0,
              30, "the engine node back in status")  # fmt: skip
        engines[0].kill()  # only the engine node can serve now
        engines[0].wait(10)
        deadline = time.monotonic() + 60
        while _completions(ns0, router, 1) != 1:
            assert time.monotonic() < deadline, "the engine node did not serve again after it was continued"
            time.sleep(0.2)
        assert _run_in(ns1, [*CLI, "down", "-f", str(f)], timeout=120).returncode == 0
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 18)
        for p in [*ups, *engines]:
            if p.poll() is None:
                p.kill()
        for lg in logs:
            lg.close()
