"""Shared fixtures: real servers on free loopback ports, logs kept under test-artifacts/.

Also here: the session's real vLLM server (``vllm_server``, see tests/support/vllm.py) and the order and xdist
groups of the tests using it, and the check that every gRPC server a test starts is stopped by that test.
"""

from __future__ import annotations

import asyncio
import os
import resource
import threading
from pathlib import Path

import port_for
import pytest

from tests.support.artifacts import ARTIFACTS

# Helper modules whose own assertions check what the tests prove (the manifest helpers, the group machine's harness and
# scenarios): pytest rewrites them like test files, so a failing assert there reports its values (before any import).
pytest.register_assert_rewrite(
    "tests.manifests.support",
    "tests.orchestrator.group_machine_support",
    "tests.orchestrator.group_edges",
    "tests.orchestrator.group_fault_edges",
    "tests.orchestrator.group_yield_edges",
)

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before any grpc import (see llmd_timeslice/__init__.py)
# One OpenMP thread per test process (torch, and every child process: trainers, offload checks): 4 pytest workers
# on 2 cores plus their children already use every core, and torch's own pool of one thread per core spins while it
# waits (measured: the fifty-cycle offload check, 10.2 s of CPU idle, 8.1 s with one thread; under the full run's load
# it took 24 s). vLLM servers set their own (llmd_timeslice/engines/vllm_server.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _raise_open_file_limit() -> None:
    """Thousands of held requests are thousands of sockets (client, Envoy): lift the soft limit (1024 here)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


_raise_open_file_limit()


def _ports_of_this_worker() -> None:
    """Give each xdist worker its own share of port_for's free ports (port modulo the worker count).

    Many tests choose ports ahead of binding them (stack files, Envoy configs, a vLLM server binds its port about
    20 s after it is chosen), and port_for checks only that a port is free *now*: in a parallel run, another worker's
    test chose and bound a port of the `up` test's stack in that window (seen once: "port ... is in use by pid ...
    [pytest-xdist running] ..."). Disjoint shares make that impossible between workers. The shares stay below the
    kernel's ephemeral range (port_for's list does), so client sockets cannot take them either.
    """
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    # LLMD_TEST_PORT_SHARE=I/N: this run is run I of N at once on one machine (e.g. checkouts side by side):
    # it takes share I of N, split again between its xdist workers.
    run_index, runs = 0, 1
    outer = os.environ.get("LLMD_TEST_PORT_SHARE", "")
    if outer:
        i, _, n_runs = outer.partition("/")
        if not (i.isdigit() and n_runs.isdigit() and int(i) < int(n_runs)):
            raise pytest.UsageError(f"LLMD_TEST_PORT_SHARE={outer!r}: expected I/N with 0 <= I < N, e.g. 1/4")
        run_index, runs = int(i), int(n_runs)
    if worker.startswith("gw") and count.isdigit():
        index, n = run_index * int(count) + int(worker[2:]), runs * int(count)
    elif runs > 1:
        index, n = run_index, runs
    else:
        return
    import port_for.api

    all_good = port_for.api.available_good_ports

    def share(*args, **kwargs) -> set[int]:
        return {p for p in all_good(*args, **kwargs) if p % n == index}

    port_for.api.available_good_ports = share  # select_random looks it up at each call


_ports_of_this_worker()


@pytest.fixture(scope="session", autouse=True)
def _grpc_aio_stays_initialised():
    """Keep one grpc.aio channel for the whole run. grpc.aio shuts its poller down (and joins the poller thread)
    when the last aio channel or server of the process is garbage-collected; in full runs that happened inside
    whatever test triggered the collection and blocked it for 300 s (py-spy: ``Thread.join`` under an unrelated
    frame) until pytest-timeout's alarm woke the poll. Components are long-lived processes with one loop and do not
    hit this; the test run creates and drops hundreds of loops. See ``pytest_unconfigure`` for the end of the run.

    The channel is held at module level, not by the fixture: session fixtures are torn down before pytest's terminal
    summary, and a garbage collection there (hypothesis's plugin imports hypothesis in its summary hook when no test
    did) shut aio down and hung the run before the "N passed" line (py-spy: ``Thread.join`` under ``ast.parse``)."""
    import grpc

    if not _AIO_KEPT_ALIVE:
        _AIO_KEPT_ALIVE.append(grpc.aio.insecure_channel("127.0.0.1:9"))
    yield


_AIO_KEPT_ALIVE: list = []  # until os._exit in pytest_unconfigure


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config) -> None:
    """End the process once pytest has reported: the final garbage collection would shut grpc.aio down and join
    its poller thread, which can block for good on a completion queue that still has an operation of some
    long-gone test loop (seen in CI as a hang after "N passed"). Every report has been written by now."""
    if _EXIT_STATUS and os.environ.get("LLMD_TIMESLICE_TESTS_NORMAL_EXIT") != "1":
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])


# ---------------------------------------------------------------------------------------------- the shared vLLM
def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "kills_vllm: kills the session's shared vLLM server (runs after every other test that uses it)"
    )
    config.addinivalue_line(
        "markers",
        f"torch: imports torch in the test process (these run in one xdist worker, group {TORCH_GROUP!r}: importing "
        "torch and the torch._dynamo that the first optimizer pulls in is ~6 s of CPU per process)",
    )


TORCH_GROUP = "torch"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns xdist_group marks into node ids
def pytest_collection_modifyitems(config, items) -> None:
    """Tests using the session's vLLM server (``vllm_server``) run in one xdist worker, first, in collection order,
    the ones that kill it last; then the other tests that start vLLM (they take longest: starting them early keeps
    the end of a parallel run short); then the tests marked ``torch``, in one worker of their own (torch is imported
    once, not in every worker: measured, every one of 4 workers imported it when they were spread); then the rest."""
    from tests.support.vllm import SHARED_GROUP

    shared, killing, other_vllm, with_torch, rest = [], [], [], [], []
    for item in items:
        if "vllm_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(SHARED_GROUP))
            (killing if item.get_closest_marker("kills_vllm") else shared).append(item)
        elif item.get_closest_marker("vllm"):
            other_vllm.append(item)
        elif item.get_closest_marker("torch"):
            item.add_marker(pytest.mark.xdist_group(TORCH_GROUP))
            with_torch.append(item)
        else:
            rest.append(item)
    items[:] = shared + killing + other_vllm + with_torch + rest


def pytest_collection_finish(session) -> None:
    """Freeze what collection built (see below). In an xdist worker under ``--dist loadgroup``: refuse to run if
    xdist lost the groups (it then spreads the vLLM tests over every worker, each starting its own server: seen with
    pytest 9.2, pytest-dev/pytest-xdist#1386)."""
    _freeze_collected_objects()
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        import sys

        why = (
            f"--dist loadgroup ignored the xdist_group mark of {len(lost)} tests (e.g. {lost[0]}): pytest-xdist "
            "does not support this pytest (pytest-dev/pytest-xdist#1386); see the pytest pin in pyproject.toml"
        )
        print(f"\nERROR: {why}", file=sys.__stderr__, flush=True)  # an xdist worker's own errors show as a crash
        raise pytest.UsageError(why)


def _freeze_collected_objects() -> None:
    """Move every object alive after collection (modules, test functions, fixtures: they live to the end of the run)
    out of the garbage collector's reach (``gc.freeze``), so that its full collections stop walking them again.
    Measured in a full run: 49 full collections of ~0.35 s each across the 4 workers, 16.5 s of their CPU."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def _shared_vllm():
    from tests.support.vllm import SharedVllm

    shared = SharedVllm()
    yield shared
    shared.stop()


@pytest.fixture(scope="session")
def vllm_server(_shared_vllm):
    """The session's real vLLM server (a started ``VllmServer``; ``model_name``, ``model_dir``, ``url``, ``pid``):
    started on first use, shared by every test that does not need an engine of its own."""
    return _shared_vllm.get()


@pytest.fixture(autouse=True)
def _vllm_server_usable(request):
    """Before each test using ``vllm_server``: running (started again after a test killed it) and awake."""
    if "vllm_server" in request.fixturenames:
        request.getfixturevalue("_shared_vllm").make_usable()


# ------------------------------------------------------------------------ no gRPC server left to the collector
_GRPC_SERVERS: list[dict] = []


def _track_grpc_aio_servers() -> None:
    """Wrap ``grpc.aio.server`` (how every server of the project is made) to record each server with its event loop
    and whether its ``start()`` and ``stop()`` ran. A server still serving when its loop has stopped was left to
    ``__del__``, which schedules its shutdown on that dead loop ("Event loop is closed", "coroutine
    'AioServer.shutdown' was never awaited") in whatever later test the garbage collector runs."""
    from grpc import aio

    make = aio.server
    if getattr(make, "_llmd_tracked", False):
        return

    def server(*args, **kwargs):
        srv = make(*args, **kwargs)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return srv
        rec = {
            "test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0],
            "loop": loop,
            "started": False,
            "stopped": False,
        }
        start, stop = srv.start, srv.stop

        async def tracked_start():
            await start()
            rec["started"] = True

        async def tracked_stop(grace):
            rec["stopped"] = True
            return await stop(grace)

        srv.start, srv.stop = tracked_start, tracked_stop
        _GRPC_SERVERS.append(rec)
        return srv

    server._llmd_tracked = True
    aio.server = server


_track_grpc_aio_servers()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """Before each test: SIGINT back to Python's default handler if an asyncio runner left its own behind.

    ``asyncio.Runner`` installs ``partial(Runner._on_sigint, main_task=...)`` only while the handler is the default,
    and restores it only if it is still its own. Seen in a full run on a loaded machine: after an Envoy of one test
    could not bind its port, a runner's handler stayed installed; every later ``asyncio.run`` in that worker then
    read it through ``signal.getsignal``, whose enum conversion formats ``repr(handler)``: the repr of a finished
    task holding that test's exception, which overflowed the recursion limit, so each later test of the worker
    failed with RecursionError. ``_signal`` reads the raw handler without that conversion."""
    import _signal
    import functools
    import signal

    handler = _signal.getsignal(signal.SIGINT)
    if isinstance(handler, functools.partial) and isinstance(getattr(handler.func, "__self__", None), asyncio.Runner):
        _signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test and its fixtures are torn down: every gRPC server whose event loop has ended was stopped."""
    result = yield
    left = []
    for rec in list(_GRPC_SERVERS):
        if rec["loop"].is_running():
            continue  # a module or session fixture's loop: checked when it ends
        _GRPC_SERVERS.remove(rec)
        if rec["started"] and not rec["stopped"]:
            left.append(rec["test"])
    if left:
        raise AssertionError(
            f"{len(left)} gRPC server(s) started in {sorted(set(left))} were never stopped "
            "(await server.stop() before the test's event loop ends)"
        )
    return result


def free_port() -> int:
    return port_for.select_random()


@pytest.fixture
def artifacts(request) -> Path:
    d = ARTIFACTS / request.node.name.replace("/", "_")[:80]
    d.mkdir(parents=True, exist_ok=True)
    return d


class LoopThread:
    """An asyncio loop in a background thread, for running the project's aio servers from sync tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._t = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._t.start()

    def run(self, coro, timeout: float | None = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._t.join(5)


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()
