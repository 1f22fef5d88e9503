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
from tests.support.squatter import bind_when_free
from tests.support.waits import until as _until


async def test_dead_child_is_restarted_with_backoff_and_stop_leaves_nothing(tmp_path):
    port = port_for.select_random()
    web = ChildSpec(
        "web",
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        tmp_path / "web.log",
        port,
        probe=http_probe(f"http://127.0.0.1:{port}/"),
        stop_grace_s=2,
    )
    pidfile = tmp_path / "grandchild.pid"
    family = ChildSpec("family", ["sh", "-c", f"sleep 1000 & echo $! > {pidfile}; wait"], tmp_path / "family.log", stop_grace_s=2)
    events: list[tuple[str, str]] = []
    sup = Supervisor([[web], [family]], on_event=lambda n, m: events.append((n, m)), backoff_s=0.1)
    await sup.start()
    try:
        first = sup.child("web").pid
        os.kill(first, signal.SIGKILL)
        await _until(lambda: sup.child("web").restarts == 1 and sup.child("web").state == "ready")
        assert sup.child("web").pid != first
        assert sup.child("web").last_exit == "signal SIGKILL"
        assert any(n == "web" and "restarting in 0.1 s" in m for n, m in events)
        os.kill(sup.child("web").pid, signal.SIGKILL)  # dies again at once: the delay doubles
        await _until(lambda: sup.child("web").restarts == 2 and sup.child("web").state == "ready")
        assert any(n == "web" and "restarting in 0.2 s" in m for n, m in events)
        await _until(pidfile.exists)
        grandchild = int(pidfile.read_text())
        assert alive(grandchild)
    finally:
        await sup.stop()
    pids = [c.proc.pid for c in sup.children]
    assert not [p for p in pids if alive(p)], "no child is left"
    # the grandchild got its group's SIGKILL; on a loaded machine it may take a moment to be scheduled and exit
    await _until(lambda: not alive(grandchild), 5, "the grandchild gone")
    assert {c.state for c in sup.children} == {"stopped"}


async def test_child_that_cannot_start_fails_the_start_with_its_log_and_stops_the_others(tmp_path):
    port = port_for.select_random()
    ok = ChildSpec(
        "ok",
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        tmp_path / "ok.log",
        port,
        probe=http_probe(f"http://127.0.0.1:{port}/"),
    )
    bad = ChildSpec("bad", [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"], tmp_path / "bad.log")
    sup = Supervisor([[ok], [bad]])
    with pytest.raises(StartFailed, match=r"(?s)bad exited with code 3 while starting.*no model here"):
        await sup.start()
    assert not alive(sup.child("ok").proc.pid)


async def test_child_not_ready_in_time_fails_the_start(tmp_path):
    never = ChildSpec(
        "never",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        tmp_path / "never.log",
        probe=lambda: asyncio.sleep(0, result=False),
        start_timeout_s=0.5,
    )
    sup = Supervisor([[never]])
    with pytest.raises(StartFailed, match=r"never was not ready within 0\.5 s"):
        await sup.start()
    assert not alive(sup.child("never").proc.pid)


async def test_a_child_that_exits_while_its_probe_hangs_fails_the_start_at_its_exit(tmp_path):
    """A probe that never returns (e.g. one connected to another process's socket on the child's port, which accepts
    and never answers) does not hold the exit's report back: the child's exit ends the probe in flight (cancelled)
    and the start fails naming the exit code and the log. Before, the start waited for the probe's own timeout."""
    probes: list[str] = []

    async def hangs() -> bool:
        probes.append("started")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            probes.append("cancelled")
            raise
        return True

    dies = ChildSpec(
        "dies",
        [sys.executable, "-c", "import sys, time; time.sleep(0.3); print('bind failed'); sys.exit(1)"],
        tmp_path / "dies.log",
        probe=hangs,
        start_timeout_s=300,
    )
    sup = Supervisor([[dies]])
    with pytest.raises(StartFailed, match=r"(?s)dies exited with code 1 while starting.*bind failed"):
        await sup.start()
    assert probes == ["started", "cancelled"], "one probe, ended by the exit"


def _http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


async def _foreign_listener(port: int) -> asyncio.subprocess.Process:
    """Another user's server on ``port`` (not a child of the supervisor), answering once it listens."""
    proc = await asyncio.create_subprocess_exec(
        *_http_server(port), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    probe = http_probe(f"http://127.0.0.1:{port}/")
    for _ in range(200):
        try:
            if await probe():
                return proc
        except Exception:
            await asyncio.sleep(0.05)
    raise AssertionError("the foreign server did not start")


async def test_readiness_on_a_port_another_process_holds_fails_naming_the_holder_not_ready(tmp_path):
    """The probe answers, but from another process's server: the child (which never binds) is not ready; the start
    fails at once, for good, naming the port and the process that holds it."""
    port = port_for.select_random()
    other = await _foreign_listener(port)
    try:
        child = ChildSpec(
            "gate",
            [sys.executable, "-c", "import time; time.sleep(60)"],
            tmp_path / "gate.log",
            port,
            probe=http_probe(f"http://127.0.0.1:{port}/"),
            start_timeout_s=30,
            listen=(port,),
        )
        sup = Supervisor([[child]])
        t = asyncio.get_running_loop().time()
        with pytest.raises(StartFailed, match=rf"gate: port {port} is held by pid {other.pid} \(.*http\.server") as ei:
            await sup.start()
        assert ei.value.permanent and asyncio.get_running_loop().time() - t < 10
        assert sup.child("gate").state != "ready"
        assert not alive(sup.child("gate").proc.pid)
    finally:
        other.kill()
        await other.wait()


@pytest.mark.parametrize("case", ["port_taken_meanwhile", "usage_error"])
async def test_restart_that_cannot_succeed_is_given_up_not_retried_forever(tmp_path, case):
    """A ready child dies; its restart fails for a reason a restart cannot fix (another process took its port
    meanwhile / it exits with a usage error, code 2): it is marked failed, on_fatal is called once with the reason
    and the log's tail, and no further restart is tried."""
    port = port_for.select_random()
    marker = tmp_path / "second-start"
    script = (
        (
            f"if [ -e {marker} ]; then echo 'Error: No such option: --colour' >&2; exit 2; fi; "
            f"touch {marker}; exec {' '.join(_http_server(port))}"
        )
        if case == "usage_error"
        else " ".join(["exec", *_http_server(port)])
    )
    web = ChildSpec(
        "web",
        ["sh", "-c", script],
        tmp_path / "web.log",
        port,
        probe=http_probe(f"http://127.0.0.1:{port}/"),
        stop_grace_s=2,
        listen=(port,),
    )
    fatal: list[StartFailed] = []
    sup = Supervisor([[web]], backoff_s=0.2, on_fatal=fatal.append)
    await sup.start()
    squatter = None
    try:
        os.kill(sup.child("web").pid, signal.SIGKILL)
        if case == "port_taken_meanwhile":
            # Taken by this process before the supervisor's event loop (this test's) runs again, so before its restart
            # (a server process of its own took longer than the 0.2 s back-off to start under load).
            squatter = bind_when_free(port, 10)
        await _until(lambda: bool(fatal), 20)
        assert sup.child("web").state == "failed" and sup.child("web").restarts == 1
        msg = str(fatal[0])
        if case == "port_taken_meanwhile":
            assert f"port {port} is held by pid {os.getpid()}" in msg, msg
        else:
            assert "exited with code 2 while starting (a usage error" in msg and "No such option: --colour" in msg, msg
        await asyncio.sleep(1.0)  # 2.5 times the next back-off (0.4 s): nothing restarts it
        assert sup.child("web").restarts == 1 and len(fatal) == 1
    finally:
        await sup.stop()
        if squatter is not None:
            squatter.close()


async def test_child_that_keeps_failing_to_start_is_given_up_after_max_start_failures(tmp_path):
    port = port_for.select_random()
    marker = tmp_path / "started"
    script = (
        f"if [ -e {marker} ]; then echo 'engine crashed' >&2; exit 1; fi; touch {marker}; exec {' '.join(_http_server(port))}"
    )
    web = ChildSpec(
        "web",
        ["sh", "-c", script],
        tmp_path / "web.log",
        port,
        probe=http_probe(f"http://127.0.0.1:{port}/"),
        stop_grace_s=2,
        listen=(port,),
    )
    fatal: list[StartFailed] = []
    events: list[tuple[str, str]] = []
    sup = Supervisor(
        [[web]],
        backoff_s=0.05,
        max_backoff_s=0.1,
        max_start_failures=3,
        on_fatal=fatal.append,
        on_event=lambda n, m: events.append((n, m)),
    )
    await sup.start()
    try:
        os.kill(sup.child("web").pid, signal.SIGKILL)
        await _until(lambda: bool(fatal), 20)
        assert sup.child("web").restarts == 3 and sup.child("web").state == "failed"
        assert "web failed to start 3 times in a row; giving up" in str(fatal[0]) and "engine crashed" in str(fatal[0])
        assert sum("restart failed" in m for _, m in events) == 2, events
    finally:
        await sup.stop()


async def test_after_exit_runs_once_the_group_is_gone_before_each_restart_and_at_stop(tmp_path):
    """What a child leaves on disk (a vLLM server's private runtime directory) is removed after each of its exits."""
    runtime = tmp_path / "runtime"
    gone: list[bool] = []  # per call: was the child's process already gone?
    procs = []

    def start_env() -> dict[str, str]:
        runtime.mkdir()  # as VllmServer.environment: a new directory per start (it would fail if one were left)
        return dict(os.environ)

    def after_exit() -> None:
        gone.append(procs[-1].returncode is not None)
        runtime.rmdir()

    spec = ChildSpec(
        "sleeper", ["sleep", "1000"], tmp_path / "sleeper.log", env_factory=start_env, after_exit=after_exit, settle_s=0.2
    )
    sup = Supervisor([[spec]], backoff_s=0.2)
    await sup.start()
    procs.append(sup.child("sleeper").proc)
    try:
        os.kill(sup.child("sleeper").pid, signal.SIGKILL)
        await _until(lambda: sup.child("sleeper").restarts == 1 and sup.child("sleeper").state == "ready")
        procs.append(sup.child("sleeper").proc)
        assert gone == [True] and runtime.is_dir(), "cleaned after the exit, made again by the restart"
    finally:
        await sup.stop()
    assert gone == [True, True] and not runtime.exists()


async def test_a_starting_child_is_probed_often_in_its_first_seconds_then_less_often(tmp_path):
    """Each stage of `up` waits for its slowest child's probe: probes every 0.05 s during a child's first 3 s (our
    components are ready within a second or two), then every 0.2 s (a vLLM loading for minutes is not probed 20
    times a second). A child whose probe answers on its third call is ready after three probes."""
    from llmd_timeslice.local.supervisor import PROBE_EVERY_S, PROBE_FAST_EVERY_S, probe_interval

    assert probe_interval(0.0) == probe_interval(2.9) == PROBE_FAST_EVERY_S == 0.05
    assert probe_interval(3.0) == probe_interval(600.0) == PROBE_EVERY_S == 0.2
    calls = 0

    async def third_time() -> bool:
        nonlocal calls
        calls += 1
        return calls >= 3

    sup = Supervisor(
        [[ChildSpec("c", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "c.log", probe=third_time)]]
    )
    try:
        await sup.start()
        assert sup.child("c").state == "ready" and calls == 3
    finally:
        await sup.stop()
