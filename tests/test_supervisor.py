"""The supervisor of ``llmd-timeslice up`` with plain child processes: readiness, restart with back-off,
a child that cannot start, and stop leaving no process (grandchildren included)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import port_for
import pytest

from llmd_timeslice.local.supervisor import ChildSpec, StartFailed, Supervisor
from llmd_timeslice.local.up import alive, http_probe


async def _until(pred, timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_dead_child_is_restarted_with_backoff_and_stop_leaves_nothing(tmp_path):
    port = port_for.select_random()
    web = ChildSpec("web", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], tmp_path / "web.log",
                    port, probe=http_probe(f"http://127.0.0.1:{port}/"), stop_grace_s=2)
    pidfile = tmp_path / "grandchild.pid"
    family = ChildSpec("family", ["sh", "-c", f"sleep 1000 & echo $! > {pidfile}; wait"], tmp_path / "family.log",
                       stop_grace_s=2)
    events: list[tuple[str, str]] = []
    sup = Supervisor([[web], [family]], on_event=lambda n, m: events.append((n, m)))
    await sup.start()
    try:
        first = sup.child("web").pid
        os.kill(first, signal.SIGKILL)
        await _until(lambda: sup.child("web").restarts == 1 and sup.child("web").state == "ready")
        assert sup.child("web").pid != first
        assert sup.child("web").last_exit == "signal SIGKILL"
        assert any(n == "web" and "restarting in 1 s" in m for n, m in events)
        os.kill(sup.child("web").pid, signal.SIGKILL)  # dies again at once: the delay doubles
        await _until(lambda: sup.child("web").restarts == 2 and sup.child("web").state == "ready")
        assert any(n == "web" and "restarting in 2 s" in m for n, m in events)
        await _until(pidfile.exists)
        grandchild = int(pidfile.read_text())
        assert alive(grandchild)
    finally:
        await sup.stop()
    pids = [c.proc.pid for c in sup.children]
    assert not [p for p in [*pids, grandchild] if alive(p)], "no child nor grandchild is left"
    assert {c.state for c in sup.children} == {"stopped"}


async def test_child_that_cannot_start_fails_the_start_with_its_log_and_stops_the_others(tmp_path):
    port = port_for.select_random()
    ok = ChildSpec("ok", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], tmp_path / "ok.log",
                   port, probe=http_probe(f"http://127.0.0.1:{port}/"))
    bad = ChildSpec("bad", [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"], tmp_path / "bad.log")
    sup = Supervisor([[ok], [bad]])
    with pytest.raises(StartFailed, match=r"(?s)bad exited with code 3 while starting.*no model here"):
        await sup.start()
    assert not alive(sup.child("ok").proc.pid)


async def test_child_not_ready_in_time_fails_the_start(tmp_path):
    never = ChildSpec("never", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "never.log",
                      probe=lambda: asyncio.sleep(0, result=False), start_timeout_s=0.5)
    sup = Supervisor([[never]])
    with pytest.raises(StartFailed, match=r"never was not ready within 0\.5 s"):
        await sup.start()
    assert not alive(sup.child("never").proc.pid)
