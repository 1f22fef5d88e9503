"""`llmd-timeslice ARGS` for tests: through its console entry point in the test's process, for commands that exit
at once (:func:`run_cli`), or as a child process that serves on a port (:class:`CliProcess`).

A Python start with the CLI's imports is ~0.5 s of CPU here, and several seconds of wall time on 2 loaded cores;
the commands that only check their input and exit (usage errors, `config check`, bad stack files) run
``llmd_timeslice.cli:main`` (what the `llmd-timeslice` script calls) here instead. Tests that start a server keep
a real process, and tests/test_cli.py runs the installed entry point as a process once.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO
from unittest import mock


class _ThisThread(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` for one call: this thread's writes go to ``buf``, other threads' (servers a
    test left running in this process) to the stream that was there."""

    def __init__(self, buf: io.StringIO, other) -> None:
        self._buf, self._other, self._thread = buf, other, threading.current_thread()

    def _target(self):
        return self._buf if threading.current_thread() is self._thread else self._other

    def write(self, s: str) -> int:
        return self._target().write(s)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return False  # a pipe, as for a child process


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``llmd-timeslice ARGS``; returns its exit code, stdout and stderr as :func:`subprocess.run` would.

    The process's ``LLMD_TIMESLICE_*`` variables are hidden and ``env`` is added, for the call only. A command that
    would serve (reach the CLI's event-loop runner) raises AssertionError instead of blocking the test.
    """
    import epp_plugin.commands as router_side_commands
    import llmd_timeslice.cli as cli

    def refuse(*_a, **_k):
        raise AssertionError(f"`llmd-timeslice {' '.join(args)}` started serving instead of exiting")

    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ))
        for k in [k for k in os.environ if k.startswith("LLMD_TIMESLICE_")]:
            del os.environ[k]
        os.environ.update(env or {})
        stack.enter_context(mock.patch.object(sys, "argv", ["llmd-timeslice", *args]))
        for module, runner in (
            (cli, "run_until_signal"),
            (router_side_commands, "run_until_signal"),
            (router_side_commands, "run_on_uvloop"),
        ):
            stack.enter_context(mock.patch.object(module, runner, refuse))
        stack.enter_context(contextlib.redirect_stdout(_ThisThread(out, sys.stdout)))
        stack.enter_context(contextlib.redirect_stderr(_ThisThread(err, sys.stderr)))
        try:
            cli.main()
        except SystemExit as exc:
            code = exc.code
    if isinstance(code, str):  # SystemExit("message"): Python prints it and exits 1
        err.write(code + "\n")
        code = 1
    return subprocess.CompletedProcess(["llmd-timeslice", *args], code or 0, out.getvalue(), err.getvalue())


class CliProcess:
    """``python -m llmd_timeslice.cli ARGS`` as a child process, ready once it accepts connections on ``port``;
    its output goes to ``log`` (appended across restarts); ``env`` is added to this process's environment.
    ``start`` may be called again after ``kill``/``stop``."""

    def __init__(self, args: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> None:
        self.args = [sys.executable, "-m", "llmd_timeslice.cli", *args]
        self.env = {**os.environ, **env} if env else None
        self.port, self.log_path = port, log
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    async def start(self, timeout_s: float = 60.0) -> None:
        """Start the process and wait until it listens (a Python start: ~1-2 s, more on a loaded 2-core machine).
        Raises RuntimeError (naming the log) if it exits or does not listen within ``timeout_s``."""
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.proc.poll() is None and loop.time() < deadline:
            try:
                _, w = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            w.close()
            return
        code = self.proc.poll()
        self.stop()
        raise RuntimeError(
            f"{self.args[3]} did not listen on {self.port} within {timeout_s:g} s (exit code {code}); see {self.log_path}"
        )

    def kill(self) -> None:
        """SIGKILL, nothing flushed."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._close_log()

    def stop(self) -> None:
        """SIGTERM; SIGKILL (and TimeoutExpired raised) if it is still running 10 s later."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                    raise
        finally:
            self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
