"""Shared fixtures: real servers on free loopback ports, logs kept under test-artifacts/."""

from __future__ import annotations

import asyncio
import os
import resource
import threading
from pathlib import Path

import port_for
import pytest

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before any grpc import (see llmd_timeslice/__init__.py)

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def _raise_open_file_limit() -> None:
    """Thousands of held requests are thousands of sockets (client, Envoy): lift the soft limit (1024 here)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


_raise_open_file_limit()


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
